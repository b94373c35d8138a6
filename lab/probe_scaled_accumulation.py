"""What would accumulating srelu24's weight gradients in the scaled domain save?

Today each micro-batch's e4m3 2:4 weight-gradient GEMM (dW1 = S(dZ)^T X, dW2 = (S(A24)^T dY)^T)
writes its product in bf16, still scaled by A's row and B's column scales, and a pass
(fp8_sparse.unscale) divides them out and adds the result into the fp32 .grad: 2 bytes written by
the GEMM, then 2 read + 4 read + 4 written an element (the first micro-batch: 2 + 4). With the
scales held fixed for the optimizer step, the GEMM itself could add into .grad (cuSPARSELt's fp32 D
with beta 1: 4 read + 4 written in its epilogue, the first micro-batch 4 written), and one in-place
pass at the step's end takes the scales out (8 bytes an element, once). Per element and step, at
8 micro-batches: 92 bytes today against 68, if the epilogue's traffic does not hide behind the
GEMM's math; fewer if it does.

This probe times both on one layer's two weight-gradient GEMMs at the 7B and 1B FFN shapes, with
operands from the project's own kernels and the id the project's search picks, back to back for a
few seconds each (interleaved rounds; ms and mJ from NVML's energy counter), and checks the scaled
sum against today's. It does not fix any scales: every micro-batch reuses one pair of operands, so
both paths see the same scales. What the product would also need (fixed amaxes fed to the
conversions, the dense features' rows added scaled, a switch and a loss check) is in lab/LOG.md.

    python lab/probe_scaled_accumulation.py --shapes 7b,1b --seconds 3 --rounds 2 --out scaled.json
"""
import argparse
import ctypes
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from srelu24_kernels.cusparselt import binding as C  # noqa: E402
from srelu24_kernels.float8 import sparse as fp8_sparse  # noqa: E402
from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4  # noqa: E402
from training.gpu_clocks import energy_during, interleaved_rounds  # noqa: E402
from training.logger import environment  # noqa: E402

_CUDA_R_32F = 0
# name: (F, d, tokens a micro-batch, micro-batches a step, layers of the bench's step)
SHAPES = {"7b": (16512, 4096, 8192, 8, 8), "1b": (8448, 2048, 16384, 4, 20)}


class Fp32Plan:
    """One e4m3 2:4 GEMM as binding._Plan builds it, but with D (= C) in fp32 and beta given per
    call: D = A B + beta D, accumulated by the GEMM's epilogue."""

    def __init__(self, lib, m: int, k: int, n: int, alg: int, transpose_result: bool):
        h = lib.handle.ptr
        self.lib, self.m, self.n, self.transpose_result = lib, m, n, transpose_result
        self.a, self.b, self.d = C._Opaque(), C._Opaque(), C._Opaque()
        self.mm, self.sel, self.plan = C._Opaque(), C._Opaque(), C._Opaque()
        lib.check("cusparseLtStructuredDescriptorInit", h, self.a.ptr, m, k, k, 16, C._CUDA_R_8F_E4M3, C._ORDER_ROW,
                  C._SPARSITY_50)
        lib.check("cusparseLtDenseDescriptorInit", h, self.b.ptr, n, k, k, 16, C._CUDA_R_8F_E4M3, C._ORDER_ROW)
        lib.check("cusparseLtDenseDescriptorInit", h, self.d.ptr, m, n, m if transpose_result else n, 16, _CUDA_R_32F,
                  C._ORDER_COL if transpose_result else C._ORDER_ROW)
        lib.check("cusparseLtMatmulDescriptorInit", h, self.mm.ptr, C._OP_N, C._OP_T, self.a.ptr, self.b.ptr,
                  self.d.ptr, self.d.ptr, C._COMPUTE_32F)
        lib.check("cusparseLtMatmulAlgSelectionInit", h, self.sel.ptr, self.mm.ptr, C._ALG_DEFAULT)
        alg_id = ctypes.c_int(alg)
        lib.check("cusparseLtMatmulAlgSetAttribute", h, self.sel.ptr, C._ALG_CONFIG_ID, ctypes.byref(alg_id),
                  ctypes.sizeof(alg_id))
        lib.check("cusparseLtMatmulPlanInit", h, self.plan.ptr, self.mm.ptr, self.sel.ptr)
        ws = ctypes.c_size_t(0)
        lib.check("cusparseLtMatmulGetWorkspace", h, self.plan.ptr, ctypes.byref(ws))
        self.workspace = torch.empty(max(ws.value, 1), dtype=torch.uint8, device="cuda")
        self.alpha, self.betas = ctypes.c_float(1.0), {0.0: ctypes.c_float(0.0), 1.0: ctypes.c_float(1.0)}

    def run(self, a: Tensor, b: Tensor, d: Tensor, beta: float) -> Tensor:
        stream = (ctypes.c_void_p * 1)(torch.cuda.current_stream().cuda_stream)
        self.lib.check("cusparseLtMatmul", self.lib.handle.ptr, self.plan.ptr, ctypes.byref(self.alpha),
                       a.data_ptr(), b.data_ptr(), ctypes.byref(self.betas[beta]), d.data_ptr(), d.data_ptr(),
                       self.workspace.data_ptr(), stream, 1)
        return d


