"""A/B in one process: srelu24's e4m3 FFN under rowwise, fp32 weights under bf16 autocast (the
one-GPU model), with the column amaxes of X, W1 and dY taken by their rowwise casts (the forward's,
and dY's in the backward) against the backward's own amax passes over X, W1 and dY; and W2's
column scales for dA = dY W2 from fp8_cast.columns_to_e4m3 against the PyTorch path before it
(an amax reduction, the fp32 amax's scale in PyTorch launches, the cast). 7B FFN shapes.

    python lab/probe_column_amax_ab.py [--tokens 8192] [--rounds 6]

Prints whether the gradients agree bit for bit, each amax-bearing cast alone (µs), and fw+bw in
interleaved rounds (ms, do_bench medians; the order reversed every other round).
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import fp8_gemm, srelu24_ffn  # noqa: E402
from lab.patched_ab import patched_ab, patched_grads  # noqa: E402
from scripts.bench_ffn import MODEL_RECIPE  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs  # noqa: E402

NEW_AMAXES, NEW_TO_FLOAT8 = srelu24_ffn._column_amaxes, fp8_gemm.to_float8


def own_amaxes(x, float8, sparse_float8):
    """Before: no amaxes from the forward; the backward's conversions compute them."""
    return x.new_empty(0, x.shape[1], dtype=torch.int32)


def old_to_float8(t, dtype, dim, pow2, column_major=False, cross_amax=None):
    """Before: to_float8 without the column path (W2 for dA through PyTorch's reduction and scale)."""
    assert cross_amax is None
    if t.is_cuda and pow2 and dtype == fp8_gemm.E4M3 and dim is not None:
        rows = t.t() if dim == 0 else t
        if (dim == 1) != column_major and rows.stride(1) == 1:
            fused = fp8_gemm.rowwise_e4m3(rows)
            if fused is not None:
                q, scale, inv = fused
                return (q.t(), scale.t(), inv.t()) if dim == 0 else fused
    amax = torch.linalg.vector_norm(t, float("inf"), dim=dim, keepdim=True)
    scale, inv = fp8_gemm.amax_to_scale(amax, torch.finfo(dtype).max, pow2)
    return fp8_gemm._cast(t, scale, dtype, column_major), scale, inv


class Arm:
    """The variant in force: both patches set together before each run."""
    current = "new"


def apply(arm: str) -> None:
    srelu24_ffn._column_amaxes = NEW_AMAXES if arm == "new" else own_amaxes
    fp8_gemm.to_float8 = NEW_TO_FLOAT8 if arm == "new" else old_to_float8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    D, Fh = SHAPES["7B-config"][:2]
    x, gy, w1, w2 = ffn_inputs(D, Fh, args.tokens)
    w1, w2 = (w.float().requires_grad_() for w in (w1, w2))  # fp32 parameters
    x.requires_grad_()

    def run():
        apply(Arm.current)
        for t in (x, w1, w2):
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = srelu24_ffn.srelu24_ffn_kernels(x, w1, w2, MODEL_RECIPE, float8="rowwise", sparse_float8=True)
        y.backward(gy)

    variants = {"own amax passes (before)": "old", "amaxes from the rowwise casts": "new"}
    grads = patched_grads(Arm, "current", variants, run, lambda: [t.grad.clone() for t in (x, w1, w2)])
    for name, g0, g1 in zip(("dX", "dW1", "dW2"), *grads.values()):
        print(f"{name}: bit for bit {torch.equal(g0, g1)}; relative {((g1 - g0).float().norm() / g0.float().norm()).item():.2e}")

    bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    xb, dyb = x.detach().bfloat16(), gy.bfloat16()
    amax = torch.zeros(D, dtype=torch.int32, device="cuda")
    for name, t in (("X [T, d] bf16", xb), ("dY [T, d] bf16", dyb), ("W1 [F, d] fp32", w1.detach())):
        plain = bench(lambda: fp8_gemm.rowwise_e4m3(t))
        fused = bench(lambda: fp8_gemm.rowwise_e4m3(t, amax))
        print(f"rowwise cast of {name}: {1e3 * plain:.1f} µs, with its column amaxes {1e3 * fused:.1f} µs")
    w2d = w2.detach()
    for arm in ("old", "new"):
        apply(arm)
        print(f"W2's column cast for dA ({arm}): {1e3 * bench(lambda: fp8_gemm.to_float8(w2d, fp8_gemm.E4M3, 0, True, True)):.1f} µs")
    patched_ab(Arm, "current", variants, run, args.rounds, bench, f"FFN fw+bw, T={args.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
