"""Compare runs: a table (one row per run), the time each run took to reach a validation loss,
and plots, from run directories or multirun directories.

    python scripts/compare.py runs/demo/multirun_2026-11-29_21-00-00       # every job of a sweep
    python scripts/compare.py runs/a runs/b --out reports/a_vs_b --baseline srelu
    python scripts/compare.py runs/study_speed/multirun_<date> --target-loss 4.5 --baseline "swiglu bf16"

Writes to <out> (default: <first input>/report): summary.md (the run table, then the time-to-loss
table, then the gaps within each seed where seeds pair up), summary.csv (one row per run, both
tables' columns), layers.csv (last per-layer statistics) and plots: validation and training loss against tokens (val_loss.png,
train_loss.png), against training hours (val_loss_time.png, train_loss_time.png) and against
GPU-hours (val_loss_gpu_hours.png, train_loss_gpu_hours.png), val_loss_delta.png (gap to
--baseline), throughput.png (ratios vs --baseline), sparsity_heatmap_<run>.png. The tables are
also printed. With wandb on (--wandb; by default when the runs logged to wandb), the plots and
tables also go to wandb as one run of job_type "report" in the runs' group (offline: written
under <out>/wandb; `wandb sync` uploads it).

A run's label is its FFN, plus its precision (trainer.float8: tensorwise, rowwise; bf16 without,
fp32 on CPU) when the runs differ in precision, plus its seed when runs of one label differ in
seed. metrics.jsonl is the source of truth. Throughput and MFU are medians over the log intervals
after the first ~10% (at least the first one), which include warm-up and compilation; srelu24's
tokens/s are also given for each phase apart (dense warmup, 2:4), each without its first interval.
Where the trainer logged NVML's readings (a CUDA GPU with nvidia-ml-py), the SM clock, the power
and the energy per token (each interval's joules from the card's energy counter over its tokens,
or, in runs logged before the trainer recorded joules, its median power over its tokens/s, those
readings covering its evaluations too; srelu24's 2:4 phase apart) are medians over the same intervals: on a power-capped GPU the
variant that draws more power per cycle runs at a lower clock, so tokens/s follows energy per
token. GPU busy is NVML's utilisation, the share of time some kernel ran: under 100% the step
waited on the host (or the data), and its power sits below the cap.

Time (--time): each log row's tokens/s covers the training steps since the previous log row, and
neither evaluation nor checkpoints (training/metrics.py pauses its interval for them), so
  steady  (default) sums the log intervals' times (tokens / tokens/s), except one-off intervals,
          counted at their phase's median tokens/s: each phase's first (compilation; srelu24's
          switch to 2:4) and any under half that median (a recompilation, e.g. for the first logged
          step's statistics): the time a long run takes per token, one-off costs left out;
  train   sums the log intervals' times as measured, compilation included;
  elapsed is the logged elapsed_s: wall-clock from the first step, evaluation, checkpoints and
          compilation included (a resumed run continues its clock from its checkpoint).
GPU-hours = hours x the run's world size (run_info.json). Time to reach a loss L: the first
logged point at or below L, interpolated linearly (in time, tokens and steps) from the logged
point before it; validation loss by default (--target-metric train: the training loss, which
is noisier: one batch). L defaults to the worst run's final value. Runs of one FFN and
precision that differ only in seed give the run-to-run spread: final losses closer to the best
than that spread are marked as ties. Where two or more seeds each hold the baseline's
configuration (FFN, precision and ffn settings) and another, summary.md also gives each
configuration's final loss minus the baseline's within each seed, and its time to the baseline's
final loss of each seed: a seed moves every FFN's loss together, so a gap of one sign in every
seed can be settled where the seed spread is wider than the gap (runs of one configuration and
seed, where there are several, show what is left).
"""
import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

import numpy as np
from matplotlib.ticker import MaxNLocator
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from training.plots import close, layer_heatmap, plt  # noqa: E402

WARMUP_FRACTION = 0.1
ONE_OFF_BELOW = 0.5  # steady time: an interval under this fraction of its phase's median tokens/s held a one-off
TIME_BASES = ("steady", "train", "elapsed")
TIME_AXIS = {"steady": "training hours (compilation excluded)", "train": "training hours",
             "elapsed": "wall-clock hours (evaluation and checkpoints included)"}
TIME_MEANING = {
    "steady": "training time: the log intervals summed (evaluation and checkpoints excluded), one-off intervals "
              "(each phase's first: compilation, srelu24's switch to 2:4; any under half the phase's median "
              "tokens/s: a recompilation) counted at the phase's median tokens/s",
    "train": "training time: the log intervals summed as measured (evaluation and checkpoints excluded, "
             "compilation included)",
    "elapsed": "wall-clock time from the first step (elapsed_s: evaluation, checkpoints and compilation included)"}
METRICS = {"val": ("val_loss", "validation loss"), "train": ("loss", "training loss")}


