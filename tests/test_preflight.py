"""The memory pre-flight (training/preflight.py): a run whose estimated peak does not fit the device
ends with one line, before the data, the model or any file, naming the estimate, the capacity and
settings that fit; within 15% of the capacity a warning; every rank judges the least capacity.
And the dry run's verdict for `python train.py +experiment=sparse_7b` on one H200, which is the
README's one-GPU command."""
import logging
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import training.checkpoint as ck
from helpers import ROOT, background, compose_config, run_train, tiny_overrides, to_config, to_object
from training.distributed import Dist
from training.errors import ConfigError
from training.memory import GiB, estimate, run_peak
from training.preflight import H200_FREE_GIB, MARGIN, Capacity, check_memory, device_capacity, judge

ONE_H200 = Capacity(int(H200_FREE_GIB * GiB), "of one H200", gpu=True)


@background
def launches(ctx):
    """The two command-line checks (helpers.background), run while the in-process tests run; each
    test waits for its own."""
    dry, fast = ctx.tmp("dry_run"), ctx.tmp("fast")
    jobs = {"test_the_literal_sparse_7b_dry_run_prints_the_estimate_and_what_fits_one_h200":
            lambda: check_the_literal_sparse_7b_dry_run_prints_the_estimate_and_what_fits_one_h200(dry),
            "test_a_7b_model_on_a_24_gib_cpu_exits_2_with_one_line_fast":
            lambda: check_a_7b_model_on_a_24_gib_cpu_exits_2_with_one_line_fast(fast)}
    return jobs


def tiny(tmp: Path, extra=()):
    """tests/helpers.py's tiny run, with longer micro-batches (activations matter against the weights)."""
    return tiny_overrides(tmp, tmp / "corpus", ["trainer.seq_len=64", "trainer.batch_size=16",
                                                "trainer.micro_batch_size=8", *extra])


def peak_of(cfg, **trainer) -> int:
    return run_peak(cfg, cfg.model.vocab_size or cfg.data.vocab_size, replace(cfg.trainer, **trainer), 1, False)[0]


def test_a_run_that_does_not_fit_stops_before_the_data_the_model_and_any_file(tmp_path, monkeypatch):
    """The CPU's available RAM, faked: between the peak with micro-batch 4 (with margin) and the run's."""
    from training.loop import train

    cfg = to_config(tiny(tmp_path))
    fits = peak_of(cfg, micro_batch_size=4)
    monkeypatch.setattr(ck, "available_host_bytes", lambda: int(fits / (1 - MARGIN)) + 2)
    assert peak_of(cfg) > ck.available_host_bytes()
    offered = judge(cfg, cfg.data.vocab_size, Capacity(ck.available_host_bytes(), "", False), 1, False).changes
    assert offered and all(c.peak <= (1 - MARGIN) * ck.available_host_bytes() for c in offered)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ConfigError) as e:
        train(compose_config([a for a in tiny(tmp_path) if not a.startswith("hydra.")]), run_dir, "t")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"the estimated peak memory, {peak_of(cfg) / GiB:.3g} GiB per process" in msg, msg
    assert f"exceeds the {ck.available_host_bytes() / GiB:.3g} GiB of available RAM" in msg, msg
    assert f"settings that fit (estimated peak): {' | '.join(map(str, offered))};" in msg, msg
    assert f"trainer.micro_batch_size=4 ({fits / GiB:.3g} GiB)" in msg, msg
    assert msg.endswith("trainer.check_memory=false skips this check")
    assert "torchrun" not in msg  # processes on one host share its RAM: no FSDP offered on the CPU
    assert not (tmp_path / "cache").exists() and list(run_dir.iterdir()) == []  # no data prepared, nothing written


