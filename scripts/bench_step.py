"""Whole training steps of the real model and optimizer: tokens/s, MFU, peak memory and the
step-time breakdown (data, forward, backward, optimizer), on one device or under torchrun.

    python scripts/bench_step.py +experiment=swiglu_1b                  # on a GPU
    python scripts/bench_step.py +experiment=sparse_1b --ffn-sweep      # swiglu, srelu, srelu24 in one run
    python scripts/bench_step.py +experiment=sparse_7b --layers 8       # 7B shapes, layers cut to fit one GPU
    python scripts/bench_step.py +experiment=swiglu_7b --layers 8 --ffns swiglu,srelu,srelu24 \
        --precisions none,tensorwise,rowwise                               # 9 rows: every (precision, ffn)
    python scripts/bench_step.py --merge a.json b.json --out merged.md   # records of several commands, one table
    torchrun --nproc-per-node=2 scripts/bench_step.py +experiment=sparse_1b trainer.strategy=fsdp --ffn-sweep

The model is built exactly as the trainer builds it (training/distributed.py: meta device,
activation checkpointing, torch.compile per block, FSDP2 / DDP, bf16 as the trainer uses it).
Each step is the trainer's own `training.step.train_step` (clipping, the non-finite check, the
FFN statistics on the config's logged steps or every trainer.ffn_stats_every, `--accum`
micro-batches). Batches are random tokens of the experiment's micro-batch and sequence length
("data" is building them on the host and copying them to the device). srelu24 is measured in its 2:4 phase. tokens/s counts all ranks;
MFU is per GPU. Rank 0 writes a table and benchmarks/results/bench_step.json. With
trainer.cuda_graph=true each micro-batch is one graph replay (training/cuda_graph.py), whose time
the breakdown counts as forward; the first warmup step collects the statistics and runs eagerly,
as a timed step that collects them does (one in five at the studies' log_every 5, unless
trainer.ffn_stats_every is set higher).

At random init srelu's activations are about half zeros; a trained model's are 75-80% and more,
and on a power-capped GPU dense GEMMs over zeros draw less power and clock higher. To measure at
trained sparsity, start from a run's weights on its own text (the same weights for srelu and
srelu24, whose shapes match):

    python train.py +experiment=study_speed_7b variant=srelu_tensorwise
    python scripts/bench_step.py +experiment=study_speed_7b --ffns srelu,srelu24 --accum 4 \
        --weights runs/study_speed_7b/<date>/checkpoints/step_00000250 --tokens data

--precisions crosses trainer.float8 (none, tensorwise, rowwise) with the FFNs: each (precision,
ffn) row is a fresh model, compiled anew. The table gives each row's tokens/s against the fastest
dense row (swiglu or srelu at any precision) and against swiglu bf16 (the swiglu row without
float8; the fastest of several). Each JSON row names its precision, commit (short SHA, dirty or
not), GPU, SM clock and power medians over the timed steps, torch and triton versions.
Rowwise float8 sets two of inductor's options for the whole process (training/float8.py); they
are restored after each row, so a later row of another precision runs with the settings it would
have in a process of its own.

--rounds N measures every row N times, in interleaved rounds whose order reverses every other
round, so that the rows' places in the order vary. At the power cap one row's clock can depend
on what ran before it in the process (the 7B tensorwise srelu step cost 663 J after swiglu's and
703 J after srelu24's); each row then reports its median round (the lower middle one for an even
N), its JSON row keeps every round's tokens/s, step time, joules, clock and power, and each row's
ratio to the fastest dense row is also given as the median of the rounds' own ratios. Rounds do
not remove every order effect: a srelu24 row leaves the process in a state that slows a later
dense row (1B float8, graphed: srelu 702 ms first, 734 ms after srelu24's row, 706 ms in a new
process right after; benchmarks/RESULTS.md), so the medians favour srelu24. A training run holds one
variant per process: compare each variant as its own command, or as a command's first row.

--merge A.json B.json ... [--out merged.md | merged.json]: the rows of several records (a 7B
sweep of nine rows takes more than one command) as one table with the same ratios and each row's
commit, clocks and record; records of different shapes (model, layers, micro-batch, sequence,
accumulation, ranks, strategy) are refused unless --mixed-shapes. Older records, whose rows do
not name their precision or commit, take them from the record's command line and environment.
"""
import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model import FFN_REGISTRY, Transformer, model_size  # noqa: E402
from training.config import Float8, Strategy, register_configs  # noqa: E402
from training.distributed import build_model, exit_process, setup, shutdown  # noqa: E402
from training.errors import ConfigError  # noqa: E402
from training.float8 import check as float8_check  # noqa: E402
from training.logger import environment  # noqa: E402
from training.loop import autocast_for, logged, prepare_data, use_bf16  # noqa: E402
from training.metrics import peak_flops  # noqa: E402
from training.memory import estimate  # noqa: E402
from training.optim import build_optimizer  # noqa: E402
from training.checkpoint import CheckpointError, is_checkpoint, load_weights_into, read_train_state, verify_checkpoint  # noqa: E402
from training.config_checks import resolve_vocab_size  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.loader import TokenLoader, batch_to_device  # noqa: E402
from training.cuda_graph import MicroBatchGraphs, graph_problem  # noqa: E402
from training.step import StepParts, TrainState, train_step  # noqa: E402
from training.gpu_clocks import ClockSampler, energy_during, interleaved_rounds  # noqa: E402

