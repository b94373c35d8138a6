"""Compare runs: a table (one row per run) and plots, from run directories or multirun directories.

    python scripts/compare.py runs/demo/multirun_2026-11-29_21-00-00       # every job of a sweep
    python scripts/compare.py runs/a runs/b --out reports/a_vs_b --baseline srelu

Writes <out>/summary.md, <out>/summary.csv, layers.csv (last per-layer statistics), val_loss.png, val_loss_delta.png (gap to --baseline),
train_loss_time.png, throughput.png (ratios vs --baseline) and
sparsity_heatmap_<run>.png (default out: <first input>/report); the table is also printed.
metrics.jsonl is the source of truth. Throughput and MFU are medians over the log intervals after
the first ~10% (at least the first one), which include warm-up and compilation.
"""
import argparse
import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

from matplotlib.ticker import MaxNLocator
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from training.plots import close, layer_heatmap, plt  # noqa: E402

WARMUP_FRACTION = 0.1


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


def variant_of(run: Path) -> str:
    for name in ("config_resolved.yaml", ".hydra/config.yaml"):
        if (run / name).is_file():
            kind = OmegaConf.select(OmegaConf.load(run / name), "ffn.kind", default=None)
            if kind is not None:
                return str(kind)
    return "?"


def steady(values: list) -> list:
    """Drop the first ~10% of log intervals (at least one, when there are more than one)."""
    skip = max(1, math.ceil(WARMUP_FRACTION * len(values))) if len(values) > 1 else 0
    return values[skip:]


def median(values: list):
    return statistics.median(values) if values else None


def summarize(run: Path) -> dict:
    rows = read_metrics(run)
    info = json.loads((run / "run_info.json").read_text()) if (run / "run_info.json").is_file() else {}
    params = info.get("params", {})
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    window = steady([r for r in train if "tokens_per_s" in r])
    # srelu24: the 2:4 phase alone (intervals logged with 2:4 on, after the first: the switch)
    sparse_window = [r for r in train if "tokens_per_s" in r and r.get("mode_2to4") == 1][1:]
    sparsity = [r["layers"]["act_sparsity"] for r in rows if r.get("layers", {}).get("act_sparsity")]
    mem = [r["mem_allocated_gib"] for r in rows if "mem_allocated_gib" in r]
    return {
        "run": run.name, "variant": variant_of(run),
        "params": params.get("total"), "non_embedding": params.get("non_embedding"),
        "tokens": rows[-1]["tokens"] if rows else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "tokens_per_s": median([r["tokens_per_s"] for r in window]),
        "tokens_per_s_24": median([r["tokens_per_s"] for r in sparse_window]),
        "mfu": median([r["mfu"] for r in window if "mfu" in r]),
        "act_sparsity": statistics.fmean(sparsity[-1]) if sparsity else None,
        "peak_mem_gib": max(mem) if mem else None,
        "_rows": rows,
    }


# key, header, format of a present value ("-" when absent)
COLUMNS = [("run", "run", str), ("variant", "variant", str),
           ("params", "params", "{:,}".format), ("non_embedding", "non-emb params", "{:,}".format),
           ("tokens", "tokens", "{:,}".format), ("final_loss", "final train loss", "{:.4f}".format),
           ("final_val_loss", "final val loss", "{:.4f}".format),
           ("val_vs_baseline", "val loss vs baseline", "{:+.2%}".format),
           ("tokens_per_s", "tokens/s (steady median)", "{:,.0f}".format),
           ("tokens_per_s_24", "tokens/s (2:4 phase median)", "{:,.0f}".format), ("mfu", "MFU", "{:.1%}".format),
           ("act_sparsity", "act sparsity (mean)", "{:.3f}".format),
           ("peak_mem_gib", "peak mem alloc (GiB)", "{:.2f}".format)]


