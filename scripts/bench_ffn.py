"""The srelu24 FFN against dense on the GPU: correctness of the kernels against their
references, then median times (triton do_bench) of forward and forward+backward (backward as
their difference) for SwiGLU, dense srelu (eager and compiled) and srelu24
(srelu24_kernels/srelu24/op.py), the fused sparsify pass against a copy, where srelu24's time goes (piece by piece at 7B/1B, T=16384 and 1B,
T=4096), and its host time per call against its GPU kernel time (`overhead`).

    python scripts/bench_ffn.py                     # 1B and 7B shapes, T = 4096, 16384, 65536

Writes tables and benchmarks/results/bench_ffn.json.
"""
import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from srelu24_kernels.cusparselt.layout import decompress  # noqa: E402
from srelu24_kernels.cusparselt.binding import searched_alg, sparse_mm  # noqa: E402
from srelu24_kernels.srelu24.op import OpOptions, ffn, ffn_backward, ffn_forward, ffn_output, keeps_a24  # noqa: E402
from srelu24_kernels.srelu24.sparsify_backward import (a24_usable, backward_operands, backward_operands_from_a24,  # noqa: E402
                                         cuda_usable, dense_slots, write_dense_columns, write_dense_rows)
from srelu24_kernels.srelu24.reference import SReLU24Recipe, densest_from_counts, random_token_order, srelu24_ffn  # noqa: E402
from srelu24_kernels.srelu24.sparsify import cuda_usable as sparsify_cuda_usable  # noqa: E402
from srelu24_kernels.cusparselt.layout import ROWS_PER_BAND, padded  # noqa: E402
from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4, srelu_sparsify_2to4_reference  # noqa: E402
from srelu24_kernels.srelu24.reference import mask_2to4  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs, swiglu_weights  # noqa: E402
from training.gpu_clocks import energy_during, interleaved_rounds  # noqa: E402
from training.logger import environment  # noqa: E402

BF = torch.bfloat16


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(M: int, K: int, shift: float) -> dict:
    """Fused kernel == reference bit for bit; our layout decodes _cslt_compress's buffer; the sparse
    product is right."""
    z = torch.randn(M, K, device="cuda", dtype=BF) - shift  # shift: sparser activations, zero groups
    buf, counts = srelu_sparsify_2to4(z)
    ref, ref_counts = srelu_sparsify_2to4_reference(z)
    Mp = padded(M, ROWS_PER_BAND)
    a24 = decompress(ref, Mp, K)
    out = {"shape": [M, K], "shift": shift, "kernel_equals_reference": torch.equal(buf.view(torch.int16), ref.view(torch.int16)),
           "buffer_shape": list(buf.shape),
           "counts_equal": torch.equal(counts, ref_counts)}
    try:
        c2 = torch._cslt_compress(a24)
        out["cslt_shape"] = list(c2.shape)
        # cuSPARSELt may name other positions for groups with fewer than 2 non-zeros, so its bytes
        # can differ from ours; our layout formula must still decode its buffer to A24 exactly
        out["cslt_buffer_decodes_to_a24"] = c2.numel() == buf.numel() and torch.equal(decompress(c2, Mp, K), a24)
        w = torch.randn(1024, K, device="cuda", dtype=BF)
        y = torch._cslt_sparse_mm(buf, w.t())
        out["sparse_mm_rel_err"] = rel_err(y, a24.float() @ w.float().t())
    except Exception as e:  # noqa: BLE001
        out["cslt_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


RECIPE = SReLU24Recipe()  # the paper's: token permutation, 5% dense features, forward mask re-used
# the FFN as the model runs it: the block permutes its tokens (fused into the norm and the residual add)
MODEL_RECIPE = replace(RECIPE, token_permutation=False)


def check_ffn(T: int, D: int, Fh: int) -> dict:
    """Kernel FFN vs the PyTorch reference (same token permutation): output and the 3 gradients."""
    x = torch.randn(T, D, device="cuda", dtype=BF)
    w1, w2 = torch.randn(Fh, D, device="cuda") * D ** -0.5, torch.randn(D, Fh, device="cuda") * Fh ** -0.5
    dy = torch.randn(T, D, device="cuda", dtype=BF)
    outs = []
    for fn in (srelu24_ffn, lambda x, a, b, r: ffn(x, a, b, OpOptions(r))):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        with torch.autocast("cuda", dtype=BF):
            y = fn(xx, a, b, RECIPE)
        torch.manual_seed(5)
        y.backward(dy)
        outs.append((y, xx.grad, a.grad, b.grad))
    return {"shape": [T, D, Fh], **{f"rel_err_{k}": rel_err(g, w) for k, g, w in zip(("y", "dx", "dw1", "dw2"), *outs)}}


def fwbw(fn, x, ws, gy):
    def run():
        for w in ws:
            w.grad = None
        x.grad = None
        fn(x, *ws).backward(gy)
    return run


def time_fwbw(name: str, D: int, Fh: int, T: int, compiled, density=None, clocks: bool = False) -> dict:
    x, gy, w1, w2 = ffn_inputs(D, Fh, T, requires_grad=True, density=density)
    g1, g3, g2 = swiglu_weights(D, Fh, requires_grad=True)

    def dense(x, w1, w2):
        return F.linear(F.relu(F.linear(x, w1)).square(), w2)

    def swiglu(x, a, b, c):
        return F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c)

    def sparse(x, w1, w2):
        return ffn(x, w1, w2, OpOptions(MODEL_RECIPE))

    runs = {"dense_eager": fwbw(dense, x, [w1, w2], gy), "dense_compiled": fwbw(compiled, x, [w1, w2], gy),
            "swiglu": fwbw(swiglu, x, [g1, g3, g2], gy), "srelu24": fwbw(sparse, x, [w1, w2], gy)}
    r = {"shape": name, "T": T, "density": density}
    r.update({f"fwbw_{v}_ms": bench(run) for v, run in runs.items()})
    if clocks:  # each variant for 2 s more, back to back as do_bench runs it
        r["clocks"] = {v: energy_during(run, 2.0) for v, run in runs.items()}
    r["fwbw_speedup_vs_eager"] = r["fwbw_dense_eager_ms"] / r["fwbw_srelu24_ms"]
    r["fwbw_speedup_vs_compiled"] = r["fwbw_dense_compiled_ms"] / r["fwbw_srelu24_ms"]
    return r


