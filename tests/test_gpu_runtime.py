"""The runtime on CUDA decodes as on the CPU: a W4 checkpoint's greedy tokens agree across devices, speculative
decoding keeps greedy output exact, and the batching engine answers each request as if alone. Collected
everywhere, run where a GPU is (bench/gpu_check.sh)."""
import pytest
import quantkit
import torch

from helpers import NumberTokenizer, greedy_with_and_without_lookup, repeat_prompts, run_together_as_alone, tiny_model
from quantkit.runtime import build
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; bench/gpu_check.sh runs it on one")]
VOCAB = 512


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    d = tmp_path_factory.mktemp("gpu_w4")
    tiny_model(vocab_size=VOCAB, dtype=torch.float16, seed=3).save_pretrained(d / "base")
    quantize_to_checkpoint(apply_overrides(Recipe(), {"model": str(d / "base"), "output": str(d / "w4"),
                                                      "quant.group_size": 32, "dtype": "float16",
                                                      "quant.method": "rtn"}))
    return str(d / "w4")


def _exact_cpu(path):
    """The checkpoint on the CPU in float32 without the runtime's bf16 packed ops: the exact reference."""
    return quantkit.load(path, device="cpu", dtype=torch.float32, exact=True)


def _prompts():
    return repeat_prompts(6, VOCAB, seed=4)


def test_greedy_tokens_agree_across_devices_in_float32(w4):
    cpu = _exact_cpu(w4)
    gpu = quantkit.load(w4, dtype=torch.float32, device="cuda")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for prompt in _prompts():
        assert generate(gpu, prompt, params).output_ids() == generate(cpu, prompt, params).output_ids()


def test_float16_logits_on_cuda_follow_the_cpu(w4):
    """fp16 on CUDA runs the CUDA GEMV / Triton kernels; its logits stay within fp16 rounding of the CPU's."""
    cpu = _exact_cpu(w4)
    gpu = quantkit.load(w4, device="cuda")
    ids = torch.tensor([_prompts()[0]])
    with torch.inference_mode():
        want = cpu(ids).logits.double()
        got = gpu(ids.cuda()).logits.double().cpu()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_speculative_greedy_is_exact_on_cuda(w4):
    gpu = quantkit.load(w4, device="cuda")
    steps = greedy_with_and_without_lookup(gpu, _prompts(), SamplingParams(max_tokens=12, ignore_eos=True))
    assert steps > 0


def test_engine_batches_on_cuda_as_alone(w4):
    from quantkit.runtime.engine import Engine

    gpu = quantkit.load(w4, device="cuda")
    run_together_as_alone(Engine(gpu, NumberTokenizer(), max_active=8), gpu, _prompts(), 10)
