"""A weight's two e4m3 conversions in two passes over it: srelu24's kept conversions of W1 and W2
under the tensorwise recipe (srelu24_kernels/srelu24/op.py, convert_weights), once per optimizer step.

Each fp32 weight W [R, C] feeds two GEMMs, each wanting its own e4m3 copy: W1 as Z's B (one scale
for the tensor, W1's own layout) and as dX's B (a power-of-2 scale per column, transposed); W2 as
Y's B (one per row, its own layout) and as dA's B (one for the tensor, transposed). Made one by one
(fp8_gemm.b_operand, fp8_sparse.kmajor_e4m3) they read W seven times in ten launches per layer;
here
    1. one pass takes the amaxes both casts need (row, column and tensor, as atomic maxima of
       |w|'s bits: NaN > inf > every finite value, so a NaN survives);
    2. one pass reads each tile once and writes both casts, one of them transposed,
so W is read twice, in three launches (with the amaxes' zero fill), and the casts may be written
into given tensors (a CUDA graph's kept buffers) rather than copied there.

Bit for bit the one-by-one conversions (tests/test_weight_casts.py): the tensor's scale is torchao's
amax_to_scale (fp8_gemm.amax_to_scale: float64 division, then float32), the rows' and columns' are
cast.pow2_scale; values are scaled in fp32, clamped to +-448 (NaN kept) and rounded to e4m3.
`weight_casts_reference` is the same in PyTorch.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .cast import COLUMN_AMAX_TILE, pow2_scale, pow2_scale_triton, scaled_cast_reference, to_float8_bits
from .gemm import amax_to_scale_reference, amax_to_scale_triton

E4M3 = torch.float8_e4m3fn
KINDS = {"tensor": 0, "rows": 1, "cols": 2}
AMAX_TILE = COLUMN_AMAX_TILE  # the fastest tile of a weight's column amaxes (cast.py)
CAST_TILE = (64, 64)   # as cast.scaled_cast's transposing tile


class Cast(NamedTuple):
    """One e4m3 copy of a weight: its values, its scale(s) and their reciprocals (float32; a 0-dim
    tensor for "tensor", one per row [R] or per column [C] otherwise)."""
    values: Tensor
    scale: Tensor
    inv: Tensor


@triton.jit
def _amax_kernel(w_ptr, rows_ptr, cols_ptr, tensor_ptr, R, C, ROWS: tl.constexpr, COLS: tl.constexpr,
                 TENSOR: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """The bits of max |w| over this program's BR x BC tile, atomically maxed into its rows', its
    columns' and the tensor's slots (each where asked)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (i[:, None] < R) & (j[None, :] < C)
    w = tl.load(w_ptr + i[:, None] * C + j[None, :], mask=m, other=0.0).to(tl.float32)
    bits = w.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |w| by its bits: a NaN's sign cleared too
    if ROWS:
        tl.atomic_max(rows_ptr + i, tl.max(bits, 1), mask=i < R)
    if COLS:
        tl.atomic_max(cols_ptr + j, tl.max(bits, 0), mask=j < C)
    if TENSOR:
        tl.atomic_max(tensor_ptr, tl.max(tl.max(bits, 1), 0))


@triton.jit
def _tensor_scale(tensor_ptr):
    """The tensor's scale from its amax bits, as a [1] tensor (fp8_gemm.amax_to_scale_triton)."""
    return amax_to_scale_triton(tl.load(tensor_ptr + tl.arange(0, 1)).to(tl.float32, bitcast=True), 448.0)


@triton.jit
def _pow2_scales(bits_ptr, k, n):
    """The power-of-2 scales (cast.pow2_scale) of the amaxes whose bits are at bits_ptr[k], k < n."""
    b = tl.load(bits_ptr + k, mask=k < n, other=0)
    return pow2_scale_triton(b.to(tl.float32, bitcast=True), b > 0x7F800000)


@triton.jit
def _cast_tile(w, kind: tl.constexpr, s_tensor, s_rows, s_cols):
    """The tile w [BR, BC] times the cast's scale (KINDS: 0 tensor, 1 rows, 2 columns), clamped to
    +-448 with NaN kept, rounded to e4m3 (its bits)."""
    if kind == 0:
        y = w * s_tensor[None, :]
    elif kind == 1:
        y = w * s_rows[:, None]
    else:
        y = w * s_cols[None, :]
    return to_float8_bits(tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), False)


@triton.jit
def _store_scales(kind: tl.constexpr, s_tensor, s_rows, s_cols, scale_ptr, inv_ptr, i, j, R, C):
    """This program's share of a cast's scales and their reciprocals (rounded as torch's): the
    tensor's by program (0, 0), the rows' by the first column of programs, the columns' by the first row."""
    first_i, first_j = tl.program_id(0) == 0, tl.program_id(1) == 0
    if kind == 0:
        if first_i & first_j:
            one = tl.arange(0, 1)
            tl.store(scale_ptr + one, s_tensor)
            tl.store(inv_ptr + one, tl.math.div_rn(tl.full([1], 1.0, tl.float32), s_tensor))
    elif kind == 1:
        if first_j:
            tl.store(scale_ptr + i, s_rows, mask=i < R)
            tl.store(inv_ptr + i, tl.math.div_rn(tl.full(s_rows.shape, 1.0, tl.float32), s_rows), mask=i < R)
    else:
        if first_i:
            tl.store(scale_ptr + j, s_cols, mask=j < C)
            tl.store(inv_ptr + j, tl.math.div_rn(tl.full(s_cols.shape, 1.0, tl.float32), s_cols), mask=j < C)


