"""The memory pre-flight: before the data, the model or the run directory's files, compare
training/memory.py's estimate of the peak with what the device has (a GPU's free memory, the
host's available RAM on the CPU). Above it the run stops with one line that names the estimate,
the capacity and settings that fit, found by the estimator; within MARGIN of it, a warning. Every
rank decides alike (the least capacity of all ranks); rank 0 prints. The dry run prints the same."""
import gc
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .config import Config
from .errors import ConfigError
from .memory import GiB, fitting_changes, gib, resident_bytes, run_peak, use_bf16

log = logging.getLogger(__name__)

# The estimate's accuracy, as required of it (tests/test_memory.py: the calibrated estimate is within
# 5% of every measured peak; an eager step or the allocator's fragmentation can add more). A peak
# within MARGIN of the capacity is warned about; the settings offered fit with this margin.
MARGIN = 0.15
# One H200 (140.4 GiB) less what the CUDA context takes: what a dry run without a GPU compares with.
H200_FREE_GIB = 139.0
SUGGESTIONS_SAME_GPUS, SUGGESTIONS_MORE_GPUS = 2, 1  # how many changes the line offers of each kind


@dataclass(frozen=True)
class Capacity:
    bytes: int
    what: str       # e.g. "free on cuda:0", "of available RAM"
    gpu: bool       # a GPU's memory (FSDP on more GPUs can help), not the host's


