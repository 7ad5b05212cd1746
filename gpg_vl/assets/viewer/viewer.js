// gpg-vl viewer: a step selector, filters and box highlighting on a page that works without it too.
// Any script error is written into the page (data-js-error on <html> and a visible line), so that a
// headless browser's DOM dump shows it.
window.onerror = function (message, source, line) {
  var text = String(message) + " (line " + line + ")";
  document.documentElement.setAttribute("data-js-error", text);
  var shown = document.getElementById("js-error");
  if (shown) { shown.textContent = "viewer error: " + text; shown.hidden = false; }
};

(function () {
  var step = document.getElementById("step");
  var filters = Array.prototype.slice.call(document.querySelectorAll("select.filter"));
  var counter = document.getElementById("shown");

  function currentSections() {
    var sections = Array.prototype.slice.call(document.querySelectorAll(step ? "section.step" : "section"));
    if (!step) { return sections; }
    sections.forEach(function (s) { s.hidden = s.getAttribute("data-step") !== step.value; });
    return sections.filter(function (s) { return !s.hidden; });
  }

  function apply() {
    var wanted = filters.map(function (f) { return f.value; }).filter(function (v) { return v !== ""; });
    var shown = 0, total = 0;
    currentSections().forEach(function (section) {
      Array.prototype.forEach.call(section.querySelectorAll(".item"), function (item) {
        var tags = JSON.parse(item.getAttribute("data-tags") || "[]");
        var visible = wanted.every(function (t) { return tags.indexOf(t) >= 0; });
        item.hidden = !visible;
        total += 1;
        shown += visible ? 1 : 0;
      });
    });
    if (counter) { counter.textContent = shown + " of " + total + " shown"; }
    document.documentElement.setAttribute("data-ready", "1");
  }

  function move(by) {
    if (!step) { return; }
    var next = step.selectedIndex + by;
    if (next >= 0 && next < step.options.length) { step.selectedIndex = next; apply(); }
  }

  // page.html#step=3&state=invalid (or #verdict=wrong&group=type%3D2D): choices set from the address
  location.hash.replace(/^#/, "").split("&").forEach(function (pair) {
    var parts = pair.split("="), select = document.getElementById(decodeURIComponent(parts[0]));
    var value = decodeURIComponent(parts.slice(1).join("="));
    if (select && select.tagName === "SELECT" &&
        Array.prototype.some.call(select.options, function (o) { return o.value === value; })) {
      select.value = value;
    }
  });
  if (step) {
    step.addEventListener("change", apply);
    document.getElementById("prev").addEventListener("click", function () { move(-1); });
    document.getElementById("next").addEventListener("click", function () { move(1); });
    document.addEventListener("keydown", function (e) {
      if (e.target.tagName === "SELECT") { return; }
      if (e.key === "ArrowLeft") { move(-1); }
      if (e.key === "ArrowRight") { move(1); }
    });
  }
  filters.forEach(function (f) { f.addEventListener("change", apply); });
  Array.prototype.forEach.call(document.querySelectorAll("button[data-filter-id]"), function (button) {
    button.addEventListener("click", function () {
      var select = document.getElementById(button.getAttribute("data-filter-id"));
      select.value = button.getAttribute("data-filter-value");
      apply();
    });
  });
  Array.prototype.forEach.call(document.querySelectorAll("[data-box]"), function (card) {
    var box = document.getElementById(card.getAttribute("data-box"));
    if (!box) { return; }
    card.addEventListener("mouseenter", function () { box.classList.add("hl"); card.classList.add("hl"); });
    card.addEventListener("mouseleave", function () { box.classList.remove("hl"); card.classList.remove("hl"); });
  });
  apply();
})();
