"""Scaled casts to float8 in one Triton pass, for srelu24's own float8 GEMMs (srelu24_kernels/float8/gemm.py,
srelu24_kernels/float8/sparse.py): the srelu24 custom op runs outside torch.compile's graph, where PyTorch
would spend six passes over the tensor on `(t.float() * scale).clamp(-max, max).to(dtype)`, more
time than the float8 GEMMs it feeds.

`scaled_cast(t, scale, dtype, transpose)` equals that expression bit for bit (tests/test_fp8_cast.py),
for one scale, one per row or one per column; `transpose` writes the result transposed (K-major
operands). `columns_to_e4m3` casts a row-major B [K, N] with a power-of-2 scale per column,
K-major (fp8_sparse's dense operands, fp8_gemm's rowwise W2). `to_float8_bits` rounds (ties to
even) with the GPU's conversion instruction; under TRITON_INTERPRET, whose own float8 cast rounds
wrongly, it rounds on the bits instead, which gives the same bytes.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@triton.jit
def round_to_float8(x, E5M2: tl.constexpr):
    """fp32 within the format's range -> the nearest e4m3 (e5m2) value, ties to even, kept in fp32.
    NaN stays NaN (the rounding add would carry a NaN's mantissa into its sign: +-0)."""
    bits = x.to(tl.uint32, bitcast=True)
    big = 12582912.0  # 1.5 2^23: adding and subtracting it rounds to an integer, ties to even
    if E5M2:  # 2 mantissa bits; subnormals below 2^-14 are multiples of 2^-16
        normal = ((bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000).to(tl.float32, bitcast=True)
        sub = ((tl.abs(x) * 65536.0 + big) - big) * 0.0000152587890625
        tiny = 0.00006103515625
    else:  # e4m3: 3 mantissa bits; subnormals below 2^-6 are multiples of 2^-9
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        sub = ((tl.abs(x) * 512.0 + big) - big) * 0.001953125
        tiny = 0.015625
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # x's sign, -0 too
    return tl.where(x != x, x, tl.where(tl.abs(x) < tiny, sub, normal))


@triton.jit
def float8_bits(q, E5M2: tl.constexpr):
    """The float8 bytes (uint8) of q, already rounded by round_to_float8; NaN as 0x7F (a NaN in both
    formats), which the interpreter's cast would get wrong."""
    b = (q.to(tl.float8e5) if E5M2 else q.to(tl.float8e4nv)).to(tl.uint8, bitcast=True)
    return tl.where(q != q, tl.full(q.shape, 0x7F, tl.uint8), b)


# Compiled kernels convert with the GPU's cvt.rn.satfinite (sm89+: two values an instruction, ties
# to even, as torch's cast within the format's range); the bit-level rounding above costs about 20
# instructions a value, which makes a conversion instruction-bound. Read once, at import:
# tests/conftest.py sets TRITON_INTERPRET before that.
NATIVE_CVT = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def to_float8_bits(x, E5M2: tl.constexpr):
    """fp32 x, within the format's range or NaN, as float8 bytes (uint8), rounded to nearest even;
    NaN as 0x7F. Callers clamp or scale into range (cvt's saturation is never reached)."""
    if NATIVE_CVT:
        b = (x.to(tl.float8e5) if E5M2 else x.to(tl.float8e4nv)).to(tl.uint8, bitcast=True)
        return tl.where(x != x, tl.full(x.shape, 0x7F, tl.uint8), b)
    return float8_bits(round_to_float8(x, E5M2), E5M2)


# e4m3 power-of-2 scales: fp8_sparse's rows and columns, and fp8_gemm's rowwise operands (the same
# scale as torchao's rowwise recipe, exp2(floor(log2(448 / amax))), for every finite bf16 amax)
AMAX_FLOOR = 1e-12  # an all-zero row (token padding) gets a finite scale


def pow2_scale(amax: Tensor) -> Tensor:
    """The largest power of 2 s with amax * s <= 448, from amax's bits (float32; exact, no log2):
    with amax = m 2^e (1 <= m < 2), s = 2^(8 - e), or 2^(7 - e) where m > 1.75 (448 = 1.75 2^8).
    NaN for a non-finite amax: the row's values become NaN, which the trainer's check catches."""
    a = amax.float()
    bits = a.clamp(min=AMAX_FLOOR).view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    e_s = 8 - e - ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(torch.isfinite(a), ((e_s + 127) << 23).view(torch.float32), float("nan"))


@triton.jit
def pow2_scale_triton(amax, nan_seen):
    """pow2_scale, in Triton (nan_seen: the row held a NaN, which Triton's max reduction may drop)."""
    bits = tl.maximum(amax, 1e-12).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e_s = 8 - e - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    bad = nan_seen | (e == 128)  # NaN seen, or inf (exponent all ones; bf16 reaches 3.39e38, finite)
    return tl.where(bad, 0x7FC00000, (e_s + 127) << 23).to(tl.float32, bitcast=True)  # 0x7FC00000: NaN


@triton.jit
def _scaled_cast_kernel(x_ptr, s_ptr, out_ptr, M, N, stride_m, stride_n, SCALE: tl.constexpr,
                        TRANSPOSE: tl.constexpr, E5M2: tl.constexpr, FMAX: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
    """out = round(clamp(x * s)) for x [M, N] (any strides); SCALE 0: one scale, 1: per row, 2: per
    column. TRANSPOSE: out is [N, M] row-major, the tile transposed in registers (both sides contiguous)."""
    i = tl.program_id(0) * BM + tl.arange(0, BM)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    x = tl.load(x_ptr + i[:, None] * stride_m + j[None, :] * stride_n, mask=(i[:, None] < M) & (j[None, :] < N),
                other=0.0).to(tl.float32)
    if SCALE == 0:
        y = x * tl.load(s_ptr)
    elif SCALE == 1:
        y = x * tl.load(s_ptr + i, mask=i < M, other=1.0)[:, None]
    else:
        y = x * tl.load(s_ptr + j, mask=j < N, other=1.0)[None, :]
    # NaN must survive (the trainer's non-finite check sees it); Triton's min/max drop it by default
    q = to_float8_bits(tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), E5M2)
    if TRANSPOSE:
        tl.store(out_ptr + j[:, None] * M + i[None, :], tl.trans(q), mask=(j[:, None] < N) & (i[None, :] < M))
    else:
        tl.store(out_ptr + i[:, None] * N + j[None, :], q, mask=(i[:, None] < M) & (j[None, :] < N))


def scaled_cast_reference(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def scaled_cast(t: Tensor, scale: Tensor, dtype: torch.dtype, transpose: bool = False) -> Tensor:
    """scaled_cast_reference(t, scale, dtype) (t 2-D, any strides; scale float32 of one element,
    [M, 1] or [1, N]), contiguous; transpose: its transpose [N, M], contiguous."""
    m, n = t.shape
    if scale.numel() == 1:
        kind = 0
    elif scale.shape == (m, 1):
        kind = 1
    elif scale.shape == (1, n):
        kind = 2
    else:
        raise ValueError(f"scaled_cast: scale of shape {tuple(scale.shape)} for a [{m}, {n}] tensor; "
                         f"give one element, [{m}, 1] or [1, {n}]")
    out = torch.empty((n, m) if transpose else (m, n), dtype=dtype, device=t.device)
    if t.numel():
        grid = (triton.cdiv(m, 64), triton.cdiv(n, 64))
        _scaled_cast_kernel[grid](t, scale.float().contiguous(), out.view(torch.uint8), m, n, t.stride(0), t.stride(1), SCALE=kind,
                                  TRANSPOSE=transpose, E5M2=dtype == E5M2, FMAX=torch.finfo(dtype).max,
                                  BM=64, BN=64, num_warps=4)
    return out


# A row-major B's column conversion, in two launches that each cover the GPU's whole width:
# 1. column amaxes: each program reduces a COLUMN_AMAX_TILE tile of B and takes an atomic max on the
#    bits of |b| (as int32, NaN > inf > every finite value, so a NaN survives the max);
# 2. the cast: 64 x 64 tiles, each column's scale from its amax, written transposed (K-major).
# Two launches because one kernel of N/16 programs, each walking all of K twice, covers too little
# of the GPU and reads B twice from HBM; the amax tile is the fastest of those tried (lab/LOG.md).
COLUMN_AMAX_TILE = (256, 64)


@triton.jit
def _column_amax_kernel(b_ptr, amax_ptr, K, N, stride_k, stride_n, BK: tl.constexpr, BN: tl.constexpr):
    """amax_ptr[j] = max(amax_ptr[j], bits of max |b[k, j]|) over this program's BK x BN tile."""
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    v = tl.load(b_ptr + k[:, None] * stride_k + j[None, :] * stride_n, mask=(k[:, None] < K) & (j[None, :] < N),
                other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr + j, tl.max(tl.abs(v).to(tl.int32, bitcast=True), 0), mask=j < N)


@triton.jit
def _column_cast_kernel(b_ptr, amax_ptr, out_ptr, scale_ptr, inv_ptr, K, N, stride_k, stride_n, BK: tl.constexpr,
                        BN: tl.constexpr):
    """out [N, K] = b [K, N] times each column's power-of-2 scale (from its amax bits), as e4m3,
    transposed; the first row of programs also writes the scales and their reciprocals (rounded as
    torch's)."""
    k = tl.program_id(0) * BK + tl.arange(0, BK)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    bits = tl.load(amax_ptr + j, mask=j < N, other=0)
    s = pow2_scale_triton(bits.to(tl.float32, bitcast=True), bits > 0x7F800000)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + j, s, mask=j < N)
        tl.store(inv_ptr + j, tl.math.div_rn(tl.full([BN], 1.0, tl.float32), s), mask=j < N)
    m = (k[:, None] < K) & (j[None, :] < N)
    v = tl.load(b_ptr + k[:, None] * stride_k + j[None, :] * stride_n, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + j[None, :] * K + k[:, None], to_float8_bits(v * s[None, :], False), mask=m)


def column_amax_bits(b: Tensor) -> Tensor:
    """The bits (int32) of each column's max |b[:, j]| for b [K, N], in one launch (and a zero fill)."""
    k, n = b.shape
    amax = torch.zeros(n, dtype=torch.int32, device=b.device)
    if k and n:
        bk, bn = COLUMN_AMAX_TILE
        _column_amax_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](b, amax, k, n, b.stride(0), b.stride(1), BK=bk,
                                                                       BN=bn, num_warps=8)
    return amax


def columns_to_e4m3(b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """b [K, N] (bf16 or fp32, any strides) cast to e4m3 with a power-of-2 scale per column (pow2_scale
    of its amax), written K-major: (the cast [N, K] row-major, the scales [N], their reciprocals [N]).
    Bit for bit columns_to_e4m3_reference."""
    k, n = b.shape
    out = torch.empty(n, k, dtype=E4M3, device=b.device)
    s, inv = torch.empty(n, dtype=torch.float32, device=b.device), torch.empty(n, dtype=torch.float32, device=b.device)
    if n:
        _column_cast_kernel[(max(triton.cdiv(k, 64), 1), triton.cdiv(n, 64))](
            b, column_amax_bits(b), out.view(torch.uint8), s, inv, k, n, b.stride(0), b.stride(1), BK=64, BN=64,
            num_warps=4)
    return out, s, inv


def columns_to_e4m3_reference(b: Tensor) -> tuple[Tensor, Tensor]:
    """(the cast [N, K], the scales [N]) of columns_to_e4m3, in PyTorch."""
    s = pow2_scale(b.float().abs().amax(0)) if b.shape[0] else pow2_scale(b.new_zeros(b.shape[1]))
    return (b.float().t() * s[:, None]).to(E4M3), s
