"""--device for serve, generate, eval and quantize: auto picks CUDA only where torch sees a GPU, an explicit
cuda without one is a one-line error (exit 2) before anything loads, and a CUDA model gets no CPU-only layout.
torch.cuda.is_available is patched, so each case means the same on machines with and without a GPU."""
import pytest
import torch

from quantkit.errors import UserError
from quantkit.devices import resolve_device


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_auto_follows_the_gpu(monkeypatch):
    for seen, expected in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda seen=seen: seen)
        assert resolve_device("auto") == expected
        assert resolve_device(None) == expected
    assert resolve_device(" CPU ") == "cpu"


def test_explicit_cuda_without_a_gpu_is_refused(no_gpu):
    for name in ("cuda", "cuda:0"):
        with pytest.raises(UserError, match=f"--device {name}: this torch .* sees no CUDA GPU; use --device cpu"):
            resolve_device(name)


def test_cuda_names_with_a_gpu(one_gpu):
    assert resolve_device("cuda") == "cuda"
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(UserError, match="only 1 CUDA GPU"):
        resolve_device("cuda:1")
    for bad in ("tpu", "cuda:x", "gpu"):
        with pytest.raises(UserError, match="choose auto, cpu or cuda"):
            resolve_device(bad)


def test_load_builds_cpu_layouts_on_the_cpu_only(monkeypatch, tmp_path, one_gpu):
    """quantkit.load's one set of defaults: the runtime's layouts on the CPU, the checkpoint's dtype on CUDA, and
    exact=True the checkpoint's own modules anywhere."""
    import quantkit
    from quantkit.runtime import checkpoint

    calls = []
    monkeypatch.setattr(checkpoint, "read_model", lambda path, **kw: calls.append(kw) or "model")
    quantkit.load(tmp_path)
    quantkit.load(tmp_path, device="cuda", dtype="bfloat16")
    quantkit.load(tmp_path, device="cuda:0")
    quantkit.load(tmp_path, device="auto", dtype=torch.float16, exact=True)
    assert calls[0] == dict(device="cpu", dtype=torch.float32, cpu_fast=True, relayout=True)
    assert calls[1] == dict(device="cuda", dtype=torch.bfloat16, cpu_fast=False, relayout=False)
    assert calls[2] == dict(device="cuda:0", dtype=None, cpu_fast=False, relayout=False)  # the checkpoint's dtype
    assert calls[3] == dict(device="cuda", dtype=torch.float16)
    assert quantkit.load is checkpoint.load  # the facade has no defaults of its own
    with pytest.raises(UserError, match="unknown dtype 'float8'"):
        quantkit.load(tmp_path, dtype="float8")


@pytest.mark.parametrize("args", [
    ["generate", "embedded", "--prompt", "hi", "--device", "cuda"],
    ["serve", "embedded", "--port", "0", "--device", "cuda"],
    ["eval", "embedded", "w4=embedded", "--device", "cuda"],
    ["quantize", "embedded", "-o", "{tmp}/out", "--device", "cuda"],
])
def test_cli_device_cuda_without_a_gpu_exits_2_with_one_line(cli, no_gpu, tmp_path, args):
    code, _, err = cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--device cuda" in lines[0] and "no CUDA GPU" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["generate", "serve", "eval", "quantize"])
def test_help_names_the_device_choices(cli, cmd):
    code, out, _ = cli(cmd, "--help")
    assert code == 0 and "--device" in out and "auto" in out
