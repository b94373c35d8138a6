"""Checkpoints: one directory per saved step under <run_dir>/checkpoints, written with
torch.distributed.checkpoint (DCP), so every rank writes its own shard; one format for one
process and for many.

    checkpoints/step_00001000/
        .metadata, __<rank>_<n>.distcp   DCP: "model" and "optimizer" (keyed by parameter name, so
                                        any world size or strategy can load them: DCP reshards)
        rank_00000.pt, rank_00001.pt    each rank's loader position and RNG states (torch.save)
        train_state.json                step, config, model shape, data identity, elapsed time, world size
        manifest.json                   size and checksum of every other file; written last

Atomic: all of it goes into `.step_00001000.tmp`, every file fsynced, the manifest last, then the
directory is renamed. A crash or `kill -9` at any moment leaves either a complete checkpoint or a
temp directory that is never listed and that the next successful save (or a resume) deletes;
older checkpoints are not touched before a new one is complete, and a pruned one is renamed to a
temp name before it is deleted. Loading verifies the manifest; a damaged checkpoint is reported by
name and an older one is used.

Saves go through a `Checkpointer`: synchronous, or asynchronous (DCP's async_save): the training
loop waits only while the state is copied into host memory (training/host_staging.py); a thread
writes, checksums and commits it while training goes on. One save is in flight at a time.

Under a process group every function here is called by all ranks in the same order: each local
failure is shared (all-gather) before anyone acts on it, so no rank waits for one that gave up."""
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .distributed import broadcast_object, current, gather_object
from .errors import CheckpointError
from .host_staging import HostStaging

log = logging.getLogger(__name__)

FORMAT = 2
_NAME = re.compile(r"^step_(\d+)$")
MANIFEST, TRAIN_STATE = "manifest.json", "train_state.json"
TENSORS = ("model", "optimizer")  # the keys of a state saved through DCP; "rank" is per rank; the rest JSON
FAILED = (Exception, CheckpointException)  # DCP's exception is a BaseException
# The manifest's checksum. xxh3_128 reads at ~8 GB/s on one core (sha256 1.2, blake2b 0.5) and
# releases the GIL: checksumming 13 GB takes ~2 s of the background write, not ~15 s. It guards
# against torn writes and bit rot, not tampering, so a non-cryptographic hash is enough. Manifests
# that name no hash were written with sha256, and still verify.
HASH = "xxh3_128"
# DCP warns on every call without a process group (also from its writer thread); one process is what we mean
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
_HASHES = {"xxh3_128": lambda: __import__("xxhash").xxh3_128(), "sha256": hashlib.sha256}


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


# ---------------------------------------------------------------- ranks

def _ranks() -> tuple[int, int]:
    d = current()
    return d.rank, d.world_size


def _first_error(err: Optional[str], group=None) -> Optional[str]:
    """A collective: the first rank's error (or None), on every rank."""
    errors = [(r, e) for r, e in enumerate(gather_object(err, current(), group)) if e]
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
    first = (str(e).strip().splitlines() or [""])[0]
    if not first or isinstance(e, LookupError):  # a KeyError's message is only its key: name the error
        return f"{type(e).__name__}: {first}" if first else type(e).__name__
    return first


