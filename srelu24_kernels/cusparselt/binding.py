"""cuSPARSELt 2:4 GEMMs with cached plans, called through ctypes.

`torch._cslt_sparse_mm` builds every cuSPARSELt descriptor and the matmul plan from scratch on
each call and destroys them after: host time per call that is many times a dense `F.linear`'s
(the figures are in benchmarks/RESULTS.md). The srelu24 FFN makes four such calls per layer and
step, so at 1B shapes the GPU waited on the host. Here the descriptors and
the plan are built once per (shape, layout, algorithm) and kept; a call is one
`cusparseLtMatmul` on the current stream.

The descriptors are the ones `torch._cslt_sparse_mm` sets up (aten/src/ATen/native/sparse/cuda/
cuSPARSELtOps.cpp), so the compressed operand is the same buffer: A [m, k] 2:4 row-major
(compressed, as srelu24_kernels/srelu24/sparsify*.py write it), B [k, n] row-major or the transpose of a
row-major [n, k], D [m, n] row-major bf16 (or column-major: torch's `transpose_result`, the product
returned as its transpose [n, m], which is how the weight gradient dW2 is wanted), fp32 accumulation.
A and B in bf16, or both in e4m3 (B then K-major, the transpose of a row-major [n, k]; D still bf16:
srelu24_kernels/float8/sparse.py). The library is the one torch
loaded. Each new plan's product is checked once against torch's; any failure (library not
found, an error status, a different product) falls back to torch._cslt_sparse_mm with a
warning, so this can only make the GEMM cheaper to launch, never wrong. Inputs it was not built
for (other dtypes, misaligned, another device than the current one) go to torch's op as well.

The first call of a shape synchronises (the check); under CUDA graph capture, warm every shape
up first. The workspace comes from the caching allocator on each call, so calls on several
streams do not share it. Plans are never freed (one per shape and id the search timed, a few KiB
of host memory each).
"""
import ctypes
import glob
import logging
import os
import threading
import time
import warnings
from typing import Optional

import torch
from torch import Tensor

# enum values of cusparseLt.h (0.5+) and library_types.h / cusparse.h
_CUDA_R_16BF, _CUDA_R_8F_E4M3, _ORDER_COL, _ORDER_ROW, _OP_N, _OP_T = 14, 28, 1, 2, 0, 1
_SPARSITY_50, _COMPUTE_32F, _ALG_DEFAULT, _ALG_CONFIG_ID = 0, 2, 0, 0
_MIN_VERSION = 502  # major * 1000 + minor * 100 + patch
_OPAQUE_BYTES = 16384  # the opaque structs are 1 KiB or less in 0.5-0.8; room to spare, 64-byte aligned


class _Opaque:
    """An aligned host buffer standing in for one of cuSPARSELt's opaque structs."""

    def __init__(self):
        self._buf = ctypes.create_string_buffer(_OPAQUE_BYTES + 64)
        self.ptr = ctypes.c_void_p((ctypes.addressof(self._buf) + 63) & ~63)


