"""The benchmark scripts on CPU: bench_step.py runs the real model and optimizer and must still
produce a complete table and JSON (the GPU figures go to benchmarks/RESULTS.md); bench_ffn.py
redraws a saved GPU result."""
import json
import subprocess
import sys

import pytest

from helpers import BASE_ENV, ROOT, background
from test_distributed import start_torchrun, wait


@background
def launches(ctx):
    """The checks of the tests that launch the scripts (helpers.background); each test waits for
    its own. The longest first."""
    def job(check, *args):
        tmp = ctx.tmp(check.__name__[len("check_"):][:30])
        return lambda: check(tmp, *args)

    jobs = {"test_bench_step_from_a_runs_weights_on_its_text": job(check_bench_step_from_a_runs_weights_on_its_text,
                                                                   ctx.corpus, ctx.cache),
            "test_host_profile_on_cpu_names_the_costliest_ops": job(check_host_profile_on_cpu_names_the_costliest_ops),
            "test_fsdp_sweep_under_torchrun_on_two_cpu_processes": job(
                check_fsdp_sweep_under_torchrun_on_two_cpu_processes),
            "test_rounds_alternate_the_order_and_report_each_rows_median_round": job(
                check_rounds_alternate_the_order_and_report_each_rows_median_round),
            "test_bench_ffn_replots_a_saved_breakdown_without_a_gpu": job(
                check_bench_ffn_replots_a_saved_breakdown_without_a_gpu),
            "test_ffn_sweep_on_cpu_writes_every_variant": job(check_ffn_sweep_on_cpu_writes_every_variant),
            "test_bad_input_under_torchrun_is_one_line_from_the_first_rank": job(
                check_bad_input_under_torchrun_is_one_line_from_the_first_rank)}
    return jobs


def test_ffn_sweep_on_cpu_writes_every_variant(launched):
    launched["test_ffn_sweep_on_cpu_writes_every_variant"].result()


def check_ffn_sweep_on_cpu_writes_every_variant(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "+experiment=demo", "--ffn-sweep",
                        "--steps", "1", "--warmup", "1", "--device", "cpu", "--layers", "1", "--out", str(out),
                        "--precisions", "none", "logging.wandb.mode=disabled"],  # overrides on both sides of the flags
                       capture_output=True, text=True, env=BASE_ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [x["ffn"] for x in results] == ["swiglu", "srelu", "srelu24"]
    for x in results:
        assert x["n_layers"] == 1 and x["layers_cut_from"] == 4  # the cut is recorded
        assert x["tokens_per_s"] > 0 and abs(x["step_ms"] - (x["data_ms"] + x["forward_ms"] + x["backward_ms"]
                                                             + x["optimizer_ms"])) < 1e-6
        assert x["mfu"] is None  # no MFU on CPU
        # what a merged table needs of each row (scripts/bench_table.py)
        assert (x["float8"], x["precision"], x["gpu"]) == ("none", "fp32", "CPU")
        assert len(x["commit"]) == 7 and isinstance(x["dirty"], bool) and x["torch"] and x["date"]
    assert "layers cut to 1 of 4" in r.stdout and "| srelu24 | fp32 |" in r.stdout
    fastest = max(results[:2], key=lambda x: x["tokens_per_s"])  # swiglu or srelu: the fastest dense row
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("| srelu24 |")).split(" | ")
    assert line[8] == f"{results[2]['tokens_per_s'] / fastest['tokens_per_s']:.2f}x"  # vs fastest dense
    assert line[9] == f"{results[2]['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x"  # vs swiglu bf16


def test_rounds_alternate_the_order_and_report_each_rows_median_round(launched):
    launched["test_rounds_alternate_the_order_and_report_each_rows_median_round"].result()


