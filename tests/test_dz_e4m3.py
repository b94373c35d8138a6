"""dZ's operand and S(dZ)^T, dX's and dW1's 2:4 operands, written in e4m3 by the backward's pass
from row maxima that a pass of loads takes first (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu;
op._writes_dz_e4m3): each is the bytes and scales fp8_sparse.compressed_to_e4m3 makes of the bf16
one, the pass's other outputs do not change, and the whole op is bit for bit the same with and
without it. The kernels are CUDA C++ (GPU tests); bad arguments are refused anywhere."""
import pytest
import torch

from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.reference import SReLU24Recipe
from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4
from srelu24_kernels.srelu24.sparsify_backward import a24_usable, backward_operands_from_a24, dense_slots

E4M3 = torch.float8_e4m3fn


def _needs_kernels():
    if not (torch.cuda.is_available() and a24_usable("cuda", 64) and fp8_sparse.available("cuda")):
        pytest.skip("needs an sm90 GPU, cuSPARSELt's e4m3 kernels and the CUDA kernels (make kernels)")


def test_tokens_not_a_multiple_of_64_are_refused_anywhere():
    a24 = torch.zeros(64, 64 * 9 // 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a multiple of 64"):  # 32 tokens: no e4m3 layout
        backward_operands_from_a24(a24, torch.zeros(32, 64, dtype=torch.bfloat16), None, None, dz_e4m3=True)


def _inputs(T: int, F_: int, seed: int):
    """(A24 with its column maxima, dA): Z's columns and dA's rows of very different magnitudes, so
    that the row scales of dZ (a token's) and of S(dZ)^T (a feature's) differ; one token whose dA is
    zero (its dZ row all zeros) and one feature never positive (its S(dZ)^T row all zeros)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, F_, generator=g) * torch.logspace(-5, 3, F_, base=2.0)[torch.randperm(F_, generator=g)]
    z[:, 3] = -z[:, 3].abs()
    da = torch.randn(T, F_, generator=g) * torch.logspace(-12, 4, T, base=2.0)[torch.randperm(T, generator=g)][:, None]
    da[1] = 0
    amax = torch.zeros(F_, dtype=torch.float32, device="cuda")
    a24, _ = srelu_sparsify_2to4(z.bfloat16().cuda(), amax=amax)
    return a24, amax, da.bfloat16().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("T, F_", [(64, 64), (512, 256), (1024, 8448), (4096, 8448)])
@pytest.mark.parametrize("permuted, n_dense", [(False, 0), (True, 0), (True, 5)])
@pytest.mark.parametrize("a_e4m3", [False, True])
def test_the_backward_writes_dz_in_e4m3_as_compressed_to_e4m3_converts_it(monkeypatch, T, F_, permuted, n_dense,
                                                                           a_e4m3):
    _needs_kernels()
    import srelu24_kernels.srelu24.sparsify_backward as SB
    real_empty = SB.empty_compressed
    # poisoned buffers (and inputs drawn anew for each case): a byte the pass fails to write cannot pass
    monkeypatch.setattr(SB, "empty_compressed", lambda n, dtype, device: real_empty(n, dtype, device).fill_(
        255 if dtype == torch.uint8 else float("nan")))
    torch.manual_seed(T * 7 + F_ + n_dense + 2 * a_e4m3)
    a24, amax, da = _inputs(T, F_, T * 3 + F_ + n_dense + 2 * a_e4m3)
    perm = torch.randperm(T, device="cuda") if permuted else None
    dense = torch.randperm(F_, device="cuda")[:n_dense].sort().values if n_dense else None
    slots = dense_slots(dense, F_, "cuda")[0] if dense is not None else None
    a_amax = amax if a_e4m3 else None
    dz8, a, (g8, g_full) = backward_operands_from_a24(a24, da, perm, dense, slots=slots, a_amax=a_amax, dz_e4m3=True)
    dz, a0, (g, g_full0) = backward_operands_from_a24(a24, da, perm, dense, slots=slots, a_amax=a_amax)
    for (values, scale), bf16, rows, cols in ((dz8, dz, T, F_), (g8, g, F_, T)):
        want_values, want_scale = fp8_sparse.compressed_to_e4m3(bf16, rows, cols)
        assert values.dtype == E4M3 and values.shape == want_values.shape == (rows, cols * 5 // 8)
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        assert len(scale.unique()) > 4  # the rows' scales differ: a per-row scale was tested
    floor = fp8_sparse.pow2_scale(torch.zeros(1, device="cuda"))
    assert dz8[1][perm.argsort()[1] if permuted else 1] == floor  # the token whose dA is zero
    assert g8[1][3] == floor  # the feature never positive
    if dense is not None:  # a dense feature's row of S(dZ)^T is zeros, scaled as an all-zero row
        assert (g8[1][dense] == floor).all()
    got_a, want_a = (a[0], a0[0]) if a_e4m3 else ((a[0],), (a0[0],))  # the rest as without (values, scales)
    for got, want in (*zip(got_a, want_a), (a[1], a0[1]), (g_full, g_full0)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _op_runs(monkeypatch, x, w1, w2, dy, float8: str, recipe: SReLU24Recipe) -> dict:
    """The op's Y, dX, dW1, dW2 with dZ and S(dZ)^T in e4m3 from the backward's pass (op._writes_dz_e4m3
    as it decides) and without (converted from bf16), and the compressed_to_e4m3 calls of each."""
    from helpers import kernel_ffn
    import srelu24_kernels.srelu24.op as K
    real_writes, real_convert = K._writes_dz_e4m3, fp8_sparse.compressed_to_e4m3
    runs = {}
    for fused in (True, False):
        calls = []
        monkeypatch.setattr(K, "_writes_dz_e4m3", real_writes if fused else lambda *a: False)
        monkeypatch.setattr(fp8_sparse, "compressed_to_e4m3", lambda *a: calls.append(a) or real_convert(*a))
        for t in (x, w1, w2):
            t.grad = None
        torch.manual_seed(5)  # the op's own token order, where it draws one
        y = kernel_ffn(x, w1, w2, recipe, float8=float8)
        y.backward(dy)
        runs[fused] = ([y.detach().clone()] + [t.grad.clone() for t in (x, w1, w2)], len(calls))
    monkeypatch.setattr(K, "_writes_dz_e4m3", real_writes)
    monkeypatch.setattr(fp8_sparse, "compressed_to_e4m3", real_convert)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("float8, token_permutation", [("tensorwise", False), ("rowwise", False),
                                                       ("tensorwise", True)])
def test_the_op_is_bit_for_bit_the_same_with_dz_written_in_e4m3(monkeypatch, float8, token_permutation):
    """At the 1B FFN's width, fresh random inputs, fp32 weights, dense features on: the four results
    are the same bits, and the run that writes dZ and S(dZ)^T in e4m3 converts two operands fewer."""
    _needs_kernels()
    torch.manual_seed(29)
    T, d, f = 1024, 2048, 8448
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(f, d, device="cuda") * d ** -0.5).requires_grad_()
    w2 = (torch.randn(d, f, device="cuda") * f ** -0.5).requires_grad_()
    dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    recipe = SReLU24Recipe(token_permutation=token_permutation)
    assert recipe.dense_feature_fraction > 0
    runs = _op_runs(monkeypatch, x, w1, w2, dy, float8, recipe)
    (fused, n_fused), (alone, n_alone) = runs[True], runs[False]
    for what, a, b in zip(("Y", "dX", "dW1", "dW2"), fused, alone):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    assert n_fused == n_alone - 2


@pytest.mark.gpu
def test_dz_is_written_in_e4m3_only_where_it_can_be():
    import srelu24_kernels.srelu24.op as K
    _needs_kernels()
    cuda = torch.device("cuda")
    e4m3 = K.OpOptions(SReLU24Recipe(), "tensorwise", True)
    assert K._writes_dz_e4m3(1024, 8448, e4m3, cuda, True)
    assert not K._writes_dz_e4m3(1024, 8448, e4m3, cuda, False)  # Z saved: the Triton backward
    assert not K._writes_dz_e4m3(1000, 8448, e4m3, cuda, True)   # tokens not a multiple of 64
    assert not K._writes_dz_e4m3(1024, 8448, K.OpOptions(SReLU24Recipe(), "tensorwise", False), cuda, True)  # bf16 GEMMs