def time_fwbw_float8(name: str, D: int, Fh: int, T: int, recipe: str, density=None, repeats: int = 3,
                     clocks: bool = False) -> dict:
    """fw+bw in float8, the FFN modules as the model builds them (model/ffn.py) and as
    training/float8.py converts them: dense srelu with torchao's Float8Linear, compiled, against
    srelu24 with float8 dense GEMMs and its 2:4 GEMMs in bf16 or in e4m3 (ffn.sparse_float8).
    bf16 dense srelu, compiled, as the anchor. repeats: rounds of one do_bench per variant, the
    order reversed every other round, so that the variants share the GPU's drift at the power cap
    (times: the medians of the rounds; ratios: the median of the rounds' own)."""
    from model.ffn import SReLU, SReLU24
    from training.config import Float8
    from training.float8 import convert

    x, gy, w1, w2 = ffn_inputs(D, Fh, T, requires_grad=True, density=density)
    mods = {"dense_bf16": SReLU(D, Fh), "dense_float8": SReLU(D, Fh),
            "srelu24_float8_bf16_sparse": SReLU24(D, Fh, OpOptions(MODEL_RECIPE, recipe, sparse_float8=False)),
            "srelu24_float8_e4m3_sparse": SReLU24(D, Fh, OpOptions(MODEL_RECIPE, recipe))}
    runs = {}
    for v, m in mods.items():
        m.w1.weight.data, m.w2.weight.data = w1.detach().clone(), w2.detach().clone()
        m = m.cuda().to(BF)
        if isinstance(m, SReLU24):
            m.set_2to4(True)
        if v != "dense_bf16":  # under a parent, so that the names are a model's ("ffn.w1")
            convert(torch.nn.ModuleDict({"ffn": m}), Float8(recipe), fsdp=False)
        fn = torch.compile(m) if not isinstance(m, SReLU24) else m
        runs[v] = fwbw(lambda x, *ws, fn=fn: fn(x), x, list(m.parameters()), gy)
    r = {"shape": name, "T": T, "density": density, "recipe": recipe, "repeats": repeats}
    rounds = interleaved_rounds(runs, repeats, bench)
    for v, ms in rounds.items():
        r[f"fwbw_{v}_ms"], r[f"fwbw_{v}_ms_rounds"] = statistics.median(ms), ms
    for v in ("srelu24_float8_bf16_sparse", "srelu24_float8_e4m3_sparse"):
        ratios = [d / t for d, t in zip(rounds["dense_float8"], rounds[v])]
        r[f"{v}_vs_dense_float8"], r[f"{v}_vs_dense_float8_rounds"] = statistics.median(ratios), ratios
    if clocks:  # the two that the target compares, 2 s each back to back: clocks, power, energy per fw+bw
        r["clocks"] = {v: energy_during(runs[v], 2.0) for v in ("dense_float8", "srelu24_float8_e4m3_sparse")}
    for v in ("dense_float8", "srelu24_float8_e4m3_sparse"):  # where each spends its GPU time
        r[f"kernel_ms_{v}"], r[f"top_kernels_{v}"] = kernel_ms(runs[v], top=24)
    return r