def _causes(e: BaseException) -> list[BaseException]:
    """e, what it wraps (DCP's per-rank failures) and its causes and contexts, each once."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is seen for seen in out):
            continue
        out.append(x)
        failures = getattr(x, "failures", None) or {}
        todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return out


# torch's zip writer (torch.save, DCP's shards) reports a write the disk refused as a position
# mismatch, or as a failed write, without the OS error where it wrote through C++
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed")
# ... so with less than this left on the filesystem such a failure is taken for a full disk
DISK_FULL_BYTES = 1 << 30


def _bytes(n: int) -> str:
    return f"{n:,} bytes" if n < 1e6 else f"{n / 1e9:.3g} GB" if n < 1e12 else f"{n / 1e12:.3g} TB"


def _mount(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _write_failure(final: Path, e: BaseException) -> str:
    """The line for a failed checkpoint write: a full disk (ENOSPC, or torch's failed write with
    under DISK_FULL_BYTES left) named as such, with the bytes free on its filesystem, measured now,
    before the partial write is removed; else the reason (_reason)."""
    causes = _causes(e)
    enospc = next((c for c in causes if isinstance(c, OSError) and c.errno == errno.ENOSPC), None)
    try:
        free = shutil.disk_usage(_mount(final)).free
    except OSError:
        free = None
    torch_failed = any(m in str(c) for c in causes for m in _TORCH_WRITE_FAILED)
    if enospc is None and not (torch_failed and free is not None and free < DISK_FULL_BYTES):
        return f"could not write checkpoint {final}: {_reason(e)}"
    why = f" ({enospc.strerror})" if enospc is not None and enospc.strerror else ""
    room = f": {_bytes(free)} free on {_mount(final)}" if free is not None else ""
    return f"disk full{why} while writing checkpoint {final}{room}"


# ---------------------------------------------------------------- files

def _checksum(path: Path, algorithm: str = HASH) -> str:
    h = _HASHES[algorithm]()
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
    """{name: [size, checksum]} of names in d."""
    return {n: [(d / n).stat().st_size, _checksum(d / n)] for n in names}


def _missing_rank_files(manifest: dict) -> list[str]:
    """Per-rank state files a complete checkpoint of manifest["world_size"] ranks must list. (DCP's
    shards are not counted here: a rank may own none, e.g. under DDP; DCP's .metadata names the
    ones it needs and dcp.load fails on every rank when one is missing.)"""
    names, world = manifest["files"], manifest.get("world_size", 1)
    return [f"rank_{r:05d}.pt" for r in range(world) if f"rank_{r:05d}.pt" not in names]


def _remove(path: Path) -> None:
    """Delete a checkpoint or temp directory so that no kill on the way leaves a `step_*`
    directory behind: a complete one is renamed to a temp name first (never listed, deleted by
    the next cleanup)."""
    if _NAME.match(path.name):
        hidden = path.with_name(f".{path.name}.deleting.tmp")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(path, hidden)
        path = hidden
    shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(run_dir: Path) -> list[str]:
    """Delete what killed processes left in the checkpoints directory: temp directories and
    `step_*` directories without a manifest (half pruned by a trainer that deleted the manifest
    first). Rank 0 only. Returns the names removed."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    gone = [p for p in d.iterdir() if p.is_dir() and ((p.name.startswith(".step_") and p.name.endswith(".tmp"))
                                                      or (_NAME.match(p.name) and not (p / MANIFEST).is_file()))]
    for p in gone:
        _remove(p)
    return sorted(p.name for p in gone)


# ---------------------------------------------------------------- save

def _paths(run_dir: Path, step: int) -> tuple[Path, Path]:
    d = checkpoint_dir(run_dir)
    return d / f"step_{step:08d}", d / f".step_{step:08d}.tmp"


def _begin(run_dir: Path, step: int) -> None:
    """An empty temp directory for `step` (rank 0 makes it; every rank returns once it exists)."""
    final, tmp = _paths(run_dir, step)
    err = None
    if _ranks()[0] == 0:
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a killed attempt at this same step
            tmp.mkdir()
        except OSError as e:
            err = _write_failure(final, e)
    err = _first_error(err)
    if err:
        raise CheckpointError(f"{err}; the previous checkpoints in {tmp.parent} are intact")


