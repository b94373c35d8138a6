"""The GPU's SM clock, power draw and throttle reasons while something runs, from nvidia-smi.

On a power-capped card (the H200 here: 700 W) a GEMM-heavy loop runs at a lower clock than a
short one, and which variant draws more power changes how fast *everything else* runs
(benchmarks/RESULTS.md, session 7), so the benchmarks record the clocks beside their times and
the trainer logs them:

    with ClockSampler(device) as clocks:
        run_steps()             # synchronised before the block ends
    clocks.summary()            # {"samples": 31, "sm_clock_mhz": 1755.0, "power_w": 512.3, ...}

    sampler = ClockSampler(device, interval_ms=500).start()   # the trainer: one per run
    sampler.take()              # medians since the previous take()
    sampler.stop()
"""
import subprocess
import threading
import time

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class ClockSampler:
    """nvidia-smi polling every `interval_ms` on a background reader thread, for this process's
    GPU (`device`; all GPUs without one). The caller synchronises the GPU before reading, so
    that the samples cover the work, not just its launch. Without nvidia-smi, or without usable
    samples, the summaries say why instead of failing the run."""

    def __init__(self, device=None, interval_ms: int = 50):
        self.interval_ms, self.gpu_id = interval_ms, nvidia_smi_id(device)
        self.proc, self.thread, self.error = None, None, None
        self.rows, self.fresh, self.first_line = [], [], None
        self.lock = threading.Lock()

    def start(self) -> "ClockSampler":
        cmd = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"]
        if self.gpu_id:  # this process's GPU only: on a host of several, the others would mix in
            cmd.append(f"--id={self.gpu_id}")
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as e:
            self.error = f"could not run nvidia-smi: {e}"
            return self
        self.thread = threading.Thread(target=self._read, name="nvidia-smi reader", daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.first_line is None:
                self.first_line = line.strip()
            row = parse_row(line)
            if row is not None:
                with self.lock:
                    self.rows.append(row)
                    self.fresh.append(row)

    def stop(self) -> None:
        if self.proc is None or self.thread is None:
            return
        self.proc.terminate()
        err = self.proc.communicate()[1]  # the reader thread drains stdout
        self.thread.join()
        if not self.rows:  # say what nvidia-smi said (a rejected field, [N/A] readings, ...)
            self.error = (f"no usable samples from `{' '.join(self.proc.args)}` (exit {self.proc.returncode}); "
                          f"first line {self.first_line!r}; stderr {(err or '').strip()[:200]!r}")
        self.thread = None

    def __enter__(self) -> "ClockSampler":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def take(self) -> dict:
        """Medians of the samples since the previous take() (or the start)."""
        with self.lock:
            rows, self.fresh = self.fresh, []
        return summarise(rows, self.error)

    def summary(self) -> dict:
        """Medians of every sample so far."""
        with self.lock:
            rows = list(self.rows)
        return summarise(rows, self.error)


def nvidia_smi_id(device) -> str | None:
    """nvidia-smi's id for a torch CUDA device ("GPU-<uuid>": CUDA_VISIBLE_DEVICES renumbers devices,
    UUIDs do not); None without a device or where torch does not give the UUID (all GPUs sampled)."""
    if device is None:
        return None
    import torch

    try:
        return f"GPU-{torch.cuda.get_device_properties(torch.device(device)).uuid}"
    except (AttributeError, RuntimeError, AssertionError, ValueError):
        return None


def parse_row(line: str):
    """One nvidia-smi csv line as (SM MHz, W, deg C, throttle reasons), or None (a partial line,
    a field it could not read)."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != 4:
        return None
    try:
        return float(cells[0]), float(cells[1]), float(cells[2]), cells[3]
    except ValueError:
        return None


def parse(text: str) -> list:
    return [r for r in map(parse_row, text.splitlines()) if r is not None]


def summarise(rows: list, error: str | None = None) -> dict:
    if not rows:
        return {"error": error or "no samples (the block ran shorter than nvidia-smi's first sample?)"}

    def med(i):
        return sorted(r[i] for r in rows)[len(rows) // 2]
    return {"samples": len(rows), "sm_clock_mhz": med(0), "power_w": med(1), "temp_c": med(2),
            "throttle_reasons": sorted({r[3] for r in rows})}


def clocks_during(fn, seconds: float) -> dict:
    """The summary while fn runs back to back for `seconds` (then a synchronisation)."""
    import torch

    with ClockSampler(torch.cuda.current_device()) as s:
        t0 = time.time()
        while time.time() - t0 < seconds:
            fn()
        torch.cuda.synchronize()
    return s.summary()