def breakdown(D: int, Fh: int, T: int, density=None) -> dict:
    """srelu24's fw+bw, piece by piece (each timed alone)."""
    return {k: bench(fn) for k, fn in srelu24_pieces(D, Fh, T, density).items()}


def dense_srelu_pieces(D: int, Fh: int, T: int, density=None) -> dict:
    """Dense srelu's fw+bw as its GEMMs and elementwise passes: {name: fn} (names as in
    srelu24_pieces: "(dense)" marks a dense GEMM)."""
    x, dy, w1, w2 = ffn_inputs(D, Fh, T, density=density)
    z = F.linear(x, w1)
    a, da = F.relu(z).square(), dy @ w2
    dz = da * 2 * F.relu(z)
    return {"fw: Z = X W1^T (dense)": lambda: F.linear(x, w1),
            "fw: A = relu(Z)^2 (elementwise)": lambda: F.relu(z).square(),
            "fw: Y = A W2^T (dense)": lambda: F.linear(a, w2),
            "bw: dA = dY W2 (dense)": lambda: dy @ w2,
            "bw: dZ = dA 2 relu(Z) (elementwise)": lambda: da * 2 * F.relu(z),
            "bw: dX = dZ W1 (dense)": lambda: dz @ w1,
            "bw: dW2 = dY^T A (dense)": lambda: dy.t() @ a,
            "bw: dW1 = dZ^T X (dense)": lambda: dz.t() @ x}


def srelu24_pieces(D: int, Fh: int, T: int, density=None) -> dict:
    """srelu24's fw+bw as the FFN runs it, piece by piece: {name: fn}."""
    x, dy, w1, w2 = ffn_inputs(D, Fh, T, density=density)
    z = F.linear(x, w1)
    buf, counts = srelu_sparsify_2to4(z)
    da = dy @ w2
    # the tokens come permuted by the model (model/transformer.py, Block): no order to draw here
    perm = None
    dense = densest_from_counts(counts, RECIPE.dense_feature_fraction)
    from_a24 = a24_usable(z.device, Fh)  # the pass as the FFN runs it: over the forward's A24, or Z

    def one_pass():
        return backward_operands_from_a24(buf, da, perm, dense) if from_a24 else backward_operands(z, da, perm, dense)

    dzb, (s_a, a_d), (s_dz, dz_d) = one_pass()
    Tp = s_a.shape[1] * 16 // 9
    dy_p, x_p = F.pad(dy, (0, 0, 0, Tp - T)), F.pad(x, (0, 0, 0, Tp - T))
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    slots, _ = dense_slots(dense, Fh, "cuda")
    a_dense, dz_dense = a_d @ dy_p, dz_d @ x_p

    parts = {
        "fw: Z = X W1^T (dense)": lambda: F.linear(x, w1),
        f"fw: fused srelu+2:4+compress ({'CUDA' if sparsify_cuda_usable(z) else 'Triton'})": lambda: srelu_sparsify_2to4(z),
        "fw: Y = A24 W2^T (sparse)": lambda: sparse_mm(buf, w2.t()),
        "bw: dA = dY W2 (dense)": lambda: dy @ w2,
        "bw: dZ, S(A24)^T, S(dZ)^T in one fused pass (" + (
            "CUDA, reads A24" if from_a24 else "CUDA, reads Z" if cuda_usable(z, da) else "Triton") + ")": one_pass,
        "bw: dX = dZ W1 (sparse)": lambda: sparse_mm(dzb, w1),
        "bw: dW2 (sparse), written as [d, F]": lambda: sparse_mm(s_a, dy_p, transpose_result=True),
        "bw: dW1 (sparse)": lambda: sparse_mm(s_dz, x_p),
        "bw: dense-feature GEMMs": lambda: (a_d @ dy_p, dz_d @ x_p),
        "bw: the dense features' columns of dW2 and rows of dW1": lambda: (
            write_dense_columns(dw2, slots, a_dense), write_dense_rows(dw1, dense, dz_dense)),
        "bw: feature sort (the dense features)": lambda: densest_from_counts(counts, RECIPE.dense_feature_fraction),
    }
    return parts


