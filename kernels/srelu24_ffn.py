"""The srelu24 FFN on sparse tensor cores: the fused kernels + cuSPARSELt (plans cached by
kernels/cusparselt.py; algorithm ids from torch's search).

Same function as kernels.srelu24_reference.srelu24_ffn (its reference), GEMM by GEMM:

    forward   Z = X W1^T (dense; in float8 under trainer.float8: kernels/fp8_gemm.py);
              A24 = fused srelu + 2:4 + compress; Y = A24 W2^T (sparse; in e4m3 under
              trainer.float8 unless ffn.sparse_float8=false, as the other three sparse
              GEMMs: kernels/fp8_sparse.py);
              compressed A24 kept for the backward (9/16 of Z's bytes; Z where the CUDA kernels
              are not built, the Triton backward reads Z)
    backward  dA = dY W2 (dense; float8 as Z)
              dX = dZ W1                 sparse: dZ compressed with the forward positions
                                         (dense GEMM when reuse_forward_mask is off)
              dW2 = dY^T S(A24)          sparse: S()^T tokens permuted, dense features zeroed
              dW1 = S(dZ)^T X            there and computed by a dense GEMM over those features
              the three sparse operands from one pass (kernels/srelu24_sparsify_backward.py);
              the dense features' GEMMs in e4m3 where the 2:4 ones are, sharing their B;
              dW2 comes out of cuSPARSELt as [d, F] (column-major result), dX's rows are
              gathered back to token order

cuSPARSELt was chosen over CUTLASS's sm90 2:4 GEMM by measurement: CUTLASS was not faster at
these shapes and needed its own metadata layout and build (benchmarks/RESULTS.md).

x in bf16 (the autocast dtype); the weights in bf16, or in e4m3 mode (float8 set, sparse_float8 on)
in fp32 as the model keeps them: on the fast path every use of a weight there is an e4m3
conversion that reads fp32 (the shape fallbacks and the reuse_forward_mask=False dX cast to bf16
inside the op), and the weight gradients come out in fp32, so autograd casts neither (those casts
took 3 ms of a profiled 140 ms 7B step on the H200). Tokens are padded to 64 for the sparse operands.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from . import fp8_gemm, fp8_sparse, grads_in_place as in_place, weight_casts
from .cusparselt import cached_mm, searched_alg, torch_mm
from .ffn_stats import N_SUMS, srelu24_sums_from_counts
from .srelu24_reference import SReLU24Recipe, densest_from_counts, random_token_order
from .srelu24_sparsify import padded_rows, srelu_sparsify_2to4
from .srelu24_sparsify_backward import (a24_usable, backward_operands, backward_operands_from_a24, dense_slots,
                                        padded_tokens, write_dense_columns, write_dense_rows)


def available(x: Tensor) -> bool:
    """The kernels need CUDA on sm80/sm90 (cuSPARSELt 2:4) and torch._cslt_sparse_mm."""
    if not (x.is_cuda and hasattr(torch, "_cslt_sparse_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (8, 9)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if rows != t.shape[0] else t


def sparse_mm(a: Tensor, b: Tensor, transpose_result: bool = False) -> Tensor:
    """A @ B with A compressed, through cuSPARSELt, at the searched algorithm id (kernels/cusparselt.py).
    transpose_result: (A @ B)^T [n, m] written directly (cuSPARSELt's column-major output)."""
    alg = searched_alg(a, b, transpose_result)
    if a.is_cuda:  # plans cached: torch's op re-plans every call (host time; kernels/cusparselt.py)
        return cached_mm(a, b, alg, transpose_result)
    return torch_mm(a, b, alg, transpose_result)


def _check_dtypes(op: str, w1: Tensor, w2: Tensor, **tensors: Tensor) -> None:
    bad = [f"{k} {t.dtype}" for k, t in tensors.items() if t.dtype != torch.bfloat16]
    bad += [f"{k} {t.dtype}" for k, t in (("w1", w1), ("w2", w2)) if t.dtype not in (torch.bfloat16, torch.float32)]
    if bad:
        raise ValueError(f"srelu24::{op} needs bf16 inputs and bf16 or fp32 weights (srelu24_ffn_kernels casts "
                         f"them), got {', '.join(bad)}")


# The FFN as two torch.library custom ops (forward, backward) tied by register_autograd:
# torch.compile keeps them whole in its graph (no graph break) and traces around them with the
# fake (meta) versions below; FSDP2 hands them plain, all-gathered weights. Inputs are bf16, the
# weights bf16 or fp32 (srelu24_ffn_kernels casts: _op_weight); the recipe travels as plain
# bool/float arguments, and `float8` ("none" | "tensorwise" | "rowwise", set by training/float8.py)
# picks the dense GEMMs' precision. Every bf16 GEMM below casts a weight to bf16 itself.

def _bf16(w: Tensor) -> Tensor:
    return w.to(torch.bfloat16)


# _dense_mm's and _sparse_mm's b is a weight (W1^T, W2): its conversion is kept across the micro-batches
# of an optimizer step where the trainer asks for it (kernels/weight_casts.py; fp32 weights only)

def _dense_mm(a: Tensor, b: Tensor, float8: str, grad: bool) -> Tensor:
    if float8 == "none":
        return a @ _bf16(b)
    b8 = weight_casts.converted(f"dense {float8}", b, lambda: fp8_gemm.b_operand(b, float8))
    return fp8_gemm.mm(a, b, float8, grad, b_float8=b8)


def _sparse_mm(a: Tensor, b: Tensor, e4m3: bool, transpose_result: bool = False) -> Tensor:
    """sparse_mm, in e4m3 where asked and the shapes allow it (rows and reduction multiples of 64)."""
    if e4m3 and fp8_sparse.usable(a, b):
        b8 = weight_casts.converted("sparse e4m3", b, lambda: fp8_sparse.kmajor_e4m3(b))
        return fp8_sparse.sparse_mm(a, b, transpose_result, b_e4m3=b8)
    return sparse_mm(a, _bf16(b), transpose_result)


def _weight_grad_mm(a: Tensor, dense_rows: Tensor | None, b: Tensor, e4m3: bool, out_dtype: torch.dtype,
                    transpose_result: bool = False, slots: Tensor | None = None,
                    into: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(_sparse_mm(a, b, e4m3, transpose_result) in out_dtype (the weight's), dense_rows @ b or None
    in bf16): a weight gradient's 2:4 product and its dense features' exact rows, both in e4m3 where
    the 2:4 one is (from one e4m3 conversion of b, which the two share; the product written in
    out_dtype by its unscaling pass), else in bf16 (the product cast). slots (dW2): in e4m3 the
    unscaling pass writes the dense rows into the product's columns too, and None comes back for them.
    into (a weight's .grad): in e4m3 the unscaling pass adds the product into it, and it comes back
    in the product's place; the bf16 path ignores it."""
    if e4m3 and fp8_sparse.usable(a, b):
        return fp8_sparse.sparse_and_dense_mm(a, dense_rows, b, transpose_result, out_dtype, slots, into)
    return sparse_mm(a, b, transpose_result).to(out_dtype), None if dense_rows is None else dense_rows @ b


@torch.library.custom_op("srelu24::srelu24_ffn_fwd", mutates_args=())
def srelu24_ffn_fwd(x: Tensor, w1: Tensor, w2: Tensor, collect_stats: bool, dense_feature_fraction: float,
                    token_permutation: bool, reuse_forward_mask: bool,
                    float8: str = "none", sparse_float8: bool = True,
                    grads_in_place: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(Y [T, d], what the backward reads (`keeps_a24`: compressed A24 [padded_rows(T), 9F/16],
    else Z [T, F]), kept non-zeros per feature [F] int32, the statistics row [N_SUMS] float64,
    empty unless collect_stats). token_permutation, reuse_forward_mask and grads_in_place are the
    backward's, passed here so that the op's inputs hold the whole recipe."""
    _check_dtypes("srelu24_ffn_fwd", w1, w2, x=x)
    T = x.shape[0]
    z = _dense_mm(x, w1.t(), float8, grad=False)
    # logged steps only: the statistics come out of the sparsify pass, no extra pass over Z
    totals = torch.zeros(3, dtype=torch.float64, device=z.device) if collect_stats else None
    buf, counts = srelu_sparsify_2to4(z, totals=totals)
    y = _sparse_mm(buf, w2.t(), float8 != "none" and sparse_float8)[:T]
    # the row only on logged steps; otherwise an empty tensor (no launch on the hot path)
    row = (srelu24_sums_from_counts(counts, totals, T, dense_feature_fraction) if collect_stats
           else z.new_empty(0, dtype=torch.float64))
    return y, buf if keeps_a24(x, w1, reuse_forward_mask) else z, counts, row


@srelu24_ffn_fwd.register_fake
def _(x, w1, w2, collect_stats, dense_feature_fraction, token_permutation, reuse_forward_mask, float8="none",
      sparse_float8=True, grads_in_place=False):
    _check_dtypes("srelu24_ffn_fwd", w1, w2, x=x)
    T, F_ = x.shape[0], w1.shape[0]
    saved = (x.new_empty(padded_rows(T), F_ * 9 // 16) if keeps_a24(x, w1, reuse_forward_mask)
             else x.new_empty(T, F_))
    return (x.new_empty(T, w2.shape[0]), saved, x.new_empty(F_, dtype=torch.int32),
            x.new_empty(N_SUMS if collect_stats else 0, dtype=torch.float64))


def keeps_a24(x: Tensor, w1: Tensor, reuse_forward_mask: bool) -> bool:
    """Whether the forward keeps compressed A24 for the backward (the CUDA backward kernel reads
    it), rather than Z (the Triton kernel's input). Decided from device and shapes alone, so the
    fake (meta) forward agrees with the real one."""
    return a24_usable(x.device, w1.shape[0], reuse_forward_mask)


@torch.library.custom_op("srelu24::srelu24_ffn_bwd", mutates_args=())
def srelu24_ffn_bwd(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, saved: Tensor, counts: Tensor,
                    token_permutation: bool, dense_feature_fraction: float,
                    reuse_forward_mask: bool, float8: str = "none",
                    sparse_float8: bool = True, grads_in_place: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dX in bf16, dW1 and dW2 in their weights' dtypes). saved: the forward's compressed A24 or Z
    (srelu24_ffn_fwd). grads_in_place (fp32 weights, e4m3 mode: `_in_place`): dW1 and dW2 are added
    into the weights' .grad instead (kernels/grads_in_place.py), and come back empty."""
    _check_dtypes("srelu24_ffn_bwd", w1, w2, x=x, saved=saved)
    T, F_ = x.shape[0], w1.shape[0]
    from_a24 = saved.shape[1] != F_  # A24 is [padded T, 9F/16]
    dy = dy.to(torch.bfloat16).contiguous()
    e4m3 = float8 != "none" and sparse_float8
    da = _dense_mm(dy, w2, float8, grad=True)              # [T, F] dense
    perm = random_token_order(T, x.device) if token_permutation else None
    dense = densest_from_counts(counts, dense_feature_fraction)
    slots = dense_slots(dense, F_, x.device)[0] if dense is not None else None
    # one pass over A24 (or Z) and dA writes all three sparse operands (dZ's rows in permuted order)
    if from_a24:
        dz_buf, (s_a, a_dense), (s_dz, dz_dense) = backward_operands_from_a24(saved, da, perm, dense, slots=slots)
    else:
        dz_buf, (s_a, a_dense), (s_dz, dz_dense) = backward_operands(saved, da, perm, dense, reuse_forward_mask,
                                                                     slots=slots)
    if reuse_forward_mask:
        dx = _sparse_mm(dz_buf, w1, e4m3)[:T]
        if perm is not None:  # back to token order: a gather by the inverse (a scatter took 3x as long)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(T, device=perm.device, dtype=perm.dtype)
            dx = dx.index_select(0, inverse)
    else:  # dZ is not 2:4 then: a dense GEMM (the ablation, not the fast path)
        dx = (da * (2 * F.relu(saved))) @ _bf16(w1)  # saved is Z here: keeps_a24 needs the forward mask

    Tp = padded_tokens(T)
    dy_p = _pad_rows(dy[perm] if perm is not None else dy, Tp)
    x_p = _pad_rows(x[perm] if perm is not None else x, Tp)
    # in place: the parameters, and their .grad where the unscaling pass may add into it
    p1, p2 = (in_place.parameter_of(w1), in_place.parameter_of(w2)) if grads_in_place else (None, None)
    g1, g2 = (in_place.accumulator(p1), in_place.accumulator(p2)) if grads_in_place else (None, None)
    has_dense = dense is not None  # zero in the sparse products: the dense features' exact columns, rows
    dw2, dw2_dense = _weight_grad_mm(s_a, a_dense if has_dense else None, dy_p, e4m3, w2.dtype, transpose_result=True,
                                     slots=slots, into=g2)
    if dw2_dense is not None:  # dw2 is [d, F], no transpose pass (in e4m3 its columns are already written)
        write_dense_columns(dw2, slots, dw2_dense)
    dw1, dw1_dense = _weight_grad_mm(s_dz, dz_dense if has_dense else None, x_p, e4m3, w1.dtype, into=g1)  # [F, d]
    if has_dense:
        write_dense_rows(dw1, dense, dw1_dense, accumulate=g1 is not None and dw1 is g1)
    if not grads_in_place:
        return dx.contiguous(), dw1.contiguous(), dw2
    for p, dw, g in ((p1, dw1, g1), (p2, dw2, g2)):
        if g is None or dw is not g:  # no .grad yet, or a path that did not add into it
            in_place.add(p, dw)
    return dx.contiguous(), dx.new_empty(0, dtype=w1.dtype), dx.new_empty(0, dtype=w2.dtype)


@srelu24_ffn_bwd.register_fake
def _(dy, x, w1, w2, saved, counts, token_permutation, dense_feature_fraction, reuse_forward_mask, float8="none",
      sparse_float8=True, grads_in_place=False):
    if grads_in_place:
        return torch.empty_like(x), x.new_empty(0, dtype=w1.dtype), x.new_empty(0, dtype=w2.dtype)
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _in_place(w1: Tensor, w2: Tensor, float8: str, sparse_float8: bool, grads_in_place: bool) -> bool:
    """Whether the backward adds the weight gradients into .grad itself: asked for, and the fp32
    weights of e4m3 mode (a static property of the model: fixed when compile traces the op)."""
    return grads_in_place and float8 != "none" and sparse_float8 and w1.dtype == w2.dtype == torch.float32


def _setup_context(ctx, inputs, output):
    (x, w1, w2, _, ctx.dense_feature_fraction, ctx.token_permutation, ctx.reuse_forward_mask, ctx.float8,
     ctx.sparse_float8, grads_in_place) = inputs
    # frozen weights (no gradient wanted) take the plain path: the op would give them a .grad
    ctx.grads_in_place = (_in_place(w1, w2, ctx.float8, ctx.sparse_float8, grads_in_place)
                          and ctx.needs_input_grad[1] and ctx.needs_input_grad[2])
    _, saved, counts, _ = output
    ctx.save_for_backward(x, w1, w2, saved, counts)
    # A24/Z and the statistics row never get gradients: without this autograd fills a zero "gradient"
    # for them before the backward, a memset of [T, F] per layer that buys nothing (benchmarks/RESULTS.md)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, *unused):  # only Y carries a gradient; Z, counts and the row do not
    if dy is None:  # Y unused by the loss (grads are not materialised)
        return (None,) * 10
    x, w1, w2, saved, counts = ctx.saved_tensors
    dx, dw1, dw2 = srelu24_ffn_bwd(dy, x, w1, w2, saved, counts, ctx.token_permutation, ctx.dense_feature_fraction,
                                   ctx.reuse_forward_mask, ctx.float8, ctx.sparse_float8, ctx.grads_in_place)
    if ctx.grads_in_place:  # already in the weights' .grad
        dw1 = dw2 = None
    return dx, dw1, dw2, None, None, None, None, None, None, None


srelu24_ffn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _op_weight(w: Tensor, e4m3: bool) -> Tensor:
    """w as the op takes it. In e4m3 mode an fp32 w goes in as it is: the op's e4m3 conversions read
    fp32 (its bf16 fallbacks cast inside), and it returns the gradient in fp32, which saves autograd's
    cast of w (forward) and of its gradient (backward). Else w cast to bf16 here, outside the op:
    autograd returns fp32 gradients to fp32 weights."""
    return w if e4m3 and w.dtype == torch.float32 else w.to(torch.bfloat16)


def srelu24_ffn_kernels(x: Tensor, w1: Tensor, w2: Tensor, recipe: SReLU24Recipe, stats=None,
                        float8: str = "none", sparse_float8: bool = True, grads_in_place: bool = False) -> Tensor:
    """The srelu24 FFN on x [..., d]; adds this call's statistics row to `stats` when given.
    float8: the dense GEMMs' recipe (trainer.float8), "none" for bf16; sparse_float8: with float8
    set, the 2:4 GEMMs in e4m3 as well (row-wise power-of-2 scales, kernels/fp8_sparse.py).
    grads_in_place: in e4m3 mode on fp32 weights (registered parameters), the backward adds their
    gradients into .grad itself and autograd gets None for them (kernels/grads_in_place.py)."""
    shape = x.shape
    e4m3 = float8 != "none" and sparse_float8
    y, _, _, row = srelu24_ffn_fwd(x.reshape(-1, shape[-1]).to(torch.bfloat16), _op_weight(w1, e4m3),
                                   _op_weight(w2, e4m3), stats is not None, recipe.dense_feature_fraction,
                                   recipe.token_permutation, recipe.reuse_forward_mask, float8, sparse_float8,
                                   grads_in_place)
    if stats is not None:
        stats += row.detach()  # the op's float outputs all carry autograd history; the buffer must not
    return y.reshape(*shape[:-1], y.shape[-1])
