// The console's only script of its own (the page works without it): a
// "select all" checkbox ticks every checkbox of the name it names.
document.addEventListener("change", function (e) {
  var name = e.target.getAttribute && e.target.getAttribute("data-select-all");
  if (!name) return;
  var form = e.target.closest("form") || document;
  form.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (box) {
    box.checked = e.target.checked;
  });
});
