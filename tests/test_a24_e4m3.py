"""S(A24)^T, dW2's 2:4 operand, written in e4m3 by the backward's pass from A24's column maxima that
the forward's sparsify pass takes (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu; op._fuses_a24_cast):
the maxima are the reference's, the e4m3 operand is the bytes and scales fp8_sparse.compressed_to_e4m3
makes of the bf16 one, the pass's other outputs do not change, and the whole op is bit for bit the
same with and without it. The kernels are CUDA C++ (GPU tests); bad arguments are refused anywhere."""
import pytest
import torch

from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.reference import SReLU24Recipe
from srelu24_kernels.srelu24.sparsify import column_amax_reference, srelu_sparsify_2to4
from srelu24_kernels.srelu24.sparsify_backward import a24_usable, backward_operands_from_a24, dense_slots

E4M3 = torch.float8_e4m3fn


def _needs_kernels():
    if not (torch.cuda.is_available() and a24_usable("cuda", 64) and fp8_sparse.available("cuda")):
        pytest.skip("needs an sm90 GPU, cuSPARSELt's e4m3 kernels and the CUDA kernels (make kernels)")


def _z(T: int, F_: int, seed: int) -> torch.Tensor:
    """Z with columns of very different magnitudes (A24 from about 2^-10 to 2^6 times a square of a
    normal sample), and a column that is never positive (its maximum 0)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, F_, generator=g) * torch.logspace(-5, 3, F_, base=2.0)[torch.randperm(F_, generator=g)]
    z[:, 3] = -z[:, 3].abs()
    return z.bfloat16().cuda()


def test_bad_arguments_are_refused_anywhere():
    z = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amax is the CUDA kernel's"):
        srelu_sparsify_2to4(z, amax=torch.zeros(64), backend="triton")
    with pytest.raises(ValueError, match="amax must be a contiguous float32"):
        srelu_sparsify_2to4(z, amax=torch.zeros(32))
    a24 = torch.zeros(64, 64 * 9 // 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a multiple of 64"):  # 32 tokens: no e4m3 layout
        backward_operands_from_a24(a24, torch.zeros(32, 64, dtype=torch.bfloat16), None, None, a_amax=torch.zeros(64))
    with pytest.raises(ValueError, match="a_amax must be a contiguous float32"):
        backward_operands_from_a24(a24, torch.zeros(64, 64, dtype=torch.bfloat16), None, None,
                                   a_amax=torch.zeros(64, dtype=torch.float64))


def test_the_references_take_an_operand_already_in_e4m3():
    """fp8_sparse's references (which GPU tests swap in for the e4m3 2:4 GEMMs) given compressed_to_e4m3's
    values and scales in place of the bf16 buffer compute the same product (and dense rows)."""
    from srelu24_kernels.cusparselt.layout import compress
    from srelu24_kernels.srelu24.reference import mask_2to4
    g = torch.Generator().manual_seed(3)
    m, k, n = 128, 128, 96
    a = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).bfloat16()
    buf = compress(a, mask_2to4(a))
    b = torch.randn(k, n, generator=g)
    a_e4m3 = fp8_sparse.compressed_to_e4m3(buf, m, k)
    for t in (False, True):
        want = fp8_sparse.sparse_mm_reference(buf, b, t)
        assert torch.equal(fp8_sparse.sparse_mm_reference(None, b, t, a_e4m3=a_e4m3), want)
    rows = torch.randn(5, k, generator=g).bfloat16()
    want = fp8_sparse.sparse_and_dense_mm_reference(buf, rows, b, True, torch.float32)
    got = fp8_sparse.sparse_and_dense_mm_reference(None, rows, b, True, torch.float32, a_e4m3=a_e4m3)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("T, F_", [(64, 64), (200, 256), (1024, 8448), (16384, 8448)])  # the last: 8 bands a block
def test_the_forward_takes_the_column_maxima_and_writes_the_same_a24(T, F_):
    _needs_kernels()
    z = _z(T, F_, T + F_)
    amax = torch.zeros(F_, dtype=torch.float32, device="cuda")
    buf, counts = srelu_sparsify_2to4(z, amax=amax)
    want = column_amax_reference(z)
    assert torch.equal(amax, want) and want[3] == 0 and (want > 0).sum() == F_ - 1
    buf0, counts0 = srelu_sparsify_2to4(z)
    assert torch.equal(buf.view(torch.int16), buf0.view(torch.int16)) and torch.equal(counts, counts0)


@pytest.mark.gpu
@pytest.mark.parametrize("T, F_", [(64, 64), (512, 256), (1024, 8448)])
@pytest.mark.parametrize("permuted, n_dense", [(False, 0), (True, 0), (True, 5)])
def test_the_backward_writes_s_a24_in_e4m3_as_compressed_to_e4m3_converts_it(T, F_, permuted, n_dense):
    _needs_kernels()
    torch.manual_seed(T * 7 + F_ + n_dense)
    z = _z(T, F_, T * 3 + F_)
    amax = torch.zeros(F_, dtype=torch.float32, device="cuda")
    a24, _ = srelu_sparsify_2to4(z, amax=amax)
    da = torch.randn(T, F_, device="cuda").bfloat16()
    perm = torch.randperm(T, device="cuda") if permuted else None
    dense = torch.randperm(F_, device="cuda")[:n_dense].sort().values if n_dense else None
    slots = dense_slots(dense, F_, "cuda")[0] if dense is not None else None
    dz, (a8, a_full), (g, g_full) = backward_operands_from_a24(a24, da, perm, dense, slots=slots, a_amax=amax)
    dz0, (a_bf16, a_full0), (g0, g_full0) = backward_operands_from_a24(a24, da, perm, dense, slots=slots)
    values, scale = a8
    want_values, want_scale = fp8_sparse.compressed_to_e4m3(a_bf16, F_, T)
    assert values.dtype == E4M3 and values.shape == want_values.shape == (F_, T * 5 // 8)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    for got, want in ((dz, dz0), (a_full, a_full0), (g, g0), (g_full, g_full0)):  # the rest as without
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if dense is not None:  # a dense feature's row of S(A24)^T is zeros, scaled as an all-zero row
        rows = values.reshape(-1).view(torch.uint8)[: F_ * T // 2].view(F_, T // 2)  # the values, then the metadata
        assert (rows[dense] == 0).all() and (scale[dense] == scale[3]).all()


def _op_runs(monkeypatch, x, w1, w2, dy, float8: str, recipe: SReLU24Recipe) -> dict:
    """The op's Y, dX, dW1, dW2 with S(A24)^T in e4m3 from the backward's pass (op._fuses_a24_cast as
    it decides) and without (converted from bf16), the compressed_to_e4m3 calls of each, and
    whether the forward saved A24's maxima (float32 [F])."""
    from helpers import kernel_ffn
    import srelu24_kernels.srelu24.op as K
    real_fuses, real_convert = K._fuses_a24_cast, fp8_sparse.compressed_to_e4m3
    runs = {}
    for fused in (True, False):
        calls = []
        monkeypatch.setattr(K, "_fuses_a24_cast", real_fuses if fused else lambda *a: False)
        monkeypatch.setattr(fp8_sparse, "compressed_to_e4m3", lambda *a: calls.append(a) or real_convert(*a))
        for t in (x, w1, w2):
            t.grad = None
        saved = []
        torch.manual_seed(5)  # the op's own token order, where it draws one
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = kernel_ffn(x, w1, w2, recipe, float8=float8)
        y.backward(dy)
        maxima = any(t.dtype == torch.float32 and t.shape == (w1.shape[0],) for t in saved)
        runs[fused] = ([y.detach().clone()] + [t.grad.clone() for t in (x, w1, w2)], len(calls), maxima)
    monkeypatch.setattr(K, "_fuses_a24_cast", real_fuses)
    monkeypatch.setattr(fp8_sparse, "compressed_to_e4m3", real_convert)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("float8, token_permutation", [("tensorwise", False), ("rowwise", False),
                                                       ("tensorwise", True)])
