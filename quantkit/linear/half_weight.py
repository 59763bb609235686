"""Linears whose weights are held in float16 and multiplied in float32, by FBGEMM's float16-weight product.

A float model's decode step reads every weight once per token, so the bytes a weight takes are the step's time
on a CPU. Many float checkpoints store float16 (SmolLM2-135M among them): loaded in float32 for exact products,
each weight then takes 4 bytes for what fits in 2. FBGEMM (in torch's x86 builds, behind
`torch.ops.quantized.linear_dynamic_fp16`) keeps the weight in float16 panels, widens it to float32 in
registers and accumulates in float32, so a weight that is exactly a float16 number gives the float32 product up
to summation order while half the bytes are read. On one core of this machine the embedded SmolLM2 decoded at
~48 tok/s this way (~60 with --compile) against 20-22 tok/s with float32 weights in oneDNN's layout
(docs/benchmarks.md).
Two ways to call it, chosen when a weight is packed (pack()): at one torch thread, torch's tensor-held form of
FBGEMM's pack (`torch.fbgemm_pack_gemm_matrix_fp16`, deprecated but present in the torch pinned here), ~2 us
of fixed cost a call against ~12 us for `torch.ops.quantized.linear_dynamic_fp16` (2 ms of a 22 ms step over
SmolLM2's 211 Linears) but always on one thread; at more threads, the latter, which splits each product over
them (13 rows of a 3072 x 576 product: 234 against 437 us at 2 threads), so verify steps cost less.
It is also fast for several rows, where torch's own float16 product runs row by row: the 49152 x 576 head
took 8 ms for 13 rows against 40 ms (F.linear in float16); and each output row depends only on its own input
row, so rows computed together equal the same rows computed alone.

The runtime holds a weight this way only where it loses nothing (relayout.py: every value exactly a float16
number), and for the head of a quantised checkpoint, which half_head.py rounds to float16 on purpose.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F

from .opaque import OpaqueLinear

HOLDABLE = (torch.float32, torch.float16)


class _Held:
    """A weight as FBGEMM holds it, callable as x -> x @ w.T in float32. Never changed in place (a new weight gets
    a new one), so copies of a module share it."""

    def __init__(self, out_features: int, in_features: int):
        self.out_features, self.in_features = out_features, in_features

    def unpack(self) -> torch.Tensor:
        raise NotImplementedError

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # pickling (torch.save of a whole model): the weight, packed again on load
        return pack, (self.unpack(),)


def _packable(w: torch.Tensor) -> torch.Tensor:
    # a copy, because packing clamps values beyond float16's range in the tensor it is given
    return w.to(torch.float32, copy=True).contiguous()


class _ThreadedPack(_Held):
    """One weight in FBGEMM's float16 layout behind `torch.ops.quantized.linear_dynamic_fp16`, which splits each
    product over torch's threads: at 2 threads a 3072 x 576 product took 53 us for one row and 234 us for 13,
    against 74 and 437 us for _Pack's single-threaded call. Its fixed cost is ~12 us a call."""

    def __init__(self, w: torch.Tensor):
        super().__init__(*w.shape)
        self.params = torch.ops.quantized.linear_prepack_fp16(_packable(w), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.params)

    def unpack(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(self.params)[0]


class _Pack(_Held):
    """One weight in FBGEMM's float16 layout: a uint8 tensor torch uses as a handle to the packed matrix, which
    no tensor operation can copy (a clone copies the handle's bytes, not the matrix). Its call runs on one thread
    whatever torch's setting, at ~2 us of fixed cost: the faster kind at one thread."""

    def __init__(self, w: torch.Tensor):
        super().__init__(*w.shape)
        self.handle = torch.fbgemm_pack_gemm_matrix_fp16(_packable(w))
        self.zeros = torch.zeros(self.out_features)  # the op requires a bias; a module's own is added after

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fbgemm_linear_fp16_weight(x, self.handle, self.zeros)

    def unpack(self) -> torch.Tensor:
        """The [out, in] float32 weight. FBGEMM has no unpack for this form, so the weight is multiplied by the
        identity: each output is 1.0 * w plus exact zeros, so every value comes back exactly (a -0.0 as 0.0)."""
        n, cols = self.in_features, []
        for i in range(0, n, 512):
            rows = torch.arange(min(512, n - i))
            eye = torch.zeros(len(rows), n)
            eye[rows, rows + i] = 1.0  # rows i.. of the identity, without building all of it
            cols.append(self(eye))
        return torch.cat(cols).t().contiguous()


class _Rows(_Held):
    """Output rows [start, stop) of a pack that several modules share (fuse_modules): alone, it computes the
    whole product and keeps its columns, which only a caller outside the fused step pays for."""

    def __init__(self, whole: _Held, start: int, stop: int):
        super().__init__(stop - start, whole.in_features)
        self.whole, self.start, self.stop = whole, start, stop

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start: self.stop].contiguous()

    def unpack(self) -> torch.Tensor:
        return self.whole.unpack()[self.start: self.stop].contiguous()


