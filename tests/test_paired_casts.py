"""A matrix's two float8 conversions in two passes (srelu24_kernels/float8/paired.py): bit for bit its
PyTorch reference and the one-by-one conversions the op made before (fp8_gemm's operands,
fp8_sparse.kmajor_e4m3), special values included: the weights' (e4m3), written into given tensors
where asked (a CUDA graph's kept buffers), and dY's (e5m2 and e4m3); a wrong buffer or format is
refused. CPU: TRITON_INTERPRET."""
import pytest
import torch

from srelu24_kernels.float8 import gemm as fp8_gemm
from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.float8.paired import E4M3, E5M2, KINDS, Cast, paired_casts, paired_casts_reference
from srelu24_kernels.srelu24.op import convert_weights
from srelu24_kernels.srelu24.options import OpOptions, SReLU24Recipe, WeightOperands

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def weight(r: int, c: int, seed: int, special: bool = False) -> torch.Tensor:
    """An fp32 [r, c] with rows and columns of very different magnitudes; `special`: a NaN, an inf,
    an all-zero row, a tiny row and amaxes at the power-of-2 scales' edges."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(r, c, generator=g) * torch.logspace(-2, 2, r)[:, None] * torch.logspace(-1, 1, c)[None, :]
    if special:
        w[1, 3] = float("nan")
        w[2, 5] = -float("inf")
        w[4] = 0.0
        w[5] *= 1e-20
        w[6, 0], w[7, 1], w[8, 2] = 448.0, 1.75, 1.7500001
    return w


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """float8 bytes as they are (NaN is 0x7F in both paths); float32 bits with every NaN as one pattern:
    a NaN's sign and payload are the arithmetic's (x86's default NaN has its sign set, the GPU's not)."""
    t = t.cpu()
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return torch.where(t.isnan(), torch.tensor(0x7FC00000, dtype=torch.int32), t.view(torch.int32))


def _equal(got, want) -> bool:
    return got.shape == want.shape and torch.equal(_bytes(got), _bytes(want))


@pytest.mark.parametrize("r, c", [(64, 128), (96, 200), (300, 70), (1, 1)])
@pytest.mark.parametrize("own, trans", [("tensor", "cols"), ("rows", "tensor"), ("rows", "cols"), ("cols", "rows")])
def test_paired_casts_match_the_reference_bit_for_bit(r, c, own, trans):
    w = weight(r, c, r * c)
    got = paired_casts(w.to(DEV), own, trans)
    want = paired_casts_reference(w, own, trans)
    for g, x in zip(got, want):
        assert all(_equal(a, b) for a, b in zip(g, x)), (own, trans)
    assert got[0].values.shape == (r, c) and got[1].values.shape == (c, r)


def test_a_bf16_weight_casts_as_the_reference():
    w = weight(64, 96, 9).bfloat16()
    for g, x in zip(paired_casts(w.to(DEV), "rows", "tensor"), paired_casts_reference(w, "rows", "tensor")):
        assert all(_equal(a, b) for a, b in zip(g, x))


@pytest.mark.parametrize("own, trans", [("tensor", "cols"), ("rows", "tensor")])
def test_nan_and_inf_reach_the_casts_as_the_reference_has_them(own, trans):
    w = weight(72, 136, 5, special=True)
    got = paired_casts(w.to(DEV), own, trans)
    want = paired_casts_reference(w, own, trans)
    for g, x in zip(got, want):
        assert all(_equal(a, b) for a, b in zip(g, x))
    assert got[0].values.cpu().float().isnan().any()  # the NaN is not lost to a max reduction


@pytest.mark.parametrize("special", [False, True])
def test_convert_weights_makes_the_bytes_of_the_one_by_one_conversions(special):
    """The op's tensorwise conversions of W1 [F, d] and W2 [d, F], against the functions it called
    before: the same values, scales and layouts (views of the same shapes and strides)."""
    w1, w2 = weight(192, 64, 1, special).to(DEV), weight(64, 192, 2, special).to(DEV)
    got = convert_weights(w1, w2, OpOptions(SReLU24Recipe(), "tensorwise", True))
    want = WeightOperands(for_z=fp8_gemm.b_operand(w1.t(), "tensorwise"), for_y=fp8_sparse.kmajor_e4m3(w2.t()),
                          for_da=fp8_gemm.b_operand(w2, "tensorwise"), for_dx=fp8_sparse.kmajor_e4m3(w1))
    for name, g, x in zip(WeightOperands._fields, got, want):
        for a, b in zip(g, x):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, name
            assert _equal(a, b), name


def test_convert_weights_writes_into_the_given_tensors():
    opts = OpOptions(SReLU24Recipe(), "tensorwise", True)
    w1, w2 = weight(128, 64, 3).to(DEV), weight(64, 128, 4).to(DEV)
    kept = convert_weights(w1, w2, opts)
    ptrs = [t.data_ptr() for t in kept.flat()]
    w1.mul_(3.0), w2.mul_(-0.5)  # the optimizer's update
    again = convert_weights(w1, w2, opts, out=kept)
    assert [t.data_ptr() for t in again.flat()] == ptrs
    fresh = convert_weights(w1, w2, opts)
    assert all(_equal(a, b) for a, b in zip(kept.flat(), fresh.flat()))
    assert not _equal(kept.for_z[1], convert_weights(w1 / 3.0, w2, opts).for_z[1])  # the scales did change


def test_rowwise_conversions_are_copied_into_the_given_tensors():
    opts = OpOptions(SReLU24Recipe(), "rowwise", True)
    w1, w2 = weight(128, 64, 6).to(DEV), weight(64, 128, 7).to(DEV)
    kept = convert_weights(w1, w2, opts)
    ptrs = [t.data_ptr() for t in kept.flat()]
    w1.mul_(0.25)
    convert_weights(w1, w2, opts, out=kept)
    assert [t.data_ptr() for t in kept.flat()] == ptrs
    assert all(_equal(a, b) for a, b in zip(kept.flat(), convert_weights(w1, w2, opts).flat()))


def test_a_wrong_buffer_or_kind_is_refused():
    w = weight(64, 128, 8).to(DEV)
    bad = torch.empty(64, 128, dtype=torch.float8_e4m3fn, device=DEV)  # the transposed cast is [128, 64]
    with pytest.raises(ValueError, match=r"out trans.values must be a contiguous torch.float8_e4m3fn \(128, 64\)"):
        paired_casts(w, "tensor", "cols", (None, Cast(bad, None, None)))
    with pytest.raises(ValueError, match="scale kinds are tensor, rows, cols"):
        paired_casts(w, "tensor", "columns")
    with pytest.raises(ValueError, match="contiguous 2-D matrix"):
        paired_casts(w.t(), "tensor", "cols")
    with pytest.raises(ValueError, match="float8_e5m2 for a tensor's scale"):
        paired_casts(w, "tensor", "cols", dtypes=(E5M2, E5M2))
    assert set(KINDS) == {"tensor", "rows", "cols"}


def gradient(t: int, d: int, seed: int, special: bool = False) -> torch.Tensor:
    """A bf16 dY [t, d]: tokens and features of very different magnitudes; `special`: values past
    e5m2's range after scaling, an all-zero token, a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(t, d, generator=g) * torch.logspace(-6, 1, t)[:, None] * torch.logspace(-1, 1, d)[None, :]
    if special:
        dy[3] = 0.0
        dy[5, 7], dy[9, 2] = float("nan"), -float("inf")
    return dy.bfloat16()


