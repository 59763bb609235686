"""The playground in a real headless browser (Debian's chromium driven by Playwright): streaming, drafted-token
marks, compare view with divergence and KL, chat with a system prompt, stop, escaping, and a 360 px screen.

The served and base models are tiny llamas wired to copy: attention and MLP outputs are zeroed so the logits
depend on the current token only, and the embedding/lm_head rows of a few tokens make each one predict a fixed
successor. Their greedy answers are then known text, here text containing `<script>`, which prompt lookup
drafts (and the target accepts) once the prompt has shown it; the served model differs from the base in one
transition, so the two answers diverge at a known token.
"""
import os
from types import SimpleNamespace
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from transformers import AutoTokenizer

from quantkit.models.embedded import embedded_model_dir
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.serve.playground import CompareModel, mount, teacher_forced_kl
from quantkit.runtime.sampling import SamplingParams
from quantkit.serve.app import create_app
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread, tiny_llama

CHROMIUM = os.environ.get("QUANTKIT_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = "<script>window.pwned=1;</"
MAX_TOKENS = 24
LIMIT = 400


def chain_model(n_vocab, transitions: dict[int, int], noise: float = 0.0, seed: int = 3):
    """A tiny llama whose greedy next token after `s` is `transitions[s]`, whatever came before."""
    m = tiny_llama(vocab_size=n_vocab, hidden=64, seed=seed, max_positions=512)
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0].float()
    with torch.no_grad():
        for layer in m.model.layers:  # the residual stream is then the current token's embedding alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = m.model.embed_tokens.weight, m.lm_head.weight
        head.add_(noise * torch.randn(head.shape, generator=g))
        srcs = sorted(transitions)
        for i, s in enumerate(srcs):
            emb[s] = basis[:, i]
        # After the final RMSNorm the state is 8 * basis_i (norm sqrt(64)): logit 80 for the successor against
        # ~0.2 for the other rows (std 0.02 * 8), so the argmax is the successor by a wide margin.
        for d in set(transitions.values()):
            head[d] = 10 * sum(basis[:, i] for i, s in enumerate(srcs) if transitions[s] == d)
    return m


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def models(tok):
    chain = tok(PROMPT)["input_ids"]
    assert len(set(chain)) == len(chain), "the copy chain needs distinct tokens"
    base_t = {c: chain[(i + 1) % len(chain)] for i, c in enumerate(chain)}
    served_t = dict(base_t)
    two = tok.convert_tokens_to_ids("2")
    served_t[chain[8]] = two  # "=" -> "2" instead of "1": the served model writes pwned=2
    served_t[two] = chain[10]  # "2" -> ";"
    # The served model's head also carries small noise, like a quantised model: KL > 0 at every token.
    return chain, chain_model(len(tok), served_t, noise=0.01), chain_model(len(tok), base_t)


@pytest.fixture(scope="module")
def server(models, tok):
    chain, served, base = models
    with single_thread():
        # cost_aware off here and in _expected: which tokens get drafted must not depend on step timings
        main = Engine(served, tok, drafter_factory=lambda: PromptLookupDrafter(2), cost_aware=False)
        other = Engine(base, tok, drafter_factory=lambda: PromptLookupDrafter(2), cost_aware=False)
        app = create_app(main, "tiny-w4", max_tokens_limit=LIMIT)
        mount(app, compare=CompareModel(other, "tiny-base"))
        port = _free_port()
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engines=(main, other))
        srv.should_exit = True
        th.join(timeout=10)
        main.close()
        other.close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium is not installed at {CHROMIUM}: the playground test needs a real browser "
                    "(bash tests/setup_machine.sh installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the Python package 'playwright' is not installed (pip install playwright); it drives chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser, url, width=1280, height=820):
    page = browser.new_page(viewport={"width": width, "height": height})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    page.wait_for_selector('#status[data-state="ready"]', timeout=20000)
    return page, errors


def _send(page, text, max_tokens=MAX_TOKENS, wait=True):
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")
    if wait:
        page.wait_for_selector('#status[data-state="done"]', timeout=60000)


