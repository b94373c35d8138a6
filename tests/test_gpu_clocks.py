"""training/gpu_clocks.py on CPU, against a stand-in NVML module: medians per interval, joules
from the energy counter, and a clear summary where NVML is missing."""
import sys
import threading
import time
import types

import pytest

from training import gpu_clocks
from training.gpu_clocks import ClockSampler, energy_during, summarise


class FakeNVML(types.ModuleType):
    """pynvml's calls that the sampler uses: the clock rises 1 MHz per reading, the energy counter
    grows by 700 W of wall-clock time."""
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, fail_init=False):
        super().__init__("pynvml")
        self.fail_init, self.reads, self.t0, self.lock = fail_init, 0, time.perf_counter(), threading.Lock()
        self.handles = []
        self.no_utilisation = False  # a card (a MIG slice) that does not report it
        self.no_memory_state = False  # a card that reports neither its memory clock nor its performance state

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i):
        self.handles.append(("index", i))
        return "h"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(("uuid", uuid))
        return "h"

    def nvmlDeviceGetClockInfo(self, h, kind):
        if kind == self.NVML_CLOCK_MEM:
            if self.no_memory_state:
                raise RuntimeError("Not Supported")
            return 2619
        with self.lock:
            self.reads += 1
            return 1400 + self.reads

    def nvmlDeviceGetPowerUsage(self, h):
        return 690500  # mW

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 60

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return int((time.perf_counter() - self.t0) * 700_000)  # mJ

    def nvmlDeviceGetPerformanceState(self, h):
        if self.no_memory_state:
            raise RuntimeError("Not Supported")
        return 0

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.no_utilisation:
            raise RuntimeError("Not Supported")
        return types.SimpleNamespace(gpu=97, memory=40)


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_sampler_streams_medians_and_joules_per_interval(nvml):
    s = ClockSampler(interval_ms=20).start()
    try:
        time.sleep(0.3)
        first = s.take()
        time.sleep(0.3)
        second = s.take()
    finally:
        s.stop()
    assert first["samples"] >= 3 and second["samples"] >= 3
    assert second["sm_clock_mhz"] > first["sm_clock_mhz"]  # separate intervals, not one running median
    assert first["power_w"] == 690.5 and first["throttle_reasons"] == ["0x0000000000000004"]
    assert first["gpu_busy_pct"] == second["gpu_busy_pct"] == 97.0
    assert first["mem_clock_mhz"] == 2619.0 and first["pstates"] == ["P0"]
    for interval in (first, second):  # 700 W over ~0.3 s each
        assert interval["energy_j"] == pytest.approx(0.3 * 700, rel=0.3)
    whole = s.summary()
    time.sleep(0.2)
    assert s.summary()["energy_j"] == whole["energy_j"]  # stopped: later work is not counted
    assert whole["samples"] >= first["samples"] + second["samples"] and "error" not in whole
    assert whole["energy_j"] >= first["energy_j"] + second["energy_j"] - 1
    assert s.thread is None and nvml.handles == [("index", 0)]  # stopped; no device given: GPU 0


def test_a_pause_leaves_its_samples_and_joules_out_of_the_next_take(nvml):
    """The trainer pauses the sampler around evaluations and checkpoints: their readings and joules
    are not the training interval's. Readings one by one (no thread), the energy counter set by hand."""
    nvml.energy = 0
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: nvml.energy
    s = ClockSampler()
    s.nvml, s.handle = nvml, "h"
    s.energy0 = s.energy_take = s.energy_mj()
    s.sample()                                   # training: 1401 MHz, 1 J
    nvml.energy = 1000
    s.pause()
    s.sample(), s.sample()                       # evaluation: 1402, 1403 MHz, 5 J
    nvml.energy = 6000
    s.resume()
    s.sample()                                   # training again: 1404 MHz, 1 J
    nvml.energy = 7000
    interval = s.take()
    assert interval["samples"] == 2 and interval["sm_clock_mhz"] == 1404 and interval["energy_j"] == 2.0
    assert s.summary()["samples"] == 4  # the whole run keeps every reading
    nvml.energy = 9000
    assert s.take()["energy_j"] == 2.0  # what was left out is not subtracted twice


