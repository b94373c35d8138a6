"""The dense features' weight-gradient GEMM of srelu24 at 7B (826 rows, T=16384, d 4096), bf16
against e4m3 (fp8_sparse.dense_mm), timed at boost clock (do_bench) and in a 2 s loop at the power
cap (NVML energy): it is no faster alone at boost, and cheaper in energy at the cap, where the FFN
runs (benchmarks/RESULTS.md, session 17).

    python lab/probe_dense_rows_energy.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import fp8_sparse  # noqa: E402
from training.gpu_clocks import energy_during  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    rows = torch.randn(826, 16384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    b8, sb = fp8_sparse.kmajor_e4m3(b)
    big = torch.randn(16384, 16512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16512, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # bring the GPU to its power cap first
        big @ w
    fns = {"bf16 rows @ b": lambda: rows @ b, "e4m3 dense_mm": lambda: fp8_sparse.dense_mm(rows, b8, sb)}
    for name, fn in fns.items():
        t = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        e = energy_during(fn, 2.0)
        print(f"{name}: do_bench {t:.1f} us; sustained {1e3 * e['ms_per_call']:.1f} us, {e.get('mj_per_call', float('nan')):.1f} mJ, {e['sm_clock_mhz']} MHz, {e['power_w']} W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