def backward_kernels(D: int, Fh: int, T: int, density=None) -> dict:
    """The backward's one-pass kernel, Triton against CUDA C++ (when built): equal output bytes,
    and the time of each beside a bf16 copy of Z."""
    torch.manual_seed(T + Fh)
    x, dy, w1, w2 = ffn_inputs(D, Fh, T, density=density)
    z, da = F.linear(x, w1), dy @ w2
    perm = random_token_order(T, "cuda")
    dense = densest_from_counts(srelu_sparsify_2to4(z)[1], RECIPE.dense_feature_fraction)
    out = {"copy_z_ms": bench(lambda: z.clone()), "triton_ms": bench(lambda: backward_operands(z, da, perm, dense,
                                                                                                backend="triton"))}
    if cuda_usable(z, da):
        flat = lambda r: [r[0].view(torch.int16)] + [t.view(torch.int16) for p in r[1:] for t in p]  # noqa: E731
        got, want = flat(backward_operands(z, da, perm, dense, backend="cuda")), flat(
            backward_operands(z, da, perm, dense, backend="triton"))
        out["cuda_equals_triton"] = all(torch.equal(a, b) for a, b in zip(got, want))
        out["cuda_ms"] = bench(lambda: backward_operands(z, da, perm, dense, backend="cuda"))
        a24 = srelu_sparsify_2to4(z)[0]  # the FFN's path: the same pass over the forward's compressed A24
        out["cuda_a24_equals_triton"] = all(torch.equal(a, b) for a, b in zip(
            flat(backward_operands_from_a24(a24, da, perm, dense)), want))
        out["cuda_a24_ms"] = bench(lambda: backward_operands_from_a24(a24, da, perm, dense))
        out["cuda_speedup"] = out["triton_ms"] / out["cuda_ms"]
    return out


def host_ms(fn, n: int = 50) -> float:
    """Host time per call (enqueueing only): at the small shapes this is used for, the GPU keeps
    up, so the wall time of n unsynchronised calls is the Python + launch + library set-up cost."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def kernel_ms(fn, n: int = 5, top: int = 8) -> tuple[float, list]:
    """GPU kernel time per call (sum over kernels, torch.profiler) and the `top` costliest kernels
    (name, ms and launches per call): against the do_bench time of the same call, the gap is the
    GPU idling between kernels or on the host."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, getattr(e, "self_device_time_total", 0) / 1e3 / n, e.count / n) for e in prof.key_averages()
            if getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda r: -r[1])
    return sum(t for _, t, _ in rows), [(k[:70], round(t, 4), c) for k, t, c in rows[:top]]