def _find_library() -> Optional[str]:
    """The libcusparseLt torch loaded (its path from the process's memory map), else the
    nvidia-cusparselt wheel's copy beside torch."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcusparseLt" in line:
                    return line.split()[-1]
    except OSError:
        pass
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "cusparselt*", "lib", "libcusparseLt.so*")))
    return found[0] if found else None


class _Lib:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i64, u32, i32, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "cusparseLtInit": [p],
            "cusparseLtStructuredDescriptorInit": [p, p, i64, i64, i64, u32, i32, i32, i32],
            "cusparseLtDenseDescriptorInit": [p, p, i64, i64, i64, u32, i32, i32],
            "cusparseLtMatmulDescriptorInit": [p, p, i32, i32, p, p, p, p, i32],
            "cusparseLtMatmulAlgSelectionInit": [p, p, p, i32],
            "cusparseLtMatmulAlgSetAttribute": [p, p, i32, p, sz],
            "cusparseLtMatmulPlanInit": [p, p, p, p],
            "cusparseLtMatmulGetWorkspace": [p, p, ctypes.POINTER(sz)],
            "cusparseLtMatmul": [p, p, p, p, p, p, p, p, p, p, i32],
            "cusparseLtGetVersion": [p, ctypes.POINTER(i32)],
            "cusparseLtMatDescriptorDestroy": [p],
            "cusparseLtMatmulPlanDestroy": [p],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, name, fn)
        self.handle = _Opaque()
        self.check("cusparseLtInit", self.handle.ptr)
        version = ctypes.c_int(0)
        self.check("cusparseLtGetVersion", self.handle.ptr, ctypes.byref(version))
        if version.value < _MIN_VERSION:  # the enum values above are 0.5.2's and later
            raise RuntimeError(f"cuSPARSELt {version.value} is older than {_MIN_VERSION}")

    def check(self, name: str, *args) -> None:
        status = getattr(self, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned cuSPARSELt status {status}")


class _Plan:
    """Descriptors and plan of one GEMM shape; `run` enqueues it."""

    def __init__(self, lib: _Lib, m: int, k: int, n: int, b_transposed: bool, alg: int, device,
                 transpose_result: bool = False, e4m3: bool = False):
        self.lib, self.m, self.n, self.transpose_result = lib, m, n, transpose_result
        h = lib.handle.ptr
        self.a, self.b, self.d = _Opaque(), _Opaque(), _Opaque()
        self.mm, self.sel, self.plan = _Opaque(), _Opaque(), _Opaque()
        ab = _CUDA_R_8F_E4M3 if e4m3 else _CUDA_R_16BF
        lib.check("cusparseLtStructuredDescriptorInit", h, self.a.ptr, m, k, k, 16, ab, _ORDER_ROW, _SPARSITY_50)
        rows, cols = (n, k) if b_transposed else (k, n)
        lib.check("cusparseLtDenseDescriptorInit", h, self.b.ptr, rows, cols, cols, 16, ab, _ORDER_ROW)
        lib.check("cusparseLtDenseDescriptorInit", h, self.d.ptr, m, n, m if transpose_result else n, 16, _CUDA_R_16BF,
                  _ORDER_COL if transpose_result else _ORDER_ROW)
        lib.check("cusparseLtMatmulDescriptorInit", h, self.mm.ptr, _OP_N, _OP_T if b_transposed else _OP_N,
                  self.a.ptr, self.b.ptr, self.d.ptr, self.d.ptr, _COMPUTE_32F)
        lib.check("cusparseLtMatmulAlgSelectionInit", h, self.sel.ptr, self.mm.ptr, _ALG_DEFAULT)
        alg_id = ctypes.c_int(alg)
        lib.check("cusparseLtMatmulAlgSetAttribute", h, self.sel.ptr, _ALG_CONFIG_ID, ctypes.byref(alg_id),
                  ctypes.sizeof(alg_id))
        lib.check("cusparseLtMatmulPlanInit", h, self.plan.ptr, self.mm.ptr, self.sel.ptr)
        ws = ctypes.c_size_t(0)
        lib.check("cusparseLtMatmulGetWorkspace", h, self.plan.ptr, ctypes.byref(ws))
        self.workspace_bytes = max(ws.value, 1)  # 32 MiB at the FFN's shapes on the H200
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def run(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        shape = (self.n, self.m) if self.transpose_result else (self.m, self.n)
        d = torch.empty(shape, dtype=torch.bfloat16, device=a.device) if out is None else out
        # per call and stream-ordered, as torch's op does: no sharing between streams
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=a.device)
        stream = (ctypes.c_void_p * 1)(torch.cuda.current_stream(a.device).cuda_stream)
        self.lib.check("cusparseLtMatmul", self.lib.handle.ptr, self.plan.ptr, ctypes.byref(self.alpha),
                       a.data_ptr(), b.data_ptr(), ctypes.byref(self.beta), d.data_ptr(), d.data_ptr(),
                       workspace.data_ptr(), stream, 1)
        return d

    def destroy(self) -> None:
        """Release the library's side of a plan that is not kept."""
        self.lib.cusparseLtMatmulPlanDestroy(self.plan.ptr)
        for desc in (self.a, self.b, self.d):
            self.lib.cusparseLtMatDescriptorDestroy(desc.ptr)