def operands(m: int, k: int, n: int, seed: int):
    """(a8 [m, 5k/8] compressed e4m3, its row scales [m], b8 [k, n] K-major e4m3, its column scales
    [n]): a random srelu'd Z through srelu_sparsify_2to4 and compressed_to_e4m3, B through kmajor_e4m3."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf, _ = srelu_sparsify_2to4(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
    a8, sa = fp8_sparse.compressed_to_e4m3(buf, m, k)
    b8, sb = fp8_sparse.kmajor_e4m3(torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g))
    return a8, sa, b8, sb


class Gemm:
    """One weight gradient of one layer: its operands, today's path and the scaled one."""

    def __init__(self, name: str, m: int, k: int, n: int, transpose_result: bool, seed: int):
        self.name, self.tr = name, transpose_result
        self.a8, sa, self.b8, sb = operands(m, k, n, seed)
        # the product's rows and columns: transposed, (A B)^T is [n, m] and B's columns are its rows
        self.rows, self.cols = (sb, sa) if transpose_result else (sa, sb)
        self.alg = C.searched_alg(self.a8, self.b8, transpose_result)
        self.plan = Fp32Plan(C._library(self.a8.device), m, k, n, self.alg, transpose_result)
        self.shape = (n, m) if transpose_result else (m, n)
        self.grad = torch.empty(self.shape, dtype=torch.float32, device="cuda")

    def today(self, micro_batches: int) -> Tensor:
        g = None
        for _ in range(micro_batches):
            y = C.cached_mm(self.a8, self.b8, self.alg, self.tr)
            g = fp8_sparse.unscale(y, row_scale=self.rows, col_scale=self.cols, out_dtype=torch.float32,
                                   accumulate_into=g)
        return g

    def scaled(self, micro_batches: int) -> Tensor:
        for i in range(micro_batches):
            self.plan.run(self.a8, self.b8, self.grad, 0.0 if i == 0 else 1.0)
        return fp8_sparse.unscale(self.grad, row_scale=self.rows, col_scale=self.cols, out_dtype=torch.float32)

    def gemms(self, micro_batches: int, fp32: bool) -> None:
        for i in range(micro_batches):
            if fp32:
                self.plan.run(self.a8, self.b8, self.grad, 0.0 if i == 0 else 1.0)
            else:
                C.cached_mm(self.a8, self.b8, self.alg, self.tr)


def check(g: Gemm, micro_batches: int) -> dict:
    """The scaled path's sum against today's (whose products are rounded to bf16 before they are
    added: a difference of about bf16's rounding is expected), and its first product against torch's
    fp32-output GEMM where torch offers one."""
    want, got = g.today(micro_batches), g.scaled(micro_batches).clone()
    out = {"rel_diff_vs_today": ((got - want).norm() / want.norm()).item()}
    first = g.plan.run(g.a8, g.b8, torch.empty_like(g.grad), 0.0)
    try:
        ref = torch._cslt_sparse_mm(g.a8, g.b8, out_dtype=torch.float32, transpose_result=g.tr,
                                    **({"alg_id": g.alg} if g.alg else {}))
        out["fp32_equal_torch"] = bool(torch.equal(first, ref))
    except (RuntimeError, TypeError) as e:
        out["fp32_equal_torch"] = f"torch has no fp32 output here: {str(e).splitlines()[0][:120]}"
    bf16 = C.cached_mm(g.a8, g.b8, g.alg, g.tr).float()
    out["fp32_vs_bf16_product_rel"] = ((first - bf16).norm() / first.norm()).item()
    return out