@pytest.mark.parametrize("special", [False, True])
def test_gradient_casts_are_the_bytes_of_the_one_by_one_conversions(special):
    """dY's pair (e5m2 scaled as a whole, e4m3 per column transposed) against what dA = dY W2 and
    dW2 converted for themselves: fp8_gemm.a_operand (tensorwise, gradient) and fp8_sparse.kmajor_e4m3."""
    dy = gradient(192, 64, 4, special).to(DEV)
    own, trans = paired_casts(dy, "tensor", "cols", dtypes=(E5M2, E4M3))
    a8, ia = fp8_gemm.a_operand(dy, "tensorwise", grad=True)
    b8, sb = fp8_sparse.kmajor_e4m3(dy)
    assert own.values.dtype == E5M2 and _equal(own.values, a8)
    # a NaN in dY makes the tensor's scale NaN on both paths, with different payload bits on the CPU
    assert torch.equal(own.inv.cpu(), ia.cpu()) or (own.inv.isnan() & ia.isnan()).item()
    assert _equal(trans.values.t(), b8) and trans.values.t().stride() == b8.stride() and _equal(trans.scale, sb)
    ref = paired_casts_reference(dy, "tensor", "cols", (E5M2, E4M3))
    assert _equal(own.values, ref[0].values) and all(_equal(a, b) for a, b in zip(trans, ref[1]))
    assert special == own.scale.isnan().item() == ref[0].scale.isnan().item()


