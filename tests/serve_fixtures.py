"""Module-scoped fixtures the server test files share: the real tokenizer, a tiny random model over it, and
that model served with default settings. Imported by name into each file (pytest finds imported fixtures)."""
import pytest

from quantkit.testing.models import single_thread

from serve_helpers import Served, random_model, real_tokenizer


@pytest.fixture(scope="module")
def tok():
    return real_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return random_model(tok)


@pytest.fixture(scope="module")
def server(model, tok):
    with single_thread():
        s = Served(model, tok)
        yield s
        s.stop()
