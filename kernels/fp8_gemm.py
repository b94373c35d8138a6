"""Dense float8 GEMMs for the srelu24 custom op (kernels/srelu24_ffn.py): with trainer.float8 set,
its Z = X W1^T (forward) and dA = dY W2 (backward) run through torch._scaled_mm, scaled as
torchao's float8 training recipes scale the Float8Linear modules around it
(torchao.float8.Float8LinearConfig.from_recipe_name; tests/test_float8.py checks the casts against
torchao's own). Its 2:4 sparse GEMMs stay bf16.

    recipe      forward operands   gradient operand dY   one scale per                  accumulation
    tensorwise  e4m3               e5m2                  tensor                         fast in the forward
    rowwise     e4m3               e4m3                  row of the reduction dim,      fast in the forward
                                                         rounded down to a power of 2

scale = fp8 max / max(amax, 1e-12) (float64, then float32: torchao's amax_to_scale); values are
scaled in fp32, saturated to +-max and cast; torch._scaled_mm takes the scales' reciprocals and
writes bf16. `mm_reference` computes the same product from the same float8 values in fp32.

Needs a GPU of compute capability >= 8.9 (training/float8.py checks); torch's CPU _scaled_mm
(torch >= 2.13) runs it in tests.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor on amax (float8_utils.EPS): an all-zero operand gets a finite scale


@dataclass(frozen=True)
class Recipe:
    rowwise: bool          # one scale per row of the reduction dim, else one per tensor
    grad_dtype: torch.dtype
    pow2_scales: bool      # scales rounded down to a power of 2 (exact in any dtype)


RECIPES = {"tensorwise": Recipe(False, E5M2, False), "rowwise": Recipe(True, E4M3, True)}


def to_float8(t: Tensor, dtype: torch.dtype, dim, pow2: bool) -> tuple[Tensor, Tensor]:
    """(t * scale cast to dtype, scale): amax over `dim` (kept as size 1; None: the whole tensor),
    as torchao's hp_tensor_to_float8_dynamic."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.double().clamp(min=EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype), scale


def _operands(a: Tensor, b: Tensor, recipe: str, grad: bool):
    """a, b in float8 and the reciprocals of their scales (what _scaled_mm multiplies by)."""
    r = RECIPES[recipe]
    # a [M, K] scaled per row, b [K, N] per column: both along K, the reduction
    a8, sa = to_float8(a, r.grad_dtype if grad else E4M3, 1 if r.rowwise else None, r.pow2_scales)
    b8, sb = to_float8(b, E4M3, 0 if r.rowwise else None, r.pow2_scales)
    return a8, sa.reciprocal(), b8, sb.reciprocal()


def mm(a: Tensor, b: Tensor, recipe: str, grad: bool = False) -> Tensor:
    """a [M, K] @ b [K, N] in float8, bf16 out. grad: `a` is an output gradient (dA = dY W2):
    torchao's gradient dtype and exact accumulation; else e4m3 and fast accumulation (forward)."""
    a8, sa, b8, sb = _operands(a.contiguous(), b, recipe, grad)
    if b8.stride(0) != 1:  # _scaled_mm takes b column-major
        b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=not grad)


def mm_reference(a: Tensor, b: Tensor, recipe: str, grad: bool = False) -> Tensor:
    """What mm computes, in fp32 on any device: the same float8 values, dequantized and multiplied."""
    a8, sa, b8, sb = _operands(a, b, recipe, grad)
    return (a8.float() * sa) @ (b8.float() * sb)