def test_every_setting_offered_fits_with_margin_and_one_knob_comes_first():
    cfg = to_object(compose_config(["+experiment=sparse_7b", "trainer.micro_batch_size=8"]))
    v = judge(cfg, 32768, ONE_H200, 1, bf16=True)
    assert not v.fits and len(v.changes) == 2
    for c in v.changes:
        again = to_object(compose_config(["+experiment=sparse_7b", "trainer.micro_batch_size=8", *c.overrides]))
        peak, _ = run_peak(again, 32768, again.trainer, c.world, True)
        assert peak == c.peak <= (1 - MARGIN) * ONE_H200.bytes
        assert again.trainer.batch_size % (again.trainer.micro_batch_size * c.world) == 0
    assert [c.world for c in v.changes] == [1, 2]  # the same GPU first, then the fewest more
    assert "under torchrun --nproc-per-node=2" in str(v.changes[1]) and "trainer.strategy=fsdp" in str(v.changes[1])


def test_sparse_7b_does_not_fit_one_h200_and_the_first_setting_offered_is_the_readmes():
    """sparse_7b's defaults ran out of memory on one H200; the README's one-GPU command is what the
    pre-flight offers first, and fits one H200 with margin, with float8 off and rowwise, and on the
    disk size the README states."""
    cfg = to_object(compose_config(["+experiment=sparse_7b"]))
    v = judge(cfg, 32768, ONE_H200, 1, bf16=True)
    assert not v.fits and round(v.peak / GiB, 1) == 150.7
    first = v.changes[0].overrides
    readme = (ROOT / "README.md").read_text()
    command = next(m for m in re.findall(r"`(python train\.py \+experiment=sparse_7b [^`]*)`", readme)
                   if "keep_last" in m)
    args = command.split()[2:]
    assert set(first) <= set(args)
    for float8 in ("none", "rowwise"):
        ok = to_object(compose_config([*args, f"trainer.float8={float8}"]))
        verdict = judge(ok, 32768, ONE_H200, 1, bf16=True)
        assert verdict.fits and not verdict.close, float8
        assert f"{verdict.peak / GiB:.1f}" in readme
    from training.memory import dry_run_rows

    disk = dict(dry_run_rows(to_object(compose_config(args)), 32768))["disk for checkpoints"]
    assert disk.split(" free")[0] in readme  # e.g. "162 GB"


def test_the_literal_sparse_7b_dry_run_prints_the_estimate_and_what_fits_one_h200(launched):
    launched["test_the_literal_sparse_7b_dry_run_prints_the_estimate_and_what_fits_one_h200"].result()


def check_the_literal_sparse_7b_dry_run_prints_the_estimate_and_what_fits_one_h200(tmp_path):
    r = run_train(["+experiment=sparse_7b", "trainer.dry_run=true", f"hydra.run.dir={tmp_path}"],
                  env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in r.stdout.splitlines() if "  " in line.strip())
    assert rows["peak (srelu24 dense warmup)"].startswith("150.7 GiB")
    assert rows["memory capacity"].startswith(f"{H200_FREE_GIB:.1f} GiB of one H200 (no GPU here")
    assert rows["fits"].startswith("no: peak 150.7 GiB")
    assert rows["settings that fit"].startswith("trainer.micro_batch_size=1 trainer.activation_checkpointing=full (116.9 GiB)")


def test_within_the_margin_the_run_goes_on_with_one_warning(tmp_path, caplog):
    cfg = to_config(tiny(tmp_path))
    peak = peak_of(cfg)
    for capacity, warned in ((peak * 1.05, 1), (peak / (1 - MARGIN) * 1.01, 0)):
        caplog.clear()
        check_memory(replace(cfg, trainer=replace(cfg.trainer, memory_capacity_gib=capacity / GiB)), Dist())
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == warned, lines
    caplog.clear()
    check_memory(replace(cfg, trainer=replace(cfg.trainer, memory_capacity_gib=peak * 1.05 / GiB)), Dist(rank=1))
    assert not caplog.records  # rank 0 prints


def test_within_the_margin_warning_names_the_estimate_the_capacity_and_settings_with_margin(tmp_path, caplog):
    cfg = to_config(tiny(tmp_path))
    check_memory(replace(cfg, trainer=replace(cfg.trainer, memory_capacity_gib=peak_of(cfg) * 1.05 / GiB)), Dist())
    line = caplog.records[-1].getMessage()
    assert "is within 15% of the" in line and "of trainer.memory_capacity_gib=" in line and "(the estimate's accuracy)" in line
    assert "with margin: trainer.activation_checkpointing=full (" in line and "| trainer.micro_batch_size=4 (" in line


