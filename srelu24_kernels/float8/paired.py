"""A matrix's two float8 conversions in two passes over it, for srelu24's op under the tensorwise
recipe (srelu24_kernels/srelu24/op.py), where one matrix feeds two GEMMs that each want their own copy:

    W1 [F, d]  Z's B: e4m3, one scale, own layout;     dX's B: e4m3, a scale per column, transposed
    W2 [d, F]  Y's B: e4m3, a scale per row, own;      dA's B: e4m3, one scale, transposed
    dY [T, d]  dA's A: e5m2, one scale, own layout;    dW2's B: e4m3, a scale per column, transposed

(the weights' once per optimizer step, convert_weights; dY's in each backward, where the 2:4 GEMMs
are e4m3). Made one by one (fp8_gemm's operands, fp8_sparse.kmajor_e4m3) each conversion reads the
matrix twice (an amax, then the cast) in three or four launches; here
    1. one pass takes the amaxes both casts need (row, column and tensor, as atomic maxima of
       |x|'s bits: NaN > inf > every finite value, so a NaN survives);
    2. one pass reads each tile once and writes both casts, one of them transposed,
so the matrix is read twice, in three launches (with the amaxes' zero fill), and the casts may be
written into given tensors (a CUDA graph's kept buffers) rather than copied there.

Bit for bit the one-by-one conversions (tests/test_paired_casts.py): a tensor's scale is torchao's
amax_to_scale for its format (fp8_gemm.amax_to_scale: float64 division, then float32), the rows'
and columns' are cast.pow2_scale (e4m3's); values are scaled in fp32, clamped to the format's
largest value (NaN kept) and rounded. `paired_casts_reference` is the same in PyTorch.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .cast import COLUMN_AMAX_TILE, pow2_scale, pow2_scale_triton, scaled_cast_reference, to_float8_bits
from .gemm import amax_to_scale_reference, amax_to_scale_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KINDS = {"tensor": 0, "rows": 1, "cols": 2}
AMAX_TILE = COLUMN_AMAX_TILE  # the fastest tile of a weight's column amaxes (cast.py)
CAST_TILE = (64, 64)   # as cast.scaled_cast's transposing tile


class Cast(NamedTuple):
    """One float8 copy of a matrix: its values, its scale(s) and their reciprocals (float32; a 0-dim
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
def _tensor_scale(tensor_ptr, E5M2: tl.constexpr):
    """The tensor's scale for the format from its amax bits, as a [1] tensor (fp8_gemm.amax_to_scale_triton)."""
    return amax_to_scale_triton(tl.load(tensor_ptr + tl.arange(0, 1)).to(tl.float32, bitcast=True),
                                57344.0 if E5M2 else 448.0)


@triton.jit
def _pow2_scales(bits_ptr, k, n):
    """The power-of-2 scales (cast.pow2_scale) of the amaxes whose bits are at bits_ptr[k], k < n."""
    b = tl.load(bits_ptr + k, mask=k < n, other=0)
    return pow2_scale_triton(b.to(tl.float32, bitcast=True), b > 0x7F800000)


@triton.jit
def _cast_tile(w, kind: tl.constexpr, s_tensor, s_rows, s_cols, E5M2: tl.constexpr):
    """The tile w [BR, BC] times the cast's scale (KINDS: 0 tensor, 1 rows, 2 columns), clamped to
    the format's largest value with NaN kept, rounded to e4m3 (e5m2: E5M2), as bytes."""
    if kind == 0:
        y = w * s_tensor[None, :]
    elif kind == 1:
        y = w * s_rows[:, None]
    else:
        y = w * s_cols[None, :]
    fmax = 57344.0 if E5M2 else 448.0
    return to_float8_bits(tl.clamp(y, -fmax, fmax, propagate_nan=tl.PropagateNan.ALL), E5M2)


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
                 R, C, OWN: tl.constexpr, TRANS: tl.constexpr, OWN_E5M2: tl.constexpr, TRANS_E5M2: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr):
    """w's tile cast per OWN into own [R, C], and per TRANS into t [C, R] (transposed in registers);
    each in e4m3, or e5m2 where its *_E5M2 (a "tensor" kind only: the tensor's scale is the format's)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (i[:, None] < R) & (j[None, :] < C)
    w = tl.load(w_ptr + i[:, None] * C + j[None, :], mask=m, other=0.0).to(tl.float32)
    s_own = _tensor_scale(tensor_ptr, OWN_E5M2)
    s_trans = _tensor_scale(tensor_ptr, TRANS_E5M2)
    s_rows = _pow2_scales(rows_ptr, i, R)
    s_cols = _pow2_scales(cols_ptr, j, C)
    _store_scales(OWN, s_own, s_rows, s_cols, own_s_ptr, own_inv_ptr, i, j, R, C)
    _store_scales(TRANS, s_trans, s_rows, s_cols, t_s_ptr, t_inv_ptr, i, j, R, C)
    tl.store(own_ptr + i[:, None] * C + j[None, :], _cast_tile(w, OWN, s_own, s_rows, s_cols, OWN_E5M2), mask=m)
    qt = _cast_tile(w, TRANS, s_trans, s_rows, s_cols, TRANS_E5M2)
    tl.store(t_ptr + j[:, None] * R + i[None, :], tl.trans(qt), mask=(j[:, None] < C) & (i[None, :] < R))


def _cast_into(name: str, given: Optional[Cast], kind: str, dtype: torch.dtype, shape: tuple, r: int, c: int,
               device) -> Cast:
    """`given`'s tensors (checked), new ones where it has None or is None."""
    s = {"tensor": (), "rows": (r,), "cols": (c,)}[kind]
    want = ((shape, dtype), (s, torch.float32), (s, torch.float32))
    got = given or Cast(None, None, None)
    fields = []
    for field, g, (shp, dtype) in zip(Cast._fields, got, want):
        if g is None:
            g = torch.empty(shp, dtype=dtype, device=device)
        elif g.shape != shp or g.dtype != dtype or not g.is_contiguous() or g.device != device:
            raise ValueError(f"paired_casts: out {name}.{field} must be a contiguous {dtype} {tuple(shp)} on {device}, "
                             f"got a{'' if g.is_contiguous() else ' strided'} {g.dtype} {tuple(g.shape)} on {g.device}")
        fields.append(g)
    return Cast(*fields)