def natural(p: Path) -> list:
    """Sort key: multirun job 10_x after 9_x."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for p in paths:
        found = [p] if (p / "metrics.jsonl").is_file() else sorted(
            (d.parent for d in p.glob("*/metrics.jsonl")), key=natural)
        runs += [r for r in found if r.resolve() not in {x.resolve() for x in runs}]
    return runs


def read_metrics(run: Path) -> list[dict]:
    """Rows by step; a resumed run appends from its checkpoint, so a repeated step keeps its last row."""
    by_step = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # blank, or a line cut short by a crash
            continue
        by_step[row.get("step", len(by_step))] = row
    return [by_step[s] for s in sorted(by_step)]


def run_config(run: Path):
    """The run's config (config_resolved.yaml, else Hydra's .hydra/config.yaml), or None."""
    for name in ("config_resolved.yaml", ".hydra/config.yaml"):
        if (run / name).is_file():
            return OmegaConf.load(run / name)
    return None


def variant_of(run: Path, cfg=None) -> str:
    cfg = run_config(run) if cfg is None else cfg
    kind = OmegaConf.select(cfg, "ffn.kind", default=None) if cfg is not None else None
    return "?" if kind is None else str(kind)


def precision_of(cfg, info: dict) -> Optional[str]:
    """trainer.float8's recipe, or without one the GEMMs' dtype (bf16 autocast on GPUs, fp32 on CPU,
    as trainer.precision=auto picks); None without a config."""
    if cfg is None:
        return None
    recipe = str(OmegaConf.select(cfg, "trainer.float8", default=None) or "none")
    if recipe != "none":
        return recipe
    precision = str(OmegaConf.select(cfg, "trainer.precision", default="auto"))
    on_gpu = str(info.get("device", "")).startswith("cuda")
    return "bf16" if precision == "bf16" or (precision == "auto" and on_gpu) else "fp32"


def wandb_of(cfg) -> Optional[dict]:
    """Where the run's wandb run went (logging.wandb; its group defaults to the experiment's name)."""
    if cfg is None:
        return None
    w = OmegaConf.select(cfg, "logging.wandb", default=None)
    if w is None:
        return None
    return {"mode": str(w.get("mode", "offline")), "project": w.get("project"), "entity": w.get("entity"),
            "group": w.get("group") or OmegaConf.select(cfg, "name", default=None)}


def steady(values: list) -> list:
    """Drop the first ~10% of log intervals (at least one, when there are more than one)."""
    skip = max(1, math.ceil(WARMUP_FRACTION * len(values))) if len(values) > 1 else 0
    return values[skip:]


def median(values: list):
    return statistics.median(values) if values else None


def phase(row: dict) -> int:
    """1 in srelu24's 2:4 phase, else 0 (dense: its warmup, and every other variant)."""
    return 1 if row.get("mode_2to4") == 1 else 0


def phase_medians(timed: list[dict], value=lambda r: r.get("tokens_per_s")) -> dict:
    """Median `value` (tokens/s by default) of each phase's log intervals after its first
    (compilation; the switch to 2:4 and its recompilation): {0: dense, 1: 2:4}, None for a phase
    with fewer than two intervals."""
    timed = [r for r in timed if finite(r.get("tokens_per_s"))]
    per_phase = {p: [value(r) for r in timed if phase(r) == p][1:] for p in (0, 1)}
    return {p: median([v for v in values if finite(v)]) for p, values in per_phase.items()}


def logged_median(rows: list[dict], key: str):
    """Median of a field over the rows that logged it (NVML's readings are absent without a GPU)."""
    return median([r[key] for r in rows if finite(r.get(key))])


def mj_per_token(row: dict, gpus: int = 1) -> Optional[float]:
    """A log interval's energy per token in mJ, per GPU over that GPU's share of the tokens: the
    trainer's, from the card's energy counter (gpu_mj_per_token), else the logging GPU's median
    power over its share of tokens/s (None without NVML's readings)."""
    if finite(row.get("gpu_mj_per_token")):
        return row["gpu_mj_per_token"]
    w, rate = row.get("gpu_power_w"), row.get("tokens_per_s")
    return 1000 * w * gpus / rate if finite(w) and finite(rate) and rate > 0 else None


def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def training_seconds(rows: list[dict], basis: str = "steady") -> list[float]:
    """Seconds of training at each row of `rows` (in step order, as read_metrics gives them), by
    --time's basis (the module's docstring). A row without its own time (an evaluation off the log
    steps, a row without elapsed_s) takes the time interpolated in step between its neighbours'."""
    known = {}
    if basis == "elapsed":
        known = {i: r["elapsed_s"] for i, r in enumerate(rows) if finite(r.get("elapsed_s"))}
    else:
        timed = [(i, r) for i, r in enumerate(rows) if finite(r.get("tokens_per_s")) and r["tokens_per_s"] > 0
                 and "tokens" in r]
        medians = phase_medians([r for _, r in timed])
        seconds, tokens, started = 0.0, 0, set()
        for i, r in timed:
            rate, usual = r["tokens_per_s"], medians[phase(r)]
            if basis == "steady" and usual and (phase(r) not in started or rate < ONE_OFF_BELOW * usual):
                rate = usual  # a one-off interval (compilation, recompilation) at its phase's usual speed
            started.add(phase(r))
            seconds += max(r["tokens"] - tokens, 0) / rate
            tokens = r["tokens"]
            known[i] = seconds
    if not known:
        return [math.nan] * len(rows)
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    xs = [steps[i] for i in sorted(known)]
    ys = [known[i] for i in sorted(known)]
    return [known[i] if i in known else float(np.interp(steps[i], xs, ys)) for i in range(len(rows))]


