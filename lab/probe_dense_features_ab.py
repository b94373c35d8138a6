"""A/B in one process: srelu24's dense-feature weight-gradient GEMMs (the `dense_feature_fraction`
densest features, exact, beside the 2:4 dW1 and dW2) in e4m3, sharing the 2:4 GEMM's e4m3 B
(fp8_sparse.sparse_and_dense_mm), against the bf16 GEMMs they replaced. At the 7B FFN (d 4096,
F 16512), float8 rowwise, e4m3 2:4, as scripts/bench_ffn.py --parts float8 builds it.

    python lab/probe_dense_features_ab.py [--tokens 16384] [--rounds 6]

Prints: the GEMMs alone (µs), the relative difference of the dense rows (e4m3 against bf16), and
the FFN's fw+bw in interleaved rounds (ms, do_bench medians; the order reversed every other round).
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import fp8_sparse, srelu24_ffn  # noqa: E402
from lab.patched_ab import patched_ab, patched_grads  # noqa: E402
from scripts.bench_ffn import MODEL_RECIPE, fwbw  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs  # noqa: E402

BF = torch.bfloat16
E4M3_DENSE = srelu24_ffn._weight_grad_mm


def bf16_dense(a, dense_rows, b, e4m3, out_dtype, transpose_result=False, slots=None):
    """The product before: the 2:4 GEMM as now, the dense features' GEMM in bf16 (their rows come
    back, and the caller writes them, whether or not slots are given)."""
    y = srelu24_ffn._sparse_mm(a, b, e4m3, transpose_result).to(out_dtype)
    return y, None if dense_rows is None else dense_rows @ b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from model.ffn import SReLU24
    from training.config import Float8
    from training.float8 import convert

    D, Fh = SHAPES["7B-config"][:2]
    T, k = args.tokens, int(round(MODEL_RECIPE.dense_feature_fraction * Fh))
    bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731

    rows = torch.randn(k, T, device="cuda", dtype=BF)
    b = torch.randn(T, D, device="cuda", dtype=BF)
    b8, sb = fp8_sparse.kmajor_e4m3(b)
    got, want = fp8_sparse.dense_mm(rows, b8, sb).float(), (rows @ b).float()
    print(f"dense rows [{k}, {T}] @ [{T}, {D}]: bf16 {1e3 * bench(lambda: rows @ b):.1f} us, e4m3 "
          f"{1e3 * bench(lambda: fp8_sparse.dense_mm(rows, b8, sb)):.1f} us (of which the rows' cast "
          f"{1e3 * bench(lambda: fp8_sparse.rows_to_e4m3(rows)):.1f}); e4m3 vs bf16: "
          f"{((got - want).norm() / want.norm()).item():.4f} relative")

    x, gy, w1, w2 = ffn_inputs(D, Fh, T, requires_grad=True)
    m = SReLU24(D, Fh)
    m.w1.weight.data, m.w2.weight.data = w1.detach().clone(), w2.detach().clone()
    m = m.cuda().to(BF)
    m.set_2to4(True)
    m.recipe = MODEL_RECIPE
    convert(torch.nn.ModuleDict({"ffn": m}), Float8("rowwise"), fsdp=False)
    run = fwbw(lambda x, *ws: m(x), x, list(m.parameters()), gy)
    variants = {"bf16 dense features": bf16_dense, "e4m3 dense features": E4M3_DENSE}
    grads = patched_grads(srelu24_ffn, "_weight_grad_mm", variants, run,
                          lambda: [p.grad.float().clone() for p in m.parameters()])
    for (name, p), g0, g1 in zip(m.named_parameters(), *grads.values()):
        print(f"{name} grad, e4m3 vs bf16 dense features: {((g1 - g0).norm() / g0.norm()).item():.5f} relative")
    patched_ab(srelu24_ffn, "_weight_grad_mm", variants, run, args.rounds, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
