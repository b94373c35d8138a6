"""The srelu24 backward's three sparse operands from one pass over Z and dA.

With the forward mask re-used, the backward needs (tokens permuted by `perm`):

    dZ   compressed along features at the forward's positions, rows in permuted order
         (dX = dZ W1 then comes out permuted; the caller gathers its rows back)
    S(A24)^T, S(dZ)^T  2:4 along tokens, transposed (dW2 = dY^T S(A24), dW1 = S(dZ)^T X), the
         dense features zeroed there and their exact values written to [k, Tp] buffers

Three separate kernels (this project's previous version) read Z three times and dA twice, and
were measurably slower than this one pass (benchmarks/RESULTS.md). Here one program reads
a [32 tokens, 64 features] tile of Z and dA (gathered rows, 128-byte contiguous), recomputes
the forward mask along features, writes the dZ operand from the tile
as it is, transposes the tile in registers and writes both token-dimension operands.
Reference: `backward_operands_reference`, which the kernel must match bit for bit for finite
inputs (NaN or Inf in dA, NaN in Z, and the sign of zeros made from a -0.0 in Z may differ: the
kernel takes max(z, 0) where torch's relu can keep -0.0).

A CUDA C++ version of the same pass (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu, `make kernels`) is used
instead when it is built, in a variant that reads the forward's compressed A24 in place of Z
(`backward_operands_from_a24`: the FFN then keeps 9/16 of Z's bytes for its backward): this Triton kernel is instruction-bound, because cuSPARSELt's 2:4 metadata
layout packs nibbles of rows 8 apart into one word, which costs Triton cross-thread reductions
and layout conversions; the CUDA kernel moves the tile once through shared memory. Both must
equal the reference bit for bit.
"""
import ctypes
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..cusparselt.layout import (COLS_PER_CHUNK, E4M3_COLS_PER_CHUNK, ROWS_PER_BAND, compress, compressed_bytes_e4m3,
                                 compressed_numel, empty_compressed, pad_rows, padded)
from .native import KERNELS, kernels_usable, launch, use_cuda
from .reference import mask_2to4
from .sparsify import round_to_bf16, top2_of_4


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
    vt = pad_rows(v, COLS_PER_CHUNK).t().contiguous()
    full = vt[dense] if dense is not None else vt[:0]
    if dense is not None:
        vt[dense] = 0
    return compress(vt, mask_2to4(vt)), full


def check_tokens_input(z: Tensor, da: Optional[Tensor]) -> int:
    """Tp, the token count padded to 32, after checking z (and da) can be indexed by the kernels."""
    T, Fh = z.shape
    if Fh % 64:
        raise ValueError(f"backward_operands needs the feature count to be a multiple of 64, got {Fh}")
    if z.dtype != torch.bfloat16 or z.stride(1) != 1 or (da is not None and (
            da.shape != z.shape or da.stride(1) != 1 or da.dtype != torch.bfloat16 or da.device != z.device)):
        raise ValueError("backward_operands needs row-major bf16 z (and da of the same shape, dtype and device)")
    Tp = padded(T, COLS_PER_CHUNK)
    if Tp * max(z.stride(0), Fh) >= 2**31:  # offsets: token * stride, feature * Tp
        raise ValueError(f"backward_operands indexes with int32: [{T}, {Fh}] is too large")
    return Tp


def dense_slots(dense: Optional[Tensor], Fh: int, device) -> tuple[Tensor, int]:
    """[F] int32: each dense feature's row in the [k, Tp] dense buffer, -1 for the others; and k."""
    slots = torch.full((Fh,), -1, dtype=torch.int32, device=device)
    k = 0 if dense is None else dense.numel()
    if k:
        slots[dense] = torch.arange(k, dtype=torch.int32, device=device)
    return slots, k


