"""The shared library built from srelu24_kernels/srelu24/csrc by make, loaded once through ctypes.

KERNELS, build/srelu24_kernels.so (`make kernels`, srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu; optional, for
GPU machines with nvcc, the README says how to build it): CUDA C++ versions of the forward's and
the backward's sparsify kernels, preferred to the Triton ones. Without it they fall back to Triton.
The environment variable SRELU24_KERNELS_LIB names another path for it.
"""
import ctypes
import os
import warnings
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NativeLibrary:
    def __init__(self, filename: str, env_var: str, abi_symbol: str, abi_version: int, what: str, make_target: str):
        self.filename, self.env_var, self.abi_symbol, self.abi_version = filename, env_var, abi_symbol, abi_version
        self.what, self.make_target = what, make_target
        self.loaded: list = []  # [ctypes library or None], looked for once
        self.functions: dict = {}

    def path(self) -> str:
        """build/<filename>, or the path in the environment variable env_var."""
        return os.environ.get(self.env_var, os.path.join(ROOT, "build", self.filename))

    def get(self) -> Optional[ctypes.CDLL]:
        if not self.loaded:
            lib = None
            path = self.path()
            if os.path.exists(path):
                lib = ctypes.CDLL(path)
                if getattr(lib, self.abi_symbol)() != self.abi_version:
                    raise RuntimeError(f"{path} was built from another version of its source: run {self.make_target}")
            self.loaded.append(lib)
        return self.loaded[0]

    def function(self, name: str, argtypes: list, restype):
        """The exported function `name`, with its ctypes signature (set once)."""
        if name not in self.functions:
            fn = getattr(self.get(), name)
            fn.argtypes, fn.restype = argtypes, restype
            self.functions[name] = fn
        return self.functions[name]

    def available(self, device=None, majors: tuple = (9,)) -> bool:
        """The library is built and loads, and the GPU's compute capability major is in `majors`."""
        if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] not in majors:
            return False
        try:
            return self.get() is not None
        except (OSError, RuntimeError, AttributeError) as e:  # unloadable, or built from another source version
            warnings.warn(f"{self.what} library unusable: {e}", RuntimeWarning, stacklevel=3)
            self.loaded[:] = [None]
            return False


KERNELS = NativeLibrary("srelu24_kernels.so", "SRELU24_KERNELS_LIB", "srelu24_kernels_abi_version", 4,
                        "CUDA sparsify kernels", "make kernels")


def kernels_usable(*tensors: torch.Tensor) -> bool:
    """KERNELS is built and loads, and the 2-D tensors are all on one sm80/sm90 GPU with 16-byte
    aligned rows."""
    dev = tensors[0].device
    return (tensors[0].is_cuda and all(t.device == dev for t in tensors) and KERNELS.available(dev, (8, 9))
            and all(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(1) == 1 for t in tensors))


BACKENDS = ("auto", "triton", "cuda")


def use_cuda(backend: str, usable, op: str, needs: str) -> bool:
    """Whether `op` runs its CUDA kernel: backend "cuda" (which must be usable: else a ValueError
    naming what it needs), "triton", or "auto" (cuda where usable). usable: a no-argument callable."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton":
        return False
    ok = usable()
    if backend == "cuda" and not ok:
        raise ValueError(f"{op}: backend 'cuda' needs {KERNELS.path()} ({KERNELS.make_target}), an sm80/sm90 GPU, "
                         f"{needs}; backend 'triton' runs anywhere")
    return ok


def launch(name: str, argtypes: list, *args, device) -> None:
    """Call KERNELS' launcher `name` (returning a cudaError_t) on the current stream of `device`;
    a non-zero status (a CUDA error at launch) raises."""
    with torch.cuda.device(device):
        status = KERNELS.function(name, argtypes + [ctypes.c_void_p], ctypes.c_int)(
            *args, torch.cuda.current_stream().cuda_stream)
    if status:
        raise RuntimeError(f"{name}: CUDA error {status} at launch")