def host_and_gpu(D: int, Fh: int, T: int, density=None) -> dict:
    """Where the small shapes lose: per fw+bw call, host time at T=128 (GPU work negligible) for
    dense eager and srelu24, and srelu24's kernel time vs its do_bench time at T."""
    out = {}
    for t, what in ((128, "host"), (T, "gpu")):
        x, gy, w1, w2 = ffn_inputs(D, Fh, t, requires_grad=True, density=density)
        sparse = fwbw(lambda x, a, b: ffn(x, a, b, OpOptions(MODEL_RECIPE)), x, [w1, w2], gy)
        if what == "host":
            dense = fwbw(lambda x, a, b: F.linear(F.relu(F.linear(x, a)).square(), b), x, [w1, w2], gy)
            buf, _ = srelu_sparsify_2to4(F.linear(x, w1).detach())
            xd, w1d, w2d = x.detach(), w1.detach(), w2.detach()
            o = OpOptions(RECIPE)
            keep = keeps_a24(xd, w1d, o.recipe.reuse_forward_mask)
            fwd_args = (xd, w1d, w2d, [], None, None, [], False, keep, *o.flags(), False, 0)
            a24, h, z_kept, counts, *_ = ffn_forward(*fwd_args)
            out_args = (a24, h, w2d, [], o.float8, o.sparse_float8, False)
            bwd_args = (gy, xd, w1d, w2d, a24 if keep else z_kept, counts, keep, [], None, None, [], None, None, None,
                        *o.flags(), False, 0)
            z = F.linear(xd, w1d)
            perm = torch.randperm(t, device="cuda")
            da = gy @ w2d
            out.update({"host_ms_fwbw_dense_eager_T128": host_ms(dense), "host_ms_fwbw_srelu24_T128": host_ms(sparse),
                        "host_ms_one_sparse_mm": host_ms(lambda: sparse_mm(buf, w2.t())),
                        "host_ms_one_torch_cslt_sparse_mm": host_ms(lambda: torch._cslt_sparse_mm(buf, w2d.t())),
                        "host_ms_one_dense_mm": host_ms(lambda: F.linear(xd, w1d)),
                        "host_ms_op_fwd": host_ms(lambda: (ffn_forward(*fwd_args), ffn_output(*out_args))),
                        "host_ms_op_bwd": host_ms(lambda: ffn_backward(*bwd_args)),
                        "host_ms_sparsify_launch": host_ms(lambda: srelu_sparsify_2to4(z)),
                        "host_ms_backward_operands_launch": host_ms(lambda: backward_operands(z, da, perm, None)),
                        "host_ms_randperm_sort": host_ms(lambda: (torch.randperm(t, device="cuda"),
                                                                  torch.sort(-counts, stable=True)))})
            impl = getattr(ffn_backward, "_init_fn", None)  # the Python function under the op
            if impl is not None:
                out["host_ms_bwd_without_op_dispatch"] = host_ms(lambda: impl(*bwd_args))
        else:
            k, top = kernel_ms(sparse)
            out.update({"T": T, "srelu24_fwbw_do_bench_ms": bench(sparse), "srelu24_fwbw_kernel_ms": k,
                        "srelu24_top_kernels": top})
    return out


def tune_sparsify(z) -> dict:
    """The fastest launch configuration of the fused Triton kernel for this shape (all are exact)."""
    configs = [{"bands": b, "num_warps": w} for b in (1, 4, 16) for w in (2, 4, 8)]
    times = [(bench(lambda c=c: srelu_sparsify_2to4(z, **c, backend="triton")), c) for c in configs]
    return min(times, key=lambda t: t[0])[1]


def time_shape(name: str, D: int, Fh: int, T: int, compiled, density=None) -> dict:
    x, _, w1, w2 = ffn_inputs(D, Fh, T, density=density)
    g1, g3, g2 = swiglu_weights(D, Fh)
    z = F.linear(x, w1)
    best = tune_sparsify(z)
    buf = srelu_sparsify_2to4(z)[0]

    def sparse_fw():  # the product's path (custom op, default launch configuration), no autograd
        with torch.no_grad():
            return ffn(x, w1, w2, OpOptions(RECIPE))

    def dense_fw():
        return F.linear(F.relu(F.linear(x, w1)).square(), w2)

    def swiglu_fw():
        return F.linear(F.silu(F.linear(x, g1)) * F.linear(x, g3), g2)

    y_s, y_d = sparse_fw(), F.linear(F.relu(z).square() * mask_2to4(F.relu(z).square()), w2)
    alg = searched_alg(buf, w2.t())  # the id the op's Y = A24 W2^T ran with (its search, cached by then)
    r = {"shape": name, "T": T, "D": D, "F": Fh, "density": density, "alg_id": alg, "fw_rel_err_vs_masked_dense": rel_err(y_s, y_d),
         "sparsify_triton_config": best,
         "sparsify_backend": "cuda" if sparsify_cuda_usable(z) else "triton",
         "copy_ms": bench(lambda: z.clone()), "sparsify_ms": bench(lambda: srelu_sparsify_2to4(z)),
         "sparsify_triton_ms": bench(lambda: srelu_sparsify_2to4(z, **best, backend="triton")),
         "sparsify_triton_no_counts_ms": bench(lambda: srelu_sparsify_2to4(z, **{**best, "counts": False}, backend="triton")),
         "gemm1_ms": bench(lambda: F.linear(x, w1)),
         "sparse_gemm2_ms": bench(lambda: sparse_mm(buf, w2.t())),  # as the FFN runs it (cached plan)
         "dense_gemm2_ms": bench(lambda: F.linear(F.relu(z).square(), w2)),
         "fw_dense_eager_ms": bench(dense_fw), "fw_dense_compiled_ms": bench(lambda: compiled(x, w1, w2)),
         "fw_swiglu_ms": bench(swiglu_fw), "fw_srelu24_ms": bench(sparse_fw)}
    r["sparsify_vs_copy"] = r["sparsify_ms"] / r["copy_ms"]
    r["fw_speedup_vs_eager"] = r["fw_dense_eager_ms"] / r["fw_srelu24_ms"]
    r["fw_speedup_vs_compiled"] = r["fw_dense_compiled_ms"] / r["fw_srelu24_ms"]
    return r