def dz_sparsify_2to4_reference(z: Tensor, da: Tensor) -> Tensor:
    """Compressed dZ = dA * 2 relu(Z), at the positions the forward 2:4 kept (rows padded to 64)."""
    a = F.relu(z).square()
    keep = mask_2to4(a)
    dz = da * (2 * F.relu(z))
    pad = padded(z.shape[0], ROWS_PER_BAND) - z.shape[0]
    keep_p = F.pad(keep, (0, 0, 0, pad))
    if pad:
        keep_p[z.shape[0]:] = mask_2to4(torch.zeros_like(keep_p[z.shape[0]:], dtype=a.dtype))
    return compress(F.pad(dz, (0, 0, 0, pad)), keep_p)


def backward_operands_reference(z: Tensor, da: Tensor, perm: Optional[Tensor], dense: Optional[Tensor],
                                reuse_forward_mask: bool = True):
    """(compressed dZ of the permuted rows [padded(T, ROWS_PER_BAND), 9F/16] (None without
    reuse_forward_mask: dZ is not 2:4 then), (S(A24)^T, A24^T of the dense features),
    (S(dZ)^T, dZ^T of the dense features))."""
    zp, dap = (z[perm], da[perm]) if perm is not None else (z, da)
    return (dz_sparsify_2to4_reference(zp, dap) if reuse_forward_mask else None,
            sparsify_tokens_reference(a24_reference(z), perm, dense),
            sparsify_tokens_reference(dz_reference(da, z, reuse_forward_mask), perm, dense))


@triton.jit
def _split4(x):
    """[R, 4G] -> the four [R, G] slices of feature (or token) position q = 0..3 in each group of 4."""
    R: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1] // 4
    lo, hi = tl.split(tl.reshape(x, [R, G, 2, 2]))  # [.., q >> 1, q & 1]
    x0, x2 = tl.split(lo)
    x1, x3 = tl.split(hi)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3):
    """Inverse of _split4."""
    R: tl.constexpr = x0.shape[0]
    G: tl.constexpr = x0.shape[1]
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [R, 4 * G])