@triton.jit
def _cast_kernel(w_ptr, rows_ptr, cols_ptr, tensor_ptr, own_ptr, own_s_ptr, own_inv_ptr, t_ptr, t_s_ptr, t_inv_ptr,
                 R, C, OWN: tl.constexpr, TRANS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """w's tile cast per OWN into own [R, C], and per TRANS into t [C, R] (transposed in registers)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (i[:, None] < R) & (j[None, :] < C)
    w = tl.load(w_ptr + i[:, None] * C + j[None, :], mask=m, other=0.0).to(tl.float32)
    s_tensor = _tensor_scale(tensor_ptr)
    s_rows = _pow2_scales(rows_ptr, i, R)
    s_cols = _pow2_scales(cols_ptr, j, C)
    _store_scales(OWN, s_tensor, s_rows, s_cols, own_s_ptr, own_inv_ptr, i, j, R, C)
    _store_scales(TRANS, s_tensor, s_rows, s_cols, t_s_ptr, t_inv_ptr, i, j, R, C)
    tl.store(own_ptr + i[:, None] * C + j[None, :], _cast_tile(w, OWN, s_tensor, s_rows, s_cols), mask=m)
    qt = _cast_tile(w, TRANS, s_tensor, s_rows, s_cols)
    tl.store(t_ptr + j[:, None] * R + i[None, :], tl.trans(qt), mask=(j[:, None] < C) & (i[None, :] < R))


def _cast_into(name: str, given: Optional[Cast], kind: str, shape: tuple, r: int, c: int, device) -> Cast:
    """`given`'s tensors (checked), new ones where it has None or is None."""
    s = {"tensor": (), "rows": (r,), "cols": (c,)}[kind]
    want = ((shape, E4M3), (s, torch.float32), (s, torch.float32))
    got = given or Cast(None, None, None)
    fields = []
    for field, g, (shp, dtype) in zip(Cast._fields, got, want):
        if g is None:
            g = torch.empty(shp, dtype=dtype, device=device)
        elif g.shape != shp or g.dtype != dtype or not g.is_contiguous() or g.device != device:
            raise ValueError(f"weight_casts: out {name}.{field} must be a contiguous {dtype} {tuple(shp)} on {device}, "
                             f"got a{'' if g.is_contiguous() else ' strided'} {g.dtype} {tuple(g.shape)} on {g.device}")
        fields.append(g)
    return Cast(*fields)


def weight_casts(w: Tensor, own: str, trans: str,
                 out: tuple[Optional[Cast], Optional[Cast]] = (None, None)) -> tuple[Cast, Cast]:
    """w [R, C] (row-major, fp32 or bf16) in e4m3 twice: scaled per `own` in its own layout [R, C],
    and per `trans` transposed [C, R]; each kind "tensor", "rows" or "cols" (of w). `out`: tensors
    to write into (contiguous, shaped as returned; None: new ones), for the own and the transposed cast."""
    if own not in KINDS or trans not in KINDS:
        raise ValueError(f"weight_casts: scale kinds are {', '.join(KINDS)}; got own={own!r}, trans={trans!r}")
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"weight_casts needs a contiguous 2-D weight, got shape {tuple(w.shape)}, strides {w.stride()}")
    r, c = w.shape
    out = (_cast_into("own", out[0], own, (r, c), r, c, w.device),
           _cast_into("trans", out[1], trans, (c, r), r, c, w.device))
    if not w.numel():
        return out
    kinds = {own, trans}
    amax = torch.zeros(r + c + 1, dtype=torch.int32, device=w.device)  # rows, columns, tensor: one fill
    rows, cols, tensor = amax[:r], amax[r:r + c], amax[r + c:]
    br, bc = AMAX_TILE
    _amax_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](w, rows, cols, tensor, r, c, ROWS="rows" in kinds,
                                                            COLS="cols" in kinds, TENSOR="tensor" in kinds,
                                                            BR=br, BC=bc, num_warps=8)
    br, bc = CAST_TILE
    o, t = out
    _cast_kernel[(triton.cdiv(r, br), triton.cdiv(c, bc))](
        w, rows, cols, tensor, o.values.view(torch.uint8), o.scale, o.inv, t.values.view(torch.uint8), t.scale, t.inv,
        r, c, OWN=KINDS[own], TRANS=KINDS[trans], BR=br, BC=bc, num_warps=4)
    return out


def _reference_cast(w: Tensor, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """(w scaled per `kind` and cast, scale, inv), in PyTorch: fp8_gemm's tensorwise scale or
    cast.pow2_scale of the rows' or columns' amaxes, then cast.scaled_cast_reference."""
    if kind == "tensor":
        scale, inv = amax_to_scale_reference(w.float().abs().amax(), 448.0, pow2=False)
        return scaled_cast_reference(w, scale, E4M3), scale, inv
    s = pow2_scale(w.float().abs().amax(1 if kind == "rows" else 0))
    return scaled_cast_reference(w, s[:, None] if kind == "rows" else s[None, :], E4M3), s, s.reciprocal()


def weight_casts_reference(w: Tensor, own: str, trans: str) -> tuple[Cast, Cast]:
    """weight_casts in PyTorch."""
    q, s, inv = _reference_cast(w, own)
    qt, st, invt = _reference_cast(w, trans)
    return Cast(q, s, inv), Cast(qt.t().contiguous(), st, invt)