def reach(points: list[tuple[float, dict]], target: float) -> Optional[dict]:
    """Where a curve first reaches `target`: points are (loss, {"hours": .., "gpu_hours": .., "tokens":
    .., "step": ..}) in step order. The first point at or below the target, interpolated linearly
    (every coordinate) from the point before it; the first point itself if it is already there;
    None if no point is."""
    points = [(loss, at) for loss, at in points if finite(loss)]
    for i, (loss, at) in enumerate(points):
        if loss <= target:
            if i == 0:
                return dict(at)
            before, was = points[i - 1]
            f = (before - target) / (before - loss)
            return {k: was[k] + f * (at[k] - was[k]) for k in at}
    return None


def summarize(run: Path, basis: str = "steady") -> dict:
    rows = read_metrics(run)
    info = json.loads((run / "run_info.json").read_text()) if (run / "run_info.json").is_file() else {}
    cfg = run_config(run)
    params = info.get("params", {})
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    timed = [r for r in train if "tokens_per_s" in r]
    window = steady(timed)
    variant = variant_of(run, cfg)
    # srelu24: each phase alone (intervals logged with 2:4 off / on, after each phase's first:
    # compilation, and the switch to 2:4)
    speeds = phase_medians(timed)
    sparsity = [r["layers"]["act_sparsity"] for r in rows if r.get("layers", {}).get("act_sparsity")]
    mem = [r["mem_allocated_gib"] for r in rows if "mem_allocated_gib" in r]
    gpus = int(info.get("world_size") or 1)
    for m, seconds in zip(rows, training_seconds(rows, basis)):
        m["_hours"], m["_gpu_hours"] = seconds / 3600, seconds * gpus / 3600
    seed = OmegaConf.select(cfg, "trainer.seed", default=None) if cfg is not None else None
    return {
        "run": run.name, "variant": variant, "precision": precision_of(cfg, info), "seed": seed, "gpus": gpus,
        "cuda_graph": bool(OmegaConf.select(cfg, "trainer.cuda_graph", default=False)) if cfg is not None else False,
        "ffn_stats_every": OmegaConf.select(cfg, "trainer.ffn_stats_every", default=0) if cfg is not None else 0,
        "params": params.get("total"), "non_embedding": params.get("non_embedding"),
        "tokens": rows[-1]["tokens"] if rows else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "tokens_per_s": median([r["tokens_per_s"] for r in window]),
        "tokens_per_s_dense": speeds[0] if variant == "srelu24" else None,
        "tokens_per_s_24": speeds[1],
        "mfu": median([r["mfu"] for r in window if "mfu" in r]),
        "sm_clock_mhz": logged_median(window, "gpu_sm_clock_mhz"),
        "power_w": logged_median(window, "gpu_power_w"),
        "gpu_busy_pct": logged_median(window, "gpu_busy_pct"),
        "mj_per_token": median([e for e in (mj_per_token(r, gpus) for r in window) if e is not None]),
        "mj_per_token_24": phase_medians(timed, lambda r: mj_per_token(r, gpus))[1],
        "act_sparsity": statistics.fmean(sparsity[-1]) if sparsity else None,
        "peak_mem_gib": max(mem) if mem else None,
        "hours": rows[-1]["_hours"] if rows else None,
        "gpu_hours": rows[-1]["_gpu_hours"] if rows else None,
        "time_basis": basis,
        "_wandb": wandb_of(cfg),
        "_ffn": json.dumps(OmegaConf.to_container(cfg.ffn, resolve=True), sort_keys=True)
        if cfg is not None and OmegaConf.select(cfg, "ffn") is not None else None,
        "_rows": rows,
    }


def time_to_target(r: dict, target: float, metric: str = "val") -> dict:
    """The run's hours, GPU-hours, tokens and step at which its `metric` first reached `target`
    (None each, and reached False, if it never did)."""
    key = METRICS[metric][0]
    at = reach([(m[key], {"hours": m["_hours"], "gpu_hours": m["_gpu_hours"], "tokens": m["tokens"],
                          "step": m.get("step", 0)}) for m in r["_rows"] if key in m and "tokens" in m], target)
    at = at or {}
    return {"target_loss": target, "target_metric": metric, "reached": bool(at),
            "hours_to_target": at.get("hours"), "gpu_hours_to_target": at.get("gpu_hours"),
            "tokens_to_target": at.get("tokens"), "step_to_target": at.get("step")}