PRECISIONS = [f.value for f in Float8]  # trainer.float8's values: none (bf16), tensorwise, rowwise


def load_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


class Clock:
    """Phase timer for train_step's marks: CUDA events on a GPU (no sync inside or between steps),
    perf_counter on CPU. Each phase's time is summed over its marks (micro-batches)."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps = []  # per step since the last read: its (phase, mark) pairs

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.steps.append([("start", self.now())])

    def mark(self, phase: str) -> None:
        self.steps[-1].append((phase, self.now()))

    def phases_ms(self) -> list[list[float]]:
        """Milliseconds per phase (PHASES order) of each step since the last call. One sync, after
        the last step: the steps ran back to back, as the trainer runs its unlogged steps; a GPU
        gap between two steps counts in the next one's optimizer phase, with its opening (srelu24's
        weight conversions for the step)."""
        steps, self.steps = self.steps, []
        if self.cuda and steps:
            steps[-1][-1][1].synchronize()
        rows = []
        for marks in steps:
            out = dict.fromkeys(self.PHASES, 0.0)
            for (_, a), (phase, b) in zip(marks, marks[1:]):
                out[phase] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            rows.append([out[p] for p in self.PHASES])
        return rows


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by sorted (start, end) intervals, overlaps counted once."""
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy


PROFILE_KEPT = 60  # kernels per variant kept in the JSON


