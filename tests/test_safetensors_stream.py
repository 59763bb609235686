"""The streaming safetensors writer against safetensors' own reader (the independent reference): every dtype a
checkpoint stores, scalars and empty tensors, tensors produced in any order, several shards with their index;
wrong or missing tensors are refused; and it holds one tensor at a time, where save_file holds the whole file."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quantkit.formats.safetensors_stream import Spec, StreamWriter


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"f32": torch.randn(3, 5, generator=g), "f16": torch.randn(7, generator=g).half(),
            "bf16": torch.randn(2, 3, generator=g).bfloat16(), "f64": torch.randn(4, generator=g).double(),
            "i32": torch.randint(-2**31, 2**31 - 1, (6, 2), generator=g, dtype=torch.int32),
            "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
            "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
            "i64": torch.tensor([2**40, -3]), "bool": torch.tensor([True, False, True]),
            "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "a.long.name/with.dots": torch.ones(1)}


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                      and a.dtype != torch.bool else a,
                                                                      b.view(torch.uint8) if b.element_size() == 1
                                                                      and b.dtype != torch.bool else b)


def test_every_dtype_reads_back_bit_for_bit_in_any_order(tmp_path):
    ts = _tensors()
    with StreamWriter(tmp_path, {k: Spec.of(v) for k, v in ts.items()}, 1 << 30, {"format": "pt"}) as w:
        for k in reversed(list(ts)):
            w.write(k, ts[k])
    assert w.files == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(ts) and all(_same(back[k], ts[k]) for k in ts)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_shards_and_index(tmp_path):
    ts = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each, two per 2 KiB shard
    with StreamWriter(tmp_path, {k: Spec.of(v) for k, v in ts.items()}, 2048, {"format": "pt"}) as w:
        for k, v in ts.items():
            w.write(k, v)
    assert len(w.files) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024 and set(index["weight_map"]) == set(ts)
    for k, v in ts.items():
        assert torch.equal(load_file(str(tmp_path / index["weight_map"][k]))[k], v)


def test_a_tensor_unlike_its_announcement_or_never_written_is_refused(tmp_path):
    specs = {"a": Spec(torch.float32, (2, 2)), "b": Spec(torch.float16, (3,))}
    w = StreamWriter(tmp_path, specs, 1 << 20, {})
    with pytest.raises(ValueError, match="'a' is torch.float32 \\(2, 3\\)"):
        w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="not announced"):
        w.write("c", torch.zeros(1))
    w.write("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="written twice"):
        w.write("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="never written, e.g. 'b'"):
        w.close()


PEAK = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from quantkit.formats.safetensors_stream import Spec, StreamWriter
    from safetensors.torch import save_file

    def hwm():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) // 1024

    n, mib = 8, 32
    spec = Spec(torch.float32, (mib << 18,))
    made = lambda i: torch.full(spec.shape, float(i))
    made(0)  # warm the allocator and the page cache of this process once
    open("/proc/self/clear_refs", "w").write("5")
    base = hwm()
    if sys.argv[1] == "stream":
        with StreamWriter(Path(sys.argv[2]), {f"t{i}": spec for i in range(n)}, 1 << 40, {}) as w:
            for i in range(n):
                w.write(f"t{i}", made(i))
    else:
        save_file({f"t{i}": made(i) for i in range(n)}, sys.argv[2] + "/model.safetensors")
    print(hwm() - base)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
def test_memory_is_one_tensor_not_the_file(tmp_path):
    """8 tensors of 32 MiB: streamed, the peak grows by about one tensor; save_file (the reference) by the whole
    256 MiB file at least. Measured in fresh processes, so nothing else in the test run moves the peak."""
    def peak(mode):
        d = tmp_path / mode
        d.mkdir()
        out = subprocess.run([sys.executable, "-c", PEAK, mode, str(d)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    streamed, whole = peak("stream"), peak("save_file")
    assert whole >= 256, whole  # the reference really holds the file: otherwise this test measures nothing
    assert streamed <= 2 * 32 + 16, streamed