def test_check_memory_false_skips_the_check(tmp_path):
    cfg = to_config(tiny(tmp_path, ["trainer.memory_capacity_gib=1e-6"]))
    with pytest.raises(ConfigError):
        check_memory(cfg, Dist())
    check_memory(replace(cfg, trainer=replace(cfg.trainer, check_memory=False)), Dist())


def test_every_rank_judges_the_least_capacity_of_all_ranks(tmp_path, monkeypatch):
    import training.distributed

    cfg = to_config(tiny(tmp_path))
    peak = peak_of(cfg)
    monkeypatch.setattr(ck, "available_host_bytes", lambda: 10 * peak)
    monkeypatch.setattr(training.distributed, "gather_object", lambda obj, d, group=None: [obj, peak // 2])
    for rank in (0, 1):  # this rank has room, the other does not: both stop alike
        with pytest.raises(ConfigError, match=r"exceeds the .* GiB of available RAM \(the least of 2 ranks\)"):
            check_memory(cfg, Dist(rank=rank, world_size=2))


def test_the_capacity_of_a_gpu_is_its_free_memory_and_of_the_cpu_the_available_ram(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (123 * GiB, 140 * GiB))
    c = device_capacity(torch.device("cuda", 3), None)
    assert (c.bytes, c.what, c.gpu) == (123 * GiB, "free on cuda:3", True)
    monkeypatch.setattr(ck, "available_host_bytes", lambda: 24 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes of this host share it
    c = device_capacity(torch.device("cpu"), None)
    assert (c.bytes, c.what, c.gpu) == (12 * GiB, "of available RAM / 2 processes", False)
    c = device_capacity(torch.device("cpu"), 40.0)
    assert c.bytes == 40 * GiB and c.what == "of trainer.memory_capacity_gib=40"


def test_available_ram_without_proc_meminfo_comes_from_sysconf(monkeypatch):
    real = Path.read_text

    def read_text(self, *a, **k):
        if str(self) == "/proc/meminfo":
            raise FileNotFoundError(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    import os

    assert ck.available_host_bytes() == os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") > 0


def test_the_estimate_on_the_cpu_is_of_fp32(tmp_path):
    cfg = to_config(tiny(tmp_path))
    V = cfg.data.vocab_size
    assert peak_of(cfg) == estimate(cfg.model, cfg.ffn, V, cfg.trainer, bf16=False).peak > \
        estimate(cfg.model, cfg.ffn, V, cfg.trainer, bf16=True).peak


def test_a_7b_model_on_a_24_gib_cpu_exits_2_with_one_line_fast(launched):
    """`python train.py +experiment=demo model=7b` on a 24 GiB machine (the capacity set, so that a
    larger machine running this test behaves the same)."""
    launched["test_a_7b_model_on_a_24_gib_cpu_exits_2_with_one_line_fast"].result()


def check_a_7b_model_on_a_24_gib_cpu_exits_2_with_one_line_fast(tmp_path):
    t0 = time.monotonic()
    r = run_train(["+experiment=demo", "model=7b", "trainer.memory_capacity_gib=24", f"hydra.run.dir={tmp_path / 'run'}"],
                  timeout=120)
    took = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: the estimated peak memory, 97.0 GiB per process") and "24.0 GiB" in lines[0]
    assert "the weights, gradients and AdamW state alone take 97.0 GiB" in lines[0]
    assert took < 60 and not (tmp_path / "run").exists()


def test_a_gpus_free_memory_counts_what_an_earlier_job_in_this_process_left_cached(monkeypatch):
    """A multirun's jobs share one process: the blocks an earlier job freed stay in the caching
    allocator (and a CUDA graph's pool) and read as used until they are returned to the driver."""
    cached = {"bytes": 40 * GiB}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cached.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GiB - cached["bytes"], 80 * GiB))
    cap = device_capacity(torch.device("cuda", 0), None)
    assert cap.bytes == 80 * GiB and cap.gpu and cap.what == "free on cuda:0"
