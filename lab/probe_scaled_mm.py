"""Where does float8 rowwise lose to tensorwise? torch._scaled_mm at the swiglu 7B linears' shapes,
each of a linear's three GEMMs (output, grad input, grad weight), in bf16 (torch mm), e4m3
tensorwise and e4m3 rowwise scales, with and without fast accumulation (torchao's recipes use
fast accumulation for the output GEMM only). Median ms (triton do_bench) and TFLOP/s.

    python lab/probe_scaled_mm.py [--tokens 8192 --d 4096 --hidden 11008]
"""
import argparse
import sys

import torch
from triton.testing import do_bench

E4M3 = torch.float8_e4m3fn


def operands(m: int, k: int, n: int, rowwise: bool):
    """a [m, k] row-major, b [k, n] column-major (what _scaled_mm takes), e4m3, with scales."""
    a = torch.randn(m, k, device="cuda").to(E4M3)
    b = torch.randn(n, k, device="cuda").to(E4M3).t()
    if rowwise:
        return a, b, torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    one = torch.ones((), device="cuda")
    return a, b, one, one


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=11008)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_scaled_mm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t, d, h = args.tokens, args.d, args.hidden
    # (name, m, k, n): the w1 / w3 linear (d -> h) and w2 (h -> d), each GEMM of fw + bw
    shapes = [("w1 output", t, d, h), ("w1 grad input", t, h, d), ("w1 grad weight", h, t, d),
              ("w2 output", t, h, d), ("w2 grad input", t, d, h), ("w2 grad weight", d, t, h),
              ("wq output", t, d, d), ("wq grad weight", d, t, d)]
    print("| GEMM | m x k x n | bf16 ms | tensorwise fast / exact ms | rowwise fast / exact ms | best TFLOP/s bf16, tw, rw |")
    print("|---|---|---|---|---|---|")
    total = {}
    for name, m, k, n in shapes:
        fl = 2 * m * k * n
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        ms = {"bf16": do_bench(lambda: x @ w)}
        for rw in (False, True):
            a, b, sa, sb = operands(m, k, n, rw)
            for fast in (True, False):
                ms[(rw, fast)] = do_bench(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                                   use_fast_accum=fast))
        for key, v in ms.items():
            total[key] = total.get(key, 0.0) + v
        tf = [fl / ms[k_] / 1e9 for k_ in ("bf16", (False, True), (True, True))]
        print(f"| {name} | {m}x{k}x{n} | {ms['bf16']:.3f} | {ms[(False, True)]:.3f} / {ms[(False, False)]:.3f} | "
              f"{ms[(True, True)]:.3f} / {ms[(True, False)]:.3f} | {tf[0]:.0f}, {tf[1]:.0f}, {tf[2]:.0f} |", flush=True)
    print(f"| sum | | {total['bf16']:.3f} | {total[(False, True)]:.3f} / {total[(False, False)]:.3f} | "
          f"{total[(True, True)]:.3f} / {total[(True, False)]:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
