"""The three feed-forward variants, one small class each; `build_ffn` maps the config's
`ffn.kind` onto them. Weight names follow Llama (w1 gate/in, w2 out, w3 up)."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .config import FFNKind
from .sparse24 import Sparse24Recipe, srelu24_ffn
from .stats import N_SUMS, SWIGLU_ZERO_THRESHOLD, dense_activation_sums, sparse24_sums


class FFN(nn.Module):
    """Base: a device buffer of activation-statistics sums (model/stats.py), added to on
    forward passes while `collect_stats` is on."""

    def __init__(self):
        super().__init__()
        self.register_buffer("stats", torch.zeros(N_SUMS, dtype=torch.float64), persistent=False)
        self.collect_stats = False


class SwiGLU(FFN):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.w1(x)) * self.w3(x)
        if self.collect_stats:
            self.stats += dense_activation_sums(h.detach(), SWIGLU_ZERO_THRESHOLD)
        return self.w2(h)


class SReLU(FFN):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def activation(self, x: Tensor) -> Tensor:
        return F.relu(self.w1(x)).square()

    def forward(self, x: Tensor) -> Tensor:
        a = self.activation(x)
        if self.collect_stats:
            self.stats += dense_activation_sums(a.detach())
        return self.w2(a)


class SReLU24(SReLU):
    """Squared-ReLU whose activations are 2:4 sparse once `sparse` is switched on (the
    trainer does so after the dense warmup). Before that it is exactly SReLU."""

    def __init__(self, dim: int, hidden: int, recipe: Sparse24Recipe, kernels: bool = True):
        super().__init__(dim, hidden)
        if hidden % 4:
            raise ValueError(f"srelu24 needs a hidden size divisible by 4, got {hidden}")
        self.recipe = recipe
        self.sparse = False
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        if self.sparse:
            stats = self.stats if self.collect_stats else None
            if self.kernels and kernels_available(x):
                return srelu24_ffn_kernels(x, self.w1.weight, self.w2.weight, self.recipe, stats)
            warn_reference_path_once()
            return srelu24_ffn(x, self.w1.weight, self.w2.weight, self.recipe, stats)
        a = self.activation(x)
        if self.collect_stats:  # dense warmup: what 2:4 would drop
            d = a.detach()
            self.stats += sparse24_sums(d, None, self.recipe.dense_feature_fraction, sparse=False)
        return self.w2(a)


def build_ffn(kind: FFNKind, dim: int, hidden: int, recipe: Sparse24Recipe, kernels: bool = True) -> nn.Module:
    if kind == FFNKind.swiglu:
        return SwiGLU(dim, hidden)
    if kind == FFNKind.srelu:
        return SReLU(dim, hidden)
    if kind == FFNKind.srelu24:
        return SReLU24(dim, hidden, recipe, kernels)
    raise ValueError(f"unknown ffn kind {kind!r}; valid: {[k.value for k in FFNKind]}")


_warned = False


def kernels_available(x: Tensor) -> bool:
    if not x.is_cuda:
        return False  # keeps triton out of CPU-only runs
    from kernels.srelu24_ffn import available

    return available(x)


def srelu24_ffn_kernels(*args):
    from kernels.srelu24_ffn import srelu24_ffn_kernels as fn

    return fn(*args)


def warn_reference_path_once() -> None:
    """Where the kernels cannot run, srelu24 runs its PyTorch reference. Say so once per process."""
    global _warned
    if not _warned:
        warnings.warn("srelu24: using the pure-PyTorch 2:4 reference (the fused kernels need CUDA sm80/sm90 "
                      "and ffn.kernels=true); it computes the same function but is slower than dense srelu",
                      stacklevel=2)
        _warned = True
