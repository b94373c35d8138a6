"""The GPU's SM clock, power draw, energy and throttle reasons while something runs, from NVML
(nvidia-ml-py): one library call per reading, no subprocess, and the card's own energy counter.

On a power-capped card (the H200: 700 W) a GEMM-heavy loop runs at a lower clock than a short
one, and the variant that draws more power lowers the clock of *everything else* in its step
(benchmarks/RESULTS.md), so the benchmarks record clocks and joules beside their times and the
trainer logs them:

    with ClockSampler(device) as clocks:
        run_steps()             # synchronised before the block ends
    clocks.summary()            # {"samples": 31, "sm_clock_mhz": 1755, "power_w": 512.3, "energy_j": 95.1,
                                #  "gpu_busy_pct": 99.0, "mem_clock_mhz": 2619, "pstates": ["P0"], ...}

    sampler = ClockSampler(device, interval_ms=500).start()   # the trainer: one per run
    sampler.pause(); evaluate(); sampler.resume()             # left out of the next take()
    sampler.take()              # medians (and joules) since the previous take()
    sampler.stop()

    energy_during(fn, seconds=3.0)   # fn back to back: ms and mJ per call, W, MHz
"""
import threading
import time

THROTTLE_POWER_CAP = 0x4  # NVML's clocks-event reason "software power cap"


def load_nvml():
    """The pynvml module of nvidia-ml-py, initialised; raises RuntimeError saying why not."""
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError(f"NVML is not available ({e}): pip install nvidia-ml-py") from e
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and its many subclasses
        raise RuntimeError(f"NVML could not start: {e}") from e
    return pynvml


def nvml_uuid(device) -> str | None:
    """NVML's UUID ("GPU-<uuid>") of a torch CUDA device: CUDA_VISIBLE_DEVICES renumbers devices,
    UUIDs do not. None without a device or where torch does not give the UUID."""
    if device is None:
        return None
    import torch

    try:
        return f"GPU-{torch.cuda.get_device_properties(torch.device(device)).uuid}"
    except (AttributeError, RuntimeError, AssertionError, ValueError):
        return None


class ClockSampler:
    """Reads NVML every `interval_ms` on a background thread for this process's GPU (`device`;
    GPU 0 without one). The caller synchronises the GPU before reading, so that the samples
    cover the work, not just its launch. Without NVML, or without samples, the summaries say
    why instead of failing the run."""

    def __init__(self, device=None, interval_ms: int = 50):
        self.interval_ms, self.uuid = interval_ms, nvml_uuid(device)
        self.nvml = self.handle = self.thread = self.error = None
        self.rows, self.fresh = [], []
        self.energy0 = self.energy_take = self.energy_end = None  # mJ at start / the last take() / stop()
        self.paused, self.energy_paused_at, self.energy_left_out = False, None, 0  # pause() .. resume()
        self.lock, self.halt = threading.Lock(), threading.Event()

    def start(self) -> "ClockSampler":
        try:
            self.nvml = load_nvml()
            self.handle = (self.nvml.nvmlDeviceGetHandleByUUID(self.uuid) if self.uuid
                           else self.nvml.nvmlDeviceGetHandleByIndex(0))
            self.energy0 = self.energy_take = self.energy_mj()
        except Exception as e:  # noqa: BLE001 - said in the summaries
            self.error = str(e) if isinstance(e, RuntimeError) else f"NVML: {type(e).__name__}: {e}"
            self.handle = None
            return self
        self.halt.clear()
        self.thread = threading.Thread(target=self._poll, name="NVML sampler", daemon=True)
        self.thread.start()
        return self

    def energy_mj(self) -> int | None:
        """The card's energy counter (mJ since the driver loaded), None where it has none."""
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported on older cards
            return None

    def read(self) -> tuple:
        n, h = self.nvml, self.handle
        reasons = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons
        return (float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)), n.nvmlDeviceGetPowerUsage(h) / 1e3,
                float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)), f"0x{reasons(h):016x}", self.busy(),
                *self.memory_and_pstate())

    def memory_and_pstate(self) -> tuple:
        """(the memory clock in MHz, the performance state as "P0"), each None where the card does
        not say. The same work costing more joules at the power cap (benchmarks/RESULTS.md, the
        order effect) could come from the memory side: these say whether it changed state."""
        n, h = self.nvml, self.handle
        try:
            mem = float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and kin; a stand-in without it
            mem = None
        try:
            pstate = f"P{int(n.nvmlDeviceGetPerformanceState(h))}"
        except Exception:  # noqa: BLE001 - likewise
            pstate = None
        return mem, pstate

    def busy(self) -> float | None:
        """NVML's GPU utilisation: the percent of its last sample period (1/6 s to 1 s) in which some
        kernel ran. Under 100 in a training loop: the GPU waited, on the host or on data. None where
        the card does not report it (MIG slices)."""
        try:
            return float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except Exception:  # noqa: BLE001 - pynvml.NVMLError_NotSupported and kin; an older stand-in without it
            return None

    def sample(self) -> bool:
        """One reading: into summary()'s samples, and take()'s unless paused. False if NVML failed."""
        try:
            row = self.read()
        except Exception as e:  # noqa: BLE001 - keep what we have, say why it ended
            self.error = f"NVML read failed: {type(e).__name__}: {e}"
            return False
        with self.lock:
            self.rows.append(row)
            if not self.paused:
                self.fresh.append(row)
        return True

    def _poll(self) -> None:
        while not self.halt.is_set() and self.sample():
            self.halt.wait(self.interval_ms / 1e3)

    def pause(self) -> None:
        """Leave what runs until resume() (the trainer's evaluations and checkpoints) out of the next
        take(): its samples and its joules."""
        with self.lock:
            if self.paused:  # already: the first pause() holds
                return
            self.paused = True
        self.energy_paused_at = self.energy_mj() if self.handle is not None else None

    def resume(self) -> None:
        if not self.paused:
            return
        self._leave_out_paused()
        self.energy_paused_at = None
        with self.lock:
            self.paused = False

    def _leave_out_paused(self) -> None:
        """Count the joules since the pause (or since a take() during it) as left out."""
        now = self.energy_mj() if self.handle is not None else None
        if now is not None and self.energy_paused_at is not None:
            self.energy_left_out += now - self.energy_paused_at
            self.energy_paused_at = now

    def stop(self) -> None:
        if self.thread is None:
            return
        self.halt.set()
        self.thread.join()
        self.thread = None
        self.energy_end = self.energy_mj()  # summary() after the block covers the block only
        if not self.rows and self.error is None:
            self.error = "no samples (the block ran shorter than one NVML reading?)"

    def __enter__(self) -> "ClockSampler":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def take(self) -> dict:
        """Medians of the samples since the previous take() (or the start), and the joules, both
        without what ran between pause() and resume()."""
        if self.paused:  # a take() inside a pause: the paused joules so far are not this interval's
            self._leave_out_paused()
        with self.lock:
            rows, self.fresh = self.fresh, []
        now = self.energy_mj() if self.handle is not None else None
        out = summarise(rows, self.error)
        if now is not None and self.energy_take is not None:
            out["energy_j"] = (now - self.energy_take - self.energy_left_out) / 1e3
        self.energy_take, self.energy_left_out = now, 0
        return out

    def summary(self) -> dict:
        """Medians of every sample so far, and the joules since the start (until stop(), if stopped)."""
        with self.lock:
            rows = list(self.rows)
        out = summarise(rows, self.error)
        now = self.energy_end if self.thread is None else self.energy_mj() if self.handle is not None else None
        if now is not None and self.energy0 is not None:
            out["energy_j"] = (now - self.energy0) / 1e3
        return out