_LIB: dict = {}     # device index -> _Lib, or None where it could not be loaded
_PLANS: dict = {}   # (device index, m, k, n, b_transposed, alg, transpose_result, e4m3) -> _Plan, or None: torch's op
_LOCK = threading.Lock()  # forward (main thread) and backward (autograd's thread) both build plans


def _warn_fallback(why: str) -> None:
    warnings.warn(f"cuSPARSELt plan cache unavailable ({why}); using torch._cslt_sparse_mm, which re-plans "
                  "every call (host time per call; benchmarks/RESULTS.md)", RuntimeWarning, stacklevel=3)


def _library(device) -> Optional[_Lib]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _LIB:
        lib, path = None, _find_library()
        if path is None:
            _warn_fallback("libcusparseLt not found")
        else:
            try:
                with torch.cuda.device(idx):
                    lib = _Lib(path)
            except Exception as e:  # noqa: BLE001 - any failure to load means: torch's op
                _warn_fallback(f"{path}: {e}")
        _LIB[idx] = lib
    return _LIB[idx]


def torch_mm(a: Tensor, b: Tensor, alg: int, transpose_result: bool = False) -> Tensor:
    """torch._cslt_sparse_mm with algorithm `alg` (0: the default) and torch's transpose_result;
    e4m3 operands give bf16."""
    kw = {"alg_id": alg} if alg else {}
    if transpose_result:
        kw["transpose_result"] = True
    if a.dtype == torch.float8_e4m3fn:
        kw["out_dtype"] = torch.bfloat16
    return torch._cslt_sparse_mm(a, b, **kw)


_SEARCHED: dict = {}  # (A shape, B shape, B strides, transpose_result, A dtype) -> algorithm id
_FIXED: list = [None]  # ffn.sparse_gemm_alg: one algorithm id for every shape, or None: searched per shape
_log = logging.getLogger(__name__)


def set_algorithm(alg: Optional[int]) -> None:
    """The 2:4 GEMMs from now on at algorithm id `alg` for every shape (ffn.sparse_gemm_alg), or
    None: the id searched per shape (searched_alg). Process-wide, as the plans are."""
    if alg is not None and (not isinstance(alg, int) or alg < 0):
        raise ValueError(f"a cuSPARSELt algorithm id is an integer >= 0, got {alg!r}")
    _FIXED[0] = alg


def searched_alg(a: Tensor, b: Tensor, transpose_result: bool = False) -> int:
    """The algorithm id for this shape, layout and dtype (cached, and logged once with how it was
    chosen): set_algorithm's where one is set, else _search's. One search at a time (the forward's
    thread and autograd's can both meet a new shape), and nothing is cached if it fails."""
    key = (tuple(a.shape), tuple(b.shape), b.stride(), transpose_result, a.dtype)
    if key in _SEARCHED:
        return _SEARCHED[key]
    with _SEARCH_LOCK:
        if key not in _SEARCHED:
            alg, how = (_FIXED[0], "set by ffn.sparse_gemm_alg") if _FIXED[0] is not None else _search(
                a, b, transpose_result)
            _log.info(f"cuSPARSELt 2:4 GEMM, {str(a.dtype).removeprefix('torch.')} A {list(a.shape)} (compressed) x "
                      f"B {list(b.shape)}{' (K-major)' if not b.is_contiguous() else ''}"
                      f"{', transposed result' if transpose_result else ''}: algorithm {alg} ({how})")
            _SEARCHED[key] = alg
    return _SEARCHED[key]


_SEARCH_LOCK = threading.Lock()  # not _LOCK: the search builds plans through cached_mm, which takes that
_MAX_IDS = 64  # where torch's mm_search does not say how many ids a shape has
# Two ids' bf16 products differ by their output rounding, at most one bf16 unit in the last place
# (2^-7 relative) an element, so a row's difference is under 2^-7 of its norm (every id was within
# 2.6e-3 of the float32 product overall at the 7B FFN's shapes: lab/LOG.md). A wrong id, even in
# one row, is off by far more. Rows far smaller than the others (cancellation) are measured
# against 1% of the median row's norm.
_SAME_ROWS = 2.0 ** -5
_ROUNDS = 3  # timing rounds over all ids, interleaved: a clock change hits every id alike


