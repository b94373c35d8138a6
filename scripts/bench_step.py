"""Whole training steps of the real model and optimizer: tokens/s, MFU, peak memory and the
step-time breakdown (data, forward, backward, optimizer), on one device or under torchrun.

    python scripts/bench_step.py +experiment=swiglu_1b                  # on a GPU
    python scripts/bench_step.py +experiment=sparse_1b --ffn-sweep      # swiglu, srelu, srelu24 in one run
    python scripts/bench_step.py +experiment=sparse_7b --layers 8       # 7B shapes, layers cut to fit one GPU
    torchrun --nproc-per-node=2 scripts/bench_step.py +experiment=sparse_1b trainer.strategy=fsdp --ffn-sweep

The model is built exactly as the trainer builds it (training/distributed.py: meta device,
activation checkpointing, torch.compile per block, FSDP2 / DDP, bf16 as the trainer uses it).
Each step is the trainer's own `training.step.train_step` (clipping, the non-finite check, the
FFN statistics on the config's logged steps, `--accum` micro-batches). Batches are random
tokens of the experiment's micro-batch and sequence length ("data" is building them on the host
and copying them to the device). srelu24 is measured in its 2:4 phase. tokens/s counts all ranks;
MFU is per GPU. Rank 0 writes a table and benchmarks/results/bench_step.json.
"""
import argparse
import gc
import json
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model import FFNKind, Transformer, model_size  # noqa: E402
from training.config import Strategy, register_configs  # noqa: E402
from training.distributed import build_model, exit_process, setup, shutdown  # noqa: E402
from training.logger import environment  # noqa: E402
from training.loop import autocast_for, use_bf16  # noqa: E402
from training.metrics import peak_flops  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.step import StepParts, TrainState, train_step  # noqa: E402
from training.gpu_clocks import ClockSampler  # noqa: E402


def load_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


class Clock:
    """Phase timer for train_step's marks: CUDA events on a GPU (no sync inside the step),
    perf_counter on CPU. Each phase's time is summed over its marks (micro-batches)."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("start", self.now())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self.now()))

    def phases_ms(self) -> list[float]:
        """Milliseconds per phase (PHASES order) since start()."""
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = dict.fromkeys(self.PHASES, 0.0)
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:]):
            out[phase] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return [out[p] for p in self.PHASES]


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by sorted (start, end) intervals, overlaps counted once."""
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy


PROFILE_KEPT = 60  # kernels per variant kept in the JSON