def absent(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join("-" if absent(r[k]) else f(r[k]) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([k for k, _, _ in COLUMNS])
        w.writerows(["" if absent(r[k]) else r[k] for k, _, _ in COLUMNS] for r in rows)


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
    """Names unique across inputs (file names) and labels by variant, plus the run when variants repeat."""
    for r in rows:
        clash = sum(x["run"] == r["run"] for x in rows) > 1
        r["name"] = f"{r['_dir'].parent.name}_{r['run']}" if clash else r["run"]
    for r in rows:
        # a multirun job dir is "<job number>_<choice>" (e.g. 3_srelu24_no_permutation): the choice
        # names an ablation better than the FFN kind does
        r["choice"] = re.sub(r"^\d+_", "", r["run"])
    for r in rows:
        repeated = sum(x["variant"] == r["variant"] for x in rows) > 1
        choice_unique = sum(x["choice"] == r["choice"] for x in rows) == 1 and r["choice"] != r["run"]
        if not repeated:
            r["label"] = r["variant"]
        elif choice_unique:
            r["label"] = r["choice"]
        else:
            r["label"] = f"{r['variant']} ({r['name']})"


def _finish(fig, ax, path: Path, drawn: bool) -> bool:
    """Grid, legend and save a line plot when something was drawn; close it either way."""
    if drawn:
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    close(fig)
    return drawn


def line_plot(rows: list[dict], y: str, x: str, xlabel: str, ylabel: str, path: Path) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for r in rows:
        pts = [(m[x], m[y]) for m in r["_rows"] if y in m and x in m]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, ms=3, label=r["label"])
            drawn = True
    if drawn:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="run directories or multirun directories")
    ap.add_argument("--out", type=Path, help="where tables and plots go (default: <first path>/report)")
    ap.add_argument("--baseline", help="label or run name that ratios and loss gaps are taken against "
                    "(default: the first run)")
    args = ap.parse_args(argv)
    runs = find_runs(args.paths)
    if not runs:
        print(f"error: no run (a directory with metrics.jsonl) in {' '.join(map(str, args.paths))}", file=sys.stderr)
        return 2
    rows = [{**summarize(r), "_dir": r} for r in runs]
    label_runs(rows)
    if args.baseline is None:
        base_index = 0
    else:
        names = [(r["label"], r["run"], r["name"]) for r in rows]
        matches = [i for i, n in enumerate(names) if args.baseline in n]
        if len(matches) != 1:
            what = "is none" if not matches else "matches more than one"
            print(f"error: --baseline {args.baseline!r} {what} of the runs: {', '.join(r['label'] for r in rows)}",
                  file=sys.stderr)
            return 2
        base_index = matches[0]
    base = rows[base_index]
    for r in rows:
        v, b = r["final_val_loss"], base["final_val_loss"]
        r["val_vs_baseline"] = None if absent(v) or absent(b) else (v - b) / b
    out = args.out or args.paths[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    print(table)
    (out / "summary.md").write_text(table + "\n")
    write_csv(rows, out / "summary.csv")
    write_layers_csv(rows, out / "layers.csv")

    plots = []
    if line_plot(rows, "val_loss", "tokens", "tokens", "validation loss", out / "val_loss.png"):
        plots.append("val_loss.png")
    if line_plot(rows, "loss", "elapsed_s", "wall-clock seconds", "training loss", out / "train_loss_time.png"):
        plots.append("train_loss_time.png")
    if val_delta_plot(rows, base, out / "val_loss_delta.png"):
        plots.append("val_loss_delta.png")
    if throughput_plot(rows, out / "throughput.png", base_index):
        plots.append("throughput.png")
    for r in rows:
        if heatmap(r, out / f"sparsity_heatmap_{r['name']}.png"):
            plots.append(f"sparsity_heatmap_{r['name']}.png")
    print(f"\ntables: {out / 'summary.md'}, {out / 'summary.csv'}")
    print(f"plots in {out}/: {', '.join(plots) or 'none (nothing to plot)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
