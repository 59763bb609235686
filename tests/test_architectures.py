"""Every architecture the README names quantises with RTN and loads back with matching logits."""
import pytest
import torch

import quantkit
from helpers import TINY_ARCHS, make_tiny_model, rel_err
from quantkit.linear.quant import QuantLinear

IDS = torch.tensor([[5, 9, 100, 33, 2, 250, 7]])


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_quantize_and_load(tmp_path, cli, arch):
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "src", arch)
    out = tmp_path / "out"
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")
    assert code == 0, err
    q = quantkit.load(out, dtype=torch.float32, exact=True)
    qlin = {n: m for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    n_linear = sum(isinstance(m, torch.nn.Linear) for n, m in ref.named_modules() if n != "lm_head")
    assert len(qlin) == n_linear  # every projection except the head is quantised
    for n, m in ref.named_modules():
        if n in qlin:
            m.weight.data = qlin[n].dequantized_weight()
    with torch.no_grad():
        assert rel_err(q(IDS).logits, ref(IDS).logits) < 1e-5
