"""What the per-layer activation statistics cost: step time with and without collecting them,
at an experiment's shapes (default the 1B ones), for each FFN variant, in one process.

    python lab/bench_stats.py --scale 1b --steps 20            # on a GPU
    python lab/bench_stats.py --scale 1b --no-compile

The trainer collects statistics on the logged step only, so with log_every=10 their cost per
step is (t_on - t_off) / 10. Steps use random tokens (data loading is not what is measured),
bf16 autocast, fused AdamW and the experiment's micro-batch. Writes a table and
benchmarks/results/bench_stats.json.
"""
import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model import Transformer  # noqa: E402
from training.config import register_configs  # noqa: E402
from training.logger import environment  # noqa: E402
from training.optim import build_optimizer  # noqa: E402

EXPERIMENT = {"swiglu": "swiglu", "srelu": "srelu", "srelu24": "sparse"}


def load_config(variant: str, scale: str, overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=[f"+experiment={EXPERIMENT[variant]}_{scale}", *overrides]))


def time_steps(model, forward, opt, batch, steps: int, collect: bool) -> list[float]:
    """Per-step milliseconds (CUDA events), statistics collected on every step or never."""
    x, y = batch
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        model.collect_ffn_stats(collect)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if collect:
            model.pop_ffn_stats()  # what the trainer does on a logged step (its copy to host is one sync)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench_variant(variant: str, args) -> dict:
    cfg = load_config(variant, args.scale, args.override)
    if args.layers:
        cfg.model.n_layers = args.layers
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.ffn, cfg.model.vocab_size or cfg.data.vocab_size).to(device)
    model.set_2to4(variant == "srelu24")  # measure srelu24 in its 2:4 phase
    opt = build_optimizer(model, cfg.optim, device)
    forward = torch.compile(model) if args.compile else model
    B, S = cfg.trainer.micro_batch_size, cfg.trainer.seq_len
    tokens = torch.randint(0, model.vocab_size, (B, S + 1), device=device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    t0 = time.perf_counter()
    for collect in (False, True):  # warm up (and compile) both graphs
        time_steps(model, forward, opt, batch, args.warmup, collect)
    warm_s = time.perf_counter() - t0
    off, on = [], []
    for _ in range(args.rounds):  # interleaved, so drift hits both alike
        off += time_steps(model, forward, opt, batch, args.steps, False)
        on += time_steps(model, forward, opt, batch, args.steps, True)
    t_off, t_on = statistics.median(off), statistics.median(on)
    result = {"variant": variant, "n_layers": cfg.model.n_layers, "micro_batch": B, "seq_len": S,
              "compile": args.compile, "warmup_s": warm_s, "step_ms_off": t_off, "step_ms_on": t_on,
              "collect_cost_ms": t_on - t_off, "cost_at_log_every_10": (t_on - t_off) / 10 / t_off,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, opt, forward
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="1b", choices=["125m", "1b", "7b"])
    ap.add_argument("--variants", default="swiglu,srelu,srelu24")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="cut the layer count (e.g. to fit 7b on one GPU)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_stats.json")
    ap.add_argument("override", nargs="*", help="extra Hydra overrides, e.g. trainer.micro_batch_size=4")
    args = ap.parse_intermixed_args()  # Hydra overrides may come before or after the flags
    if not torch.cuda.is_available():
        print("error: bench_stats.py needs a CUDA GPU", file=sys.stderr)
        return 2
    results = []
    for variant in args.variants.split(","):
        try:
            results.append(bench_variant(variant, args))
        except Exception as e:  # noqa: BLE001 - record and go on with the other variants
            results.append({"variant": variant, "error": f"{type(e).__name__}: {e}"[:500]})
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    record = {"date": datetime.now(timezone.utc).isoformat(), "argv": sys.argv, "environment": environment(),
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\n{args.scale}, {torch.cuda.get_device_name()}, compile={args.compile}")
    print("| variant | step, stats off (ms) | step, stats on (ms) | stats cost per collection (ms) | cost at log_every=10 |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['variant']} | {r['step_ms_off']:.1f} | {r['step_ms_on']:.1f} | {r['collect_cost_ms']:.2f} "
                  f"| {100 * r['cost_at_log_every_10']:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
