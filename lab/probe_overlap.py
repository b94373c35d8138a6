"""Can the srelu24 backward's small operations hide under its GEMMs on a second CUDA stream?

    python lab/probe_overlap.py --out overlap.json

At 7B, T=16384 (median ms, triton do_bench), for each GEMM of the FFN that the small work could
run beside: the GEMM alone, the GEMM followed by the work on the same stream, and the work on a
side stream of high or of normal priority, concurrent with the GEMM (the caller waits for
both). The small work is either the index work (token permutation, dense-feature sort and
slots, inverse permutation) or the row gathers of dY and X. A GEMM that holds every SM for its
whole length (a persistent kernel) leaves the side stream nothing until its tail.

Both were once put beside their GEMMs in the FFN's backward (high priority) and taken out again:
the whole FFN was not measurably faster with them, while a second stream and the allocator's
cross-stream bookkeeping are a risk in training (the figures: lab/LOG.md, the side-stream entry).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.srelu24_sparsify import srelu_sparsify_2to4  # noqa: E402
from kernels.srelu24_sparsify_backward import backward_operands, dense_slots  # noqa: E402
from kernels.srelu24_ffn import sparse_mm  # noqa: E402
from kernels.srelu24_reference import densest_from_counts, random_token_order  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_overlap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    (D, Fh), T = SHAPES["7B"], 16384
    x, dy, w1, w2 = ffn_inputs(D, Fh, T)
    z = x @ w1.t()
    buf, counts = srelu_sparsify_2to4(z)
    da = dy @ w2
    perm = random_token_order(T, "cuda")
    dense = densest_from_counts(counts, 0.05)
    dzb = backward_operands(z, da, perm, dense)[0]

    def index_work():
        p = random_token_order(T, "cuda")
        d = densest_from_counts(counts, 0.05)
        dense_slots(d, Fh, "cuda")
        inv = torch.empty_like(p)
        inv[p] = torch.arange(T, device="cuda", dtype=p.dtype)

    def gathers():
        return dy[perm], x[perm]

    gemms = {"Y = A24 W2^T (sparse, forward)": lambda: sparse_mm(buf, w2.t()),
             "dA = dY W2 (dense)": lambda: dy @ w2,
             "dX = dZ W1 (sparse)": lambda: sparse_mm(dzb, w1)}
    works = {"index work": index_work, "dY, X row gathers": gathers}
    main_stream = torch.cuda.current_stream()
    streams = {"high": torch.cuda.Stream(priority=-1), "normal": torch.cuda.Stream(priority=0)}

    def beside(gemm, work, side):
        def run():
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                work()
            gemm()
            main_stream.wait_stream(side)
        return run

    bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    rows = []
    for wname, work in works.items():
        work_ms = bench(work)
        for gname, gemm in gemms.items():
            r = {"gemm": gname, "work": wname, "work_alone_ms": work_ms, "gemm_alone_ms": bench(gemm),
                 "serial_ms": bench(lambda: (gemm(), work()))}
            for pname, side in streams.items():
                r[f"side_{pname}_ms"] = bench(beside(gemm, work, side))
            r["saved_ms_best"] = r["serial_ms"] - min(r["side_high_ms"], r["side_normal_ms"])
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| GEMM | side work | work alone | GEMM alone | serial | side, high priority | side, normal | saved |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gemm']} | {r['work']} | {r['work_alone_ms']:.3f} | {r['gemm_alone_ms']:.3f} | {r['serial_ms']:.3f} "
              f"| {r['side_high_ms']:.3f} | {r['side_normal_ms']:.3f} | {r['saved_ms_best']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
