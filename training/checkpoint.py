"""Checkpoints: one file per saved step under <run_dir>/checkpoints.

A checkpoint is `step_XXXXXXXX.pt` plus its manifest `step_XXXXXXXX.pt.json` (size and
sha256). Both are written to temporary files, fsynced and renamed, the manifest last, so a
crash or `kill -9` at any moment leaves either a complete, verifiable checkpoint or one that
is ignored; the previous checkpoints are never touched before a new one is complete. Loading
verifies the manifest; a damaged checkpoint is reported by name and an older one is used."""
import hashlib
import json
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int = 0) -> Path:
    """Write step `step` atomically, then keep only the newest `keep_last` (0: all). A failure
    (disk full, read-only directory) raises CheckpointError and leaves the older ones intact."""
    d = checkpoint_dir(run_dir)
    path = d / f"step_{step:08d}.pt"
    try:
        d.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, lambda f: torch.save({"format": FORMAT, "step": step, **state}, f))
        manifest = {"step": step, "size": path.stat().st_size, "sha256": _sha256(path)}
        _write_atomic(_manifest(path), lambda f: f.write(json.dumps(manifest).encode()))
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint {path}: {e.strerror or e}; the previous checkpoints "
                              f"in {d} are intact") from e
    if keep_last > 0:
        for old in list_checkpoints(run_dir)[keep_last:]:
            _manifest(old).unlink(missing_ok=True)  # manifest first: a half-deleted one is never "complete"
            old.unlink(missing_ok=True)
    for stale in d.glob(".step_*.tmp-*"):  # partial writes of killed processes: never complete, only disk
        if not stale.name.endswith(f".tmp-{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return path


def _manifest(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints whose manifest exists (complete writes), newest first."""
    d = checkpoint_dir(run_dir)
    found = [(int(m.group(1)), p) for p in d.glob("step_*.pt") if (m := _NAME.match(p.name))] if d.is_dir() else []
    return [p for _, p in sorted(found, reverse=True) if _manifest(p).exists()]


def verify_checkpoint(path: Path) -> None:
    """Size and sha256 against the manifest written with the checkpoint."""
    try:
        manifest = json.loads(_manifest(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable manifest {_manifest(path).name}") from e
    size = path.stat().st_size if path.exists() else -1
    if size != manifest.get("size"):
        raise CheckpointError(f"checkpoint {path} is damaged: {size} bytes, its manifest says {manifest.get('size')}")
    if _sha256(path) != manifest.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is damaged: its sha256 does not match its manifest")


def load_checkpoint(path: Path, verify: bool = True) -> dict:
    if verify and _manifest(path).exists():
        verify_checkpoint(path)
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
