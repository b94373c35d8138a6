"""Fault tolerance: "a crash never costs more than the steps since the last checkpoint, and
never corrupts one". kill -9 at random moments, half-written and damaged checkpoints,
SIGTERM / SIGUSR1, non-finite steps, a full disk, keep_last and a corrupted shard.
See docs/RELIABILITY.md for the table of faults and where each is tested."""
import errno
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from helpers import BASE_ENV, ROOT, background, compose_config, run_train, tiny_overrides, with_cache
from wandb_records import records, run_info

pytestmark = pytest.mark.slow

KILL_STEPS = 50   # steps of the kill -9 run
MIN_KILLS = 20
SIGNAL_STEPS = 60


# ---------------------------------------------------------------- helpers

def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_row_per_step(run_dir: Path) -> dict:
    """metrics.jsonl after resumes repeats the steps redone since the last checkpoint: the last wins."""
    return {m["step"]: m for m in metrics(run_dir)}


def losses(run_dir: Path) -> dict:
    return {s: (m.get("loss"), m.get("val_loss")) for s, m in sorted(last_row_per_step(run_dir).items())}


def weights(ckpt: Path) -> dict:
    from training.checkpoint import load_checkpoint

    return load_checkpoint(ckpt)["model"]


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs between {a} and {b}"


def snapshot(d: Path) -> dict:
    """Every file under d (checkpoint directories included): relative path -> bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.is_dir() else {}


def entries(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def temp_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp")) if d.is_dir() else []


def popen_train(args: list[str], log: Path) -> subprocess.Popen:
    env = {**BASE_ENV, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def count_rows(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def listing(d: Path) -> frozenset:
    try:
        return frozenset(os.listdir(d))
    except FileNotFoundError:
        return frozenset()


def overrides(tmp: Path, corpus: Path, cache: Path, extra=()) -> list[str]:
    return with_cache(tiny_overrides(tmp, corpus, extra), cache)


def train_in_process(tmp: Path, corpus: Path, cache: Path, extra=()) -> dict:
    """training.loop.train in this process (so it can be monkeypatched); run dir tmp/'run'."""
    from training.loop import train

    run_dir = tmp / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    dcfg = compose_config([a for a in overrides(tmp, corpus, cache, extra) if not a.startswith("hydra.")])
    return train(dcfg, run_dir, "reliability")


@pytest.fixture
def keep_signal_handlers():
    """train() installs SIGTERM/SIGUSR1/SIGUSR2 handlers and restores them only when it returns normally."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


# ---------------------------------------------------------------- 1. kill -9, many times

KILL_EXTRA = [f"trainer.max_steps={KILL_STEPS}", "trainer.ckpt_every=1", "trainer.keep_last=2",
              "trainer.log_every=1", "trainer.eval_every=10"]


def straight_run(tmp: Path, corpus: Path, cache: Path, extra: list[str]) -> Path:
    """An uninterrupted run, the reference an interrupted one is compared with."""
    r = run_train(overrides(tmp, corpus, cache, extra))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1}


@background
def launches(ctx):
    """The module's subprocess work (helpers.background): the reference runs several tests read,
    and the checks of the tests that only launch train.py; each test waits for its own. The longest
    first; a check waits for its reference run only to compare."""
    corpus, cache = ctx.corpus, ctx.cache

    def job(check, name, *args):
        tmp = ctx.tmp(name)
        return lambda: check(tmp, corpus, cache, *args)

    def after(check, name, ref, *args):  # a check that compares with the reference run `ref`
        tmp = ctx.tmp(name)
        return lambda: check(tmp, corpus, cache, ctx.futures[ref], *args)

    jobs = {
        "straight_kill": job(straight_run, "straight", KILL_EXTRA),
        "test_kill_9_at_random_moments_resumes_exactly": after(check_kill_9_at_random_moments_resumes_exactly, "kill",
                                                               "straight_kill"),
        "straight_signal": job(straight_run, "straight_signal", SIGNAL_EXTRA),
        **{f"test_preemption_signal_checkpoints_and_resumes[{name}]": after(check_preemption_signal, "signal",
                                                                            "straight_signal", sig)
           for name, sig in SIGNALS.items()},
        "test_half_written_and_damaged_checkpoints_are_skipped": job(
            check_half_written_and_damaged_checkpoints_are_skipped, "damaged"),
        "test_wandb_keeps_the_training_step_and_the_name_after_a_resume": job(
            check_wandb_keeps_the_training_step_and_the_name_after_a_resume, "wandb"),
        "stopped_srelu24": job(stopped_run, "stopped"),
        "test_resume_overrides_allow_the_listed_change": after(check_resume_overrides_allow_the_listed_change,
                                                               "overrides", "stopped_srelu24"),
        "test_token_id_past_vocabulary_names_the_shard": job(check_token_id_past_vocabulary_names_the_shard, "token"),
        "test_checkpoints_that_cannot_fit_stop_the_run_before_training": job(
            check_checkpoints_that_cannot_fit_stop_the_run_before_training, "space"),
    }
    needed_by = {"straight_kill": ["test_kill_9_at_random_moments_resumes_exactly",
                                   "test_keep_last_keeps_the_newest_complete_checkpoints",
                                   "test_resuming_a_finished_run_says_it_is_complete_and_changes_nothing"],
                 "straight_signal": ["test_preemption_signal_checkpoints_and_resumes"],
                 "stopped_srelu24": ["test_resume_that_would_change_the_schedule_or_ffn_stops",
                                     "test_resume_overrides_allow_the_listed_change"]}
    return jobs, needed_by


