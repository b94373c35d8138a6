"""Fused srelu + 2:4 sparsify: one pass over Z = X W1^T that writes A24 = 2:4(relu(Z)^2)
directly in cuSPARSELt's sm90 compressed layout (the operand of `torch._cslt_sparse_mm`),
plus the per-feature count of kept non-zeros (for the dense-feature split).

Reference: `srelu_sparsify_2to4_reference` (PyTorch: srelu24_kernels.srelu24.reference.mask_2to4 +
srelu24_kernels.cusparselt.layout.compress). The Triton kernel must match it bit for bit, and so must the
CUDA C++ version (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu, `make kernels`), which runs instead where it
is built, except on logged steps (the statistics totals are the Triton kernel's).

A 64x32 tile's 512 metadata nibbles are 128 consecutive 16-bit words: word 4p + m (p = 8c + a
for rows 16c + 8b + a, m = group % 4) packs the nibbles of rows (b = 0, 1) and groups
(h = 0, 1; group = 4h + m) at bits 4 (b + 2h). So the kernel loads the tile as two
[32 rows, 32 columns] blocks (b = 0, 1) and ORs their nibbles into one [32, 4] block of words.
"""
import ctypes
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..cusparselt.layout import ROWS_PER_BAND, compress, compressed_numel, empty_compressed, padded
from .native import kernels_usable, launch, use_cuda
from .reference import mask_2to4


def srelu_sparsify_2to4_reference(z: Tensor) -> tuple[Tensor, Tensor]:
    """(compressed A24 of z's rows padded to 64 with zeros, kept non-zeros per column int32)."""
    a = F.relu(z).square()
    keep = mask_2to4(a)
    pad = padded(z.shape[0], ROWS_PER_BAND) - z.shape[0]
    a_p, keep_p = F.pad(a, (0, 0, 0, pad)), F.pad(keep, (0, 0, 0, pad))
    if pad:  # padding rows are all zero: they keep positions 0 and 1
        keep_p[z.shape[0]:] = mask_2to4(a_p[z.shape[0]:])
    counts = ((a * keep) != 0).sum(0, dtype=torch.int32)
    return compress(a_p, keep_p), counts


def column_amax_reference(z: Tensor) -> Tensor:
    """Each column's largest A24 value (float32 [K]): what srelu_sparsify_2to4 maxes into `amax`."""
    a = F.relu(z).square()
    return (a * mask_2to4(a)).float().amax(0) if z.shape[0] else z.new_zeros(z.shape[1], dtype=torch.float32)


def activation_totals_reference(z: Tensor) -> Tensor:
    """[non-zeros, sum a^2, dropped sum a^2] of a = relu(z)^2 under its 2:4 selection (float64)."""
    a = F.relu(z).square()
    sq = a.double().square()
    keep = mask_2to4(a)
    return torch.stack([(a != 0).sum().double(), sq.sum(), torch.where(keep, 0.0, sq).sum()])


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32, as torch rounds a bf16 product.
    Done on the bits because TRITON_INTERPRET truncates in .to(tl.bfloat16)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def top2_of_4(v0, v1, v2, v3):
    """2:4 selection of groups given as 4 same-shaped tensors (one per position): keep masks,
    kept positions p0 < p1, and kept values x0, x1. The 2 largest magnitudes win; ties go to
    the lower position (as srelu24_kernels.srelu24.reference.mask_2to4)."""
    a0, a1, a2, a3 = tl.abs(v0), tl.abs(v1), tl.abs(v2), tl.abs(v3)
    # b_ij: j strictly beats i (i < j)
    b01, b02, b03 = (a1 > a0).to(tl.int32), (a2 > a0).to(tl.int32), (a3 > a0).to(tl.int32)
    b12, b13, b23 = (a2 > a1).to(tl.int32), (a3 > a1).to(tl.int32), (a3 > a2).to(tl.int32)
    k0 = (b01 + b02 + b03) < 2
    k1 = (1 - b01 + b12 + b13) < 2
    k2 = (2 - b02 - b12 + b23) < 2
    k3 = (3 - b03 - b13 - b23) < 2
    p0 = tl.where(k0, 0, tl.where(k1, 1, 2))
    p1 = tl.where(k3, 3, tl.where(k2, 2, 1))
    x0 = tl.where(p0 == 0, v0, tl.where(p0 == 1, v1, v2))
    x1 = tl.where(p1 == 3, v3, tl.where(p1 == 2, v2, v1))
    return k0, k1, k2, k3, p0, p1, x0, x1