VARIANTS = ("dense_eager", "dense_compiled", "swiglu", "srelu24")


def derived_backward(forward: list, fwbw: list) -> list:
    """Backward alone, per variant: the fw+bw median minus the forward median of the same run
    (a difference of medians: backward is not timed on its own, because a compiled graph's
    backward cannot be replayed without its forward)."""
    fw = {(r["shape"], r["T"]): r for r in forward}
    out = []
    for r in fwbw:
        f = fw.get((r["shape"], r["T"]))
        if f:
            b = {"shape": r["shape"], "T": r["T"]}
            b.update({f"bw_{v}_ms": r[f"fwbw_{v}_ms"] - f[f"fw_{v}_ms"] for v in VARIANTS})
            b["bw_speedup_vs_eager"] = b["bw_dense_eager_ms"] / b["bw_srelu24_ms"]
            b["bw_speedup_vs_compiled"] = b["bw_dense_compiled_ms"] / b["bw_srelu24_ms"]
            out.append(b)
    return out


def plot_breakdown(result: Path) -> Path:
    """The saved result's breakdown as a stacked bar chart (training/plots.ffn_breakdown), PNG
    beside the JSON."""
    from training.plots import close, ffn_breakdown

    d = json.loads(result.read_text())
    if not d.get("breakdown"):
        raise SystemExit(f"error: {result} has no breakdown (run with --parts ...,breakdown)")
    fwbw = {f"{r['shape']}, T={r['T']}": r for r in d.get("fwbw", [])}
    fig = ffn_breakdown(d["breakdown"], fwbw)
    png = result.with_suffix(".png")
    fig.savefig(png, dpi=120)
    close(fig)
    return png


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--shapes", default="1B,7B")
    ap.add_argument("--parts", default="checks,forward,fwbw,breakdown,overhead")
    ap.add_argument("--density", type=float, default=None,
                    help="fraction of pre-activations above zero (default: about 0.5, random init); 0.1 is "
                         "as sparse as a trained model's srelu (scripts/ffn_inputs.py)")
    ap.add_argument("--float8", default="rowwise", choices=["tensorwise", "rowwise"],
                    help="the recipe of the float8 part (--parts ...,float8)")
    ap.add_argument("--clocks", action="store_true",
                    help="also sample the SM clock and power (nvidia-smi) while each fw+bw variant runs")
    ap.add_argument("--repeats", type=int, default=3,
                    help="float8 part: interleaved rounds of the variants (median of the rounds; default 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_ffn.json")
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="only redraw the breakdown figure of a saved result (no GPU needed), next to it")
    args = ap.parse_args(argv)
    if args.density is not None and not 0.0 < args.density < 1.0:
        ap.error(f"--density is the fraction of positive pre-activations, in (0, 1); got {args.density}")
    if args.repeats < 1:
        ap.error(f"--repeats is the number of rounds of the float8 part, >= 1; got {args.repeats}")
    if bad := [n for n in args.shapes.split(",") if n not in SHAPES]:
        ap.error(f"--shapes: unknown shape(s) {bad}; valid: {list(SHAPES)}")
    return args


