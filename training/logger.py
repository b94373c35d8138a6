"""Where metrics go: <run_dir>/metrics.jsonl (the source of truth for scripts) and wandb
(offline by default, one run per job); and where messages go: Python logging, so Hydra's job log
(<run_dir>/train.log) holds them, with a console handler that keeps tqdm's bar intact."""
import json
import logging
import math
import secrets
import socket
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

from .config import WandbConfig, WandbMode


class RunLogger:
    def __init__(self, run_dir: Path, wandb_cfg: WandbConfig, *, name: str, group: str, job_type: str,
                 config: dict, resumed: bool, rank: int = 0):
        self.path = run_dir / "metrics.jsonl"
        # rank 0 writes metrics.jsonl and wandb; the other ranks' loggers do nothing
        self._file = open(self.path, "a" if resumed else "w", buffering=1) if rank == 0 else None
        self._wandb, self._history = None, {}
        if wandb_cfg.mode != WandbMode.disabled and rank == 0:
            import wandb  # slow to import; only when used

            self._wandb = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity, group=wandb_cfg.group or group,
                name=name, job_type=job_type, tags=list(wandb_cfg.tags), config=config,
                dir=str(run_dir), mode=wandb_cfg.mode.value, resume="allow" if resumed else None,
                id=_wandb_id(run_dir), settings=wandb.Settings(console="off", quiet=True))
            # tokens seen is the x-axis of every chart, so runs of different batch sizes line up
            self._wandb.define_metric("tokens")
            self._wandb.define_metric("*", step_metric="tokens")

    def log(self, row: dict) -> None:
        """One line of metrics.jsonl; in wandb, per-layer lists become one key per layer
        (`act_sparsity/layer_03`), and at each evaluation one chart per statistic with a
        line per layer plus a layers x tokens heatmap."""
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is None:
            return
        flat = {k: v for k, v in row.items() if k != "layers"}
        for stat, values in row.get("layers", {}).items():
            flat.update({f"{stat}/layer_{i:02d}": v for i, v in enumerate(values)})
            self._history.setdefault(stat, []).append((row["tokens"], values))
        if "val_loss" in row and self._history:
            flat.update(self._charts())
        self._wandb.log(flat, step=row["step"])  # the training step: a resumed run continues its steps

    def _charts(self) -> dict:
        import wandb

        from .plots import close, layer_heatmap

        charts = {}
        for stat, hist in self._history.items():
            xs = [t for t, _ in hist]
            per_layer = [list(col) for col in zip(*(v for _, v in hist))]
            charts[f"charts/{stat}"] = wandb.plot.line_series(
                xs=xs, ys=per_layer, keys=[f"layer {i}" for i in range(len(per_layer))], title=stat, xname="tokens")
        if "act_sparsity" in self._history:
            hist = self._history["act_sparsity"]
            fig = layer_heatmap([t for t, _ in hist], [v for _, v in hist], "activation sparsity per layer")
            charts["charts/act_sparsity_heatmap"] = wandb.Image(fig)
            close(fig)
        return charts

    def summary(self, values: dict) -> None:
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """One wandb run per run directory, kept across resumes."""
    f = run_dir / "wandb_id.txt"
    if f.exists():
        return f.read_text().strip()
    run_id = secrets.token_hex(4)  # wandb ids: [a-z0-9]
    f.write_text(run_id)
    return run_id


def environment() -> dict:
    """What produced a run: git SHA, dirty flag and package versions."""
    import torch

    root = Path(__file__).resolve().parent.parent
    env = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("triton", "hydra-core", "datasets", "tokenizers", "wandb", "numpy"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    env["git_sha"] = _git(root, "rev-parse", "HEAD")
    env["git_dirty"] = bool(_git(root, "status", "--porcelain"))
    env["host"] = socket.gethostname()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001 - no git
        return None
    return r.stdout.strip() if r.returncode == 0 else None  # None: not a git checkout


def startup_summary(run_dir: Path, cfg, info: dict, start: int) -> str:
    """The run in one line, at start-up."""
    where = f"resuming at step {start}" if start else "from scratch"
    return (f"run {run_dir}: {cfg.model.name} ffn={cfg.ffn.kind} (hidden {info['ffn_hidden']}), "
            f"{info['params']['total']:,} parameters; {info['total_steps']:,} steps x {info['tokens_per_step']:,} "
            f"tokens; {info['device']}, strategy {info['strategy']} x {info['world_size']}; {where}")


def end_summary(run_dir: Path, summary: dict) -> str:
    """The run's last line: where it is, its final losses (those it measured: a run stopped before
    its first evaluation has none), and how to look at it."""
    losses = [f"{name} {summary[key]:.4f}" for key, name in (("final_train_loss", "final train loss"),
                                                              ("final_val_loss", "validation loss"))
              if math.isfinite(summary.get(key, math.nan))]
    parts = [f"done: {run_dir}"] + ([", ".join(losses)] if losses else [])
    return "; ".join(parts + [f"compare runs with: python scripts/compare.py {run_dir}"])


class ConsoleHandler(logging.Handler):
    """Messages as plain lines, INFO to stdout and warnings (as `warning: ...`) and errors to
    stderr, written through tqdm so that a progress bar is cleared and redrawn instead of broken."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            line = self.format(record)
            if record.levelno == logging.WARNING and not line.startswith("warning: "):
                line = f"warning: {line}"
            tqdm.write(line, file=sys.stderr if record.levelno >= logging.WARNING else sys.stdout)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def console_logging() -> None:
    """Replace the console handlers Hydra configured (timestamped, all on stdout) with one
    ConsoleHandler; its file handler (train.log) keeps Hydra's format."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler or isinstance(h, ConsoleHandler):
            root.removeHandler(h)
    root.addHandler(ConsoleHandler())
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
