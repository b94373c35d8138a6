"""Checkpoints: one directory per saved step under <run_dir>/checkpoints, written with
torch.distributed.checkpoint (DCP), so every rank writes its own shard; one format for one
process and for many.

    checkpoints/step_00001000/
        .metadata, __<rank>_<n>.distcp   DCP: "model" and "optimizer" (keyed by parameter name, so
                                        any world size or strategy can load them: DCP reshards)
        rank_00000.pt, rank_00001.pt    each rank's loader position and RNG states (torch.save)
        train_state.json                step, config, model shape, data identity, elapsed time, world size
        manifest.json                   size and sha256 of every other file; written last

Atomic: all of it goes into `.step_00001000.tmp`, every file fsynced, the manifest last, then the
directory is renamed. A crash or `kill -9` at any moment leaves either a complete checkpoint or a
temp directory that is never listed and that the next successful save deletes; older checkpoints
are not touched before a new one is complete. Loading verifies the manifest; a damaged checkpoint
is reported by name and an older one is used.

Under a process group every function here is called by all ranks in the same order: each local
failure is shared (all-gather) before anyone acts on it, so no rank waits for one that gave up."""
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError

FORMAT = 2
_NAME = re.compile(r"^step_(\d+)$")
MANIFEST, TRAIN_STATE = "manifest.json", "train_state.json"
TENSORS = ("model", "optimizer")
FAILED = (Exception, CheckpointException)  # DCP's exception is a BaseException  # the keys of a state saved through DCP; "rank" is per rank; the rest JSON


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


# ---------------------------------------------------------------- ranks

def _ranks() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(obj) -> list:
    """Every rank's obj, on every rank (a no-op for one process)."""
    if _ranks()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    if _ranks()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first_error(err: Optional[str]) -> Optional[str]:
    """A collective: the first rank's error (or None), on every rank."""
    errors = [(r, e) for r, e in enumerate(_gather(err)) if e]
    if not errors:
        return None
    r, e = errors[0]
    return e if _ranks()[1] == 1 else f"{e} (rank {r})"


def _agreed(fn: Callable, *args):
    """fn(*args) on every rank; a CheckpointError on any rank is raised on every rank (so a file
    that one rank alone cannot read does not send the ranks down different paths)."""
    out, err = None, None
    try:
        out = fn(*args)
    except CheckpointError as e:
        err = str(e)
    err = _first_error(err)
    if err:
        raise CheckpointError(err)
    return out


@contextmanager
def _quiet_dcp():
    """DCP warns on every call without a process group; one process is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield


def _reason(e: BaseException) -> str:
    """One line: OSError's strerror, else the first line of the message (DCP wraps the cause)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    cause = e.__cause__ or e.__context__
    for err in (e, cause):  # DCP's CheckpointException holds each failed rank's (exception, traceback)
        failures = getattr(err, "failures", None)
        if failures:
            first = next(iter(failures.values()))
            return _reason(first[0] if isinstance(first, tuple) else first)
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# ---------------------------------------------------------------- files

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: Path, write: Callable) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RANK_FILE = re.compile(r"^(?:__(\d+)_.*\.distcp|rank_(\d+)\.pt)$")  # DCP's per-rank shards, our rank state


def _own_files(d: Path, rank: int) -> list[str]:
    """The files of checkpoint dir d that this rank wrote: its DCP shards and rank state; rank 0
    also everything not per rank (.metadata, train_state.json). Each rank lists what it wrote
    itself: on a network filesystem rank 0's listing of the others' files can be stale."""
    out = []
    for p in d.iterdir():
        m = _RANK_FILE.match(p.name)
        owner = int(m.group(1) or m.group(2)) if m else 0
        if owner == rank and p.name != MANIFEST:
            out.append(p.name)
    return sorted(out)


def _hash_files(d: Path, names: list[str]) -> dict:
    """{name: [size, sha256]} of names in d."""
    return {n: [(d / n).stat().st_size, _sha256(d / n)] for n in names}


def _missing_rank_files(manifest: dict) -> list[str]:
    """Per-rank state files a complete checkpoint of manifest["world_size"] ranks must list. (DCP's
    shards are not counted here: a rank may own none, e.g. under DDP; DCP's .metadata names the
    ones it needs and dcp.load fails on every rank when one is missing.)"""
    names, world = manifest["files"], manifest.get("world_size", 1)
    return [f"rank_{r:05d}.pt" for r in range(world) if f"rank_{r:05d}.pt" not in names]


