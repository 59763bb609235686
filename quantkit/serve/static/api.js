// quantkit playground: requests to the server. Loaded before app.js; exposes window.quantkitApi.
//
// API key (quantkit serve --api-key): the page never carries the key, since anyone who can load the page could
// read it there. On a 401 the page asks for the key, keeps it in sessionStorage (this tab only, gone when it
// closes) and sends it as "Authorization: Bearer KEY" from then on.
"use strict";
(() => {
  const KEY = "quantkit-api-key";

  function withKey(headers) {
    const out = Object.assign({}, headers || {});
    const key = window.sessionStorage.getItem(KEY);
    if (key) out.Authorization = "Bearer " + key;
    return out;
  }

  // fetch(path, opts) with the key; asks for the key (twice at most) while the server answers 401.
  async function request(path, opts) {
    opts = opts || {};
    for (let asked = 0; ; asked++) {
      const res = await fetch(path, Object.assign({}, opts, { headers: withKey(opts.headers) }));
      if (res.status !== 401 || asked >= 2) return res;
      const key = window.prompt(asked ? "That API key was refused. API key:"
        : "This server needs an API key (quantkit serve --api-key). API key:");
      if (!key || !key.trim()) return res;
      window.sessionStorage.setItem(KEY, key.trim());
    }
  }

  function postJSON(path, body, signal) {
    return request(path, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal });
  }

  // The data fields of a server-sent event stream, one string per event.
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

  window.quantkitApi = { request, postJSON, sseData, errorText };
})();
