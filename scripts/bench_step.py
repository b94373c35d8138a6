"""Whole training steps of the real model and optimizer: tokens/s, MFU, peak memory and the
step-time breakdown (data, forward, backward, optimizer), one process, one device.

    python scripts/bench_step.py +experiment=swiglu_1b                  # on a GPU
    python scripts/bench_step.py +experiment=sparse_1b --ffn-sweep      # swiglu, srelu, srelu24 in one run
    python scripts/bench_step.py +experiment=sparse_7b --layers 8       # 7B shapes, layers cut to fit one GPU

Batches are random tokens of the experiment's micro-batch and sequence length ("data" is
building one on the host and copying it to the device); gradient accumulation is not
timed (one micro-batch per step). srelu24 is measured in its 2:4 phase. Everything else is the
trainer's: model, bf16 autocast on CUDA, fused AdamW, grad clipping, trainer.compile.
Not yet: several GPUs (torchrun/FSDP2, issue 5). Writes a table and benchmarks/results/bench_step.json.
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
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model import FFNKind, Transformer, model_size  # noqa: E402
from training.config import register_configs  # noqa: E402
from training.logger import environment  # noqa: E402
from training.metrics import peak_flops  # noqa: E402
from training.optim import build_optimizer  # noqa: E402


def load_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


class Clock:
    """Phase timer: CUDA events on a GPU (no sync inside the step), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def phases_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            out = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            out = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return out


def bench(cfg, args, device: torch.device) -> dict:
    model_cfg = replace(cfg.model, n_layers=args.layers) if args.layers else cfg.model
    vocab = model_cfg.vocab_size or cfg.data.vocab_size
    torch.manual_seed(0)
    model = Transformer(model_cfg, cfg.ffn, vocab).to(device)
    model.set_sparse24(cfg.ffn.kind == FFNKind.srelu24)
    opt = build_optimizer(model, cfg.optim, device)
    forward = torch.compile(model) if cfg.trainer.compile and not args.no_compile else model
    B, S = cfg.trainer.micro_batch_size, cfg.trainer.seq_len
    bf16 = device.type == "cuda"
    clock, rows = Clock(device), []
    for i in range(args.warmup + args.steps):
        clock.mark()
        tokens = torch.randint(0, vocab, (B, S + 1)).to(device, non_blocking=True)
        x, y = tokens[:, :-1], tokens[:, 1:]
        clock.mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(x, y)
        clock.mark()
        loss.backward()
        clock.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.mark()
        phases = clock.phases_ms()
        if i >= args.warmup:
            rows.append(phases)
    data, fw, bw, op = (statistics.median(col) for col in zip(*rows))
    step = data + fw + bw + op
    size = model_size(model, S)
    tok_s = B * S / (step / 1e3)
    peak = peak_flops(device)
    result = {"ffn": cfg.ffn.kind.value, "model": model_cfg.name, "n_layers": model_cfg.n_layers,
              "layers_cut_from": cfg.model.n_layers if args.layers else None, "micro_batch": B, "seq_len": S,
              "compile": forward is not model, "step_ms": step, "data_ms": data, "forward_ms": fw,
              "backward_ms": bw, "optimizer_ms": op, "tokens_per_s": tok_s,
              "mfu": size.flops_per_token * tok_s / peak if peak else None,
              "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    del model, opt, forward
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ffn-sweep", action="store_true", help="swiglu, srelu and srelu24 in one run")
    ap.add_argument("--layers", type=int, default=0, help="cut the layer count (per-layer figures still hold)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_step.json")
    ap.add_argument("override", nargs="*", help="Hydra overrides, e.g. +experiment=sparse_1b")
    args = ap.parse_args()
    device = torch.device(args.device)
    variants = ["swiglu", "srelu", "srelu24"] if args.ffn_sweep else [None]
    results = []
    for v in variants:
        cfg = load_config(args.override + ([f"ffn={v}"] if v else []))
        if v and cfg.ffn.kind.value != v:  # an experiment that overrides ffn: force the variant
            cfg.ffn.kind = FFNKind(v)
        results.append(bench(cfg, args, device))
        print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(), "argv": sys.argv,
                                    "environment": environment(), "results": results}, indent=2))
    r0 = results[0]
    cut = f", layers cut to {r0['n_layers']} of {r0['layers_cut_from']}" if r0["layers_cut_from"] else ""
    print(f"\n{' '.join(args.override)} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}"
          f" (micro-batch {r0['micro_batch']} x {r0['seq_len']}{cut})")
    print("| ffn | step (ms) | data | forward | backward | optimizer | tokens/s | vs first | MFU | peak mem (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        print(f"| {r['ffn']} | {r['step_ms']:.1f} | {r['data_ms']:.1f} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} "
              f"| {r['optimizer_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / r0['tokens_per_s']:.2f}x "
              f"| {mfu} | {mem} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