# ---------------------------------------------------------------- save

def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int = 0) -> Path:
    """Write step `step` atomically, then keep only the newest `keep_last` (0: all).

    state: "model" (a state dict, possibly sharded), optionally "optimizer" (from
    torch.distributed.checkpoint.state_dict.get_state_dict) and "rank" (this rank's own small
    state: loader, RNG); every other key must be JSON and is the same on all ranks (rank 0 writes
    it). A failure on any rank (disk full, read-only directory) raises CheckpointError on every
    rank and leaves the older checkpoints intact."""
    d = checkpoint_dir(run_dir)
    final, tmp = d / f"step_{step:08d}", d / f".step_{step:08d}.tmp"
    rank, world = _ranks()
    err = None

    def attempt(phase: Callable) -> None:
        nonlocal err
        if err is None:
            try:
                phase()
            except FAILED as e:  # noqa: BLE001 - any failure to write is reported the same way
                err = f"could not write checkpoint {final}: {_reason(e)}"
        err = _first_error(err)  # collective: called by every rank at each phase, failed or not

    def start() -> None:
        if rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a killed attempt at this same step
            tmp.mkdir()

    def tensors_and_rank_state() -> None:
        with _quiet_dcp():
            dcp.save({k: state[k] for k in TENSORS if k in state}, checkpoint_id=tmp, no_dist=world == 1)
        if "rank" in state:
            _write(tmp / f"rank_{rank:05d}.pt", lambda f: torch.save(state["rank"], f))
        if rank == 0:
            meta = {k: v for k, v in state.items() if k not in (*TENSORS, "rank")}
            body = {"format": FORMAT, "step": step, "world_size": world, **meta}
            _write(tmp / TRAIN_STATE, lambda f: f.write(json.dumps(body, indent=1).encode()))

    hashes = {}

    def hash_files() -> None:
        for part in _gather(_hash_files(tmp, _own_files(tmp, rank))):  # each rank hashes what it wrote
            hashes.update(part)

    def commit() -> None:
        if rank == 0:
            manifest = {"format": FORMAT, "step": step, "world_size": world, "files": hashes}
            missing = _missing_rank_files(manifest)
            if "rank" in state and missing:
                raise OSError(f"files of some ranks are missing: {', '.join(missing)}")
            _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            _fsync_dir(tmp)
            if final.exists():  # a step saved again (resumed from an older one): set the old one aside
                old = d / f".step_{step:08d}.old.tmp"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            _fsync_dir(d)

    attempt(start)
    attempt(tensors_and_rank_state)
    if err is None:
        try:
            hash_files()  # collectives only: every rank is here
        except OSError as e:
            err = f"could not write checkpoint {final}: {_reason(e)}"
        err = _first_error(err)
    attempt(commit)
    if err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{err}; the previous checkpoints in {d} are intact")
    if rank == 0:
        if keep_last > 0:
            for old in list_checkpoints(run_dir)[keep_last:]:
                (old / MANIFEST).unlink(missing_ok=True)  # manifest first: a half-deleted one is never "complete"
                shutil.rmtree(old, ignore_errors=True)
        for stale in d.glob(".step_*.tmp"):  # partial writes of killed processes: never complete, only disk
            shutil.rmtree(stale, ignore_errors=True)
    return final


# ---------------------------------------------------------------- find and verify

