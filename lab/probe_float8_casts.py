"""Which inductor settings make torchao's float8 casts cheaper? One Float8Linear at each swiglu 7B
linear shape (d -> d: wq wk wv wo; d -> h: w1 w3; h -> d: w2), compiled, forward plus backward
(output, grad input and grad weight), under several inductor settings. Each setting runs in its
own process with its own inductor cache, so that no tuned kernel leaks from one setting into
another. Per setting: ms per layer (the shapes weighted by their count in a block), of which cuBLAS
GEMMs and Triton kernels (the casts, amaxes and layout copies), from torch.profiler, and the
compile seconds. The outputs are hashed: a setting that only tunes block sizes must give the
default's bits.

    python lab/probe_float8_casts.py [--tokens 8192] [--settings default,coordesc,...]

In a block, wq wk and wv share their input, so the probe counts that input's casts three times
where the compiled block may cast it once: compare settings with it, not with a step.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (environment, inductor config set in the process)
SETTINGS = {
    "default": ({}, {}),
    "nd": ({}, {"triton.prefer_nd_tiling": True}),
    "coordesc": ({"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}, {}),
    "coordesc+pointwise": ({"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"}, {}),
    "coordesc+pointwise+nd": ({"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
                              {"triton.prefer_nd_tiling": True}),
    "coordesc+pointwise+nd+tiled-reductions": (
        {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1", "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"},
        {"triton.prefer_nd_tiling": True, "triton.tile_reductions": True}),
    "coordesc-all-directions+pointwise": ({"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1",
                                           "TORCHINDUCTOR_COORDINATE_DESCENT_CHECK_ALL_DIRECTIONS": "1",
                                           "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"}, {}),
    "no-emulate-precision-casts": ({}, {"emulate_precision_casts": False}),
}
GEMM_NAMES = ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas")


def shapes(tokens: int, d: int, h: int):
    """(name, tokens, in, out, count per block)"""
    return [("d->d", tokens, d, d, 4), ("d->h", tokens, d, h, 2), ("h->d", tokens, h, d, 1)]


def run_one(setting: str, recipes: list[str], tokens: int, d: int, h: int) -> dict:
    import torch
    import torch._inductor.config as ic
    import torch.nn as nn
    from torch.profiler import ProfilerActivity, profile

    from training.config import Float8
    from training.float8 import convert

    from lab.with_inductor import set_option

    for key, value in SETTINGS[setting][1].items():
        set_option(key, value)
    out = {}
    for recipe in recipes:
        for name, t, k, n, count in shapes(tokens, d, h):
            torch.manual_seed(0)
            holder = nn.Sequential(nn.Linear(k, n, bias=False)).cuda().to(torch.bfloat16)
            convert(holder, Float8(recipe), fsdp=False)
            if recipe == "rowwise" and "emulate_precision_casts" in SETTINGS[setting][1]:
                ic.emulate_precision_casts = SETTINGS[setting][1]["emulate_precision_casts"]
            model = torch.compile(holder)
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            w = holder[0].weight

            def step():
                return torch.autograd.grad(model(x), (x, w), dy)

            t0 = time.perf_counter()
            gx, gw = step()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            y = model(x).detach()
            digest = hashlib.sha256()
            for v in (y, gx, gw):
                digest.update(v.float().cpu().numpy().tobytes())
            for _ in range(5):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            start.record()
            for _ in range(reps):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / reps
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            gemm = triton = other = 0.0
            for ev in prof.key_averages():
                us = getattr(ev, "self_device_time_total", 0)  # kernels only: ops' own device time is 0
                if us <= 0:
                    continue
                low = ev.key.lower()
                if low.startswith("triton"):
                    triton += us
                elif any(g in low for g in GEMM_NAMES):
                    gemm += us
                else:
                    other += us
            out[f"{recipe} {name}"] = {"ms": ms, "gemm_ms": gemm / 5e3, "triton_ms": triton / 5e3,
                                       "other_ms": other / 5e3, "compile_s": compile_s, "count": count,
                                       "sha": digest.hexdigest()[:12]}
            print(f"  {setting:38s} {recipe:10s} {name}: {ms:.3f} ms (gemm {gemm / 5e3:.3f}, triton {triton / 5e3:.3f}), "
                  f"compile {compile_s:.1f} s, sha {digest.hexdigest()[:12]}", file=sys.stderr, flush=True)
            del model, holder, x, dy
            torch._dynamo.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=11008)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child process: one setting
    ap.add_argument("--recipes", default="rowwise", help="the recipes of every setting after the first "
                    "(the first runs none, tensorwise and rowwise)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.one:
        res = run_one(args.one, args.recipes.split(","), args.tokens, args.d, args.hidden)
        print(json.dumps(res))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: probe_float8_casts.py needs a CUDA GPU", file=sys.stderr)
        return 2
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"error: --settings {','.join(unknown)}: choose from {','.join(SETTINGS)}", file=sys.stderr)
        return 2
    results = {}
    for i, name in enumerate(names):
        # bf16 and tensorwise once, under the default setting, as the yardsticks
        recipes = "none,tensorwise,rowwise" if i == 0 else args.recipes
        env = dict(os.environ, **SETTINGS[name][0], TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor_"))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", name, "--recipes", recipes, "--tokens", str(args.tokens),
                               "--d", str(args.d), "--hidden", str(args.hidden)], env=env, capture_output=True, text=True)
        sys.stderr.write(proc.stderr[-6000:] if proc.returncode else "".join(
            l + "\n" for l in proc.stderr.splitlines() if l.startswith("  ")))
        if proc.returncode:
            print(f"{name}: failed (exit {proc.returncode})", flush=True)
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n| setting | recipe | ms per layer | GEMM ms | Triton ms | other ms | compile s | output sha (d->d, d->h, h->d) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        for recipe in ("none", "tensorwise", "rowwise"):
            rows = [v for key, v in res.items() if key.startswith(recipe + " ")]
            if not rows:
                continue
            tot = {f: sum(r[f] * r["count"] for r in rows) for f in ("ms", "gemm_ms", "triton_ms", "other_ms")}
            print(f"| {name} | {recipe} | {tot['ms']:.2f} | {tot['gemm_ms']:.2f} | {tot['triton_ms']:.2f} | "
                  f"{tot['other_ms']:.2f} | {sum(r['compile_s'] for r in rows):.0f} | {' '.join(r['sha'] for r in rows)} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
