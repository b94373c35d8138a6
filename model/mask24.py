"""The 2:4 selection: the one definition every path (reference, statistics, kernels' tests) uses."""
import torch
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
