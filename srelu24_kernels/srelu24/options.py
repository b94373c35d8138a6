"""The srelu24 op's options and the state one optimizer step lends it: plain data, no kernels
(model/ffn.py builds them without importing Triton)."""
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .reference import SReLU24Recipe

FLOAT8 = ("none", "tensorwise", "rowwise")


@dataclass(frozen=True)
class OpOptions:
    """How the op runs for one FFN module: the recipe's switches and its GEMMs' precision. Built
    once, by model/ffn.py, from the FFN's config and the trainer's float8 recipe."""
    recipe: SReLU24Recipe = SReLU24Recipe()
    float8: str = "none"        # the two dense GEMMs: none (bf16), tensorwise or rowwise (torchao's recipes)
    sparse_float8: bool = True  # with float8 set, the four 2:4 GEMMs in e4m3 as well

    def __post_init__(self):
        if self.float8 not in FLOAT8:
            raise ValueError(f"srelu24 op: float8={self.float8!r}; valid values are {', '.join(FLOAT8)}")

    @property
    def e4m3(self) -> bool:
        return self.float8 != "none" and self.sparse_float8

    def flags(self, tokens_permuted: bool = False) -> tuple:
        """The op's trailing arguments, in its order (a custom op takes no dataclass).
        tokens_permuted: the caller has permuted the tokens (the block does), so the op does not.
        Plain values, not a modified copy of the options: torch 2.11's dynamo cannot build a
        dataclass inside a compiled block, and breaks the graph there."""
        r = self.recipe
        return (r.token_permutation and not tokens_permuted, r.dense_feature_fraction, r.reuse_forward_mask,
                self.float8, self.sparse_float8)

    @classmethod
    def from_flags(cls, token_permutation: bool, dense_feature_fraction: float, reuse_forward_mask: bool,
                   float8: str, sparse_float8: bool) -> "OpOptions":
        return cls(SReLU24Recipe(token_permutation, dense_feature_fraction, reuse_forward_mask), float8, sparse_float8)


class WeightOperands(NamedTuple):
    """W1's and W2's conversions, one per GEMM that reads a weight, each (values, scale) as that
    GEMM takes it: e4m3 mode on fp32 weights. Made once per optimizer step (StepState) under
    gradient accumulation or the tensorwise recipe (model/ffn.py, keeps_conversions), else by the op
    at each use."""
    for_z: tuple[Tensor, Tensor]    # W1^T, the float8 B of Z = X W1^T (fp8_gemm.b_operand)
    for_y: tuple[Tensor, Tensor]    # W2^T, the e4m3 B of Y = A24 W2^T (fp8_sparse.kmajor_e4m3)
    for_da: tuple[Tensor, Tensor]   # W2, the float8 B of dA = dY W2
    for_dx: tuple[Tensor, Tensor]   # W1, the e4m3 B of dX = dZ W1

    def flat(self) -> list[Tensor]:
        return list(chain(*self))

    @classmethod
    def from_flat(cls, tensors: list[Tensor]) -> Optional["WeightOperands"]:
        return cls(*zip(tensors[0::2], tensors[1::2])) if tensors else None


# srelu24's weight gradients two micro-batches at a time (StepState.pairs): the op keeps the first
# one's e4m3 products still scaled, and unscales both with the second's, in one pass
PAIR_OFF, PAIR_KEEP, PAIR_ADD = 0, 1, 2


class GradPairs(NamedTuple):
    """The buffers a kept micro-batch's weight-gradient products wait in (srelu24_kernels/srelu24/op.py,
    `_paired_weight_grads`): each product as cuSPARSELt wrote it (bf16, still scaled) with its row and
    column scales; for dW2 its dense features' columns (slots [F] int32, their rows [k, d]), for dW1
    its dense rows (features [k], rows [k, d]), kept only where no .grad was there to add them into."""
    y1: Tensor       # [F, d] bf16
    r1: Tensor       # [F]
    c1: Tensor       # [d]
    dense1: Tensor   # [k] int64
    rows1: Tensor    # [k, d] bf16
    y2: Tensor       # [d, F] bf16
    r2: Tensor       # [d]
    c2: Tensor       # [F]
    slots2: Tensor   # [F] int32
    g2: Tensor       # [k, d] bf16

    @classmethod
    def empty(cls, F_: int, d: int, k: int, device) -> "GradPairs":
        f32, bf16 = torch.float32, torch.bfloat16
        e = lambda *shape, dtype=f32: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
        return cls(e(F_, d, dtype=bf16), e(F_), e(d), e(k, dtype=torch.int64), e(k, d, dtype=bf16),
                   e(d, F_, dtype=bf16), e(d), e(F_), e(F_, dtype=torch.int32), e(k, d, dtype=bf16))


@dataclass
class MicroBatches:
    """Where an optimizer step is in its micro-batches, for the FFNs that pair their weight gradients:
    `keep` is true on the first of each pair (0, 2, 4, ...), a bool (a compiled block recompiles per
    value it reads: two, not one per index). training/step.py advances it after each backward (under
    trainer.cuda_graph, training/cuda_graph.py after each micro-batch, replayed or eager); a
    recomputed forward (activation checkpointing) reads the same value as its micro-batch's first.
    Whoever opens srelu24_step and runs micro-batches must advance it after each one, and each
    FFN runs once a micro-batch: a pair's first is kept until its second comes."""
    keep: bool = True
    done: int = 0

    def advance(self) -> None:
        self.keep, self.done = not self.keep, self.done + 1

    def reset(self) -> None:
        """At a step's start (or once its trailing kept products are added): no micro-batch done."""
        self.keep, self.done = True, 0


@dataclass
class StepState:
    """What the micro-batches of one optimizer step share, for one FFN: its weights' conversions,
    made when the step begins (the weights stand still until its optimizer update), and the fp32
    buffers the backward adds the weight gradients into (the weights' .grad, as Megatron-LM's
    main_grad; None until they exist: model/ffn.py, begin_step). Opened and closed around the
    micro-batches by training/step.py, through model/ffn.py's `srelu24_step`; nothing of it outlives
    the step, except under trainer.cuda_graph, which keeps it for a 2:4 phase and writes each step's
    conversions into it (training/cuda_graph.py)."""
    weights: Optional[WeightOperands] = None
    grads: Optional[tuple[Tensor, Tensor]] = None
    pairs: Optional[GradPairs] = None           # ffn.paired_grad_unscaling: every micro-batch paired
    micro_batches: Optional[MicroBatches] = None  # shared by the step's FFNs, with pairs