def profile_host(train_step, steps: int, top: int = PROFILE_KEPT) -> dict:
    """torch.profiler's CPU side over `steps` more steps: where the host's time goes when a step
    waits on it (GPU idle in --profile). Per step: the wall time of the profiled steps, the ops'
    summed self CPU time by thread (the main thread issues the forward, autograd's device thread
    the backward), and the costliest ops as [name, self CPU ms, calls]. Self time leaves out the
    Python between ops and the profiler's own cost is in the wall time: compare variants
    within one run."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    by_thread: dict[int, float] = {}
    for e in prof.events():
        by_thread[e.thread] = by_thread.get(e.thread, 0.0) + e.self_cpu_time_total
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps)
            for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return {"host_wall_ms_per_step": wall * 1e3 / steps,
            "host_self_ms_per_step": sum(by_thread.values()) / 1e3 / steps,
            "host_self_ms_per_step_by_thread": sorted((round(v / 1e3 / steps, 3) for v in by_thread.values()),
                                                      reverse=True),
            "top_host_ops": [[k[:90], round(ms, 3), round(n, 1)] for k, ms, n in rows[:top]]}


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


# The energy accounting's categories; a piece's category from its name (scripts/bench_ffn.py's
# pieces mark their GEMMs "(dense)" / "(sparse)").
ENERGY_CATEGORIES = ("dense GEMMs", "sparse GEMMs", "sparsify passes", "gathers and permutations", "attention",
                     "norms and elementwise", "optimizer")


def piece_category(name: str) -> str:
    if "optimizer" in name:
        return "optimizer"
    if "(sparse)" in name:
        return "sparse GEMMs"
    if "(dense)" in name or "GEMMs" in name or "head" in name or "projections" in name:
        return "dense GEMMs"
    if "fused" in name:
        return "sparsify passes"
    if "SDPA" in name:
        return "attention"
    if "elementwise" in name or "RMSNorm" in name:
        return "norms and elementwise"
    return "gathers and permutations"  # permutations, their inverse, row gathers, dense-feature writes


def step_pieces(cfg, model_cfg, opt, params, B: int, S: int, density) -> list[tuple[str, int, object]]:
    """What one training step runs, as pieces that can run alone: (name, calls per step, fn).
    The FFN's pieces come from scripts/bench_ffn.py (the same definitions its breakdown times);
    attention, its projections, the norms, the output head and the optimizer are added here."""
    import torch.nn.functional as F

    from scripts.bench_ffn import dense_srelu_pieces, srelu24_pieces
    from model import ffn_hidden_dim

    T, D, L = B * S, model_cfg.dim, model_cfg.n_layers
    Fh = ffn_hidden_dim(model_cfg, cfg.ffn)
    if cfg.ffn.kind == "srelu24":
        ffn = srelu24_pieces(D, Fh, T, density)
    elif cfg.ffn.kind == "srelu":
        ffn = dense_srelu_pieces(D, Fh, T, density)
    else:
        raise SystemExit(f"error: --energy accounts srelu and srelu24 steps, not ffn={cfg.ffn.kind}")
    pieces = [(name, L, fn) for name, fn in ffn.items()]
    bf = torch.bfloat16
    H, Hkv = model_cfg.n_heads, model_cfg.n_kv_heads or model_cfg.n_heads
    hd = D // H
    q = torch.randn(B, H, S, hd, device="cuda", dtype=bf, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, hd, device="cuda", dtype=bf, requires_grad=True) for _ in range(2))
    go = torch.randn(B, H, S, hd, device="cuda", dtype=bf)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hkv != H).backward(go)

    x = torch.randn(T, D, device="cuda", dtype=bf, requires_grad=True)
    gx = torch.randn(T, D, device="cuda", dtype=bf)
    wqkv = torch.randn((H + 2 * Hkv) * hd, D, device="cuda", dtype=bf, requires_grad=True)
    wo = torch.randn(D, D, device="cuda", dtype=bf, requires_grad=True)
    gqkv = torch.randn(T, (H + 2 * Hkv) * hd, device="cuda", dtype=bf)
    norm_w = torch.ones(D, device="cuda", dtype=bf, requires_grad=True)  # bf16 as autocast runs it: the fused kernel
    vocab = model_cfg.vocab_size or cfg.data.vocab_size
    w_out = torch.randn(vocab, D, device="cuda", dtype=bf, requires_grad=True)
    labels = torch.randint(0, vocab, (T,), device="cuda")

    def projections():
        F.linear(x, wqkv).backward(gqkv)
        F.linear(x, wo).backward(gx)

    def rmsnorm():
        F.rms_norm(x, (D,), norm_w, model_cfg.norm_eps).backward(gx)

    def head():
        F.cross_entropy(F.linear(x, w_out).float(), labels).backward()

    for p in params:  # the optimizer steps on gradients of the model's own shapes
        p.grad = torch.randn_like(p) * 1e-3
    pieces += [("attention: SDPA fw+bw", L, sdpa), ("attention projections q, k, v, o fw+bw", L, projections),
               ("RMSNorm fw+bw", 2 * L, rmsnorm), ("output head + loss fw+bw", 1, head),
               ("optimizer: fused AdamW step", 1, opt.step)]
    return pieces


def energy_accounting(cfg, model_cfg, opt, params, B: int, S: int, seconds: float, density) -> dict:
    """Each piece of a step in a sustained loop of `seconds` (training.gpu_clocks.energy_during:
    NVML's energy counter), scaled by its calls per step: ms and J per step and per category,
    to set beside the measured step. The loops run each piece at its own clock, so the sum
    differs from the step; the comparison between variants at the same shapes is the point."""
    rows = []
    for name, calls, fn in step_pieces(cfg, model_cfg, opt, params, B, S, density):
        for _ in range(3):
            fn()  # warm: plans, workspaces
        r = energy_during(fn, seconds)
        rows.append({"piece": name, "category": piece_category(name), "calls_per_step": calls,
                     "ms_per_call": r["ms_per_call"], "mj_per_call": r.get("mj_per_call"),
                     "power_w": r.get("power_w"), "sm_clock_mhz": r.get("sm_clock_mhz")})
        torch.cuda.empty_cache()
    per_cat = {c: {"ms_per_step": 0.0, "j_per_step": 0.0} for c in ENERGY_CATEGORIES}
    for r in rows:
        c = per_cat[r["category"]]
        c["ms_per_step"] += r["ms_per_call"] * r["calls_per_step"]
        c["j_per_step"] += (r["mj_per_call"] or float("nan")) * r["calls_per_step"] / 1e3
    return {"pieces": rows, "categories": per_cat, "seconds_per_piece": seconds, "density": density}


@contextmanager
def inductor_settings_restored():
    """torch._inductor.config as it was before the block: options a row set for the whole process
    (rowwise float8: emulate_precision_casts, triton.prefer_nd_tiling) do not reach the next row."""
    import torch._inductor.config as inductor

    before = inductor.get_config_copy()
    try:
        yield
    finally:
        after = inductor.get_config_copy()
        changed = {}
        for k, v in before.items():
            try:
                same = after.get(k) is v or bool(after.get(k) == v)
            except Exception:  # noqa: BLE001 - a value without a plain ==: restore it
                same = False
            if not same:
                changed[k] = v
        if changed:
            inductor.load_config(changed)


def row_environment(env: dict, device: torch.device) -> dict:
    """What each JSON row names, so that rows of several records can be merged and told apart."""
    sha = env.get("git_sha")
    return {"commit": sha[:7] if sha else None, "dirty": env.get("git_dirty"),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": env.get("torch"), "triton": env.get("triton"),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def bench(cfg, args, d) -> dict:
    device, t = d.device, cfg.trainer
    model_cfg = replace(cfg.model, n_layers=args.layers) if args.layers else cfg.model
    problem = graph_problem(t.cuda_graph, d.world_size, t.strategy.value, t.activation_checkpointing.value,
                            getattr(model_cfg.attention, "value", model_cfg.attention), device)
    if problem:
        fail(problem)
    vocab = model_cfg.vocab_size or cfg.data.vocab_size
    bf16 = use_bf16(t.precision, device)
    fsdp_bf16 = t.strategy == Strategy.fsdp and bf16 and device.type == "cuda"
    # token 0 stands for the end of text: document masking (model.attention=document) sees
    # documents of --doc-len tokens
    # srelu24's op takes the float8 recipe from the model it is built in, as in the trainer (training/loop.py)
    loader, eot = None, 0
    if args.tokens == "data":  # the trainer's loader over the training split, from the config's seed
        try:
            shard_dir, manifest = prepare_data(cfg, d)
            vocab, eot = resolve_vocab_size(model_cfg, manifest.vocab_size), manifest.eot_id
            loader = TokenLoader(shard_dir, manifest, "train", t.seq_len, t.micro_batch_size, t.seed, d.rank,
                                 d.world_size)
        except (DataError, ConfigError) as e:
            fail(f"--tokens data: {e}")
    elif args.weights_vocab:  # random tokens over the checkpoint's vocabulary
        vocab = args.weights_vocab
    model, step_module = build_model(lambda: Transformer(model_cfg, cfg.ffn, vocab, eot_id=eot, float8=t.float8.value),
                                     t, d, 0, fsdp_bf16)
    if args.weights:
        try:
            load_weights_into(args.weights, model)
        except CheckpointError as e:
            fail(f"--weights: {e}")
    opt = build_optimizer(model, cfg.optim, device)
    B, S = t.micro_batch_size, t.seq_len
    lr = cfg.optim.lr
    # the trainer's step, as the trainer runs it (training/step.py); srelu24 in its 2:4 phase
    parts = StepParts(model=model, train_module=step_module, optimizer=opt, dist=d, accum=args.accum,
                      tokens_per_step=args.accum * B * S * d.world_size, lr_at=lambda step: lr,
                      grad_clip=cfg.optim.grad_clip, sparse_from=0 if cfg.ffn.kind == "srelu24" else None,
                      autocast=autocast_for(t.precision, t.strategy, device), nonfinite=t.nonfinite)
    if t.cuda_graph:  # as the trainer builds it (training/loop.py, step_parts)
        parts.graphs = MicroBatchGraphs.for_step(parts, B, S)
    state = TrainState()
    clock = Clock(device)

    def next_batch():
        if loader is not None:
            return batch_to_device(*loader.next_batch(), device)
        tokens = torch.randint(1, vocab, (B, S + 1))
        tokens[:, ::args.doc_len] = 0  # a boundary every doc_len tokens
        return batch_to_device(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), device)

    def train_step_timed(log: bool = None) -> None:
        clock.start()
        # the trainer's logged steps, and its steps with the FFN statistics (eager under cuda_graph)
        log, stats = logged(t, state.step + 1) if log is None else (log, log)
        train_step(parts, state, next_batch, log=log, stats=stats, mark=clock.mark)

    for i in range(max(args.warmup, 2)):  # a logged step too: it compiles its own graph (the statistics)
        train_step_timed(log=i == 0)
    clock.phases_ms()  # the warmup's: dropped
    with ClockSampler(device) if device.type == "cuda" else nullcontext() as clocks:
        for _ in range(args.steps):
            train_step_timed()
        rows = clock.phases_ms()  # synchronises: the samples cover the steps
    data, fw, bw, op = (statistics.median(col) for col in zip(*rows))
    kernels = profile_kernels(train_step_timed, args.profile) if args.profile and device.type == "cuda" else None
    host = profile_host(train_step_timed, args.profile_host) if args.profile_host else None
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None  # the steps' own
    # reserved: also a CUDA graph's private pool, whose blocks stay reserved but unallocated between replays
    peak_reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    energy = (energy_accounting(cfg, model_cfg, opt, parts.params, B, S, args.energy, args.density)
              if args.energy and device.type == "cuda" else None)
    step = data + fw + bw + op
    size = model_size(model, S)
    tok_s = parts.tokens_per_step / (step / 1e3)
    peak = peak_flops(device)
    result = {"ffn": cfg.ffn.kind, "float8": t.float8.value,
              "precision": precision_label(t.float8.value, "bf16" if bf16 else "fp32"), "model": model_cfg.name, "n_layers": model_cfg.n_layers,
              "layers_cut_from": cfg.model.n_layers if args.layers else None, "micro_batch": B, "seq_len": S, "accum": args.accum,
              "world_size": d.world_size, "strategy": t.strategy.value,
              "weights": str(args.weights) if args.weights else None, "tokens": args.tokens,
              "activation_checkpointing": t.activation_checkpointing.value, "compile": t.compile,
              "cuda_graph": t.cuda_graph,
              "step_ms": step, "data_ms": data, "forward_ms": fw,
              "backward_ms": bw, "optimizer_ms": op, "tokens_per_s": tok_s,
              "mfu": size.flops_per_token * tok_s / d.world_size / peak if peak else None,
              "peak_mem_gib": peak_mem, "peak_reserved_gib": peak_reserved, "attention": getattr(model_cfg.attention, "value", model_cfg.attention),
              "estimated_peak_gib": estimate(model_cfg, cfg.ffn, vocab, t, d.world_size, grad_accumulation=args.accum > 1,
                                             sparse_2to4=cfg.ffn.kind == "srelu24").peak / 2**30}
    if clocks is not None:  # a power-capped GPU: which variant lowers the clock for everything
        result["clocks"] = clocks.summary()
        result["sm_clock_mhz"], result["power_w"] = result["clocks"].get("sm_clock_mhz"), result["clocks"].get("power_w")
        result["temp_c"] = result["clocks"].get("temp_c")  # a warmer chip leaks more: fewer MHz at the cap
        if "energy_j" in result["clocks"]:
            result["step_j"] = result["clocks"]["energy_j"] / args.steps
    if energy is not None:
        result["energy"] = energy
    if kernels is not None:
        result.update(kernels)
    if host is not None:
        result.update(host)
    # FSDP2 and compiled modules sit in reference cycles: collect them, or the next variant of a
    # sweep runs (and measures its peak memory) with this one's parameters still allocated
    if parts.graphs is not None:
        parts.graphs.close()
    del model, step_module, opt, train_step_timed
    parts = None  # the closure above held it
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


# ---- the table of (precision, ffn) rows, of one record or merged from several

DENSE = ("swiglu", "srelu")
EXTRA_COLUMNS = {"gpu": "GPU", "record": "record", "shape": "shape"}
SHAPE_KEYS = ("model", "n_layers", "micro_batch", "seq_len", "accum", "world_size", "strategy")


def precision_label(float8: str, base: str = "bf16") -> str:
    """A row's precision: the float8 recipe, or `base` (bf16 on GPUs, fp32 on CPU) without one."""
    return base if float8 in (None, "none") else float8


def shape_of(r: dict) -> tuple:
    return tuple(r.get(k, 1 if k in ("accum", "world_size") else None) for k in SHAPE_KEYS)


def describe_shape(r: dict) -> str:
    layers = f"{r['n_layers']} of {r['layers_cut_from']} layers" if r.get("layers_cut_from") else f"{r['n_layers']} layers"
    return (f"{r['model']}, {layers}, micro-batch {r['micro_batch']} x {r['seq_len']}, accum {r.get('accum', 1)}, "
            f"{r.get('world_size', 1)} rank(s), strategy {r.get('strategy', 'none')}")


def commit_label(r: dict) -> str:
    if not r.get("commit"):
        return "-"
    return r["commit"] + ("+dirty" if r.get("dirty") else "")


def clock_of(r: dict, key: str):
    """sm_clock_mhz or power_w: the row's own (bench_step writes them beside the clocks summary)
    or the clocks summary's (older records)."""
    v = r.get(key)
    return v if v is not None else (r.get("clocks") or {}).get(key)


def ratios(rows: list[dict]) -> dict:
    """Set each row's vs_fastest_dense and vs_swiglu_bf16 (tokens/s over the reference's; None
    without a reference) and return the references: {"fastest dense": row or None, "swiglu without float8": row or None}."""
    dense = [r for r in rows if r.get("ffn") in DENSE and r.get("tokens_per_s")]
    fastest = max(dense, key=lambda r: r["tokens_per_s"], default=None)
    plain = [r for r in rows if r.get("ffn") == "swiglu" and r.get("float8", "none") == "none" and r.get("tokens_per_s")]
    swiglu = max(plain, key=lambda r: r["tokens_per_s"], default=None)
    for r in rows:
        r["vs_fastest_dense"] = r["tokens_per_s"] / fastest["tokens_per_s"] if fastest and r.get("tokens_per_s") else None
        r["vs_swiglu_bf16"] = r["tokens_per_s"] / swiglu["tokens_per_s"] if swiglu and r.get("tokens_per_s") else None
    return {"fastest dense": fastest, "swiglu without float8": swiglu}


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict], extra: tuple = ()) -> list[str]:
    """Markdown lines: one row per (precision, ffn) measurement, ratios set by `ratios` first.
    extra: more columns, among "gpu", "record", "shape"."""
    refs = ratios(rows)
    head = ["ffn", "precision", "step (ms)", "data", "forward", "backward", "optimizer", "tokens/s",
            "vs fastest dense", "vs swiglu bf16", "MFU", "peak mem (GiB)", "estimated (GiB)", "SM MHz", "W", "commit"]
    head += [EXTRA_COLUMNS[e] for e in extra]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.get("ffn", "?"), r.get("precision") or precision_label(r.get("float8")),
                 _f(r.get("step_ms"), "{:.1f}"), _f(r.get("data_ms"), "{:.1f}"), _f(r.get("forward_ms"), "{:.1f}"),
                 _f(r.get("backward_ms"), "{:.1f}"), _f(r.get("optimizer_ms"), "{:.1f}"),
                 _f(r.get("tokens_per_s"), "{:,.0f}"), _f(r["vs_fastest_dense"], "{:.2f}x"),
                 _f(r["vs_swiglu_bf16"], "{:.2f}x"), "-" if not r.get("mfu") else f"{100 * r['mfu']:.1f}%",
                 _f(r.get("peak_mem_gib") or None, "{:.1f}"), _f(r.get("estimated_peak_gib"), "{:.1f}"),
                 _f(clock_of(r, "sm_clock_mhz"), "{:.0f}"), _f(clock_of(r, "power_w"), "{:.0f}"), commit_label(r)]
        cells += [{"gpu": r.get("gpu") or "-", "record": r.get("record", "-"),
                   "shape": describe_shape(r)}[e] for e in extra]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    notes = [f"{name}: {ref.get('ffn')} {ref.get('precision') or precision_label(ref.get('float8'))} "
             f"({ref['tokens_per_s']:,.0f} tokens/s)" for name, ref in refs.items() if ref]
    if notes:
        out += ["", "ratios of tokens/s against " + "; ".join(notes)]
    return out


