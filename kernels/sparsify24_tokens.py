"""Token-dimension 2:4 for the weight gradients: S(V)^T in cuSPARSELt's sm90 layout.

dW2 = dY^T S(A24) and dW1 = S(dZ)^T X reduce over tokens, so their sparse operand is
S(V)^T [F, T]: V's tokens permuted, each feature's column 2:4 along tokens, transposed. One
pass over Z (and dA for dZ) builds it: it recomputes A = relu(Z)^2 and the forward 2:4 mask
along features, forms V (A24, or dZ = dA * 2 relu(Z) [* mask]), zeroes the dense features
(their weight-gradient columns come from a dense GEMM), selects 2 of every 4 tokens per
feature, and writes values + metadata. Reference: `sparsify_tokens_reference`.

Grid: (token chunk of 32, group of BANDS 64-feature bands). Per band and b = 0, 1 the program
reads, for each position q of a feature group, an [8 features, 32 tokens] tile: features
16c + 8b + 4ga + q (c < 4, ga < 2), i.e. output rows p = 8c + 4ga + q of the metadata tile.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from model.sparse24 import mask_2to4

from .cslt_layout import compress, compressed_numel
from .sparsify24 import round_to_bf16, top2_of_4


def padded_tokens(t: int) -> int:
    return (t + 31) // 32 * 32


def a24_reference(z: Tensor) -> Tensor:
    a = F.relu(z).square()
    return a * mask_2to4(a)


def dz_reference(da: Tensor, z: Tensor, reuse_forward_mask: bool) -> Tensor:
    dz = da * (2 * F.relu(z))
    # where, not *: a masked negative value is +0 (as the kernel writes), not -0
    return torch.where(mask_2to4(F.relu(z).square()), dz, 0.0) if reuse_forward_mask else dz


def sparsify_tokens_reference(v: Tensor, perm: Optional[Tensor], dense: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(Compressed S(V)^T [F, Tp] of V [T, F]: rows permuted, dense feature columns zeroed,
    2:4 along tokens (zero tokens pad T to a multiple of 32), transposed; and V^T of the
    dense features [k, Tp], rows in `dense` order, tokens permuted)."""
    if perm is not None:
        v = v[perm]
    vt = F.pad(v, (0, 0, 0, padded_tokens(v.shape[0]) - v.shape[0])).t().contiguous()
    full = vt[dense] if dense is not None else vt[:0]
    if dense is not None:
        vt[dense] = 0
    return compress(vt, mask_2to4(vt)), full


@triton.jit
def _tile(ptr, rows, feats, stride, valid):
    """[features, tokens] tile of a [T, F] tensor, as fp32."""
    return tl.load(ptr + rows[None, :] * stride + feats[:, None], mask=valid[None, :], other=0.0).to(tl.float32)


