"""Checkpoints: one file per saved step under <run_dir>/checkpoints, written atomically
(temporary file, fsync, rename), so a crash mid-write never leaves a file that looks valid."""
import os
import random
import re
import warnings
from pathlib import Path
from typing import Optional

import torch

from .errors import CheckpointError

FORMAT = 1
_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, state: dict) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step_{step:08d}.pt"
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, "step": step, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint files, newest first (temporary files never match the pattern)."""
    d = checkpoint_dir(run_dir)
    found = [(int(m.group(1)), p) for p in d.glob("step_*.pt") if (m := _NAME.match(p.name))] if d.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read means the file is unusable
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format {FORMAT})")
    return state


def find_resume_checkpoint(resume: str, run_dir: Path) -> Optional[tuple[Path, dict]]:
    """`none`: nothing. `auto`: the newest readable checkpoint in the run directory, skipping
    damaged ones with a warning (None when there is none). Otherwise a path that must load."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise CheckpointError(f"trainer.resume={resume}: no such checkpoint file")
        return path, load_checkpoint(path)
    for path in list_checkpoints(run_dir):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            warnings.warn(f"skipping damaged checkpoint: {e}")
    return None


def model_shape(model: torch.nn.Module) -> dict:
    """What must match for a checkpoint's weights to load: the architecture's sizes."""
    c = model.cfg
    ff = model.layers[0].feed_forward
    return {"dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads or c.n_heads,
            "ffn_hidden": ff.w1.weight.shape[0], "ffn_gated": hasattr(ff, "w3"), "vocab_size": model.vocab_size,
            "tie_embeddings": c.tie_embeddings}


def check_model_shape(path: Path, state: dict, model: torch.nn.Module) -> None:
    want, have = model_shape(model), state.get("model_shape", {})
    if want != have:
        fmt = lambda s: ", ".join(f"{k}={v}" for k, v in s.items())  # noqa: E731
        raise CheckpointError(f"checkpoint {path} holds a model of shape [{fmt(have)}] but the config builds "
                              f"[{fmt(want)}]; use the checkpoint's model/ffn settings or another run directory")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
