"""The srelu24 FFN on sparse tensor cores: the fused kernels + cuSPARSELt (`torch._cslt_sparse_mm`).

Same function as model.sparse24.srelu24_ffn (its reference), GEMM by GEMM:

    forward   Z = X W1^T (dense); A24 = fused srelu + 2:4 + compress; Y = A24 W2^T (sparse)
    backward  dA = dY W2 (dense)
              dX = dZ W1                 sparse: dZ compressed with the forward positions
                                         (dense GEMM when reuse_forward_mask is off)
              dW2 = dY^T S(A24)          sparse: S()^T from kernels/sparsify24_tokens.py,
              dW1 = S(dZ)^T X            tokens permuted, dense features zeroed there and
                                         computed by a dense GEMM over those features

Inputs in bf16 (the autocast dtype); tokens are padded to 64 for the sparse operands.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from model.sparse24 import Sparse24Recipe
from model.stats import sparse24_sums_from_counts

from .sparsify24 import srelu_sparsify24
from .sparsify24_tokens import padded_tokens, sparsify_tokens


def available(x: Tensor) -> bool:
    """The kernels need CUDA on sm80/sm90 (cuSPARSELt 2:4) and torch._cslt_sparse_mm."""
    if not (x.is_cuda and hasattr(torch, "_cslt_sparse_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (8, 9)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if rows != t.shape[0] else t


_ALG: dict = {}


def sparse_mm(a: Tensor, b: Tensor) -> Tensor:
    """A @ B with A compressed, through cuSPARSELt, with the algorithm found fastest by
    mm_search for this shape and layout (cached). An upstream issue reports wrong results for
    some algorithm ids, so a searched id is kept only if it matches the default's product."""
    key = (tuple(a.shape), tuple(b.shape), b.stride())
    if key not in _ALG:
        _ALG[key] = 0
        try:
            alg = torch._C._cusparselt.mm_search(a, b, None, None, None, False)[0]
            ref, got = torch._cslt_sparse_mm(a, b), torch._cslt_sparse_mm(a, b, alg_id=alg)
            if ((got.float() - ref.float()).norm() <= 1e-3 * ref.float().norm()).item():
                _ALG[key] = alg
        except (AttributeError, RuntimeError, TypeError):
            pass  # no search in this build (or the CPU stand-in in tests): the default algorithm
    alg = _ALG[key]
    return torch._cslt_sparse_mm(a, b, alg_id=alg) if alg else torch._cslt_sparse_mm(a, b)


class SReLU24Kernels(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, recipe: Sparse24Recipe, stats):
        dt = torch.bfloat16
        x, w1b, w2b = x.to(dt), w1.to(dt), w2.to(dt)
        T = x.shape[0]
        z = x @ w1b.t()
        # logged steps only: the statistics come out of the sparsify pass, no extra pass over Z
        totals = torch.zeros(3, dtype=torch.float64, device=z.device) if stats is not None else None
        buf, counts = srelu_sparsify24(z, totals=totals)
        y = sparse_mm(buf, w2b.t())[:T]
        if stats is not None:
            stats += sparse24_sums_from_counts(counts, totals, T, recipe.dense_feature_fraction)
        ctx.save_for_backward(x, w1b, w2b, z, counts)
        ctx.recipe, ctx.w_dtypes = recipe, (w1.dtype, w2.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w1b, w2b, z, counts = ctx.saved_tensors
        r: Sparse24Recipe = ctx.recipe
        T = x.shape[0]
        dy = dy.to(torch.bfloat16).contiguous()
        da = dy @ w2b                                          # [T, F] dense
        if r.reuse_forward_mask:
            dz_buf, _ = srelu_sparsify24(z, da=da)
            dx = sparse_mm(dz_buf, w1b)[:T]
        else:  # dZ is not 2:4 then: a dense GEMM (the ablation, not the fast path)
            dx = (da * (2 * F.relu(z))) @ w1b

        perm = torch.randperm(T, device=x.device) if r.token_permutation else None
        k = int(round(r.dense_feature_fraction * z.shape[1]))
        dense = torch.sort(-counts, stable=True).indices[:k] if k > 0 else None
        Tp = padded_tokens(T)
        dy_p = _pad_rows(dy[perm] if perm is not None else dy, Tp)
        x_p = _pad_rows(x[perm] if perm is not None else x, Tp)
        s_a, a_dense = sparsify_tokens(z, perm, dense)
        s_dz, dz_dense = sparsify_tokens(z, perm, dense, da=da, reuse_forward_mask=r.reuse_forward_mask)
        dw2 = sparse_mm(s_a, dy_p).t().contiguous()           # [d, F]
        dw1 = sparse_mm(s_dz, x_p)                            # [F, d]
        if dense is not None:                                 # exact gradients of the dense features
            dw2[:, dense] = (a_dense @ dy_p).t()
            dw1[dense] = dz_dense @ x_p
        return dx, dw1.to(ctx.w_dtypes[0]), dw2.to(ctx.w_dtypes[1]), None, None


# Not registered with torch.library yet: under torch.compile it runs as a graph break.
@torch.compiler.disable
def srelu24_ffn_kernels(x: Tensor, w1: Tensor, w2: Tensor, recipe: Sparse24Recipe, stats=None) -> Tensor:
    shape = x.shape
    y = SReLU24Kernels.apply(x.reshape(-1, shape[-1]), w1, w2, recipe, stats)
    return y.reshape(*shape[:-1], y.shape[-1])


