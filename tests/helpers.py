"""Tiny random transformers models for tests: a few layers, hidden 64-128, saved as HF folders."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

# model_type -> config kwargs; widths are multiples of 64 so group sizes 32 and 64 divide them
TINY_ARCHS = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gemma": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "phi3": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                 pad_token_id=0),
    "opt": dict(hidden_size=128, ffn_dim=256, num_attention_heads=4, word_embed_proj_dim=128),
}


def tiny_config(arch: str, vocab_size: int = 512, layers: int = 2):
    from transformers import AutoConfig

    kw = dict(TINY_ARCHS[arch])
    kw.update(vocab_size=vocab_size, num_hidden_layers=layers, max_position_embeddings=256)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str = "llama", dtype=torch.float32, seed: int = 0, vocab_size: int = 512, layers: int = 2,
               std: float = 0.05):
    """A tiny random model in memory, in eval mode; every matrix drawn from N(0, std) because the default init
    is so small that quantisation error and logit differences would hide in it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, layers), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model.eval()


def make_tiny_model(folder: Path, arch: str = "llama", dtype=torch.float32, seed: int = 0, vocab_size: int = 512,
                    layers: int = 2) -> Path:
    tiny_model(arch, dtype, seed, vocab_size, layers).save_pretrained(folder)
    return Path(folder)


def make_tiny_unmapped_model(folder: Path) -> Path:
    """A tiny GPT-NeoX model saved to FOLDER: an architecture with nn.Linear projections and no AWQ map."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    cfg = GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate: exactly n new tokens after `prompt`."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy_with_and_without_lookup(model, prompts, params, want=None) -> int:
    """For each prompt, our greedy decode of `model` equals want(prompt) (when given), and decoding with prompt
    lookup drafting gives the same tokens; returns how many verify steps drafted, for the caller to check > 0."""
    from quantkit.runtime.generate import generate
    from quantkit.drafts.prompt_lookup import PromptLookupDrafter

    spec_steps = 0
    for prompt in prompts:
        expected = want(prompt) if want is not None else None  # first, as the callers' loops always ran it
        plain = generate(model, prompt, params).output_ids()
        if expected is not None:
            assert plain == expected
        spec = generate(model, prompt, params, drafter=PromptLookupDrafter(3, min_ngram=1), num_speculative_tokens=4)
        assert spec.output_ids() == plain
        spec_steps += spec.metrics.spec_steps
    return spec_steps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread; stop() also closes the given engines."""

    def __init__(self, app, engines=()):
        import threading
        import time

        import uvicorn

        self.engines = list(engines)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        for e in self.engines:
            e.close()


class NumberTokenizer:
    """The one tokenizer method the engine calls without stop strings: decode() (token ids written as numbers)."""

    eos_token_id = None

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


class EngineRequests:
    """Requests submitted to a runtime Engine, and a wait for them to end ("done" or "error", kept by index)."""

    def __init__(self, engine):
        import threading

        self.engine, self.reqs, self.kinds = engine, [], {}
        self._ended = threading.Semaphore(0)
        self._waited = 0

    def submit(self, ids: list[int], max_tokens: int, prepare=None):
        """prepare(seq) may change the sequence before it is queued."""
        from quantkit.runtime.sampling import SamplingParams

        seq = self.engine.new_sequence(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        if prepare is not None:
            prepare(seq)
        i = len(self.reqs)

        def on_event(kind, _payload):
            if kind in ("done", "error"):
                self.kinds[i] = kind
                self._ended.release()

        self.reqs.append(self.engine.submit(seq, on_event))
        return self.reqs[-1]

    def submit_together(self, prompts: list[list[int]], max_tokens, prepare=None) -> None:
        """Queue every prompt before the decode loop can admit any, so they are all active from the first step.
        max_tokens: one for all, or one per prompt."""
        sizes = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        with self.engine._cv:
            for ids, n in zip(prompts, sizes):
                self.submit(ids, n, prepare)

    def wait(self, n: int | None = None, timeout: float = 120) -> None:
        """Until n more requests (default: every one not yet waited for) have ended."""
        n = len(self.reqs) - self._waited if n is None else n
        for _ in range(n):
            assert self._ended.acquire(timeout=timeout)
        self._waited += n


def run_together_as_alone(engine, model, prompts: list[list[int]], max_tokens: int) -> "EngineRequests":
    """Submit the prompts to `engine` all at once, wait, close it, and check each answer equals the same prompt
    decoded alone by generate (greedy, ignore_eos); one torch thread throughout. Returns the requests."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.testing.models import single_thread

    run = EngineRequests(engine)
    with single_thread():
        run.submit_together(prompts, max_tokens)
        run.wait()
        engine.close()
        for ids, req in zip(prompts, run.reqs):
            alone = generate(model, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).output_ids()
            assert req.seq.output_ids() == alone
    return run


def repeat_prompts(n: int, vocab: int, seed: int, sep: int = 7) -> list[list[int]]:
    """n random prompts that repeat their start after a `sep` token, so prompt lookup has something to draft."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        chunk = torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(chunk + [sep] + chunk[:3])
    return out


def assert_relaid_decodes_like(model, reference, sep: int = 7) -> None:
    """`model` (its Linears re-laid out by the runtime) computes `reference`'s logits up to summation order, and
    its greedy decode of 20 prompts, with and without prompt lookup, equals transformers' generate on
    `reference`; prompt lookup must have drafted."""
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.testing.models import single_thread

    ids = torch.tensor([repeat_prompts(1, 256, seed=1, sep=sep)[0]])
    with torch.no_grad():
        # the same float32 products in another summation order: ~1e-6 relative through two layers
        assert rel_err(model(ids).logits, reference(ids).logits) < 1e-5
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with single_thread():
        spec_steps = greedy_with_and_without_lookup(model, repeat_prompts(20, 256, seed=2, sep=sep), params,
                                                    want=lambda p: hf_greedy(reference, p, 12))
    assert spec_steps > 0


def sampled_pair_frequencies(target, draft, prompt: list[int], vocab: int, n: int = 800) -> torch.Tensor:
    """Frequencies of the (2nd, 3rd) generated tokens over n seeded sampled runs of `target` speculating with
    ModelDrafter(draft), k = 2; each run must have drafted at least once. For exact-distribution tests."""
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.drafts.model_draft import ModelDrafter
    from quantkit.testing.models import single_thread

    counts = torch.zeros(vocab * vocab)
    with single_thread():
        for s in range(n):
            params = SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True)
            seq = generate(target, prompt, params, drafter=ModelDrafter(draft), num_speculative_tokens=2)
            assert seq.metrics.spec_steps >= 1
            b, c = seq.output_ids()[1:3]
            counts[b * vocab + c] += 1
    return counts / n


def deadline(seconds: int):
    """A context manager that raises TimeoutError in the main thread after SECONDS (SIGALRM): for fuzz cases,
    each of which must answer, not hang."""
    import signal
    from contextlib import contextmanager

    @contextmanager
    def timer():
        def hang(*_):
            raise TimeoutError(f"no answer in {seconds} s")
        old = signal.signal(signal.SIGALRM, hang)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return timer()
