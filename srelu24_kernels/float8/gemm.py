"""Dense float8 GEMMs for the srelu24 custom op (srelu24_kernels/srelu24/op.py): with trainer.float8 set,
its Z = X W1^T (forward) and dA = dY W2 (backward) run through torch._scaled_mm, scaled as
torchao's float8 training recipes scale the Float8Linear modules around it
(torchao.float8.Float8LinearConfig.from_recipe_name; tests/test_float8.py checks the casts against
torchao's own). Its 2:4 GEMMs are srelu24_kernels/float8/sparse.py's.

    recipe      forward operands   gradient operand dY   one scale per                  accumulation
    tensorwise  e4m3               e5m2                  tensor                         fast in the forward
    rowwise     e4m3               e4m3                  row of the reduction dim,      fast in the forward
                                                         rounded down to a power of 2

scale = fp8 max / max(amax, 1e-12) (float64, then float32: torchao's amax_to_scale; on a GPU one
Triton launch computes it and its reciprocal); values are scaled in fp32, saturated to +-max and
cast (on a GPU in one Triton pass, srelu24_kernels/float8/cast.py, which also writes B column-major);
torch._scaled_mm takes the scales' reciprocals and writes bf16. On a GPU, rowwise's scales come
from the amax's bits instead (cast.pow2_scale, the largest power of 2 with amax * s <= 448):
the same as torchao's for a bf16 amax; for an fp32 one, half of torchao's where its float32 log2
rounds up.
`mm_reference` computes the same product from the same float8 values in fp32.

Needs a GPU of compute capability >= 8.9 (training/float8.py checks); torch's CPU _scaled_mm
(torch >= 2.13) runs it in tests.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .cast import columns_to_e4m3, pow2_scale_triton, scaled_cast, scaled_cast_reference, to_float8_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor on amax (float8_utils.EPS): an all-zero operand gets a finite scale


@dataclass(frozen=True)
class Recipe:
    rowwise: bool          # one scale per row of the reduction dim, else one per tensor
    grad_dtype: torch.dtype
    pow2_scales: bool      # scales rounded down to a power of 2 (exact in any dtype)


RECIPES = {"tensorwise": Recipe(False, E5M2, False), "rowwise": Recipe(True, E4M3, True)}


def _cast(t: Tensor, scale: Tensor, dtype: torch.dtype, column_major: bool) -> Tensor:
    """scaled_cast_reference(t, scale, dtype); column_major: laid out as the transpose of a row-major tensor."""
    if not t.is_cuda:
        q = scaled_cast_reference(t, scale, dtype)
        return q.t().contiguous().t() if column_major and q.stride(0) != 1 else q
    if not column_major:
        return scaled_cast(t, scale, dtype)
    if t.t().is_contiguous():  # already the transpose of a row-major tensor
        return scaled_cast(t.t(), scale.t() if scale.dim() == 2 else scale, dtype).t()
    return scaled_cast(t, scale, dtype, transpose=True).t()


def amax_to_scale_reference(amax: Tensor, fmax: float, pow2: bool) -> tuple[Tensor, Tensor]:
    """(scale, 1 / scale), float32, as torchao's amax_to_scale (and its power-of-2 rounding)."""
    scale = (fmax / amax.double().clamp(min=EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale, scale.reciprocal()


@triton.jit
def amax_to_scale_triton(amax, FMAX: tl.constexpr):
    """torchao's scale of an amax (any float dtype): FMAX / max(amax, EPS) in float64, then float32;
    NaN stays NaN, an inf amax gives 0."""
    a = amax.to(tl.float64)
    # EPS = 1e-12 as a float64, from its bits: a float literal in a kernel is a float32
    eps = tl.full(a.shape, 0x3D719799812DEA11, tl.int64).to(tl.float64, bitcast=True)
    a = tl.maximum(a, eps, propagate_nan=tl.PropagateNan.ALL)
    return (tl.full(a.shape, FMAX, tl.float64) / a).to(tl.float32)  # float64 division is IEEE (div.rn.f64)


@triton.jit
def _amax_to_scale_kernel(amax_ptr, scale_ptr, inv_ptr, n, FMAX: tl.constexpr, POW2: tl.constexpr,
                          BLOCK: tl.constexpr):
    """amax_to_scale_reference in one launch (the reference is 5-8 launches of one element each).
    POW2 keeps the scale's exponent: the same as exp2(floor(log2)) for every amax a bf16 operand
    can have (a bf16 amax never puts the scale within 2^-8 below a power of 2, where log2 could
    round up)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = amax_to_scale_triton(tl.load(amax_ptr + i, mask=m, other=1.0), FMAX)
    if POW2:
        bits = s.to(tl.int32, bitcast=True) & -8388608  # 0xFF800000: sign and exponent
        s = tl.where(s != s, s, bits.to(tl.float32, bitcast=True))
    tl.store(scale_ptr + i, s, mask=m)
    tl.store(inv_ptr + i, tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s), mask=m)


def amax_to_scale(amax: Tensor, fmax: float, pow2: bool) -> tuple[Tensor, Tensor]:
    """amax_to_scale_reference; on a GPU in one Triton launch (host time: srelu24's casts at 1B shapes
    left the GPU waiting on the host)."""
    # the kernel's pow2 rounding is torchao's for a bf16 amax only: an fp32 one can put 448 / amax
    # within an ulp below a power of 2, which torchao's float32 log2 rounds up (tests/test_float8.py)
    if not amax.is_cuda or (pow2 and amax.dtype != torch.bfloat16):
        return amax_to_scale_reference(amax, fmax, pow2)
    return amax_to_scale_kernel(amax, fmax, pow2)


def amax_to_scale_kernel(amax: Tensor, fmax: float, pow2: bool) -> tuple[Tensor, Tensor]:
    """amax_to_scale's GPU launch, without its choice of path (tests/compile_sm90.py compiles it)."""
    a = amax.contiguous()
    scale, inv = torch.empty(a.shape, dtype=torch.float32, device=a.device), torch.empty(a.shape, dtype=torch.float32,
                                                                                         device=a.device)
    n = a.numel()
    _amax_to_scale_kernel[(triton.cdiv(n, 1024),)](a, scale, inv, n, FMAX=fmax, POW2=pow2, BLOCK=1024, num_warps=4)
    return scale, inv


@triton.jit
def _rowwise_e4m3_kernel(x_ptr, out_ptr, scale_ptr, inv_ptr, M, stride_m, K: tl.constexpr, BK: tl.constexpr,
                         BM: tl.constexpr):
    """Rowwise's e4m3 cast of BM rows of x [M, K] (bf16 or fp32, rows contiguous), each row whole in
    registers: its amax, the power-of-2 scale (cast.pow2_scale: torchao's for a bf16 amax; 0 for
    an inf amax, as torchao's 448 / inf), the row scaled and cast, and 1 / scale. One read of x, one
    launch: the amax reduction, the scale kernel and the cast were three launches and two reads."""
    i = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.arange(0, BK)
    live = (i[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptr + i[:, None] * stride_m + k[None, :], mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    nan = tl.max((x != x).to(tl.int32), 1) > 0
    inf = amax.to(tl.int32, bitcast=True) == 0x7F800000  # by its bits: fp32 has finite values above 3.4e38
    s = tl.where(inf & ~nan, 0.0, pow2_scale_triton(amax, nan))
    tl.store(scale_ptr + i, s, mask=i < M)
    tl.store(inv_ptr + i, tl.math.div_rn(tl.full([BM], 1.0, tl.float32), s), mask=i < M)
    q = to_float8_bits(tl.clamp(x * s[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), False)
    tl.store(out_ptr + i[:, None] * K + k[None, :], q, mask=live)


ROWWISE_ELEMENTS = 16384  # a program's rows x K (registers: 64 values a thread at 8 warps)


def rowwise_e4m3(t: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """to_float8(t, E4M3, 1, pow2=True) for t [M, K] with contiguous rows, in one Triton launch: (the
    cast [M, K], scale [M, 1], 1 / scale [M, 1]); None where a row does not fit one program.
    For an fp32 t (srelu24's fp32 W1 in e4m3 mode) the scale is the largest power of 2 that fits,
    which torchao's exceeds 2x where its float32 log2 rounds up (amaxes a few ulps above 1.75 2^e;
    it then clamps that value to 448): dequantized, the same values but for that one and those in
    e4m3's subnormal range."""
    m, k = t.shape
    bk = triton.next_power_of_2(k)
    if t.stride(1) != 1 or bk > ROWWISE_ELEMENTS or not m:
        return None
    out = torch.empty(m, k, dtype=E4M3, device=t.device)
    scale, inv = torch.empty(m, 1, dtype=torch.float32, device=t.device), torch.empty(m, 1, dtype=torch.float32,
                                                                                      device=t.device)
    bm = ROWWISE_ELEMENTS // bk
    _rowwise_e4m3_kernel[(triton.cdiv(m, bm),)](t, out.view(torch.uint8), scale, inv, m, t.stride(0), K=k, BK=bk, BM=bm,
                                                num_warps=8)
    return out, scale, inv


def to_float8(t: Tensor, dtype: torch.dtype, dim, pow2: bool, column_major: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(t * scale cast to dtype, scale, 1 / scale): amax over `dim` (kept as size 1; None: the whole
    tensor), as torchao's hp_tensor_to_float8_dynamic. column_major: the cast laid out column-major.
    On a GPU, rowwise e4m3 runs in one launch where the amax runs along t's rows, and in two
    (cast.columns_to_e4m3, cast K-major) along the columns of a row-major t (srelu24's W2 for
    dA = dY W2, where the PyTorch path reads W2 more often and takes 5-8 launches more for an fp32
    amax's scale): its scales are pow2_scale of the amax, torchao's for a
    bf16 amax (an fp32 one: as rowwise_e4m3's), and a column holding an inf becomes NaN (torchao's,
    and rowwise_e4m3's for a row: scale 0, so 0 but the inf, which is NaN; non-finite either way)."""
    if t.is_cuda and pow2 and dtype == E4M3 and dim is not None:
        rows = t.t() if dim == 0 else t
        if (dim == 1) != column_major and rows.stride(1) == 1:  # the cast's layout is rows' own
            fused = rowwise_e4m3(rows)
            if fused is not None:
                q, scale, inv = fused
                return (q.t(), scale.t(), inv.t()) if dim == 0 else fused
        if dim == 0 and column_major and t.stride(1) == 1:  # per column of a row-major t, written K-major
            q, scale, inv = columns_to_e4m3(t)
            return q.t(), scale[None, :], inv[None, :]
    inf = float("inf")  # the largest |t|, in one pass (no |t| tensor)
    amax = torch.linalg.vector_norm(t, inf) if dim is None else torch.linalg.vector_norm(t, inf, dim=dim, keepdim=True)
    scale, inv = amax_to_scale(amax, torch.finfo(dtype).max, pow2)
    return _cast(t, scale, dtype, column_major), scale, inv


def b_operand(b: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    """b [K, N] as _scaled_mm's B: in e4m3, column-major, scaled per column (rowwise) or as a whole,
    and the reciprocal of its scale. mm's conversion of b, on its own so that a weight's can be kept
    (an optimizer step keeps them: srelu24_kernels/srelu24/options.py, StepState)."""
    r = RECIPES[recipe]
    b8, _, ib = to_float8(b, E4M3, 0 if r.rowwise else None, r.pow2_scales, column_major=True)
    return b8, ib


def a_operand(a: Tensor, recipe: str, grad: bool) -> tuple[Tensor, Tensor]:
    """a [M, K] as _scaled_mm's A: in float8 (torchao's gradient format where `grad`), row-major,
    scaled per row (rowwise) or as a whole, and the reciprocal of its scale."""
    r = RECIPES[recipe]
    a8, _, ia = to_float8(a, r.grad_dtype if grad else E4M3, 1 if r.rowwise else None, r.pow2_scales)
    return a8, ia


def _operands(a: Tensor, b: Tensor, recipe: str, grad: bool, b_float8=None, a_float8=None):
    """a, b in float8 and the reciprocals of their scales (what _scaled_mm multiplies by)."""
    # a [M, K] scaled per row, b [K, N] per column: both along K, the reduction
    a8, ia = a_float8 if a_float8 is not None else a_operand(a, recipe, grad)
    b8, ib = b_float8 if b_float8 is not None else b_operand(b, recipe)
    return a8, ia, b8, ib


def mm(a: Tensor, b: Tensor, recipe: str, grad: bool = False,
       b_float8: tuple[Tensor, Tensor] | None = None, a_float8: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """a [M, K] @ b [K, N] in float8, bf16 out. grad: `a` is an output gradient (dA = dY W2):
    torchao's gradient dtype and exact accumulation; else e4m3 and fast accumulation (forward).
    b_float8, a_float8: b_operand(b, recipe), a_operand(a, recipe, grad), where the caller has them
    already (a kept weight's; dY's, made with its other conversion: srelu24_kernels/float8/paired.py)."""
    a8, sa, b8, sb = _operands(a.contiguous(), b, recipe, grad, b_float8, a_float8)
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=not grad)


def mm_reference(a: Tensor, b: Tensor, recipe: str, grad: bool = False) -> Tensor:
    """What mm computes, in fp32 on any device: the same float8 values, dequantized and multiplied."""
    a8, sa, b8, sb = _operands(a, b, recipe, grad)
    return (a8.float() * sa) @ (b8.float() * sb)
