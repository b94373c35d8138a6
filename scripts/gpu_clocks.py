"""The GPU's SM clock, power draw and throttle reasons while something runs, from nvidia-smi.

On a power-capped card (the H200 here: 700 W) a GEMM-heavy loop runs at a lower clock than a
short one, and which variant draws more power changes how fast *everything else* runs, so the
benchmarks record the clocks beside their times:

    with ClockSampler(device) as clocks:
        run_steps()             # synchronised before the block ends
    clocks.summary()   # {"samples": 31, "sm_clock_mhz": 1755.0, "power_w": 512.3, ...}
"""
import subprocess
import time

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class ClockSampler:
    """nvidia-smi polling every `interval_ms` while the block runs. The caller synchronises the
    GPU before the block ends (the samples must cover the work, not just its launch). Without
    nvidia-smi the summary says so instead of failing the benchmark."""

    def __init__(self, device=None, interval_ms: int = 50):
        self.interval_ms, self.gpu_id = interval_ms, nvidia_smi_id(device)
        self.proc, self.rows, self.error = None, [], None

    def __enter__(self):
        cmd = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"]
        if self.gpu_id:  # this process's GPU only: on a host of several, the others would mix in
            cmd.append(f"--id={self.gpu_id}")
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.error = f"could not run nvidia-smi: {e}"
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, err = self.proc.communicate()
            self.rows = parse(out)
            if not self.rows:  # say what nvidia-smi said (a rejected field, [N/A] readings, ...)
                first = (out.strip().splitlines() or [""])[0]
                self.error = (f"no usable samples from `{' '.join(self.proc.args)}` (exit {self.proc.returncode}); "
                              f"first line {first!r}; stderr {err.strip()[:200]!r}")
        return False

    def summary(self) -> dict:
        return summarise(self.rows, self.error)


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


def parse(text: str) -> list:
    """nvidia-smi csv rows with all four fields numeric-or-hex; the rest (partial lines) dropped."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4:
            continue
        try:
            rows.append((float(cells[0]), float(cells[1]), float(cells[2]), cells[3]))
        except ValueError:
            continue
    return rows


def summarise(rows: list, error: str | None = None) -> dict:
    if error:
        return {"error": error}
    if not rows:
        return {"error": "no samples (the block ran shorter than nvidia-smi's first sample?)"}

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