def _complete(run_dir: Path, step: int, state: dict, keep_last: int, write_tensors: Callable[[], None],
              group=None) -> tuple[Path, int]:
    """Everything after _begin: the tensors (write_tensors), each rank's state and
    train_state.json, checksums, the manifest, the rename, then pruning to the newest keep_last
    (0: all). Collectives go through `group` (the background thread's own, for async saves).
    Returns (path, bytes of all ranks' files). A failure on any rank (disk full, read-only
    directory) raises CheckpointError on every rank; the temp directory is removed and the older
    checkpoints are intact."""
    final, tmp = _paths(run_dir, step)
    d = final.parent
    rank, world = _ranks()
    err = None

    def attempt(phase: Callable) -> None:
        nonlocal err
        if err is None:
            try:
                phase()
            except FAILED as e:  # noqa: BLE001 - any failure to write is reported the same way
                err = _write_failure(final, e)
        err = _first_error(err, group)  # collective: called by every rank at each phase, failed or not

    def tensors_and_rank_state() -> None:
        write_tensors()
        if "rank" in state:
            _write(tmp / f"rank_{rank:05d}.pt", lambda f: torch.save(state["rank"], f))
        if rank == 0:
            meta = {k: v for k, v in state.items() if k not in (*TENSORS, "rank")}
            body = {"format": FORMAT, "step": step, "world_size": world, **meta}
            _write(tmp / TRAIN_STATE, lambda f: f.write(json.dumps(body, indent=1).encode()))

    hashes = {}

    def hash_own_files() -> None:  # each rank checksums what it wrote
        hashes.update(_hash_files(tmp, _own_files(tmp, rank)))

    def commit() -> None:
        if rank == 0:
            manifest = {"format": FORMAT, "step": step, "world_size": world, "hash": HASH, "files": hashes}
            missing = _missing_rank_files(manifest)
            if "rank" in state and missing:
                raise OSError(f"files of some ranks are missing: {', '.join(missing)}")
            _write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            _fsync_dir(tmp)
            if final.exists():  # a step saved again (resumed from an older one): set the old one aside
                _remove(final)
            os.replace(tmp, final)
            _fsync_dir(d)

    attempt(tensors_and_rank_state)
    attempt(hash_own_files)
    if err is None:  # every rank is here, or none: err is shared
        for part in gather_object(hashes, current(), group):
            hashes.update(part)
    attempt(commit)
    if err:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{err}; the previous checkpoints in {d} are intact")
    if rank == 0:
        if keep_last > 0:
            for old in list_checkpoints(run_dir)[keep_last:]:
                _remove(old)
        for stale in d.glob(".step_*.tmp"):  # partial writes of killed processes: never complete, only disk
            shutil.rmtree(stale, ignore_errors=True)
    return final, sum(size for size, _ in hashes.values())


def _save_now(run_dir: Path, step: int, state: dict, keep_last: int) -> tuple[Path, int]:
    _begin(run_dir, step)
    tensors, tmp = {k: state[k] for k in TENSORS if k in state}, _paths(run_dir, step)[1]

    def write() -> None:
        dcp.save(tensors, checkpoint_id=tmp, no_dist=_ranks()[1] == 1)

    return _complete(run_dir, step, state, keep_last, write)


def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int = 0) -> Path:
    """Write step `step` atomically and synchronously, then keep only the newest `keep_last`
    (0: all).

    state: "model" (a state dict, possibly sharded), optionally "optimizer" (from
    torch.distributed.checkpoint.state_dict.get_state_dict) and "rank" (this rank's own small
    state: loader, RNG); every other key must be JSON and is the same on all ranks (rank 0 writes
    it). A failure on any rank raises CheckpointError on every rank (see _complete)."""
    return _save_now(run_dir, step, state, keep_last)[0]


