"""The playground against a server with an API key, in a real headless chromium (as test_playground_browser.py):
the page loads without the key, asks for it at the first 401, then streams answers and the compare view's KL
with it; a refused key is asked for again. Nothing of the key is in the page the server sends."""
import os
from pathlib import Path

import httpx
import pytest

from quantkit.runtime.engine import Engine
from quantkit.serve.playground import CompareModel, mount
from quantkit.testing.models import single_thread

from serve_helpers import Served, random_model, real_tokenizer

CHROMIUM = os.environ.get("QUANTKIT_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "pg-key-123"


@pytest.fixture(scope="module")
def server():
    tok = real_tokenizer()
    base = Engine(random_model(tok, seed=6), tok)
    with single_thread():
        s = Served(random_model(tok), tok, api_key=KEY, max_tokens_limit=16,
                   app_hook=lambda app: mount(app, compare=CompareModel(base, "base")))
        s.engines.append(base)
        yield s
        s.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium is not installed at {CHROMIUM}: this test needs a real browser "
                    "(bash tests/setup_machine.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser, url, answers: list[str]):
    """The page, answering its key prompts from `answers` in turn; returns (page, prompts seen, JS errors)."""
    page = browser.new_page()
    asked, errors = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def on_dialog(dialog):
        asked.append(dialog.message)
        dialog.accept(answers.pop(0))

    page.on("dialog", on_dialog)
    page.goto(url + "/")
    return page, asked, errors


def test_the_page_asks_for_the_key_then_uses_it(browser, server):
    assert KEY not in httpx.get(server.url + "/").text
    page, asked, errors = _open(browser, server.url, [KEY])
    page.wait_for_selector('#status[data-state="ready"]', timeout=20000)
    assert len(asked) == 1 and "API key" in asked[0]
    page.check("#mode-completion")
    page.fill("#max_tokens", "6")
    page.fill("#prompt", "Once upon a time")
    page.click("#send")
    page.wait_for_selector('#status[data-state="done"]', timeout=60000)
    for col in ("main", "base"):  # both answers streamed, and the KL request went through as well
        assert 0 < page.eval_on_selector_all(f'[data-col="{col}"] .tok', "els => els.length") <= 6
        assert page.inner_text(f'[data-col="{col}"] [data-k="kl"]') != "–"
    assert len(asked) == 1 and not errors
    assert page.evaluate("sessionStorage.getItem('quantkit-api-key')") == KEY


def test_a_refused_key_is_asked_for_again(browser, server):
    page, asked, errors = _open(browser, server.url, ["wrong", KEY])
    page.wait_for_selector('#status[data-state="ready"]', timeout=20000)
    assert len(asked) == 2 and "refused" in asked[1] and not errors


def test_no_key_given_shows_the_servers_message(browser, server):
    page, asked, _ = _open(browser, server.url, [""])
    page.wait_for_selector('#status[data-state="error"]', timeout=20000)
    assert len(asked) == 1 and "API key" in page.inner_text("#status")