def check_rounds_alternate_the_order_and_report_each_rows_median_round(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "+experiment=demo", "--ffns",
                        "swiglu,srelu24", "--rounds", "2", "--steps", "1", "--warmup", "1", "--device", "cpu",
                        "--layers", "1", "--out", str(out), "--precisions", "none", "logging.wandb.mode=disabled"],
                       capture_output=True, text=True, env=BASE_ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    measured = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [m["ffn"] for m in measured] == ["swiglu", "srelu24", "srelu24", "swiglu"]
    results = json.loads(out.read_text())["results"]
    assert [x["ffn"] for x in results] == ["swiglu", "srelu24"]
    for x in results:
        own = [m["tokens_per_s"] for m in measured if m["ffn"] == x["ffn"]]
        assert [rd["tokens_per_s"] for rd in x["rounds"]] == own  # every round, in the order run
        assert all({"step_j", "sm_clock_mhz", "temp_c"} <= set(rd) for rd in x["rounds"])  # None without a GPU
        assert x["tokens_per_s"] == min(own)  # the median round's row: the lower middle one of two
    each = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[1]["rounds"], results[0]["rounds"])]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("srelu24 fp32 / swiglu fp32 in each of 2 rounds"))
    assert line.endswith(f"; median {min(each):.3f}x")  # the lower middle one, as for the rows
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "+experiment=demo", "--rounds", "0"],
                       capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 2 and "--steps and --rounds must be positive; got 1024, 1, 10, 0" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "+experiment=demo", "--rounds", "3",
                        "--energy", "1"], capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 2 and "run --profile, --profile-host or --energy in a command of one round" in r.stderr

def test_fsdp_sweep_under_torchrun_on_two_cpu_processes(launched):
    """The 2-GPU FSDP2 measurement's code path, on 2 CPU processes (gloo): rank 0 alone reports,
    tokens/s counts both ranks."""
    launched["test_fsdp_sweep_under_torchrun_on_two_cpu_processes"].result()


def check_fsdp_sweep_under_torchrun_on_two_cpu_processes(tmp_path):
    out = tmp_path / "bench.json"
    log = tmp_path / "torchrun.log"
    p = start_torchrun(["--ffn-sweep", "--steps", "1", "--warmup", "1", "--device", "cpu", "--layers", "1",
                        "--out", str(out), "+experiment=demo", "trainer.strategy=fsdp", "trainer.micro_batch_size=4",
                        "trainer.dist_timeout_s=60"], log, script=ROOT / "scripts" / "bench_step.py")
    text = wait(p, log)
    results = json.loads(out.read_text())["results"]
    assert [x["ffn"] for x in results] == ["swiglu", "srelu", "srelu24"]
    for x in results:
        assert (x["world_size"], x["strategy"], x["micro_batch"]) == (2, "fsdp", 4)
        assert x["tokens_per_s"] == pytest.approx(2 * 4 * x["seq_len"] / (x["step_ms"] / 1e3))
    assert text.count("| srelu24 |") == 1  # one table, from rank 0
    assert "on 2 x CPU (fsdp" in text


def test_host_profile_on_cpu_names_the_costliest_ops(launched):
    """--profile-host: the host's self CPU time per step by thread and its costliest ops, in the
    JSON and the printout (a step that waits on the host is measured by where that time goes)."""
    launched["test_host_profile_on_cpu_names_the_costliest_ops"].result()


def check_host_profile_on_cpu_names_the_costliest_ops(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "+experiment=demo", "--ffns", "srelu24",
                        "--steps", "1", "--warmup", "1", "--device", "cpu", "--layers", "1", "--profile-host", "2",
                        "--out", str(out), "--precisions", "none", "logging.wandb.mode=disabled"],
                       capture_output=True, text=True, env=BASE_ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (x,) = json.loads(out.read_text())["results"]
    threads = x["host_self_ms_per_step_by_thread"]
    assert threads == sorted(threads, reverse=True) and sum(threads) == pytest.approx(x["host_self_ms_per_step"], rel=1e-3)
    assert 0 < x["host_self_ms_per_step"] and 0 < x["host_wall_ms_per_step"]
    ops = x["top_host_ops"]
    assert ops and all(ms > 0 and n > 0 for _, ms, n in ops) and [ms for _, ms, _ in ops] == sorted(
        (ms for _, ms, _ in ops), reverse=True)
    assert any(name.startswith("aten::") for name, _, _ in ops)  # the model's ops, not only the profiler's
    assert "srelu24 fp32: host ops' self CPU time" in r.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--profile-host", "-1",
                          "+experiment=demo"], capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert bad.returncode == 2 and "--profile-host" in bad.stderr.splitlines()[-1]


def test_bad_input_under_torchrun_is_one_line_from_the_first_rank(launched):
    """Every rank fails alike on a bad --weights; only rank 0 says so, and torchrun exits non-zero."""
    launched["test_bad_input_under_torchrun_is_one_line_from_the_first_rank"].result()


def check_bad_input_under_torchrun_is_one_line_from_the_first_rank(tmp_path):
    log = tmp_path / "torchrun.log"
    p = start_torchrun(["--weights", str(tmp_path / "no_such_checkpoint"), "--device", "cpu", "+experiment=demo"],
                       log, script=ROOT / "scripts" / "bench_step.py")
    assert p.wait(timeout=300) != 0
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("error: --weights")]
    assert len(lines) == 1 and "not a checkpoint of this trainer" in lines[0], log.read_text()[-3000:]