def argv_float8(argv: list) -> str:
    """trainer.float8 of an older record's command line (before rows named their precision)."""
    found = [m.group(1) for a in argv or [] if (m := re.fullmatch(r"\+{0,2}trainer\.float8=(\w+)", str(a)))]
    return found[-1] if found else "none"


def load_rows(path: Path) -> list[dict]:
    """The rows of a bench_step.py record, each completed from the record where it predates the
    per-row fields (precision, commit, GPU, versions) and named by its file (`record`)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file (give bench_step.py JSON records)")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path} is not JSON ({e}); give bench_step.py JSON records")
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and "tokens_per_s" in r for r in results):
        raise SystemExit(f"error: {path} is not a bench_step.py record (a \"results\" list of rows with tokens_per_s)")
    env = data.get("environment") or {}
    rows = []
    for r in results:
        r = dict(r)
        r.setdefault("float8", argv_float8(data.get("argv")))
        r.setdefault("precision", precision_label(r["float8"], "bf16" if env.get("gpu") else "fp32"))
        if not r.get("commit") and env.get("git_sha"):
            r["commit"], r["dirty"] = env["git_sha"][:7], bool(env.get("git_dirty"))
        r.setdefault("gpu", env.get("gpu"))
        r.setdefault("torch", env.get("torch"))
        r.setdefault("triton", env.get("triton"))
        r.setdefault("date", data.get("date"))
        r["record"] = r.get("record") or path.name
        rows.append(r)
    return rows


def merge(paths: list[Path], mixed_shapes: bool = False) -> tuple[list[dict], list[str]]:
    """All rows of the records, in order, and the table's lines with a heading. SystemExit
    ("error: ...") on a bad record or on records of different shapes (unless mixed_shapes)."""
    rows = [r for p in paths for r in load_rows(p)]
    if not rows:
        raise SystemExit(f"error: {', '.join(map(str, paths))}: no rows to merge")
    shapes = {}
    for r in rows:
        shapes.setdefault(shape_of(r), []).append(r["record"])
    if len(shapes) > 1 and not mixed_shapes:
        parts = [f"{describe_shape(next(r for r in rows if shape_of(r) == s))} ({', '.join(dict.fromkeys(files))})"
                 for s, files in shapes.items()]
        raise SystemExit(f"error: the records are of different shapes: {'; '.join(parts)}; merge records of one shape, "
                         "or pass --mixed-shapes")
    gpus = {r.get("gpu") or "CPU" for r in rows}
    extra = ("record",) + (("gpu",) if len(gpus) > 1 else ()) + (("shape",) if len(shapes) > 1 else ())
    where = f"{rows[0].get('world_size', 1)} x {gpus.pop()}" if len(gpus) == 1 else "several GPU models"
    versions = sorted({f"torch {r.get('torch')}, triton {r.get('triton')}" for r in rows if r.get("torch")})
    head = [f"{describe_shape(rows[0]) if len(shapes) == 1 else 'several shapes'} on {where}; "
            f"{len(rows)} rows from {len(paths)} record(s)" + (f"; {' / '.join(versions)}" if versions else ""), ""]
    return rows, head + table(rows, extra)


def merge_main(args) -> int:
    """--merge: print (and with --out write) the one table of the records' rows."""
    if args.override:
        return fail_code(f"--merge takes bench_step.py records, not Hydra overrides ({' '.join(args.override)})")
    if args.out is not None and args.out.suffix not in (".md", ".json"):
        return fail_code(f"--out {args.out}: with --merge, give a .md (the table) or a .json (the merged record) path")
    try:
        rows, lines = merge(args.merge, args.mixed_shapes)
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 2
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.suffix == ".md":
            args.out.write_text(text + "\n")
        else:
            args.out.write_text(json.dumps({"merged_from": [str(p) for p in args.merge], "results": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ffn-sweep", action="store_true", help="swiglu, srelu and srelu24 in one run")
    ap.add_argument("--ffns", default="", help="the variants to sweep, comma-separated (implies --ffn-sweep), "
                    "e.g. srelu,srelu24")
    ap.add_argument("--precisions", default="", metavar="LIST",
                    help=f"trainer.float8 values to cross with the FFNs, comma-separated, of {','.join(PRECISIONS)} "
                         "(none: bf16); default: the config's trainer.float8")
    ap.add_argument("--layers", type=int, default=0, help="cut the layer count (per-layer figures still hold)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="measure every row N times in interleaved rounds, the order reversed every other round "
                         "(at the power cap a step's clock follows what ran before it): each row reports its "
                         "median round, and each ratio to the fastest dense row also as the median of the rounds' own")
    ap.add_argument("--doc-len", type=int, default=1024, help="tokens per document of the random batches "
                    "(an end-of-text token every DOC_LEN; what model.attention=document masks at)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step and rank (gradient accumulation)")
    ap.add_argument("--weights", type=Path, metavar="CHECKPOINT",
                    help="start every row from this trainer checkpoint's weights (checkpoints/step_XXXXXXXX; the "
                         "config's model shape; srelu's serve srelu24 and back) instead of random init: trained "
                         "activations, as sparse as the run made them")
    ap.add_argument("--tokens", choices=("random", "data"), default="random",
                    help="random: uniform tokens with an end of text every --doc-len; data: the training split of "
                         "the config's data (prepared as train.py prepares it), with --weights the run's own text")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many steps: GPU kernel time per step and the top kernels")
    ap.add_argument("--profile-host", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many steps' host side: self CPU time per step by thread and "
                         "the costliest ops (where a step that waits on the host spends it)")
    ap.add_argument("--energy", type=float, default=0.0, metavar="SECONDS",
                    help="energy accounting: after timing, each piece of the step in a sustained loop of SECONDS "
                         "(NVML energy counter): ms and J per step by category (srelu, srelu24; GPU only)")
    ap.add_argument("--density", type=float, default=None,
                    help="--energy: fraction of positive FFN pre-activations in the pieces' inputs (default: "
                         "random init's 0.5; a trained model's is about 0.1)")
    ap.add_argument("--print-kernels", type=int, default=12, help=f"kernels printed per variant (the JSON keeps {PROFILE_KEPT})")
    ap.add_argument("--out", type=Path, help="the JSON record (default: benchmarks/results/bench_step.json); "
                    "with --merge: the merged table (.md) or record (.json)")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="no benchmark: one table of the rows of these records (their --out files)")
    ap.add_argument("--mixed-shapes", action="store_true",
                    help="--merge: merge records of different shapes (a shape column is added)")
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="only redraw the kernel-category figure of a saved --profile result, next to it")
    ap.add_argument("override", nargs="*", help="Hydra overrides, e.g. +experiment=sparse_1b")
    args = ap.parse_intermixed_args(argv)  # Hydra overrides may come before or after the flags
    if args.merge:
        return merge_main(args)
    args.out = args.out or ROOT / "benchmarks" / "results" / "bench_step.json"
    if args.doc_len <= 0 or args.accum <= 0 or args.steps <= 0 or args.rounds <= 0:
        ap.error(f"--doc-len, --accum, --steps and --rounds must be positive; got {args.doc_len}, {args.accum}, "
                 f"{args.steps}, {args.rounds}")
    if args.profile < 0 or args.profile_host < 0:
        ap.error(f"--profile and --profile-host count steps (0: none); got {args.profile}, {args.profile_host}")
    if args.rounds > 1 and (args.profile or args.profile_host or args.energy):
        ap.error("--rounds measures steps only: run --profile, --profile-host or --energy in a command of one round")
    if args.replot:
        print(f"wrote {plot_kernels(args.replot)}")
        return 0
    args.weights_vocab = None
    if args.weights:  # once, before any row: each row then reads only the model's weights
        if not is_checkpoint(args.weights):
            fail(f"--weights {args.weights}: not a checkpoint of this trainer (a <run>/checkpoints/step_XXXXXXXX directory)")
        try:
            verify_checkpoint(args.weights)
            args.weights_vocab = read_train_state(args.weights).get("model_shape", {}).get("vocab_size")
        except CheckpointError as e:
            fail(f"--weights: {e}")
    variants = ["swiglu", "srelu", "srelu24"] if args.ffn_sweep else [None]
    if args.ffns:
        variants = args.ffns.split(",")
        valid = list(FFN_REGISTRY)
        if bad := [v for v in variants if v not in valid]:
            ap.error(f"--ffns: unknown variant(s) {bad}; valid: {valid}")
    precisions = [None]  # the config's
    if args.precisions:
        precisions = args.precisions.split(",")
        if bad := [p for p in precisions if p not in PRECISIONS]:
            fail(f"--precisions: unknown value(s) {bad}; valid: a comma-separated list of {', '.join(PRECISIONS)}")
        if len(set(precisions)) < len(precisions):
            fail(f"--precisions {args.precisions}: a value is listed twice; list each of {', '.join(PRECISIONS)} once")
    cfgs = []
    for p in precisions:  # each precision's FFNs together, in the order given
        for v in variants:
            cfg = load_config(args.override + ([f"ffn={v}"] if v else []) + ([f"trainer.float8={p}"] if p else []))
            if v and cfg.ffn.kind != v:  # an experiment that overrides ffn: force the variant
                cfg.ffn.kind = v
            cfg.trainer.device = args.device
            cfg.trainer.compile = cfg.trainer.compile and not args.no_compile
            cfgs.append(cfg)
    d = setup(cfgs[0].trainer)  # the process group (torchrun, trainer.strategy), once for the sweep
    try:  # before any row: a precision this device cannot run is one line, not a traceback after other rows
        for recipe in dict.fromkeys(cfg.trainer.float8 for cfg in cfgs):
            float8_check(recipe, d.device)
    except ConfigError as e:
        shutdown(d)
        if d.is_main:
            print(f"error: {'--precisions' if args.precisions else 'trainer.float8'}: {e}", file=sys.stderr)
        return 2
    env = environment()
    if args.energy and d.device.type == "cuda":  # warm the card first: a cold one leaks less, which favours the first variant
        a = torch.randn(8192, 8192, device=d.device, dtype=torch.bfloat16)
        energy_during(lambda: a @ a, 10.0, d.device)
        del a
    def measure(cfg) -> dict:
        with inductor_settings_restored():
            row = {**bench(cfg, args, d), **row_environment(env, d.device)}
        if d.is_main:
            print(json.dumps(row), flush=True)
        return row

    try:
        rounds = interleaved_rounds(dict(enumerate(cfgs)), args.rounds, measure)
        results = [median_round(rows) for rows in rounds.values()]
    finally:
        shutdown(d)
    if d.is_main:
        report(args, results, d.device)
    return 0


def fail(message: str):
    raise SystemExit(fail_code(message))


def fail_code(message: str) -> int:
    """One line on stderr, from the first rank only under torchrun (every rank fails alike); exit 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    return 2


def label(r: dict) -> str:
    return f"{r['ffn']} {r['precision']}" if r.get("precision") else r["ffn"]


def print_energy(results: list[dict]) -> None:
    """The energy accounting side by side: per category, ms and J per step of the pieces' loops;
    then their sums against the measured step (its joules from NVML over the timed steps)."""
    e0 = results[0]["energy"]
    print(f"\nenergy accounting (each piece {e0['seconds_per_piece']} s in a sustained loop, x calls per step; "
          f"FFN input density {e0['density'] or 'of random init'}):")
    print("| category | " + " | ".join(f"{label(r)} ms | {label(r)} J" for r in results) + " |")
    print("|---|" + "---|---|" * len(results))
    for c in ENERGY_CATEGORIES:
        cells = [results_cat(r, c) for r in results]
        if any(ms for ms, _ in cells):
            print(f"| {c} | " + " | ".join(f"{ms:.2f} | {j:.2f}" for ms, j in cells) + " |")
    sums = [(sum(v["ms_per_step"] for v in r["energy"]["categories"].values()),
             sum(v["j_per_step"] for v in r["energy"]["categories"].values())) for r in results]
    print("| sum of the pieces | " + " | ".join(f"{ms:.1f} | {j:.1f}" for ms, j in sums) + " |")
    print("| measured step | " + " | ".join(f"{r['step_ms']:.1f} | {r.get('step_j', float('nan')):.1f}"
                                          for r in results) + " |")
    print("| step W, SM MHz | " + " | ".join(f"{r.get('clocks', {}).get('power_w', '-')} | "
                                           f"{r.get('clocks', {}).get('sm_clock_mhz', '-')}" for r in results) + " |")
    for r in results:
        print(f"\n{label(r)}: pieces (ms and mJ per call, W, SM MHz, calls per step)")
        for p in r["energy"]["pieces"]:
            mj = f"{p['mj_per_call']:.1f}" if p["mj_per_call"] is not None else "-"
            print(f"  {p['ms_per_call']:8.3f} ms {mj:>8} mJ {p['power_w'] or '-':>6} W {p['sm_clock_mhz'] or '-':>6} MHz "
                  f"x{p['calls_per_step']:<3} {p['category']:<24} {p['piece']}")


def results_cat(r: dict, category: str) -> tuple[float, float]:
    c = r["energy"]["categories"][category]
    return c["ms_per_step"], c["j_per_step"]


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


ROUND_KEYS = ("tokens_per_s", "step_ms", "step_j", "sm_clock_mhz", "power_w", "temp_c")


def median_round(rows: list[dict]) -> dict:
    """One row's measurements over the rounds: the round of median tokens/s (the lower of the two
    middle ones for an even count), with every round's figures under "rounds" in the order run."""
    if len(rows) == 1:
        return rows[0]
    mid = sorted(rows, key=lambda r: r["tokens_per_s"])[(len(rows) - 1) // 2]
    return {**mid, "rounds": [{k: r.get(k) for k in ROUND_KEYS} for r in rows]}


def round_ratios(results: list[dict]) -> list[str]:
    """Lines: each row's tokens/s over the fastest dense row's (`ratios`) within each round, and
    their median, the lower middle one for an even count as in `median_round`."""
    ref = ratios(results)["fastest dense"]
    if ref is None or not ref.get("rounds"):
        return []
    out = []
    for r in results:
        if r is not ref and r.get("rounds"):
            assert len(r["rounds"]) == len(ref["rounds"]), "every row runs in every round"
            each = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(r["rounds"], ref["rounds"])]
            out.append(f"{label(r)} / {label(ref)} in each of {len(each)} rounds: "
                       + ", ".join(f"{x:.3f}x" for x in each) + f"; median {statistics.median_low(each):.3f}x")
    return out


