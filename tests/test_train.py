"""The trainer end to end on CPU, in subprocesses: a run, exact resume, warmup switching,
and the start-up errors for data and checkpoints."""
import json
import math
from pathlib import Path

import pytest
import torch

from helpers import background, run_train, tiny_overrides

pytestmark = pytest.mark.slow

FFNS = ["swiglu", "srelu", "srelu24"]
RESUMED_FFNS = ["swiglu", "srelu24"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    from training.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(run_dir)[0])["model"]


def files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def overrides(tmp: Path, corpus: Path, cache: Path, extra=()):
    args = tiny_overrides(tmp, corpus, extra)
    return [a if not a.startswith("data.cache_dir=") else f"data.cache_dir={cache}" for a in args]


@background
def launches(ctx):
    """Each test's runs of train.py, and its checks (helpers.background; the shard cache is prepared
    before they start); each test waits for its own. The longest first."""
    def job(check, name, *args):
        tmp, corpus, cache = ctx.tmp(name), ctx.corpus, ctx.cache
        return lambda: check(tmp, corpus, cache, *args)

    jobs = {f"test_resume_is_exact[{ffn}]": job(check_resume_is_exact, "resume", ffn) for ffn in RESUMED_FFNS}
    trunc, corpus = ctx.tmp("trunc"), ctx.corpus
    jobs["test_truncated_shard_is_named"] = lambda: check_truncated_shard_is_named(trunc, corpus)
    jobs["test_resume_with_another_shape_names_both"] = job(check_resume_with_another_shape_names_both, "shape")
    jobs["test_shards_from_another_tokenizer"] = job(check_shards_from_another_tokenizer, "tokenizer")
    jobs.update({f"test_training_runs_and_learns[{ffn}]": job(check_training_runs_and_learns, "learns", ffn)
                 for ffn in FFNS})
    jobs["test_model_vocabulary_smaller_than_shards"] = job(check_model_vocabulary_smaller_than_shards, "vocab")
    return jobs


@pytest.mark.parametrize("ffn", FFNS)
def test_training_runs_and_learns(launched, ffn):
    launched[f"test_training_runs_and_learns[{ffn}]"].result()


def check_training_runs_and_learns(tmp_path, corpus, cache, ffn):
    extra = [f"ffn={ffn}", "ffn.dense_warmup_steps=4", "trainer.max_steps=12", "ffn.hidden_dim=128"]
    r = run_train(overrides(tmp_path, corpus, cache, extra))
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    rows = metrics(run)
    losses = [m["loss"] for m in rows if "loss" in m]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert any("val_loss" in m for m in rows)
    assert (run / "config_resolved.yaml").is_file() and (run / "run_info.json").is_file()
    assert [m["tokens"] for m in rows if "loss" in m][:2] == [8 * 32, 16 * 32]
    if ffn == "srelu24":  # dense for the warmup steps, 2:4 after
        assert [m["mode_2to4"] for m in rows if "loss" in m] == [0] * 4 + [1] * 8


@pytest.mark.parametrize("ffn", RESUMED_FFNS)
def test_resume_is_exact(launched, ffn):
    launched[f"test_resume_is_exact[{ffn}]"].result()


def check_resume_is_exact(tmp_path, corpus, cache, ffn):
    """2N steps straight == N steps, stop, resume, N more: bitwise weights and losses."""
    extra = [f"ffn={ffn}", "ffn.dense_warmup_steps=3", "ffn.hidden_dim=128", "trainer.ckpt_every=100"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    r = run_train(overrides(straight, corpus, cache, extra))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(overrides(split, corpus, cache, extra + ["trainer.stop_at_step=4"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(metrics(split / "run")) < len(metrics(straight / "run"))
    r = run_train(overrides(split, corpus, cache, extra + ["trainer.resume=auto"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    a, b = metrics(straight / "run"), metrics(split / "run")
    key = lambda rows: [(m["step"], m.get("loss"), m.get("val_loss")) for m in rows]  # noqa: E731
    assert key(a) == key(b)
    wa, wb = final_weights(straight / "run"), final_weights(split / "run")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_resume_with_another_shape_names_both(launched):
    launched["test_resume_with_another_shape_names_both"].result()


def check_resume_with_another_shape_names_both(tmp_path, corpus, cache):
    r = run_train(overrides(tmp_path, corpus, cache, ["trainer.max_steps=4"]))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(overrides(tmp_path, corpus, cache, ["trainer.max_steps=8", "model.dim=96",
                                                      "model.n_heads=2", "trainer.resume=auto"]))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "dim=64" in line and "dim=96" in line and "step_00000004" in line


def test_shards_from_another_tokenizer(launched):
    launched["test_shards_from_another_tokenizer"].result()


def check_shards_from_another_tokenizer(tmp_path, corpus, cache):
    """A run resumed on data whose tokenizer differs: clear error, checkpoint untouched."""
    r = run_train(overrides(tmp_path, corpus, cache, ["trainer.max_steps=4"]))
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    before = files(ckpt)
    r = run_train(overrides(tmp_path, corpus, cache, ["trainer.max_steps=8", "data.vocab_size=500",
                                                      "model.vocab_size=512", "trainer.resume=auto"]))
    assert r.returncode == 2
    assert "vocab" in r.stderr.strip().splitlines()[-1]
    assert files(ckpt) == before


def test_model_vocabulary_smaller_than_shards(launched):
    launched["test_model_vocabulary_smaller_than_shards"].result()


def check_model_vocabulary_smaller_than_shards(tmp_path, corpus, cache):
    r = run_train(overrides(tmp_path, corpus, cache, ["model.vocab_size=100"]))
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "model.vocab_size=100" in line and "512" in line


def test_truncated_shard_is_named(launched):
    launched["test_truncated_shard_is_named"].result()


def check_truncated_shard_is_named(tmp_path, corpus):
    args = tiny_overrides(tmp_path, corpus, ["trainer.max_steps=2"])
    r = run_train(args)
    assert r.returncode == 0, r.stderr[-3000:]
    shard = next((tmp_path / "cache").glob("*/train_*.bin"))
    shard.write_bytes(shard.read_bytes()[:-10])
    r = run_train(args)
    assert r.returncode == 2 and shard.name in r.stderr.strip().splitlines()[-1]
    shard.unlink()
    r = run_train(args)
    assert r.returncode == 2 and shard.name in r.stderr.strip().splitlines()[-1]


def test_the_last_line_names_only_the_losses_the_run_measured(tmp_path):
    """A run stopped before its first evaluation has no validation loss: no `nan` in its last line."""
    from training.logger import end_summary

    line = end_summary(tmp_path, {"final_train_loss": 4.25, "final_val_loss": math.nan})
    assert line == f"done: {tmp_path}; final train loss 4.2500; compare runs with: python scripts/compare.py {tmp_path}"
    both = end_summary(tmp_path, {"final_train_loss": 4.25, "final_val_loss": 4.5})
    assert "final train loss 4.2500, validation loss 4.5000;" in both
