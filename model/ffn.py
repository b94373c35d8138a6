"""The feed-forward variants, one small class each, registered under the name `ffn.kind` uses.

Adding a variant is its class here, decorated with `@register_ffn("name")`, and its YAML in
configs/ffn/ (`kind: name`). A class declares what the rest of the model needs of it:
- `from_config(dim, hidden, cfg, float8)`: the module for an FFNConfig (a variant reads the fields it
  uses) and the trainer's float8 recipe;
- `default_hidden(swiglu_hidden)`: its hidden size when ffn.hidden_dim is not set;
- `hidden_multiple`: what its hidden size must be a multiple of (checked at start-up);
- `residual_projections()`: the weights that write into the residual stream, which
  Transformer.reset_parameters initialises with the smaller residual std;
- `set_2to4(active)`: switch 2:4 on or off (a no-op but for the 2:4 variants).
Weight names follow Llama (w1 gate/in, w2 out, w3 up)."""
import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from srelu24_kernels.cusparselt.binding import set_algorithm
from srelu24_kernels.ffn_stats import N_SUMS, SWIGLU_ZERO_THRESHOLD, dense_activation_sums, srelu24_sums
from srelu24_kernels.float8 import scaled_mm_shapes
from srelu24_kernels.srelu24.options import GradPairs, MicroBatches, OpOptions, StepState
from srelu24_kernels.srelu24.reference import SReLU24Recipe, srelu24_ffn

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
    """Base: a device buffer of activation-statistics sums (srelu24_kernels/ffn_stats.py), added to on
    forward passes while `collect_stats` is on."""
    kind: str = ""
    hidden_multiple: int = 1

    def __init__(self):
        super().__init__()
        self.register_buffer("stats", torch.zeros(N_SUMS, dtype=torch.float64), persistent=False)
        self.collect_stats = False

    @classmethod
    def from_config(cls, dim: int, hidden: int, cfg, float8: str = "none") -> "FFN":
        """float8: the trainer's recipe, for a variant whose own GEMMs take it (srelu24's op); the
        others' linears are converted by training/float8.py."""
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
    trainer does so after the dense warmup, through set_2to4). Before that it is exactly SReLU.
    On CUDA sm80/sm90 (and ffn.kernels) its 2:4 phase runs the op of srelu24_kernels/srelu24/op.py with
    `options`; elsewhere the PyTorch reference."""
    # The sm90 sparse GEMM layout wants the 2:4 (reduction) dimension a multiple of 32 and
    # the rows of the transposed operand (features) a multiple of 64.
    hidden_multiple = 64

    def __init__(self, dim: int, hidden: int, options: OpOptions = OpOptions(), kernels: bool = True,
                 paired_grad_unscaling: bool = True):
        super().__init__(dim, hidden)
        if hidden % 4:
            raise ValueError(f"srelu24 needs a hidden size divisible by 4, got {hidden}")
        self.options = options
        self.sparse = False
        self.kernels = kernels
        self.paired_grad_unscaling = paired_grad_unscaling  # ffn.paired_grad_unscaling: begin_step
        self.step_state: Optional[StepState] = None  # an optimizer step's, while it runs (srelu24_step)
        self._grad_hooks: list = []  # the step's hooks that take the weights' .grad once autograd made them

    @classmethod
    def from_config(cls, dim: int, hidden: int, cfg, float8: str = "none") -> "SReLU24":
        """The op's GEMMs take the float8 recipe where torch._scaled_mm takes the shapes, as
        training/float8.py converts the linears."""
        recipe = SReLU24Recipe(cfg.token_permutation, cfg.dense_feature_fraction, cfg.reuse_forward_mask)
        float8 = float8 if scaled_mm_shapes(dim, hidden) else "none"
        set_algorithm(cfg.sparse_gemm_alg)  # process-wide, as cuSPARSELt's plans are
        return cls(dim, hidden, OpOptions(recipe, float8, cfg.sparse_float8), cfg.kernels,
                   cfg.paired_grad_unscaling)

    @property
    def recipe(self) -> SReLU24Recipe:
        return self.options.recipe

    @property
    def float8(self) -> str:
        """The float8 recipe of the op's GEMMs ("none": bf16)."""
        return self.options.float8

    def set_2to4(self, active: bool) -> None:
        self.sparse = active

    def wants_token_order(self) -> bool:
        # the recipe's token permutation, done by the block: the backward then needs no gathers
        # of X and dY, nor of dX back to token order
        return self.sparse and self.recipe.token_permutation

    def forward(self, x: Tensor, tokens_permuted: bool = False) -> Tensor:
        if self.sparse:
            stats = self.stats if self.collect_stats else None
            if self.kernels and kernels_available(x):
                return srelu24_op(x, self.w1.weight, self.w2.weight, self.options, stats, self.step_state,
                                  tokens_permuted)
            warn_reference_path_once()
            recipe = replace(self.recipe, token_permutation=False) if tokens_permuted else self.recipe
            return srelu24_ffn(x, self.w1.weight, self.w2.weight, recipe, stats)
        a = self.activation(x)
        if self.collect_stats:  # dense warmup: what 2:4 would drop
            d = a.detach()
            self.stats += srelu24_sums(d, None, self.recipe.dense_feature_fraction, sparse=False)
        return self.w2(a)

    def begin_step(self, keep_conversions: bool, grads_in_place: bool,
                   micro_batches: Optional[MicroBatches] = None) -> None:
        """Open this FFN's StepState for an optimizer step's micro-batches: in its 2:4 phase, in e4m3
        mode on fp32 weights (one process or DDP; under FSDP2 the weights are bf16 and gathered per
        use), its weights' conversions made now where the e4m3 2:4 GEMMs run (keep_conversions), and
        the weights' .grad as the buffers its backward adds into (grads_in_place). Where the weights
        have no .grad yet (set to None after the last step), the first micro-batch's gradients become
        it as autograd assigns them, and the op adds into it from the next micro-batch on: no zero
        fill, no read of zeros (a post-accumulate-grad hook takes them when both are there).
        With ffn.paired_grad_unscaling, gradients in place and the tensorwise recipe's e4m3 2:4 GEMMs
        on an sm90 GPU, the op also pairs the micro-batches' weight gradients (`micro_batches`, the
        step's counter: srelu24_step), in buffers made here (GradPairs: 2 bytes an element of W1 and W2)."""
        w1, w2 = self.w1.weight, self.w2.weight
        if not (self.sparse and self.options.e4m3 and w1.dtype == w2.dtype == torch.float32
                and self.kernels and kernels_available(w1)):
            return
        from srelu24_kernels.float8 import sparse as fp8_sparse
        from srelu24_kernels.srelu24.op import convert_weights

        state = StepState()
        if keep_conversions and fp8_sparse.available(w1.device):
            state.weights = convert_weights(w1, w2, self.options)
        if grads_in_place and w1.requires_grad and w2.requires_grad and not self._take_grads(state):
            def take(_):  # a post-accumulate-grad hook returns None
                self._take_grads(state)
            self._grad_hooks = [w.register_post_accumulate_grad_hook(take) for w in (w1, w2)]
        # a .grad there but not taken (one weight's only, or laid out otherwise) would get the first
        # pair's sum added by autograd, in another order: no pairs then
        grads_known = state.grads is not None or (w1.grad is None and w2.grad is None)
        if (self.paired_grad_unscaling and grads_in_place and grads_known and micro_batches is not None
                and self.options.float8 == "tensorwise" and fp8_sparse.available(w1.device)):
            k = int(round(self.recipe.dense_feature_fraction * w1.shape[0]))  # densest_from_counts' k
            state.pairs, state.micro_batches = GradPairs.empty(w1.shape[0], w1.shape[1], k, w1.device), micro_batches
        if state.weights is not None or state.grads is not None or self._grad_hooks or state.pairs is not None:
            self.step_state = state
            self._written = _versions(w1, w2)

    def _take_grads(self, state: StepState) -> bool:
        """state.grads = the weights' .grad, where both are there and laid out as the op adds into
        them (else they stay autograd's to accumulate); whether state.grads is set."""
        if state.grads is None:
            grads = _grad_buffer(self.w1.weight), _grad_buffer(self.w2.weight)
            state.grads = grads if None not in grads else None
        return state.grads is not None

    def end_step(self) -> None:
        """Close the StepState. The weights must not have been written while it was open: its
        conversions would have been stale."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        if self.step_state is None:
            return
        state, self.step_state = self.step_state, None
        add_trailing_kept(state)
        if _versions(self.w1.weight, self.w2.weight) != self._written:
            raise RuntimeError("srelu24: W1 or W2 was written during an optimizer step's micro-batches, while "
                               "their e4m3 conversions were kept; write the weights between steps")


def add_trailing_kept(state: Optional[StepState]) -> None:
    """A step that ended on a pair's first micro-batch (ffn.paired_grad_unscaling, an odd number of
    them): its kept weight-gradient products added into .grad, at the step's end (SReLU24.end_step;
    under trainer.cuda_graph, training/cuda_graph.py)."""
    if state is None or state.pairs is None or not state.micro_batches.done % 2:
        return
    from srelu24_kernels.srelu24.op import add_kept

    if state.grads is not None:  # None only where the step failed before its second micro-batch
        add_kept(state.pairs, state.grads, state.pairs.g2.shape[0] > 0)


def _versions(*ws: Tensor) -> tuple:
    return tuple((w._version, w.data_ptr()) for w in ws)


def _grad_buffer(p: nn.Parameter) -> Optional[Tensor]:
    """p.grad as a buffer the op may add into (contiguous, p's dtype and shape), or None where there
    is none or it is laid out otherwise."""
    g = p.grad
    return g if g is not None and g.dtype == p.dtype and g.shape == p.shape and g.is_contiguous() else None


def keeps_conversions(several: bool, float8: str) -> bool:
    """Whether srelu24's step state keeps the weights' e4m3 conversions for a step of `several`
    micro-batches or one: kept across several always; for one under the tensorwise recipe too, where
    two passes over each weight make all four (srelu24_kernels/float8/paired.py) and the op, making
    them at each use, would read each weight more often. training/memory.py counts them by it."""
    return several or float8 == "tensorwise"


def conversions_kept(model: nn.Module, several: bool) -> bool:
    """keeps_conversions for `model`'s srelu24 FFNs (their float8 recipe)."""
    return any(keeps_conversions(several, m.options.float8) for m in model.modules() if isinstance(m, SReLU24))


@contextmanager
def srelu24_step(model: nn.Module, keep_conversions: bool, grads_in_place: bool):
    """The state that every srelu24 FFN of `model` shares across one optimizer step's micro-batches
    (srelu24_kernels/srelu24/options.py, StepState), opened on entry and dropped on exit, also on errors.
    training/step.py opens it around the micro-batches, with keep_conversions where
    `conversions_kept` says and the weights stay put between them (not FSDP2), and grads_in_place where
    also autograd's accumulation is nobody else's business (not DDP's reducer, not FSDP2). It yields
    the step's MicroBatches, which the caller advances after each micro-batch's backward."""
    ffns = [m for m in model.modules() if isinstance(m, SReLU24)]
    micro_batches = MicroBatches()
    try:
        for m in ffns:
            m.begin_step(keep_conversions, grads_in_place, micro_batches)
        yield micro_batches
    finally:
        errors = []
        for m in ffns:
            try:
                m.end_step()
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]


def build_ffn(cfg, dim: int, hidden: int, float8: str = "none") -> FFN:
    """The registered FFN of the FFNConfig `cfg` (its `kind`), configured from it; float8: the
    trainer's recipe, for variants whose own GEMMs take it (srelu24's op)."""
    return ffn_class(cfg.kind).from_config(dim, hidden, cfg, float8)


_warned = False


def kernels_available(x: Tensor) -> bool:
    if not x.is_cuda:
        return False  # keeps triton out of CPU-only runs
    from srelu24_kernels.srelu24.op import available

    return available(x)


def srelu24_op(*args):
    from srelu24_kernels.srelu24.op import ffn

    return ffn(*args)


def warn_reference_path_once() -> None:
    """Where the kernels cannot run, srelu24 runs its PyTorch reference. Say so once per process."""
    global _warned
    if not _warned:
        # through logging: one clean line (train.log too), not a warning with a source line mid-progress-bar
        logging.getLogger(__name__).warning(
            "srelu24: using the pure-PyTorch 2:4 reference (the fused kernels need CUDA sm80/sm90 and "
            "ffn.kernels=true); it computes the same function but is slower than dense srelu")
        _warned = True