def measure(args) -> dict:
    """Every part asked for, as the JSON record holds them (printed as they come)."""
    torch.manual_seed(0)
    parts_wanted = set(args.parts.split(","))
    checks = []
    if "checks" in parts_wanted:
        checks = [check(M, K, s) for M, K, s in [(96, 192, 0.0), (2048, 8192, 1.0), (16384, 16384, 0.5), (4000, 16512, 1.5)]]
    checks += [check_ffn(4000, 1024, 4096), check_ffn(16384, 2048, 8192)]
    for c in checks:
        print(json.dumps(c), flush=True)
    compiled = torch.compile(lambda x, w1, w2: F.linear(F.relu(F.linear(x, w1)).square(), w2))
    rows = []
    for name in args.shapes.split(",") if "forward" in parts_wanted else []:
        for T in map(int, args.tokens.split(",")):
            rows.append(time_shape(name, *SHAPES[name], T, compiled, args.density))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    compiled_fwbw = torch.compile(lambda x, w1, w2: F.linear(F.relu(F.linear(x, w1)).square(), w2))
    fb = []
    for name in args.shapes.split(",") if "fwbw" in parts_wanted else []:
        for T in map(int, args.tokens.split(",")):
            fb.append(time_fwbw(name, *SHAPES[name], T, compiled_fwbw, args.density, args.clocks))
            print(json.dumps(fb[-1]), flush=True)
            torch.cuda.empty_cache()
    f8 = []
    for name in args.shapes.split(",") if "float8" in parts_wanted else []:
        for T in map(int, args.tokens.split(",")):
            f8.append(time_fwbw_float8(name, *SHAPES[name], T, args.float8, args.density, args.repeats, args.clocks))
            print(json.dumps(f8[-1]), flush=True)
            torch.cuda.empty_cache()
    shapes_bd = {"7B, T=16384": (4096, 16384, 16384), "1B, T=16384": (2048, 8192, 16384), "1B, T=4096": (2048, 8192, 4096)}
    bd = {k: breakdown(*v, args.density) for k, v in shapes_bd.items()} if "breakdown" in parts_wanted else {}
    bk = {k: backward_kernels(*v, args.density) for k, v in shapes_bd.items()} if "breakdown" in parts_wanted else {}
    overhead = {k: host_and_gpu(*v, args.density) for k, v in shapes_bd.items()} if "overhead" in parts_wanted else {}
    return {"date": datetime.now(timezone.utc).isoformat(), "argv": sys.argv, "environment": environment(),
            "density": args.density, "checks": checks, "forward": rows, "fwbw": fb, "float8": f8,
            "backward_derived": derived_backward(rows, fb), "breakdown": bd, "backward_kernels": bk, "overhead": overhead}


def print_timings(result: dict, density) -> None:
    """The forward and fw+bw tables."""
    rows, fb = result["forward"], result["fwbw"]
    print(f"\n{torch.cuda.get_device_name()}: forward")
    print("| shape | T | copy | fused sparsify (x copy) | Triton's | dense fw eager | dense fw compiled | swiglu fw | srelu24 fw "
          "| vs eager | vs compiled |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['T']} | {r['copy_ms']:.3f} | {r['sparsify_ms']:.3f} ({r['sparsify_vs_copy']:.2f}x, "
              f"{r['sparsify_backend']}) | {r['sparsify_triton_ms']:.3f} "
              f"| {r['fw_dense_eager_ms']:.3f} | {r['fw_dense_compiled_ms']:.3f} | {r['fw_swiglu_ms']:.3f} "
              f"| {r['fw_srelu24_ms']:.3f} | {r['fw_speedup_vs_eager']:.2f}x | {r['fw_speedup_vs_compiled']:.2f}x |")
    print(f"\nforward + backward (ms){'' if density is None else f', pre-activation density {density}'}")
    print("| shape | T | dense eager | dense compiled | swiglu | srelu24 | vs eager | vs compiled |")
    print("|---|---|---|---|---|---|---|---|")
    for r in fb:
        print(f"| {r['shape']} | {r['T']} | {r['fwbw_dense_eager_ms']:.3f} | {r['fwbw_dense_compiled_ms']:.3f} "
              f"| {r['fwbw_swiglu_ms']:.3f} | {r['fwbw_srelu24_ms']:.3f} | {r['fwbw_speedup_vs_eager']:.2f}x "
              f"| {r['fwbw_speedup_vs_compiled']:.2f}x |")