def seed_spreads(rows: list[dict], key: str) -> list[dict]:
    """Runs of one label kind (FFN and precision) that differ in seed: the spread (max - min) of
    their final `key` and, where all reached the target, of their GPU-hours to it."""
    groups = {}
    for r in rows:
        if r.get("seed") is not None and finite(r.get(key)):
            groups.setdefault(r["kind"], []).append(r)
    out = []
    for kind, g in groups.items():
        if len({x["seed"] for x in g}) > 1:
            values = [x[key] for x in g]
            times = [x.get("gpu_hours_to_target") for x in g]
            out.append({"kind": kind, "runs": [x["label"] for x in g], "spread": max(values) - min(values),
                        "gpu_hours_spread": (max(times) - min(times)) / min(times)
                        if all(finite(t) and t > 0 for t in times) else None})
    return out


def _seed_order(seed):
    return (0, seed, "") if isinstance(seed, (int, float)) else (1, 0, str(seed))


def seed_pairs(rows: list[dict], base: dict, metric: str = "val") -> Optional[dict]:
    """Each configuration's final loss (`metric`) minus the baseline's within each seed, and its
    time to the baseline's final loss of that seed, where at least two seeds hold the baseline's
    configuration and another: a seed fixes the initialization and the data order, which move
    every FFN's loss together, so the paired gap leaves out what the seed spread is made of. A
    configuration is a kind (FFN, precision) with its ffn settings: ablations of one kind stay
    apart. Several runs of one configuration and seed are averaged; their largest difference is
    what is left within a seed. None where the runs give no such pairing."""
    key = "final_val_loss" if metric == "val" else "final_loss"

    def unit(r):
        return r["kind"], r.get("_ffn")

    names = {}
    for r in rows:
        several = len({unit(x) for x in rows if x["kind"] == r["kind"]}) > 1
        names.setdefault(unit(r), re.sub(r"_seed\d+$", "", r["choice"]) if several else r["kind"])  # its first run's
    cells = {}
    for r in rows:
        if r.get("seed") is not None and finite(r.get(key)):
            cells.setdefault((unit(r), r["seed"]), []).append(r)
    b = unit(base)
    seeds = sorted({s for u, s in cells if u == b}, key=_seed_order)
    target = {s: statistics.fmean(r[key] for r in cells[(b, s)]) for s in seeds}
    gaps, times = {}, {}
    for u in dict.fromkeys(unit(r) for r in rows):
        at = [s for s in seeds if (u, s) in cells]
        if u != b and len(at) < 2:
            continue
        if u != b:
            gaps[names[u]] = (u, {s: statistics.fmean(r[key] for r in cells[(u, s)]) - target[s] for s in at})
        # hours and GPU-hours to the baseline's final loss of the seed: means over the runs, None if one never got there
        got = {s: [time_to_target(r, target[s], metric) for r in cells[(u, s)]] for s in at}
        times[names[u]] = {s: (statistics.fmean(x["hours_to_target"] for x in g),
                               statistics.fmean(x["gpu_hours_to_target"] for x in g))
                           if all(x["reached"] for x in g) else None for s, g in got.items()}
    if not gaps:
        return None
    reruns = [max(x[key] for x in v) - min(x[key] for x in v) for v in cells.values() if len(v) > 1]
    return {"base": names[b], "base_unit": b, "seeds": seeds, "gaps": gaps, "times": times, "targets": target,
            "runs": {c: len(v) for c, v in cells.items()}, "rerun_spread": max(reruns) if reruns else None}


def seed_pairs_table(pairs: dict, name: str) -> list[str]:
    """Markdown: one row per configuration, its gap to the baseline's in each seed, the mean over
    the seeds it ran at, and whether every one of them puts it on the same side; then each
    configuration's time to the baseline's final loss in each seed."""
    seeds, base = pairs["seeds"], pairs["base"]
    out = [f"## Final {name} against {base}, within each seed", "",
           "A seed fixes the initialization and the data order, which move every run's loss together: the gap "
           f"to {base} in the same seed leaves that out. Where one configuration ran several times at a seed, "
           "its runs (and the baseline's) are averaged: (n runs) counts them.", "",
           "| " + " | ".join(["run"] + [f"seed {s}" for s in seeds] + ["mean", "every seed"]) + " |",
           "|" + "---|" * (len(seeds) + 3)]
    rerun = pairs["rerun_spread"]
    for kind, (u, g) in pairs["gaps"].items():
        cells = []
        for s in seeds:
            n, nb = pairs["runs"].get((u, s), 0), pairs["runs"].get((pairs["base_unit"], s), 0)
            runs = f" ({n} runs)" if n > 1 else ""
            runs += f" ({base}: {nb} runs)" if nb > 1 else ""
            cells.append("-" if s not in g else f"{g[s]:+.4f}{runs}")
        values = list(g.values())
        side = "lower" if all(v < 0 for v in values) else "higher" if all(v > 0 for v in values) else "mixed"
        if side != "mixed" and rerun is not None and min(abs(v) for v in values) <= rerun:
            side += ", within the spread of one seed's runs in some seed"
        out.append("| " + " | ".join([kind] + cells + [f"{statistics.fmean(values):+.4f}", side]) + " |")
    out.append("")
    out.append(f"Runs of one configuration and seed differ by up to {rerun:.4f}: a gap within that in some seed "
               "is not settled by that seed." if rerun is not None else
               "No configuration ran twice at one seed: nothing shows what is left within a seed.")
    heads = [f"seed {s}: to {pairs['targets'][s]:.4f}" for s in seeds]
    out += ["", f"### Time to {base}'s final {name} within each seed", "",
            f"Time (the basis above) and GPU-hours to the {name} {base} ended at in that seed, and {base}'s "
            "GPU-hours over the run's (above 1: sooner).", "", "| " + " | ".join(["run"] + heads) + " |", "|" + "---|" * (len(seeds) + 1)]
    own = pairs["times"][base]
    for kind, t in pairs["times"].items():
        cells = []
        for s in seeds:
            if s not in t:
                cells.append("-")
            elif t[s] is None:
                cells.append("not reached")
            else:
                hours, gpu_hours = t[s]
                ratio = f" ({own[s][1] / gpu_hours:.2f}x)" if own.get(s) and gpu_hours > 0 else ""
                cells.append(f"{_duration(hours)}, {_gpu_hours(gpu_hours)} GPU-hours{ratio}")
        out.append("| " + " | ".join([kind] + cells) + " |")
    return out


