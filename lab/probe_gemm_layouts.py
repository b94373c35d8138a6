"""Do the FFN's sparse GEMMs run faster with B column-major? At one shape (default 7B, T=16384),
each of the backward's three sparse GEMMs with B as the FFN passes it (row-major) and as the
transpose of a row-major copy, plus the cost of making that copy (median ms, triton do_bench).

    python lab/probe_gemm_layouts.py [--d 4096 --f 16384 --t 16384]
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.srelu24_sparsify import srelu_sparsify_2to4  # noqa: E402
from kernels.srelu24_sparsify_backward import backward_operands  # noqa: E402
from kernels.srelu24_ffn import sparse_mm  # noqa: E402
from kernels.srelu24_reference import densest_from_counts, random_token_order  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=16384)
    ap.add_argument("--t", type=int, default=16384)
    a = ap.parse_args()
    bf = torch.bfloat16
    x = torch.randn(a.t, a.d, device="cuda", dtype=bf)
    w1 = torch.randn(a.f, a.d, device="cuda", dtype=bf) * a.d ** -0.5
    w2 = torch.randn(a.d, a.f, device="cuda", dtype=bf) * a.f ** -0.5
    dy = torch.randn(a.t, a.d, device="cuda", dtype=bf)
    z = F.linear(x, w1)
    _, counts = srelu_sparsify_2to4(z)
    perm = random_token_order(a.t, "cuda")
    dzb, (s_a, _), (s_dz, _) = backward_operands(z, dy @ w2, perm, densest_from_counts(counts, 0.05))
    x_p, dy_p = x[perm], dy[perm]
    cm = lambda t: t.t().contiguous().t()  # noqa: E731 - same values, column-major
    bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    cases = {"dX = dZ W1": (lambda b: sparse_mm(dzb, b), w1),
             "dW1 = S(dZ)^T X_p": (lambda b: sparse_mm(s_dz, b), x_p),
             "dW2 = (S(A24)^T dY_p)^T": (lambda b: sparse_mm(s_a, b, transpose_result=True), dy_p)}
    out = {}
    for name, (fn, b) in cases.items():
        bc = cm(b)
        rel = ((fn(bc).float() - fn(b).float()).norm() / fn(b).float().norm()).item()
        out[name] = {"row_major_ms": bench(lambda: fn(b)), "column_major_ms": bench(lambda: fn(bc)),
                     "copy_to_column_major_ms": bench(lambda: b.t().contiguous()), "rel_diff": rel}
        print(f"| {name} | {out[name]['row_major_ms']:.3f} | {out[name]['column_major_ms']:.3f} "
              f"| {out[name]['copy_to_column_major_ms']:.3f} | {rel:.1e} |", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
