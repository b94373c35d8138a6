"""scripts/compare.py on two real tiny runs (swiglu, srelu24) laid out as a multirun directory,
plus the steady-state window and resume de-duplication on a hand-written metrics.jsonl."""
import csv
import importlib.util
import json
import statistics
from pathlib import Path

import matplotlib.image
import pytest

from helpers import ROOT, background, prepare_shared_cache, run_train, tiny_overrides, with_cache, write_corpus

spec = importlib.util.spec_from_file_location("compare", ROOT / "scripts" / "compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

JOBS = {"0_swiglu": "swiglu", "1_srelu24": "srelu24"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@background
def launches(ctx):
    """The multirun's runs (helpers.background), on a shard cache prepared before they start."""
    tmp = ctx.tmp("compare")
    corpus = write_corpus(tmp / "corpus")
    cache = prepare_shared_cache(ctx.factory, corpus)

    def run(job: str, ffn: str):
        extra = [f"ffn={ffn}", "ffn.dense_warmup_steps=2", "ffn.hidden_dim=128", "trainer.max_steps=6",
                 "trainer.eval_every=3", "trainer.log_every=1", "trainer.ckpt_every=100",
                 f"hydra.run.dir={tmp / 'multi' / job}"]  # after tiny_overrides' hydra.run.dir: wins
        return lambda: (run_train(with_cache(tiny_overrides(tmp, corpus, extra), cache)), tmp / "multi")

    return {f"multirun[{job}]": run(job, ffn) for job, ffn in JOBS.items()}


@pytest.fixture(scope="module")
def multirun(launched) -> Path:
    for job in JOBS:
        r, multi = launched[f"multirun[{job}]"].result()
        assert r.returncode == 0, r.stderr[-3000:]
    return multi


@pytest.fixture(scope="module")
def report(multirun):
    """compare.py on the multirun directory, default output (<multirun>/report)."""
    rc = compare.main([str(multirun)])
    assert rc == 0
    return multirun / "report"


@pytest.mark.slow
def test_table_of_a_multirun(multirun, report):
    rows = read_csv(report / "summary.csv")
    assert [r["run"] for r in rows] == list(JOBS)
    assert [r["variant"] for r in rows] == list(JOBS.values())
    for r in rows:
        logged = metrics(multirun / r["run"])
        assert float(r["final_loss"]) == [m["loss"] for m in logged if "loss" in m][-1]
        assert float(r["final_val_loss"]) == [m["val_loss"] for m in logged if "val_loss" in m][-1]
        assert int(r["tokens"]) == logged[-1]["tokens"] == 6 * 8 * 32
        info = json.loads((multirun / r["run"] / "run_info.json").read_text())
        assert int(r["params"]) == info["params"]["total"]
        assert int(r["non_embedding"]) == info["params"]["non_embedding"]
        assert float(r["tokens_per_s"]) > 0
        assert 0 < float(r["act_sparsity"]) < 1
        assert r["mfu"] == "" and r["peak_mem_gib"] == ""  # CPU: neither is logged
        assert r["precision"] == "fp32" and r["label"] == r["variant"]  # one precision: labels as before
        assert r["reached"] in ("True", "False") and float(r["hours"]) > 0  # the time-to-loss columns
    md = (report / "summary.md").read_text().split("\n\n")[0].splitlines()  # the run table, then time to loss
    assert len(md) == 2 + len(JOBS) and md[0].startswith("| run | variant | precision |")
    assert all(f"| {job} | {ffn} | fp32 |" in "\n".join(md) for job, ffn in JOBS.items())
    assert md[2].split("|")[13].strip() == "-"  # MFU column on CPU
    assert "## Time to reach validation loss" in (report / "summary.md").read_text()


@pytest.mark.slow
def test_plots_are_written_and_not_blank(report):
    names = ["val_loss.png", "train_loss.png", "val_loss_time.png", "train_loss_time.png", "val_loss_gpu_hours.png",
             "train_loss_gpu_hours.png", "val_loss_delta.png", "throughput.png"]
    names += [f"sparsity_heatmap_{job}.png" for job in JOBS]
    for name in names:
        path = report / name
        assert path.is_file(), name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        img = matplotlib.image.imread(path)[..., :3]
        assert img.std() > 0, f"{name} is blank"
        assert ((img.max(-1) - img.min(-1)) > 0.3).mean() > 0.001, f"{name} has no data: only black/grey axes"


@pytest.mark.slow
def test_run_dirs_given_one_by_one_give_the_same_table(multirun, report, tmp_path, capsys):
    capsys.readouterr()
    rc = compare.main([str(multirun / job) for job in JOBS] + ["--out", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "summary.csv").read_text() == (report / "summary.csv").read_text()
    assert (tmp_path / "summary.md").read_text() == (report / "summary.md").read_text()
    out = capsys.readouterr().out
    assert (report / "summary.md").read_text().strip() in out  # the table is printed
    assert str(tmp_path) in out.splitlines()[-1]  # and where the plots went
    assert (tmp_path / "sparsity_heatmap_1_srelu24.png").is_file()


@pytest.mark.slow
def test_baseline_sets_the_loss_gaps_and_ratios(multirun, report, tmp_path, capsys):
    rows = {r["variant"]: r for r in read_csv(report / "summary.csv")}
    assert float(rows["swiglu"]["val_vs_baseline"]) == 0.0  # default: the first run
    assert compare.main([str(multirun), "--baseline", "srelu24", "--out", str(tmp_path)]) == 0
    rows = {r["variant"]: r for r in read_csv(tmp_path / "summary.csv")}
    v, b = float(rows["swiglu"]["final_val_loss"]), float(rows["srelu24"]["final_val_loss"])
    assert float(rows["srelu24"]["val_vs_baseline"]) == 0.0
    assert float(rows["swiglu"]["val_vs_baseline"]) == pytest.approx((v - b) / b)
    capsys.readouterr()
    assert compare.main([str(multirun), "--baseline", "gelu", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --baseline 'gelu' is none") and "swiglu, srelu24" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_two_four_phase_throughput_and_per_layer_csv(multirun, report):
    rows = {r["variant"]: r for r in read_csv(report / "summary.csv")}
    assert rows["swiglu"]["tokens_per_s_24"] == "" and rows["swiglu"]["tokens_per_s_dense"] == ""  # no 2:4 phase
    logged = metrics(multirun / "1_srelu24")
    dense = [m["tokens_per_s"] for m in logged if m.get("mode_2to4") == 0 and "tokens_per_s" in m][1:]
    assert float(rows["srelu24"]["tokens_per_s_dense"]) == pytest.approx(statistics.median(dense))
    phase = [m["tokens_per_s"] for m in logged if m.get("mode_2to4") == 1 and "tokens_per_s" in m][1:]
    assert phase and float(rows["srelu24"]["tokens_per_s_24"]) == pytest.approx(sorted(phase)[len(phase) // 2]
                                                                               if len(phase) % 2 else
                                                                               sum(sorted(phase)[len(phase) // 2 - 1:
                                                                                   len(phase) // 2 + 1]) / 2)
    layers = read_csv(report / "layers.csv")
    last = [m for m in logged if m.get("layers")][-1]
    got = [float(r["value"]) for r in layers if r["run"] == "1_srelu24" and r["statistic"] == "act_sparsity"]
    assert got == pytest.approx(last["layers"]["act_sparsity"]) and len(got) >= 2  # one value per layer


def test_no_run_found_is_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert compare.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "empty" / "report").exists()


def test_steady_state_window_and_resumed_steps(tmp_path):
    """The first interval(s) are skipped; a step logged twice (resume) counts once, the last time."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_info.json").write_text(json.dumps({"params": {"total": 10, "non_embedding": 4}, "vocab_size": 8}))
    (run / "config_resolved.yaml").write_text("ffn:\n  kind: srelu\n  hidden_dim: 8\nmodel:\n  kind: other\n")
    speeds = [1.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1100.0]
    rows = [{"step": i + 1, "tokens": 10 * (i + 1), "loss": 5.0 - i / 10, "tokens_per_s": s, "mfu": s / 1e4,
             "elapsed_s": float(i), "mem_allocated_gib": 1.0 + (i == 3), "layers": {"act_sparsity": [0.2, 0.4]}}
            for i, s in enumerate(speeds)]
    rows[-1]["val_loss"] = 4.0
    stale = {**rows[5], "loss": 99.0, "tokens_per_s": 1e9}  # logged before a crash, redone after resume
    lines = [json.dumps(r) for r in rows[:7]] + [json.dumps(stale)] + [json.dumps(r) for r in rows[5:]]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    s = compare.summarize(run)
    assert s["variant"] == "srelu"
    assert len(s["_rows"]) == 12 and s["_rows"][5]["loss"] == rows[5]["loss"]
    assert s["tokens_per_s"] == 650.0  # 12 intervals: the first 2 skipped, median of 200..1100
    assert s["mfu"] == pytest.approx(0.065)
    assert s["final_loss"] == rows[-1]["loss"] and s["final_val_loss"] == 4.0
    assert s["act_sparsity"] == pytest.approx(0.3)
    assert s["peak_mem_gib"] == 2.0
    assert compare.steady([5.0]) == [5.0] and compare.steady([5.0, 6.0]) == [6.0]


def test_ablations_of_one_variant_are_labelled_by_their_sweep_choice(tmp_path):
    """The study's multirun: four srelu24 jobs are told apart by their job dir's choice name."""
    runs = ["0_swiglu", "2_srelu24", "3_srelu24_no_permutation", "5_srelu24_no_dense_warmup"]
    rows = [{"run": r, "variant": r.split("_")[1], "_dir": tmp_path / r} for r in runs]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["swiglu", "srelu24", "srelu24_no_permutation", "srelu24_no_dense_warmup"]
    # plain run dirs (no job number) of the same variant keep "variant (run)"
    rows = [{"run": r, "variant": "srelu", "_dir": tmp_path / "x" / r} for r in ("a", "b")]
    compare.label_runs(rows)
    assert [r["label"] for r in rows] == ["srelu (a)", "srelu (b)"]