@pytest.fixture(scope="module")
def straight_kill_run(launched):
    """The uninterrupted reference for the kill -9 test (also the keep_last test's run)."""
    return launched["straight_kill"].result()


def _kill_when(p: subprocess.Popen, run_dir: Path, mode: str, rng: random.Random, deadline: float) -> None:
    """Wait for the moment `mode` picks (or the process to end), with sub-second jitter."""
    ckpt_dir = run_dir / "checkpoints"
    rows0 = count_rows(run_dir)
    if mode == "startup":  # imports, config, shards, model build, resume: before this attempt's first row
        end = time.monotonic() + rng.uniform(0.05, 2.5)
        while p.poll() is None and time.monotonic() < end and count_rows(run_dir) == rows0:
            time.sleep(0.002)
        return
    if mode == "training":  # a row or two logged by this attempt, then jitter: mid-step or mid-save
        want = rows0 + rng.randint(1, 2)
        while p.poll() is None and count_rows(run_dir) < want and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.02))
        return
    # "checkpoint": the first change in the checkpoints dir (a new temp directory, the rename of a
    # complete one, a pruned one), then at most a few ms
    before = listing(ckpt_dir)
    while p.poll() is None and listing(ckpt_dir) == before and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(rng.choice([0.0, 0.0, rng.uniform(0.0, 0.01)]))


def test_kill_9_at_random_moments_resumes_exactly(launched):
    """>= 20 SIGKILLs during start-up, training and checkpoint writes (synchronous and
    asynchronous ones); restart with trainer.resume=auto until done: final weights and every
    step's loss equal a straight run's."""
    launched["test_kill_9_at_random_moments_resumes_exactly"].result()