def summarise(rows: list, error: str | None = None) -> dict:
    if not rows:
        return {"error": error or "no samples (the block ran shorter than one NVML reading?)"}

    def med(i):
        values = sorted(r[i] for r in rows if len(r) > i and r[i] is not None)
        return values[len(values) // 2] if values else None
    out = {"samples": len(rows), "sm_clock_mhz": med(0), "power_w": med(1), "temp_c": med(2),
           "throttle_reasons": sorted({r[3] for r in rows})}
    if (busy := med(4)) is not None:
        out["gpu_busy_pct"] = busy
    if (mem := med(5)) is not None:
        out["mem_clock_mhz"] = mem
    if pstates := sorted({r[6] for r in rows if len(r) > 6 and r[6] is not None}):
        out["pstates"] = pstates
    return out


def energy_during(fn, seconds: float, device=None, warmup_s: float = 0.5) -> dict:
    """fn back to back for `seconds`, after `warmup_s` of the same (the power limiter settles in
    well under that): the clock summary, the calls, and ms and mJ per call from the energy
    counter (NVML updates it every ~20-100 ms: loops of a few seconds make that rounding
    negligible). It synchronises every 10 calls, so that the host never queues far past the
    window."""
    import torch

    def run(window: float) -> tuple[int, float]:
        torch.cuda.synchronize()
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < window:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        return calls, time.perf_counter() - t0

    run(warmup_s)
    with ClockSampler(device if device is not None else torch.cuda.current_device(), interval_ms=50) as s:
        e0 = s.energy_mj() if s.handle is not None else None
        calls, wall = run(seconds)
        e1 = s.energy_mj() if s.handle is not None else None
    out = {**s.summary(), "calls": calls, "ms_per_call": 1e3 * wall / calls}
    if e0 is not None and e1 is not None:
        out["mj_per_call"] = (e1 - e0) / calls
        out["power_w_from_energy"] = (e1 - e0) / 1e3 / wall
    return out


def interleaved_rounds(runs: dict, repeats: int, timer) -> dict:
    """{variant: [timer(run) of each round]}: every round times each variant once, in the order of
    `runs`, reversed every other round, so that no variant always runs right after another one (the
    clock at the power cap follows what ran just before)."""
    rounds = {v: [] for v in runs}
    for i in range(repeats):
        for v in list(runs)[::-1 if i % 2 else 1]:
            rounds[v].append(timer(runs[v]))
    return rounds