def test_the_op_pairs_x_and_dy_where_both_gemms_take_the_pair(monkeypatch):
    """srelu24's op (op._input_casts, op._gradient_casts): under tensorwise with e4m3 2:4 GEMMs, tokens
    in their own order and multiples of 64, X's and dY's two conversions come from one pair each,
    shaped as their GEMMs take them (checked against the one-by-one ones, the GPU's availability
    granted); else (None, None)."""
    import srelu24_kernels.srelu24.op as K
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)
    dy = gradient(128, 64, 5).to(DEV)
    x = gradient(128, 64, 6).to(DEV)
    tensorwise = OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise", True)
    (a8, ia), (b8, sb) = K._gradient_casts(dy, 256, tensorwise)
    want_a, want_b = fp8_gemm.a_operand(dy, "tensorwise", grad=True), fp8_sparse.kmajor_e4m3(dy)
    assert _equal(a8, want_a[0]) and _equal(ia, want_a[1])
    assert _equal(b8, want_b[0]) and b8.stride() == want_b[0].stride() and _equal(sb, want_b[1])
    (a8, ia), (cols, sc) = K._input_casts(x, 256, tensorwise)
    want_a, want_b = fp8_gemm.a_operand(x, "tensorwise", grad=False), fp8_sparse.kmajor_e4m3(x)
    assert a8.dtype == E4M3 and _equal(a8, want_a[0]) and _equal(ia, want_a[1])
    assert _equal(cols.t(), want_b[0]) and cols.is_contiguous() and _equal(sc, want_b[1])  # [d, T]: kept as is
    for o, t, f in [(OpOptions(SReLU24Recipe(), "rowwise", True), 128, 256),
                    (OpOptions(SReLU24Recipe(), "tensorwise", False), 128, 256),   # bf16 2:4 GEMMs
                    (OpOptions(SReLU24Recipe(token_permutation=True), "tensorwise", True), 128, 256),  # the op's order
                    (tensorwise, 96, 256),                                          # tokens not a multiple of 64
                    (tensorwise, 128, 200)]:                                        # features not a multiple of 64
        assert not K._pairs_token_casts(t, f, o, x.device)
        assert K._gradient_casts(dy[:t], f, o) == (None, None) == K._input_casts(x[:t], f, o)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: False)
    assert K._gradient_casts(dy, 256, tensorwise) == (None, None) == K._input_casts(x, 256, tensorwise)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d, f", [(2048, 8448), (512, 1536)])
def test_convert_weights_at_the_models_shapes_on_the_gpu(d, f):
    """The 1B FFN's weights (and a small one), fresh random values, then a NaN and an inf (which
    the GPU's max, unlike the interpreter's, may drop): fused and one by one agree."""
    torch.manual_seed(d + f)
    w1, w2 = torch.randn(f, d, device="cuda") * 0.02, torch.randn(d, f, device="cuda") * 0.02
    _agree(w1, w2)
    w2[3, 11] = -float("inf")  # an inf alone: tensor scale 0, the inf's column and row NaN
    _agree(w1, w2)
    w1[7, 9], w2[5, 100] = float("nan"), -float("nan")  # a NaN with its sign bit set
    _agree(w1, w2)
    _agree(w1[:f - 40, : d - 24].contiguous(), w2[: d - 24, : f - 40].contiguous())  # tails off the tiles


def _agree(w1: torch.Tensor, w2: torch.Tensor) -> None:
    got = convert_weights(w1, w2, OpOptions(SReLU24Recipe(), "tensorwise", True))
    want = WeightOperands(for_z=fp8_gemm.b_operand(w1.t(), "tensorwise"), for_y=fp8_sparse.kmajor_e4m3(w2.t()),
                          for_da=fp8_gemm.b_operand(w2, "tensorwise"), for_dx=fp8_sparse.kmajor_e4m3(w1))
    for name, g, x in zip(WeightOperands._fields, got, want):
        assert all(a.stride() == b.stride() and _equal(a, b) for a, b in zip(g, x)), name



def _op_runs(monkeypatch, x, w1, w2, dy, weights_dtype=None) -> dict:
    """The tensorwise op's Y, dX, dW1, dW2 with the pairs (op._pairs_token_casts as it decides) and
    without (each GEMM converting X and dY itself), and what its forward saved for the backward."""
    from helpers import kernel_ffn
    import srelu24_kernels.srelu24.op as K
    real = K._pairs_token_casts
    runs = {}
    for paired in (True, False):
        monkeypatch.setattr(K, "_pairs_token_casts", real if paired else lambda *a: False)
        for t in (x, w1, w2):
            t.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = kernel_ffn(x, w1, w2, SReLU24Recipe(token_permutation=False), float8="tensorwise")
        y.backward(dy)
        runs[paired] = ([y.detach().clone()] + [t.grad.clone() for t in (x, w1, w2)], saved)
    monkeypatch.setattr(K, "_pairs_token_casts", real)
    return runs


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                                              b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32))


