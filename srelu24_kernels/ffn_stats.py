"""Per-layer activation statistics, summed on the device.

An FFN whose `stats` buffer is enabled adds one row of sums per forward pass; nothing is
read back until the trainer asks (every `log_every` steps), so a step never waits on the
host. `derive` turns the sums into the logged fractions. Definitions:

- act_sparsity: fraction of exact zeros in the activation that feeds W2 (for srelu24 in 2:4
  mode, after the 2:4 selection). SwiGLU's activation silu(W1 x) * W3 x is almost never
  exactly zero, so there a value counts as zero when |a| <= SWIGLU_ZERO_THRESHOLD.
srelu24 only (also during the dense warmup, where they say what 2:4 *would* drop):
- drop_nnz: fraction of the non-zeros of relu(Z)^2 that the 2:4 selection drops;
- drop_l2: ||A - A24|| / ||A||, the relative L2 norm dropped;
- dense_features: fraction of features whose density along tokens exceeds
  DENSE_FEATURE_DENSITY (0.5): above it, 2:4 along tokens must drop values of that feature;
- split_density: density along tokens of the least dense feature in the weight-gradient
  dense split (the top `dense_feature_fraction`), i.e. the threshold that split applies;
- mode_2to4: 1 when the layer runs 2:4, 0 in the dense warmup.
"""
from typing import Optional

import torch
from torch import Tensor

from .srelu24.reference import mask_2to4

SWIGLU_ZERO_THRESHOLD = 1e-3
DENSE_FEATURE_DENSITY = 0.5

# Columns of the sums row.
ELEMENTS, ZEROS, NNZ, DROPPED_NNZ, SQ, DROPPED_SQ, DENSE_FEATS, FEATURES, SPLIT_DENSITY, PASSES, SPARSE = range(11)
N_SUMS = 11


def _dense_sums(a: Tensor, threshold: float) -> Tensor:
    zeros = (a == 0).sum() if threshold == 0 else (a.abs() <= threshold).sum()
    one = torch.ones((), dtype=torch.float64, device=a.device)
    row = torch.zeros(N_SUMS, dtype=torch.float64, device=a.device)
    return row.index_put((torch.tensor([ELEMENTS, ZEROS, PASSES], device=a.device),),
                         torch.stack([one * a.numel(), zeros.double(), one]))


def _srelu24_sums(a: Tensor, mask: Optional[Tensor], k: int, sparse: bool) -> Tensor:
    a = a.reshape(-1, a.shape[-1])
    mask = mask_2to4(a) if mask is None else mask.reshape(a.shape)  # None: selected here, in the fused pass
    nz = a != 0
    fed_nz = nz & mask if sparse else nz  # non-zeros of what feeds W2
    density = fed_nz.sum(0, dtype=torch.float32) / a.shape[0]  # per feature, along tokens
    sq = a.float().square()
    one = torch.ones((), dtype=torch.float64, device=a.device)
    return torch.stack([  # in the column order of N_SUMS
        one * a.numel(), (a.numel() - fed_nz.sum()).double(), nz.sum().double(), (nz & ~mask).sum().double(),
        sq.sum().double(), torch.where(mask, 0.0, sq).sum().double(),
        (density > DENSE_FEATURE_DENSITY).sum().double(), one * a.shape[1],
        density.topk(k).values[-1].double(), one, one * float(sparse)])


_compiled: dict = {}


def _fused(fn):
    """On CUDA, one compiled (fused) version of fn: a single pass over the activation instead
    of one kernel per reduction; eager elsewhere (CPU tests, TRITON_INTERPRET)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


# Statistics run on logged steps only. They stay out of the model's torch.compile graph (a
# graph break on those steps only), so the other steps keep their single graph.
@torch.compiler.disable
def dense_activation_sums(a: Tensor, threshold: float = 0.0) -> Tensor:
    """Sums for a dense FFN's activation a [..., F]."""
    return (_fused(_dense_sums) if a.is_cuda else _dense_sums)(a, threshold)


@torch.compiler.disable
def srelu24_sums(a: Tensor, mask: Optional[Tensor], dense_fraction: float, sparse: bool) -> Tensor:
    """Sums for srelu24: a = relu(Z)^2 [..., F] before the 2:4 selection, mask its 2:4 mask
    (None: computed here, inside the fused pass on CUDA)."""
    k = max(1, int(round(dense_fraction * a.shape[-1])))
    return (_fused(_srelu24_sums) if a.is_cuda else _srelu24_sums)(a, mask, k, sparse)


@torch.compiler.disable
def srelu24_sums_from_counts(kept: Tensor, totals: Tensor, tokens: int, dense_fraction: float) -> Tensor:
    """The row srelu24_sums(a, None, dense_fraction, sparse=True) gives, built from what the fused
    sparsify kernel already reduced in its pass (srelu24_kernels/srelu24/sparsify.py): kept non-zeros per
    feature [F] and totals [non-zeros, sum a^2, dropped sum a^2]. Small [F]-sized work only."""
    features = kept.shape[0]
    k = max(1, int(round(dense_fraction * features)))
    density = kept.double() / tokens
    kept_nnz = kept.sum(dtype=torch.float64)
    one = torch.ones((), dtype=torch.float64, device=kept.device)
    elements = one * tokens * features
    nnz, sq, dropped_sq = totals.double().unbind()
    return torch.stack([  # in the column order of N_SUMS
        elements, elements - kept_nnz, nnz, nnz - kept_nnz, sq, dropped_sq,
        (density > DENSE_FEATURE_DENSITY).sum().double(), one * features,
        density.topk(k).values[-1], one, one])


def derive(sums: Tensor, srelu24: bool) -> dict[str, list[float]]:
    """Per-layer statistics from the summed rows [L, N_SUMS] (on the CPU)."""
    s = sums.double()
    out = {"act_sparsity": s[:, ZEROS] / s[:, ELEMENTS].clamp(min=1)}
    if srelu24:
        out["drop_nnz"] = s[:, DROPPED_NNZ] / s[:, NNZ].clamp(min=1)
        out["drop_l2"] = (s[:, DROPPED_SQ] / s[:, SQ].clamp(min=1e-30)).sqrt()
        out["dense_features"] = s[:, DENSE_FEATS] / s[:, FEATURES].clamp(min=1)
        out["split_density"] = s[:, SPLIT_DENSITY] / s[:, PASSES].clamp(min=1)
        out["mode_2to4"] = (s[:, SPARSE] / s[:, PASSES].clamp(min=1)).round()
    return {k: v.tolist() for k, v in out.items()}
