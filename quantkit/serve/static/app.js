// quantkit playground: talks to the server's OpenAI-compatible endpoints (through api.js) and reads the
// per-token details (text, logprob, drafted) each streamed chunk carries in `quantkit_tokens`. No framework,
// no build step; view.js holds the DOM helpers.
//
// Safety rule: model output reaches the DOM only through textContent (or title), never innerHTML, so
// generated text such as "<script>" is shown as text and never parsed as markup.
"use strict";
(() => {
  const { request, postJSON, sseData, errorText } = window.quantkitApi;
  const { $, el, renderTokens, setStatus, fmt, makeColumn, counter, note, resetCounters,
    mode, sampling } = window.quantkitView;
  const state = {
    cfg: null, columns: [], running: false, ctrl: null,
    diverge: null, checked: 0, compareTurn: false,
  };

  function activeColumns() {
    return state.columns.filter((c) => c.key === "main" || $("compare").checked);
  }

  function showColumns() {
    const on = $("compare").checked && state.cfg.compare;
    for (const c of state.columns) c.node.hidden = c.key === "base" && !on;
    $("columns").classList.toggle("two", !!on);
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
      const res = await postJSON(col.prefix + path, body, signal);
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
        const d = await request(`${col.prefix}/v1/details/${encodeURIComponent(run.rid)}`, { signal });
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
    const res = await postJSON("/v1/playground/kl", { ...run.request, completion_ids: run.ids }, signal);
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
      const res = await request("/v1/playground");
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