def device_capacity(device: torch.device, configured_gib: Optional[float]) -> Optional[Capacity]:
    """trainer.memory_capacity_gib if set; else on CUDA the device's free memory now, on the CPU
    the host's available RAM shared by the processes of this host (LOCAL_WORLD_SIZE); None where
    the host does not say."""
    gpu = device.type == "cuda"
    if configured_gib is not None:
        return Capacity(int(configured_gib * GiB), f"of trainer.memory_capacity_gib={configured_gib:g}", gpu)
    if gpu:
        # an earlier job of a multirun in this process left its blocks in the caching allocator
        # (and a CUDA graph's private pool), which mem_get_info counts as used: returned first
        gc.collect()
        torch.cuda.empty_cache()
        return Capacity(torch.cuda.mem_get_info(device)[0], f"free on {device}", True)
    from .checkpoint import available_host_bytes

    procs, available = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), available_host_bytes()
    share = f" / {procs} processes" if procs > 1 else ""
    return None if available is None else Capacity(available // procs, f"of available RAM{share}", False)


def dry_run_capacity(cfg: Config) -> tuple[Optional[Capacity], bool]:
    """The capacity and precision a dry run judges: trainer.device=cpu, the host; a GPU here, its
    free memory; else one H200 (the estimate is of a GPU run)."""
    t = cfg.trainer
    device = torch.device("cpu" if t.device == "cpu" or not torch.cuda.is_available() else
                          ("cuda" if t.device == "auto" else t.device))
    if device.type == "cpu" and t.device != "cpu":  # no GPU here: the GPU run's precision, one H200
        bf16 = use_bf16(t.precision, torch.device("cuda"))
        if t.memory_capacity_gib is not None:
            return device_capacity(torch.device("cuda"), t.memory_capacity_gib), bf16
        return Capacity(int(H200_FREE_GIB * GiB), "of one H200 (no GPU here; trainer.memory_capacity_gib=N "
                                                  "sets another)", True), bf16
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device_capacity(device, t.memory_capacity_gib), use_bf16(t.precision, device)


@dataclass
class Verdict:
    peak: int
    phase: str          # srelu24's phase of the peak, or ""
    capacity: Capacity
    world: int
    fits: bool          # peak <= capacity
    close: bool         # and within MARGIN of it
    changes: list       # memory.Change: settings that fit (with margin where any do)
    resident: int       # weights, gradients and AdamW state: what no micro-batch or checkpointing lowers

    def _peak_text(self, cfg: Config) -> str:
        t, units = cfg.trainer, ("GPU", "GPUs") if self.capacity.gpu else ("process", "processes")
        setup = (f"{self.world} {units[self.world > 1]}, strategy {t.strategy.value}, activation checkpointing "
                 f"{t.activation_checkpointing.value}, micro-batch {t.micro_batch_size} x {t.seq_len}")
        phase = f"{self.phase}; " if self.phase else ""
        return f"{gib(self.peak)} per {units[0]} ({phase}{setup})"

    def _changes_text(self) -> str:
        if self.changes:
            return " | ".join(str(c) for c in self.changes)
        more = ", nor FSDP on up to 8 times the GPUs" if self.capacity.gpu else ""
        return (f"none: no smaller micro-batch or activation checkpointing{more}; the weights, gradients and "
                f"AdamW state alone take {gib(self.resident)}: use a smaller model (model=...)"
                + ("" if self.capacity.gpu else " or a GPU"))

    def error(self, cfg: Config) -> str:
        return (f"the estimated peak memory, {self._peak_text(cfg)}, exceeds the "
                f"{gib(self.capacity.bytes)} {self.capacity.what}; settings that fit (estimated peak): "
                f"{self._changes_text()}; trainer.check_memory=false skips this check")

    def warning(self, cfg: Config) -> str:
        return (f"the estimated peak memory, {self._peak_text(cfg)}, is within {MARGIN:.0%} of the "
                f"{gib(self.capacity.bytes)} {self.capacity.what} (the estimate's accuracy): close to the "
                f"limit; with margin: {self._changes_text()}")


def judge(cfg: Config, vocab: int, capacity: Capacity, world: int, bf16: bool) -> Verdict:
    """The estimate against `capacity`; where it does not fit with MARGIN, the cheapest settings
    that do (or, where none does, that fit at all)."""
    t = cfg.trainer
    peak, phase = run_peak(cfg, vocab, t, world, bf16)
    fits, close = peak <= capacity.bytes, peak > (1 - MARGIN) * capacity.bytes
    changes = []
    if close:
        for limit in ((1 - MARGIN) * capacity.bytes, capacity.bytes):
            found = fitting_changes(cfg, vocab, world, bf16, int(limit), more_gpus=capacity.gpu)
            same = [c for c in found if c.world == world][:SUGGESTIONS_SAME_GPUS]
            changes = same + [c for c in found if c.world > world][:SUGGESTIONS_MORE_GPUS]
            if changes:
                break
    return Verdict(peak, phase, capacity, world, fits, close, changes, resident_bytes(cfg, vocab, t, world))


def check_memory(cfg: Config, d) -> None:
    """The pre-flight of a run (d: training.distributed.Dist): ConfigError where the estimated peak
    exceeds the least capacity of all ranks, a warning (rank 0) within MARGIN of it."""
    from .distributed import gather_object

    t = cfg.trainer
    if not t.check_memory:
        return
    mine = device_capacity(d.device, t.memory_capacity_gib)
    everyone = gather_object(mine and mine.bytes, d)  # every rank judges the same bytes
    if None in everyone:  # a host that does not say what it has: nothing to judge
        return
    what = mine.what
    if d.world_size > 1 and t.memory_capacity_gib is None:
        what = f"{'free per GPU' if mine.gpu else mine.what} (the least of {d.world_size} ranks)"
    capacity = Capacity(min(everyone), what, mine.gpu)
    verdict = judge(cfg, cfg.model.vocab_size or cfg.data.vocab_size, capacity, d.world_size,
                    use_bf16(t.precision, d.device))
    if not verdict.fits:
        raise ConfigError(verdict.error(cfg))
    if verdict.close and d.is_main:
        log.warning(verdict.warning(cfg))


def dry_run_rows(cfg: Config, vocab: int, capacity: Optional[Capacity], bf16: bool, world: int) -> list[tuple[str, str]]:
    """The dry run's verdict: the capacity, whether the peak fits it, and the settings that would."""
    if capacity is None:
        return [("memory capacity", "unknown: the host does not say (trainer.memory_capacity_gib=N sets one)")]
    v = judge(cfg, vocab, capacity, world, bf16)
    verdict = "no" if not v.fits else f"yes, within {MARGIN:.0%} (close to the limit)" if v.close else "yes"
    rows = [("memory capacity", f"{gib(capacity.bytes)} {capacity.what}"),
            ("  fits", f"{verdict}: peak {gib(v.peak)}{f' ({v.phase})' if v.phase else ''}")]
    if v.close:
        label = "  settings that fit" if not v.fits else "  with margin"
        rows += [(label if i == 0 else "", str(c)) for i, c in enumerate(v.changes)] or [(label, v._changes_text())]
    return rows
