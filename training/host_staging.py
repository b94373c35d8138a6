"""The host copy a background checkpoint writes from, kept from save to save.

A background save must copy the model and optimizer state out of the GPU before training changes
it; the training loop waits for that copy (the stall). What makes the copy slow is not the
transfer (12.5 GB at tens of GB/s) but allocating and page-locking fresh host memory for it, which
DCP's DefaultStager does for each of its instances (4.2 s of a 4.2 s stall at 1B shapes). Here the
memory is one buffer, allocated and page-locked once (`reserve`, which the trainer runs in a
thread after its first step, so even the first save finds it ready), then reused: a save is one
device-to-host copy per tensor into it. One buffer, registered with cudaHostRegister, takes exactly
the state's bytes (the pinned caching allocator would round each tensor up to a power of two) and
cannot overlap another registration.

It is an `AsyncStager` for `torch.distributed.checkpoint.async_save`. Its `close()` keeps the
copy, should DCP close the stager it was given after an upload; `release()` frees it.
"""
import threading
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.checkpoint.staging import AsyncStager
from torch.utils._pytree import tree_flatten, tree_unflatten

ALIGN = 4096  # each tensor's bytes start on a page of the buffer


def _local(t: Tensor) -> Tensor:
    """A DTensor's own shard (what this rank copies and writes); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class HostStaging(AsyncStager):
    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(self, pinned: bool):
        """pinned: page-lock the buffer (GPUs) so that the copies run at full speed."""
        self.pinned = pinned
        self._lock = threading.Lock()  # reserve() runs in a thread, stage() in the loop
        self._signature: Any = None
        self._buffer: Optional[Tensor] = None
        self._leaves: list = []  # per leaf of the state: its host copy (tensors) or None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def reserve(self, state_dict: dict) -> None:
        """Allocate (and page-lock) the host copy for a state of this structure, unless it exists.
        A state of another structure (other keys, shapes or dtypes) replaces it."""
        leaves, spec = tree_flatten(state_dict)
        signature = (spec, [(tuple(_local(x).shape), _local(x).dtype) if isinstance(x, Tensor) else None
                            for x in leaves])
        with self._lock:
            if signature == self._signature:
                return
            self._free()
            sizes = [_local(x).numel() * _local(x).element_size() if isinstance(x, Tensor) else 0 for x in leaves]
            offsets, total = [], 0
            for size in sizes:
                offsets.append(total)
                total += -(-size // ALIGN) * ALIGN
            buffer = torch.empty(max(total, 1), dtype=torch.uint8)
            if self.pinned and total > 0:
                err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
                if int(err) != 0:
                    raise RuntimeError(f"could not page-lock {total / 1e9:.3g} GB of host memory for the "
                                       f"background checkpoint (CUDA error {int(err)})")
            self._buffer = buffer
            self._leaves = [_host_like(x, buffer, off, size) if isinstance(x, Tensor) else None
                            for x, off, size in zip(leaves, offsets, sizes)]
            self._signature = signature

    @torch.no_grad()
    def stage(self, state_dict: dict) -> dict:
        """The state with every tensor replaced by its host copy, copied now; the other values
        (numbers, strings) are the state's own."""
        self.reserve(state_dict)
        leaves, spec = tree_flatten(state_dict)
        with self._lock:
            for x, host in zip(leaves, self._leaves):
                if host is not None:
                    _local(host).copy_(_local(x), non_blocking=self.pinned)
            if self.pinned:
                torch.cuda.synchronize()  # the copies are complete before training changes the weights
            return tree_unflatten([host if host is not None else x for x, host in zip(leaves, self._leaves)], spec)

    def synchronize_staging(self) -> None:
        """stage() is complete when it returns."""

    def close(self) -> None:
        """Kept for the next save, should DCP call this after an upload: see release()."""

    def release(self) -> None:
        """Free the host copy (after the last write from it is complete)."""
        with self._lock:
            self._free()

    def _free(self) -> None:
        if self._buffer is not None and self.pinned and self._buffer.numel() > 1:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer, self._leaves, self._signature = None, [], None


def _host_like(x: Tensor, buffer: Tensor, offset: int, size: int) -> Tensor:
    """x's host copy: `size` bytes of `buffer` at `offset`, with x's (local) shape and dtype. A DTensor keeps its
    mesh and placements (what DCP writes as the shard's place in the whole tensor): a host DTensor
    whose shard is the view, as torch's own staging builds it."""
    local = _local(x)
    if size == 0:
        view = torch.empty(local.shape, dtype=local.dtype)
    else:  # a storage of its own bytes only: DCP clones a tensor whose storage is larger before it writes it
        view = torch.frombuffer(buffer.numpy(), dtype=torch.uint8, count=size, offset=offset)
        view = view.view(local.dtype).view(local.shape)
    if local is x:
        return view
    host = x.detach().to("cpu")  # the DTensor's metadata on the host (its shard copied once, then replaced)
    host._local_tensor = view
    return host
