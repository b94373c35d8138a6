"""A/B in one process: srelu24's e4m3 FFN with fp32 weights (as the model keeps them on one GPU,
under bf16 autocast), the weights going into the custom op as fp32 (their e4m3 conversions read
fp32, the gradients come out fp32) against the weights cast to bf16 outside the op (autograd casts
them, and their gradients back). 7B FFN shapes (d 4096, F 16512), float8 rowwise, e4m3 2:4.

    python lab/probe_fp32_weights_ab.py [--tokens 8192] [--rounds 6]

Prints the gradients' relative differences and fw+bw in interleaved rounds (ms, do_bench
medians; the order reversed every other round).
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import srelu24_ffn  # noqa: E402
from lab.patched_ab import fp32_7b_ffn_inputs, patched_ab, patched_grads  # noqa: E402
from scripts.bench_ffn import MODEL_RECIPE  # noqa: E402

FP32_IN = srelu24_ffn._op_weight


def bf16_outside(w, e4m3):
    """Before: every weight cast to bf16 outside the op."""
    return w.to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    x, gy, w1, w2 = fp32_7b_ffn_inputs(args.tokens)

    def run():
        for t in (x, w1, w2):
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = srelu24_ffn.srelu24_ffn_kernels(x, w1, w2, MODEL_RECIPE, float8="rowwise", sparse_float8=True)
        y.backward(gy)

    variants = {"bf16 weights (cast outside)": bf16_outside, "fp32 weights into the op": FP32_IN}
    grads = patched_grads(srelu24_ffn, "_op_weight", variants, run, lambda: [t.grad.clone() for t in (x, w1, w2)])
    for name, g0, g1 in zip(("dX", "dW1", "dW2"), *grads.values()):
        print(f"{name}: dtype {g0.dtype} / {g1.dtype}; fp32-in vs bf16-outside "
              f"{((g1.float() - g0.float()).norm() / g0.float().norm()).item():.5f} relative")
    bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    patched_ab(srelu24_ffn, "_op_weight", variants, run, args.rounds, bench, f"FFN fw+bw, T={args.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
