/* gradalg: render the math of a page with the vendored KaTeX (no network).
 * Docs pages: pymdownx.arithmatex (generic mode) wraps each formula in an element of class
 * "arithmatex" holding \( ... \) or \[ ... \]. Notebook pages (mkdocs-jupyter) and the
 * report (gradalg.report) keep $ ... $ and $$ ... $$ inside elements of class
 * "jupyter-wrapper" or "gradalg-math". Code (pre, code) is never touched. */
(function () {
  "use strict";
  var TEX = [
    {left: "$$", right: "$$", display: true},
    {left: "\\[", right: "\\]", display: true},
    {left: "\\(", right: "\\)", display: false},
    {left: "$", right: "$", display: false}
  ];
  var BRACKETS = TEX.slice(1, 3);

  function render() {
    if (typeof renderMathInElement !== "function") { return; }
    document.querySelectorAll(".arithmatex").forEach(function (el) {
      renderMathInElement(el, {delimiters: BRACKETS, throwOnError: false});
    });
    document.querySelectorAll(".jupyter-wrapper, .gradalg-math").forEach(function (el) {
      renderMathInElement(el, {delimiters: TEX, throwOnError: false});
    });
  }

  if (typeof document$ !== "undefined" && document$.subscribe) {
    document$.subscribe(render);          // mkdocs-material (instant navigation too)
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", render);
  } else {
    render();
  }
})();