def _check_paired_runs(runs: dict, x: torch.Tensor) -> None:
    (paired, saved_paired), (alone, saved_alone) = runs[True], runs[False]
    for what, a, b in zip(("Y", "dX", "dW1", "dW2"), paired, alone):
        assert _bitwise(a, b), what
    T, d = x.shape
    # the pair's forward keeps X's dW1 cast [d, T] in e4m3 (and its scales) in place of X
    assert any(t.dtype == torch.uint8 and t.shape == (d, T) for t in saved_paired)  # e4m3 bytes
    is_x = lambda t: t.dtype == x.dtype and t.shape == x.shape and t.data_ptr() == x.data_ptr()  # noqa: E731 (a view)
    assert not any(map(is_x, saved_paired)) and any(map(is_x, saved_alone))


def _e4m3_sparse_stand_in(monkeypatch):
    """fp8_sparse's e4m3 2:4 GEMMs on the CPU: their fp32 references, a given conversion of B
    dequantized for them (the reference converts it again: with power-of-2 scales the same values)."""
    def b_of(b, b_e4m3):
        return b if b_e4m3 is None else b_e4m3[0].float() / b_e4m3[1][None, :]

    def sparse_and_dense_mm(buf, dense_rows, b, transpose_result=False, out_dtype=torch.bfloat16, slots=None,
                            accumulate_into=None, b_e4m3=None, a_e4m3=None):
        assert a_e4m3 is None  # S(A24)^T in e4m3 needs the CUDA kernels
        return fp8_sparse.sparse_and_dense_mm_reference(buf, dense_rows, b_of(b, b_e4m3), transpose_result, out_dtype,
                                                        slots, accumulate_into)

    monkeypatch.setattr(fp8_sparse, "usable", lambda buf, b: True)
    monkeypatch.setattr(fp8_sparse, "sparse_mm", lambda buf, b, transpose_result=False, b_e4m3=None:
                        fp8_sparse.sparse_mm_reference(buf, b_of(b, b_e4m3), transpose_result))
    monkeypatch.setattr(fp8_sparse, "sparse_and_dense_mm", sparse_and_dense_mm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU machine the granted sm90 kernels would "
                    "launch on CPU tensors (the GPU test below covers the op there)")
def test_the_op_on_the_cpu_takes_the_pairs_bit_for_bit(monkeypatch):
    """The op's tensorwise kernel path on the CPU (cuSPARSELt stood in for, the dense float8 GEMMs on
    the CPU's _scaled_mm, the e4m3 2:4 GEMMs by their fp32 references, the sm90 conversions granted):
    Y, dX, dW1, dW2 bit for bit with and without X's and dY's pairs, and the forward keeps X's cast,
    not X."""
    from helpers import cpu_op_inputs, cpu_scaled_mm_runs
    from test_kernels import _cslt_stand_in
    if not cpu_scaled_mm_runs("tensorwise"):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run tensorwise")
    _cslt_stand_in(monkeypatch)
    _e4m3_sparse_stand_in(monkeypatch)
    monkeypatch.setattr(fp8_sparse, "available", lambda device: True)
    x, w1, w2, dy = cpu_op_inputs(128, 12)
    _check_paired_runs(_op_runs(monkeypatch, x, w1, w2, dy), x)
    # the forward's schema, fake and autograd with the cast among its outputs
    from helpers import forward_args
    import srelu24_kernels.srelu24.op as K
    o = OpOptions(SReLU24Recipe(token_permutation=False), "tensorwise", True)
    assert K.ffn_forward(*forward_args(x.detach(), w1.detach(), w2.detach(), False, o))[5].shape == (64, 128)
    torch.library.opcheck(K.ffn_forward, forward_args(x, w1, w2, False, o))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_the_op_with_x_and_dy_paired_is_bit_for_bit_the_one_by_one(monkeypatch, weights_dtype):
    """srelu24's tensorwise e4m3 op at the 1B FFN's width, fresh random inputs: Y, dX, dW1, dW2 the
    same bits whether X's and dY's conversions come from one pair each or each GEMM's own (the
    kernels' sm90 code, which the interpreter does not run); the forward keeps X's cast, not X."""
    from helpers import wide_op_inputs

    if not fp8_sparse.available("cuda"):
        pytest.skip("needs an sm90 GPU with cuSPARSELt's e4m3 kernels")
    x, w1, w2, dy = wide_op_inputs(17, weights_dtype)
    _check_paired_runs(_op_runs(monkeypatch, x, w1, w2, dy), x)
