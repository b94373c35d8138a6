"""The sparse GEMM backends side by side: cuSPARSELt (cached plans, searched algorithm) against
the CUTLASS 3.x sm90 configurations of kernels/csrc/sp24_gemm_sm90.cu (`make cutlass` first),
at the four sparse GEMMs of the srelu24 FFN, with the dense product of the same shape as the yardstick.

    python scripts/bench_sp24_gemm.py --shapes 7B,1B --tokens 16384

Checks first (each must hold before anything is timed):
- CUTLASS's own compressor writes the layout kernels/cslt_layout.py describes ("cutlass_k64/128");
- every configuration's product equals A @ B within bf16 rounding, for each B/D layout.
Writes a table and a JSON (--out).
"""
import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import cutlass_sp24  # noqa: E402
from kernels.cslt_layout import compress  # noqa: E402
from kernels.srelu24_ffn import sparse_mm  # noqa: E402
from model.sparse24 import mask_2to4  # noqa: E402
from scripts.ffn_inputs import SHAPES  # noqa: E402
from training.logger import environment  # noqa: E402

BF = torch.bfloat16


def random_24(m: int, k: int) -> torch.Tensor:
    a = torch.randn(m, k, device="cuda", dtype=BF)
    return a * mask_2to4(a)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_layouts() -> dict:
    out = {}
    for tile_k in (64, 128):
        for m, k in ((128, 256), (320, 512)):
            a = random_24(m, k)
            got = cutlass_sp24.compress(a, tile_k).reshape(-1).view(torch.int16)
            want = compress(a, a != 0, f"cutlass_k{tile_k}").reshape(-1).view(torch.int16)
            nv = m * k // 2
            out[f"k{tile_k} {m}x{k}"] = {"values_equal": torch.equal(got[:nv], want[:nv]),
                                         "meta_equal": torch.equal(got[nv:], want[nv:]),
                                         "meta_words_differing": int((got[nv:] != want[nv:]).sum())}
    return out


def gemm_cases(D: int, Fh: int, T: int) -> dict:
    """The FFN's four sparse GEMMs: (M, K, B maker, transposed output)."""
    return {
        "fw Y = A24 W2^T": (T, Fh, lambda: torch.randn(D, Fh, device="cuda", dtype=BF).t(), False),
        "bw dX = dZ W1": (T, Fh, lambda: torch.randn(Fh, D, device="cuda", dtype=BF), False),
        "bw dW1 = S(dZ)^T X": (Fh, T, lambda: torch.randn(T, D, device="cuda", dtype=BF), False),
        "bw dW2 = (S(A24)^T dY)^T": (Fh, T, lambda: torch.randn(T, D, device="cuda", dtype=BF), True),
    }


def check_products(cfgs) -> dict:
    out = {}
    for name, (m, k, make_b, tr) in gemm_cases(512, 1024, 1024).items():
        a, b = random_24(m, k), make_b()
        want = a.float() @ b.float()
        for cfg in cfgs:
            buf = cutlass_sp24.compress(a, cutlass_sp24.TILE_K[cfg])
            got = cutlass_sp24.mm(buf, b, cfg, out_transposed=tr)
            out[f"{name} c{cfg}"] = rel_err(got, want)
    return out


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def time_shape(D: int, Fh: int, T: int, cfgs) -> dict:
    rows = {}
    for name, (m, k, make_b, tr) in gemm_cases(D, Fh, T).items():
        a, b = random_24(m, k), make_b()
        b_dense = b.contiguous()
        row = {"dense": bench(lambda: a @ b_dense)}
        cs = torch._cslt_compress(a)
        # dW2: both backends write the weight's [d, F] layout directly (column-major result)
        row["cusparselt"] = bench(lambda: sparse_mm(cs, b, transpose_result=tr))
        ref = (sparse_mm(cs, b, transpose_result=True).t() if tr else sparse_mm(cs, b)).float()
        for cfg in cfgs:
            buf = cutlass_sp24.compress(a, cutlass_sp24.TILE_K[cfg])
            err = rel_err(cutlass_sp24.mm(buf, b, cfg, out_transposed=tr), ref)
            row[f"c{cfg}"] = bench(lambda: cutlass_sp24.mm(buf, b, cfg, out_transposed=tr)) if err < 1e-2 else None
            row[f"c{cfg} err vs cusparselt"] = err
        rows[name] = row
        del a, b, b_dense, cs
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="7B,1B")
    p.add_argument("--tokens", default="16384")
    p.add_argument("--configs", default=",".join(str(c) for c in cutlass_sp24.CONFIGS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_sp24_gemm.json"))
    args = p.parse_args()
    if not cutlass_sp24.available():
        print(f"CUTLASS library not available ({cutlass_sp24.library_path()}): run make cutlass on a Hopper GPU machine")
        return 1
    cfgs = [int(c) for c in args.configs.split(",")]
    result = {"when": datetime.now(timezone.utc).isoformat(), "environment": environment(),
              "configs": {c: cutlass_sp24.CONFIGS[c] for c in cfgs}}
    result["layouts"] = check_layouts()
    result["products_rel_err"] = check_products(cfgs)
    print(json.dumps({k: result[k] for k in ("layouts", "products_rel_err")}, indent=1))
    result["times_ms"] = {}
    for shape in args.shapes.split(","):
        D, Fh = SHAPES[shape]
        for T in (int(t) for t in args.tokens.split(",")):
            rows = time_shape(D, Fh, T, cfgs)
            result["times_ms"][f"{shape} T={T}"] = rows
            print(f"\n{shape} (d {D}, F {Fh}), T={T}: ms (dense / cuSPARSELt / CUTLASS configs)")
            print("| GEMM | dense | cuSPARSELt | " + " | ".join(f"c{c}" for c in cfgs) + " | best vs cuSPARSELt |")
            print("|---|---|---|" + "---|" * len(cfgs) + "---|")
            for name, row in rows.items():
                ts = [row[f"c{c}"] for c in cfgs]
                best = min((t for t in ts if t is not None), default=None)
                cells = " | ".join("fail" if t is None else f"{t:.3f}" for t in ts)
                gain = f"{row['cusparselt'] / best:.2f}x" if best else "-"
                print(f"| {name} | {row['dense']:.3f} | {row['cusparselt']:.3f} | {cells} | {gain} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
