"""Compare runs: one row per run directory (or every job of a multirun directory).

    python scripts/compare.py runs/demo/2026-11-29_21-00-00
    python scripts/compare.py runs/a runs/b --csv table.csv

Reads each run's metrics.jsonl and run_info.json (metrics.jsonl is the source of truth).
"""
import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for p in paths:
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        else:
            runs.extend(sorted(d.parent for d in p.glob("*/metrics.jsonl")))
    return runs


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    info = json.loads((run / "run_info.json").read_text())
    cfg = (run / "config_resolved.yaml").read_text() if (run / "config_resolved.yaml").exists() else ""
    variant = next((ln.split(":", 1)[1].strip() for ln in cfg.splitlines() if ln.strip().startswith("kind:")), "?")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in train[1:]] or [r["tokens_per_s"] for r in train]  # first interval warms up
    return {
        "run": run.name, "variant": variant,
        "params": info["params"]["total"], "non_embedding": info["params"]["non_embedding"],
        "tokens": rows[-1]["tokens"] if rows else 0,
        "first_loss": train[0]["loss"] if train else math.nan,
        "final_loss": train[-1]["loss"] if train else math.nan,
        "final_val_loss": val[-1]["val_loss"] if val else math.nan,
        "ln_vocab": math.log(info["vocab_size"]),
        "tokens_per_s": statistics.median(speeds) if speeds else math.nan,
    }


COLUMNS = [("run", "run"), ("variant", "variant"), ("params", "params"), ("tokens", "tokens"),
           ("first_loss", "first loss"), ("final_loss", "final train loss"), ("final_val_loss", "final val loss"),
           ("ln_vocab", "ln(vocab)"), ("tokens_per_s", "tokens/s (median)")]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if v > 1000 else f"{v:.3f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(fmt(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="run directories or multirun directories")
    ap.add_argument("--csv", type=Path, help="also write the table as CSV")
    args = ap.parse_args(argv)
    runs = find_runs(args.paths)
    if not runs:
        print(f"error: no run with a metrics.jsonl under {' '.join(map(str, args.paths))}", file=sys.stderr)
        return 2
    rows = [summarize(r) for r in runs]
    print(markdown(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=[k for k, _ in COLUMNS])
            w.writeheader()
            w.writerows({k: r[k] for k, _ in COLUMNS} for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