@triton.jit
def _token_operand(v, dense, slot, feats, tok, store_ok, val_ptr, meta_ptr, full_ptr, band, kc, Tp):
    """S(V)^T for one [32 tokens, 64 features] tile: dense features to full[slot] and zeroed,
    2:4 along tokens, one 64x32 metadata tile (rows = features 16c + 8b + a, groups 4h + m).
    Transposed and selected in bf16 (exact: the values are bf16 already; 2% faster than fp32)."""
    tl.store(full_ptr + slot[None, :] * Tp + tok[:, None], v.to(tl.bfloat16), mask=dense[None, :] & store_ok)
    vt = tl.trans(tl.where(dense[None, :], 0.0, v).to(tl.bfloat16))  # [64 features, 32 tokens]
    t0, t1, t2, t3 = _split4(vt)
    _k0, _k1, _k2, _k3, p0, p1, x0, x1 = top2_of_4(t0, t1, t2, t3)
    vcols = kc * 16 + tl.arange(0, 16)
    tl.store(val_ptr + feats[:, None] * (Tp // 2) + vcols[None, :],
             tl.reshape(tl.join(x0, x1), [64, 16]).to(tl.bfloat16), mask=store_ok)
    nib = tl.reshape(p0 | (p1 << 2), [4, 2, 8, 2, 4])              # [c, b, a, h, m]
    shift = 4 * (tl.arange(0, 2)[None, :, None, None, None] + 2 * tl.arange(0, 2)[None, None, None, :, None])
    words = tl.sum(tl.sum(nib << shift, axis=3), axis=1)          # [c, a, m]; bits never overlap
    c = tl.arange(0, 4)[:, None, None]
    a = tl.arange(0, 8)[None, :, None]
    m = tl.arange(0, 4)[None, None, :]
    tile = (band * (Tp // 32) + kc) * 128
    tl.store(meta_ptr + tile + 4 * (8 * c + a) + m, words.to(tl.int16), mask=store_ok)


@triton.jit
def _backward_operands_kernel(z_ptr, da_ptr, order_ptr, slot_ptr, dzv_ptr, dzm_ptr, av_ptr, am_ptr, afull_ptr,
                              gv_ptr, gm_ptr, gfull_ptr, T, Tp, F, stride_z, stride_da, REUSE: tl.constexpr,
                              BANDS: tl.constexpr):
    """Program (32-token chunk kc, group of BANDS 64-feature bands). Tokens >= T read as zeros;
    chunks past Tp (dZ's rows are padded to 64, the token operands to 32) write only dZ.
    Without REUSE (the ablation) dZ is not masked and its feature-dimension operand not written."""
    kc = tl.program_id(0)
    i = tl.arange(0, 32)
    tok = kc * 32 + i
    valid = tok < T
    src = tl.load(order_ptr + tok, mask=valid, other=0)
    store_ok = kc * 32 < Tp
    for j in range(BANDS):
        band = tl.program_id(1) * BANDS + j
        feats = band * 64 + tl.arange(0, 64)
        offs = src[:, None] * stride_z + feats[None, :]
        z = tl.load(z_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        da = tl.load(da_ptr + src[:, None] * stride_da + feats[None, :], mask=valid[:, None], other=0.0)
        r = tl.maximum(z, 0.0)
        a = round_to_bf16(r * r)
        dz = round_to_bf16(da.to(tl.float32) * (2 * r))           # rounded once, as torch does
        a0, a1, a2, a3 = _split4(a)
        k0, k1, k2, k3, p0, p1, _x0, _x1 = top2_of_4(a0, a1, a2, a3)  # the forward mask
        d0, d1, d2, d3 = _split4(dz)

        if REUSE:  # dZ along features at the forward positions: rows kc*32 + i of the permuted order
            x0 = tl.where(p0 == 0, d0, tl.where(p0 == 1, d1, d2))
            x1 = tl.where(p1 == 3, d3, tl.where(p1 == 2, d2, d1))
            tl.store(dzv_ptr + tok[:, None] * (F // 2) + band * 32 + tl.arange(0, 32)[None, :],
                     tl.reshape(tl.join(x0, x1), [32, 32]).to(tl.bfloat16))
            # metadata: row i = 16c' + 8b + a of the half band kc % 2, group g = 8 ch + 4h + m
            nib = tl.reshape(p0 | (p1 << 2), [2, 2, 8, 2, 2, 4])  # [c', b, a, ch, h, m]
            shift = 4 * (tl.arange(0, 2)[None, :, None, None, None, None]
                         + 2 * tl.arange(0, 2)[None, None, None, None, :, None])
            words = tl.sum(tl.sum(nib << shift, axis=4), axis=1)  # [c', a, ch, m]
            c = (kc % 2) * 2 + tl.arange(0, 2)[:, None, None, None]
            a_ = tl.arange(0, 8)[None, :, None, None]
            ch = tl.arange(0, 2)[None, None, :, None]
            m = tl.arange(0, 4)[None, None, None, :]
            tile = ((kc // 2) * (F // 32) + band * 2 + ch) * 128
            tl.store(dzm_ptr + tile + 4 * (8 * c + a_) + m, words.to(tl.int16))

        # token-dimension operands of A24 and of dZ, both under the forward mask
        keep = _join4(k0.to(tl.int8), k1.to(tl.int8), k2.to(tl.int8), k3.to(tl.int8)) != 0
        slot = tl.load(slot_ptr + feats)
        dense = slot >= 0
        _token_operand(tl.where(keep, a, 0.0), dense, slot, feats, tok, store_ok, av_ptr, am_ptr, afull_ptr,
                       band, kc, Tp)
        _token_operand(tl.where(keep, dz, 0.0) if REUSE else dz, dense, slot, feats, tok, store_ok, gv_ptr, gm_ptr,
                       gfull_ptr, band, kc, Tp)


def cuda_usable(z: Tensor, da: Tensor, reuse_forward_mask: bool = True) -> bool:
    """The CUDA kernel can run these inputs: built (make kernels), an sm80/sm90 GPU, the forward
    mask re-used (the ablation without it is Triton's), 16-byte aligned rows, at most 65535
    64-feature bands (the grid's y limit)."""
    return reuse_forward_mask and z.shape[1] // 64 <= 65535 and kernels_usable(z, da)


_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_CUDA_ARGS = [_P] * 12 + [_I, _I, _I, _I, _I64, _I64]
_CUDA_A24_ARGS = [_P] * 15 + [_I, _I, _I, _I, _I64]


def _token_order(perm: Optional[Tensor], T: int, device) -> Tensor:
    return (perm if perm is not None else torch.arange(T, device=device)).to(device, torch.int32)


def _checked_slots(slots: Optional[Tensor], dense: Optional[Tensor], Fh: int, device) -> tuple[Tensor, int]:
    """dense_slots(dense, F) and k, or the caller's slots after checking they can be."""
    if slots is None:
        return dense_slots(dense, Fh, device)
    # the kernels write k dense rows by it: it must be dense_slots(dense, F) (not checked: data)
    if dense is None or tuple(slots.shape) != (Fh,) or slots.dtype != torch.int32 or not slots.is_contiguous() \
            or slots.device != device:
        raise ValueError(f"backward_operands: slots must be dense_slots(dense, {Fh}) (int32 [{Fh}] on {device}, "
                         f"with dense given), got {slots.dtype} {tuple(slots.shape)} on {slots.device}"
                         f"{' and dense None' if dense is None else ''}")
    return slots, dense.numel()


def _outputs(Tr: int, Tp: int, Fh: int, k: int, reuse_forward_mask: bool, device, a_e4m3: bool = False):
    """The pass's output buffers: dZ's (values then metadata; a stub without the forward mask),
    and (compressed, dense rows) for each token-dimension operand (a_e4m3: S(A24)^T's compressed
    buffer as e4m3 bytes, uint8)."""
    # without the forward mask dZ is not 2:4 and the kernel writes no feature-dimension operand
    dz_buf = empty_compressed(compressed_numel(Tr, Fh) if reuse_forward_mask else 64, torch.bfloat16, device)
    outs = []
    for i in range(2):
        # every column < Tp of the dense rows is written (padding tokens as zeros)
        full = torch.empty(max(k, 1), Tp, dtype=torch.bfloat16, device=device)
        buf = (empty_compressed(compressed_bytes_e4m3(Fh, Tp), torch.uint8, device) if a_e4m3 and i == 0
               else empty_compressed(compressed_numel(Fh, Tp), torch.bfloat16, device))
        outs.append((buf, full))
    return dz_buf, outs


def _meta(buf: Tensor, rows: int, cols: int) -> Tensor:
    """The metadata words of a compressed [rows, cols] operand: they follow its values."""
    return buf.view(-1)[rows * cols // 2:].view(torch.int16)


def _results(dz_buf, outs, Tr: int, Fh: int, k: int, reuse_forward_mask: bool):
    (a_buf, a_full), (g_buf, g_full) = outs
    dz = dz_buf.view(Tr, -1) if reuse_forward_mask else None
    return dz, (a_buf.view(Fh, -1), a_full[:k]), (g_buf.view(Fh, -1), g_full[:k])


def backward_operands(z: Tensor, da: Tensor, perm: Optional[Tensor], dense: Optional[Tensor],
                      reuse_forward_mask: bool = True, bands: int = 1, num_warps: int = 8, backend: str = "auto",
                      slots: Optional[Tensor] = None):
    """Fused backward_operands_reference. z, da: [T, F] row-major bf16, F % 64 == 0; perm: [T]
    token order (None: identity); dense: feature indices kept dense (None: none); slots:
    dense_slots(dense, F) where the caller has them already.
    backend: "cuda" (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu), "triton", or "auto": cuda where
    `cuda_usable`, else triton. bands, num_warps: the Triton launch; the defaults were the fastest
    of bands 1-8 x warps 4-16 on the H200 at 1B and 7B (benchmarks/RESULTS.md)."""
    T, Fh = z.shape
    Tp = check_tokens_input(z, da)
    Tr = padded(T, ROWS_PER_BAND)
    if Tr * max(Fh, da.stride(0)) >= 2**31:
        raise ValueError(f"backward_operands indexes with int32: [{T}, {Fh}] is too large")
    cuda = use_cuda(backend, lambda: cuda_usable(z, da, reuse_forward_mask), "backward_operands",
                    "reuse_forward_mask=True and 16-byte aligned rows")
    order = _token_order(perm, T, z.device)
    slots, k = _checked_slots(slots, dense, Fh, z.device)
    dz_buf, outs = _outputs(Tr, Tp, Fh, k, reuse_forward_mask, z.device)
    dz_meta = _meta(dz_buf, Tr, Fh) if reuse_forward_mask else dz_buf.view(torch.int16)  # a stub without it
    (a_buf, a_full), (g_buf, g_full) = outs
    if cuda:
        launch("srelu24_backward_operands", _CUDA_ARGS, *(t.data_ptr() for t in (
            z, da, order, slots, dz_buf, dz_meta, a_buf, _meta(a_buf, Fh, Tp), a_full, g_buf, _meta(g_buf, Fh, Tp),
            g_full)), T, Tp, Tr, Fh, z.stride(0), da.stride(0), device=z.device)
    else:
        n_bands = Fh // 64
        bands = next(b for b in (bands, 4, 2, 1) if n_bands % b == 0)
        _backward_operands_kernel[(Tr // 32, n_bands // bands)](
            z, da, order, slots, dz_buf, dz_meta, a_buf, _meta(a_buf, Fh, Tp), a_full,
            g_buf, _meta(g_buf, Fh, Tp), g_full, T, Tp, Fh, z.stride(0), da.stride(0),
            REUSE=reuse_forward_mask, BANDS=bands, num_warps=num_warps)
    return _results(dz_buf, outs, Tr, Fh, k, reuse_forward_mask)


@torch.compiler.assume_constant_result
def _kernels_load(device_index: Optional[int]) -> bool:
    """KERNELS is built and loads on this sm80/sm90 GPU (its index; None: the current one). A constant to torch.compile, which calls
    it rather than tracing it: the library's first load (os.path.exists, ctypes) cannot be traced,
    and the graph break it made split every compiled block at the FFN, so that nothing around the
    op fused with its neighbours (the input's bf16 cast, Y into the residual add, dX into the norm's
    backward). Its answer is kept, unguarded, for the process: the library does not come or go."""
    return KERNELS.available(device_index, (8, 9))


def a24_usable(device, Fh: int, reuse_forward_mask: bool = True) -> bool:
    """backward_operands_from_a24 can run: the CUDA library built (make kernels), an sm80/sm90 GPU,
    the forward mask re-used, F % 64 == 0 and at most 65535 bands. Decided from the device and
    shapes alone (no data), so that the FFN's forward knows what to keep for its backward."""
    dev = torch.device(device)
    return (reuse_forward_mask and dev.type == "cuda" and Fh % 64 == 0 and Fh // 64 <= 65535
            and _kernels_load(dev.index))  # an int or None: a plain constant for dynamo


def backward_operands_from_a24(a24: Tensor, da: Tensor, perm: Optional[Tensor], dense: Optional[Tensor],
                               slots: Optional[Tensor] = None, a_amax: Optional[Tensor] = None):
    """backward_operands, reading the forward's compressed A24 (srelu_sparsify_2to4's buffer for the
    same T tokens, [padded(T, ROWS_PER_BAND), 9F/16]) instead of Z: the FFN then keeps A24 (9/16 of Z's
    bytes) for its backward, and the pass reads about 190 MiB less at 7B, T=16384. The CUDA
    kernel only (`a24_usable`); the forward mask re-used. Equal to backward_operands(z, ...) bit for
    bit wherever the positive entries of Z lie in [1.1e-19, 1.8e19] (bf16(z^2) normal and finite:
    relu(z) is recovered exactly as bf16(sqrt(a))). Outside it dZ differs there: 0 below 6.8e-21
    (a = 0), an approximate relu(z) up to 1.1e-19 (a subnormal), NaN above 1.8e19 (a = inf).

    a_amax: the forward's column maxima of A24 (srelu_sparsify_2to4's `amax` for these tokens; T a
    multiple of 64): S(A24)^T then comes in e4m3, as (values [F, 5T/8] float8_e4m3fn, row scales [F]
    float32) in place of its bf16 buffer: the bytes fp8_sparse.compressed_to_e4m3 makes of that
    buffer (the same call without a_amax), in the same pass. A row's amax is its feature's maximum, since
    2:4 along tokens keeps each group's largest value; a dense feature's row is zeros."""
    T, Fh = da.shape
    Tr, Tp = padded(T, ROWS_PER_BAND), padded(T, COLS_PER_CHUNK)
    if a_amax is not None and (T % E4M3_COLS_PER_CHUNK or tuple(a_amax.shape) != (Fh,) or a_amax.dtype != torch.float32
                               or not a_amax.is_contiguous() or a_amax.device != da.device):
        raise ValueError(f"backward_operands_from_a24: a_amax must be a contiguous float32 [{Fh}] on {da.device} and the "
                         f"tokens a multiple of {E4M3_COLS_PER_CHUNK} (the e4m3 layout); got {a_amax.dtype} "
                         f"{tuple(a_amax.shape)} on {a_amax.device}, {T} tokens")
    if tuple(a24.shape) != (Tr, Fh * 9 // 16) or a24.dtype != torch.bfloat16 or not a24.is_contiguous():
        raise ValueError(f"backward_operands_from_a24 needs A24 as srelu_sparsify_2to4 writes it for dA's {T} tokens: "
                         f"bf16 [{Tr}, {Fh * 9 // 16}], contiguous; got {a24.dtype} {tuple(a24.shape)}")
    check_tokens_input(da, None)
    if Tr * max(Fh, da.stride(0)) >= 2**31:
        raise ValueError(f"backward_operands indexes with int32: [{T}, {Fh}] is too large")
    values = a24.view(-1)[:Tr * Fh // 2].view(Tr, Fh // 2)  # its real rows: 9F/16 is not one
    if not (a24_usable(da.device, Fh) and kernels_usable(values, da)):
        raise ValueError(f"backward_operands_from_a24 needs {KERNELS.path()} ({KERNELS.make_target}), an sm80/sm90 "
                         f"GPU, F % 64 == 0 and 16-byte aligned rows; backward_operands(z, ...) runs anywhere")
    order = _token_order(perm, T, da.device)
    slots, k = _checked_slots(slots, dense, Fh, da.device)
    dz_buf, outs = _outputs(Tr, Tp, Fh, k, True, da.device, a_e4m3=a_amax is not None)
    (a_buf, a_full), (g_buf, g_full) = outs
    a_scale = torch.empty(Fh, dtype=torch.float32, device=da.device) if a_amax is not None else None
    a_meta = a_buf[Fh * Tp // 2:] if a_amax is not None else _meta(a_buf, Fh, Tp)  # e4m3: bytes after the values
    launch("srelu24_backward_operands_a24", _CUDA_A24_ARGS, *(t.data_ptr() for t in (
        a24, _meta(a24, Tr, Fh), da, order, slots, dz_buf, _meta(dz_buf, Tr, Fh), a_buf, a_meta, a_full,
        g_buf, _meta(g_buf, Fh, Tp), g_full)), None if a_amax is None else a_amax.data_ptr(),
        None if a_scale is None else a_scale.data_ptr(), T, Tp, Tr, Fh, da.stride(0), device=da.device)
    dz, (a_op, a_full), g = _results(dz_buf, outs, Tr, Fh, k, True)
    if a_amax is not None:
        a_op = (a_buf.view(torch.float8_e4m3fn).view(Fh, -1), a_scale)
    return dz, (a_op, a_full), g


@triton.jit
def _dense_rows_kernel(w_ptr, dense_ptr, g_ptr, k, D, ACCUMULATE: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Program (block of dense features, block of d): w[dense[j], :] = g[j, :] (ACCUMULATE: +=)."""
    j = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = (j < k)[:, None] & (d < D)[None, :]
    f = tl.load(dense_ptr + j, mask=j < k, other=0).to(tl.int64)
    src = j[:, None].to(tl.int64) * D + d[None, :]
    dst = w_ptr + f[:, None] * D + d[None, :]
    v = tl.load(g_ptr + src, mask=ok).to(w_ptr.dtype.element_ty)
    if ACCUMULATE:
        v = tl.load(dst, mask=ok) + v
    tl.store(dst, v, mask=ok)


@triton.jit
def _dense_columns_kernel(w_ptr, slot_ptr, g_ptr, D, F, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr):
    """Program (block of d, block of features): w[d, f] = g[slot[f], d] where slot[f] >= 0; the
    block is read and written whole."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    slot = tl.load(slot_ptr + f, mask=f < F, other=-1)
    ok = (d < D)[:, None] & (f < F)[None, :]
    offs = d[:, None].to(tl.int64) * F + f[None, :]
    new = tl.load(g_ptr + slot[None, :].to(tl.int64) * D + d[:, None], mask=ok & (slot >= 0)[None, :])
    tl.store(w_ptr + offs, tl.where((slot >= 0)[None, :], new, tl.load(w_ptr + offs, mask=ok)), mask=ok)


def _check_dense_write(name: str, w: Tensor, index: Tensor, g: Tensor, want_w: tuple, want_index: tuple) -> None:
    tensors = {"the weight gradient": w, "the index": index, "the dense-feature gradients": g}
    bad = [k for k, t in tensors.items() if not t.is_contiguous() or t.device != w.device]
    widen = w.dtype == torch.float32 and g.dtype == torch.bfloat16  # an fp32 weight's gradient: stored exactly
    if bad or (w.dtype != g.dtype and not widen) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} needs contiguous tensors on one device, gradients of one dtype (or bf16 into "
                         f"fp32) and an int32/int64 index; got {', '.join(f'{k}: {t.dtype} on {t.device}' + ('' if t.is_contiguous() else ', strided') for k, t in tensors.items())}")
    if tuple(w.shape) != want_w or tuple(index.shape) != want_index:
        raise ValueError(f"{name}: shapes {tuple(w.shape)} (weight gradient), {tuple(index.shape)} (index) and "
                         f"{tuple(g.shape)} (dense-feature gradients [k, d]) do not agree")


def write_dense_rows(dw1: Tensor, dense: Tensor, g: Tensor, accumulate: bool = False) -> None:
    """dw1[dense] = g in place (dw1 [F, d], g [k, d], dense [k] feature indices): dW1's rows of
    the dense features, zero in the sparse product, get their exact values. g bf16 into an fp32 dw1
    is widened as stored (an fp32 weight's gradient). accumulate: dw1[dense] += g (dw1 a weight's
    .grad that the sparse product was added into: srelu24_kernels/srelu24/op.py)."""
    k, D = g.shape
    _check_dense_write("write_dense_rows", dw1, dense, g, (dw1.shape[0], D), (k,))
    if k:
        _dense_rows_kernel[(triton.cdiv(k, 32), triton.cdiv(D, 128))](dw1, dense, g, k, D, ACCUMULATE=accumulate,
                                                                      BLOCK_K=32, BLOCK_D=128)


def write_dense_columns(dw2: Tensor, slots: Tensor, g: Tensor) -> None:
    """dw2[:, f] = g[slots[f]] in place for every f with slots[f] >= 0 (dw2 [d, F], g [k, d], slots
    [F] int32 as `dense_slots` numbers them): dW2's columns of the dense features (g bf16 into an
    fp32 dw2 widened, as write_dense_rows; the e4m3 path writes them in its unscaling pass instead,
    fp8_sparse.unscale). Scattering the 2-byte columns of a bf16 dW2 (torch's indexed assignment, or a
    Triton scatter), or rewriting only the 32-byte sectors that hold one, was slower than reading and
    writing all of dW2 with whole lines, which costs about a copy of dW2 (benchmarks/RESULTS.md)."""
    k, D = g.shape
    _check_dense_write("write_dense_columns", dw2, slots, g, (D, slots.shape[0]), (dw2.shape[1],))
    if slots.dtype != torch.int32:
        raise ValueError(f"write_dense_columns needs int32 slots (dense_slots), got {slots.dtype}")
    if k:
        _dense_columns_kernel[(triton.cdiv(D, 32), triton.cdiv(slots.shape[0], 128))](
            dw2, slots, g, D, slots.shape[0], BLOCK_D=32, BLOCK_F=128)
