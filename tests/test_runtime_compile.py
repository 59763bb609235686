"""`--compile`: the torch.compile'd decode step gives the eager model's tokens, with and without speculation."""
from __future__ import annotations

import copy

import torch

from helpers import greedy_with_and_without_lookup
from quantkit.runtime import compiled as steps
from quantkit.runtime.build import compile_decode
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread, tiny_llama


def test_compiled_decode_matches_eager_greedy_tokens():
    eager = tiny_llama(vocab_size=128, hidden=64, layers=2, seed=7, init_std=0.2)
    compiled = copy.deepcopy(eager)
    assert compile_decode(compiled)
    step, calls = steps.step(compiled, "slot"), []
    steps.set_step(compiled, "slot", lambda m, h, *a: calls.append(h.shape[1]) or step(m, h, *a))
    g = torch.Generator().manual_seed(2)
    chunk = torch.randint(1, 128, (9,), generator=g).tolist()
    prompts = [chunk + [3] + chunk[:4], torch.randint(1, 128, (7,), generator=g).tolist()]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with single_thread(), torch.inference_mode():
        # verify steps feed a varying number of tokens and crop the cache: the dynamic-shape graph copes
        spec_steps = greedy_with_and_without_lookup(compiled, prompts, params,
                                                    want=lambda ids: generate(eager, ids, params).output_ids())
    assert spec_steps > 0
    # decode steps (one token) and verify steps (several) ran compiled; prefills (14 and 7 tokens, more than any verify feeds) did not
    assert 1 in calls and max(calls) > 1 and 14 not in calls and 7 not in calls


def test_compiled_model_serves_from_the_engine_thread():
    """`serve --compile`: the decode loop runs on the engine's own thread, where dynamo must work too."""
    import threading

    from helpers import NumberTokenizer
    from quantkit.runtime.engine import Engine

    model = tiny_llama(vocab_size=64, hidden=64, layers=2, seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with single_thread():
        want = generate(model, [1, 2, 3, 4, 5, 6], params).output_ids()
        compile_decode(model)
        engine = Engine(model, NumberTokenizer())
        done, events = threading.Event(), []
        seq = engine.new_sequence([1, 2, 3, 4, 5, 6], params)
        engine.submit(seq, lambda kind, p: kind in ("done", "error") and (events.append((kind, p)) or done.set()))
        assert done.wait(300)
        engine.close()
    assert events == [("done", None)]
    assert seq.output_ids() == want


def test_compiled_decode_of_a_model_outside_our_forward_uses_transformers_path():
    """Models our Llama-family forward does not cover (here phi3) compile transformers' own forward."""
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config
    from quantkit.runtime import llama_step

    torch.manual_seed(3)
    eager = AutoModelForCausalLM.from_config(tiny_config("phi3", vocab_size=128, layers=2)).eval()
    assert not llama_step.supports(eager)
    compiled = copy.deepcopy(eager)
    assert compile_decode(compiled)
    step, calls = steps.step(compiled, "decode"), []
    steps.set_step(compiled, "decode", lambda **kw: calls.append(kw["input_ids"].shape[1]) or step(**kw))
    ids = torch.randint(1, 128, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with single_thread(), torch.inference_mode():
        assert generate(compiled, ids, params).output_ids() == generate(eager, ids, params).output_ids()
    assert calls and set(calls) == {1}


def test_two_compiled_models_of_the_same_shapes_keep_their_own_weights():
    """The compiled step skips guards on the modules (they cost ~1.7 ms a step); each model must still run
    its own weights, not a graph compiled for another model of identical shapes."""
    a = tiny_llama(vocab_size=64, hidden=64, layers=2, seed=11, init_std=0.2)
    b = tiny_llama(vocab_size=64, hidden=64, layers=2, seed=12, init_std=0.2)
    ids = [3, 9, 27, 17, 51, 25]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with single_thread(), torch.inference_mode():
        want_a, want_b = generate(a, ids, params).output_ids(), generate(b, ids, params).output_ids()
        assert want_a != want_b
        compile_decode(a)
        compile_decode(b)
        assert generate(a, ids, params).output_ids() == want_a
        assert generate(b, ids, params).output_ids() == want_b
        # a copy of a compiled model (as a self-w4 draft is made) runs its own weights, not a's compiled graph
        c = copy.deepcopy(a)
        with torch.no_grad():
            for p in c.parameters():
                p.mul_(-1.0)
        want_c = generate(copy.deepcopy(c), ids, params).output_ids()
        assert want_c != want_a and generate(c, ids, params).output_ids() == want_c


def test_a_decode_through_its_cache_growth_compiles_once():
    """The KV storage grows by doubling as a sequence lengthens; the compiled step must not recompile when a
    sequence exactly fills it (it did, ~12 s on SmolLM2 in the middle of a timed decode) or when it grows."""
    model = tiny_llama(vocab_size=64, hidden=64, layers=2, seed=5)
    ids = torch.randint(1, 64, (50,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(max_tokens=90, ignore_eos=True)  # positions 50..140: past 64 and 128
    with single_thread(), torch.inference_mode():
        want = generate(model, ids, params).output_ids()
        compile_decode(model)
        generate(model, ids[:5], SamplingParams(max_tokens=3, ignore_eos=True))  # the one compilation
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert generate(model, ids, params).output_ids() == want


_CAPPED_RUN = """
import torch
from quantkit.runtime import build
torch.manual_seed(0)
build._inductor_cache_per_capability()  # what compile_decode does before compiling
f = lambda x, w: torch.nn.functional.rms_norm(x, (16,), w, 1e-6) * torch.sigmoid(x)
x, w = torch.randn(3, 16), torch.rand(16)
assert torch.allclose(torch.compile(f, dynamic=True)(x, w), f(x, w), atol=1e-5)
"""


def test_compiled_kernels_of_one_cpu_capability_are_not_loaded_under_another(tmp_path):
    """torch's inductor cache does not key on ATEN_CPU_CAPABILITY: kernels compiled uncapped and loaded capped
    to AVX2 gave logits off by 1e19 (the other way round corrupted the heap). One user cache, an uncapped then
    a capped process, each compiling a norm as compile_decode would."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY", "QUANTKIT_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    for cap in (None, "avx2"):
        p = subprocess.run([sys.executable, "-c", _CAPPED_RUN], capture_output=True, text=True, timeout=300,
                           env={**env, **({"ATEN_CPU_CAPABILITY": cap} if cap else {})})
        assert p.returncode == 0, (cap, p.stderr[-1500:])
    assert len(list((tmp_path / "quantkit").glob("inductor-*"))) == 2