# key, header, format of a present value ("-" when absent)
COLUMNS = [("run", "run", str), ("variant", "variant", str), ("precision", "precision", str),
           ("params", "params", "{:,}".format), ("non_embedding", "non-emb params", "{:,}".format),
           ("tokens", "tokens", "{:,}".format), ("final_loss", "final train loss", "{:.4f}".format),
           ("final_val_loss", "final val loss", "{:.4f}".format),
           ("val_vs_baseline", "val loss vs baseline", "{:+.2%}".format),
           ("tokens_per_s", "tokens/s (steady median)", "{:,.0f}".format),
           ("tokens_per_s_dense", "tokens/s (srelu24 dense warmup median)", "{:,.0f}".format),
           ("tokens_per_s_24", "tokens/s (2:4 phase median)", "{:,.0f}".format), ("mfu", "MFU", "{:.1%}".format),
           ("sm_clock_mhz", "SM clock (MHz)", "{:.0f}".format), ("power_w", "power (W)", "{:.0f}".format),
           ("gpu_busy_pct", "GPU busy (%)", "{:.0f}".format),
           ("mj_per_token", "mJ/token", "{:.2f}".format), ("mj_per_token_24", "mJ/token (2:4 phase)", "{:.2f}".format),
           ("act_sparsity", "act sparsity (mean)", "{:.3f}".format),
           ("peak_mem_gib", "peak mem alloc (GiB)", "{:.2f}".format)]
# summary.csv's further columns: the time-to-loss table's, and what a row is (label, seed, GPUs)
CSV_EXTRA = ["label", "seed", "gpus", "time_basis", "hours", "gpu_hours", "target_metric", "target_loss", "reached",
             "hours_to_target", "gpu_hours_to_target", "tokens_to_target", "step_to_target"]