def test_a_take_inside_a_pause_and_a_second_pause(nvml):
    """take() during a pause counts the paused joules so far as left out, the rest of the pause
    as the next interval's left-out; a second pause() or resume() changes nothing."""
    nvml.energy = 0
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: nvml.energy
    s = ClockSampler()
    s.nvml, s.handle = nvml, "h"
    s.energy0 = s.energy_take = s.energy_mj()
    nvml.energy = 1000                           # training: 1 J
    s.pause()
    nvml.energy = 3000                           # paused: 2 J
    s.pause()                                    # nested: ignored
    assert s.take()["energy_j"] == 1.0
    nvml.energy = 6000                           # still paused: 3 J
    s.resume()
    s.resume()                                   # nothing to resume
    nvml.energy = 7000                           # training: 1 J
    assert s.take()["energy_j"] == 1.0


def test_sampler_says_why_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with ClockSampler() as s:
        pass
    assert "NVML is not available" in s.summary()["error"] and "nvidia-ml-py" in s.summary()["error"]
    assert "energy_j" not in s.take()
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(fail_init=True))
    with ClockSampler() as s:
        pass
    assert s.summary()["error"] == "NVML could not start: NVML Shared Library Not Found"


def test_sampler_picks_this_processes_gpu_by_uuid(nvml, monkeypatch):
    monkeypatch.setattr(gpu_clocks, "nvml_uuid", lambda device: "GPU-1234")
    with ClockSampler("cuda:1", interval_ms=10):
        time.sleep(0.05)
    assert nvml.handles == [("uuid", "GPU-1234")]


def test_energy_during_counts_calls_and_joules_per_call(nvml, monkeypatch):
    monkeypatch.setattr("torch.cuda.synchronize", lambda *a: None)
    monkeypatch.setattr(gpu_clocks, "nvml_uuid", lambda device: None)
    r = energy_during(lambda: time.sleep(0.001), seconds=0.3, device="cuda:0", warmup_s=0.05)
    assert r["calls"] >= 100 and r["calls"] % 10 == 0 and r["ms_per_call"] == pytest.approx(1e3 * 0.3 / r["calls"], rel=0.2)
    assert r["mj_per_call"] == pytest.approx(700 * r["ms_per_call"], rel=0.1)  # 700 W x seconds per call
    assert r["power_w_from_energy"] == pytest.approx(700, rel=0.1)


def test_summarise_takes_medians_and_says_why_when_empty():
    rows = [(1755.0, 512.3, 61.0, "0x0"), (1410.0, 699.1, 63.0, "0x4"), (1440.0, 695.0, 62.0, "0x4")]
    assert summarise(rows) == {"samples": 3, "sm_clock_mhz": 1440.0, "power_w": 695.0, "temp_c": 62.0,
                               "throttle_reasons": ["0x0", "0x4"]}
    assert summarise([], "NVML is not available") == {"error": "NVML is not available"}


def test_a_card_without_utilisation_still_reports_clocks_and_power(nvml):
    nvml.no_utilisation = True
    with ClockSampler(interval_ms=20) as s:
        time.sleep(0.15)
    out = s.summary()
    assert out["samples"] >= 2 and out["power_w"] == 690.5 and "gpu_busy_pct" not in out
    assert summarise([(1500.0, 600.0, 55.0, "0x4", None), (1600.0, 650.0, 56.0, "0x4", 80.0),
                      (1700.0, 700.0, 57.0, "0x4", 90.0)])["gpu_busy_pct"] == 90.0  # the median of the readings it has


def test_a_card_without_memory_clock_or_pstate_still_reports_the_rest(nvml):
    nvml.no_memory_state = True
    with ClockSampler(interval_ms=20) as s:
        time.sleep(0.15)
    out = s.summary()
    assert out["samples"] >= 2 and out["power_w"] == 690.5 and "error" not in out
    assert "mem_clock_mhz" not in out and "pstates" not in out
    rows = [(1500.0, 600.0, 55.0, "0x4", 99.0, 2619.0, "P0"), (1600.0, 650.0, 56.0, "0x4", 99.0, 1593.0, "P2"),
            (1700.0, 700.0, 57.0, "0x4", 99.0, 2619.0, "P0")]
    assert summarise(rows)["mem_clock_mhz"] == 2619.0 and summarise(rows)["pstates"] == ["P0", "P2"]