def _tokens(page, col):
    """(text, classes) of every token span of the column's last answer."""
    return page.eval_on_selector_all(
        f'[data-col="{col}"] .msg.completion .tok, [data-col="{col}"] .msg.assistant:last-child .tok',
        "els => els.map(e => [e.textContent, e.className, e.dataset.kl || null])")


def _expected(model, tok, chain):
    with single_thread():
        return generate(model, chain, SamplingParams(max_tokens=MAX_TOKENS), drafter=PromptLookupDrafter(2),
                        tokenizer=tok, cost_aware=False)


def test_completion_compare_drafts_divergence_kl_and_escaping(browser, server, models, tok, tmp_path):
    chain, served, base = models
    page, errors = _open(browser, server.url)
    page.check("#mode-completion")
    assert page.is_checked("#compare")  # a compare model is loaded: side by side by default
    _send(page, PROMPT)
    want = {"main": _expected(served, tok, chain), "base": _expected(base, tok, chain)}
    assert "pwned=2" in want["main"].text() and "pwned=1" in want["base"].text()
    spans = {}
    for col, seq in want.items():
        spans[col] = _tokens(page, col)
        assert "".join(t for t, _, _ in spans[col]) == seq.text()
        # Each accepted draft token carries the mark, and only those: same flags as the decode loop reports.
        assert ["drafted" in c.split() for _, c, _ in spans[col]] == [t.drafted for t in seq.tokens]
        assert sum(t.drafted for t in seq.tokens) >= 10
        m = seq.metrics
        counters = page.inner_text(f'[data-col="{col}"] .counters')
        assert f"{round(100 * m.acceptance_rate)}%" in counters and f"{m.mean_accepted_length:.2f}" in counters
        assert " ms" in page.inner_text(f'[data-col="{col}"] [data-k="ttft"]')
    assert want["main"].metrics.acceptance_rate < 1.0  # the prompt's "=1" was drafted and refused

    # The model wrote "<script>...": shown as text, never parsed into an element, never run.
    assert "<script>window.pwned=2;</" in page.inner_text('[data-col="main"] .msg.completion')
    assert page.eval_on_selector_all(".columns script, .columns img", "els => els.length") == 0
    assert page.evaluate("typeof window.pwned") == "undefined"

    # First divergence: token 10 ("2" against "1"), marked in both columns, later tokens dimmed.
    ids = {c: [t.id for t in s.tokens] for c, s in want.items()}
    first = next(i for i, (a, b) in enumerate(zip(ids["main"], ids["base"])) if a != b)
    assert first == 9
    for col in ("main", "base"):
        marks = [i for i, (_, c, _) in enumerate(spans[col]) if "diverge" in c.split()]
        assert marks == [first]
        assert all("after" in c.split() for _, c, _ in spans[col][first + 1:])
        assert page.inner_text(f'[data-col="{col}"] .note') == f"answers diverge at token {first + 1}"

    # KL per token along each answer: the page shows what a direct teacher-forced computation gives.
    for col in ("main", "base"):
        ref = teacher_forced_kl(served, base, chain + ids[col], len(chain))["kl"]
        shown = [float(k) for _, _, k in spans[col]]
        # The page prints 3 significant digits.
        assert shown == pytest.approx(ref, rel=6e-3, abs=1e-9)
    main_kl = [float(k) for _, _, k in spans["main"]]
    assert main_kl[first] > 10 and max(main_kl[:first]) < 0.1  # large exactly where the models disagree
    assert "kl-hot" in spans["main"][first][1]
    shot = tmp_path / "playground-compare.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10000
    assert errors == []
    page.close()


