"""CUTLASS 3.x 2:4 GEMMs for Hopper (kernels/csrc/sp24_gemm_sm90.cu), called through ctypes.

`make cutlass` builds build/sp24_cutlass.so on a machine with nvcc (see the README); the path
can be overridden with SP24_CUTLASS_LIB. Without it, `available()` is False. The FFN does not use
these GEMMs: on the H200 cuSPARSELt was faster (scripts/bench_sp24_gemm.py, benchmarks/RESULTS.md).

The compressed operand is laid out like the sparsify kernels' buffer (values [M, K/2] row-major,
then the metadata), but with the metadata in a CUTLASS layout ("cutlass_k64" / "cutlass_k128" in
kernels/cslt_layout.py, matching the tile K of the configuration that reads it), as
kernels.cslt_layout.compress or `compress` below write it.
"""
import ctypes

import torch
from torch import Tensor

from .native import NativeLibrary

_STATUS = {1: "cannot implement (shape or alignment)", 2: "workspace too small", 3: "initialize failed",
           4: "launch failed", 5: "not built for this GPU"}
ABI_VERSION = 1
# configuration id -> (tile M, N, K, cluster, schedule), as in sp24_gemm_sm90.cu
CONFIGS = {0: "128x128x128 c1x2 coop", 1: "128x256x64 c1x2 coop", 2: "256x128x64 c2x1 coop",
           3: "128x128x128 c2x1 pingpong", 4: "128x128x64 c1x2 coop", 5: "128x256x64 c2x2 coop",
           6: "256x128x64 c2x2 coop"}
TILE_K = {0: 128, 1: 64, 2: 64, 3: 128, 4: 64, 5: 64, 6: 64}


_LIB = NativeLibrary("sp24_cutlass.so", "SP24_CUTLASS_LIB", "sp24_abi_version", ABI_VERSION, "CUTLASS 2:4",
                     "make cutlass")
library_path = _LIB.path
_lib = _LIB.get


def available(device=None) -> bool:
    """The library is built and loads, and the GPU is a Hopper (sm90)."""
    return _LIB.available(device, (9,))


def _fn(name: str):
    """The exported function `name`, with its ctypes signature."""
    p, i = ctypes.c_void_p, ctypes.c_int
    if name.endswith("_workspace"):
        return _LIB.function(name, [i, i, i], ctypes.c_size_t)
    if name.startswith("sp24_compress"):
        return _LIB.function(name, [p, p, p, i, i, p, ctypes.c_size_t, p], i)
    return _LIB.function(name, [p, p, p, p, i, i, i, p, ctypes.c_size_t, p], i)


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"CUTLASS 2:4 {what}: {_STATUS.get(status, status)}")


_WS: dict = {}


def mm(buf: Tensor, b: Tensor, cfg: int = 0, out_transposed: bool = False) -> Tensor:
    """A @ B for A [M, K] compressed in `buf` (bf16 [M, 9K/16], metadata in cfg's layout) and a bf16
    B [K, N] (row-major, or the transpose of a row-major [N, K]). Always returns the [M, N]
    product; out_transposed: stored column-major, i.e. the [M, N] view of a row-major [N, M]
    (what the weight gradient dW2 wants). Note the difference from cuSPARSELt's
    `transpose_result`, which returns the [N, M] tensor itself."""
    k, n = b.shape
    m = buf.shape[0]
    if buf.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or buf.numel() * 16 != m * k * 9:
        raise ValueError(f"cutlass_sp24.mm: needs bf16 A [M, 9K/16] and B [K, N], got {tuple(buf.shape)} "
                         f"{buf.dtype} and {tuple(b.shape)} {b.dtype}")
    if b.device != buf.device:
        raise ValueError(f"cutlass_sp24.mm: A on {buf.device}, B on {b.device}")
    buf = buf.contiguous()  # the metadata pointer is values + M*K bytes
    if b.data_ptr() % 16:  # TMA needs 16-byte aligned bases
        b = b.clone(memory_format=torch.contiguous_format)
    if b.is_contiguous():
        major = "n"
    elif b.t().is_contiguous():
        major = "k"
    else:
        b, major = b.contiguous(), "n"
    if out_transposed and major != "n":
        b, major = b.contiguous(), "n"
    name = f"sp24_gemm_c{cfg}_{major}{'c' if out_transposed else 'r'}"
    key = (name, m, n, k)
    if key not in _WS:
        _WS[key] = _fn(name + "_workspace")(m, n, k)
    with torch.cuda.device(buf.device):
        d = torch.empty((n, m) if out_transposed else (m, n), dtype=torch.bfloat16, device=buf.device)
        ws = torch.empty(max(_WS[key], 1), dtype=torch.uint8, device=buf.device)
        stream = torch.cuda.current_stream(buf.device).cuda_stream
        _check(_fn(name)(buf.data_ptr(), buf.data_ptr() + m * k, b.data_ptr(), d.data_ptr(), m, n, k,
                         ws.data_ptr(), _WS[key], stream), f"{name} [{m}, {k}] x [{k}, {n}]")
    return d.t() if out_transposed else d


def compress(a: Tensor, tile_k: int) -> Tensor:
    """CUTLASS's own compressor (for the tests): a [M, K] bf16 2:4 matrix -> the buffer
    [M, 9K/16] with the metadata in layout cutlass_k{tile_k}."""
    m, k = a.shape
    buf = torch.zeros(m, k * 9 // 16, dtype=torch.bfloat16, device=a.device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    _check(_fn(f"sp24_compress_k{tile_k}")(a.contiguous().data_ptr(), buf.data_ptr(), buf.data_ptr() + m * k,
                                            m, k, ws.data_ptr(), ws.numel(), stream), "compress")
    return buf