class Checkpointer:
    """The saves of one run. `save` returns once the state is safe from the training that goes
    on: after the whole write (synchronous), or after it is copied into host memory
    (asynchronous: training/host_staging.py, one page-locked copy on GPUs kept from save to save),
    from which DCP's async_save writes it in a thread that then checksums and commits it; the
    checkpoint is visible to resume only once complete. The next `save`, and `close`, wait for the
    one in flight and raise its error. Each save logs `checkpoint step N: stall X s, written in Y s,
    Z GB`: stall is the time the training loop was blocked, written the time until the checkpoint
    was complete. Every rank constructs it at the same point (an async one makes a gloo group)."""

    @classmethod
    def for_run(cls, run_dir: Path, t, device: torch.device) -> "Checkpointer":
        """trainer.async_checkpoint=null: asynchronous on GPUs; on CPU the copy into host memory
        costs about what the write does, so synchronous."""
        asynchronous = t.async_checkpoint if t.async_checkpoint is not None else device.type == "cuda"
        return cls(run_dir, t.keep_last, asynchronous, t.dist_timeout_s)

    def __init__(self, run_dir: Path, keep_last: int, asynchronous: bool, timeout_s: float = 1800):
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        self.saves: list[dict] = []  # one per completed save: step, path, stall_s, written_s, bytes
        self.saves_started = 0
        self._pending: Optional[Future] = None
        self._staging = self._pool = self._group = None
        self.wants_prepare = asynchronous  # until prepare() (or a save) has run
        if asynchronous:
            self._staging = HostStaging(pinned=torch.cuda.is_available())
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            if dist.is_initialized():  # the writer's collectives (DCP wants a CPU backend), beside the loop's
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def check_space(self, model: torch.nn.Module, start: int, steps: int, ckpt_every: int,
                    stop_at_step: int = -1) -> None:
        """Before training: CheckpointError on every rank when the checkpoints to come do not fit
        (see check_space)."""
        err = None
        if _ranks()[0] == 0:
            try:
                each = checkpoint_bytes(model, "adamw", _ranks()[1])
                check_space(self.run_dir, each, saves_ahead(start, steps, ckpt_every, stop_at_step), self.keep_last,
                            ckpt_every)
                log.info(f"checkpoints: about {each / 1e9:.3g} GB each (estimate), "
                         f"{shutil.disk_usage(self.run_dir).free / 1e9:.3g} GB free in {self.run_dir}")
            except (CheckpointError, OSError) as e:
                err = str(e)
        err = broadcast_object(err, current())
        if err:
            raise CheckpointError(err)
        if self.asynchronous and _ranks()[0] == 0:
            warning = host_memory_warning(model)
            if warning:
                log.warning(warning)

    def prepare(self, tensors: dict) -> None:
        """Asynchronous saves: allocate the host copy for a state like `tensors` (its "model" and
        "optimizer") in the writer's thread, while training goes on, so that the first save does
        not wait for it. Call it once the optimizer has its state (after the first step). A
        failure here is only logged: the first save allocates again and reports its own error."""
        if not self.wants_prepare or self._pending is not None:
            return
        self.wants_prepare = False
        shapes = {k: tensors[k] for k in TENSORS if k in tensors}

        def reserve() -> None:
            t0 = time.perf_counter()
            try:
                self._staging.reserve(shapes)
            except Exception as e:  # noqa: BLE001 - the save itself will say why
                log.warning(f"could not prepare the background checkpoint's host copy: {_reason(e)}")
                return
            log.info(f"checkpoints: host copy of {self._staging.nbytes / 1e9:.3g} GB ready in "
                     f"{time.perf_counter() - t0:.2f} s")

        self._pending = self._pool.submit(reserve)

    def save(self, step: int, state: dict) -> None:
        """Save `state` (as save_checkpoint takes it) as step `step`."""
        t0 = time.perf_counter()
        writing = self._pending is not None and self.saves_started > len(self.saves)
        self.wait()
        waited = time.perf_counter() - t0
        if writing and waited > 1.0 and _ranks()[0] == 0:
            log.warning(f"checkpoint step {step}: waited {waited:.1f} s for the previous checkpoint's write; "
                        f"checkpoints come faster than they are written (raise trainer.ckpt_every)")
        self.saves_started += 1
        if not self.asynchronous:
            path, nbytes = _save_now(self.run_dir, step, state, self.keep_last)
            written = time.perf_counter() - t0
            self._done(step, path, written, written, nbytes)
            return
        self.wants_prepare = False
        _begin(self.run_dir, step)
        final, tmp = _paths(self.run_dir, step)
        err, upload = None, None
        try:
            upload = dcp.async_save({k: state[k] for k in TENSORS if k in state}, checkpoint_id=tmp,
                                    process_group=self._group, async_stager=self._staging,
                                    no_dist=_ranks()[1] == 1)
        except FAILED as e:  # noqa: BLE001 - staging (host memory) or planning failed
            err = _write_failure(final, e)
        err = _first_error(err)
        if err:
            if _ranks()[0] == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{err}; the previous checkpoints in {tmp.parent} are intact")
        stall = time.perf_counter() - t0
        rest = {k: v for k, v in state.items() if k not in TENSORS}  # small: this rank's state, JSON

        def finish() -> None:
            path, nbytes = _complete(self.run_dir, step, rest, self.keep_last, upload.result, self._group)
            self._done(step, path, stall, time.perf_counter() - t0, nbytes)

        self._pending = self._pool.submit(finish)

    def _done(self, step: int, path: Path, stall: float, written: float, nbytes: int) -> None:
        self.saves.append({"step": step, "path": str(path), "stall_s": stall, "written_s": written, "bytes": nbytes})
        if _ranks()[0] == 0:
            log.info(f"checkpoint step {step}: stall {stall:.2f} s, written in {written:.2f} s, "
                     f"{nbytes / 1e9:.3g} GB ({path})")

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, raise_errors: bool = True) -> None:
        """Wait for the save in flight, then free the host copy. raise_errors=False (the run is
        already failing): a failed save is logged instead of raised."""
        try:
            self.wait()
        except CheckpointError as e:
            if raise_errors:
                raise
            log.error(f"error: {e}")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._staging is not None:
                self._staging.release()