def test_chat_with_system_prompt_keeps_history(browser, server, tok):
    page, errors = _open(browser, server.url)
    page.uncheck("#compare")
    assert page.is_hidden('[data-col="base"]')
    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    msgs = [{"role": "system", "content": "You are terse."}]
    for text in ("Hello <b>there</b>", "And again?"):
        _send(page, text, max_tokens=12)
        msgs.append({"role": "user", "content": text})
        # The same conversation through the API (greedy) gives the answer the page streamed.
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny-w4", "messages": msgs, "max_tokens": 12, "temperature": 0})
        answer = r.json()["choices"][0]["message"]["content"]
        msgs.append({"role": "assistant", "content": answer})
        shown = page.inner_text('[data-col="main"] .msg.assistant:last-child')
        assert shown == answer and len(_tokens(page, "main")) == r.json()["usage"]["completion_tokens"]
    users = page.eval_on_selector_all('[data-col="main"] .msg.user', "els => els.map(e => e.textContent)")
    assert users == ["Hello <b>there</b>", "And again?"]
    assert page.eval_on_selector_all(".columns b", "els => els.length") == 0
    assert errors == []
    page.close()


def test_stop_button_ends_the_stream_and_frees_the_server(browser, server, models):
    _, served, base = models
    gate = threading.Event()
    # Every forward waits 0.3 s (until the test ends) so the answer is still streaming when Stop is clicked,
    # however slowly a loaded machine drives the browser: 400 tokens then take over 40 s.
    hooks = [m.register_forward_pre_hook(lambda *_: gate.wait(0.3) and None) for m in (served, base)]
    try:
        page, errors = _open(browser, server.url)
        page.check("#mode-completion")
        _send(page, PROMPT, max_tokens=LIMIT, wait=False)
        page.wait_for_selector('[data-col="main"] .tok', timeout=30000)
        # The acceptance counter is live: it shows a rate while the answer is still streaming.
        page.wait_for_function("document.querySelector('[data-col=main] [data-k=accept]').textContent.endsWith('%')",
                               timeout=30000)
        assert page.get_attribute("#status", "data-state") == "running" and page.is_enabled("#stop")
        page.click("#stop")
        page.wait_for_selector('#status[data-state="stopped"]', timeout=10000)
        n = len(_tokens(page, "main"))
        assert 0 < n < LIMIT and page.is_enabled("#send") and page.is_disabled("#stop")
        # The server notices the closed stream and drops the request instead of decoding on.
        # (Read from the engines: the /metrics active gauge is only refreshed when new work arrives.)
        deadline = time.time() + 20
        while any(e._active or e._waiting for e in server.engines):
            assert time.time() < deadline, "the stopped request kept decoding"
            time.sleep(0.1)
        assert len(_tokens(page, "main")) == n  # nothing more arrived after Stop
        assert errors == []
        page.close()
    finally:
        gate.set()
        for h in hooks:
            h.remove()


def test_render_function_escapes_markup(browser, server):
    page, _ = _open(browser, server.url)
    out = page.evaluate("""() => {
        const box = document.createElement('div');
        document.body.appendChild(box);
        const evil = ['<script>window.pwned2 = 1<\\/script>', '<img src=x onerror="window.pwned3 = 1">', '&amp;'];
        window.quantkitPlayground.renderTokens(box, evil.map(text => ({text, drafted: true, logprob: -1})));
        return {text: box.textContent, elements: box.querySelectorAll('script, img').length,
                spans: box.querySelectorAll('span.tok.drafted').length};
    }""")
    assert out == {"text": '<script>window.pwned2 = 1</script><img src=x onerror="window.pwned3 = 1">&amp;',
                   "elements": 0, "spans": 3}
    page.wait_for_timeout(200)  # an injected onerror would have fired by now
    assert page.evaluate("[typeof window.pwned2, typeof window.pwned3]") == ["undefined", "undefined"]
    page.close()


def test_fits_a_360px_screen(browser, server, tmp_path):
    page, errors = _open(browser, server.url, width=360, height=740)
    assert not page.is_visible("#max_tokens")  # settings start folded on a phone
    page.click("#settings summary")
    page.check("#mode-completion")
    _send(page, PROMPT)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 360, f"the page is {width}px wide at a 360px viewport"
    main = page.locator('[data-col="main"]').bounding_box()
    base = page.locator('[data-col="base"]').bounding_box()
    assert base["y"] >= main["y"] + main["height"]  # the compare columns stack instead of squeezing
    assert main["x"] >= 0 and main["x"] + main["width"] <= 360
    page.screenshot(path=str(tmp_path / "playground-360.png"), full_page=True)
    assert errors == []
    page.close()
