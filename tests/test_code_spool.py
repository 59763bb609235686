"""Issue 39.5: a streamed run keeps each solved Linear's codes on disk (formats/code_spool.py), not in memory, until
the checkpoint is written; what comes back is exactly what was solved, and the spool leaves nothing behind."""
from __future__ import annotations

import pytest
import torch

from quantkit.formats.code_spool import CodeSpool
from quantkit.schemes import get_scheme
from quantkit.solvers.rtn import rtn_quantize


@pytest.mark.parametrize("scheme", ["w4a16", "fp8"])
def test_kept_codes_are_the_solved_ones_read_from_the_file(tmp_path, scheme):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    s = get_scheme(scheme)
    qw = rtn_quantize(w, s.with_options(symmetric=False, group_size=32) if scheme == "w4a16" else s)
    folder = tmp_path / "spool"
    folder.mkdir()
    with CodeSpool(folder, tmp_path / "out") as spool:
        kept = spool.keep(qw)
        assert [p.name for p in folder.iterdir()] == ["0.pt"]
    assert not folder.exists()
    for name in ("q", "scale", "zero", "g_idx"):
        a, b = getattr(qw, name), getattr(kept, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                      b.view(torch.uint8) if b.element_size() == 1 else b), name
    torch.testing.assert_close(kept.dequantize(), qw.dequantize(), rtol=0, atol=0)


def test_a_streamed_run_spools_every_linear_and_leaves_no_folder(tmp_path, monkeypatch):
    from helpers import make_tiny_model

    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    src = make_tiny_model(tmp_path / "models" / "tiny", "llama")
    kept = []
    real = CodeSpool.keep
    monkeypatch.setattr(CodeSpool, "keep", lambda self, qw: kept.append(self.folder) or real(self, qw))
    out = tmp_path / "out"
    summary = quantize_to_checkpoint(apply_overrides(Recipe(), {"model": str(src), "output": str(out),
                                                                "quant.method": "rtn", "quant.group_size": 32}))
    assert summary["loading"] == "layer by layer" and len(kept) == summary["layers"] > 0
    # in the run's scratch folder beside OUT, and both removed after the write
    assert kept[0].parent.parent == tmp_path and not kept[0].parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]
