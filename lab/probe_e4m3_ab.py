"""A/B of srelu24's float8 conversion kernels: this tree's `kernels` against an older copy of the
package, side by side in one process, at the 7B FFN's operand shapes (T tokens, d 4096, F 16512).
Per piece: are the outputs bit-identical, GPU µs of each (do_bench median), and the bytes moved at
that time (GB/s: the HBM of an H200 gives about 4,300). Then launch settings of the new
`_compressed_to_e4m3_kernel`, each checked against the shipped launch.

    mkdir -p /tmp/old && git archive <commit> kernels | tar -x -C /tmp/old && mv /tmp/old/kernels /tmp/old/old_kernels
    python lab/probe_e4m3_ab.py --old /tmp/old [--tokens 16384]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import fp8_cast as new_cast, fp8_gemm as new_gemm, fp8_sparse as new  # noqa: E402
from kernels.cslt_layout import compressed_bytes_e4m3  # noqa: E402
from kernels.srelu24_sparsify import srelu_sparsify_2to4  # noqa: E402

D, F = 4096, 16512
BF = torch.bfloat16


def compressed(m: int, k: int) -> torch.Tensor:
    """A24 of random pre-activations (m a multiple of 64: no padded rows), as the forward writes it."""
    return srelu_sparsify_2to4(torch.randn(m, k, device="cuda", dtype=BF))[0]


def same(x, y) -> bool:
    if isinstance(x, tuple):
        return all(same(a, b) for a, b in zip(x, y))
    as_bytes = (lambda t: t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]))  # NaN == NaN
    return x.shape == y.shape and torch.equal(as_bytes(x), as_bytes(y))


def us(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def row(name: str, shape, f_old, f_new, nbytes: int) -> None:
    eq = same(f_old(), f_new())
    t_old, t_new = us(f_old), us(f_new)
    print(f"| {name} | {'x'.join(map(str, shape))} | {eq} | {t_old:.1f} | {t_new:.1f} | {t_old / t_new:.2f}x "
          f"| {nbytes / t_old / 1e3:.0f} | {nbytes / t_new / 1e3:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a directory holding the older package as old_kernels/")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    sys.path.insert(0, args.old)
    from old_kernels import fp8_cast as old_cast, fp8_gemm as old_gemm, fp8_sparse as old

    T = args.tokens
    print(f"native cvt in the new kernels: {bool(new_cast.NATIVE_CVT)}")
    print("| piece | shape | equal | old µs | new µs | new vs old | old GB/s | new GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, k in ((T, F), (F, T)):  # A24 and dZ (tokens x features); S(A24)^T and S(dZ)^T
        buf = compressed(m, k)
        moved = buf.numel() * 2 + compressed_bytes_e4m3(m, k)
        row("compressed_to_e4m3", (m, k), lambda: old.compressed_to_e4m3(buf, m, k),
            lambda: new.compressed_to_e4m3(buf, m, k), moved)
    for k, n in ((F, D), (T, D)):  # W1 (dX's B); X and dY (dW1's and dW2's B): row-major, scaled per column
        b = torch.randn(k, n, device="cuda", dtype=BF)
        row("kmajor_e4m3, row-major B", (k, n), lambda: old.kmajor_e4m3(b), lambda: new.kmajor_e4m3(b), b.numel() * 3)
    w2 = torch.randn(D, F, device="cuda", dtype=BF)  # Y's B = W2^T: K-major already, scaled per row of W2
    row("kmajor_e4m3, K-major B", (F, D), lambda: old.kmajor_e4m3(w2.t()), lambda: new.kmajor_e4m3(w2.t()), w2.numel() * 3)
    x = torch.randn(T, D, device="cuda", dtype=BF)
    s_row = torch.rand(T, 1, device="cuda") * 4
    row("scaled_cast e4m3, row scales", (T, D), lambda: old_cast.scaled_cast(x, s_row, old_cast.E4M3),
        lambda: new_cast.scaled_cast(x, s_row, new_cast.E4M3), x.numel() * 3)
    s_col = torch.rand(1, F, device="cuda") * 4
    row("scaled_cast e4m3, column scales, transposed", (D, F),
        lambda: old_cast.scaled_cast(w2, s_col, old_cast.E4M3, transpose=True),
        lambda: new_cast.scaled_cast(w2, s_col, new_cast.E4M3, transpose=True), w2.numel() * 3)

    w1 = torch.randn(F, D, device="cuda", dtype=BF)
    dy = torch.randn(T, D, device="cuda", dtype=BF)
    for name, a, b, grad in (("Z = X W1^T", x, w1.t(), False), ("dA = dY W2", dy, w2, True)):  # a [T, d] and B
        row(f"rowwise operands of {name}", (T, D, F), lambda: old_gemm._operands(a, b, "rowwise", grad),
            lambda: new_gemm._operands(a, b, "rowwise", grad), (a.numel() + b.numel()) * 3)
    print("\nnew column amax tiles (kmajor_e4m3 of a row-major B; the shipped tile first)")
    print("| shape | BK x BN | equal | µs | GB/s |")
    print("|---|---|---|---|---|")
    for k, n in ((F, D), (T, D)):
        b = torch.randn(k, n, device="cuda", dtype=BF)
        want = new.kmajor_e4m3(b)
        for tile in (new_cast.COLUMN_AMAX_TILE, (512, 64), (256, 32), (512, 32), (1024, 64), (128, 64)):
            def launch(tile=tile):  # column_amax_bits reads the tile at each call
                new_cast.COLUMN_AMAX_TILE, keep = tile, new_cast.COLUMN_AMAX_TILE
                try:
                    return new.kmajor_e4m3(b)
                finally:
                    new_cast.COLUMN_AMAX_TILE = keep
            eq = same(launch(), want)
            t = us(launch)
            print(f"| {k}x{n} | {tile[0]} x {tile[1]} | {eq} | {t:.1f} | {b.numel() * 3 / t / 1e3:.0f} |", flush=True)
    print("\nnew _compressed_to_e4m3_kernel, launch settings (the shipped one first)")
    print("| shape | BLOCK | warps | equal | µs | GB/s |")
    print("|---|---|---|---|---|---|")
    for m, k in ((T, F), (F, T)):
        buf = compressed(m, k)
        flat = buf.reshape(-1)
        moved = buf.numel() * 2 + compressed_bytes_e4m3(m, k)
        want = new.compressed_to_e4m3(buf, m, k)
        n_blocks = m * k // 4096
        for block, warps in ((1024, 4), (2048, 8), (1024, 8), (2048, 4), (512, 2), (4096, 8)):
            out = torch.empty(compressed_bytes_e4m3(m, k), dtype=torch.uint8, device="cuda")
            scale = torch.empty(m, dtype=torch.float32, device="cuda")

            def launch():
                new._compressed_to_e4m3_kernel[(m + triton.cdiv(n_blocks, new.METADATA_BLOCKS),)](
                    flat, flat.view(torch.int32), out, scale, m, n_blocks, C=k // 2, BLOCK=block,
                    BLOCKS=new.METADATA_BLOCKS, num_warps=warps)
            launch()
            eq = torch.equal(out, want[0].view(torch.uint8).reshape(-1)) and torch.equal(scale, want[1])
            t = us(launch)
            print(f"| {m}x{k} | {block} | {warps} | {eq} | {t:.1f} | {moved / t / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
