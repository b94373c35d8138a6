"""Host time per call of srelu24's float8 pieces, against the bf16 ones:

    python lab/probe_host_time.py

Each piece runs 1000 times on tiny operands (128 x 256), so the GPU finishes each launch before the
host issues the next and the wall time per call is the host's. Where a step's kernels are short
(1B shapes), this host time decides whether the GPU waits (benchmarks/RESULTS.md, session 12).
"""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def cases(m: int = 128, k: int = 256, n: int = 128) -> dict:
    from kernels import fp8_gemm, fp8_sparse
    from kernels.cslt_layout import compress
    from kernels.srelu24_ffn import sparse_mm as sparse_mm_bf16
    from kernels.srelu24_reference import mask_2to4

    dev = "cuda"
    a = torch.relu(torch.randn(m, k, device=dev)).square()
    buf = compress(a.bfloat16(), mask_2to4(a))
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    bt = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ones_m, ones_n = torch.ones(m, device=dev), torch.ones(n, device=dev)
    return {
        "torch add_ (one torch op)": lambda: y.add_(0),
        "rows_to_e4m3": lambda: fp8_sparse.rows_to_e4m3(x),
        "compressed_to_e4m3 (rows + metadata)": lambda: fp8_sparse.compressed_to_e4m3(buf, m, k),
        "kmajor_e4m3, B row-major (columns)": lambda: fp8_sparse.kmajor_e4m3(b),
        "kmajor_e4m3, B K-major (rows)": lambda: fp8_sparse.kmajor_e4m3(bt),
        "unscale_": lambda: fp8_sparse.unscale_(y, row_scale=ones_m, col_scale=ones_n),
        "sparse_mm e4m3 (all of the above + cuSPARSELt)": lambda: fp8_sparse.sparse_mm(buf, b),
        "sparse_mm bf16 (cached plan)": lambda: sparse_mm_bf16(buf, b),
        "fp8_gemm.mm tensorwise": lambda: fp8_gemm.mm(x, b, "tensorwise", False),
        "fp8_gemm.mm rowwise": lambda: fp8_gemm.mm(x, b, "rowwise", False),
        "torch mm bf16": lambda: x @ b,
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("error: probe_host_time.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print("| piece | host us per call | wall us per call |\n|---|---|---|")
    for name, f in cases().items():
        for _ in range(20):  # compiles, plans and algorithm searches out of the timing
            f()
        torch.cuda.synchronize()
        calls = 1000
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"| {name} | {(t1 - t0) / calls * 1e6:.1f} | {(t2 - t0) / calls * 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