def test_bench_ffn_replots_a_saved_breakdown_without_a_gpu(launched):
    """The breakdown figure is redrawn from a saved GPU result on any machine."""
    launched["test_bench_ffn_replots_a_saved_breakdown_without_a_gpu"].result()


def check_bench_ffn_replots_a_saved_breakdown_without_a_gpu(tmp_path):
    import shutil

    saved = tmp_path / "bench_ffn.json"
    shutil.copy(ROOT / "benchmarks" / "results" / "ffn_breakdown_7b_1b.json", saved)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ffn.py"), "--replot", str(saved)],
                       capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    png = saved.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text('{"breakdown": {}}')
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_ffn.py"), "--replot", str(empty)],
                       capture_output=True, text=True, env=BASE_ENV, timeout=120)
    assert r.returncode != 0 and "has no breakdown" in r.stderr


def test_profiled_busy_time_counts_overlapping_kernels_once():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_step import union_length

    assert union_length([]) == 0.0
    assert union_length([(0, 10), (2, 5), (8, 12), (20, 21)]) == 13.0  # [0, 12] and [20, 21]
    assert union_length([(0, 1), (1, 2)]) == 2.0


# ---------------------------------------------------------------- steps from a run's weights, on its text


def test_a_checkpoints_weights_load_into_a_model_of_its_shape_only(tmp_path):
    """srelu's weights serve srelu24 (the same shapes) bit for bit; swiglu's shape is refused in one
    line that names both shapes."""
    import torch

    from model import FFNConfig, ModelConfig, Transformer
    from training.checkpoint import CheckpointError, load_weights_into, model_shape, save_checkpoint

    mcfg = ModelConfig(name="t", dim=32, n_layers=2, n_heads=4, swiglu_hidden=64, max_seq_len=32)
    torch.manual_seed(0)
    trained = Transformer(mcfg, FFNConfig(kind="srelu", hidden_dim=64), 97)
    path = save_checkpoint(tmp_path / "run", 3, {"model": trained.state_dict(), "model_shape": model_shape(trained)})
    torch.manual_seed(1)
    fresh = Transformer(mcfg, FFNConfig(kind="srelu24", hidden_dim=64, kernels=False), 97)
    assert not torch.equal(fresh.layers[0].feed_forward.w1.weight, trained.layers[0].feed_forward.w1.weight)
    load_weights_into(path, fresh)
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(CheckpointError, match="holds a model of shape .*ffn_gated=False.* but the config builds .*ffn_gated=True"):
        load_weights_into(path, Transformer(mcfg, FFNConfig(kind="swiglu"), 97))


def test_bench_step_from_a_runs_weights_on_its_text(launched):
    """A tiny srelu run's checkpoint measured as srelu and srelu24 on the run's training split; a
    path that is no checkpoint is one line before any work."""
    launched["test_bench_step_from_a_runs_weights_on_its_text"].result()


def check_bench_step_from_a_runs_weights_on_its_text(tmp_path, corpus, cache):
    from helpers import run_train, tiny_overrides, with_cache

    args = with_cache(tiny_overrides(tmp_path, corpus), cache)
    r = run_train(args + ["ffn=srelu", "trainer.max_steps=2", "trainer.ckpt_every=2", "trainer.eval_every=2"])
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    overrides = [a for a in args if not a.startswith("hydra.")] + ["trainer.compile=false"]
    out = tmp_path / "bench.json"
    bench = [sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--ffns", "srelu,srelu24", "--steps", "1",
             "--warmup", "1", "--device", "cpu", "--precisions", "none", "--out", str(out), *overrides]
    r = subprocess.run(bench + ["--weights", str(ckpt), "--tokens", "data"], capture_output=True, text=True, env=BASE_ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(x["ffn"], x["weights"], x["tokens"]) for x in rows] == [("srelu", str(ckpt), "data"),
                                                                      ("srelu24", str(ckpt), "data")]
    r = subprocess.run(bench + ["--weights", str(ckpt), "--ffns", "srelu"], capture_output=True, text=True, env=BASE_ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]  # random tokens over the checkpoint's vocabulary
    assert json.loads(out.read_text())["results"][0]["tokens"] == "random"
    r = subprocess.run(bench + ["--weights", str(tmp_path / "run")], capture_output=True, text=True, env=BASE_ENV,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --weights ")
    assert "not a checkpoint of this trainer" in r.stderr
