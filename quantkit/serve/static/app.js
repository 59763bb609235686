// quantkit playground: talks to the server's OpenAI-compatible endpoints and reads the per-token details
// (text, logprob, drafted) each streamed chunk carries in `quantkit_tokens`. No framework, no build step.
//
// Safety rule: model output reaches the DOM only through textContent (or title), never innerHTML, so
// generated text such as "<script>" is shown as text and never parsed as markup.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const state = {
    cfg: null, columns: [], running: false, ctrl: null,
    diverge: null, checked: 0, compareTurn: false,
  };

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

  function activeColumns() {
    return state.columns.filter((c) => c.key === "main" || $("compare").checked);
  }

  function showColumns() {
    const on = $("compare").checked && state.cfg.compare;
    for (const c of state.columns) c.node.hidden = c.key === "base" && !on;
    $("columns").classList.toggle("two", !!on);
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

  // ---- streaming ---------------------------------------------------------------------------------------
  async function* sseData(res) {
    const reader = res.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, at);
        buf = buf.slice(at + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (data) yield data;
      }
    }
  }

  async function errorText(res) {
    try {
      const j = await res.json();
      return (j.error && j.error.message) || res.statusText;
    } catch (_) {
      return `HTTP ${res.status}`;
    }
  }

  function updateCounters(col) {
    const r = col.run;
    const n = r.ids.length;
    counter(col, "ntok", r.drafted ? `${n} (${r.drafted} drafted)` : String(n));
    if (r.tFirst != null) counter(col, "ttft", fmt(r.tFirst - r.t0, 0, " ms"));
    if (n > 1 && r.tLast > r.tFirst) counter(col, "tps", fmt((n - 1) / ((r.tLast - r.tFirst) / 1000), 1));
    const m = r.metrics;
    if (m && m.drafted) counter(col, "accept", fmt(100 * m.accepted / m.drafted, 0, "%"));
    if (m && m.spec_steps) counter(col, "meanlen", fmt((m.accepted + m.spec_steps) / m.spec_steps, 2));
  }

  function finalCounters(col, m) {
    // The server's own figures for the finished request are exact: they know how many tokens were drafted.
    const r = col.run;
    r.metrics = m;
    counter(col, "accept", m.acceptance_rate == null ? "no drafts" : fmt(100 * m.acceptance_rate, 0, "%"));
    counter(col, "meanlen", fmt(m.mean_accepted_length, 2));
    if (m.decode_tokens_per_s != null) counter(col, "tps", fmt(m.decode_tokens_per_s, 1));
  }

  async function runColumn(col, kind, text, params, signal) {
    const run = { ids: [], spans: [], tokens: [], t0: performance.now(), tFirst: null, tLast: null,
      drafted: 0, metrics: null, done: false, rid: null, request: null };
    col.run = run;
    resetCounters(col);
    let body, path, answer;
    if (kind === "chat") {
      const messages = [];
      const sys = $("system").value.trim();
      if (sys) messages.push({ role: "system", content: sys });
      messages.push(...col.history, { role: "user", content: text });
      col.transcript.appendChild(el("div", "msg user", text));
      answer = col.transcript.appendChild(el("div", "msg assistant"));
      body = { messages };
      path = "/v1/chat/completions";
      run.request = { messages };
    } else {
      col.transcript.replaceChildren();
      answer = col.transcript.appendChild(el("div", "msg completion"));
      answer.appendChild(el("span", "prompt", text));
      body = { prompt: text };
      path = "/v1/completions";
      run.request = { prompt: text };
    }
    Object.assign(body, params, { model: col.name, stream: true });
    try {
      const res = await fetch(col.prefix + path, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      run.rid = res.headers.get("x-request-id");
      for await (const data of sseData(res)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        let toks = chunk.quantkit_tokens;
        if (!toks) {
          const c = chunk.choices && chunk.choices[0];
          const t = c ? (kind === "chat" ? c.delta && c.delta.content : c.text) : "";
          toks = t ? [{ id: null, text: t, drafted: false }] : [];
        }
        if (!toks.length) continue;
        const now = performance.now();
        if (run.tFirst == null) run.tFirst = now;
        run.tLast = now;
        if (chunk.quantkit_metrics) run.metrics = chunk.quantkit_metrics;
        run.tokens.push(...toks);
        run.ids.push(...toks.map((t) => t.id));
        run.drafted += toks.filter((t) => t.drafted).length;
        run.spans.push(...renderTokens(answer, toks));
        updateCounters(col);
        updateDivergence();
        col.transcript.scrollTop = col.transcript.scrollHeight;
      }
      run.done = true;
      updateDivergence();
      if (run.rid) {
        const d = await fetch(`${col.prefix}/v1/details/${encodeURIComponent(run.rid)}`, { signal });
        if (d.ok) finalCounters(col, (await d.json()).metrics);
      }
    } finally {
      run.done = true;
      if (kind === "chat") {
        // A stopped answer stays in the history as it was shown, as chat UIs usually do.
        col.history.push({ role: "user", content: text },
          { role: "assistant", content: run.tokens.map((t) => t.text).join("") });
      }
    }
  }

  // ---- compare -----------------------------------------------------------------------------------------
  function updateDivergence() {
    if (!state.compareTurn) return;
    const [a, b] = state.columns.map((c) => c.run);
    if (!a || !b) return;
    if (state.diverge != null) return dimAfter();
    const n = Math.min(a.ids.length, b.ids.length);
    for (let i = state.checked; i < n; i++) {
      if (a.ids[i] !== b.ids[i]) return markDivergence(i);
    }
    state.checked = n;
    // One answer ended and the other went on: they part where the shorter one stopped.
    if ((a.done && b.ids.length > n) || (b.done && a.ids.length > n)) return markDivergence(n);
    if (a.done && b.done) {
      for (const c of state.columns) note(c, `identical answers (${n} tokens)`);
    }
  }

  function markDivergence(i) {
    state.diverge = i;
    for (const c of state.columns) {
      if (c.run.spans[i]) c.run.spans[i].classList.add("diverge");
      c.run.dimmed = i + 1;
      note(c, `answers diverge at token ${i + 1}`);
    }
    dimAfter();
  }

  // Tokens past the divergence keep streaming in; they are dimmed as they arrive.
  function dimAfter() {
    for (const c of state.columns) {
      const spans = c.run.spans;
      for (; c.run.dimmed < spans.length; c.run.dimmed++) spans[c.run.dimmed].classList.add("after");
    }
  }

  async function fetchKL(col, signal) {
    const run = col.run;
    if (!run.ids.length || run.ids.some((id) => id == null)) return;
    const res = await fetch("/v1/playground/kl", {
      method: "POST", headers: { "Content-Type": "application/json" }, signal,
      body: JSON.stringify({ ...run.request, completion_ids: run.ids }),
    });
    if (!res.ok) throw new Error(await errorText(res));
    const out = await res.json();
    let sum = 0, max = 0;
    out.kl.forEach((kl, i) => {
      const s = run.spans[i];
      sum += kl;
      max = Math.max(max, kl);
      if (!s) return;
      s.dataset.kl = kl.toPrecision(3);
      // Underline strength grows with log KL: invisible below 0.05 nats, full from 5 nats (1 nat = 0.65).
      s.style.setProperty("--kl", Math.min(1, Math.max(0, Math.log10(kl / 0.05) / 2)).toFixed(3));
      s.classList.add("klv");
      if (kl > 1) s.classList.add("kl-hot");
      s.title = (s.title ? s.title + " · " : "") + `KL ${kl.toPrecision(3)} nats` +
        ` · logprob served ${out.model_logprob[i].toFixed(3)}, base ${out.base_logprob[i].toFixed(3)}`;
    });
    counter(col, "kl", `${fmt(sum / out.kl.length, 3)} / ${fmt(max, 2)}`);
  }

  // ---- actions -----------------------------------------------------------------------------------------
  async function send(ev) {
    if (ev) ev.preventDefault();
    if (state.running) return;
    const text = $("prompt").value;
    if (!text.trim()) return;
    let params;
    try {
      params = sampling();
    } catch (e) {
      setStatus("error", e.message);
      return;
    }
    const cols = activeColumns();
    const kind = mode();
    state.running = true;
    state.ctrl = new AbortController();
    state.diverge = null;
    state.checked = 0;
    state.compareTurn = cols.length === 2;
    for (const c of state.columns) c.run = cols.includes(c) ? null : c.run;
    $("send").disabled = true;
    $("stop").disabled = false;
    setStatus("running", "generating…");
    const signal = state.ctrl.signal;
    const results = await Promise.allSettled(cols.map((c) => runColumn(c, kind, text, params, signal)));
    const failed = results.find((r) => r.status === "rejected");
    let klError = null;
    if (!signal.aborted && !failed && state.compareTurn) {
      setStatus("running", "computing KL…");
      try {
        for (const c of cols) await fetchKL(c, signal);
      } catch (e) {
        if (!signal.aborted) klError = e;
      }
    }
    state.running = false;
    $("send").disabled = false;
    $("stop").disabled = true;
    if (signal.aborted) setStatus("stopped", "stopped");
    else if (failed) setStatus("error", "error: " + failed.reason.message);
    else if (klError) setStatus("error", "KL: " + klError.message);
    else {
      setStatus("done", "done");
      if (kind === "chat") $("prompt").value = "";
    }
  }

  function stop() {
    if (state.ctrl) state.ctrl.abort();
  }

  function clearAll() {
    stop();
    for (const c of state.columns) {
      c.history = [];
      c.run = null;
      c.transcript.replaceChildren();
      resetCounters(c);
    }
    setStatus("idle", "idle");
  }

  function applyMode() {
    $("system-field").hidden = mode() !== "chat";
    $("prompt").placeholder = mode() === "chat" ? "Type a message (Ctrl+Enter to send)"
      : "Text to continue (Ctrl+Enter to send)";
  }

  async function init() {
    let cfg;
    try {
      const res = await fetch("/v1/playground");
      if (!res.ok) throw new Error(await errorText(res));
      cfg = await res.json();
    } catch (e) {
      setStatus("error", "cannot reach the server: " + e.message);
      return;
    }
    state.cfg = cfg;
    const models = $("models");
    models.appendChild(el("span", "model", cfg.model));
    if (cfg.compare) {
      models.appendChild(el("span", "vs", " vs "));
      models.appendChild(el("span", "model base", cfg.compare));
    }
    state.columns.push(makeColumn("main", cfg.model, ""));
    if (cfg.compare) {
      state.columns.push(makeColumn("base", cfg.compare, "/compare"));
      $("compare-switch").hidden = false;
      $("compare").checked = true;
    }
    if (!cfg.chat) {
      $("mode-completion").checked = true;
      $("mode-chat").disabled = true;
    }
    $("max_tokens").max = cfg.max_tokens_limit;
    $("max_tokens").value = Math.min(Number($("max_tokens").value), cfg.max_tokens_limit);
    $("spec-hint").textContent = cfg.speculative
      ? `Speculative decoding on: up to ${cfg.num_speculative_tokens} drafted tokens per step.`
      : "Speculative decoding off: start the server with --prompt-lookup N or --draft to see drafted tokens.";
    if (window.matchMedia("(max-width: 720px)").matches) $("settings").open = false;
    showColumns();
    applyMode();
    $("compare").addEventListener("change", showColumns);
    for (const r of document.querySelectorAll('input[name="mode"]')) r.addEventListener("change", applyMode);
    $("composer").addEventListener("submit", send);
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", clearAll);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
    });
    setStatus("ready", "ready");
  }

  window.quantkitPlayground = { renderTokens, state };
  init();
})();