def check_kill_9_at_random_moments_resumes_exactly(tmp_path, corpus, cache, straight: Future):
    rng = random.Random(1234)
    args = overrides(tmp_path, corpus, cache, KILL_EXTRA + ["trainer.resume=auto"])
    run_dir = tmp_path / "run"
    kills, modes, attempts, leftovers = 0, {"startup": 0, "training": 0, "checkpoint": 0}, 0, set()
    while True:
        attempts += 1
        assert attempts <= 150, f"no completion after {attempts} attempts ({kills} kills)"
        log = tmp_path / f"attempt_{attempts:03d}.log"
        # odd attempts save in the background (the GPU default), even ones synchronously: kills land in both
        p = popen_train(args + [f"trainer.async_checkpoint={str(attempts % 2 == 1).lower()}"], log)
        deadline = time.monotonic() + 120
        if kills >= MIN_KILLS:  # enough: let this one finish
            rc = p.wait(timeout=300)
            assert rc == 0, log.read_text()[-3000:]
            break
        mode = rng.choices(["startup", "training", "checkpoint"], weights=[3, 4, 3])[0]
        _kill_when(p, run_dir, mode, rng, deadline)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=60)
        if rc == -signal.SIGKILL:
            kills += 1
            modes[mode] += 1
            leftovers.update(temp_files(run_dir / "checkpoints"))
            continue
        assert rc == 0, log.read_text()[-3000:]
        break  # finished before we killed it
    print(f"{kills} kills in {attempts} attempts: {modes}; partial temp files left by kills: {len(leftovers)}")
    assert kills >= MIN_KILLS, f"only {kills} kills landed before the run finished ({modes})"
    assert min(modes.values()) >= 2, modes  # start-up, training and checkpoint moments all hit

    # the run reached its last step, and resumed at least once from a checkpoint
    assert "resumed from" in "".join(p.read_text() for p in tmp_path.glob("attempt_*.log"))
    final = ckpt(run_dir, KILL_STEPS)
    assert final.is_dir()
    straight_kill_run = straight.result()
    assert_same_weights(final, ckpt(straight_kill_run, KILL_STEPS))
    mine, ref = losses(run_dir), losses(straight_kill_run)
    assert sorted(mine) == list(range(1, KILL_STEPS + 1))
    assert mine == ref

    # nothing in the dir is a complete-looking but broken checkpoint; the partial temp files of
    # killed processes were ignored by every resume and removed by the next successful save
    from training.checkpoint import find_resume_checkpoint, list_checkpoints, verify_checkpoint

    complete = list_checkpoints(run_dir)
    assert complete and complete[0] == final
    for c in complete:
        verify_checkpoint(c)
    assert all(not t.startswith("step_") for t in leftovers)  # temp names never look like checkpoints
    assert temp_files(run_dir / "checkpoints") == []
    path, state = find_resume_checkpoint("auto", run_dir)
    assert path == final and state["step"] == KILL_STEPS


# ---------------------------------------------------------------- 2. crash mid-write, damaged files

def test_half_written_and_damaged_checkpoints_are_skipped(launched):
    launched["test_half_written_and_damaged_checkpoints_are_skipped"].result()


