"""The quantkit:: CUDA ops as torch sees them, on any machine: schemas identical to binding.cpp's TORCH_LIBRARY
block, fake implementations that propagate shapes and dtypes under FakeTensorMode and keep torch.compile's graph
whole, and the argument checks that turn bad input into one clear UserError."""
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from quantkit.errors import UserError
from quantkit.kernels import cuda_library as lib
from quantkit.testing.packed import make_packed


@pytest.fixture(scope="module")
def ops():
    """The ops declared once per process: by the built extension where a GPU exists, else from Python."""
    if torch.cuda.is_available():
        lib.load_extension()
    else:
        lib.define_schemas()
    return torch.ops.quantkit


def _cpp_schemas() -> dict:
    text = (lib.SOURCE_DIR / "binding.cpp").read_text()
    block = text[text.index("TORCH_LIBRARY(quantkit"):text.index("TORCH_LIBRARY_IMPL")]
    found = {}
    for call in re.findall(r'm\.def\(((?:\s*"[^"]*")+)\)', block):
        schema = "".join(re.findall(r'"([^"]*)"', call))
        found[schema.split("(")[0]] = schema
    return found


def test_python_schemas_match_the_cpp_library():
    assert _cpp_schemas() == lib.SCHEMAS


def _fake_args(mode, rows=3, k=256, n=48, group_size=64, dtype=torch.float16, zero=True, bias=True):
    with mode:
        x = torch.empty(rows, k, dtype=dtype, device="cuda")
        wp = torch.empty(n, k // 8, dtype=torch.int32, device="cuda")
        sc = torch.empty(n, k // group_size, dtype=dtype, device="cuda")
        zp = torch.empty(n // 8, k // group_size, dtype=torch.int32, device="cuda") if zero else None
        b = torch.empty(n, dtype=dtype, device="cuda") if bias else None
    return x, wp, sc, zp, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_fakes_propagate_shapes_and_dtypes(ops, dtype, rows):
    mode = FakeTensorMode()
    x, wp, sc, zp, b = _fake_args(mode, rows=rows, dtype=dtype)
    with mode:
        y = ops.gemv_w4a16(x, wp, sc, zp, None, b, 64)
        assert (tuple(y.shape), y.dtype, y.device.type) == ((rows, 48), dtype, "cuda")
        w = ops.dequant_int(wp, sc.float(), zp, None, 4, 64, 256, torch.float32)
        assert (tuple(w.shape), w.dtype) == ((48, 256), torch.float32)
        out = torch.empty(48, 256, dtype=dtype, device="cuda")
        assert ops.dequant_int_out(wp, sc, zp, None, 4, 64, out) is None
        big = torch.empty(rows * 16, 256, dtype=dtype, device="cuda")
        t = ops.gemm_w4a16_tc(big, wp, sc, zp, b, 64)
        assert (tuple(t.shape), t.dtype) == ((rows * 16, 48), dtype)
        f8 = torch.empty(48, 256, dtype=torch.float8_e4m3fn, device="cuda")
        d = ops.dequant_fp8(f8, torch.empty(48, device="cuda"), torch.bfloat16)
        assert (tuple(d.shape), d.dtype) == ((48, 256), torch.bfloat16)


def test_fakes_refuse_shapes_the_kernel_cannot_take(ops):
    mode = FakeTensorMode()
    x, wp, sc, zp, b = _fake_args(mode)
    with mode:
        with pytest.raises(UserError, match="weight_packed must be"):
            ops.gemv_w4a16(x, torch.empty(48, 16, dtype=torch.int32, device="cuda"), sc, zp, None, b, 64)
        with pytest.raises(UserError, match="1-4 float16/bfloat16 rows"):
            ops.gemv_w4a16(torch.empty(5, 256, dtype=torch.float16, device="cuda"), wp, sc, zp, None, b, 64)
        with pytest.raises(UserError, match="scale columns"):
            ops.gemv_w4a16(x, wp, sc, zp, None, b, 32)
        with pytest.raises(UserError, match="tensor-core W4A16 GEMM takes 1-64"):
            ops.gemm_w4a16_tc(torch.empty(65, 256, dtype=torch.float16, device="cuda"), wp, sc, zp, b, 64)
        with pytest.raises(UserError, match="group_size % 32 == 0"):
            ops.gemm_w4a16_tc(x, wp, torch.empty(48, 32, dtype=torch.float16, device="cuda"), None, b, 8)
        with pytest.raises(UserError, match="weight_zero_point must be packed"):
            ops.gemv_w4a16(x, wp, sc, torch.empty(2, 4, dtype=torch.int32, device="cuda"), None, b, 64)


def test_compiled_graph_keeps_the_op_whole(ops):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        ours = (torch.ops.quantkit.gemv_w4a16, torch.ops.quantkit.gemv_w4a16.default)
        vals = [n.meta["example_value"] for n in gm.graph.nodes if n.target in ours]
        assert len(vals) == 1 and tuple(vals[0].shape) == (2, 48) and vals[0].dtype == torch.float16
        return lambda *args: (torch.zeros(2, 48, dtype=torch.float16),)  # nothing to run it with on a CPU

    def layer(x, wp, sc, zp, b):
        return torch.relu(ops.gemv_w4a16(x, wp, sc, zp, None, b, 64)) + 1

    p = make_packed(48, 256, 4, 64, False, seed=1)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)).half()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=capture, fullgraph=True)  # fullgraph: a graph break would raise
    y = compiled(x, p.weight_packed, p.weight_scale, p.weight_zero_point, torch.zeros(48, dtype=torch.float16))
    assert len(graphs) == 1 and y.shape == (2, 48)  # one graph: the op and the ops around it, no break
    assert torch.relu in [n.target for n in graphs[0].graph.nodes]