@triton.jit
def _srelu_sparsify_2to4_kernel(z_ptr, val_ptr, meta_ptr, counts_ptr, totals_ptr, M, K, stride_zm,
                             BANDS: tl.constexpr, COUNTS: tl.constexpr, TOTALS: tl.constexpr):
    """Program (chunk, band group): one 32-column chunk of BANDS 64-row bands. Per band, two
    [32 rows, 32 cols] loads (rows 16c + 8b + a for b = 0, 1), viewed as [32, h, m, 4].
    TOTALS (logged steps): also add [non-zeros, sum a^2, dropped sum a^2] of the activation
    a = relu(Z)^2 to totals_ptr (for srelu24_kernels/ffn_stats.py)."""
    kc = tl.program_id(0)
    p = tl.arange(0, 32)                        # row pair p = 8c + a
    m = tl.arange(0, 4)
    hshift = 8 * tl.arange(0, 2)[None, :, None]  # nibble of group h*4+m sits 8 bits higher for h = 1
    cols = kc * 32 + tl.arange(0, 32)
    vcols = kc * 16 + tl.arange(0, 16)
    # kept non-zeros, per position q: summed elementwise, reduced over rows once at the end
    c0 = tl.zeros([32, 2, 4], dtype=tl.int32)
    c1 = tl.zeros([32, 2, 4], dtype=tl.int32)
    c2 = tl.zeros([32, 2, 4], dtype=tl.int32)
    c3 = tl.zeros([32, 2, 4], dtype=tl.int32)
    n_nz = tl.zeros([32, 2, 4], dtype=tl.int32)
    sq = tl.zeros([32, 2, 4], dtype=tl.float32)
    dropped_sq = tl.zeros([32, 2, 4], dtype=tl.float32)
    for i in range(BANDS):
        band = tl.program_id(1) * BANDS + i
        row0 = band * 64 + (p // 8) * 16 + p % 8
        words = tl.zeros([32, 4], dtype=tl.int32)
        for b in tl.static_range(2):
            rows = row0 + b * 8
            z = tl.load(z_ptr + rows[:, None] * stride_zm + cols[None, :], mask=rows[:, None] < M, other=0.0)
            zf = tl.maximum(z.to(tl.float32), 0.0)
            act = round_to_bf16(zf * zf)
            lo, hi = tl.split(tl.reshape(act, [32, 2, 4, 2, 2]))  # [row, h, m, q >> 1, q & 1]
            v0, v2 = tl.split(lo)
            v1, v3 = tl.split(hi)
            k0, k1, k2, k3, p0, p1, x0, x1 = top2_of_4(v0, v1, v2, v3)
            vals = tl.reshape(tl.join(x0, x1), [32, 16]).to(tl.bfloat16)
            tl.store(val_ptr + rows[:, None] * (K // 2) + vcols[None, :], vals)
            words += tl.sum((p0 | (p1 << 2)) << (hshift + 4 * b), axis=1)  # bits never overlap: + is |
            if COUNTS:  # padding rows are zero and add nothing
                c0 += (k0 & (v0 > 0)).to(tl.int32)
                c1 += (k1 & (v1 > 0)).to(tl.int32)
                c2 += (k2 & (v2 > 0)).to(tl.int32)
                c3 += (k3 & (v3 > 0)).to(tl.int32)
            if TOTALS:
                n_nz += (v0 > 0).to(tl.int32) + (v1 > 0).to(tl.int32) + (v2 > 0).to(tl.int32) + (v3 > 0).to(tl.int32)
                sq += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
                dropped_sq += (tl.where(k0, 0.0, v0 * v0) + tl.where(k1, 0.0, v1 * v1) +
                               tl.where(k2, 0.0, v2 * v2) + tl.where(k3, 0.0, v3 * v3))
        tile = (band * (K // 32) + kc) * 128
        tl.store(meta_ptr + tile + p[:, None] * 4 + m[None, :], words.to(tl.int16))
    if COUNTS:
        col = kc * 32 + (tl.arange(0, 2)[:, None] * 4 + m[None, :]) * 4  # column of (h, m, q = 0)
        tl.atomic_add(counts_ptr + col + 0, tl.sum(c0, axis=0))
        tl.atomic_add(counts_ptr + col + 1, tl.sum(c1, axis=0))
        tl.atomic_add(counts_ptr + col + 2, tl.sum(c2, axis=0))
        tl.atomic_add(counts_ptr + col + 3, tl.sum(c3, axis=0))
    if TOTALS:
        # float64: exact counts past 2^24, no precision lost over thousands of programs
        tl.atomic_add(totals_ptr + 0, tl.sum(n_nz).to(tl.float64))
        tl.atomic_add(totals_ptr + 1, tl.sum(sq).to(tl.float64))
        tl.atomic_add(totals_ptr + 2, tl.sum(dropped_sq).to(tl.float64))


_CUDA_ARGS = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_int64, ctypes.c_int]


def cuda_usable(z: Tensor, counts: bool = True, totals: Optional[Tensor] = None) -> bool:
    """The CUDA kernel (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu, `make kernels`) can run this call: built, an
    sm80/sm90 GPU, 16-byte aligned rows, features a multiple of 64, with the counts and without
    the statistics totals (logged steps run the Triton kernel)."""
    return counts and totals is None and z.shape[1] % 64 == 0 and kernels_usable(z)


def srelu_sparsify_2to4(z: Tensor, bands: int = 8, counts: bool = True, num_warps: int = 4,
                     totals: Optional[Tensor] = None, backend: str = "auto",
                     amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Fused kernel version of srelu_sparsify_2to4_reference (z: [M, K] bf16, K % 32 == 0).
    With `totals` (float64 [3]): adds [non-zeros, sum a^2, dropped sum a^2] of a = relu(Z)^2,
    see activation_totals_reference. backend: "cuda", "triton", or "auto": cuda where
    `cuda_usable`, else triton (bands and num_warps are the Triton launch's). amax (float32 [K],
    zeros; the CUDA kernel only): each feature's largest A24 value over the rows is maxed into it
    (column_amax_reference), for the backward's e4m3 S(A24)^T (sparsify_backward.py)."""
    M, K = z.shape
    if K % 32:
        raise ValueError(f"srelu_sparsify_2to4 needs the feature count to be a multiple of 32, got {K}")
    if z.dtype != torch.bfloat16 or z.stride(1) != 1:
        raise ValueError("srelu_sparsify_2to4 needs a row-major bf16 input")
    if padded(M, ROWS_PER_BAND) * max(K, z.stride(0)) >= 2**31:
        raise ValueError(f"srelu_sparsify_2to4 indexes with int32: [{M}, {K}] is too large")
    if totals is not None and not counts:
        raise ValueError("srelu_sparsify_2to4: totals need the counts (counts=True): the statistics use both")
    if totals is not None and (totals.shape != (3,) or totals.dtype != torch.float64):
        raise ValueError("srelu_sparsify_2to4: totals must be a float64 [3] tensor")
    if amax is not None and (amax.shape != (K,) or amax.dtype != torch.float32 or not amax.is_contiguous()
                             or amax.device != z.device):
        raise ValueError(f"srelu_sparsify_2to4: amax must be a contiguous float32 [{K}] on {z.device}, got "
                         f"{amax.dtype} {tuple(amax.shape)} on {amax.device}")
    if amax is not None and backend == "triton":
        raise ValueError("srelu_sparsify_2to4: amax is the CUDA kernel's (backend 'cuda' or 'auto')")
    cuda = use_cuda("cuda" if amax is not None else backend, lambda: cuda_usable(z, counts, totals),
                    "srelu_sparsify_2to4", "16-byte aligned rows, K % 64 == 0, counts=True and no totals"
                    + (" (amax is the CUDA kernel's)" if amax is not None else ""))
    Mp = padded(M, ROWS_PER_BAND)
    buf = empty_compressed(compressed_numel(Mp, K), torch.bfloat16, z.device)
    nnz = torch.zeros(K, dtype=torch.int32, device=z.device)
    n_bands = Mp // 64
    if cuda:
        # 64-row bands per block: as many as keep >= 4096 blocks (the counts' atomics amortised)
        per_block = next((b for b in (8, 4, 2) if -(-n_bands // b) * (K // 64) >= 4096), 1)
        launch("srelu24_sparsify", _CUDA_ARGS, z.data_ptr(), buf.data_ptr(), buf.data_ptr() + Mp * K, nnz.data_ptr(),
               None if amax is None else amax.data_ptr(), M, Mp, K, z.stride(0), per_block, device=z.device)
        return buf.view(Mp, -1), nnz
    bands = next(b for b in (bands, 8, 4, 2, 1) if n_bands % b == 0)
    grid = (K // 32, n_bands // bands)
    _srelu_sparsify_2to4_kernel[grid](z, buf, buf[Mp * K // 2:].view(torch.int16), nnz,
                                   totals if totals is not None else nnz, M, K, z.stride(0), BANDS=bands,
                                   COUNTS=counts, TOTALS=totals is not None, num_warps=num_warps)
    return buf.view(Mp, -1), nnz  # 2-D, as torch._cslt_sparse_mm wants its compressed operand
