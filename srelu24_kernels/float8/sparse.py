"""srelu24's 2:4 sparse GEMMs in e4m3 (trainer.float8 set): cuSPARSELt's e4m3 x e4m3 2:4 GEMM with
bf16 output, 1.5x faster than a dense e4m3 GEMM at the 7B FFN's shapes on the H200 (id 21 of 24;
id 0, torch's default, is slower than dense; benchmarks/RESULTS.md).

    sparse operand  the bf16 compressed buffer the sparsify kernels write, converted: each row's
                    kept values times a power-of-2 scale that brings its amax under 448 (e4m3's
                    largest), rounded to e4m3; the metadata permuted into the e4m3 layout
                    (srelu24_kernels/cusparselt/layout.py). A row is one of M: its scale factors out of the product.
    dense operand   B [K, N] in e4m3, K-major (fp8 tensor cores read both operands along K), one
                    power-of-2 scale per column of B (each of N).
    product         e4m3 x e4m3 with fp32 accumulation, written as bf16 unscaled, then each
                    element times 1 / (row scale x column scale): exact, the scales being powers
                    of 2. cuSPARSELt's own per-row scaling (alpha vector) is "not supported" for
                    e4m3 on sm90, so a pass over the output does it: in place, or into fp32 for
                    an fp32 weight's gradient, writing dW2's dense-feature columns on the way.
    dense features  the weight gradients' dense rows (sparse_and_dense_mm) in e4m3 as well, by
                    cuBLAS, from the same e4m3 B.

Row scales follow torchao's rowwise recipe (e4m3 everywhere, power-of-2 scales along the
reduction dimension). `sparse_mm_reference` computes the same product from the same e4m3 values in
fp32; the Triton kernels match their PyTorch references bit for bit (tests/test_fp8_sparse.py).
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import gemm
from ..cusparselt.layout import check_shape_e4m3, compressed_bytes_e4m3, decompress, decompress_e4m3, empty_compressed
from ..cusparselt.binding import cached_mm, searched_alg
from .cast import (AMAX_FLOOR, columns_to_e4m3, columns_to_e4m3_reference, pow2_scale,  # noqa: F401 (AMAX_FLOOR: tests)
                       pow2_scale_triton, to_float8_bits)

E4M3 = torch.float8_e4m3fn
@triton.jit
def _row_to_e4m3(x_ptr, out_ptr, scale_ptr, r, stride_x, C: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of x [M, C] (bf16 or fp32): amax, its power-of-2 scale, and the row scaled and rounded to
    e4m3 (out [M, C], one byte each). C is a constexpr (one compile per row length): TRITON_INTERPRET
    cannot loop to a runtime bound under numpy >= 2.4."""
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, C, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * stride_x + c, mask=c < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
        nan = tl.maximum(nan, (v != v).to(tl.int32))
    s = pow2_scale_triton(tl.max(amax, 0), tl.max(nan, 0) > 0)
    tl.store(scale_ptr + r, s)
    for c0 in range(0, C, BLOCK):  # the second read comes from cache (a one-pass variant was no faster: lab/LOG.md)
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * stride_x + c, mask=c < C, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * C + c, to_float8_bits(v * s, False), mask=c < C)


@triton.jit
def _rows_to_e4m3_kernel(x_ptr, out_ptr, scale_ptr, stride_x, C: tl.constexpr, BLOCK: tl.constexpr):
    _row_to_e4m3(x_ptr, out_ptr, scale_ptr, tl.program_id(0), stride_x, C, BLOCK)


@triton.jit
def _bf16_nibble(i):
    """Where nibble i (0..1023) of an e4m3 metadata tile sits in the two bf16 tiles it covers: the
    inverse of layout.nibble_index_e4m3 (a bit permutation) into row rr, group gg of the
    64 x 64 tile, then layout.nibble_index of (rr, gg % 8) in bf16 tile gg // 8. Computed,
    not loaded: a 1024-entry table cost each 512-byte block 8 KB of loads."""
    gg = (i & 1) | (((i >> 3) & 3) << 1) | (((i >> 2) & 1) << 3)
    rr = ((i >> 5) & 7) | (((i >> 1) & 1) << 3) | (((i >> 8) & 3) << 4)
    g = gg & 7
    return ((gg >> 3) * 512 + ((rr >> 3) & 1) + (((g >> 2) & 1) << 1) + ((g & 1) << 2) + (((g >> 1) & 1) << 3)
            + ((rr & 7) << 4) + (((rr >> 4) & 3) << 7))