# ---------------------------------------------------------------- size and free space

# DCP writes each tensor as its own torch.save record (a zip container) and describes it in
# .metadata: about 2 KiB per tensor, measured (8.2 KiB per parameter with AdamW's 3 state tensors).
BYTES_PER_TENSOR = 2048
# rank_XXXXX.pt (loader position, RNG states: ~10 KiB measured) and, once, train_state.json +
# manifest.json (the resolved config and one line per file)
BYTES_PER_RANK, BYTES_ONCE = 12 << 10, 16 << 10


def checkpoint_bytes(model: torch.nn.Module, optimizer: str = "adamw", world_size: int = 1) -> int:
    """The bytes one checkpoint takes on disk, all ranks' files together, from the parameters'
    numel and dtype (a model on the meta device will do; a sharded parameter counts whole):
    the model's state dict, AdamW's exp_avg and exp_avg_sq per parameter (in the parameter's
    dtype: fp32 here) and its step counter, DCP's per-tensor overhead, each rank's loader/RNG
    state and the JSON files. optimizer: "adamw" or "none" (weights only)."""
    if optimizer not in ("adamw", "none"):
        raise ValueError(f"checkpoint_bytes: optimizer={optimizer!r}; known: adamw, none")
    total = BYTES_ONCE + BYTES_PER_RANK * world_size
    for t in model.state_dict().values():
        total += t.numel() * t.element_size() + BYTES_PER_TENSOR
    if optimizer == "adamw":
        for p in model.parameters():
            if p.requires_grad:  # exp_avg, exp_avg_sq, and step (a float32 scalar)
                total += 2 * p.numel() * p.element_size() + 4 + 3 * BYTES_PER_TENSOR
    return total


def host_memory_warning(model: torch.nn.Module) -> Optional[str]:
    """A background save keeps a host copy of each process's model and optimizer state (each
    rank's shard under FSDP, everything under DDP): a warning when the processes of this node
    would need more than the host's available memory."""
    from .distributed import local

    each = sum(3 * local(p).numel() * p.element_size() for p in model.parameters())  # weights + AdamW's 2
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = available_host_bytes()
    if available is None or each * procs <= available:
        return None
    return (f"background checkpoints copy {each / 1e9:.3g} GB per process ({procs} on this host) into host memory, "
            f"{available / 1e9:.3g} GB are available; set trainer.async_checkpoint=false if the host runs short")


