"""2:4 activation sparsity for the Squared-ReLU FFN: the pure-PyTorch reference.

This is the definition the GPU kernels are tested against, and the path that runs on
CPU and on GPUs without the kernels. Notation (shared/PAPER_NOTES.md), T tokens, F features:

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
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .mask24 import mask_2to4
from .stats import sparse24_sums


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
    Drawn on the host (CPU generator) and copied: on the GPU, randperm is a 64-bit-key radix sort,
    about a dozen launches and 0.08 ms per layer at 7B (benchmarks/RESULTS.md), against one 64 KiB
    copy from pinned memory that the host, running ahead of the GPU, prepares for free."""
    dev = torch.device(device)
    perm = torch.randperm(T, dtype=torch.int32, pin_memory=dev.type == "cuda")
    return perm.to(dev, non_blocking=True)


@dataclass(frozen=True)
class Sparse24Recipe:
    token_permutation: bool = True
    dense_feature_fraction: float = 0.05
    reuse_forward_mask: bool = True


class _SReLU24(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, recipe: Sparse24Recipe, stats: Optional[Tensor]):
        z = x @ w1.t()
        a = F.relu(z).square()
        mask = mask_2to4(a)
        if stats is not None:
            stats += sparse24_sums(a, mask, recipe.dense_feature_fraction, sparse=True)
        y = (a * mask) @ w2.t()
        ctx.save_for_backward(x, w1, w2, z, mask)
        ctx.recipe = recipe
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w1, w2, z, mask = ctx.saved_tensors
        r: Sparse24Recipe = ctx.recipe
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
def srelu24_ffn(x: Tensor, w1: Tensor, w2: Tensor, recipe: Sparse24Recipe,
                stats: Optional[Tensor] = None) -> Tensor:
    """Y = (mask24 * relu(X W1^T)^2) W2^T with the 2:4 backward of the recipe.
    x: [..., d], w1: [F, d], w2: [d, F]. `stats`, if given, is a sums buffer (model/stats.py)
    that the forward adds to."""
    shape = x.shape
    y = _SReLU24.apply(x.reshape(-1, shape[-1]), w1, w2, recipe, stats)
    return y.reshape(*shape[:-1], y.shape[-1])
