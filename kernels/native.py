"""The shared libraries built from kernels/csrc by make, loaded once through ctypes.

Two of them, both optional (GPU machines with nvcc; the README says how to build them):
- KERNELS, build/sp24_kernels.so (`make kernels`, kernels/csrc/sp24_backward.cu): the CUDA C++
  version of the backward's one-pass sparsify kernel, which the FFN prefers to the Triton one;
- build/sp24_cutlass.so (`make cutlass`): the CUTLASS 2:4 GEMMs of kernels/cutlass_sp24.py.
Without a library its users fall back (Triton kernel) or report it unavailable.
"""
import ctypes
import os
import warnings
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NativeLibrary:
    def __init__(self, filename: str, env_var: str, abi_symbol: str, abi_version: int, what: str, make_target: str):
        self.filename, self.env_var, self.abi_symbol, self.abi_version = filename, env_var, abi_symbol, abi_version
        self.what, self.make_target = what, make_target
        self.loaded: list = []  # [ctypes library or None], looked for once

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


KERNELS = NativeLibrary("sp24_kernels.so", "SP24_KERNELS_LIB", "sp24_kernels_abi_version", 1,
                        "CUDA sparsify kernels", "make kernels")