@triton.jit
def _metadata_blocks(meta_ptr, out_ptr, p, n_blocks, BLOCKS: tl.constexpr):
    """Program p's BLOCKS 512-byte blocks of e4m3 metadata, each from the 128 32-bit words (256
    16-bit words) of the two bf16 tiles it covers. Output byte j holds e4m3 nibbles 2j, 2j + 1;
    they differ only in their group's lowest bit, which in the bf16 order is nibble bit 2: the
    16-bit words s // 4 and s // 4 + 1 (s = _bf16_nibble(2j), s // 4 even), so one 32-bit load
    fetches both."""
    blk = p * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    j = tl.arange(0, 512)
    s = _bf16_nibble(2 * j)[None, :]
    live = (blk < n_blocks) & (j[None, :] < 512)  # the last program's tail
    w = tl.load(meta_ptr + blk * 128 + s // 8, mask=live, other=0)
    shift = (s % 4) * 4
    lo, hi = (w >> shift) & 0xF, (w >> (shift + 16)) & 0xF
    tl.store(out_ptr + blk * 512 + j[None, :], (lo | (hi << 4)).to(tl.uint8), mask=live)


@triton.jit
def _compressed_to_e4m3_kernel(x_ptr, words_ptr, out_ptr, scale_ptr, M, n_blocks, C: tl.constexpr, BLOCK: tl.constexpr,
                               BLOCKS: tl.constexpr):
    """A bf16 compressed buffer as an e4m3 one in one launch (launches cost host time, which the 1B
    step waits on):
    programs 0..M-1 convert the value rows (x [M, C], C = k/2, into out's first M*C bytes),
    the rest the metadata (words_ptr: the whole buffer as 32-bit words, the metadata after the
    values' M*C/2; into out after the values)."""
    p = tl.program_id(0)
    if p < M:
        _row_to_e4m3(x_ptr, out_ptr, scale_ptr, p, C, C, BLOCK)
    else:
        _metadata_blocks(words_ptr + M * C // 2, out_ptr + M * C, p - M, n_blocks, BLOCKS)


# 512-byte metadata blocks a program (a power of 2: a tl.arange); 2 at 4 warps was the fastest of
# 1, 2, 4 and 8 at the 1B and 7B FFN's operands (lab/LOG.md)
METADATA_BLOCKS = 2


def rows_to_e4m3_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x [M, C] scaled per row and cast to e4m3, the row scales [M] float32)."""
    s = pow2_scale(x.float().abs().amax(1))
    return (x.float() * s[:, None]).to(E4M3), s


def rows_to_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """rows_to_e4m3_reference in one Triton pass over x's rows (each read twice, the second from cache)."""
    m, c = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"rows_to_e4m3 needs rows of consecutive elements, got strides {x.stride()}")
    out = torch.empty(m, c, dtype=E4M3, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _rows_to_e4m3_kernel[(m,)](x, out.view(torch.uint8), scale, x.stride(0), C=c, BLOCK=1024, num_warps=4)
    return out, scale


def compressed_to_e4m3(buf: Tensor, m: int, k: int) -> tuple[Tensor, Tensor]:
    """A bf16 compressed 2:4 buffer of an [m, k] matrix (srelu24_kernels/cusparselt/layout.py) as an e4m3 one
    (float8_e4m3fn [m, 5k/8]) and its row scales [m]: the e4m3 matrix is the bf16 one times its
    scales. Values and metadata in one launch."""
    check_shape_e4m3(m, k)
    flat = buf.reshape(-1)  # values [m, k/2], then the metadata: at m * k bytes, 4-byte aligned
    if flat.storage_offset() % 2:  # the metadata is read as 32-bit words
        flat = flat.clone()
    out = empty_compressed(compressed_bytes_e4m3(m, k), torch.uint8, buf.device)
    scale = torch.empty(m, dtype=torch.float32, device=buf.device)
    n_blocks = m * k // 4096
    _compressed_to_e4m3_kernel[(m + triton.cdiv(n_blocks, METADATA_BLOCKS),)](
        flat, flat.view(torch.int32), out, scale, m, n_blocks, C=k // 2, BLOCK=1024, BLOCKS=METADATA_BLOCKS, num_warps=4)
    return out.view(E4M3).view(m, -1), scale


def kmajor_e4m3(b: Tensor) -> tuple[Tensor, Tensor]:
    """B [K, N] (bf16 or fp32) as e4m3 with a power-of-2 scale per column: (its [K, N] view of a K-major
    [N, K] tensor, the scales [N]): one launch for a K-major B, three (zeros, amaxes, cast) for a
    row-major one (cast.columns_to_e4m3)."""
    if b.t().is_contiguous():  # the transpose of a row-major [N, K]: its rows are B's columns
        q, s = rows_to_e4m3(b.t())
        return q.t(), s
    q, s, _ = columns_to_e4m3(b)
    return q.t(), s


def kmajor_e4m3_reference(b: Tensor) -> tuple[Tensor, Tensor]:
    q, s = columns_to_e4m3_reference(b)
    return q.t(), s


@triton.jit
def _unscaled_tile(y_ptr, sr_ptr, sc_ptr, slot_ptr, g_ptr, i, j, m, offs, M, N, DENSE_COLUMNS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    """One product's tile times 1 / sr[i], then 1 / sc[j] (the reciprocals rounded as torch's: div_rn;
    exact for powers of 2, NaN for NaN), in fp32; DENSE_COLUMNS: a dense feature's column j
    (slot[j] >= 0) is g [k, M]'s row slot[j] instead."""
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sr, sc = tl.load(sr_ptr + i, mask=i < M, other=1.0), tl.load(sc_ptr + j, mask=j < N, other=1.0)
    r, c = tl.math.div_rn(tl.full([BM], 1.0, tl.float32), sr), tl.math.div_rn(tl.full([BN], 1.0, tl.float32), sc)
    v = y * r[:, None] * c[None, :]
    if DENSE_COLUMNS:
        slot = tl.load(slot_ptr + j, mask=j < N, other=-1)
        dense = (slot >= 0)[None, :]
        g = tl.load(g_ptr + slot[None, :].to(tl.int64) * M + i[:, None], mask=m & dense, other=0.0).to(tl.float32)
        v = tl.where(dense, g, v)
    return v


@triton.jit
def _unscale_kernel(y_ptr, out_ptr, sr_ptr, sc_ptr, slot_ptr, g_ptr, y0_ptr, sr0_ptr, sc0_ptr, slot0_ptr, g0_ptr,
                    M, N, DENSE_COLUMNS: tl.constexpr, ACCUMULATE: tl.constexpr, PENDING: tl.constexpr,
                    DENSE_COLUMNS0: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out [M, N] = y (bf16 or fp32) unscaled (_unscaled_tile), in out's dtype (out may be y: in place).
    DENSE_COLUMNS: out is dW2 [d, F], and a dense feature's column is g's row, as write_dense_columns
    would store it, in the same pass. ACCUMULATE: out += that instead (a weight's .grad, which the op
    adds into: srelu24_kernels/srelu24/op.py). PENDING: an earlier micro-batch's product y0 (its
    scales, its dense columns where DENSE_COLUMNS0) goes in first, as if it had been unscaled and
    added by a pass of its own: the same fp32 sums in the same order, one pass instead of two."""
    i = tl.program_id(0) * BM + tl.arange(0, BM)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (i[:, None] < M) & (j[None, :] < N)
    offs = i[:, None] * N + j[None, :]
    v = _unscaled_tile(y_ptr, sr_ptr, sc_ptr, slot_ptr, g_ptr, i, j, m, offs, M, N, DENSE_COLUMNS, BM, BN)
    if PENDING:
        acc = _unscaled_tile(y0_ptr, sr0_ptr, sc0_ptr, slot0_ptr, g0_ptr, i, j, m, offs, M, N, DENSE_COLUMNS0, BM, BN)
        if ACCUMULATE:
            acc = tl.load(out_ptr + offs, mask=m, other=0.0).to(tl.float32) + acc
        v = acc + v
    elif ACCUMULATE:
        v = tl.load(out_ptr + offs, mask=m, other=0.0).to(tl.float32) + v
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m)


class Pending(NamedTuple):
    """A micro-batch's e4m3 2:4 weight-gradient product kept still scaled (its bf16 values as the GEMM
    wrote them, its row and column scales, and for dW2 its dense columns: slots [N] int32 and g
    [k, M], or None), to be unscaled together with the next micro-batch's (unscale's `pending`)."""
    y: Tensor
    row_scale: Tensor
    col_scale: Tensor
    dense_columns: Optional[tuple[Tensor, Tensor]]


def _unscale_into(out: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor,
                  dense_columns: tuple[Tensor, Tensor] | None = None, accumulate: bool = False,
                  pending: Optional[Pending] = None) -> Tensor:
    m, n = y.shape
    slots, g = dense_columns if dense_columns is not None else (y, y)  # unread without DENSE_COLUMNS
    p = pending if pending is not None else Pending(y, row_scale, col_scale, None)  # unread without PENDING
    slots0, g0 = p.dense_columns if p.dense_columns is not None else (y, y)
    _unscale_kernel[(triton.cdiv(m, 32), triton.cdiv(n, 128))](
        y, out, row_scale, col_scale, slots, g, p.y, p.row_scale, p.col_scale, slots0, g0, m, n,
        DENSE_COLUMNS=dense_columns is not None, ACCUMULATE=accumulate, PENDING=pending is not None,
        DENSE_COLUMNS0=pending is not None and pending.dense_columns is not None, BM=32, BN=128, num_warps=4)
    return out


def unscale_(y: Tensor, *, row_scale: Tensor, col_scale: Tensor) -> Tensor:
    """y [M, N] (contiguous bf16) *= (1 / row_scale)[:, None] * (1 / col_scale)[None, :], in place, in
    one pass (the reciprocals inside it)."""
    return _unscale_into(y, y, row_scale, col_scale)


def _check_dense_columns(y: Tensor, dense_columns: tuple[Tensor, Tensor]) -> None:
    slots, g = dense_columns
    if (slots.dtype != torch.int32 or slots.shape != (y.shape[1],) or g.shape[1:] != (y.shape[0],)
            or not g.is_contiguous() or g.dtype != y.dtype or g.device != y.device):
        raise ValueError(f"unscale's dense columns need int32 slots [{y.shape[1]}] and contiguous g [k, {y.shape[0]}] "
                         f"of y's dtype and device, got slots {slots.dtype} {tuple(slots.shape)}, g {g.dtype} "
                         f"{tuple(g.shape)} on {g.device}")


def unscale(y: Tensor, *, row_scale: Tensor, col_scale: Tensor, out_dtype: torch.dtype,
            dense_columns: tuple[Tensor, Tensor] | None = None, accumulate_into: Tensor | None = None,
            pending: Optional[Pending] = None) -> Tensor:
    """unscale_ written in out_dtype (fp32: an fp32 weight's gradient, no cast pass after; bf16: in
    place). With power-of-2 scales the fp32 result is unscale_'s bf16 one, .float(), bit for bit (a
    bf16 times powers of 2 is a bf16) except below 2^-126, where fp32 keeps bits that bf16 drops.
    dense_columns (slots [N] int32 as dense_slots numbers them, g [k, M]): y is dW2 [d, F], and
    the dense features' columns are written from g in the same pass, as write_dense_columns
    would (which reads and writes all of dW2 once more). accumulate_into (contiguous, out_dtype, y's
    shape: a weight's .grad): the result added into it, which is returned (the same sums, bit for
    bit, as adding the result afterwards). pending (a Pending of y's shape and dtype, out_dtype fp32):
    an earlier micro-batch's product, unscaled and added first: bit for bit what unscaling it on its
    own (into accumulate_into, or as the fresh result) and then this one into that would give."""
    if not y.is_contiguous() or y.numel() >= 2**31:  # the kernel's offsets are int32
        raise ValueError(f"unscale needs a contiguous y of fewer than 2^31 elements, got {tuple(y.shape)}, "
                         f"strides {y.stride()}")
    if accumulate_into is not None and (accumulate_into.shape != y.shape or accumulate_into.dtype != out_dtype
                                        or not accumulate_into.is_contiguous()):
        raise ValueError(f"unscale accumulates into a contiguous {out_dtype} {tuple(y.shape)}, got "
                         f"{accumulate_into.dtype} {tuple(accumulate_into.shape)}, strides {accumulate_into.stride()}")
    if pending is not None and (pending.y.shape != y.shape or pending.y.dtype != y.dtype or not pending.y.is_contiguous()
                                or out_dtype != torch.float32):
        raise ValueError(f"unscale's pending product must be a contiguous {y.dtype} {tuple(y.shape)} summed in float32, "
                         f"got {pending.y.dtype} {tuple(pending.y.shape)} into {out_dtype}")
    out = (accumulate_into if accumulate_into is not None else y if out_dtype == y.dtype and pending is None
           else torch.empty(y.shape, dtype=out_dtype, device=y.device))
    for dc in (dense_columns, pending and pending.dense_columns):
        if dc is not None:
            _check_dense_columns(y, dc)
    return _unscale_into(out, y, row_scale, col_scale, dense_columns, accumulate_into is not None, pending)


def available(device) -> bool:
    """An sm90 GPU with cuSPARSELt >= 0.6: its e4m3 2:4 kernels."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and (torch.backends.cusparselt.version() or 0) >= 600)


def usable(buf: Tensor, b: Tensor) -> bool:
    """sparse_mm runs these operands: a bf16 compressed A and a bf16 or fp32 B (an fp32 weight: its
    e4m3 conversion reads fp32) on an sm90 GPU with cuSPARSELt >= 0.6 (e4m3 kernels), A's rows and
    the reduction dimension (B's rows) multiples of 64 (the e4m3 layout's tile). Otherwise the
    caller's bf16 2:4 GEMM runs: so the weight gradients do where the tokens per micro-batch are not
    a multiple of 64 (they are padded to 32)."""
    return (buf.is_cuda and buf.dtype == torch.bfloat16 and b.dtype in (torch.bfloat16, torch.float32)
            and available(buf.device)
            and buf.shape[0] % 64 == 0 and b.shape[0] % 64 == 0 and buf.numel() * 16 == buf.shape[0] * b.shape[0] * 9)


def _scaled_product(buf: Tensor | None, b8: Tensor, sb: Tensor, transpose_result: bool,
                    a_e4m3: tuple[Tensor, Tensor] | None = None, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(the e4m3 product as cuSPARSELt writes it, bf16, still scaled (into `out` where given); its row
    scales; its column scales)."""
    a8, sa = a_e4m3 if a_e4m3 is not None else compressed_to_e4m3(buf, buf.shape[0], b8.shape[0])
    y = cached_mm(a8, b8, searched_alg(a8, b8, transpose_result), transpose_result, out=out)  # plans cached: host time
    return (y, sb, sa) if transpose_result else (y, sa, sb)  # transposed, y is (A B)^T: B's columns are its rows


def _sparse_product(buf: Tensor | None, b8: Tensor, sb: Tensor, transpose_result: bool,
                    out_dtype: torch.dtype = torch.bfloat16, dense_columns=None, accumulate_into=None,
                    a_e4m3: tuple[Tensor, Tensor] | None = None, pending: Optional[Pending] = None) -> Tensor:
    y, sr, sc = _scaled_product(buf, b8, sb, transpose_result, a_e4m3)
    return unscale(y, row_scale=sr, col_scale=sc, out_dtype=out_dtype, dense_columns=dense_columns,
                   accumulate_into=accumulate_into, pending=pending)


def sparse_mm(buf: Tensor, b: Tensor, transpose_result: bool = False,
              b_e4m3: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """A @ B in e4m3, bf16 out, for A given as its bf16 compressed buffer ([m, 9k/16]) and B [k, n]
    in bf16 or fp32; transpose_result: (A @ B)^T [n, m]. Same contract as srelu24_kernels.srelu24.op.sparse_mm.
    b_e4m3: kmajor_e4m3(b), where the caller has it already (a weight's, kept for an optimizer step: srelu24_kernels/srelu24/options.py)."""
    return _sparse_product(buf, *(b_e4m3 if b_e4m3 is not None else kmajor_e4m3(b)), transpose_result)


def scaled_sparse_mm(buf: Tensor, b: Tensor, b_e4m3: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """sparse_mm(buf, b) before its unscaling pass: (y, row scales, column scales), y bf16 [m, n]
    such that sparse_mm's product is `unscaled(y, row_scale, col_scale)`. For a caller that does
    the unscaling inside a compiled graph, where it fuses into the product's consumer (the residual
    add, the norm's backward: srelu24_kernels/srelu24/op.py) instead of a pass of its own."""
    return _scaled_product(buf, *(b_e4m3 if b_e4m3 is not None else kmajor_e4m3(b)), False)


def unscaled(y: Tensor, row_scale: Tensor, col_scale: Tensor) -> Tensor:
    """unscale_'s result in plain torch ops (not in place), for torch.compile to fuse into what reads
    it. The same bits as unscale_ wherever the result is a normal bf16: the scales are powers of 2,
    so the quotients are bf16 values, which a fused kernel may keep in fp32 without a difference.
    Compiled, Inductor writes the divisions as Triton's fp32 `/` (div.full.f32, not IEEE div_rn),
    whose results for power-of-2 divisors matched the Triton pass bit for bit on an H100
    (tests/test_deferred_unscaling.py, the GPU test). Outside Inductor (eager, aot_eager) these are
    four elementwise passes, slower than unscale_'s one: the op defers only inside a compiled graph."""
    return (y.float() / row_scale[:, None] / col_scale[None, :]).to(y.dtype)


def dense_mm(a: Tensor, b8: Tensor, sb: Tensor) -> Tensor:
    """a [r, k] (bf16, dense) @ B, B given as kmajor_e4m3's (b8, sb): a's rows scaled and cast as
    rows_to_e4m3 scales the sparse operand's, one cuBLAS e4m3 GEMM (torch._scaled_mm, the scales'
    reciprocals per row and column, exact accumulation as torchao's gradient GEMMs), bf16 out.
    On a GPU the rows' cast, scales and reciprocals come from one launch (gemm.rowwise_e4m3,
    rows up to its ROWWISE_ELEMENTS): the same bytes as rows_to_e4m3 for finite rows."""
    fused = gemm.rowwise_e4m3(a) if a.is_cuda else None
    if fused is not None:
        a8, _, inv_a = fused
    else:
        a8, sa = rows_to_e4m3(a)
        inv_a = sa.reciprocal()[:, None]
    return torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=sb.reciprocal()[None, :],
                            out_dtype=torch.bfloat16, use_fast_accum=False)


def sparse_and_dense_mm(buf: Tensor | None, dense_rows: Tensor | None, b: Tensor, transpose_result: bool = False,
                        out_dtype: torch.dtype = torch.bfloat16, slots: Tensor | None = None,
                        accumulate_into: Tensor | None = None,
                        b_e4m3: tuple[Tensor, Tensor] | None = None,
                        a_e4m3: tuple[Tensor, Tensor] | None = None,
                        pending: Optional[Pending] = None,
                        keep: Optional[Tensor] = None) -> tuple[Tensor | Pending, Tensor | None]:
    """(sparse_mm(buf, b, transpose_result), dense_rows @ B or None), both in e4m3 from one conversion
    of B: a weight gradient's 2:4 product and its dense features' rows (srelu24_kernels/srelu24/op.py).
    out_dtype: the 2:4 product's (the weight's: fp32 written by the unscaling pass); the dense rows
    stay bf16 (dense_mm's), widened where write_dense_rows/columns store them. slots (dW2, with
    transpose_result): the dense rows go into the product's columns in its unscaling pass instead,
    and None comes back in their place. accumulate_into: the 2:4 product added into it (unscale's),
    and it returned in the product's place. b_e4m3: kmajor_e4m3(b), where the caller has it already
    (dY's, made with its other conversion: srelu24_kernels/float8/paired.py). a_e4m3: compressed_to_e4m3's
    (values, row scales) of buf, where the caller has them already (S(A24)^T, written in e4m3 by the
    backward's pass: srelu24_kernels/srelu24/sparsify_backward.py); buf is not read then.
    pending: an earlier micro-batch's product, unscaled in the same pass, first (unscale's).
    keep (bf16, the product's shape): the product is not unscaled but written there, and comes back
    as a Pending (its scales; with slots its dense columns, the dense rows then None) for a later call's
    `pending`; the scales and dense rows are this call's tensors, which the caller copies to keep."""
    b8, sb = b_e4m3 if b_e4m3 is not None else kmajor_e4m3(b)
    dense = None if dense_rows is None else dense_mm(dense_rows, b8, sb)
    if slots is not None and dense is not None and not transpose_result:
        raise ValueError("sparse_and_dense_mm writes dense columns only into a transposed product (dW2 [d, F])")
    if keep is not None:
        y, sr, sc = _scaled_product(buf, b8, sb, transpose_result, a_e4m3, out=keep)
        if slots is not None and dense is not None:
            return Pending(y, sr, sc, (slots, dense)), None
        return Pending(y, sr, sc, None), dense
    if slots is not None and dense is not None:
        return _sparse_product(buf, b8, sb, True, out_dtype, (slots, dense), accumulate_into, a_e4m3, pending), None
    return _sparse_product(buf, b8, sb, transpose_result, out_dtype, accumulate_into=accumulate_into,
                           a_e4m3=a_e4m3, pending=pending), dense


def _dequantized(q: Tensor, s: Tensor) -> Tensor:
    return q.float() / s


def sparse_mm_reference(buf: Tensor | None, b: Tensor, transpose_result: bool = False, b_e4m3=None,
                        a_e4m3=None) -> Tensor:
    """What sparse_mm computes, in fp32 on any device: the same e4m3 values, dequantized and multiplied.
    b_e4m3 is not read: the reference converts b itself. a_e4m3 (compressed_to_e4m3's values and row
    scales, in place of buf): those values, dequantized."""
    k = b.shape[0]
    if a_e4m3 is not None:
        a8, sa = decompress_e4m3(a_e4m3[0], a_e4m3[0].shape[0], k), a_e4m3[1]
    else:
        a8, sa = rows_to_e4m3_reference(decompress(buf, buf.shape[0], k))
    b8, sb = kmajor_e4m3_reference(b)
    y = _dequantized(a8, sa[:, None]) @ _dequantized(b8, sb[None, :])
    return (y.t().contiguous() if transpose_result else y).to(torch.bfloat16)


def dense_mm_reference(a: Tensor, b: Tensor) -> Tensor:
    """What dense_mm(a, *kmajor_e4m3(b)) computes, in fp32 on any device."""
    a8, sa = rows_to_e4m3_reference(a)
    b8, sb = kmajor_e4m3_reference(b)
    return (_dequantized(a8, sa[:, None]) @ _dequantized(b8, sb[None, :])).to(torch.bfloat16)


def sparse_and_dense_mm_reference(buf: Tensor | None, dense_rows: Tensor | None, b: Tensor, transpose_result: bool = False,
                                  out_dtype: torch.dtype = torch.bfloat16, slots: Tensor | None = None,
                                  accumulate_into: Tensor | None = None, b_e4m3=None,
                                  a_e4m3=None) -> tuple[Tensor, Tensor | None]:
    """What sparse_and_dense_mm computes: the product's bf16 widened to out_dtype, and with slots
    the dense rows written as its columns; with accumulate_into, that added into it. b_e4m3 is not
    read: the reference converts b itself; a_e4m3 as sparse_mm_reference's."""
    y = sparse_mm_reference(buf, b, transpose_result, a_e4m3=a_e4m3).to(out_dtype)
    dense = None if dense_rows is None else dense_mm_reference(dense_rows, b)
    if slots is not None and dense is not None:
        if not transpose_result:
            raise ValueError("sparse_and_dense_mm writes dense columns only into a transposed product (dW2 [d, F])")
        cols = (slots >= 0).nonzero().squeeze(1)
        y[:, cols] = dense[slots[cols].long()].t().to(out_dtype)
        dense = None
    if accumulate_into is not None:
        y = accumulate_into.add_(y)
    return y, dense
