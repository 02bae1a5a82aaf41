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
