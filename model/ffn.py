"""The three feed-forward variants, one small class each; `build_ffn` maps the config's
`ffn.kind` onto them. Weight names follow Llama (w1 gate/in, w2 out, w3 up)."""
import warnings

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .config import FFNKind
from .sparse24 import Sparse24Recipe, srelu24_ffn


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SReLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.relu(self.w1(x)).square())


class SReLU24(SReLU):
    """Squared-ReLU whose activations are 2:4 sparse once `sparse` is switched on (the
    trainer does so after the dense warmup). Before that it is exactly SReLU."""

    def __init__(self, dim: int, hidden: int, recipe: Sparse24Recipe):
        super().__init__(dim, hidden)
        if hidden % 4:
            raise ValueError(f"srelu24 needs a hidden size divisible by 4, got {hidden}")
        self.recipe = recipe
        self.sparse = False

    def forward(self, x: Tensor) -> Tensor:
        if not self.sparse:
            return super().forward(x)
        warn_reference_path_once()
        return srelu24_ffn(x, self.w1.weight, self.w2.weight, self.recipe)


def build_ffn(kind: FFNKind, dim: int, hidden: int, recipe: Sparse24Recipe) -> nn.Module:
    if kind == FFNKind.swiglu:
        return SwiGLU(dim, hidden)
    if kind == FFNKind.srelu:
        return SReLU(dim, hidden)
    if kind == FFNKind.srelu24:
        return SReLU24(dim, hidden, recipe)
    raise ValueError(f"unknown ffn kind {kind!r}; valid: {[k.value for k in FFNKind]}")


_warned = False


def warn_reference_path_once() -> None:
    """The GPU kernels arrive later: until then, and wherever they cannot run, srelu24 runs
    its PyTorch reference. Say so once per process."""
    global _warned
    if not _warned:
        warnings.warn("srelu24: using the pure-PyTorch 2:4 reference (no fused kernels on this device); "
                      "it computes the right function but is slower than dense srelu", stacklevel=2)
        _warned = True