def is_checkpoint(path: Path) -> bool:
    """A checkpoint directory (complete or not), as opposed to a run directory."""
    return any((Path(path) / n).is_file() for n in (MANIFEST, TRAIN_STATE, ".metadata"))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints whose manifest exists (complete writes), newest first."""
    d = checkpoint_dir(run_dir)
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))] if d.is_dir() else []
    return [p for _, p in sorted(found, reverse=True) if (p / MANIFEST).is_file()]


def _check_files(path: Path, manifest: dict, names: list[str]) -> Optional[str]:
    for n in names:
        size, sha = manifest["files"][n]
        f = path / n
        have = f.stat().st_size if f.is_file() else -1
        if have != size:
            return f"checkpoint {path} is damaged: {n} has {have} bytes, its manifest says {size}"
        if _sha256(f) != sha:
            return f"checkpoint {path} is damaged: the sha256 of {n} does not match its manifest"
    return None


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"].items()
        return manifest
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} has no readable {MANIFEST}") from e


def verify_checkpoint(path: Path) -> None:
    """Every file's size and sha256 against the manifest written with the checkpoint (ranks
    share the reading; every rank raises the same CheckpointError)."""
    path = Path(path)
    rank, world = _ranks()
    err, manifest = None, None
    try:
        manifest = _read_manifest(path)
    except CheckpointError as e:
        err = str(e)
    err = _first_error(err)
    if err:
        raise CheckpointError(err.removesuffix(" (rank 0)"))
    names = sorted(manifest["files"])
    missing = _missing_rank_files(manifest) if any(n.startswith("rank_") for n in names) else []
    if missing:  # every rank checks the same manifest: the same decision everywhere
        raise CheckpointError(f"checkpoint {path} is incomplete: its manifest lacks {', '.join(missing)}")
    try:
        err = _check_files(path, manifest, names[rank::world])
    except OSError as e:
        err = f"checkpoint {path} cannot be read: {_reason(e)}"
    err = _first_error(err)
    if err:
        raise CheckpointError(err)


def read_train_state(path: Path) -> dict:
    try:
        state = json.loads((Path(path) / TRAIN_STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {Path(path) / TRAIN_STATE}: {_reason(e)}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format {FORMAT})")
    return state


def find_resume_checkpoint(resume: str, run_dir: Path) -> Optional[tuple[Path, dict]]:
    """`none`: nothing. `auto`: the newest checkpoint in the run directory that verifies, skipping
    damaged ones with a warning (None when there is none). Otherwise a checkpoint directory that
    must verify. Returns (path, train_state); the same on every rank."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)

        def check(p: Path) -> None:
            if not is_checkpoint(p):
                raise CheckpointError(f"trainer.resume={resume}: not a checkpoint directory (no {MANIFEST})")

        _agreed(check, path)
        verify_checkpoint(path)
        return path, _agreed(read_train_state, path)
    rank, _ = _ranks()
    for path in _broadcast(list_checkpoints(run_dir) if rank == 0 else None):
        try:
            verify_checkpoint(path)
            return path, _agreed(read_train_state, path)
        except CheckpointError as e:
            if rank == 0:
                warnings.warn(f"skipping damaged checkpoint: {e}")
    return None


# ---------------------------------------------------------------- load

def load_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state into this rank's (possibly sharded) model; DCP reshards a
    checkpoint written with another world size or strategy."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=path, no_dist=_ranks()[1] == 1)
    except FAILED as e:  # noqa: BLE001 - raised on every rank by DCP
        raise CheckpointError(f"cannot load checkpoint {path}: {_reason(e)}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_rank_state(path: Path, rank: int, world_size: int) -> dict:
    """This rank's loader and RNG state. Written by another world size: rank 0's (the loader
    position is global, and every rank's RNG follows the same stream from the same seed).
    Called by every rank; a failure on one is raised on all."""
    return _agreed(_load_rank_state, path, rank, world_size)


def _load_rank_state(path: Path, rank: int, world_size: int) -> dict:
    f = path / f"rank_{rank:05d}.pt"
    if read_train_state(path).get("world_size") != world_size:
        f = path / "rank_00000.pt"
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except FAILED as e:  # noqa: BLE001 - any failure to read means the file is unusable
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {_reason(e)}") from e


def load_model_weights(path: Path) -> dict:
    """The whole model state dict (CPU tensors, unsharded) of a checkpoint, in this one process:
    for export and sampling; shapes and dtypes come from DCP's metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        model = {}
        for key, md in meta.state_dict_metadata.items():
            where = meta.planner_data.get(key, ())
            if len(where) == 2 and where[0] == "model" and isinstance(md, TensorStorageMetadata):
                model[where[1]] = torch.empty(md.size, dtype=md.properties.dtype)
        state = {"model": model}
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except FAILED as e:  # noqa: BLE001 - any failure to read means the checkpoint is unusable
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {_reason(e)}") from e
    return state["model"]


def load_checkpoint(path: Path, verify: bool = True) -> dict:
    """train_state.json plus "model": the whole model's weights (one process; export, sampling)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (a step_XXXXXXXX directory, format {FORMAT})")
    if verify and (path / MANIFEST).exists():
        verify_checkpoint(path)
    state = read_train_state(path)
    state["model"] = load_model_weights(path)
    return state


# ---------------------------------------------------------------- model shape, RNG

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
    """This process's random streams (CUDA: its own device's, one GPU per process)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