def report(args, results: list[dict], device: torch.device) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(), "argv": sys.argv,
                                    "environment": environment(), "results": results}, indent=2))
    r0 = results[0]
    cut = f", layers cut to {r0['n_layers']} of {r0['layers_cut_from']}" if r0["layers_cut_from"] else ""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    commit = f", commit {r0['commit']}{'+dirty' if r0.get('dirty') else ''}" if r0.get("commit") else ""
    print(f"\n{' '.join(args.override)} on {r0['world_size']} x {where} ({r0['strategy']}, micro-batch "
          f"{r0['micro_batch']} x {r0['seq_len']} per rank, accum {r0['accum']}{cut}{commit})")
    print("\n".join(table(results)))
    if any(r.get("rounds") for r in results):  # from the rows: report() also serves records made elsewhere
        n = max(len(r.get("rounds", ())) for r in results)
        print("\n".join(["", f"each row: its median of {n} interleaved rounds"] + round_ratios(results)))
    print(f"record: {args.out} (rows of several records in one table: python scripts/bench_step.py --merge A.json B.json)")
    if any(r.get("clocks", {}).get("samples") for r in results):
        print("\nclocks over the timed steps (NVML medians; joules from its energy counter): "
              + "; ".join(f"{label(r)} {r['clocks'].get('sm_clock_mhz')} MHz, {r['clocks'].get('power_w')} W, "
                          f"{r.get('step_j', float('nan')):.1f} J/step"
                          + (f", GPU busy {r['clocks']['gpu_busy_pct']:.0f}%" if r["clocks"].get("gpu_busy_pct") is not None
                             else "") for r in results if r.get("clocks")))
    if any(r.get("energy") for r in results):
        print_energy([r for r in results if r.get("energy")])
    if any(r.get("top_kernels") for r in results):
        print(f"wrote {plot_kernels(args.out)}")
    for r in results:
        if r.get("top_host_ops"):
            threads = ", ".join(f"{ms:.1f}" for ms in r["host_self_ms_per_step_by_thread"][:3])
            print(f"\n{label(r)}: host ops' self CPU time {r['host_self_ms_per_step']:.1f} ms a step (by thread: "
                  f"{threads}) over a profiled step of {r['host_wall_ms_per_step']:.1f} ms; costliest (self ms, calls "
                  "per step):")
            for name, ms, n in r["top_host_ops"][:args.print_kernels]:
                print(f"  {ms:8.3f} {n:6.1f}  {name}")
    for r in results:
        if r.get("top_kernels"):
            print(f"\n{label(r)}: kernels running {r['kernel_busy_ms_per_step']:.1f} ms of a "
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