@triton.jit
def _token_select(v, rows_f, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, bshift, hshift):
    """2:4 along tokens of an [8 features, 32 tokens] tile; stores the kept values and
    returns the metadata words' contribution [8, 4]. Dense features (slot >= 0) are written
    whole to full[slot] and zeroed in the sparse operand."""
    slot = tl.load(slot_ptr + rows_f)
    dense = slot >= 0
    tl.store(full_ptr + slot[:, None] * Tp + tok[None, :], v.to(tl.bfloat16), mask=dense[:, None])
    v = tl.where(dense[:, None], 0.0, v)
    lo, hi = tl.split(tl.reshape(v, [8, 8, 2, 2]))  # [feature, token group, q >> 1, q & 1]
    t0, t2 = tl.split(lo)
    t1, t3 = tl.split(hi)
    k0, k1, k2, k3, p0, p1, x0, x1 = top2_of_4(t0, t1, t2, t3)
    vals = tl.reshape(tl.join(x0, x1), [8, 16]).to(tl.bfloat16)
    tl.store(val_ptr + rows_f[:, None] * (Tp // 2) + vcols[None, :], vals)
    nib = tl.reshape(p0 | (p1 << 2), [8, 2, 4])  # [feature, h, m]
    return tl.sum(nib << (hshift + bshift), axis=1)


@triton.jit
def _store_words(meta_ptr, tile, prow, m, w0, w1, w2, w3):
    base = meta_ptr + tile + m[None, :]
    tl.store(base + (prow + 0)[:, None] * 4, w0.to(tl.int16))
    tl.store(base + (prow + 1)[:, None] * 4, w1.to(tl.int16))
    tl.store(base + (prow + 2)[:, None] * 4, w2.to(tl.int16))
    tl.store(base + (prow + 3)[:, None] * 4, w3.to(tl.int16))


@triton.jit
def _sparsify_tokens_kernel(z_ptr, da_ptr, perm_ptr, slot_ptr, full_ptr, val_ptr, meta_ptr, T, Tp, stride_z,
                            stride_da, MODE: tl.constexpr, REUSE: tl.constexpr, BANDS: tl.constexpr):
    """MODE 0: S(A24)^T; 1: S(dZ)^T."""
    kc = tl.program_id(0)
    tok = kc * 32 + tl.arange(0, 32)
    valid = tok < T
    src = tl.load(perm_ptr + tok, mask=valid, other=0)    # permuted token order
    ca = tl.arange(0, 8)                                  # (c, ga) = (ca // 2, ca % 2)
    m = tl.arange(0, 4)
    hshift = 8 * tl.arange(0, 2)[None, :, None]
    vcols = kc * 16 + tl.arange(0, 16)
    prow = (ca // 2) * 8 + (ca % 2) * 4                   # metadata row p of q = 0
    for i in range(BANDS):
        band = tl.program_id(1) * BANDS + i
        w0 = tl.zeros([8, 4], dtype=tl.int32)
        w1 = tl.zeros([8, 4], dtype=tl.int32)
        w2 = tl.zeros([8, 4], dtype=tl.int32)
        w3 = tl.zeros([8, 4], dtype=tl.int32)
        for b in tl.static_range(2):
            f0 = band * 64 + (ca // 2) * 16 + b * 8 + (ca % 2) * 4   # feature of q = 0 in each group
            z0, z1 = _tile(z_ptr, src, f0, stride_z, valid), _tile(z_ptr, src, f0 + 1, stride_z, valid)
            z2, z3 = _tile(z_ptr, src, f0 + 2, stride_z, valid), _tile(z_ptr, src, f0 + 3, stride_z, valid)
            r0, r1, r2, r3 = tl.maximum(z0, 0.0), tl.maximum(z1, 0.0), tl.maximum(z2, 0.0), tl.maximum(z3, 0.0)
            a0, a1 = round_to_bf16(r0 * r0), round_to_bf16(r1 * r1)
            a2, a3 = round_to_bf16(r2 * r2), round_to_bf16(r3 * r3)
            fk0, fk1, fk2, fk3, _p0, _p1, _x0, _x1 = top2_of_4(a0, a1, a2, a3)  # the forward mask
            if MODE == 0:  # A24
                v0, v1, v2, v3 = a0 * fk0, a1 * fk1, a2 * fk2, a3 * fk3
                w0 += _token_select(v0, f0, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w1 += _token_select(v1, f0 + 1, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w2 += _token_select(v2, f0 + 2, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w3 += _token_select(v3, f0 + 3, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
            if MODE == 1:  # dZ = dA * 2 relu(Z), rounded once as torch does, [* forward mask]
                d0 = round_to_bf16(_tile(da_ptr, src, f0, stride_da, valid) * (2 * r0))
                d1 = round_to_bf16(_tile(da_ptr, src, f0 + 1, stride_da, valid) * (2 * r1))
                d2 = round_to_bf16(_tile(da_ptr, src, f0 + 2, stride_da, valid) * (2 * r2))
                d3 = round_to_bf16(_tile(da_ptr, src, f0 + 3, stride_da, valid) * (2 * r3))
                if REUSE:
                    d0, d1, d2, d3 = tl.where(fk0, d0, 0.0), tl.where(fk1, d1, 0.0), tl.where(fk2, d2, 0.0), tl.where(fk3, d3, 0.0)
                w0 += _token_select(d0, f0, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w1 += _token_select(d1, f0 + 1, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w2 += _token_select(d2, f0 + 2, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
                w3 += _token_select(d3, f0 + 3, slot_ptr, full_ptr, tok, val_ptr, vcols, Tp, 4 * b, hshift)
        tile = (band * (Tp // 32) + kc) * 128
        _store_words(meta_ptr, tile, prow, m, w0, w1, w2, w3)


def check_tokens_input(z: Tensor, da: Optional[Tensor]) -> int:
    """Tp, the token count padded to 32, after checking z (and da) can be indexed by the kernels."""
    T, Fh = z.shape
    if Fh % 64:
        raise ValueError(f"sparsify_tokens needs the feature count to be a multiple of 64, got {Fh}")
    if z.dtype != torch.bfloat16 or z.stride(1) != 1 or (da is not None and (da.shape != z.shape or da.stride(1) != 1)):
        raise ValueError("sparsify_tokens needs row-major bf16 z (and da of the same shape)")
    Tp = padded_tokens(T)
    if Tp * max(z.stride(0), Fh) >= 2**31:  # offsets: token * stride, feature * Tp
        raise ValueError(f"sparsify_tokens indexes with int32: [{T}, {Fh}] is too large")
    return Tp


def dense_slots(dense: Optional[Tensor], Fh: int, device) -> tuple[Tensor, int]:
    """[F] int32: each dense feature's row in the [k, Tp] dense buffer, -1 for the others; and k."""
    slots = torch.full((Fh,), -1, dtype=torch.int32, device=device)
    k = 0 if dense is None else dense.numel()
    if k:
        slots[dense] = torch.arange(k, dtype=torch.int32, device=device)
    return slots, k


def _outputs(Fh: int, Tp: int, k: int, device) -> tuple[Tensor, Tensor]:
    full = torch.zeros(max(k, 1), Tp, dtype=torch.bfloat16, device=device)  # padding tokens stay 0
    return torch.empty(compressed_numel(Fh, Tp), dtype=torch.bfloat16, device=device), full


def _launch(z, da, perm, dense, mode: int, reuse: bool, bands: int, num_warps: int) -> tuple[Tensor, Tensor]:
    T, Fh = z.shape
    Tp = check_tokens_input(z, da)
    order = (perm if perm is not None else torch.arange(T, device=z.device)).to(torch.int32)
    slots, k = dense_slots(dense, Fh, z.device)
    buf, full = _outputs(Fh, Tp, k, z.device)
    n_bands = Fh // 64
    bands = next(b for b in (bands, 4, 2, 1) if n_bands % b == 0)
    da_ = da if da is not None else z
    _sparsify_tokens_kernel[(Tp // 32, n_bands // bands)](
        z, da_, order, slots, full, buf, buf[Fh * Tp // 2:].view(torch.int16), T, Tp, z.stride(0), da_.stride(0),
        MODE=mode, REUSE=reuse, BANDS=bands, num_warps=num_warps)
    return buf.view(Fh, -1), full[:k]


def sparsify_tokens(z: Tensor, perm: Optional[Tensor], dense: Optional[Tensor], da: Optional[Tensor] = None,
                    reuse_forward_mask: bool = True, bands: int = 4, num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """Fused S(V)^T, V = A24 of z (da None) or dZ of (da, z). z, da: [T, F] row-major bf16,
    F % 64 == 0; perm: [T] token order (None: identity); dense: feature indices kept dense.
    Returns (compressed S(V)^T [F, 9 Tp / 16], V^T of the dense features [k, Tp], permuted)."""
    return _launch(z, da, perm, dense, 0 if da is None else 1, reuse_forward_mask, bands, num_warps)
