"""A/B in one process: srelu24's e4m3 FFN over an optimizer step's micro-batches, its weight
conversions kept across them (kernels/weight_casts.py, as training/step.py runs them) against
converted in each. 7B FFN shapes (d 4096, F 16512), fp32 weights (one GPU), bf16 autocast, float8
rowwise, e4m3 2:4.

    python lab/probe_weight_casts_ab.py [--tokens 8192] [--micro 4] [--rounds 6]

Prints whether the gradients agree bit for bit, and the ms per micro-batch (fw+bw) in interleaved
rounds (do_bench medians of a whole step's micro-batches, divided by --micro; the order reversed
every other round).
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import srelu24_ffn, weight_casts  # noqa: E402
from lab.patched_ab import fp32_7b_ffn_inputs, patched_ab, patched_grads  # noqa: E402
from scripts.bench_ffn import MODEL_RECIPE  # noqa: E402

KEPT = weight_casts.reuse_within_step


def converted_each_time(enabled=True):
    """Before: no conversion kept."""
    return KEPT(enabled=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    x, gy, w1, w2 = fp32_7b_ffn_inputs(args.tokens)

    def run():
        for t in (x, w1, w2):
            t.grad = None
        with weight_casts.reuse_within_step():  # patched: the variant's scope
            for _ in range(args.micro):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = srelu24_ffn.srelu24_ffn_kernels(x, w1, w2, MODEL_RECIPE, float8="rowwise", sparse_float8=True)
                y.backward(gy)

    variants = {"converted per micro-batch": converted_each_time, "kept across micro-batches": KEPT}
    grads = patched_grads(weight_casts, "reuse_within_step", variants, run,
                          lambda: [t.grad.clone() for t in (x, w1, w2)])
    for name, g0, g1 in zip(("dX", "dW1", "dW2"), *grads.values()):
        print(f"{name}: bit-identical {torch.equal(g0, g1)}")
    bench = lambda fn: do_bench(fn, warmup=10, rep=200, return_mode="median") / args.micro  # noqa: E731
    patched_ab(weight_casts, "reuse_within_step", variants, run, args.rounds, bench,
               f"FFN fw+bw per micro-batch, T={args.tokens}, {args.micro} micro-batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
