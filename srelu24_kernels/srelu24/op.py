"""The srelu24 FFN on sparse tensor cores: the fused sparsify passes + cuSPARSELt, as custom ops.

Same function as srelu24_kernels.srelu24.reference.srelu24_ffn (its reference), GEMM by GEMM:

    forward   Z = X W1^T                 dense (float8 under trainer.float8: srelu24_kernels/float8/gemm.py)
              A24 = srelu + 2:4 + compress, one pass (sparsify.py)
              Y = A24 W2^T               sparse (e4m3 under trainer.float8 unless ffn.sparse_float8=false,
                                         as the other three sparse GEMMs: srelu24_kernels/float8/sparse.py)
              kept for the backward: compressed A24 (9/16 of Z's bytes) where the CUDA backward
              kernel is built, else Z (the Triton backward reads Z); `keeps_a24` decides, the
              caller passes the choice in (keep_a24), and the backward is told which; with A24
              in e4m3 mode, A24's column maxima too (_fuses_a24_cast)
    backward  dA = dY W2                 dense (float8 as Z)
              the three sparse operands from one pass over A24 (or Z) and dA (sparsify_backward.py),
              S(A24)^T straight in e4m3 where the forward took A24's column maxima
              dX = dZ W1                 sparse: dZ compressed at the forward's positions
                                         (a dense GEMM when reuse_forward_mask is off)
              dW2 = dY^T S(A24)          sparse: S()^T tokens permuted, the dense features zeroed there
              dW1 = S(dZ)^T X            and their rows (columns of dW2) computed by a dense GEMM
              dW2 comes out of cuSPARSELt as [d, F] (its column-major output); dX's rows are
              gathered back to token order

Three ops: srelu24::ffn_forward (up to A24), srelu24::ffn_output (Y) and srelu24::ffn_backward (the
whole backward). Y's GEMM is an op of its own so that a checkpointed block recomputes without it:
AOT autograd's partitioner recomputes in the backward only the forward's nodes whose outputs the
backward reads (A24 or Z, the counts), as it leaves W2's GEMM out of the dense FFN's recomputation.
dL/dY reaches ffn_forward's backward through h, an output of ffn_forward without storage that
ffn_output takes and gives Y's gradient to.

The backward's modes, and who sets them:

    mode                          set by                                    changes
    A24 or Z kept                 the device and the CUDA kernels' build    the operands' pass
    reuse_forward_mask            OpOptions.recipe                          dX sparse or dense
    token_permutation             OpOptions.recipe (off: the block permutes) dY, X permuted; dX gathered back
    e4m3                          OpOptions (float8 set, sparse_float8 on)  the 2:4 GEMMs' precision
    dense features                the forward's counts                      exact rows of dW1, columns of dW2
    kept weight conversions       StepState (training/step.py)              the weights' e4m3 conversions reused
    X's, dY's conversions paired  tensorwise, e4m3, tokens in their order   Z's A and dW1's B from one pair of
                                  (_pairs_token_casts)                      passes over X in the forward, which
                                                                            keeps the second instead of X; dA's A
                                                                            and dW2's B likewise from dY
    Y, dX left scaled             a compiled graph (ffn asks), e4m3         the unscaling of Y and dX as torch ops
                                  2:4 GEMMs; for dX also dZ 2:4 and no      after the op, fused by Inductor into the
                                  order drawn by the op (_defers_unscaling) residual add and the norm's backward
    gradients added into .grad    StepState (training/step.py)              dW1, dW2 added into the given buffers
    S(A24)^T written in e4m3      A24 kept, e4m3, an unlogged step,         the forward's sparsify pass takes A24's
                                  tokens a multiple of 64                   column maxima, from which the backward's
                                  (_fuses_a24_cast)                         pass writes dW2's A in e4m3 (no bf16
                                                                            copy, no conversion pass)

Weights: bf16, or in e4m3 mode fp32 as the model keeps them (every use of a weight there is an e4m3
conversion that reads fp32, and the weight gradients are written in fp32, so autograd casts
neither). x is bf16 (the autocast dtype). Tokens are padded for the sparse operands
(srelu24_kernels/cusparselt/layout.py: `padded`).

cuSPARSELt was chosen over CUTLASS's sm90 2:4 GEMM by measurement: CUTLASS was not faster at these
shapes and needed its own metadata layout and build (lab/LOG.md).
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cusparselt.binding import sparse_mm
from ..cusparselt.layout import COLS_PER_CHUNK, ROWS_PER_BAND, pad_rows, padded
from ..ffn_stats import N_SUMS, srelu24_sums_from_counts
from ..float8 import gemm as fp8_gemm
from ..float8 import sparse as fp8_sparse
from ..float8 import paired as fp8_paired
from ..float8.paired import Cast
from .native import KERNELS
from .options import PAIR_ADD, PAIR_KEEP, PAIR_OFF, GradPairs, OpOptions, StepState, WeightOperands
from .reference import densest_from_counts, random_token_order
from .sparsify import srelu_sparsify_2to4
from .sparsify_backward import (a24_usable, backward_operands, backward_operands_from_a24, dense_slots,
                                write_dense_columns, write_dense_rows)

@torch.no_grad()
def convert_weights(w1: Tensor, w2: Tensor, options: OpOptions, out: Optional[WeightOperands] = None) -> WeightOperands:
    """Every conversion of W1 and W2 the e4m3 op makes, as it makes them. Under the tensorwise recipe
    two passes over each weight make both of its conversions (fp8_paired.paired_casts: the same
    bytes), written into `out`'s tensors where given (a CUDA graph's kept ones); else one by one,
    copied into `out`."""
    if options.float8 == "tensorwise" and w1.is_contiguous() and w2.is_contiguous():
        o = out or WeightOperands((None, None), (None, None), (None, None), (None, None))
        t = lambda v: None if v is None else v.t()  # noqa: E731 (the kept views are transposes of the casts)
        z, dx = fp8_paired.paired_casts(w1, "tensor", "cols", (Cast(t(o.for_z[0]), None, o.for_z[1]),
                                                               Cast(t(o.for_dx[0]), o.for_dx[1], None)))
        y, da = fp8_paired.paired_casts(w2, "rows", "tensor", (Cast(t(o.for_y[0]), o.for_y[1], None),
                                                               Cast(t(o.for_da[0]), None, o.for_da[1])))
        return WeightOperands(for_z=(z.values.t(), z.inv), for_y=(y.values.t(), y.scale),
                              for_da=(da.values.t(), da.inv), for_dx=(dx.values.t(), dx.scale))
    fresh = WeightOperands(for_z=fp8_gemm.b_operand(w1.t(), options.float8), for_y=fp8_sparse.kmajor_e4m3(w2.t()),
                           for_da=fp8_gemm.b_operand(w2, options.float8), for_dx=fp8_sparse.kmajor_e4m3(w1))
    if out is None:
        return fresh
    torch._foreach_copy_(out.flat(), fresh.flat())
    return out


def available(x: Tensor) -> bool:
    """The kernels need CUDA on sm80/sm90 (cuSPARSELt 2:4) and torch._cslt_sparse_mm."""
    if not (x.is_cuda and hasattr(torch, "_cslt_sparse_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (8, 9)


def keeps_a24(x: Tensor, w1: Tensor, reuse_forward_mask: bool) -> bool:
    """Whether the forward keeps compressed A24 for the backward (the CUDA backward kernel reads
    it), rather than Z (the Triton kernel's input). From device and shapes alone, so that the fake
    (meta) forward agrees with the real one and the backward is told, not left to guess."""
    return a24_usable(x.device, w1.shape[0], reuse_forward_mask)


def _check_dtypes(op: str, w1: Tensor, w2: Tensor, **tensors: Tensor) -> None:
    bad = [f"{k} {t.dtype}" for k, t in tensors.items() if t.dtype != torch.bfloat16]
    bad += [f"{k} {t.dtype}" for k, t in (("w1", w1), ("w2", w2)) if t.dtype not in (torch.bfloat16, torch.float32)]
    if bad:
        raise ValueError(f"srelu24::{op} needs bf16 inputs and bf16 or fp32 weights (srelu24_kernels.srelu24.op.ffn casts "
                         f"them), got {', '.join(bad)}")


# ------------------------------------------------------------------ the GEMMs
# b is a weight in _dense_mm and _sparse_mm: `converted` is its conversion where the step made it.

def _dense_mm(a: Tensor, b: Tensor, float8: str, grad: bool, converted=None, a_converted=None) -> Tensor:
    if float8 == "none":
        return a @ b.to(torch.bfloat16)
    return fp8_gemm.mm(a, b, float8, grad, b_float8=converted, a_float8=a_converted)


def _sparse_mm(a: Tensor, b: Tensor, e4m3: bool, transpose_result: bool = False, converted=None) -> Tensor:
    """A @ B with A compressed, in e4m3 where asked and the shapes allow it (rows and reduction
    multiples of 64), else in bf16."""
    if e4m3 and fp8_sparse.usable(a, b):
        return fp8_sparse.sparse_mm(a, b, transpose_result, b_e4m3=converted)
    return sparse_mm(a, b.to(torch.bfloat16), transpose_result)


def _weight_grad_mm(a, dense_rows: Optional[Tensor], b: Tensor, e4m3: bool, out_dtype: torch.dtype,
                    transpose_result: bool = False, slots: Optional[Tensor] = None,
                    into: Optional[Tensor] = None, converted=None) -> tuple[Tensor, Optional[Tensor]]:
    """(a weight gradient's 2:4 product in out_dtype, its dense features' exact rows dense_rows @ b
    or None): in e4m3 where the 2:4 GEMMs are (one conversion of b for both, `converted` where the
    caller made it; the product written in out_dtype by the unscaling pass, which also writes the
    dense rows as dW2's columns where given `slots`, None coming back for them, and adds into `into`
    where given, returning it), else bf16. Where `converted` is given b may be None (X's kept cast).
    a: a compressed bf16 buffer, or one already in e4m3 as (values, row scales) (S(A24)^T from the
    backward's pass: always an e4m3 product)."""
    a_e4m3 = a if isinstance(a, tuple) else None
    if converted is not None or a_e4m3 is not None or (e4m3 and fp8_sparse.usable(a, b)):  # b unread where converted
        return fp8_sparse.sparse_and_dense_mm(None if a_e4m3 is not None else a, dense_rows, b, transpose_result,
                                              out_dtype, slots, into, b_e4m3=converted, a_e4m3=a_e4m3)
    return sparse_mm(a, b, transpose_result).to(out_dtype), None if dense_rows is None else dense_rows @ b


# ------------------------------------------------------------------ forward

@torch.library.custom_op("srelu24::ffn_forward", mutates_args=())
def ffn_forward(x: Tensor, w1: Tensor, w2: Tensor, weights: list[Tensor], grad_w1: Optional[Tensor],
                grad_w2: Optional[Tensor], pairs: list[Tensor], collect_stats: bool, keep_a24: bool,
                token_permutation: bool, dense_feature_fraction: float, reuse_forward_mask: bool, float8: str,
                sparse_float8: bool, defer_unscaling: bool, pairing: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward up to A24 (Y = A24 W2^T is ffn_output's): (A24 [padded(T, 64), 9F/16], compressed;
    h [T, d] bf16, Y's gradient carrier for ffn_output (_gradient_carrier); Z [T, F] where not
    keep_a24 (the backward reads it then), else empty; kept non-zeros per feature [F] int32; the
    statistics row [N_SUMS] float64, empty unless collect_stats; X's e4m3 cast for dW1 [d, T] (its
    bytes, uint8) and its column scales [d] where _pairs_token_casts (the backward keeps these
    instead of X), else empty; A24's column maxima [F] float32 where _fuses_a24_cast, else empty).
    The backward is this op's: it gets dL/dY as h's gradient and returns dX, dW1 and dW2 (w2, not
    read here, is an input for that). defer_unscaling: the backward's dX leaves ffn_backward still
    scaled (_defers_unscaling), as ffn_output's Y. weights: WeightOperands.flat() or []; grad_w1,
    grad_w2 are the backward's (the buffers it adds into), taken here so that autograd hands them
    to it, as are pairs (GradPairs' tensors or []) and pairing (PAIR_OFF, PAIR_KEEP, PAIR_ADD:
    _paired_weight_grads). keep_a24: `keeps_a24`, asked by the caller: an argument is part of a
    compiled graph and so of Inductor's on-disk cache key, which cannot see whether the CUDA
    kernels are built (a graph compiled with them, reused without, expected A24 where the op
    returned Z)."""
    _check_dtypes("ffn_forward", w1, w2, x=x)
    if keep_a24 and not keeps_a24(x, w1, reuse_forward_mask):
        raise ValueError(f"srelu24::ffn_forward was asked to keep A24 for the backward, which needs {KERNELS.path()} "
                         f"({KERNELS.make_target}), an sm80/sm90 GPU, F % 64 == 0 and reuse_forward_mask; "
                         f"got {x.device}, F {w1.shape[0]}, reuse_forward_mask {reuse_forward_mask}")
    o = OpOptions.from_flags(token_permutation, dense_feature_fraction, reuse_forward_mask, float8, sparse_float8)
    kept = WeightOperands.from_flat(weights)
    T = x.shape[0]
    for_z, for_dw1 = _input_casts(x, w1.shape[0], o)
    z = _dense_mm(x, w1.t(), o.float8, grad=False, converted=kept and kept.for_z, a_converted=for_z)
    del for_z
    # logged steps only: the statistics come out of the sparsify pass, no extra pass over Z
    totals = torch.zeros(3, dtype=torch.float64, device=z.device) if collect_stats else None
    amax = torch.zeros(w1.shape[0], dtype=torch.float32, device=x.device) if _fuses_a24_cast(
        T, w1.shape[0], o, x.device, keep_a24, collect_stats) else None
    buf, counts = srelu_sparsify_2to4(z, totals=totals, amax=amax)
    row = (srelu24_sums_from_counts(counts, totals, T, dense_feature_fraction) if collect_stats
           else z.new_empty(0, dtype=torch.float64))  # no launch on the hot path
    # the cast's bytes as uint8: an integer output, which autograd gives no gradient (float8 ones it would try to)
    x_cols, x_scale = ((for_dw1[0].view(torch.uint8), for_dw1[1]) if for_dw1 is not None
                       else (x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float32)))
    return (buf, _gradient_carrier(x, w2), z.new_empty(0) if keep_a24 else z, counts, row, x_cols, x_scale,
            amax if amax is not None else x.new_empty(0, dtype=torch.float32))


@ffn_forward.register_fake
def _(x, w1, w2, weights, grad_w1, grad_w2, pairs, collect_stats, keep_a24, token_permutation, dense_feature_fraction,
      reuse_forward_mask, float8, sparse_float8, defer_unscaling, pairing):
    _check_dtypes("ffn_forward", w1, w2, x=x)
    T, F_ = x.shape[0], w1.shape[0]
    o = OpOptions.from_flags(token_permutation, dense_feature_fraction, reuse_forward_mask, float8, sparse_float8)
    d, paired = x.shape[1], _pairs_token_casts(T, F_, o, x.device)
    fused = _fuses_a24_cast(T, F_, o, x.device, keep_a24, collect_stats)
    return (_compressed_like(x, F_), _gradient_carrier(x, w2), x.new_empty(0) if keep_a24 else x.new_empty(T, F_),
            x.new_empty(F_, dtype=torch.int32), x.new_empty(N_SUMS if collect_stats else 0, dtype=torch.float64),
            x.new_empty((d, T) if paired else 0, dtype=torch.uint8), x.new_empty(d if paired else 0, dtype=torch.float32),
            x.new_empty(F_ if fused else 0, dtype=torch.float32))


def _gradient_carrier(x: Tensor, w2: Tensor) -> Tensor:
    """ffn_forward's h: Y's shape [T, d] and dtype in one element of storage (all strides 0), never
    read. Its gradient is dL/dY, which autograd checks against its shape, dtype and device only.
    Zero (an op's outputs must be the same in every run: opcheck), one element written: zero_ on
    the [T, d] view would write T d times."""
    return torch.zeros((), dtype=torch.bfloat16, device=x.device).expand(x.shape[0], w2.shape[0])


@torch.library.custom_op("srelu24::ffn_output", mutates_args=())
def ffn_output(a24: Tensor, h: Tensor, w2: Tensor, for_y: list[Tensor], float8: str, sparse_float8: bool,
               defer_unscaling: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(Y = A24 W2^T [T, d] bf16, the 2:4 GEMM: e4m3 where OpOptions.e4m3 and fp8_sparse.usable, else
    bf16; Y's row [T] and column [d] scales where _defers_unscaling (Y is then still scaled:
    fp8_sparse.unscaled(Y, *scales) is the product), else empty). a24, h: ffn_forward's first two
    outputs (h for its shape and its gradient: dL/dY of the unscaled Y goes to it, and so to
    ffn_forward's backward, which does all of the backward's work; a24, w2 and for_y get none, dW2
    being ffn_forward's). for_y: W2^T's e4m3 conversion kept for the step (WeightOperands.for_y) or [].
    defer_unscaling: asked by the caller inside a compiled graph, where the unscaling fuses into
    the residual add (ffn). A caller that defers must unscale Y with an identity gradient
    (_Unscaled), or its gradients are wrong."""
    o = OpOptions(float8=float8, sparse_float8=sparse_float8)
    converted = tuple(for_y) or None
    T = h.shape[0]
    if _defers_unscaling(a24, w2.t(), o, defer_unscaling):
        y, y_rows, y_cols = fp8_sparse.scaled_sparse_mm(a24, w2.t(), b_e4m3=converted)
        # a kept conversion's scales are an input: an output may not alias it
        return y[:T], y_rows[:T], y_cols.clone() if converted else y_cols
    y = _sparse_mm(a24, w2.t(), o.e4m3, converted=converted)[:T]
    return y, y.new_empty(0, dtype=torch.float32), y.new_empty(0, dtype=torch.float32)


@ffn_output.register_fake
def _(a24, h, w2, for_y, float8, sparse_float8, defer_unscaling):
    deferred = _defers_unscaling(a24, w2.t(), OpOptions(float8=float8, sparse_float8=sparse_float8), defer_unscaling)
    T, d = h.shape
    return (a24.new_empty(T, d), a24.new_empty(T if deferred else 0, dtype=torch.float32),
            a24.new_empty(d if deferred else 0, dtype=torch.float32))


def _output_setup_context(ctx, inputs, output):
    ctx.n_for_y = len(inputs[3])
    ctx.set_materialize_grads(False)  # the scales' gradients: None, not zeros


def _output_backward(ctx, dy, *unused):
    # dL/dY to h alone: ffn_forward's backward computes every gradient, dW2 included
    return None, dy, None, [None] * ctx.n_for_y, None, None, None


ffn_output.register_autograd(_output_backward, setup_context=_output_setup_context)


# ------------------------------------------------------------------ backward

class _SparseOperands(NamedTuple):
    dz: Tensor                         # dZ compressed at the forward's positions, rows permuted
    a_tokens: tuple                    # S(A24)^T (bf16, or e4m3 as (values, row scales)), A24^T of the dense features
    dz_tokens: tuple[Tensor, Optional[Tensor]]  # S(dZ)^T, and dZ^T of the dense features


def _sparse_operands(saved: Tensor, saved_a24: bool, da: Tensor, perm, dense, slots,
                     reuse_forward_mask: bool, a_amax: Optional[Tensor] = None) -> _SparseOperands:
    if saved_a24:
        return _SparseOperands(*backward_operands_from_a24(saved, da, perm, dense, slots=slots, a_amax=a_amax))
    return _SparseOperands(*backward_operands(saved, da, perm, dense, reuse_forward_mask, slots=slots))


def _input_grad(ops: _SparseOperands, saved: Tensor, da: Tensor, w1: Tensor, perm, T: int, o: OpOptions,
                kept: Optional[WeightOperands], deferred: bool = False) -> tuple[Tensor, Optional[tuple]]:
    """(dX = dZ W1 in token order, None); deferred (_defers_unscaling, for the backward): (dX still
    scaled, its row and column scales)."""
    if deferred:  # _defers_unscaling(backward=True): dZ 2:4, no order of the op's to undo
        assert perm is None and o.recipe.reuse_forward_mask
        dx, rows, cols = fp8_sparse.scaled_sparse_mm(ops.dz, w1, b_e4m3=kept and kept.for_dx)
        return dx[:T], (rows[:T], cols.clone() if kept else cols)  # a kept conversion's is an input: not aliased
    if not o.recipe.reuse_forward_mask:  # dZ is not 2:4 then: a dense GEMM (the ablation), from Z
        return (da * (2 * F.relu(saved))) @ w1.to(torch.bfloat16), None
    dx = _sparse_mm(ops.dz, w1, o.e4m3, converted=kept and kept.for_dx)[:T]
    if perm is not None:  # back to token order: a gather by the inverse (a scatter is slower)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(T, device=perm.device, dtype=perm.dtype)
        dx = dx.index_select(0, inverse)
    return dx, None


def _weight_grads(ops: _SparseOperands, dy: Tensor, x: Optional[Tensor], perm, dense, slots, w1: Tensor, w2: Tensor,
                  o: OpOptions, grads: Optional[tuple[Tensor, Tensor]], dy_e4m3=None, x_e4m3=None,
                  pairing: int = PAIR_OFF, pairs: Optional[GradPairs] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(dW1 [F, d], dW2 [d, F]) in the weights' dtypes; with `grads`, added into them instead (and
    those returned). dy_e4m3, x_e4m3: dW2's and dW1's B, where _gradient_casts and _input_casts made
    them (x is None then). pairing, pairs: _paired_weight_grads (None, None back where it keeps)."""
    g1, g2 = grads if grads is not None else (None, None)
    dy_p = pad_rows(dy[perm] if perm is not None else dy, COLS_PER_CHUNK)
    x_p = None if x_e4m3 is not None else pad_rows(x[perm] if perm is not None else x, COLS_PER_CHUNK)
    if pairing != PAIR_OFF:
        return _paired_weight_grads(ops, dy_p, x_p, dense, slots, grads, dy_e4m3, x_e4m3, pairing, pairs)
    (s_a, a_dense), (s_dz, dz_dense) = ops.a_tokens, ops.dz_tokens
    has_dense = dense is not None  # zero in the sparse products: the dense features' exact columns, rows
    dw2, dw2_dense = _weight_grad_mm(s_a, a_dense if has_dense else None, dy_p, o.e4m3, w2.dtype,
                                     transpose_result=True, slots=slots, into=g2, converted=dy_e4m3)
    if dw2_dense is not None:  # dw2 is [d, F]; in e4m3 its dense columns are already written
        write_dense_columns(dw2, slots, dw2_dense)
    dw1, dw1_dense = _weight_grad_mm(s_dz, dz_dense if has_dense else None, x_p, o.e4m3, w1.dtype, into=g1,
                                     converted=x_e4m3)
    if has_dense:
        write_dense_rows(dw1, dense, dw1_dense, accumulate=dw1 is g1 and g1 is not None)
    for g, dw in ((g1, dw1), (g2, dw2)):
        if g is not None and dw is not g:  # a bf16 path, which wrote its own product
            g.add_(dw)
    return (g1, g2) if grads is not None else (dw1, dw2)


def _paired_weight_grads(ops: _SparseOperands, dy_p: Tensor, x_p: Optional[Tensor], dense, slots,
                         grads: Optional[tuple[Tensor, Tensor]], dy_e4m3, x_e4m3, pairing: int,
                         pairs: GradPairs) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The weight gradients' e4m3 products two micro-batches at a time (ffn.paired_grad_unscaling).
    PAIR_KEEP, the first of a pair: the products are written, still scaled, into `pairs` (with their
    scales and dense columns), nothing into .grad; (None, None). PAIR_ADD, the second: its products and
    the kept ones are unscaled in one pass each (fp8_sparse.unscale's `pending`) and added into
    `grads`, or made the new gradients where there are none yet. That pass reads 2 + 2 + 4 bytes an
    element and writes 4, where two passes read 2 + 4 + 2 + 4 and write 8. The sums are those of the
    unpaired op bit for bit, in the same order: the kept micro-batch's dW1 dense rows go into .grad
    when it is kept (the 2:4 product is zero there), or, where there is no .grad yet, after the pair's pass
    (two terms: the order of an fp32 sum of two does not change it)."""
    (s_a, a_dense), (s_dz, dz_dense) = ops.a_tokens, ops.dz_tokens
    has_dense = dense is not None
    g1, g2 = grads if grads is not None else (None, None)
    a2, a1 = (None, s_a) if isinstance(s_a, tuple) else (s_a, None)  # S(A24)^T in e4m3 from the backward's pass
    if not (dy_e4m3 is not None and x_e4m3 is not None):
        raise ValueError("srelu24: paired weight gradients need X's and dY's e4m3 casts (_pairs_token_casts)")
    if pairing == PAIR_KEEP:
        p2, _ = fp8_sparse.sparse_and_dense_mm(a2, a_dense if has_dense else None, dy_p, True, torch.float32, slots,
                                               b_e4m3=dy_e4m3, a_e4m3=a1, keep=pairs.y2)
        p1, rows1 = fp8_sparse.sparse_and_dense_mm(s_dz, dz_dense if has_dense else None, x_p, False, torch.float32,
                                                   b_e4m3=x_e4m3, keep=pairs.y1)
        torch._foreach_copy_([pairs.r2, pairs.c2, pairs.r1, pairs.c1], [p2.row_scale, p2.col_scale, p1.row_scale,
                                                                        p1.col_scale])
        if has_dense:
            torch._foreach_copy_([pairs.slots2, pairs.g2], list(p2.dense_columns))
            if g1 is not None:
                write_dense_rows(g1, dense, rows1, accumulate=True)
            else:
                torch._foreach_copy_([pairs.dense1, pairs.rows1], [dense, rows1])
        return None, None
    kept2 = fp8_sparse.Pending(pairs.y2, pairs.r2, pairs.c2, (pairs.slots2, pairs.g2) if has_dense else None)
    kept1 = fp8_sparse.Pending(pairs.y1, pairs.r1, pairs.c1, None)
    dw2, _ = fp8_sparse.sparse_and_dense_mm(a2, a_dense if has_dense else None, dy_p, True, torch.float32, slots,
                                            accumulate_into=g2, b_e4m3=dy_e4m3, a_e4m3=a1, pending=kept2)
    dw1, rows1 = fp8_sparse.sparse_and_dense_mm(s_dz, dz_dense if has_dense else None, x_p, False, torch.float32,
                                                accumulate_into=g1, b_e4m3=x_e4m3, pending=kept1)
    if has_dense:
        if g1 is None:  # the kept micro-batch's, which had no .grad to go into
            write_dense_rows(dw1, pairs.dense1, pairs.rows1, accumulate=True)
        write_dense_rows(dw1, dense, rows1, accumulate=True)
    return dw1, dw2


def add_kept(pairs: GradPairs, grads: tuple[Tensor, Tensor], has_dense: bool) -> None:
    """A step that ends on the first of a pair (an odd number of micro-batches): its kept products
    unscaled and added into .grad (its dense rows of dW1 are there already)."""
    g1, g2 = grads
    fp8_sparse.unscale(pairs.y2, row_scale=pairs.r2, col_scale=pairs.c2, out_dtype=torch.float32,
                       dense_columns=(pairs.slots2, pairs.g2) if has_dense else None, accumulate_into=g2)
    fp8_sparse.unscale(pairs.y1, row_scale=pairs.r1, col_scale=pairs.c1, out_dtype=torch.float32, accumulate_into=g1)


def _pairs_token_casts(T: int, F_: int, o: OpOptions, device) -> bool:
    """Whether X's and dY's two float8 conversions each come from one pair of passes
    (fp8_paired.paired_casts, the bytes of the one-by-one ones): where both GEMMs that read each take
    those. The tensorwise recipe (X, dY scaled as a whole for Z and dA), e4m3 2:4 GEMMs that
    fp8_sparse.usable will accept for dW1 and dW2 (an sm90 GPU, F and the tokens T multiples of 64),
    and the tokens in their own order (the block permuted them, or no order is drawn: an order the
    op draws is drawn in the backward, after X's casts)."""
    return (o.float8 == "tensorwise" and o.e4m3 and not o.recipe.token_permutation and T % 64 == 0 and F_ % 64 == 0
            and fp8_sparse.available(device))


def _fuses_a24_cast(T: int, F_: int, o: OpOptions, device, keep_a24: bool, collect_stats: bool) -> bool:
    """Whether the forward takes A24's column maxima (srelu_sparsify_2to4's amax) so that the
    backward's pass writes S(A24)^T, dW2's A, straight in e4m3 (backward_operands_from_a24's a_amax):
    the same bytes as converting its bf16 buffer, without that buffer or the conversion pass. Where
    A24 is kept (the CUDA kernels), the 2:4 GEMMs are e4m3 and the tokens T a multiple of 64 (the
    e4m3 layout); not on logged steps (collect_stats), whose forward is the Triton kernel's."""
    return (keep_a24 and o.e4m3 and not collect_stats and T % 64 == 0 and F_ % 64 == 0
            and fp8_sparse.available(device))


def _defers_unscaling(a: Tensor, b: Tensor, o: OpOptions, asked: bool, backward: bool = False) -> bool:
    """Whether Y = A24 W2^T (or, backward, dX = dZ W1) leaves the op still scaled, with its row and
    column scales: where the caller asked (inside a compiled graph: `ffn`) and that product is an
    e4m3 2:4 GEMM (fp8_sparse.usable of its compressed A and its B: an sm90 GPU, F a multiple of 64).
    The unscaling, fp8_sparse.unscaled in torch ops, then fuses into the residual add that reads Y and
    the norm's backward that reads dX, instead of a pass over each (read and write [T, d] in bf16).
    dX also needs dZ 2:4 (reuse_forward_mask) and no token order drawn by the op (its rows gathered
    back). ffn_backward's fake asks with a stand-in for A of its shape."""
    if backward and not (o.recipe.reuse_forward_mask and not o.recipe.token_permutation):
        return False
    return asked and o.e4m3 and fp8_sparse.usable(a, b)


def _compressed_like(x: Tensor, F_: int) -> Tensor:
    """A stand-in (for a fake) for the compressed 2:4 buffer of a [T, F] operand: its shape and dtype, x's device."""
    return x.new_empty(padded(x.shape[0], ROWS_PER_BAND), F_ * 9 // 16, dtype=torch.bfloat16)


def _input_casts(x: Tensor, F_: int, o: OpOptions) -> tuple[Optional[tuple], Optional[tuple]]:
    """(Z = X W1^T's A: e4m3 scaled as a whole, as fp8_gemm.a_operand; dW1's B: e4m3 per column,
    K-major, as fp8_sparse.kmajor_e4m3 — its values [d, T] and scales, which the forward returns
    for the backward to keep), from one pair of passes over X where _pairs_token_casts; else
    (None, None): each GEMM converts X itself."""
    if not _pairs_token_casts(x.shape[0], F_, o, x.device):
        return None, None
    for_z, for_dw1 = fp8_paired.paired_casts(x.contiguous(), "tensor", "cols")
    return (for_z.values, for_z.inv), (for_dw1.values, for_dw1.scale)


def _gradient_casts(dy: Tensor, F_: int, o: OpOptions) -> tuple[Optional[tuple], Optional[tuple]]:
    """(dA = dY W2's A: e5m2 scaled as a whole, as fp8_gemm.a_operand; dW2's B: e4m3 per column,
    K-major, as fp8_sparse.kmajor_e4m3), from one pair of passes over dY where _pairs_token_casts;
    else (None, None): each GEMM converts dY itself."""
    if not _pairs_token_casts(dy.shape[0], F_, o, dy.device):
        return None, None
    for_da, for_dw2 = fp8_paired.paired_casts(dy, "tensor", "cols", dtypes=(fp8_paired.E5M2, fp8_paired.E4M3))
    return (for_da.values, for_da.inv), (for_dw2.values.t(), for_dw2.scale)


@torch.library.custom_op("srelu24::ffn_backward", mutates_args=("grad_w1", "grad_w2", "pairs"))
def ffn_backward(dy: Tensor, x: Optional[Tensor], w1: Tensor, w2: Tensor, saved: Tensor, counts: Tensor,
                 saved_a24: bool, weights: list[Tensor], grad_w1: Optional[Tensor], grad_w2: Optional[Tensor],
                 pairs: list[Tensor], x_cols: Optional[Tensor], x_scale: Optional[Tensor], a24_amax: Optional[Tensor],
                 token_permutation: bool, dense_feature_fraction: float, reuse_forward_mask: bool, float8: str,
                 sparse_float8: bool, defer_unscaling: bool, pairing: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dX in bf16, dW1, dW2 in their weights' dtypes, dX's row [T] and column [d] scales where
    _defers_unscaling(backward=True), else empty: dX is then still scaled, as the forward's Y).
    saved: the forward's A24 (saved_a24) or Z.
    grad_w1, grad_w2 (both or neither; fp32, contiguous, the weights' shapes): dW1 and dW2 are
    added into them, and come back empty. x_cols, x_scale: X's cast for dW1 that the forward made
    (its fifth and sixth outputs, where not empty: e4m3 bytes as uint8), in place of x (None then).
    a24_amax: the forward's last output where not empty (A24 saved): S(A24)^T is then written in e4m3.
    pairs, pairing: _paired_weight_grads (GradPairs' tensors); with PAIR_KEEP dW1 and dW2 come back
    empty, nothing having been added anywhere yet."""
    _check_dtypes("ffn_backward", w1, w2, saved=saved, **({} if x is None else {"x": x}))
    if (x is None) == (x_cols is None):
        raise ValueError("srelu24::ffn_backward takes X or its cast for dW1 (the forward's x_cols, x_scale), one of them")
    o = OpOptions.from_flags(token_permutation, dense_feature_fraction, reuse_forward_mask, float8, sparse_float8)
    kept = WeightOperands.from_flat(weights)
    grads = (grad_w1, grad_w2) if grad_w1 is not None and grad_w2 is not None else None
    T, F_ = dy.shape[0], w1.shape[0]
    dy = dy.to(torch.bfloat16).contiguous()
    perm = random_token_order(T, dy.device) if token_permutation else None
    dy_for_da, dy_for_dw2 = _gradient_casts(dy, F_, o)
    da = _dense_mm(dy, w2, o.float8, grad=True, converted=kept and kept.for_da, a_converted=dy_for_da)  # [T, F]
    del dy_for_da  # freed before the sparse passes allocate theirs
    dense = densest_from_counts(counts, dense_feature_fraction)
    slots = dense_slots(dense, F_, dy.device)[0] if dense is not None else None
    if a24_amax is not None and not saved_a24:
        raise ValueError("srelu24::ffn_backward: A24's column maxima come with A24 saved (saved_a24)")
    ops = _sparse_operands(saved, saved_a24, da, perm, dense, slots, reuse_forward_mask, a24_amax)
    dx, dx_scales = _input_grad(ops, saved, da, w1, perm, T, o, kept,
                                _defers_unscaling(ops.dz, w1, o, defer_unscaling, backward=True))
    dx_rows, dx_cols = dx_scales or (dx.new_empty(0, dtype=torch.float32), dx.new_empty(0, dtype=torch.float32))
    if pairing != PAIR_OFF and not _pairs_token_casts(T, F_, o, dy.device):
        raise ValueError(f"ffn.paired_grad_unscaling needs X's and dY's e4m3 casts paired: the tensorwise recipe, "
                         f"tokens a multiple of 64 and none permuted by the op (got {T} tokens, token_permutation "
                         f"{o.recipe.token_permutation}); set ffn.paired_grad_unscaling=false")
    dw1, dw2 = _weight_grads(ops, dy, x, perm, dense, slots, w1, w2, o, grads, dy_for_dw2,
                             None if x_cols is None else (x_cols.view(fp8_paired.E4M3).t(), x_scale),
                             pairing, GradPairs(*pairs) if pairs else None)
    if grads is not None or pairing == PAIR_KEEP:
        return dx.contiguous(), dx.new_empty(0, dtype=w1.dtype), dx.new_empty(0, dtype=w2.dtype), dx_rows, dx_cols
    return dx.contiguous(), dw1.contiguous(), dw2, dx_rows, dx_cols


@ffn_backward.register_fake
def _(dy, x, w1, w2, saved, counts, saved_a24, weights, grad_w1, grad_w2, pairs, x_cols, x_scale, a24_amax,
      token_permutation, dense_feature_fraction, reuse_forward_mask, float8, sparse_float8, defer_unscaling, pairing):
    dx = torch.empty_like(dy, dtype=torch.bfloat16)  # X's shape
    o = OpOptions.from_flags(token_permutation, dense_feature_fraction, reuse_forward_mask, float8, sparse_float8)
    deferred = _defers_unscaling(_compressed_like(dy, w1.shape[0]), w1, o, defer_unscaling, backward=True)
    scales = (dx.new_empty(dx.shape[0] if deferred else 0, dtype=torch.float32),
              dx.new_empty(dx.shape[1] if deferred else 0, dtype=torch.float32))
    if grad_w1 is not None and grad_w2 is not None or pairing == PAIR_KEEP:
        return dx, dx.new_empty(0, dtype=w1.dtype), dx.new_empty(0, dtype=w2.dtype), *scales
    return dx, torch.empty_like(w1), torch.empty_like(w2), *scales


def _setup_context(ctx, inputs, output):
    x, w1, w2, weights, g1, g2, pairs, _, keep_a24, *flags = inputs
    ctx.flags = flags
    ctx.pairing, ctx.n_pairs = flags[-1], len(pairs)
    ctx.saved_a24 = keep_a24
    # weights that want no gradient take the plain path: adding would give them a .grad
    ctx.in_place = g1 is not None and g2 is not None and ctx.needs_input_grad[1] and ctx.needs_input_grad[2]
    ctx.n_weights = len(weights)
    a24, _, z, counts, _, x_cols, x_scale, a24_amax = output
    saved = a24 if keep_a24 else z
    # X's cast for dW1 where the forward made it (1 byte an element, its scales), else X (2 bytes)
    ctx.x_paired = x_cols.numel() > 0
    xs = (x_cols, x_scale) if ctx.x_paired else (x,)
    ctx.a24_amax = a24_amax.numel() > 0
    ctx.save_for_backward(*xs, w1, w2, saved, counts, *((a24_amax,) if ctx.a24_amax else ()), *weights,
                          *((g1, g2) if ctx.in_place else ()), *pairs)
    # A24, Z and the statistics row never get gradients: without this autograd fills a zero "gradient"
    # for them before the backward, a memset of [T, F] per layer that buys nothing
    ctx.set_materialize_grads(False)


def _backward(ctx, _, dy, *unused):  # only h carries a gradient: dL/dY, from ffn_output's backward
    # the inputs' gradients: x, w1, w2, then one per kept conversion (a list), none for the rest
    # (grad_w1, grad_w2, the pairs' buffers (a list), collect_stats, keep_a24, the flags)
    no_grads = ([None] * ctx.n_weights, None, None, [None] * ctx.n_pairs, None, None) + (None,) * len(ctx.flags)
    if dy is None:  # Y unused by the loss (gradients are not materialised)
        return (None, None, None) + no_grads
    tensors = ctx.saved_tensors
    n = 2 if ctx.x_paired else 1
    x, x_cols, x_scale = (None, *tensors[:2]) if ctx.x_paired else (tensors[0], None, None)
    w1, w2, saved, counts, *rest = tensors[n:]
    a24_amax, rest = (rest[0], rest[1:]) if ctx.a24_amax else (None, rest)
    weights, rest = rest[:ctx.n_weights], rest[ctx.n_weights:]
    grads, pairs = (rest[:2], rest[2:]) if ctx.in_place else ((None, None), rest)
    dx, dw1, dw2, dx_rows, dx_cols = ffn_backward(dy, x, w1, w2, saved, counts, ctx.saved_a24, weights, *grads,
                                                  list(pairs), x_cols, x_scale, a24_amax, *ctx.flags)
    if dx_rows.numel():  # traced into the compiled backward, where it fuses into the norm's backward
        dx = fp8_sparse.unscaled(dx, dx_rows, dx_cols)
    if ctx.in_place or ctx.pairing == PAIR_KEEP:  # in the buffers already, or kept for the next micro-batch:
        dw1 = dw2 = None                           # autograd accumulates nothing for W1, W2
    return (dx, dw1, dw2) + no_grads


ffn_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ entry

class _Unscaled(torch.autograd.Function):
    """Y from the op's still-scaled product (fp8_sparse.unscaled), its gradient passed on as it
    is: the op's backward takes dL/dY, whatever Y's scaling was."""

    @staticmethod
    def forward(ctx, y: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        return fp8_sparse.unscaled(y, rows, cols)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return dy, None, None


def _op_weight(w: Tensor, e4m3: bool) -> Tensor:
    """w as the op takes it: in e4m3 mode an fp32 w as it is (the op's conversions read fp32, its bf16
    fallbacks cast inside, and it returns fp32 gradients: autograd casts neither way); else cast to
    bf16 here, outside the op, and autograd returns fp32 gradients to fp32 weights."""
    return w if e4m3 and w.dtype == torch.float32 else w.to(torch.bfloat16)


def ffn(x: Tensor, w1: Tensor, w2: Tensor, options: OpOptions = OpOptions(), stats: Optional[Tensor] = None,
        step: Optional[StepState] = None, tokens_permuted: bool = False) -> Tensor:
    """The srelu24 FFN on x [..., d]; adds this call's statistics row to `stats` when given.
    step: the optimizer step's shared state (StepState), or None: the op converts every weight at
    each use and hands autograd the weight gradients. tokens_permuted: x's rows are already in a
    random order (the block's), so the op draws none."""
    shape = x.shape
    kept = step.weights.flat() if step is not None and step.weights is not None else []
    g1, g2 = step.grads if step is not None and step.grads is not None else (None, None)
    pairs, pairing = [], PAIR_OFF
    # every micro-batch of a step with pairs is paired (the backward refuses one whose casts of X and dY
    # are not: tokens a multiple of 64, no order drawn by the op; the trainer's config check asks the
    # first, its blocks do the second): a step that ends on a pair's first adds it then (end_step)
    if step is not None and step.pairs is not None:
        pairs, pairing = list(step.pairs), PAIR_KEEP if step.micro_batches.keep else PAIR_ADD
    keep = keeps_a24(x, w1, options.recipe.reuse_forward_mask)  # decided here: a constant of the compiled graph
    # compiled: Y and dX leave the ops still scaled, their unscaling fused into what reads them (by
    # Inductor; under aot_eager, a test backend, the unscaling runs as four elementwise passes)
    defer = options.e4m3 and torch.compiler.is_compiling()
    w2 = _op_weight(w2, options.e4m3)
    a24, h, _, _, row, _, _, _ = ffn_forward(
        x.reshape(-1, shape[-1]).to(torch.bfloat16), _op_weight(w1, options.e4m3), w2, kept, g1, g2, pairs,
        stats is not None, keep, *options.flags(tokens_permuted), defer, pairing)
    for_y = list(step.weights.for_y) if kept else []
    y, y_rows, y_cols = ffn_output(a24, h, w2, for_y, options.float8, options.sparse_float8, defer)
    if y_rows.numel():
        y = _Unscaled.apply(y, y_rows, y_cols)
    if stats is not None:
        stats += row.detach()  # the op's float outputs all carry autograd history; the buffer must not
    return y.reshape(*shape[:-1], y.shape[-1])
