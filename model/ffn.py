"""The feed-forward variants, one small class each, registered under the name `ffn.kind` uses.

Adding a variant is its class here, decorated with `@register_ffn("name")`, and its YAML in
configs/ffn/ (`kind: name`). A class declares what the rest of the model needs of it:
- `from_config(dim, hidden, cfg)`: the module for an FFNConfig (a variant reads the fields it uses);
- `default_hidden(swiglu_hidden)`: its hidden size when ffn.hidden_dim is not set;
- `hidden_multiple`: what its hidden size must be a multiple of (checked at start-up);
- `residual_projections()`: the weights that write into the residual stream, which
  Transformer.reset_parameters initialises with the smaller residual std;
- `set_2to4(active)`: switch 2:4 on or off (a no-op but for the 2:4 variants).
Weight names follow Llama (w1 gate/in, w2 out, w3 up)."""
import logging
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kernels.ffn_stats import N_SUMS, SWIGLU_ZERO_THRESHOLD, dense_activation_sums, srelu24_sums
from kernels.srelu24_reference import SReLU24Recipe, srelu24_ffn

FFN_REGISTRY: dict[str, type["FFN"]] = {}


def register_ffn(name: str):
    """Class decorator: make the FFN class available as `ffn.kind=name`."""
    def register(cls: type["FFN"]) -> type["FFN"]:
        if name in FFN_REGISTRY:
            raise ValueError(f"FFN kind {name!r} is registered twice ({FFN_REGISTRY[name].__name__}, {cls.__name__})")
        FFN_REGISTRY[name] = cls
        cls.kind = name
        return cls
    return register


def check_ffn_kind(kind) -> None:
    """A ValueError of one line, listing the registered kinds, if `kind` is not one of them."""
    if kind not in FFN_REGISTRY:
        raise ValueError(f"ffn.kind={kind} is not a registered FFN; valid kinds: [{', '.join(FFN_REGISTRY)}]")


def ffn_class(kind: str) -> type["FFN"]:
    check_ffn_kind(kind)
    return FFN_REGISTRY[kind]


class FFN(nn.Module):
    """Base: a device buffer of activation-statistics sums (kernels/ffn_stats.py), added to on
    forward passes while `collect_stats` is on."""
    kind: str = ""
    hidden_multiple: int = 1

    def __init__(self):
        super().__init__()
        self.register_buffer("stats", torch.zeros(N_SUMS, dtype=torch.float64), persistent=False)
        self.collect_stats = False

    @classmethod
    def from_config(cls, dim: int, hidden: int, cfg) -> "FFN":
        return cls(dim, hidden)

    @staticmethod
    def default_hidden(swiglu_hidden: int) -> int:
        return swiglu_hidden

    def residual_projections(self) -> list[nn.Parameter]:
        """The weights whose output is added to the residual stream."""
        return [self.w2.weight]

    def set_2to4(self, active: bool) -> None:
        """Dense variants have no 2:4 mode."""

    def wants_token_order(self) -> bool:
        """True: give forward(x, tokens_permuted=True) its tokens in a random order (the block
        permutes them where they are produced and restores them where they are consumed)."""
        return False


SRELU_HIDDEN_MULTIPLE = 128


@register_ffn("swiglu")
class SwiGLU(FFN):
    """W2 (silu(W1 x) * W3 x), Llama's FFN."""

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


@register_ffn("srelu")
class SReLU(FFN):
    """W2 relu(W1 x)^2, Squared-ReLU."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    @staticmethod
    def default_hidden(swiglu_hidden: int) -> int:
        """1.5x SwiGLU's (2 matrices instead of 3: the same parameters and FLOPs), rounded to
        the nearest multiple of 128."""
        m = SRELU_HIDDEN_MULTIPLE
        return max(m, (3 * swiglu_hidden // 2 + m // 2) // m * m)

    def activation(self, x: Tensor) -> Tensor:
        return F.relu(self.w1(x)).square()

    def forward(self, x: Tensor) -> Tensor:
        a = self.activation(x)
        if self.collect_stats:
            self.stats += dense_activation_sums(a.detach())
        return self.w2(a)


@register_ffn("srelu24")
class SReLU24(SReLU):
    """Squared-ReLU whose activations are 2:4 sparse once `sparse` is switched on (the
    trainer does so after the dense warmup, through set_2to4). Before that it is exactly SReLU."""
    # The sm90 sparse GEMM layout wants the 2:4 (reduction) dimension a multiple of 32 and
    # the rows of the transposed operand (features) a multiple of 64.
    hidden_multiple = 64

    def __init__(self, dim: int, hidden: int, recipe: SReLU24Recipe = SReLU24Recipe(), kernels: bool = True,
                 sparse_float8: bool = True):
        super().__init__(dim, hidden)
        if hidden % 4:
            raise ValueError(f"srelu24 needs a hidden size divisible by 4, got {hidden}")
        self.recipe = recipe
        self.sparse = False
        self.kernels = kernels
        self.float8 = "none"  # the kernels' dense GEMMs in float8: trainer.float8, set by training/float8.py
        self.sparse_float8 = sparse_float8  # and, with float8 set, their 2:4 GEMMs in e4m3 (kernels/fp8_sparse.py)
        # there, on fp32 weights, the op adds their gradients into .grad itself (kernels/grads_in_place.py):
        # set by training/distributed.build_model for one process
        self.grads_in_place = False

    @classmethod
    def from_config(cls, dim: int, hidden: int, cfg) -> "SReLU24":
        recipe = SReLU24Recipe(cfg.token_permutation, cfg.dense_feature_fraction, cfg.reuse_forward_mask)
        return cls(dim, hidden, recipe, cfg.kernels, cfg.sparse_float8)

    def set_2to4(self, active: bool) -> None:
        self.sparse = active

    def wants_token_order(self) -> bool:
        # the recipe's token permutation, done by the block: the backward then needs no gathers
        # of X and dY, nor of dX back to token order
        return self.sparse and self.recipe.token_permutation

    def forward(self, x: Tensor, tokens_permuted: bool = False) -> Tensor:
        if self.sparse:
            stats = self.stats if self.collect_stats else None
            recipe = replace(self.recipe, token_permutation=False) if tokens_permuted else self.recipe
            if self.kernels and kernels_available(x):
                return srelu24_ffn_kernels(x, self.w1.weight, self.w2.weight, recipe, stats, self.float8,
                                           self.sparse_float8, self.grads_in_place)
            warn_reference_path_once()
            return srelu24_ffn(x, self.w1.weight, self.w2.weight, recipe, stats)
        a = self.activation(x)
        if self.collect_stats:  # dense warmup: what 2:4 would drop
            d = a.detach()
            self.stats += srelu24_sums(d, None, self.recipe.dense_feature_fraction, sparse=False)
        return self.w2(a)


def build_ffn(cfg, dim: int, hidden: int) -> FFN:
    """The registered FFN of the FFNConfig `cfg` (its `kind`), configured from it."""
    return ffn_class(cfg.kind).from_config(dim, hidden, cfg)


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
        # through logging: one clean line (train.log too), not a warning with a source line mid-progress-bar
        logging.getLogger(__name__).warning(
            "srelu24: using the pure-PyTorch 2:4 reference (the fused kernels need CUDA sm80/sm90 and "
            "ffn.kernels=true); it computes the same function but is slower than dense srelu")
        _warned = True