def check_half_written_and_damaged_checkpoints_are_skipped(tmp_path, corpus, cache):
    extra = ["trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.keep_last=0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    r = run_train(overrides(straight, corpus, cache, extra))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(overrides(split, corpus, cache, extra + ["trainer.stop_at_step=4"]))
    assert r.returncode == 0, r.stderr[-3000:]
    run = split / "run"
    d = run / "checkpoints"
    good = ckpt(run, 4)
    shards = sorted(good.glob("*.distcp"))
    assert shards
    # a crash in the middle of writing step 5: a temp directory with a partial shard
    part = d / ".step_00000005.tmp"
    part.mkdir()
    (part / shards[0].name).write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 3])
    # a directory that looks like step 6 but has no manifest (copied by hand, say): not complete
    shutil.copytree(good, ckpt(run, 6))
    (ckpt(run, 6) / "manifest.json").unlink()
    # bit rot / a torn write: step 7 whose bytes do not match its manifest
    shutil.copytree(good, ckpt(run, 7))
    flipped = bytearray((ckpt(run, 7) / shards[0].name).read_bytes())
    for i in range(len(flipped) // 2, len(flipped) // 2 + 8):
        flipped[i] ^= 0xFF
    (ckpt(run, 7) / shards[0].name).write_bytes(bytes(flipped))

    r = run_train(overrides(split, corpus, cache, extra + ["trainer.resume=auto"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping damaged checkpoint" in r.stderr and "step_00000007" in r.stderr
    assert f"the xxh3_128 checksum of {shards[0].name} does not match its manifest" in r.stderr
    assert f"resumed from {good} at step 4" in r.stdout
    assert temp_files(d) == []  # the next successful save removed the partial write
    assert "step_00000006" not in r.stderr  # never considered: no manifest, so not a checkpoint
    assert (ckpt(run, 6) / "manifest.json").is_file()  # step 6 was saved again, over the incomplete one
    assert_same_weights(ckpt(run, 8), ckpt(straight / "run", 8))
    assert losses(run) == losses(straight / "run")

    # the run's messages are in Hydra's job log (train.log), and its last line says where it is
    log = (run / "train.log").read_text()
    for part in (f"run {run}: tiny ffn=swiglu", "removed what killed processes left", ".step_00000005.tmp",
                 "skipping damaged checkpoint", f"resumed from {good} at step 4", "step 8: val_loss",
                 "checkpoint step 8: stall", f"done: {run}; final train loss"):
        assert part in log, (part, log)
    m = re.fullmatch(rf"done: {re.escape(str(run))}; final train loss (\S+), validation loss (\S+); compare runs with: "
                     rf"python scripts/compare\.py {re.escape(str(run))}", r.stdout.strip().splitlines()[-1])
    assert m, r.stdout[-2000:]
    assert float(m.group(1)) == pytest.approx(losses(run)[8][0], abs=1e-4)
    assert float(m.group(2)) == pytest.approx(losses(run)[8][1], abs=1e-4)


# ---------------------------------------------------------------- 3. SIGTERM / SIGUSR1

SIGNAL_EXTRA = [f"trainer.max_steps={SIGNAL_STEPS}", "trainer.ckpt_every=1000", "trainer.eval_every=1000",
                "trainer.log_every=1"]


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_preemption_signal_checkpoints_and_resumes(launched, sig):
    launched[f"test_preemption_signal_checkpoints_and_resumes[{sig}]"].result()


def check_preemption_signal(tmp_path, corpus, cache, straight: Future, sig):
    args = overrides(tmp_path, corpus, cache, SIGNAL_EXTRA)
    run = tmp_path / "run"
    log = tmp_path / "signalled.log"
    p = popen_train(args, log)
    deadline = time.monotonic() + 120
    while p.poll() is None and count_rows(run) < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert p.poll() is None, log.read_text()[-3000:]
    p.send_signal(sig)
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    out = log.read_text()
    m = re.search(r"stopped at step (\d+) \(signal (\w+)\)", out)
    assert m, out[-3000:]
    stopped = int(m.group(1))
    assert m.group(2) == sig.name and "trainer.resume=auto" in out
    assert 3 <= stopped < SIGNAL_STEPS
    from training.checkpoint import list_checkpoints, verify_checkpoint
    assert list_checkpoints(run) == [ckpt(run, stopped)]  # ckpt_every is 1000: this one is the signal's
    verify_checkpoint(ckpt(run, stopped))
    assert max(m["step"] for m in metrics(run)) == stopped

    r = run_train(args + ["trainer.resume=auto"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {stopped}" in r.stdout
    straight_signal_run = straight.result()
    assert_same_weights(ckpt(run, SIGNAL_STEPS), ckpt(straight_signal_run, SIGNAL_STEPS))
    assert losses(run) == losses(straight_signal_run)


# ---------------------------------------------------------------- 4. non-finite loss / weights

NAN_STEP = 5
NF_EXTRA = ["trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.keep_last=0", "trainer.eval_every=100"]


def nan_at_step(monkeypatch, step: int, on_nan=lambda model: None) -> list:
    """Make the training loss NaN on the first micro-batch of `step` (1-based); 2 micro-batches a step."""
    from model.transformer import Transformer

    real, calls, names = Transformer.forward, [0], []

    def forward(self, *a, **k):
        loss = real(self, *a, **k)
        if not self.training:  # evaluation
            return loss
        calls[0] += 1
        if calls[0] == 2 * (step - 1) + 1:
            names.extend(n for n, _ in self.named_parameters())
            on_nan(self)
            return loss * float("nan")
        return loss

    monkeypatch.setattr(Transformer, "forward", forward)
    return names


def test_nonfinite_skip_counts_and_keeps_weights_finite(tmp_path, corpus, cache, monkeypatch,
                                                        keep_signal_handlers, caplog):
    nan_at_step(monkeypatch, NAN_STEP)
    train_in_process(tmp_path, corpus, cache, NF_EXTRA + ["trainer.nonfinite=skip"])
    run = tmp_path / "run"
    rows = last_row_per_step(run)
    assert sorted(rows) == list(range(1, 9))
    assert [rows[s]["skipped_steps"] for s in range(1, 9)] == [0] * (NAN_STEP - 1) + [1] * (9 - NAN_STEP)
    assert math.isnan(rows[NAN_STEP]["loss"])
    assert all(math.isfinite(rows[s]["loss"]) for s in rows if s != NAN_STEP)
    for k, w in weights(ckpt(run, 8)).items():
        assert torch.isfinite(w).all(), k
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # train.log and stderr
    assert any(f"step {NAN_STEP}: non-finite gradient, step skipped" in m for m in warned), warned


def test_nonfinite_skip_on_the_device_is_settled_for_checkpoints(tmp_path, corpus, cache, monkeypatch,
                                                                  keep_signal_handlers, caplog):
    """Fused AdamW on one process skips on the device: the count is read back on logged steps
    (4, 8) and before each checkpoint (2, 4, 6, 8), so step 6's checkpoint already has it."""
    from training.checkpoint import read_train_state

    nan_at_step(monkeypatch, NAN_STEP)
    train_in_process(tmp_path, corpus, cache, NF_EXTRA + ["trainer.nonfinite=skip", "optim.fused=true",
                                                          "trainer.log_every=4"])
    run = tmp_path / "run"
    assert [read_train_state(ckpt(run, s))["skipped_steps"] for s in (2, 4, 6, 8)] == [0, 0, 1, 1]
    assert {s: r["skipped_steps"] for s, r in last_row_per_step(run).items() if "loss" in r} == {4: 0, 8: 1}
    for k, w in weights(ckpt(run, 8)).items():
        assert torch.isfinite(w).all(), k
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"steps {NAN_STEP}-6: 1 non-finite gradient step skipped (1 so far)" in warned, warned


def test_nonfinite_stop_names_step_and_tensor(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers):
    from training.errors import TrainingError

    d = tmp_path / "run" / "checkpoints"
    before = {}
    names = nan_at_step(monkeypatch, NAN_STEP, on_nan=lambda model: before.update(snapshot(d)))
    with pytest.raises(TrainingError) as e:
        train_in_process(tmp_path, corpus, cache, NF_EXTRA + ["trainer.nonfinite=stop"])
    msg = str(e.value)
    assert f"step {NAN_STEP}:" in msg and "non-finite" in msg and "trainer.nonfinite=stop" in msg
    assert any(n in msg for n in names), msg
    assert sorted({k.split("/")[0] for k in before}) == ["step_00000002", "step_00000004"]
    assert snapshot(d) == before and entries(d) == ["step_00000002", "step_00000004"]  # nothing written or touched


def test_refuses_to_checkpoint_nonfinite_weights(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers):
    import training.loop
    from training.errors import TrainingError

    d = tmp_path / "run" / "checkpoints"
    before, real_build = {}, training.loop.build_optimizer

    def build(*a, **k):
        opt = real_build(*a, **k)
        real_step, n = opt.step, [0]

        def step(*sa, **sk):
            out = real_step(*sa, **sk)
            n[0] += 1
            if n[0] == 3:  # after step 3's update: a NaN in the weights (a bad kernel, a bit flip)
                before.update(snapshot(d))
                with torch.no_grad():
                    opt.param_groups[0]["params"][0].view(-1)[0] = float("nan")
            return out

        opt.step = step
        return opt

    monkeypatch.setattr(training.loop, "build_optimizer", build)
    with pytest.raises(TrainingError, match=r"step 3: refusing to checkpoint .*non-finite weights"):
        train_in_process(tmp_path, corpus, cache, ["trainer.max_steps=6", "trainer.ckpt_every=1",
                                                   "trainer.keep_last=0"])
    assert sorted({k.split("/")[0] for k in before}) == ["step_00000001", "step_00000002"]
    assert snapshot(d) == before and entries(d) == ["step_00000001", "step_00000002"]


# ---------------------------------------------------------------- 5. disk full while saving

@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["tensors", "rank_state"])
def test_disk_full_while_saving_keeps_previous_checkpoint(tmp_path, corpus, cache, monkeypatch,
                                                          keep_signal_handlers, where, asynchronous):
    """ENOSPC is simulated (tests run as root: a read-only dir would not stop us) inside DCP's file
    writer (the model/optimizer shards) or in the write of the rank's own state. Written in the
    background, the error is raised at the next save (step 6), which is not started."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import training.checkpoint as ck
    from training.errors import CheckpointError

    def full(f):  # some bytes got out before the disk filled
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "tensors":
        real = dcp_fs._write_item

        def write_item(transforms, stream, *a, **k):
            if "step_00000004" in str(getattr(stream, "name", "")):
                full(stream)
            return real(transforms, stream, *a, **k)

        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    else:
        real = ck._write

        def write(path, fn):
            if "step_00000004" in str(path) and path.name.startswith("rank_"):
                with open(path, "wb") as f:
                    full(f)
            return real(path, fn)

        monkeypatch.setattr(ck, "_write", write)
    with pytest.raises(CheckpointError) as e:
        train_in_process(tmp_path, corpus, cache, ["trainer.max_steps=6", "trainer.ckpt_every=2",
                                                   "trainer.keep_last=1", f"trainer.async_checkpoint={asynchronous}"])
    run = tmp_path / "run"
    msg = str(e.value)
    assert "No space left on device" in msg and "step_00000004" in msg and "intact" in msg, msg
    assert entries(run / "checkpoints") == ["step_00000002"]  # the temp directory is gone
    ck.verify_checkpoint(ckpt(run, 2))
    assert ck.find_resume_checkpoint("auto", run)[0] == ckpt(run, 2)


def test_a_stop_whose_save_fails_does_not_say_it_saved(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers,
                                                       caplog):
    """A stop (trainer.stop_at_step, as a signal's) waits for its checkpoint, written in the
    background, before saying it is saved: a full disk there ends in its error, not that line."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from training.errors import CheckpointError

    real = dcp_fs._write_item

    def write_item(transforms, stream, *a, **k):
        if "step_00000004" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    with caplog.at_level("INFO"), pytest.raises(CheckpointError, match="disk full"):
        train_in_process(tmp_path, corpus, cache, ["trainer.max_steps=8", "trainer.ckpt_every=100",
                                                   "trainer.stop_at_step=4", "trainer.async_checkpoint=true"])
    assert "stopped at step 4" not in caplog.text and "checkpoint saved" not in caplog.text


def test_a_failed_last_save_still_closes_the_logs(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers):
    """The run's last checkpoint, written in the background, fails at the end: its error ends the
    run, and metrics.jsonl and wandb are closed all the same."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import training.logger as logger
    from training.errors import CheckpointError

    real, closed = dcp_fs._write_item, []

    def write_item(transforms, stream, *a, **k):
        if "step_00000004" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    real_close = logger.RunLogger.close
    monkeypatch.setattr(logger.RunLogger, "close", lambda self: closed.append(True) or real_close(self))
    with pytest.raises(CheckpointError, match="disk full"):
        train_in_process(tmp_path, corpus, cache, ["trainer.max_steps=4", "trainer.ckpt_every=100",
                                                   "trainer.async_checkpoint=true"])
    assert closed and [m["step"] for m in metrics(tmp_path / "run")][-1] == 4


# ---------------------------------------------------------------- 6. keep_last

def test_keep_last_keeps_the_newest_complete_checkpoints(straight_kill_run):
    from training.checkpoint import verify_checkpoint

    last = [f"step_{KILL_STEPS - 1:08d}", f"step_{KILL_STEPS:08d}"]
    assert entries(straight_kill_run / "checkpoints") == last
    for n in last:
        verify_checkpoint(straight_kill_run / "checkpoints" / n)


def test_resuming_a_finished_run_says_it_is_complete_and_changes_nothing(straight_kill_run, corpus, cache, caplog,
                                                                      keep_signal_handlers):
    import logging

    caplog.set_level(logging.INFO)
    before = snapshot(straight_kill_run)
    summary = train_in_process(straight_kill_run.parent, corpus, cache, [*KILL_EXTRA, "trainer.resume=auto"])
    assert summary["complete_at_step"] == KILL_STEPS
    assert all(math.isfinite(v) for v in summary.values() if isinstance(v, float))
    said = [r.getMessage() for r in caplog.records]
    assert said[-1].startswith(f"run complete at step {KILL_STEPS} ({ckpt(straight_kill_run, KILL_STEPS)}); "
                               f"nothing to do"), said
    assert not [m for m in said if "nan" in m.lower()]
    assert snapshot(straight_kill_run) == before  # nothing built, written or pruned


# ---------------------------------------------------------------- 7. corrupted shard

def test_token_id_past_vocabulary_names_the_shard(launched):
    launched["test_token_id_past_vocabulary_names_the_shard"].result()


def check_token_id_past_vocabulary_names_the_shard(tmp_path, corpus, cache):
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine)
    shard_dir = next(p.parent for p in mine.glob("*/manifest.json"))
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    shard = shard_dir / manifest["splits"]["train"][0]["file"]
    ids = np.memmap(shard, dtype=manifest["dtype"], mode="r+")
    ids[::7] = manifest["vocab_size"] + 3  # every window sees one
    ids.flush()
    del ids
    r = run_train(overrides(tmp_path, corpus, mine, ["trainer.max_steps=2"]))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("error: ") and str(shard) in lines[0] and "vocabulary size" in lines[0]


# ---------------------------------------------------------------- 8. SIGTERM during a background write

def test_sigterm_during_an_async_write_waits_for_it(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers,
                                                   caplog):
    """The signal arrives while step 4 is being written in the background (and the write takes a
    second): the loop checkpoints at the next step boundary, which waits for step 4, and returns
    only once both are complete."""
    import logging

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from training.checkpoint import list_checkpoints, verify_checkpoint

    caplog.set_level(logging.INFO)
    real, sent = dcp_fs._write_item, []

    def write_item(transforms, stream, *a, **k):
        if "step_00000004" in str(getattr(stream, "name", "")) and not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)  # preemption, mid-write
            time.sleep(1.0)
        return real(transforms, stream, *a, **k)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    train_in_process(tmp_path, corpus, cache, ["trainer.max_steps=40", "trainer.ckpt_every=4", "trainer.keep_last=0",
                                               "trainer.eval_every=100", "trainer.async_checkpoint=true"])
    run = tmp_path / "run"
    stopped = [int(m.group(1)) for r in caplog.records
               if (m := re.match(r"stopped at step (\d+) \(signal SIGTERM\)", r.getMessage()))]
    assert len(stopped) == 1 and 4 < stopped[0] < 40, stopped
    assert entries(run / "checkpoints") == ["step_00000004", f"step_{stopped[0]:08d}"]  # no temp directory
    assert list_checkpoints(run)[0] == ckpt(run, stopped[0])
    for c in list_checkpoints(run):
        verify_checkpoint(c)


# ---------------------------------------------------------------- 9. resume that would change the run

GUARD_EXTRA = ["ffn=srelu24", "ffn.hidden_dim=128", "ffn.dense_warmup_steps=2", "trainer.max_steps=8",
               "trainer.ckpt_every=100"]


def stopped_run(tmp: Path, corpus: Path, cache: Path) -> Path:
    """An srelu24 run of 8 steps stopped (with a checkpoint) at step 4."""
    r = run_train(overrides(tmp, corpus, cache, GUARD_EXTRA + ["trainer.stop_at_step=4"]))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def stopped_srelu24(launched):
    return launched["stopped_srelu24"].result()


@pytest.mark.parametrize("change, named", [
    ("trainer.max_steps=16", "trainer.max_steps 8 -> 16"),
    ("optim.lr=1e-3", "optim.lr 0.003 -> 0.001"),
    ("optim.warmup_steps=5", "optim.warmup_steps 2 -> 5"),
    ("optim.schedule=wsd", "optim.schedule cosine -> wsd"),
    ("ffn=srelu", "ffn.kind srelu24 -> srelu"),
])
def test_resume_that_would_change_the_schedule_or_ffn_stops(tmp_path, corpus, cache, stopped_srelu24, change, named,
                                                            keep_signal_handlers):
    from training.errors import ConfigError

    run = tmp_path / "run"
    shutil.copytree(stopped_srelu24 / "run", run)
    before = snapshot(run / "checkpoints")
    extra = [a for a in GUARD_EXTRA if not (change.startswith("ffn=") and a.startswith("ffn="))]
    with pytest.raises(ConfigError) as e:
        train_in_process(tmp_path, corpus, cache, extra + [change, "trainer.resume=auto"])
    msg = str(e.value)
    assert "\n" not in msg and named in msg and "step_00000004" in msg, msg
    assert f"trainer.resume_overrides=[{named.split()[0]}]" in msg
    assert snapshot(run / "checkpoints") == before


def test_resume_overrides_allow_the_listed_change(launched):
    launched["test_resume_overrides_allow_the_listed_change"].result()


def check_resume_overrides_allow_the_listed_change(tmp_path, corpus, cache, stopped: Future):
    stopped_srelu24 = stopped.result()
    run = tmp_path / "run"
    shutil.copytree(stopped_srelu24 / "run", run)
    line = one_error_line(run_train(overrides(tmp_path, corpus, cache, GUARD_EXTRA[:-2] + [
        "trainer.max_steps=12", "trainer.resume=auto"])))
    assert line.startswith("error: resuming ") and "trainer.max_steps 8 -> 12" in line
    r = run_train(overrides(tmp_path, corpus, cache, GUARD_EXTRA[:-2] + [
        "trainer.max_steps=12", "trainer.resume=auto", "trainer.resume_overrides=[trainer.max_steps]"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 4; trainer.max_steps: 8 -> 12 (trainer.resume_overrides)" in r.stdout
    assert max(last_row_per_step(run)) == 12


def one_error_line(r) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------- 10. wandb across a resume

def wandb_steps(path: Path) -> list[int]:
    """The `_step` of every history row of an offline wandb run file."""
    steps = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            steps += [int(json.loads(item.value_json)) for item in rec.history.item
                      if (item.key or "/".join(item.nested_key)) == "_step"]
    return steps


def test_wandb_keeps_the_training_step_and_the_name_after_a_resume(launched):
    launched["test_wandb_keeps_the_training_step_and_the_name_after_a_resume"].result()


def check_wandb_keeps_the_training_step_and_the_name_after_a_resume(tmp_path, corpus, cache):
    args = [a for a in overrides(tmp_path, corpus, cache, ["trainer.max_steps=8", "trainer.ckpt_every=100"])
            if not a.startswith("logging.wandb.mode=")] + ["logging.wandb.mode=offline"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    r = run_train(args + ["trainer.stop_at_step=4"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(args + ["trainer.resume=auto"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert first.name == second.name  # one wandb run id
    assert wandb_steps(first) == [1, 2, 3, 4]
    assert wandb_steps(second) == [5, 6, 7, 8]  # the training step, not wandb's own count from 0
    name = run_info(first)["name"]
    assert run_info(second)["name"] == name and "stop_at_step" not in name and "resume" not in name


# ---------------------------------------------------------------- 11. free space before training

def test_checkpoints_that_cannot_fit_stop_the_run_before_training(launched):
    """keep_last=0 (keep all) with a save every step of a billion steps: petabytes."""
    launched["test_checkpoints_that_cannot_fit_stop_the_run_before_training"].result()


def check_checkpoints_that_cannot_fit_stop_the_run_before_training(tmp_path, corpus, cache):
    line = one_error_line(run_train(overrides(tmp_path, corpus, cache, [
        "trainer.max_steps=1000000000", "trainer.ckpt_every=1", "trainer.keep_last=0"])))
    assert line.startswith("error: not enough disk space for checkpoints in ") and "GB needed" in line
    assert "GB free" in line and "trainer.keep_last" in line and "trainer.check_space=false" in line
    assert not (tmp_path / "run").exists()  # nothing written, not even Hydra's run directory


def test_check_space_false_skips_the_check(tmp_path, corpus, cache, monkeypatch, keep_signal_handlers):
    import training.checkpoint as ck
    from training.errors import CheckpointError

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: type("Usage", (), {"free": 0})())
    with pytest.raises(CheckpointError, match="not enough disk space"):
        train_in_process(tmp_path / "a", corpus, cache, ["trainer.max_steps=2"])
    train_in_process(tmp_path / "b", corpus, cache, ["trainer.max_steps=2", "trainer.check_space=false"])
    assert entries(tmp_path / "b" / "run" / "checkpoints") == ["step_00000002"]


@pytest.mark.parametrize("ffn,compile", [("swiglu", False), ("srelu24", False), ("swiglu", True)])
def test_a_finished_run_leaves_its_model_and_optimizer_to_the_next_job(tmp_path, corpus, cache, monkeypatch,
                                                                        keep_signal_handlers, ffn, compile):
    """A multirun's jobs share one process: once train() returns, nothing of the run holds its
    weights, gradients or optimizer state, so the pre-flight (which returns the caching allocator's
    free blocks first) sees the next job's memory as free."""
    import gc
    import weakref

    import training.loop as loop

    held = {}
    step_parts = loop.step_parts

    def watched(run):
        parts = step_parts(run)
        held.update(model=weakref.ref(run.model), optimizer=weakref.ref(run.optimizer),
                    weight=weakref.ref(next(run.model.parameters())))
        return parts

    monkeypatch.setattr(loop, "step_parts", watched)
    extra = [f"ffn={ffn}", f"trainer.compile={str(compile).lower()}", "trainer.ckpt_every=100"]
    train_in_process(tmp_path, corpus, cache, extra + (["ffn.dense_warmup_steps=3"] if ffn == "srelu24" else []))
    gc.collect()
    alive = [name for name, ref in held.items() if ref() is not None]
    assert held and not alive, f"still referenced after the run: {alive}"