def _real(rows=2, k=256, dtype=torch.float16):
    p = make_packed(48, k, 4, 64, False, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    return x, p.weight_packed, p.weight_scale.to(dtype), p.weight_zero_point


@pytest.mark.parametrize("mutate,message", [
    (lambda a: {"x": a["x"].float()}, "1-4 float16/bfloat16 rows"),
    (lambda a: {"scale": a["scale"].bfloat16()}, "weight_scale must have x's dtype"),
    (lambda a: {"x": a["x"].t().contiguous().t()}, "x must be contiguous"),
    (lambda a: {"zero": a["zero"].long()}, "weight_zero_point must be int32"),
    (lambda a: {"x": torch.randn(2, 264).half()[:, 8:]}, "contiguous"),
    (lambda a: {"x": torch.randn(2 * 256 + 2).half()[2:].view(2, 256)}, "16-byte boundary"),
    (lambda a: {"bias": torch.zeros(47, dtype=torch.float16)}, r"bias must be \[48\]"),
    (lambda a: {"x": torch.randn(2, 224).half()}, "weight_packed must be"),
])
def test_checks_name_the_bad_argument(mutate, message):
    x, wp, sc, zp = _real()
    args = {"x": x, "wp": wp, "scale": sc, "zero": zp, "bias": None}
    args.update(mutate(args))
    with pytest.raises(UserError, match=message):
        lib.check_gemv(args["x"], args["wp"], args["scale"], args["zero"], None, args["bias"], 64, cuda=False)


def test_checks_accept_good_arguments_and_want_cuda_tensors():
    x, wp, sc, zp = _real()
    lib.check_gemv(x, wp, sc, zp, None, None, 64, cuda=False)  # shapes, dtypes and alignment all fit
    with pytest.raises(UserError, match="CUDA tensors only"):
        lib.check_gemv(x, wp, sc, zp, None, None, 64)
    out = torch.empty(48, 256, dtype=torch.float16)
    lib.check_dequant_int(wp, sc, zp, None, 4, 64, out, cuda=False)
    with pytest.raises(UserError, match="output dtype"):
        lib.check_dequant_int(wp, sc.float(), zp, None, 4, 64, out, cuda=False)
