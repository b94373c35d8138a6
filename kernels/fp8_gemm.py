"""Dense float8 GEMMs for the srelu24 custom op (kernels/srelu24_ffn.py): with trainer.float8 set,
its Z = X W1^T (forward) and dA = dY W2 (backward) run through torch._scaled_mm, scaled as
torchao's float8 training recipes scale the Float8Linear modules around it
(torchao.float8.Float8LinearConfig.from_recipe_name; tests/test_float8.py checks the casts against
torchao's own). Its 2:4 GEMMs are kernels/fp8_sparse.py's.

    recipe      forward operands   gradient operand dY   one scale per                  accumulation
    tensorwise  e4m3               e5m2                  tensor                         fast in the forward
    rowwise     e4m3               e4m3                  row of the reduction dim,      fast in the forward
                                                         rounded down to a power of 2

scale = fp8 max / max(amax, 1e-12) (float64, then float32: torchao's amax_to_scale); values are
scaled in fp32, saturated to +-max and cast (on a GPU in one Triton pass, kernels/fp8_cast.py, which
also writes B column-major); torch._scaled_mm takes the scales' reciprocals and writes bf16.
`mm_reference` computes the same product from the same float8 values in fp32.

Needs a GPU of compute capability >= 8.9 (training/float8.py checks); torch's CPU _scaled_mm
(torch >= 2.13) runs it in tests.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from .fp8_cast import scaled_cast, scaled_cast_reference

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


def to_float8(t: Tensor, dtype: torch.dtype, dim, pow2: bool, column_major: bool = False) -> tuple[Tensor, Tensor]:
    """(t * scale cast to dtype, scale): amax over `dim` (kept as size 1; None: the whole tensor),
    as torchao's hp_tensor_to_float8_dynamic. column_major: the cast laid out column-major."""
    inf = float("inf")  # the largest |t|, in one pass (no |t| tensor)
    amax = torch.linalg.vector_norm(t, inf) if dim is None else torch.linalg.vector_norm(t, inf, dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return _cast(t, scale, dtype, column_major), scale


def _operands(a: Tensor, b: Tensor, recipe: str, grad: bool):
    """a, b in float8 and the reciprocals of their scales (what _scaled_mm multiplies by)."""
    r = RECIPES[recipe]
    # a [M, K] scaled per row, b [K, N] per column: both along K, the reduction
    a8, sa = to_float8(a, r.grad_dtype if grad else E4M3, 1 if r.rowwise else None, r.pow2_scales)
    b8, sb = to_float8(b, E4M3, 0 if r.rowwise else None, r.pow2_scales, column_major=True)  # _scaled_mm's B
    return a8, sa.reciprocal(), b8, sb.reciprocal()


def mm(a: Tensor, b: Tensor, recipe: str, grad: bool = False) -> Tensor:
    """a [M, K] @ b [K, N] in float8, bf16 out. grad: `a` is an output gradient (dA = dY W2):
    torchao's gradient dtype and exact accumulation; else e4m3 and fast accumulation (forward)."""
    a8, sa, b8, sb = _operands(a.contiguous(), b, recipe, grad)
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=not grad)


def mm_reference(a: Tensor, b: Tensor, recipe: str, grad: bool = False) -> Tensor:
    """What mm computes, in fp32 on any device: the same float8 values, dequantized and multiplied."""
    a8, sa, b8, sb = _operands(a, b, recipe, grad)
    return (a8.float() * sa) @ (b8.float() * sb)