def profile_kernels(train_step, steps: int, top: int = PROFILE_KEPT) -> dict:
    """torch.profiler over `steps` more steps: per step, the time some kernel was running (the
    union of kernel intervals: kernels that overlap, such as NCCL's beside compute, count once),
    the span from the first kernel's start to the last one's end, and the costliest kernels as
    [name, summed ms, launches]. span minus busy is the GPU idling. The profiler adds a little
    to each kernel, so compare variants within one run rather than with the timed steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy = union_length(spans)
    rows = [(e.key, getattr(e, "self_device_time_total", 0) / 1e3 / steps, e.count / steps)
            for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    rows.sort(key=lambda r: -r[1])
    return {"kernel_busy_ms_per_step": busy / 1e3 / steps,
            "profiled_span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / steps if spans else 0.0,
            "top_kernels": [[k[:90], round(ms, 3), round(n, 1)] for k, ms, n in rows[:top]]}


def bench(cfg, args, d) -> dict:
    device, t = d.device, cfg.trainer
    model_cfg = replace(cfg.model, n_layers=args.layers) if args.layers else cfg.model
    vocab = model_cfg.vocab_size or cfg.data.vocab_size
    bf16 = use_bf16(t.precision, device)
    fsdp_bf16 = t.strategy == Strategy.fsdp and bf16 and device.type == "cuda"
    model, step_module = build_model(lambda: Transformer(model_cfg, cfg.ffn, vocab), t, d, 0, fsdp_bf16)
    opt = build_optimizer(model, cfg.optim, device)
    B, S = t.micro_batch_size, t.seq_len
    lr = cfg.optim.lr
    # the trainer's step, as the trainer runs it (training/step.py); srelu24 in its 2:4 phase
    parts = StepParts(model=model, train_module=step_module, optimizer=opt, dist=d, accum=args.accum,
                      tokens_per_step=args.accum * B * S * d.world_size, lr_at=lambda step: lr,
                      grad_clip=cfg.optim.grad_clip, sparse_from=0 if cfg.ffn.kind == FFNKind.srelu24 else None,
                      autocast=autocast_for(t.precision, t.strategy, device))
    state = TrainState()
    clock, rows = Clock(device), []

    def next_batch():
        tokens = torch.randint(0, vocab, (B, S + 1)).to(device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step_timed() -> list[float]:
        clock.start()
        log = (state.step + 1) % t.log_every == 0  # statistics on the trainer's logged steps
        train_step(parts, state, next_batch, log=log, mark=clock.mark)
        return clock.phases_ms()

    for _ in range(args.warmup):
        train_step_timed()
    with ClockSampler(device) if device.type == "cuda" else nullcontext() as clocks:
        for _ in range(args.steps):
            rows.append(train_step_timed())  # phases_ms synchronises: the samples cover the steps
    data, fw, bw, op = (statistics.median(col) for col in zip(*rows))
    kernels = profile_kernels(train_step_timed, args.profile) if args.profile and device.type == "cuda" else None
    step = data + fw + bw + op
    size = model_size(model, S)
    tok_s = parts.tokens_per_step / (step / 1e3)
    peak = peak_flops(device)
    result = {"ffn": cfg.ffn.kind.value, "model": model_cfg.name, "n_layers": model_cfg.n_layers,
              "layers_cut_from": cfg.model.n_layers if args.layers else None, "micro_batch": B, "seq_len": S, "accum": args.accum,
              "world_size": d.world_size, "strategy": t.strategy.value,
              "activation_checkpointing": t.activation_checkpointing.value, "compile": t.compile,
              "step_ms": step, "data_ms": data, "forward_ms": fw,
              "backward_ms": bw, "optimizer_ms": op, "tokens_per_s": tok_s,
              "mfu": size.flops_per_token * tok_s / d.world_size / peak if peak else None,
              "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if clocks is not None:  # a power-capped GPU: which variant lowers the clock for everything
        result["clocks"] = clocks.summary()
    if kernels is not None:
        result.update(kernels)
    # FSDP2 and compiled modules sit in reference cycles: collect them, or the next variant of a
    # sweep runs (and measures its peak memory) with this one's parameters still allocated
    del model, step_module, opt, train_step_timed
    parts = None  # the closure above held it
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ffn-sweep", action="store_true", help="swiglu, srelu and srelu24 in one run")
    ap.add_argument("--ffns", default="", help="the variants to sweep, comma-separated (implies --ffn-sweep), "
                    "e.g. srelu,srelu24")
    ap.add_argument("--layers", type=int, default=0, help="cut the layer count (per-layer figures still hold)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step and rank (gradient accumulation)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many steps: GPU kernel time per step and the top kernels")
    ap.add_argument("--print-kernels", type=int, default=12, help=f"kernels printed per variant (the JSON keeps {PROFILE_KEPT})")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_step.json")
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="only redraw the kernel-category figure of a saved --profile result, next to it")
    ap.add_argument("override", nargs="*", help="Hydra overrides, e.g. +experiment=sparse_1b")
    args = ap.parse_intermixed_args()  # Hydra overrides may come before or after the flags
    if args.replot:
        print(f"wrote {plot_kernels(args.replot)}")
        return 0
    variants = ["swiglu", "srelu", "srelu24"] if args.ffn_sweep else [None]
    if args.ffns:
        variants = args.ffns.split(",")
        valid = [k.value for k in FFNKind]
        if bad := [v for v in variants if v not in valid]:
            ap.error(f"--ffns: unknown variant(s) {bad}; valid: {valid}")
    cfgs = []
    for v in variants:
        cfg = load_config(args.override + ([f"ffn={v}"] if v else []))
        if v and cfg.ffn.kind.value != v:  # an experiment that overrides ffn: force the variant
            cfg.ffn.kind = FFNKind(v)
        cfg.trainer.device = args.device
        cfg.trainer.compile = cfg.trainer.compile and not args.no_compile
        cfgs.append(cfg)
    d = setup(cfgs[0].trainer)  # the process group (torchrun, trainer.strategy), once for the sweep
    try:
        results = []
        for cfg in cfgs:
            results.append(bench(cfg, args, d))
            if d.is_main:
                print(json.dumps(results[-1]), flush=True)
    finally:
        shutdown(d)
    if d.is_main:
        report(args, results, d.device)
    return 0


def plot_kernels(result: Path) -> Path:
    """The saved result's profiled kernel time per category (training/plots.step_kernels), PNG
    beside the JSON."""
    from training.plots import close, step_kernels

    results = json.loads(result.read_text()).get("results")
    if not isinstance(results, list):
        raise SystemExit(f"error: {result} is not a bench_step.py result (no \"results\" list)")
    if not any(r.get("top_kernels") for r in results):
        raise SystemExit(f"error: {result} has no kernel profile (run with --profile STEPS)")
    fig = step_kernels(results)
    png = result.with_suffix(".png")
    fig.savefig(png, dpi=120)
    close(fig)
    return png


def report(args, results: list[dict], device: torch.device) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(), "argv": sys.argv,
                                    "environment": environment(), "results": results}, indent=2))
    r0 = results[0]
    cut = f", layers cut to {r0['n_layers']} of {r0['layers_cut_from']}" if r0["layers_cut_from"] else ""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{' '.join(args.override)} on {r0['world_size']} x {where} ({r0['strategy']}, micro-batch "
          f"{r0['micro_batch']} x {r0['seq_len']} per rank{cut})")
    print("| ffn | step (ms) | data | forward | backward | optimizer | tokens/s | vs first | MFU | peak mem (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        print(f"| {r['ffn']} | {r['step_ms']:.1f} | {r['data_ms']:.1f} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} "
              f"| {r['optimizer_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / r0['tokens_per_s']:.2f}x "
              f"| {mfu} | {mem} |")
    if any(r.get("clocks", {}).get("samples") for r in results):
        print("\nclocks over the timed steps (nvidia-smi medians): "
              + "; ".join(f"{r['ffn']} {r['clocks'].get('sm_clock_mhz')} MHz, {r['clocks'].get('power_w')} W"
                          for r in results if r.get("clocks")))
    if any(r.get("top_kernels") for r in results):
        print(f"wrote {plot_kernels(args.out)}")
    for r in results:
        if r.get("top_kernels"):
            print(f"\n{r['ffn']}: kernels running {r['kernel_busy_ms_per_step']:.1f} ms of a "
                  f"{r['profiled_span_ms_per_step']:.1f} ms profiled step; costliest (summed ms, launches per step):")
            for name, ms, n in r["top_kernels"][:args.print_kernels]:
                print(f"  {ms:8.3f} {n:6.1f}  {name}")


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001 - printed here: exit_process skips the interpreter's teardown
        import traceback

        traceback.print_exc()
        code = 1
    exit_process(code)  # after a process group: see training/distributed.exit_process
