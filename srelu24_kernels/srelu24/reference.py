"""2:4 activation sparsity for the Squared-ReLU FFN: the pure-PyTorch reference.

This is the definition the GPU kernels are tested against, and the path that runs on
CPU and on GPUs without the kernels. Notation (docs/METHOD.md, 2:4 activation sparsity), T tokens, F features:

    Z = X W1^T            dense
    A = relu(Z)^2
    A24 = A * mask        mask: 2 largest of every 4 along F, per token
    Y = A24 W2^T          sparse GEMM in the kernels

    dA  = dY W2           dense
    dZ  = dA * 2 relu(Z) * mask     (mask only if reuse_forward_mask)
    dX  = dZ W1
    dW2 = dY^T S(A24),  dW1 = S(dZ)^T X

S() re-sparsifies 2:4 along TOKENS, per feature, after a random token permutation,
except for the densest `dense_feature_fraction` of features, which stay dense.

`mask_2to4` is the 2:4 selection: the one definition every path (this reference, the
statistics in srelu24_kernels/ffn_stats.py, the kernels' tests) uses.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def mask_2to4(x: Tensor, dim: int = -1) -> Tensor:
    """Boolean mask keeping the 2 largest-magnitude values of every 4 consecutive ones
    along `dim`. Ties go to the lower index, so the mask is deterministic."""
    x = x.movedim(dim, -1)
    if x.shape[-1] % 4:
        raise ValueError(f"2:4 sparsity needs the size along dim {dim} to be a multiple of 4, got {x.shape[-1]}")
    a0, a1, a2, a3 = x.abs().reshape(*x.shape[:-1], -1, 4).unbind(-1)
    # b_ij (i < j): j beats i, i.e. is strictly larger; on a tie the lower index i wins
    b01, b02, b03, b12, b13, b23 = a1 > a0, a2 > a0, a3 > a0, a2 > a1, a3 > a1, a3 > a2
    # a value is kept when fewer than 2 of the other three beat it
    r0 = b01.int() + b02 + b03
    r1 = (~b01).int() + b12 + b13
    r2 = (~b02).int() + ~b12 + b23
    r3 = (~b03).int() + ~b13 + ~b23
    keep = torch.stack([r0 < 2, r1 < 2, r2 < 2, r3 < 2], dim=-1)
    return keep.reshape(x.shape).movedim(-1, dim)


def sparsify_tokens_2to4(t: Tensor, dense_features: Optional[Tensor]) -> Tensor:
    """2:4 along dim 0 (tokens) for every feature column, except the columns in
    `dense_features`, which are kept as they are. Token counts that are not a multiple of
    4 are zero-padded for the grouping."""
    T = t.shape[0]
    pad = (-T) % 4
    tp = F.pad(t, (0, 0, 0, pad)) if pad else t
    out = tp * mask_2to4(tp, dim=0)
    if pad:
        out = out[:T]
    if dense_features is not None and dense_features.numel():
        out[:, dense_features] = t[:, dense_features]
    return out


def densest_features(a: Tensor, fraction: float) -> Optional[Tensor]:
    """Indices of the `fraction` of features with the most non-zeros along tokens."""
    return densest_from_counts((a != 0).sum(0), fraction)


def densest_from_counts(counts: Tensor, fraction: float) -> Optional[Tensor]:
    """The `fraction` of features with the highest `counts` (non-zeros per feature), None if none."""
    k = int(round(fraction * counts.shape[0]))
    if k <= 0:
        return None
    # stable sort on -counts: ties go to the lower feature index
    return torch.sort(-counts, stable=True).indices[:k]


def random_token_order(T: int, device) -> Tensor:
    """The random token order of the weight gradients' 2:4 along tokens (one per backward), int32.
    Drawn on the host (CPU generator) and copied: on the GPU, randperm is a 64-bit-key radix sort
    of about a dozen launches per layer, while the host, running ahead of the GPU, prepares the
    one small copy from pinned memory off the critical path (the measured cost of each is in
    benchmarks/RESULTS.md)."""
    dev = torch.device(device)
    perm = torch.randperm(T, dtype=torch.int32, pin_memory=dev.type == "cuda")
    return perm.to(dev, non_blocking=True)


def random_token_orders(T: int, n: int, device, generator: Optional[torch.Generator] = None) -> Tensor:
    """n random token orders and their inverses, [n, 2, T] int32 ([i, 0] the order, [i, 1] its
    inverse): one per layer of a training step, for the model to permute the FFN's tokens where
    they are produced and consumed (permute_rows). All drawn and inverted on the host (CPU
    generator: torch's default, or `generator`) and moved in one copy from pinned memory."""
    dev = torch.device(device)
    out = torch.empty(n, 2, T, dtype=torch.int32, pin_memory=dev.type == "cuda")
    ar = torch.arange(T, dtype=torch.int32)
    for i in range(n):
        out[i, 0] = torch.randperm(T, dtype=torch.int32, generator=generator)
        out[i, 1, out[i, 0].long()] = ar
    return out.to(dev, non_blocking=True)


class _PermuteRows(torch.autograd.Function):
    """x[order] whose gradient is g[inverse]: a gather both ways. Plain indexing would
    back-propagate through an accumulating scatter; inside a compiled block both gathers fuse
    into their neighbours (the norm before the FFN, the residual add after it)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, g: Tensor):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


def permute_rows(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """Rows of x [T, ...] in `order` (inverse: the order's inverse permutation)."""
    return _PermuteRows.apply(x, order, inverse)


@dataclass(frozen=True)
class SReLU24Recipe:
    # True: the weight gradients' 2:4 along tokens sees the tokens in a random order. The FFN
    # draws it in its backward, unless the model hands it tokens already permuted (the FFN then
    # runs with this False: see model/transformer.py, Block)
    token_permutation: bool = True
    dense_feature_fraction: float = 0.05
    reuse_forward_mask: bool = True


class _SReLU24(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, recipe: SReLU24Recipe, stats: Optional[Tensor]):
        z = x @ w1.t()
        a = F.relu(z).square()
        mask = mask_2to4(a)
        if stats is not None:
            from ..ffn_stats import srelu24_sums  # here: ffn_stats imports mask_2to4 from this module

            stats += srelu24_sums(a, mask, recipe.dense_feature_fraction, sparse=True)
        y = (a * mask) @ w2.t()
        ctx.save_for_backward(x, w1, w2, z, mask)
        ctx.recipe = recipe
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w1, w2, z, mask = ctx.saved_tensors
        r: SReLU24Recipe = ctx.recipe
        dy = dy.to(z.dtype)
        relu_z = F.relu(z)
        a24 = relu_z.square() * mask
        dz = (dy @ w2.to(z.dtype)) * (2 * relu_z)
        if r.reuse_forward_mask:
            dz = dz * mask
        dx = dz @ w1.to(z.dtype)

        # Weight gradients reduce over tokens: 2:4 along tokens, after a permutation.
        T = x.shape[0]
        perm = random_token_order(T, x.device) if r.token_permutation else None
        pick = (lambda t: t[perm]) if perm is not None else (lambda t: t)
        dense = densest_features(a24, r.dense_feature_fraction)
        dw2 = pick(dy).t() @ sparsify_tokens_2to4(pick(a24), dense)
        dw1 = sparsify_tokens_2to4(pick(dz), dense).t() @ pick(x).to(z.dtype)
        return dx, dw1, dw2, None, None


# The reference runs eagerly inside a compiled model: inductor cannot compile it (its pattern
# matcher failed on it, torch 2.11), and the fused kernels replace it where speed matters.
@torch.compiler.disable
def srelu24_ffn(x: Tensor, w1: Tensor, w2: Tensor, recipe: SReLU24Recipe,
                stats: Optional[Tensor] = None) -> Tensor:
    """Y = (mask_2to4 * relu(X W1^T)^2) W2^T with the 2:4 backward of the recipe.
    x: [..., d], w1: [F, d], w2: [d, F]. `stats`, if given, is a sums buffer (srelu24_kernels/ffn_stats.py)
    that the forward adds to."""
    shape = x.shape
    y = _SReLU24.apply(x.reshape(-1, shape[-1]), w1, w2, recipe, stats)
    return y.reshape(*shape[:-1], y.shape[-1])