def paired_casts(w: Tensor, own: str, trans: str, out: tuple[Optional[Cast], Optional[Cast]] = (None, None),
                 dtypes: tuple[torch.dtype, torch.dtype] = (E4M3, E4M3)) -> tuple[Cast, Cast]:
    """w [R, C] (row-major, fp32 or bf16) in float8 twice: scaled per `own` in its own layout [R, C],
    and per `trans` transposed [C, R]; each kind "tensor", "rows" or "cols" (of w), in its format of
    `dtypes` (e5m2 for a "tensor" kind only: the rows' and columns' power-of-2 scales are e4m3's).
    `out`: tensors to write into (contiguous, shaped as returned; None: new ones), for the own and
    the transposed cast."""
    if own not in KINDS or trans not in KINDS:
        raise ValueError(f"paired_casts: scale kinds are {', '.join(KINDS)}; got own={own!r}, trans={trans!r}")
    if any(d not in (E4M3, E5M2) or (d == E5M2 and k != "tensor") for d, k in zip(dtypes, (own, trans))):
        raise ValueError(f"paired_casts: formats are float8_e4m3fn, or float8_e5m2 for a tensor's scale; got "
                         f"{dtypes[0]} for {own!r}, {dtypes[1]} for {trans!r}")
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"paired_casts needs a contiguous 2-D matrix, got shape {tuple(w.shape)}, strides {w.stride()}")
    r, c = w.shape
    out = (_cast_into("own", out[0], own, dtypes[0], (r, c), r, c, w.device),
           _cast_into("trans", out[1], trans, dtypes[1], (c, r), r, c, w.device))
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
        r, c, OWN=KINDS[own], TRANS=KINDS[trans], OWN_E5M2=dtypes[0] == E5M2, TRANS_E5M2=dtypes[1] == E5M2,
        BR=br, BC=bc, num_warps=4)
    return out


def _reference_cast(w: Tensor, kind: str, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(w scaled per `kind` and cast, scale, inv), in PyTorch: fp8_gemm's tensorwise scale or
    cast.pow2_scale of the rows' or columns' amaxes, then cast.scaled_cast_reference."""
    if kind == "tensor":
        scale, inv = amax_to_scale_reference(w.float().abs().amax(), torch.finfo(dtype).max, pow2=False)
        return scaled_cast_reference(w, scale, dtype), scale, inv
    s = pow2_scale(w.float().abs().amax(1 if kind == "rows" else 0))
    return scaled_cast_reference(w, s[:, None] if kind == "rows" else s[None, :], dtype), s, s.reciprocal()


def paired_casts_reference(w: Tensor, own: str, trans: str,
                           dtypes: tuple[torch.dtype, torch.dtype] = (E4M3, E4M3)) -> tuple[Cast, Cast]:
    """paired_casts in PyTorch."""
    q, s, inv = _reference_cast(w, own, dtypes[0])
    qt, st, invt = _reference_cast(w, trans, dtypes[1])
    return Cast(q, s, inv), Cast(qt.t().contiguous(), st, invt)
