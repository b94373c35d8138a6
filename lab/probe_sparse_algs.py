"""Every cuSPARSELt algorithm id for the four sparse GEMMs of the srelu24 FFN, timed in a sustained
loop (the H200 runs these at its power cap, not at the clock of a short search):

    python lab/probe_sparse_algs.py --shape 7B --tokens 16384 --out algs.json

Per GEMM: the id that kernels/srelu24_ffn.sparse_mm picks (torch's mm_search), and per id the
median ms (triton do_bench, 300 ms) and the relative difference of its product from id 0's.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.cusparselt import cached_mm  # noqa: E402
from kernels.srelu24_sparsify import srelu_sparsify_2to4  # noqa: E402
from kernels.srelu24_sparsify_backward import backward_operands, padded_tokens  # noqa: E402
from kernels.cusparselt import _SEARCHED  # noqa: E402
from kernels.srelu24_ffn import sparse_mm  # noqa: E402
from kernels.srelu24_reference import densest_from_counts, random_token_order  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7B", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--max-ids", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_sparse_algs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    (D, Fh), T = SHAPES[args.shape], args.tokens
    x, dy, w1, w2 = ffn_inputs(D, Fh, T)
    z = x @ w1.t()
    buf, counts = srelu_sparsify_2to4(z)
    perm = random_token_order(T, "cuda")
    dzb, (s_a, _), (s_dz, _) = backward_operands(z, dy @ w2, perm, densest_from_counts(counts, 0.05))
    Tp = padded_tokens(T)
    dy_p, x_p = F.pad(dy[perm], (0, 0, 0, Tp - T)), F.pad(x[perm], (0, 0, 0, Tp - T))
    gemms = {"Y = A24 W2^T": (buf, w2.t(), False), "dX = dZ W1": (dzb, w1, False),
             "dW2 = (S(A24)^T dY_p)^T": (s_a, dy_p, True), "dW1 = S(dZ)^T X_p": (s_dz, x_p, False)}
    rows = []
    for name, (a, b, tr) in gemms.items():
        sparse_mm(a, b, transpose_result=tr)
        picked = next(v for k, v in _SEARCHED.items() if k[0] == tuple(a.shape) and k[1] == tuple(b.shape) and k[3] == tr)
        ref = cached_mm(a, b, 0, tr).float()
        times = {}
        for alg in range(args.max_ids):
            try:
                got = cached_mm(a, b, alg, tr).float()
            except RuntimeError as e:  # past the last id
                times[alg] = {"error": str(e)[:80]}
                break
            err = ((got - ref).norm() / ref.norm()).item()
            times[alg] = {"ms": do_bench(lambda: cached_mm(a, b, alg, tr), warmup=25, rep=300, return_mode="median"),
                          "rel_diff_vs_id0": err}
        best = min(((t["ms"], k) for k, t in times.items() if "ms" in t and t["rel_diff_vs_id0"] < 1e-2),
                   default=(float("nan"), None))
        picked_ms = times.get(picked, {}).get("ms")  # None: the picked id is past --max-ids
        if picked_ms is None:
            picked_ms = do_bench(lambda: sparse_mm(a, b, transpose_result=tr), warmup=25, rep=300, return_mode="median")
        rows.append({"gemm": name, "picked": picked, "picked_ms": picked_ms,
                     "best": best[1], "best_ms": best[0], "ids": times})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| GEMM | picked id | its ms | fastest id (same product) | its ms | all ids: ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        all_ms = ", ".join(f"{k}: {t['ms']:.3f}" for k, t in r["ids"].items() if "ms" in t)
        print(f"| {r['gemm']} | {r['picked']} | {r['picked_ms']:.3f} | {r['best']} | {r['best_ms']:.3f} | {all_ms} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "T": T,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