def available_host_bytes() -> Optional[int]:
    """The host's available memory (MemAvailable: free plus what the kernel can reclaim); where
    /proc/meminfo has none, the free pages; None where neither is known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def saves_ahead(start: int, steps: int, ckpt_every: int, stop_at_step: int = -1) -> int:
    """How many checkpoints a run from step `start` writes: every ckpt_every steps, the last
    step, and trainer.stop_at_step."""
    end = min(steps, stop_at_step) if stop_at_step > start else steps
    n = len(range(ckpt_every * (start // ckpt_every + 1), end + 1, ckpt_every))
    return n + (end % ckpt_every != 0 and end > start)


def space_needed(each: int, saves: int, existing: int, keep_last: int) -> int:
    """Bytes beyond what is on disk now: keep_last copies plus the one being written (all of
    them with keep_last=0), less the complete checkpoints already there (they are pruned only
    after the next save is complete)."""
    if saves <= 0:
        return 0
    peak = existing + saves if keep_last == 0 else min(keep_last, existing + saves - 1) + 1
    return each * max(1, peak - existing)


def check_space(run_dir: Path, each: int, saves: int, keep_last: int, ckpt_every: int) -> None:
    """Raise CheckpointError (one line) when the checkpoint directory's filesystem has less free
    space than space_needed. Rank 0's view; the caller shares the outcome."""
    d = checkpoint_dir(run_dir)
    existing = len(list_checkpoints(run_dir))
    need = space_needed(each, saves, existing, keep_last)
    probe = d if d.is_dir() else run_dir
    free = shutil.disk_usage(probe).free
    if need > free:
        copies = f"all {saves} saves (trainer.keep_last=0)" if keep_last == 0 else \
            f"trainer.keep_last={keep_last} plus the one being written"
        raise CheckpointError(
            f"not enough disk space for checkpoints in {d}: {need / 1e9:.3g} GB needed "
            f"({need // each} x {each / 1e9:.3g} GB: {copies}), {free / 1e9:.3g} GB free; lower trainer.keep_last, "
            f"raise trainer.ckpt_every (now {ckpt_every}), free space or choose another output dir "
            f"(hydra.run.dir=...); trainer.check_space=false skips this check")


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
        algorithm = manifest.get("hash", "sha256")  # manifests without one were written with sha256
        if _checksum(f, algorithm) != sha:
            return f"checkpoint {path} is damaged: the {algorithm} checksum of {n} does not match its manifest"
    return None


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"].items()
        if manifest.get("hash", "sha256") not in _HASHES:
            raise ValueError(manifest["hash"])
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
    damaged ones with a warning (None when there is none), after removing the leftovers of killed
    processes (remove_leftovers). Otherwise a checkpoint directory that
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
    if rank == 0:
        gone = remove_leftovers(run_dir)
        if gone:
            log.info(f"removed what killed processes left in {checkpoint_dir(run_dir)}: {', '.join(gone)}")
    for path in broadcast_object(list_checkpoints(run_dir) if rank == 0 else None, current()):
        try:
            verify_checkpoint(path)
            return path, _agreed(read_train_state, path)
        except CheckpointError as e:
            if rank == 0:
                log.warning(f"skipping damaged checkpoint: {e}")
    return None


# ---------------------------------------------------------------- load

def load_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state into this rank's (possibly sharded) model; DCP reshards a
    checkpoint written with another world size or strategy."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
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


def load_weights_into(path: Path, model: torch.nn.Module) -> None:
    """A checkpoint's model weights, and nothing else of its run, into `model` as built for training
    (float8-converted, compiled or sharded; each rank reads its own shards, as a resume does):
    scripts/bench_step.py's steps from trained weights. The architecture must match (model_shape):
    srelu and srelu24 share theirs, so one's weights serve the other; swiglu's do not. Not verified
    against the manifest here (verify_checkpoint, once, is the caller's)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    check_model_shape(path, read_train_state(path), model)
    weights = get_model_state_dict(model)
    try:
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=_ranks()[1] == 1)
        set_model_state_dict(model, weights)
    except FAILED as e:  # noqa: BLE001 - DCP's and load_state_dict's errors: one line
        raise CheckpointError(f"cannot load the model weights of {path}: {_reason(e)}") from e


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
