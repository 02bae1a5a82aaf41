// The console's only script of its own (the page works without it).

// A "select all" checkbox ticks every checkbox of the name it names.
document.addEventListener("change", function (e) {
  var name = e.target.getAttribute && e.target.getAttribute("data-select-all");
  if (!name) return;
  var form = e.target.closest("form") || document;
  form.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (box) {
    box.checked = e.target.checked;
  });
});

// On a narrow screen a wide table scrolls sideways inside the page (the
// stylesheet); one that does can be scrolled from the keyboard too.
function focusableScrolls() {
  document.querySelectorAll("main table").forEach(function (t) {
    if (t.scrollWidth > t.clientWidth) {
      t.setAttribute("tabindex", "0");
    } else {
      t.removeAttribute("tabindex");
    }
  });
}
document.addEventListener("DOMContentLoaded", focusableScrolls);
window.addEventListener("resize", focusableScrolls);
document.addEventListener("htmx:afterSwap", focusableScrolls);

// Auto-refresh keeps keyboard focus: htmx restores focus only to an
// element with an id, and the overview's links and buttons have none, so
// a keyboard user tabbing through a refreshing page was thrown back to the
// top every five seconds. Before a swap, remember what had focus (its
// link, its form's action and value, its text, and its place among the
// focusable elements); after it, focus the same control in the new content.
var focusables = "a[href],button,input,select,textarea,[tabindex]";
var focusMemo = null;
function focusKey(el) {
  return [el.tagName, el.getAttribute("href") || "", el.getAttribute("name") || "", el.getAttribute("value") || "",
    (el.form && el.form.getAttribute("action")) || "", (el.textContent || "").trim()].join("\u0000");
}
document.addEventListener("htmx:beforeSwap", function (e) {
  focusMemo = null;
  var target = e.detail.target, active = document.activeElement;
  if (!target || !active || active === document.body || !target.contains(active) || active.id) return;
  focusMemo = {target: target.id, key: focusKey(active), index: Array.prototype.indexOf.call(target.querySelectorAll(focusables), active)};
});
document.addEventListener("htmx:afterSettle", function (e) {
  if (!focusMemo) return;
  var memo = focusMemo;
  focusMemo = null;
  var target = document.getElementById(memo.target) || e.detail.target;
  if (!target || (document.activeElement && document.activeElement !== document.body && target.contains(document.activeElement))) return;
  var all = target.querySelectorAll(focusables), match = null;
  for (var i = 0; i < all.length && !match; i++) {
    if (focusKey(all[i]) === memo.key) match = all[i];
  }
  if (!match && memo.index >= 0 && memo.index < all.length) match = all[memo.index];
  if (match) match.focus({preventScroll: true});
});