# The product as an operator torch.compile can keep in one graph: dynamo cannot trace the pack's handle (a
# tensor without data to it), so the compiled step names the module (or fused group) by a key it keeps for its
# whole life, and the op asks it for its product as it is now: weights loaded after compiling reach the compiled
# step too (it skips guards on modules: build._fixed_model_guards). The Meta kernel gives the output's shape.
# Defined at the dispatcher's level because torch.library.custom_op's Python wrapper costs ~10 us more a call,
# which over 211 Linears would undo much of what compiling gains.
_OWNERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_keys = itertools.count()


def _register(owner) -> int:
    key = next(_keys)
    _OWNERS[key] = owner
    return key


_LIB = torch.library.Library("quantkit", "FRAGMENT")
_LIB.define("half_linear(Tensor x, int key, int out_features) -> Tensor")
_LIB.impl("half_linear", lambda x, key, out_features: _OWNERS[key].product(x), "CPU")
_LIB.impl("half_linear", lambda x, key, out_features: x.new_empty(*x.shape[:-1], out_features), "Meta")


def _linear(x: torch.Tensor, key: int, out_features: int, held, bias: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """x times the weights of the owner named by key, in float32, plus bias, returned in dtype. Eager calls go
    straight to `held` (the owner's product); compiled ones through the op."""
    x = x if x.dtype == torch.float32 else x.float()
    y = torch.ops.quantkit.half_linear(x, key, out_features) if torch.compiler.is_compiling() else held(x)
    if bias is not None:
        y = y + bias
    return y if y.dtype == dtype else y.to(dtype)


@lru_cache(maxsize=None)
def _works(kind: type) -> bool:
    """This torch build has the kind's FBGEMM ops and they give the float32 product of the float16 weight."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g).half().float()
    x = torch.randn(3, 16, generator=g)
    # torch warns once per process that _Pack's ops are deprecated; this first use takes that warning, outside
    # inference mode, where it arrives as a Python warning that can be silenced (inside, it goes to stderr)
    with torch.inference_mode(False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"fbgemm_.* is deprecated")
        try:
            held = kind(w)
            y, back = held(x), held.unpack()
        except (RuntimeError, NotImplementedError, AttributeError):
            return False
    return bool(torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-5)) and bool(torch.equal(back, w))


def available() -> bool:
    """This torch build has FBGEMM's float16-weight product (x86 builds; not ARM's)."""
    return _works(_Pack) or _works(_ThreadedPack)


def pack(w: torch.Tensor) -> _Held:
    """w in FBGEMM's float16 layout, in the kind that is faster at torch's thread count as it is now: one
    thread, the single-threaded call with the smaller fixed cost; more, the call that splits over them."""
    threaded = torch.get_num_threads() > 1 or not _works(_Pack)
    return _ThreadedPack(w) if threaded and _works(_ThreadedPack) else _Pack(w)


def exact_in_float16(w: torch.Tensor) -> bool:
    """Every value of w is a finite float16 number (in range, no lost bits), so holding it in float16 loses
    nothing (FBGEMM saturates infinities to 65504, so they do not count)."""
    if not bool(torch.isfinite(w).all()):
        return False
    return w.dtype == torch.float16 or bool(torch.equal(w.to(torch.float16).to(w.dtype), w))


class HalfWeightLinear(OpaqueLinear):
    """An inference-only nn.Linear holding its weight in float16 in FBGEMM's layout. Inputs of any float dtype
    are multiplied in float32 and the output is returned in the weight's original dtype (float32, or float16 for
    a float16 model). Moved or cast to what FBGEMM cannot hold (a GPU, bfloat16), it holds a plain weight and
    computes as nn.Linear.

    lossless (relayout.py): only weights that are float16 numbers are held in float16; any other weight (one
    loaded later through load_state_dict, say) is held plain, so no value is ever rounded. lossless=False
    (half_head.py) rounds on purpose."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lossless: bool = True):
        self.lossless = lossless  # read by _set_weight, which the base class calls
        super().__init__(weight, bias)
        self.key = _register(self)

    def __setstate__(self, state):
        # a copy (deepcopy, or pickled and loaded) is a module of its own: the compiled op must find it, not us
        super().__setstate__(state)
        self.key = _register(self)

    def _set_weight(self, w: torch.Tensor) -> None:
        holdable = w.device.type == "cpu" and w.dtype in HOLDABLE and available()
        if holdable and (not self.lossless or exact_in_float16(w)):
            # the bias stays a parameter of its own, added after the product, so in-place updates reach it
            self.packed, self.plain = pack(w), None
        else:
            self.packed, self.plain = None, w

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (float32) times the weight as held now, in float32, without the bias (the compiled step's op)."""
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.plain.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return F.linear(x, self.plain, self.bias)
        return _linear(x, self.key, self.out_features, self.packed, self.bias, self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight, the float16 values in the original dtype (a new tensor each call)."""
        if self.plain is not None:
            return self.plain
        return self.packed.unpack().to(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: 2 per weight. Held in memory, FBGEMM's panels take more where the input width
        is not a multiple of 512 (its row blocks are padded to 512 rows: 3.56 bytes per weight at SmolLM2's 576,
        2 at 1536), padding the product never reads (measured from the process's resident memory)."""
        if self.plain is not None:
            return self.plain.numel() * self.plain.element_size()
        return self.out_features * self.in_features * 2

    @property
    def layout(self) -> str:
        return "float16 weights, float32 products (FBGEMM)" if self.packed is not None else "plain"


class _Group:
    """Modules sharing one pack (fuse_modules). Each keeps its rows of it until given a new weight; from then on
    the group computes module by module and lets the shared pack go."""

    def __init__(self, mods: list[HalfWeightLinear]):
        self.mods = mods
        self.whole = pack(torch.cat([m.packed.unpack() for m in mods]))
        self.views, start = [], 0
        for m in mods:
            self.views.append(_Rows(self.whole, start, start + m.out_features))
            start += m.out_features
            m.packed = self.views[-1]
        self.out_features = start
        self.key = _register(self)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole is not None and all(m.packed is v for m, v in zip(self.mods, self.views)):
            return self.whole(x)
        self.whole = self.views = None
        return torch.cat([m.product(x) for m in self.mods], dim=-1)


def fuse_modules(mods: list[HalfWeightLinear]):
    """One product for HalfWeightLinear modules that read the same input (q/k/v; gate/up), with the weights held
    once: the modules' weights are packed together and each module is left its rows of that pack (_Rows).
    Fewer, wider products save ~1.5 ms of SmolLM2's 18 ms step at one row (30 layers: 9.4 against 10.9 ms), and
    each column is the same dot product, so the outputs are bit-identical to the modules' own.
    Returns fn(x) -> the outputs side by side, or None where the modules cannot share a pack. A module given a new
    weight later (load_state_dict) leaves the pack: fn then calls the modules one by one."""
    if not all(type(m) is HalfWeightLinear and m.packed is not None for m in mods):
        return None
    if len({m.dtype for m in mods}) != 1 or len({m.in_features for m in mods}) != 1:
        return None
    if len({m.bias is None for m in mods}) != 1:
        return None
    group = _Group(mods)

    def run(x: torch.Tensor) -> torch.Tensor:
        bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        return _linear(x, group.key, group.out_features, group.product, bias, mods[0].dtype)

    return run