def _row_distance(got: Tensor, ref: Tensor) -> float:
    """The largest difference of a row of `got` from `ref`'s, relative to that row's norm (floored as
    above); NaN where either has a NaN."""
    rows = ref.norm(dim=-1)
    floor = (rows.median() * 1e-2).clamp_min(torch.finfo(torch.float32).tiny)
    return ((got - ref).norm(dim=-1) / torch.maximum(rows, floor)).max().item()


def _search(a: Tensor, b: Tensor, transpose_result: bool) -> tuple[int, str]:
    """(the fastest id whose product matches id 0's, how it was chosen). Every id is timed on these
    operands through the path the GEMMs take (the cached plans on a GPU), the median of _ROUNDS
    interleaved rounds. An upstream issue reports wrong results for some ids, so an id with a row
    further than _SAME_ROWS from id 0's is left out. torch's mm_search only tells how many ids
    there are: its own pick, timed once inside cuSPARSELt, changed from run to run at the 7B FFN's
    shape, and a check at 1e-3 of the norm (below bf16 rounding on trained operands) had the 7B
    study's srelu24 fall back to slower ids (lab/LOG.md)."""
    out = torch.bfloat16 if a.dtype == torch.float8_e4m3fn else None
    try:
        found = torch._C._cusparselt.mm_search(a, b, None, None, out, transpose_result)
    except (AttributeError, RuntimeError, TypeError):
        return 0, "no search in this build"  # the default algorithm
    # torch's tuple ends with cuSPARSELt's ALG_CONFIG_MAX_ID, a count: ids 0-23 where it said 24
    count = found[-1] if isinstance(found, tuple) and len(found) == 4 else _MAX_IDS
    ref = torch_mm(a, b, 0, transpose_result).float()
    ok, dist, differ = [], {}, []
    for alg in range(count):
        try:
            got = torch_mm(a, b, alg, transpose_result).float()
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:
            continue  # an id this shape does not take
        dist[alg] = _row_distance(got, ref)
        (ok if dist[alg] <= _SAME_ROWS else differ).append(alg)  # NaN: differs
    if not ok:
        return 0, "no id's product matches id 0's, not even id 0's own (non-finite operands?)"
    rounds = [[_time_ms(a, b, alg, transpose_result) for alg in ok] for _ in range(_ROUNDS)]
    times = {alg: sorted(r[i] for r in rounds)[_ROUNDS // 2] for i, alg in enumerate(ok)}
    best = min(times, key=times.get)
    how = (f"the fastest of {len(times)} ids timed: {times[best]:.3f} ms, id 0 {times.get(0, float('nan')):.3f} ms; "
           f"rows within {max(dist[i] for i in ok):.1e} of id 0's")
    return best, how + (f"; left out, further from id 0's: {', '.join(f'{i} ({dist[i]:.1e})' for i in differ)}"
                        if differ else "")


def _time_ms(a: Tensor, b: Tensor, alg: int, transpose_result: bool, reps: int = 5) -> float:
    """Time of one a @ b at id `alg` the way sparse_mm runs it (the cached plan on a GPU; its first
    call builds and checks the plan): the mean of `reps` back-to-back calls after one untimed."""
    mm = cached_mm if a.is_cuda else torch_mm
    mm(a, b, alg, transpose_result)
    if not a.is_cuda:
        t0 = time.perf_counter()
        for _ in range(reps):
            mm(a, b, alg, transpose_result)
        return (time.perf_counter() - t0) * 1e3 / reps
    with torch.cuda.device(a.device):
        stream = torch.cuda.current_stream(a.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            mm(a, b, alg, transpose_result)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / reps


def _new_plan(a: Tensor, b: Tensor, key: tuple) -> Optional[_Plan]:
    """A plan for this GEMM, kept only if its product equals torch's bit for bit."""
    idx, m, k, n, b_transposed, alg, transpose_result, e4m3 = key
    lib = _library(a.device)
    if lib is None:
        return None
    plan = None
    try:
        plan = _Plan(lib, m, k, n, b_transposed, alg, a.device, transpose_result, e4m3)
        want, got = torch_mm(a, b, alg, transpose_result), plan.run(a, b)
        if got.shape == want.shape and torch.equal(got, want):
            return plan
        how = (f"shape {tuple(got.shape)} against {tuple(want.shape)}" if got.shape != want.shape else
               f"relative difference {((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item():.2e}")
        _warn_fallback(f"its product differs from torch's for A [{m}, {k}], B [{k}, {n}], alg {alg}: {how}")
    except Exception as e:  # noqa: BLE001 - any failure to plan means: torch's op for this shape
        _warn_fallback(f"A [{m}, {k}], B [{k}, {n}], alg {alg}: {e}")
    if plan is not None:
        plan.destroy()
    return None


def cached_mm(a: Tensor, b: Tensor, alg: int, transpose_result: bool = False, out: Optional[Tensor] = None) -> Tensor:
    """torch._cslt_sparse_mm(a, b, alg_id=alg, transpose_result=...) for a bf16 compressed A
    [m, 9k/16] on CUDA and a bf16 B [k, n] (row-major, or the transpose of a row-major matrix),
    or an e4m3 A [m, 5k/8] and an e4m3 K-major B (bf16 out), with the plan built once.
    transpose_result: the product comes back as (A B)^T, [n, m]. out (bf16, contiguous, the product's
    shape): written there and returned (torch's op writes its own, copied there)."""
    b_transposed = not b.is_contiguous()
    if b_transposed and not b.t().is_contiguous():
        b = b.contiguous()
        b_transposed = False
    m, (k, n) = a.shape[0], b.shape
    if out is not None and (out.dtype != torch.bfloat16 or not out.is_contiguous()
                            or tuple(out.shape) != ((n, m) if transpose_result else (m, n))):
        raise ValueError(f"cached_mm writes a contiguous bf16 {(n, m) if transpose_result else (m, n)} product, got "
                         f"out {out.dtype} {tuple(out.shape)}, strides {out.stride()}")
    idx = a.get_device()
    e4m3 = a.dtype == b.dtype == torch.float8_e4m3fn and b_transposed
    size_ok = a.numel() * 8 == m * k * 5 if e4m3 else a.numel() * 16 == m * k * 9
    if (not (e4m3 or a.dtype == b.dtype == torch.bfloat16) or not a.is_contiguous() or not size_ok
            or a.data_ptr() % 16 or b.data_ptr() % 16 or b.get_device() != idx or idx != torch.cuda.current_device()):
        return _into(torch_mm(a, b, alg, transpose_result), out)  # not what the plans are built for: torch's op checks
    key = (idx, m, k, n, b_transposed, alg, transpose_result, e4m3)
    plan = _PLANS.get(key, False)
    if plan is False:
        with _LOCK:
            if key not in _PLANS:
                _PLANS[key] = _new_plan(a, b, key)
            plan = _PLANS[key]
    return _into(torch_mm(a, b, alg, transpose_result), out) if plan is None else plan.run(a, b, out)


def _into(y: Tensor, out: Optional[Tensor]) -> Tensor:
    return y if out is None else out.copy_(y)


def sparse_mm(a: Tensor, b: Tensor, transpose_result: bool = False) -> Tensor:
    """A @ B with A compressed (bf16 or e4m3, as cached_mm takes them), at the searched algorithm
    id; transpose_result: (A @ B)^T [n, m], cuSPARSELt's column-major output. On a GPU through
    the cached plans, elsewhere (the CPU stand-in in tests) through torch's op."""
    alg = searched_alg(a, b, transpose_result)
    return cached_mm(a, b, alg, transpose_result) if a.is_cuda else torch_mm(a, b, alg, transpose_result)