def print_float8(f8: list, recipe: str) -> None:
    if not f8:
        return
        print(f"\nforward + backward in float8 ({recipe}; ms): dense srelu with torchao, srelu24 with its 2:4 GEMMs in "
              "bf16 or e4m3")
        print("| shape | T | dense bf16 | dense float8 | srelu24, bf16 2:4 | srelu24, e4m3 2:4 | e4m3 2:4 vs dense float8 |")
        print("|---|---|---|---|---|---|---|")
        for r in f8:
            print(f"| {r['shape']} | {r['T']} | {r['fwbw_dense_bf16_ms']:.3f} | {r['fwbw_dense_float8_ms']:.3f} "
                  f"| {r['fwbw_srelu24_float8_bf16_sparse_ms']:.3f} | {r['fwbw_srelu24_float8_e4m3_sparse_ms']:.3f} "
                  f"| {r['srelu24_float8_e4m3_sparse_vs_dense_float8']:.2f}x |")
        for r in f8:
            ratios = r["srelu24_float8_e4m3_sparse_vs_dense_float8_rounds"]
            print(f"\n{r['shape']}, T={r['T']}: e4m3 2:4 vs dense float8 in each of {r['repeats']} interleaved rounds: "
                  + ", ".join(f"{x:.3f}x" for x in ratios))
            for v, c in r.get("clocks", {}).items():
                print(f"  {v}: {c.get('sm_clock_mhz', '-')} MHz, {c.get('power_w', '-')} W, "
                      f"{c.get('ms_per_call', float('nan')):.3f} ms and {c.get('mj_per_call', float('nan')):.0f} mJ per fw+bw "
                      f"{' '.join(c.get('throttle_reasons', [])) or c.get('error', '')}")
        for r in f8:
            for v in ("dense_float8", "srelu24_float8_e4m3_sparse"):
                print(f"\n{v} ({r['shape']}, T={r['T']}): kernels {r[f'kernel_ms_{v}']:.3f} ms per fw+bw; the costliest "
                      "(ms, launches per fw+bw):")
                for k, t, c in r[f"top_kernels_{v}"]:
                    print(f"  {t:8.3f}  {c:4.1f}  {k}")


def print_details(result: dict) -> None:
    """Clocks, the derived backward, the piece-by-piece breakdown, the backward kernel, host time."""
    fb, bd, bk, overhead = result["fwbw"], result["breakdown"], result["backward_kernels"], result["overhead"]
    for r in fb:
        if r.get("clocks"):
            print(f"\nclocks while each fw+bw runs back to back ({r['shape']}, T={r['T']}; nvidia-smi medians)")
            print("| variant | SM MHz | power W | throttle reasons |")
            print("|---|---|---|---|")
            for v, c in r["clocks"].items():
                print(f"| {v} | {c.get('sm_clock_mhz', '-')} | {c.get('power_w', '-')} | "
                      f"{' '.join(c.get('throttle_reasons', [])) or c.get('error', '')} |")
    bw = result["backward_derived"]
    if bw:
        print("\nbackward (ms): fw+bw median minus forward median, same run")
        print("| shape | T | dense eager | dense compiled | swiglu | srelu24 | vs eager | vs compiled |")
        print("|---|---|---|---|---|---|---|---|")
        for r in bw:
            print(f"| {r['shape']} | {r['T']} | " + " | ".join(f"{r[f'bw_{v}_ms']:.3f}" for v in VARIANTS)
                  + f" | {r['bw_speedup_vs_eager']:.2f}x | {r['bw_speedup_vs_compiled']:.2f}x |")
    for name, parts in bd.items():
        print(f"\nsrelu24 at {name}, piece by piece (ms)")
        for k, v in parts.items():
            print(f"| {k} | {v:.3f} |")
        print(f"| sum of the pieces above | {sum(parts.values()):.3f} |")
    if bk:
        print("\nthe backward's one-pass kernel (ms): Triton against CUDA C++ (make kernels)")
        print("| shape | copy of Z | Triton | CUDA over Z | CUDA over A24 (the FFN's) | CUDA speed-up | CUDA == Triton "
              "| over A24 == Triton |")
        print("|---|---|---|---|---|---|---|---|")
        for name, o in bk.items():
            print(f"| {name} | {o['copy_z_ms']:.3f} | {o['triton_ms']:.3f} | {o.get('cuda_ms', float('nan')):.3f} "
                  f"| {o.get('cuda_a24_ms', float('nan')):.3f} | {o.get('cuda_speedup', float('nan')):.2f}x "
                  f"| {o.get('cuda_equals_triton', 'not built')} | {o.get('cuda_a24_equals_triton', 'not built')} |")
    for name, o in overhead.items():
        print(f"\nhost and GPU at {name}: " + json.dumps(o))


def main() -> int:
    args = parse_args()
    if args.replot:
        print(f"wrote {plot_breakdown(args.replot)}")
        return 0
    if not torch.cuda.is_available():
        print("error: bench_ffn.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    if result["breakdown"]:
        print(f"wrote {plot_breakdown(args.out)}")
    print_timings(result, args.density)
    print_float8(result["float8"], args.float8)
    print_details(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

