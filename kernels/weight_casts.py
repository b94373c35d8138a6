"""srelu24's e4m3 weight conversions, kept across the micro-batches of one optimizer step.

Under gradient accumulation the weights do not change between an optimizer step and the next, yet
each micro-batch's forward and backward convert W1 and W2 to e4m3 again: four conversions per
layer (W1's rows for Z, W2's rows for the 2:4 forward, W2's columns for dA, W1's columns for dX),
each reading the fp32 weight (270 MB at 7B) - about 5 ms of a 7B step at 8 layers on the H200
(benchmarks/RESULTS.md). training/step.py runs an optimizer step's micro-batches inside
`reuse_within_step()`, and the op asks `converted(kind, w, convert)` for each conversion: inside,
the first micro-batch converts and the rest reuse the result; outside (a single micro-batch, the
benchmarks, tests) every call converts, as before.

What a hit needs, so that a stale conversion is never used:
- an fp32 weight: the single-device and DDP parameters as the op takes them. Under FSDP2 the
  step does not open the scope (its gathered weights are freed and re-gathered into memory that
  another layer's may have held, without a version bump).
- the same tensor: the same storage (its StorageImpl, kept alive by the entry), at the same
  address, shape and strides, and the same version counter. Every in-place write (the optimizer's,
  a checkpoint load's `copy_`) bumps the version; a `.data =` swap changes the storage.
- and the scope itself: it ends before the optimizer step, and its end drops everything kept.

Memory: what is kept is e4m3, one byte per weight element per conversion, four conversions of
d x F elements each per layer (270 MB per 7B layer), held until the micro-batches end
(training/memory.py counts it).
"""
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

_kept: dict | None = None  # None: outside the scope; else key -> (weight, version, conversion)


@contextmanager
def reuse_within_step(enabled: bool = True):
    """Inside, `converted` keeps each fp32 weight's conversions; they are dropped on the way out.
    enabled=False (one micro-batch per step: nothing to reuse) leaves every call converting."""
    global _kept
    outer = _kept
    _kept = {} if enabled else None
    try:
        yield
    finally:
        _kept = outer


def active() -> bool:
    return _kept is not None


def converted(kind: str, w: Tensor, convert: Callable[[], T]) -> T:
    """convert(), or what it returned for this weight (the same tensor, unchanged) earlier in the
    scope. kind names the conversion (one weight has several)."""
    if _kept is None or w.dtype != torch.float32:
        return convert()
    storage = w.untyped_storage()
    key = (kind, w.device, storage._cdata, w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    hit = _kept.get(key)
    if hit is not None and hit[1] == w._version and hit[0].data_ptr() == w.data_ptr():
        return hit[2]
    out = convert()
    _kept[key] = (w, w._version, out)
    return out