def absent(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join("-" if absent(r[k]) else f(r[k]) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def write_csv(rows: list[dict], path: Path) -> None:
    keys = [k for k, _, _ in COLUMNS] + CSV_EXTRA
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        w.writerows(["" if absent(r.get(k)) else r[k] for k in keys] for r in rows)


def _duration(hours) -> str:
    if not finite(hours):
        return "-"
    return f"{hours:.2f} h" if hours >= 1 else f"{60 * hours:.1f} min" if hours >= 1 / 60 else f"{3600 * hours:.0f} s"


def _gpu_hours(v) -> str:
    return "-" if not finite(v) else f"{v:.3g}"


def time_table(rows: list[dict], base: dict, metric: str, target: float, target_from: str,
               paired: bool = False) -> list[str]:
    """Markdown: the heading, what time means, then one row per run, soonest to reach the target
    first (GPU-hours), the runs that never did last (lowest final loss first)."""
    key, name = METRICS[metric]
    final = "final_val_loss" if metric == "val" else "final_loss"
    basis = rows[0]["time_basis"]
    spreads = seed_spreads(rows, final)
    tie = max((s["spread"] for s in spreads), default=None)
    best = min((r[final] for r in rows if finite(r.get(final))), default=None)
    b = base.get("gpu_hours_to_target")
    out = [f"## Time to reach {name} {target:.4f} ({target_from})", "",
           f"Time is {TIME_MEANING[basis]} (--time {basis}). GPU-hours: time x GPUs. Interpolated linearly between the "
           f"two logged {name} points around the target" + (" (validation: every trainer.eval_every steps)."
                                                              if metric == "val" else " (one batch each: noisy)."), ""]
    head = ["run", "GPUs", "time to target", "GPU-hours to target", f"vs {base['label']} (GPU-hours)",
            "tokens to target", "step to target", f"final {name}", "vs best final", "time in all", "GPU-hours in all"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(rows, key=lambda r: (not r.get("reached"), r.get("gpu_hours_to_target") or 0,
                                        r[final] if finite(r.get(final)) else math.inf))
    for r in order:
        v = r.get(final)
        gap = "-" if not (finite(v) and finite(best)) else "best" if v == best else f"{v - best:+.4f}"
        if finite(v) and finite(best) and tie is not None and v != best and v - best <= tie:
            gap += " (tie)"
        if r.get("reached"):
            t = r["gpu_hours_to_target"]
            cells = [_duration(r["hours_to_target"]), _gpu_hours(t), f"{b / t:.2f}x" if finite(b) and t > 0 else "-",
                     f"{r['tokens_to_target']:,.0f}", f"{r['step_to_target']:.0f}"]
        else:
            cells = [f"not reached (final {v:.4f})" if finite(v) else "no " + name, "-", "-", "-", "-"]
        out.append("| " + " | ".join([r["label"], str(r["gpus"])] + cells + [
            "-" if not finite(v) else f"{v:.4f}", gap, _duration(r.get("hours")), _gpu_hours(r.get("gpu_hours"))]) + " |")
    out += ["", f"vs {base['label']}: its GPU-hours to the target over the run's (above 1: the run gets there sooner)."]
    for s in spreads:
        t = f"; their GPU-hours to the target differ by {s['gpu_hours_spread']:.1%}" if s["gpu_hours_spread"] is not None \
            else ""
        out.append(f"Seed spread, {s['kind']} ({', '.join(s['runs'])}): final {name} differs by {s['spread']:.4f}{t}.")
    if tie is not None:
        out.append(f"Final losses within {tie:.4f} of the best (the largest seed spread) are marked as ties"
                   + ("; the gaps within each seed below are the finer test." if paired else "."))
    else:
        out.append("No two runs of one FFN and precision differ only in seed: no run-to-run spread to judge ties by.")
    return out


def write_layers_csv(rows: list[dict], path: Path) -> None:
    """The last logged per-layer statistics of each run: one row per run, statistic and layer."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "label", "step", "statistic", "layer", "value"])
        for r in rows:
            last = next((m for m in reversed(r["_rows"]) if m.get("layers")), None)
            for stat, values in (last or {}).get("layers", {}).items():
                w.writerows([r["run"], r["label"], last["step"], stat, i, v] for i, v in enumerate(values))


def label_runs(rows: list[dict]) -> None:
    """Names unique across inputs (file names) and labels: the variant, with its precision when the
    runs' precisions differ ("srelu24 tensorwise": the row's `kind`) and "graphed" when some ran with
    trainer.cuda_graph and some without (the same losses, other speeds: never one configuration), and
    "stats/N" when graphed runs differ in trainer.ffn_stats_every (N: how often a step runs eagerly);
    where a kind repeats, its seed when that tells the runs apart, else the sweep choice, else the run."""
    for r in rows:
        clash = sum(x["run"] == r["run"] for x in rows) > 1
        r["name"] = f"{r['_dir'].parent.name}_{r['run']}" if clash else r["run"]
    for r in rows:
        # a multirun job dir is "<job number>_<choice>" (e.g. 3_srelu24_no_permutation): the choice
        # names an ablation better than the FFN kind does
        r["choice"] = re.sub(r"^\d+_", "", r["run"])
    mixed = len({r.get("precision") for r in rows}) > 1
    graphs_mixed = len({bool(r.get("cuda_graph")) for r in rows}) > 1
    stats_mixed = len({r.get("ffn_stats_every") or 0 for r in rows if r.get("cuda_graph")}) > 1
    for r in rows:
        r["kind"] = f"{r['variant']} {r['precision']}" if mixed and r.get("precision") else r["variant"]
        if graphs_mixed and r.get("cuda_graph"):
            r["kind"] += " graphed"
        if stats_mixed and r.get("cuda_graph"):
            r["kind"] += f" stats/{r.get('ffn_stats_every') or 'log'}"
    for r in rows:
        same = [x for x in rows if x["kind"] == r["kind"]]
        seeds = {x.get("seed") for x in same}
        choice_unique = sum(x["choice"] == r["choice"] for x in rows) == 1 and r["choice"] != r["run"]
        if len(same) == 1:
            r["label"] = r["kind"]
        elif None not in seeds and len(seeds) == len(same):
            r["label"] = f"{r['kind']} seed {r['seed']}"
        elif choice_unique:
            r["label"] = r["choice"]
        else:
            r["label"] = f"{r['kind']} ({r['name']})"


def _finish(fig, ax, path: Path, drawn: bool) -> bool:
    """Grid, legend and save a line plot when something was drawn; close it either way."""
    if drawn:
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    close(fig)
    return drawn


def line_plot(rows: list[dict], y: str, x: str, xlabel: str, ylabel: str, path: Path,
              target: Optional[float] = None) -> bool:
    """y against x, a line per run (color by the run's position, the same in every plot); a dashed
    line at `target`."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for i, r in enumerate(rows):
        pts = [(m[x], m[y]) for m in r["_rows"] if y in m and x in m and finite(m[x]) and finite(m[y])]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, ms=3, color=f"C{i % 10}", label=r["label"])
            drawn = True
    if drawn:
        if target is not None:
            ax.axhline(target, color="0.4", lw=0.8, ls="--", label=f"target {target:.4f}")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{ylabel} vs {xlabel}")
    return _finish(fig, ax, path, drawn)


def val_delta_plot(rows: list[dict], base: dict, path: Path) -> bool:
    """Validation loss minus the baseline's at the same step: the small gaps the full curves hide."""
    ref = {m["step"]: m["val_loss"] for m in base["_rows"] if "val_loss" in m}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for i, r in enumerate(rows):
        pts = [(m["tokens"], m["val_loss"] - ref[m["step"]]) for m in r["_rows"]
               if "val_loss" in m and m.get("step") in ref]
        if r is not base and len(pts) > 1:
            ax.plot(*zip(*pts), marker="o", ms=3, color=f"C{i % 10}", label=r["label"])
            drawn = True
    if drawn:
        ax.axhline(0, color="k", lw=0.8, label=base["label"])
        ax.set(xlabel="tokens", ylabel=f"validation loss - {base['label']}'s",
               title=f"validation loss relative to {base['label']}")
    return _finish(fig, ax, path, drawn)


def throughput_plot(rows: list[dict], path: Path, base_index: int = 0) -> bool:
    speeds = [0.0 if absent(r["tokens_per_s"]) else r["tokens_per_s"] for r in rows]
    if not any(speeds):
        return False
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(rows) + 2), 4.5))
    bars = ax.bar(range(len(rows)), speeds, color=[f"C{i % 10}" for i in range(len(rows))])
    tilt = len(rows) > 3
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=20 if tilt else 0,
                  ha="right" if tilt else "center")
    base = speeds[base_index]
    for bar, s in zip(bars, speeds):
        note = f"{s:,.0f}" + (f"\n{s / base:.2f}x" if base else "")
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, s), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="tokens/s (steady-state median)", title=f"throughput (ratio vs {rows[base_index]['label']})")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    close(fig)
    return True


