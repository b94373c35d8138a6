"""Where one FFN fw+bw spends its GPU time, kernel by kernel, from a torch.profiler trace:

    python lab/probe_timeline.py --shape 7B --tokens 16384 --out timeline.json

For dense srelu (eager) and srelu24: several fw+bw calls back to back (as do_bench and training
run them), split into calls by a marker kernel. Per call: the span from its first kernel's start
to its last kernel's end, the time kernels ran, the idle gaps (GPU waiting on the host) and the
kernels in order with their durations. Alongside, the do_bench median of the same call, and the
SM clock, power and throttle reasons sampled by nvidia-smi while do_bench runs (a GEMM-heavy
call can run at a lower clock than a short profiled one).
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.srelu24_ffn import srelu24_ffn_kernels  # noqa: E402
from kernels.srelu24_reference import SReLU24Recipe  # noqa: E402
from scripts.ffn_inputs import SHAPES, ffn_inputs  # noqa: E402
from training.gpu_clocks import energy_during  # noqa: E402

MARKER = "spin"  # torch.cuda._sleep's kernel name contains it


def kernels_of(trace_path: str) -> list:
    """(start us, duration us, name) of every kernel, memcpy and memset on the GPU, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    rows = [(e["ts"], e["dur"], e["name"]) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(rows)


def calls_of(rows: list) -> list:
    """The rows split at the marker kernels (the marker itself dropped)."""
    calls, cur = [], None
    for r in rows:
        if MARKER in r[2]:
            if cur:
                calls.append(cur)
            cur = []
        elif cur is not None:
            cur.append(r)
    if cur:
        calls.append(cur)
    return calls


def summarise(call: list) -> dict:
    start, end = call[0][0], max(t + d for t, d, _ in call)
    busy, gaps, reach = 0.0, [], start
    for t, d, name in call:
        if t > reach + 1.0:  # more than a microsecond idle
            gaps.append((round(t - reach, 1), name[:60]))
        busy += max(0.0, t + d - max(t, reach))
        reach = max(reach, t + d)
    return {"span_ms": (end - start) / 1e3, "busy_ms": busy / 1e3, "idle_ms": (end - start - busy) / 1e3,
            "n_kernels": len(call), "largest_gaps_us": sorted(gaps, reverse=True)[:8],
            "kernels": [(name[:90], round(d, 1), round(t - start, 1)) for t, d, name in call]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7B", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--calls", type=int, default=6, help="fw+bw calls profiled (>= 2; the first is dropped)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: probe_timeline.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    T = args.tokens
    x, gy, w1, w2 = ffn_inputs(*SHAPES[args.shape], T, requires_grad=True)
    recipe = SReLU24Recipe()
    variants = {"dense_eager": lambda: F.linear(F.relu(F.linear(x, w1)).square(), w2),
                "srelu24": lambda: srelu24_ffn_kernels(x, w1, w2, recipe)}
    result = {"shape": args.shape, "T": T, "device": torch.cuda.get_device_name()}
    for name, fw in variants.items():
        def run():
            x.grad = w1.grad = w2.grad = None
            fw().backward(gy)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                torch.cuda._sleep(100)
                run()
            torch.cuda._sleep(100)
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            calls = calls_of(kernels_of(path))
        sums = [summarise(c) for c in calls[1:]]  # the first call also carries the profiler's start-up
        if not sums:
            print(f"error: the trace of {name} split into {len(calls)} calls; need --calls >= 2", file=sys.stderr)
            return 1
        med = lambda k: sorted(s[k] for s in sums)[len(sums) // 2]  # noqa: E731
        result[name] = {"do_bench_ms": do_bench(run, warmup=25, rep=200, return_mode="median"),
                        "profiled_span_ms": med("span_ms"), "profiled_busy_ms": med("busy_ms"),
                        "profiled_idle_ms": med("idle_ms"), "clocks_under_do_bench": energy_during(run, 3.0),
                        "one_call": sums[len(sums) // 2]}
        r = result[name]
        print(f"{name}: do_bench {r['do_bench_ms']:.3f} ms; profiled call span {r['profiled_span_ms']:.3f}, kernels "
              f"{r['profiled_busy_ms']:.3f}, idle {r['profiled_idle_ms']:.3f}; clocks {json.dumps(r['clocks_under_do_bench'])}",
              flush=True)
    print(f"\nsrelu24 fw+bw at {args.shape}, T={T}, one profiled call: kernel, us, start us")
    for k, d, t in result["srelu24"]["one_call"]["kernels"]:
        print(f"| {k} | {d} | {t} |")
    print("largest gaps (us, next kernel):", result["srelu24"]["one_call"]["largest_gaps_us"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
