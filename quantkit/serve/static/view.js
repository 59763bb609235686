// quantkit playground: DOM helpers and the answer columns. Loaded before app.js; exposes window.quantkitView.
//
// Safety rule: model output reaches the DOM only through textContent (or title), never innerHTML, so
// generated text such as "<script>" is shown as text and never parsed as markup.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }

  // One span per generated token; accepted draft tokens get their own class (and colour).
  function renderTokens(container, tokens) {
    const spans = [];
    for (const t of tokens) {
      const s = document.createElement("span");
      s.className = t.drafted ? "tok drafted" : "tok";
      s.textContent = t.text == null ? "" : String(t.text);
      const bits = [];
      if (typeof t.logprob === "number") bits.push("logprob " + t.logprob.toFixed(3));
      if (t.drafted) bits.push("accepted draft");
      s.title = bits.join(" · ");
      container.appendChild(s);
      spans.push(s);
    }
    return spans;
  }

  function setStatus(kind, text) {
    const s = $("status");
    s.dataset.state = kind;
    s.textContent = text;
  }

  function fmt(v, digits, unit) {
    return v == null || !isFinite(v) ? "–" : v.toFixed(digits) + (unit || "");
  }

  // ---- columns -----------------------------------------------------------------------------------------
  function makeColumn(key, name, prefix) {
    const node = $("column-template").content.firstElementChild.cloneNode(true);
    node.dataset.col = key;
    node.querySelector(".name").textContent = key === "base" ? name + " (base)" : name;
    $("columns").appendChild(node);
    return { key, name, prefix, node, transcript: node.querySelector(".transcript"), history: [], run: null };
  }

  function counter(col, k, text) {
    col.node.querySelector(`[data-k="${k}"]`).textContent = text;
  }

  function note(col, text) {
    col.node.querySelector(".note").textContent = text;
  }

  function resetCounters(col) {
    for (const k of ["tps", "ttft", "accept", "meanlen", "kl"]) counter(col, k, "–");
    counter(col, "ntok", "0");
    note(col, "");
  }

  // ---- settings ----------------------------------------------------------------------------------------
  function mode() {
    return $("mode-completion").checked ? "completion" : "chat";
  }

  function sampling() {
    const num = (id, name) => {
      const v = Number($(id).value);
      if ($(id).value.trim() === "" || !isFinite(v)) throw new Error(`${name} must be a number`);
      return v;
    };
    const out = {
      temperature: num("temperature", "temperature"),
      top_p: num("top_p", "top-p"),
      max_tokens: Math.trunc(num("max_tokens", "max tokens")),
    };
    if ($("seed").value.trim() !== "") out.seed = Math.trunc(num("seed", "seed"));
    return out;
  }

  window.quantkitView = { $, el, renderTokens, setStatus, fmt, makeColumn, counter, note, resetCounters,
    mode, sampling };
})();
