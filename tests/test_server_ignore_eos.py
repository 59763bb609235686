"""`ignore_eos` (vLLM's extension, which bench/serve_vs_vllm.py sends both servers): generate max_tokens tokens
even past the end-of-sequence token."""
import httpx
from transformers import AutoTokenizer

from helpers import ServerThread
from quantkit.models.embedded import embedded_model_dir
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.serve.app import create_app
from quantkit.testing.models import single_thread, tiny_llama


def test_ignore_eos_generates_past_the_end_token():
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    prompt = tok("Once upon a time")["input_ids"]
    probe = tiny_llama(vocab_size=len(tok), hidden=64, seed=5, max_positions=256)
    first = generate(probe, prompt, SamplingParams(max_tokens=1, ignore_eos=True)).output_ids()[0]
    # the same weights, with the greedy first token declared the end of sequence
    model = tiny_llama(vocab_size=len(tok), hidden=64, seed=5, max_positions=256, eos_token_id=first)
    with single_thread():
        engine = Engine(model, tok)
        server = ServerThread(create_app(engine, "tiny"), [engine])
        try:
            def ask(**kw):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
                return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

            plain, ignoring = ask().json(), ask(ignore_eos=True).json()
            assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
            assert ignoring["usage"]["completion_tokens"] == 8 and ignoring["choices"][0]["finish_reason"] == "length"
            assert ask(ignore_eos="yes").status_code == 400  # strict types, as every parameter
        finally:
            server.stop()
