"""Candidate for kernels/fp8_sparse.kmajor_e4m3 on a row-major B [K, N]: the column amax split
over K (programs of KS rows, combined by atomic max on the amax's bits), then the cast in a second
launch over the same split. The shipped kernel has one program per 16 columns, which reads its
columns twice and leaves the GPU part-idle at N = 4096: 188 us at 16512 x 4096 against about 50 us
for a bf16 read and an e4m3 write at HBM speed (benchmarks/RESULTS.md, session 13). Predicted:
about 80-100 us there, for two launches and a memset more of host time.

    python lab/probe_column_splitk.py [--shapes 16512x4096 16384x4096 8192x4096]

Checks the candidate bit for bit against the shipped kernel, then prints GPU us (do_bench
median) and host us per call (tiny operands) of both.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import fp8_sparse  # noqa: E402
from kernels.fp8_cast import float8_bits, round_to_float8  # noqa: E402
from kernels.fp8_sparse import E4M3, _column_tile, _pow2_scale  # noqa: E402
from scripts.bench_ffn import host_ms  # noqa: E402

NAN_BITS = tl.constexpr(0x7FC00000)  # a constexpr: jit code reads no plain globals; above every finite or infinite non-negative float's bits as an int32


@triton.jit
def _column_amax_kernel(b_ptr, amax_ptr, K, N, stride_k, stride_n, KS: tl.constexpr, BK: tl.constexpr,
                        BN: tl.constexpr):
    """amax_ptr[j] (int32 bits of a float32, zero-initialised) = max over this program's KS rows of
    |b[k, j]|, NaN where a NaN was seen (non-negative floats order as their bits)."""
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    k_start = tl.program_id(1) * KS
    amax = tl.zeros([BK, BN], dtype=tl.float32)
    nan = tl.zeros([BK, BN], dtype=tl.int32)
    for k0 in range(0, KS, BK):
        k = k_start + k0 + tl.arange(0, BK)
        v = _column_tile(b_ptr, k, j, K, N, stride_k, stride_n)
        amax = tl.maximum(amax, tl.abs(v))
        nan = tl.maximum(nan, (v != v).to(tl.int32))
    bits = tl.max(amax, 0).to(tl.int32, bitcast=True)
    bits = tl.where(tl.max(nan, 0) > 0, NAN_BITS, bits)
    tl.atomic_max(amax_ptr + j, bits, mask=j < N)


@triton.jit
def _column_cast_kernel(b_ptr, amax_ptr, out_ptr, scale_ptr, K, N, stride_k, stride_n, KS: tl.constexpr,
                        BK: tl.constexpr, BN: tl.constexpr):
    """This program's KS rows of BN columns scaled by the columns' power-of-2 scales, rounded to e4m3
    and written as out [N, K] (B K-major); the first program of each column group writes the scales."""
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    k_start = tl.program_id(1) * KS
    amax = tl.load(amax_ptr + j, mask=j < N, other=0).to(tl.float32, bitcast=True)
    s = _pow2_scale(amax, amax != amax)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + j, s, mask=j < N)
    for k0 in range(0, KS, BK):
        k = k_start + k0 + tl.arange(0, BK)
        v = _column_tile(b_ptr, k, j, K, N, stride_k, stride_n)
        q = float8_bits(round_to_float8(v * s[None, :], False), False)
        tl.store(out_ptr + j[:, None] * K + k[None, :], tl.trans(q), mask=(j[:, None] < N) & (k[None, :] < K))


def kmajor_e4m3_splitk(b: torch.Tensor, ks: int = 2048, bk: int = 512, bn: int = 16, warps: int = 8):
    """fp8_sparse.kmajor_e4m3 for a row-major b [K, N], split over K."""
    k, n = b.shape
    out = torch.empty(n, k, dtype=E4M3, device=b.device)
    s = torch.empty(n, dtype=torch.float32, device=b.device)
    amax = torch.zeros(n, dtype=torch.int32, device=b.device)
    ks = min(ks, triton.next_power_of_2(k))
    bk = min(bk, ks)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, ks))
    _column_amax_kernel[grid](b, amax, k, n, b.stride(0), b.stride(1), KS=ks, BK=bk, BN=bn, num_warps=warps)
    _column_cast_kernel[grid](b, amax, out.view(torch.uint8), s, k, n, b.stride(0), b.stride(1), KS=ks, BK=bk,
                              BN=bn, num_warps=warps)
    return out.t(), s


def same(x, y) -> bool:
    return torch.equal(x[0].view(torch.uint8), y[0].view(torch.uint8)) and torch.equal(x[1], y[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["16512x4096", "16384x4096", "8192x4096"])
    ap.add_argument("--ks", type=int, nargs="+", default=[1024, 2048, 4096])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_column_splitk.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    tiny = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    print(f"host us per call: shipped {host_ms(lambda: fp8_sparse.kmajor_e4m3(tiny), 1000) * 1e3:.1f}, "
          f"split-K {host_ms(lambda: kmajor_e4m3_splitk(tiny), 1000) * 1e3:.1f}")
    print("| K x N | shipped us | " + " | ".join(f"split-K, KS {ks} us" for ks in args.ks) + " |")
    print("|---" * (2 + len(args.ks)) + "|")
    for shape in args.shapes:
        k, n = map(int, shape.split("x"))
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        b[0, 0] = 1e4  # one large column amax among random ones
        ref = fp8_sparse.kmajor_e4m3(b)
        cells = [f"{do_bench(lambda: fp8_sparse.kmajor_e4m3(b)) * 1e3:.1f}"]
        for ks in args.ks:
            ok = same(kmajor_e4m3_splitk(b, ks), ref)
            cells.append(f"{do_bench(lambda: kmajor_e4m3_splitk(b, ks)) * 1e3:.1f}" if ok else "MISMATCH")
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