def probe(shape: str, seconds: float, rounds: int) -> dict:
    F_, d, T, n, layers = SHAPES[shape]
    gemms = [Gemm("dW2", F_, T, d, True, 1), Gemm("dW1", F_, T, d, False, 2)]
    checks = {g.name: check(g, n) for g in gemms}
    runs = {
        "today": lambda: [g.today(n) for g in gemms],
        "scaled": lambda: [g.scaled(n) for g in gemms],
        "gemms_bf16": lambda: [g.gemms(n, False) for g in gemms],
        "gemms_fp32_beta1": lambda: [g.gemms(n, True) for g in gemms],
    }
    timed = interleaved_rounds(runs, rounds, lambda fn: energy_during(fn, seconds))
    table = {}
    for v, rs in timed.items():
        ms = sorted(r["ms_per_call"] for r in rs)[len(rs) // 2]
        mj = sorted(r.get("mj_per_call", float("nan")) for r in rs)[len(rs) // 2]
        table[v] = {"ms_layer": ms, "mj_layer": mj, "ms_step": ms * layers, "j_step": mj * layers / 1e3,
                    "sm_clock_mhz": rs[0].get("sm_clock_mhz"), "power_w": rs[0].get("power_w"), "rounds": rs}
    return {"shape": shape, "F": F_, "d": d, "tokens": T, "micro_batches": n, "layers": layers,
            "algs": {g.name: g.alg for g in gemms}, "checks": checks, "variants": table}


def id_sweep(shape: str, reps: int = 5) -> dict:
    """Every algorithm id of the fp32-D GEMM with beta 1 (the ids searched above are the bf16-D
    GEMM's), timed by CUDA events over `reps` calls after one, against the bf16-D GEMM at its searched id."""
    F_, d, T, _, _ = SHAPES[shape]
    out = {}
    for g in (Gemm("dW2", F_, T, d, True, 1), Gemm("dW1", F_, T, d, False, 2)):
        lib = C._library(g.a8.device)
        times = {"bf16_searched": C._time_ms(g.a8, g.b8, g.alg, g.tr)}
        for alg in range(C._MAX_IDS):
            try:
                plan = Fp32Plan(lib, g.a8.shape[0], g.b8.shape[0], g.b8.shape[1], alg, g.tr)
            except RuntimeError:
                break  # ids are consecutive: the first refused one ends them
            plan.run(g.a8, g.b8, g.grad, 1.0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                plan.run(g.a8, g.b8, g.grad, 1.0)
            end.record()
            end.synchronize()
            times[alg] = start.elapsed_time(end) / reps
        best = min((a for a in times if a != "bf16_searched"), key=times.get)
        print(f"{shape} {g.name}: bf16 D at id {g.alg} {times['bf16_searched']:.3f} ms; fp32 D beta 1: best id {best} "
              f"{times[best]:.3f} ms, searched id {g.alg} {times.get(g.alg, float('nan')):.3f} ms; "
              + ", ".join(f"{a}: {t:.3f}" for a, t in times.items() if a != "bf16_searched"), flush=True)
        out[g.name] = {"searched_alg": g.alg, "ms": {str(a): t for a, t in times.items()}}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="7b,1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--seconds", type=float, default=3.0, help="each variant's timed loop")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ids", action="store_true", help="instead: time every id of the fp32-D GEMM (beta 1)")
    p.add_argument("--out", help="a JSON record of everything measured")
    args = p.parse_args()
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        print(f"probe_scaled_accumulation: --shapes takes {', '.join(SHAPES)}, got {', '.join(bad)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or not fp8_sparse.available("cuda"):
        print("probe_scaled_accumulation needs an sm90 GPU with cuSPARSELt >= 0.6", file=sys.stderr)
        return 2
    results = []
    if args.ids:
        results = [{"shape": s, "ids": id_sweep(s)} for s in args.shapes.split(",")]
        if args.out:
            Path(args.out).write_text(json.dumps({"argv": sys.argv, "environment": environment(), "results": results},
                                                 indent=1))
        return 0
    for s in args.shapes.split(","):
        r = probe(s, args.seconds, args.rounds)
        results.append(r)
        v = r["variants"]
        print(f"\n{s}: F {r['F']}, d {r['d']}, {r['tokens']} tokens x {r['micro_batches']} micro-batches, "
              f"{r['layers']} layers; ids {r['algs']}; checks {r['checks']}")
        print(f"{'variant':<18} {'ms/layer':>9} {'mJ/layer':>9} {'ms/step':>8} {'J/step':>7} {'MHz':>6} {'W':>6}")
        for name, t in v.items():
            print(f"{name:<18} {t['ms_layer']:9.3f} {t['mj_layer']:9.1f} {t['ms_step']:8.2f} {t['j_step']:7.2f} "
                  f"{t['sm_clock_mhz'] or 0:6.0f} {t['power_w'] or 0:6.0f}")
        print(f"scaled - today: {v['scaled']['ms_step'] - v['today']['ms_step']:+.2f} ms, "
              f"{v['scaled']['j_step'] - v['today']['j_step']:+.2f} J a step")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv, "environment": environment(), "results": results},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