def heatmap(r: dict, path: Path) -> bool:
    hist = [(m["tokens"], m["layers"]["act_sparsity"]) for m in r["_rows"] if m.get("layers", {}).get("act_sparsity")]
    if not hist:
        return False
    fig = layer_heatmap([t for t, _ in hist], [v for _, v in hist], f"activation sparsity per layer: {r['label']}")
    fig.axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    fig.savefig(path, dpi=120)
    close(fig)
    return True


def wandb_mode(flag: str, rows: list[dict]) -> str:
    """--wandb auto: offline when any run logged to wandb (online or offline), unless WANDB_MODE is
    disabled; disabled otherwise. Never online unless asked: the report needs no network."""
    if flag != "auto":
        return flag
    if os.environ.get("WANDB_MODE", "").lower() == "disabled":
        return "disabled"
    logged = [r for r in rows if r.get("_wandb") and r["_wandb"]["mode"] != "disabled"]
    return "offline" if logged else "disabled"


def wandb_report(rows: list[dict], out: Path, plots: list[str], tables: dict, mode: str, config: dict) -> str:
    """One wandb run of job_type "report" in the runs' group (the first run's project, entity and
    group: training/logger.py's), holding the plots as images and the tables. Returns a line
    saying where it went."""
    import wandb

    where = next((r["_wandb"] for r in rows if r.get("_wandb")), {"project": "srelu24", "entity": None, "group": None})
    groups = sorted({str(r["_wandb"]["group"]) for r in rows if r.get("_wandb")})
    run = wandb.init(project=where["project"], entity=where["entity"], group=where["group"], job_type="report",
                     name="report" if out.name == "report" else f"report {out.name}", dir=str(out), mode=mode,
                     config=config,
                     settings=wandb.Settings(console="off", quiet=True, silent=True))
    logged = {f"report/{Path(p).stem}": wandb.Image(str(out / p)) for p in plots}
    for name, (columns, data) in tables.items():
        logged[f"report/{name}"] = wandb.Table(columns=columns, data=data)
    run.log(logged)
    run.finish()
    note = f"; the runs are in {len(groups)} groups ({', '.join(groups)}), the report went to the first" \
        if len(groups) > 1 else ""
    sync = f"; upload it with: wandb sync {out / 'wandb'}/offline-run-*" if mode == "offline" else ""
    return f"wandb: report run {run.id}, group {where['group']}, project {where['project']}, {mode}{sync}{note}"


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="run directories or multirun directories")
    ap.add_argument("--out", type=Path, help="where tables and plots go (default: <first path>/report)")
    ap.add_argument("--baseline", help="label, run name or \"<ffn> <precision>\" that ratios and loss gaps "
                    "are taken against (default: the first run)")
    ap.add_argument("--target-loss", type=float, metavar="L",
                    help="the loss whose time to reach is tabled (default: the worst run's final value)")
    ap.add_argument("--target-metric", choices=list(METRICS), default="val",
                    help="the loss the target is of: val (validation, every eval_every steps; default) or train "
                         "(one batch per log step: noisier)")
    ap.add_argument("--time", choices=TIME_BASES, default="steady",
                    help="what time means on the time axes and in the time-to-loss table (the docstring above)")
    ap.add_argument("--wandb", choices=["auto", "offline", "online", "disabled"], default="auto",
                    help="the report in wandb: auto (offline when the runs logged to wandb, unless "
                         "WANDB_MODE=disabled), offline, online (needs the network), disabled")
    args = ap.parse_args(argv)
    if args.target_loss is not None and not math.isfinite(args.target_loss):
        return fail(f"--target-loss {args.target_loss}: give a finite loss, e.g. --target-loss 4.5")
    runs = find_runs(args.paths)
    if not runs:
        return fail(f"no run (a directory with metrics.jsonl) in {' '.join(map(str, args.paths))}")
    rows = [{**summarize(r, args.time), "_dir": r} for r in runs]
    label_runs(rows)
    if args.baseline is None:
        base_index = 0
    else:
        # "swiglu tensorwise" names a run also where the labels leave the precision out (all runs share it)
        names = [(r["label"], r["run"], r["name"], f"{r['variant']} {r['precision']}",
                  f"{r['variant']} {r['precision']} seed {r['seed']}", f"{r['variant']} seed {r['seed']}") for r in rows]
        matches = [i for i, n in enumerate(names) if args.baseline in n]
        if len(matches) != 1:
            what = "is none" if not matches else "matches more than one"
            return fail(f"--baseline {args.baseline!r} {what} of the runs: {', '.join(r['label'] for r in rows)}")
        base_index = matches[0]
    base = rows[base_index]
    for r in rows:
        v, b = r["final_val_loss"], base["final_val_loss"]
        r["val_vs_baseline"] = None if absent(v) or absent(b) else (v - b) / b

    key, name = METRICS[args.target_metric]
    final = "final_val_loss" if args.target_metric == "val" else "final_loss"
    finals = [r[final] for r in rows if finite(r.get(final))]
    target, target_from = args.target_loss, "--target-loss"
    if target is None and finals:
        target = max(finals)
        worst = next(r for r in rows if r.get(final) == target)
        target_from = f"the worst final {name}: {worst['label']}'s"
    if target is not None:
        for r in rows:
            r.update(time_to_target(r, target, args.target_metric))
    out = args.out or args.paths[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    if target is not None:
        pairs = seed_pairs(rows, base, args.target_metric)
        table += "\n\n" + "\n".join(time_table(rows, base, args.target_metric, target, target_from, pairs is not None))
        if pairs:
            table += "\n\n" + "\n".join(seed_pairs_table(pairs, name))
        elif len({r["seed"] for r in rows if r.get("seed") is not None}) > 1:
            table += (f"\n\nNo gaps within each seed: {base['label']}'s configuration did not run at two seeds "
                      "that another also ran at (--baseline names one that did).")
    else:
        table += f"\n\nNo run logged a {name}: no time-to-loss table."
    print(table)
    (out / "summary.md").write_text(table + "\n")
    write_csv(rows, out / "summary.csv")
    write_layers_csv(rows, out / "layers.csv")

    plots = []
    hours, gpu_hours = TIME_AXIS[args.time], TIME_AXIS[args.time].replace("hours", "GPU-hours", 1)
    vt = target if args.target_metric == "val" else None
    tt = target if args.target_metric == "train" else None
    for y, x, xlabel, ylabel, file, line in [
            ("val_loss", "tokens", "tokens", "validation loss", "val_loss.png", vt),
            ("loss", "tokens", "tokens", "training loss", "train_loss.png", tt),
            ("val_loss", "_hours", hours, "validation loss", "val_loss_time.png", vt),
            ("loss", "_hours", hours, "training loss", "train_loss_time.png", tt),
            ("val_loss", "_gpu_hours", gpu_hours, "validation loss", "val_loss_gpu_hours.png", vt),
            ("loss", "_gpu_hours", gpu_hours, "training loss", "train_loss_gpu_hours.png", tt)]:
        if line_plot(rows, y, x, xlabel, ylabel, out / file, line):
            plots.append(file)
    if val_delta_plot(rows, base, out / "val_loss_delta.png"):
        plots.append("val_loss_delta.png")
    if throughput_plot(rows, out / "throughput.png", base_index):
        plots.append("throughput.png")
    for r in rows:
        if heatmap(r, out / f"sparsity_heatmap_{r['name']}.png"):
            plots.append(f"sparsity_heatmap_{r['name']}.png")
    print(f"\ntables: {out / 'summary.md'}, {out / 'summary.csv'}")
    print(f"plots in {out}/: {', '.join(plots) or 'none (nothing to plot)'}")
    mode = wandb_mode(args.wandb, rows)
    if mode != "disabled":
        keys = [k for k, _, _ in COLUMNS] + CSV_EXTRA
        data = [[None if absent(r.get(k)) else r[k] for k in keys] for r in rows]
        config = {"runs": [r["name"] for r in rows], "labels": [r["label"] for r in rows], "time": args.time,
                  "target_metric": args.target_metric, "target_loss": target, "baseline": base["label"],
                  "inputs": [str(p) for p in args.paths]}
        print(wandb_report(rows, out, plots, {"summary": (keys, data)}, mode, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