def test_the_op_is_bit_for_bit_the_same_with_s_a24_written_in_e4m3(monkeypatch, float8, token_permutation):
    """At the 1B FFN's width, fresh random inputs, fp32 weights, dense features on: the four results
    are the same bits; the fused run saves A24's maxima and converts one operand fewer."""
    _needs_kernels()
    torch.manual_seed(23)
    T, d, f = 1024, 2048, 8448
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(f, d, device="cuda") * d ** -0.5).requires_grad_()
    w2 = (torch.randn(d, f, device="cuda") * f ** -0.5).requires_grad_()
    dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    recipe = SReLU24Recipe(token_permutation=token_permutation)
    assert recipe.dense_feature_fraction > 0
    runs = _op_runs(monkeypatch, x, w1, w2, dy, float8, recipe)
    (fused, n_fused, kept_fused), (alone, n_alone, kept_alone) = runs[True], runs[False]
    for what, a, b in zip(("Y", "dX", "dW1", "dW2"), fused, alone):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    assert kept_fused and not kept_alone and n_fused == n_alone - 1


@pytest.mark.gpu
def test_no_fusion_where_it_cannot_apply():
    import srelu24_kernels.srelu24.op as K
    _needs_kernels()
    e4m3 = K.OpOptions(SReLU24Recipe(), "tensorwise", True)
    assert K._fuses_a24_cast(1024, 8448, e4m3, torch.device("cuda"), True, False)
    assert not K._fuses_a24_cast(1024, 8448, e4m3, torch.device("cuda"), False, False)  # Z kept: the Triton backward
    assert not K._fuses_a24_cast(1024, 8448, e4m3, torch.device("cuda"), True, True)   # a logged step
    assert not K._fuses_a24_cast(1000, 8448, e4m3, torch.device("cuda"), True, False)  # tokens not a multiple of 64
    assert not K._fuses_a24_cast(1024, 8448, K.OpOptions(SReLU24Recipe(), "tensorwise", False),
                                 torch.device("cuda"), True, False)                    # bf16 2:4 GEMMs
