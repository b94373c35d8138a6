"""Throughput, MFU and memory: measured between log points without per-step host syncs."""
import logging
import time
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' datasheets: the one
# table MFU is computed against. A key is matched as a case-insensitive substring of
# torch.cuda.get_device_name(), the longest key first: "NVIDIA H100 PCIe" is the PCIe card, a plain
# "H100" ("NVIDIA H100 80GB HBM3") the SXM one. The PCIe and NVL cards run lower clocks and power.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
                    "H800": 989.0, "H800 PCIe": 756.0, "H200": 989.0, "H200 NVL": 835.0, "GH200": 989.0,
                    "H20": 148.0, "B200": 2250.0, "GB200": 2500.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def match_peak(name: str) -> Optional[tuple[str, float]]:
    """(the table's key, TFLOP/s) for a device name, or None."""
    for key, tflops in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key.lower() in name.lower():
            return key, tflops
    return None


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak FLOP/s of one device, or None (CPU, or a GPU not in the table: no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = match_peak(name)
    if found is None:
        log.warning(f"no peak FLOP/s known for {name!r}; MFU is not logged (add it to PEAK_BF16_TFLOPS)")
        return None
    return found[1] * 1e12


def peak_info(device: torch.device) -> dict:
    """What MFU is measured against, for run_info.json: the device's name, the table's key it
    matched and the peak per GPU (None where there is no MFU)."""
    if device.type != "cuda":
        return {"device_name": "cpu", "mfu_peak_key": None, "mfu_peak_tflops_per_gpu": None}
    name = torch.cuda.get_device_name(device)
    key, tflops = match_peak(name) or (None, None)
    return {"device_name": name, "mfu_peak_key": key, "mfu_peak_tflops_per_gpu": tflops}


class Throughput:
    """Tokens/s, step time, data-wait fraction, MFU, peak memory and (given a clock sampler) the
    GPU's median SM clock and power over each log interval, and its joules from the card's energy
    counter (gpu_energy_j; gpu_mj_per_token: over this GPU's share of the interval's tokens).

    MFU = dense-equivalent FLOPs per token (model/flops.py: 6N + 12LdS) x tokens/s over the
    peak of all devices. srelu24 counts as dense, so its speed-up shows as a higher MFU."""

    def __init__(self, device: torch.device, flops_per_token: int, tokens_per_step: int, world_size: int = 1,
                 elapsed_offset: float = 0.0, clocks=None):
        self.device, self.flops_per_token, self.tokens_per_step = device, flops_per_token, tokens_per_step
        self.world_size = world_size
        self.clocks = clocks  # a started training.gpu_clocks.ClockSampler, or None
        self.paused_at = None
        peak = peak_flops(device)
        self.peak = peak * world_size if peak else None
        self.start = time.perf_counter() - elapsed_offset  # wall-clock carries over a resume
        self.reset()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def reset(self) -> None:
        self.t0, self.steps, self.data_s = time.perf_counter(), 0, 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def pause(self) -> None:
        """Exclude what follows (evaluation, checkpoints) from the interval: its time, and its GPU
        readings and joules. The GPU is synchronised first: training work still queued belongs to
        the interval. A second pause() before resume() changes nothing."""
        if self.paused_at is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.paused_at = time.perf_counter()
        if self.clocks is not None:
            self.clocks.pause()

    def resume(self) -> None:
        if self.paused_at is None:
            return
        self.t0 += time.perf_counter() - self.paused_at
        self.paused_at = None
        if self.clocks is not None:
            self.clocks.resume()

    def data_time(self, seconds: float) -> None:
        self.data_s += seconds

    def step(self) -> None:
        self.steps += 1

    def read(self) -> dict:
        """Call right after a host sync (the loss .item()), so the clock covers the device work."""
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        tok_s = self.steps * self.tokens_per_step / elapsed
        out = {"tokens_per_s": tok_s, "step_time_s": elapsed / max(self.steps, 1),
               "data_wait_frac": self.data_s / elapsed, "elapsed_s": self.elapsed()}
        if self.peak:
            out["mfu"] = self.flops_per_token * tok_s / self.peak
        if self.device.type == "cuda":
            out["mem_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        if self.clocks is not None:  # a power-capped GPU runs a hungrier variant at a lower clock
            c = self.clocks.take()
            if "samples" in c:
                out["gpu_sm_clock_mhz"], out["gpu_power_w"] = c["sm_clock_mhz"], c["power_w"]
                if c.get("gpu_busy_pct") is not None:  # under 100: the GPU waited (the host, the data)
                    out["gpu_busy_pct"] = c["gpu_busy_pct"]
                if c.get("mem_clock_mhz") is not None:
                    out["gpu_mem_clock_mhz"] = c["mem_clock_mhz"]
                if c.get("energy_j") is not None and self.steps:  # the card's energy counter, this GPU's share
                    out["gpu_energy_j"] = c["energy_j"]
                    out["gpu_mj_per_token"] = 1e3 * c["energy_j"] / (self.steps * self.tokens_per_step / self.world_size)
        self.reset()
        return out
