"""scripts/compare.py against time, on hand-written runs whose answers are worked out by hand:
the training clock of each basis (--time), the time, GPU-hours, tokens and step to reach a loss,
srelu24's tokens/s per phase, labels by precision and seed, the seed spread and ties, and the
report run in wandb (offline)."""
import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

spec = importlib.util.spec_from_file_location("compare", ROOT / "scripts" / "compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

STEPS = list(range(10, 101, 10))  # log every 10 steps, 1000 tokens a step
VAL_STEPS = (20, 40, 60, 80, 100)  # eval every 20


def make_run(root: Path, job: str, ffn: str, float8: str, *, seed=1337, gpus=1, speeds, val, modes=None,
             wandb_mode="offline", name="study_speed", elapsed=None, power=None, clock=None, busy=None) -> Path:
    """A run directory as the trainer writes it: config_resolved.yaml, run_info.json, metrics.jsonl.
    speeds: tokens/s of each log interval; val: validation loss at VAL_STEPS; modes: mode_2to4 per row;
    power, clock: NVML's W and MHz per interval (none logged without them)."""
    run = root / job
    run.mkdir(parents=True)
    cfg = {"name": name, "ffn": {"kind": ffn}, "trainer": {"float8": float8, "seed": seed, "precision": "auto"},
           "logging": {"wandb": {"mode": wandb_mode, "project": "srelu24", "entity": None, "group": None}}}
    (run / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    (run / "run_info.json").write_text(json.dumps({"world_size": gpus, "device": "cuda:0",
                                                    "params": {"total": 100, "non_embedding": 60}}))
    rows = []
    for i, step in enumerate(STEPS):
        row = {"step": step, "tokens": 1000 * step, "loss": 6.0 - 0.03 * step, "tokens_per_s": speeds[i],
               "elapsed_s": elapsed[i] if elapsed else 100.0 + step, "mode_2to4": modes[i] if modes else 0}
        if power:
            row["gpu_power_w"], row["gpu_sm_clock_mhz"] = power[i], clock[i]
        if busy:
            row["gpu_busy_pct"] = busy[i]
        if step in VAL_STEPS:
            row["val_loss"] = val[VAL_STEPS.index(step)]
        rows.append(row)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


SRELU24_MODES = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]  # 2:4 from the 4th log interval (the switch)
SRELU24_SPEEDS = [100.0, 1000.0, 1000.0, 50.0] + [1250.0] * 6  # compile, dense; the switch, 2:4
RECOMPILED_SPEEDS = [100.0, 300.0] + [1000.0] * 8  # the second interval recompiles (under half the median)


@pytest.fixture()
def study(tmp_path) -> Path:
    """Four runs of a speed study: swiglu bf16 (1 GPU), swiglu tensorwise (2 GPUs), srelu24
    tensorwise at two seeds. Each first interval is slow (compilation)."""
    m = tmp_path / "multirun"
    make_run(m, "0_swiglu_bf16", "swiglu", "none", speeds=[100.0] + [1000.0] * 9, val=[5.0, 4.2, 3.8, 3.6, 3.5])
    make_run(m, "1_swiglu_tensorwise", "swiglu", "tensorwise", gpus=2, speeds=[200.0] + [2000.0] * 9,
             val=[5.0, 4.0, 3.5, 3.2, 3.0])
    make_run(m, "2_srelu24_tensorwise", "srelu24", "tensorwise", speeds=SRELU24_SPEEDS, modes=SRELU24_MODES,
             val=[5.0, 4.0, 3.5, 3.2, 3.04])
    make_run(m, "3_srelu24_tensorwise_seed2", "srelu24", "tensorwise", seed=2, speeds=SRELU24_SPEEDS,
             modes=SRELU24_MODES, val=[5.0, 4.1, 3.6, 3.3, 3.10])
    return m


def read_csv(path: Path) -> dict:
    with open(path, newline="") as f:
        return {r["label"]: r for r in csv.DictReader(f)}


def test_training_clock_of_each_basis():
    """10,000 tokens per interval: at 1000 tokens/s 10 s each, the first (100 tokens/s) 100 s as
    measured and 10 s (the phase's median) in steady time; srelu24's switch interval at 2:4's median."""
    rows = [{"step": s, "tokens": 1000 * s, "tokens_per_s": v, "mode_2to4": m, "elapsed_s": 500.0 + s}
            for s, v, m in zip(STEPS, SRELU24_SPEEDS, SRELU24_MODES)]
    rows.insert(2, {"step": 25, "tokens": 25000, "val_loss": 4.0})  # an evaluation off the log steps
    train = compare.training_seconds(rows, "train")
    steady = compare.training_seconds(rows, "steady")
    dense, sparse = 10.0, 10000 / 1250
    assert train[:2] == pytest.approx([100.0, 110.0])
    assert train[3:5] == pytest.approx([120.0, 120.0 + 10000 / 50])
    assert steady[:2] == pytest.approx([dense, 2 * dense])
    assert steady[2] == pytest.approx(2.5 * dense)  # interpolated in step between steps 20 and 30
    assert steady[4] == pytest.approx(3 * dense + sparse)  # the switch counted at 2:4's median
    assert steady[-1] == pytest.approx(3 * dense + 7 * sparse)
    assert compare.training_seconds(rows, "elapsed")[:3] == pytest.approx([510.0, 520.0, 525.0])
    assert compare.phase_medians(rows) == {0: 1000.0, 1: 1250.0}


def test_steady_time_counts_a_recompiling_interval_at_the_phases_median():
    """An interval under half its phase's median (a recompilation after the first) is a one-off
    in steady time, as the first one is; one at 0.6 of the median counts as measured."""
    rows = [{"step": s, "tokens": 1000 * s, "tokens_per_s": v} for s, v in zip(STEPS, RECOMPILED_SPEEDS)]
    assert compare.training_seconds(rows, "steady") == pytest.approx([10.0 * (i + 1) for i in range(10)])
    assert compare.training_seconds(rows, "train")[1] == pytest.approx(100.0 + 10000 / 300)
    rows[5]["tokens_per_s"] = 600.0
    assert compare.training_seconds(rows, "steady")[-1] == pytest.approx(90.0 + 10000 / 600)


def test_the_baseline_named_by_ffn_and_precision_where_the_labels_omit_it(tmp_path, capsys):
    """All runs tensorwise: labels are the FFNs alone, and --baseline "swiglu tensorwise" (the
    study's documented command) still names swiglu's run."""
    m = tmp_path / "multirun"
    make_run(m, "0_swiglu_tensorwise", "swiglu", "tensorwise", speeds=[100.0] + [1000.0] * 9,
             val=[5.0, 4.2, 3.8, 3.6, 3.5])
    make_run(m, "1_srelu_tensorwise", "srelu", "tensorwise", speeds=[100.0] + [1100.0] * 9,
             val=[5.0, 4.0, 3.5, 3.2, 3.1])
    assert compare.main([str(m), "--baseline", "swiglu tensorwise", "--wandb", "disabled"]) == 0
    rows = read_csv(m / "report" / "summary.csv")
    assert set(rows) == {"swiglu", "srelu"} and float(rows["swiglu"]["val_vs_baseline"]) == 0.0
    assert compare.main([str(m), "--baseline", "swiglu rowwise", "--wandb", "disabled"]) == 2


def test_reach_interpolates_between_the_bracketing_points():
    pts = [(5.0, {"h": 1.0}), (4.0, {"h": 2.0}), (3.0, {"h": 4.0}), (3.5, {"h": 5.0}), (2.0, {"h": 6.0})]
    assert compare.reach(pts, 3.5) == {"h": 3.0}  # halfway from 4.0 (h 2) to 3.0 (h 4): the first crossing
    assert compare.reach(pts, 4.0) == {"h": 2.0}  # a point exactly at the target
    assert compare.reach(pts, 6.0) == {"h": 1.0}  # already below at the first point
    assert compare.reach(pts, 1.0) is None
    assert compare.reach([(math.nan, {"h": 1.0}), (3.0, {"h": 2.0})], 3.0) == {"h": 2.0}


def test_time_to_the_worst_final_loss_by_default(study, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = study / "report"
    assert compare.main([str(study), "--baseline", "swiglu bf16"]) == 0
    rows = read_csv(out / "summary.csv")
    assert list(rows) == ["swiglu bf16", "swiglu tensorwise", "srelu24 tensorwise seed 1337",
                          "srelu24 tensorwise seed 2"]
    assert {r["target_loss"] for r in rows.values()} == {"3.5"}  # swiglu bf16's final: the worst
    a, b = rows["swiglu bf16"], rows["swiglu tensorwise"]
    # swiglu bf16 reaches 3.5 at its last point: step 100, 10 intervals of 10 s (steady), 1 GPU
    assert float(a["step_to_target"]) == 100 and float(a["hours_to_target"]) * 3600 == pytest.approx(100.0)
    # swiglu tensorwise at step 60 exactly (3.5), 6 intervals of 5 s, on 2 GPUs
    assert float(b["tokens_to_target"]) == 60000 and float(b["hours_to_target"]) * 3600 == pytest.approx(30.0)
    assert float(b["gpu_hours_to_target"]) * 3600 == pytest.approx(60.0)
    assert float(b["gpu_hours"]) * 3600 == pytest.approx(100.0) and b["gpus"] == "2"
    # srelu24 seed 1337 at step 60 too: 3 dense intervals (10 s) and 3 of 2:4 (8 s)
    assert float(rows["srelu24 tensorwise seed 1337"]["hours_to_target"]) * 3600 == pytest.approx(54.0)
    # seed 2: 3.6 at step 60, 3.3 at 80 -> a third of the way: step 66.67
    s2 = rows["srelu24 tensorwise seed 2"]
    assert float(s2["step_to_target"]) == pytest.approx(200 / 3)
    assert float(s2["hours_to_target"]) * 3600 == pytest.approx(54.0 + 8.0 * 2 / 3)
    assert rows["srelu24 tensorwise seed 1337"]["tokens_per_s_dense"] == "1000.0"
    assert rows["srelu24 tensorwise seed 1337"]["tokens_per_s_24"] == "1250.0"
    assert a["tokens_per_s_dense"] == "" and a["precision"] == "bf16" and a["time_basis"] == "steady"
    md = (out / "summary.md").read_text()
    assert "## Time to reach validation loss 3.5000 (the worst final validation loss: swiglu bf16's)" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    timed = [ln for ln in table if ln.count("|") == 12]  # the time table's rows, soonest first (GPU-hours)
    assert [ln.split(" | ")[0][2:] for ln in timed[1:]] == [
        "srelu24 tensorwise seed 1337", "srelu24 tensorwise seed 2", "swiglu tensorwise", "swiglu bf16"]
    assert "| swiglu tensorwise | 2 | 30 s | 0.0167 | 1.67x | 60,000 | 60 |" in md
    # the seed pair's spread (0.06) makes srelu24's 3.04 a tie with the best (3.00), seed 2's 3.10 not
    assert "final validation loss differs by 0.0600" in md
    assert "| 3.0400 | +0.0400 (tie) |" in md and "| 3.1000 | +0.1000 |" in md and "| 3.0000 | best |" in md
    assert md.strip() in capsys.readouterr().out


def test_a_target_loss_not_reached_and_the_training_loss(study, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = study / "r2"
    assert compare.main([str(study), "--target-loss", "3.2", "--time", "train", "--out", str(out)]) == 0
    rows = read_csv(out / "summary.csv")
    assert rows["swiglu bf16"]["reached"] == "False" and rows["swiglu bf16"]["hours_to_target"] == ""
    assert "not reached (final 3.5000)" in (out / "summary.md").read_text()
    # swiglu tensorwise at step 80 exactly; measured time: the first interval at 200 tokens/s (50 s)
    assert float(rows["swiglu tensorwise"]["hours_to_target"]) * 3600 == pytest.approx(50.0 + 7 * 5.0)
    assert "(--target-loss)" in (out / "summary.md").read_text()
    # training loss 6 - 0.03 step, the same in every run: 4.5 at step 50
    out = study / "r3"
    assert compare.main([str(study), "--target-metric", "train", "--target-loss", "4.5", "--out", str(out)]) == 0
    rows = read_csv(out / "summary.csv")
    assert [float(r["step_to_target"]) for r in rows.values()] == pytest.approx([50.0] * 4)
    assert float(rows["swiglu bf16"]["hours_to_target"]) * 3600 == pytest.approx(50.0)


def test_elapsed_time_and_the_time_plots(study, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = study / "r4"
    assert compare.main([str(study), "--time", "elapsed", "--target-loss", "3.5", "--out", str(out)]) == 0
    rows = read_csv(out / "summary.csv")
    assert float(rows["swiglu bf16"]["hours_to_target"]) * 3600 == pytest.approx(200.0)  # elapsed_s at step 100
    for name in ("val_loss.png", "train_loss.png", "val_loss_time.png", "train_loss_time.png",
                 "val_loss_gpu_hours.png", "train_loss_gpu_hours.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert not (out / "wandb").exists()


def test_bad_target_is_one_error_line(study, capsys):
    assert compare.main([str(study), "--target-loss", "nan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --target-loss nan: give a finite loss")


def test_labels_say_precision_only_when_runs_differ_in_it(tmp_path):
    rows = [{"run": r, "variant": v, "precision": p, "seed": s, "_dir": tmp_path / r}
            for r, v, p, s in [("0_swiglu_bf16", "swiglu", "bf16", 1337), ("1_srelu24_rowwise", "srelu24", "rowwise", 1337),
                               ("2_srelu24_tensorwise", "srelu24", "tensorwise", 1337),
                               ("3_srelu24_tensorwise_seed2", "srelu24", "tensorwise", 2)]]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["swiglu bf16", "srelu24 rowwise", "srelu24 tensorwise seed 1337",
                                          "srelu24 tensorwise seed 2"]
    # one precision (the older runs): the variant alone, as before
    rows = [{"run": r, "variant": v, "precision": "bf16", "seed": 1337, "_dir": tmp_path / r}
            for r, v in [("0_swiglu", "swiglu"), ("1_srelu24", "srelu24")]]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["swiglu", "srelu24"]


def test_graphed_runs_are_labelled_apart_only_beside_eager_ones(tmp_path):
    """trainer.cuda_graph changes the speed, not the losses: beside eager runs a graphed one is its
    own configuration ("graphed"), so times and seed pairs never mix the two."""
    rows = [{"run": r, "variant": "srelu24", "precision": "tensorwise", "seed": 1337, "cuda_graph": g,
             "_dir": tmp_path / r} for r, g in [("0_srelu24_tensorwise", False), ("1_srelu24_tensorwise", True)]]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["srelu24", "srelu24 graphed"]
    for r in rows:
        r["cuda_graph"] = True
    compare.label_runs(rows)
    assert [r["kind"] for r in rows] == ["srelu24", "srelu24"]
    rows[1]["ffn_stats_every"] = 25  # a graphed run's eager steps: one in 25 against every logged one
    compare.label_runs(rows)
    assert [r["kind"] for r in rows] == ["srelu24 stats/log", "srelu24 stats/25"]


def test_the_report_goes_to_the_runs_wandb_group_offline(study, monkeypatch, capsys):
    from wandb_records import history_keys, run_info

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = study / "report"
    assert compare.main([str(study)]) == 0  # --wandb auto: the runs logged to wandb (offline)
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    info = run_info(files[0])
    assert (info["group"], info["job_type"], info["name"]) == ("study_speed", "report", "report")
    keys = history_keys(files[0])
    for plot in ("val_loss_time", "val_loss_gpu_hours", "train_loss_time", "val_loss"):
        assert f"report/{plot}/_type" in keys, plot
    assert "report/summary/_type" in keys
    assert "wandb: report run" in capsys.readouterr().out


def test_no_wandb_report_when_the_runs_had_none(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    m = tmp_path / "m"
    make_run(m, "0_swiglu", "swiglu", "none", speeds=[1000.0] * 10, val=[5, 4, 3, 2, 1], wandb_mode="disabled")
    assert compare.main([str(m)]) == 0
    assert not (m / "report" / "wandb").exists()
    assert compare.wandb_mode("auto", [{"_wandb": {"mode": "offline"}}]) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert compare.wandb_mode("auto", [{"_wandb": {"mode": "online"}}]) == "disabled"
    assert compare.wandb_mode("offline", []) == "offline"


def test_clock_power_and_energy_per_token_over_the_steady_intervals(tmp_path, capsys):
    """Medians over the intervals after the first (10% of 10): clock and power as logged, energy per
    token each interval's W / tokens/s; srelu24's 2:4 phase apart, without its switch interval.
    A run logged without NVML's readings shows none."""
    m = tmp_path / "multirun"
    power = [300.0] + [700.0] * 3 + [500.0] * 3 + [600.0] * 3  # compile, dense (and the switch); 2:4
    clock = [1980.0] + [1500.0] * 3 + [1600.0] * 6
    busy = [50.0] + [99.0] * 4 + [80.0] * 5  # compile; dense; 2:4 waiting on the host
    run = make_run(m, "0_srelu24", "srelu24", "tensorwise", speeds=SRELU24_SPEEDS, modes=SRELU24_MODES,
                   val=[5.0, 4.0, 3.5, 3.2, 3.0], power=power, clock=clock, busy=busy)
    make_run(m, "1_srelu", "srelu", "tensorwise", speeds=[100.0] + [1000.0] * 9, val=[5.0, 4.0, 3.5, 3.2, 3.1])
    r = compare.summarize(run)
    assert r["sm_clock_mhz"] == 1600.0 and r["power_w"] == 600.0
    assert r["gpu_busy_pct"] == 80.0  # intervals 2-10: 99 (x4), 80 (x5)
    # mJ/token of intervals 2-10: 700 (x2, dense), 14000 (the switch: 700 W at 50 tokens/s),
    # 400 (x3) and 480 (x3) in 2:4 -> the 5th of 9 sorted: 480
    assert r["mj_per_token"] == pytest.approx(480.0)
    # 2:4 alone without the switch: 400 (x3), 480 (x3) -> 440; with it, the median would be 480
    assert r["mj_per_token_24"] == pytest.approx(440.0)
    assert compare.main([str(m), "--out", str(tmp_path / "rep"), "--wandb", "disabled"]) == 0
    rows = read_csv(tmp_path / "rep" / "summary.csv")
    assert float(rows["srelu24"]["mj_per_token_24"]) == pytest.approx(440.0)
    assert rows["srelu"]["mj_per_token"] == "" and rows["srelu"]["power_w"] == "" and rows["srelu"]["gpu_busy_pct"] == ""
    assert float(rows["srelu24"]["gpu_busy_pct"]) == 80.0
    table = capsys.readouterr().out
    assert "| mJ/token |" in table and "| 480.00 | 440.00 |" in table and "| GPU busy (%) |" in table


def test_energy_per_token_needs_power_and_a_positive_rate():
    """The trainer's own figure (the energy counter over the interval's tokens) wins over power / rate."""
    assert compare.mj_per_token({"gpu_mj_per_token": 9.5, "gpu_power_w": 500.0, "tokens_per_s": 1000.0}) == 9.5
    assert compare.mj_per_token({"gpu_power_w": 500.0, "tokens_per_s": 1000.0}) == pytest.approx(500.0)
    # 2 GPUs: the logging GPU's 500 W over its half of 1000 tokens/s, as the trainer's own figure counts
    assert compare.mj_per_token({"gpu_power_w": 500.0, "tokens_per_s": 1000.0}, gpus=2) == pytest.approx(1000.0)
    assert compare.mj_per_token({"gpu_power_w": 500.0, "tokens_per_s": 0.0}) is None
    assert compare.mj_per_token({"tokens_per_s": 1000.0}) is None
    assert compare.mj_per_token({"gpu_power_w": float("nan"), "tokens_per_s": 1000.0}) is None


def test_gaps_within_each_seed_against_the_baseline_kind(tmp_path, monkeypatch, capsys):
    """Three FFNs at two seeds, srelu24 twice at seed 1337, and an srelu24 ablation at both: each
    configuration's final loss minus srelu's in the same seed, runs of one configuration and seed
    averaged, the ablation apart, and the spread of one seed's runs as what a paired gap must clear."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    m = tmp_path / "multirun"
    runs = [("0_swiglu_tensorwise", "swiglu", 1337, 3.00), ("1_srelu_tensorwise", "srelu", 1337, 3.05),
            ("2_srelu24_tensorwise", "srelu24", 1337, 3.08), ("3_srelu24_tensorwise_rerun", "srelu24", 1337, 3.10),
            ("4_swiglu_tensorwise_seed2", "swiglu", 2, 2.90), ("5_srelu_tensorwise_seed2", "srelu", 2, 2.96),
            ("6_srelu24_tensorwise_seed2", "srelu24", 2, 2.97), ("7_srelu24_no_permutation", "srelu24", 1337, 3.20),
            ("8_srelu24_no_permutation_seed2", "srelu24", 2, 3.00)]
    for job, ffn, seed, final in runs:
        run = make_run(m, job, ffn, "tensorwise", seed=seed, speeds=[1000.0] * 10, val=[5.0, 4.0, 3.5, 3.2, final])
        if "no_permutation" in job:  # an ablation: same kind and seed, other ffn settings
            cfg = yaml.safe_load((run / "config_resolved.yaml").read_text())
            cfg["ffn"]["token_permutation"] = False
            (run / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    assert compare.main([str(m), "--baseline", "srelu tensorwise seed 1337"]) == 0  # names the precision too
    md = (m / "report" / "summary.md").read_text()
    assert "## Final validation loss against srelu, within each seed" in md
    assert "| run | seed 2 | seed 1337 | mean | every seed |" in md  # seeds in numeric order
    # swiglu lower in both seeds, by 0.06 and 0.05
    assert "| swiglu | -0.0600 | -0.0500 | -0.0550 | lower |" in md
    # srelu24 at 1337: the mean of 3.08 and 3.10 against 3.05; at seed 2 +0.01, under those runs' 0.02
    assert ("| srelu24_tensorwise | +0.0100 | +0.0400 (2 runs) | +0.0250 | higher, within the spread of one seed's runs in "
            "some seed |") in md
    # the ablation is not averaged with srelu24; where a kind has several configurations, a row is named by its
    # first run's sweep choice
    assert "| srelu24_no_permutation | +0.0400 | +0.1500 | +0.0950 | higher |" in md
    assert "differ by up to 0.0200" in md
    assert "the gaps within each seed below are the finer test" in md
    # time to srelu's final loss of each seed (1 s a step: 1000 tokens a step at 1000 tokens/s): swiglu gets to
    # 2.96 (seed 2) at step 96 (3.2 at 80, 2.90 at 100) and to 3.05 (seed 1337) at step 95, srelu at its last
    assert "| run | seed 2: to 2.9600 | seed 1337: to 3.0500 |" in md
    assert "| swiglu | 1.6 min, 0.0267 GPU-hours (1.04x) | 1.6 min, 0.0264 GPU-hours (1.05x) |" in md
    assert "| srelu | 1.7 min, 0.0278 GPU-hours (1.00x) | 1.7 min, 0.0278 GPU-hours (1.00x) |" in md
    assert "| srelu24_tensorwise | not reached | not reached |" in md

    # one seed with every FFN is no pairing: the section is left out, and the table says why
    for job in ("4_swiglu_tensorwise_seed2", "5_srelu_tensorwise_seed2"):
        for f in (m / job).iterdir():
            f.unlink()
        (m / job).rmdir()
    assert compare.main([str(m), "--baseline", "srelu"]) == 0
    md = (m / "report" / "summary.md").read_text()
    assert "## Final validation loss against" not in md and "the finer test" not in md
    assert "No gaps within each seed: srelu's configuration did not run at two seeds" in md
