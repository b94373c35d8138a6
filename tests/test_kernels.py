"""The fused srelu + 2:4 sparsify kernel against its PyTorch reference (CPU: TRITON_INTERPRET,
small sizes), and the cuSPARSELt layout reference against its own inverse and the formula."""
import pytest
import torch
import torch.nn.functional as F

from srelu24_kernels.cusparselt.layout import compress, compressed_numel, decompress, nibble_index
from srelu24_kernels.cusparselt.layout import ROWS_PER_BAND, padded
from srelu24_kernels.srelu24.sparsify import activation_totals_reference, srelu_sparsify_2to4, srelu_sparsify_2to4_reference
from srelu24_kernels.srelu24.reference import mask_2to4
from srelu24_kernels.ffn_stats import ELEMENTS, N_SUMS
from srelu24_kernels.srelu24.options import OpOptions
from srelu24_kernels.srelu24.reference import SReLU24Recipe
from helpers import backward_args, forward_args, kernel_ffn, output_args


def padded_rows(m: int) -> int:  # a compressed operand's rows
    return padded(m, ROWS_PER_BAND)


def random_z(m: int, k: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, k, generator=g).bfloat16()
    z[: m // 3, : k // 4] -= 2.0                                   # sparse region: all-zero groups after relu
    z[m // 2, :8] = 1.0                                            # exact ties
    z[-1, 8:16] = torch.tensor([0.5, -0.5, 0.5, 0.25, 0.0, 0.0, 3.0, 3.0])
    return z.to(device)


def assert_token_operands_equal(got, want) -> None:
    """The two token-dimension operands of backward_operands (compressed buffer, dense rows), bit for bit."""
    for (buf, full), (want_buf, want_full) in zip(got[1:], want[1:]):
        assert torch.equal(buf.view(torch.int16), want_buf.view(torch.int16)) and torch.equal(full, want_full)


def assert_operands_equal(got, want) -> None:
    """All three operands of backward_operands (dZ's, then the token-dimension ones), bit for bit."""
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert_token_operands_equal(got, want)


def test_layout_round_trip_and_size():
    a = (torch.relu(torch.randn(128, 96)) ** 2).bfloat16()
    keep = mask_2to4(a)
    buf = compress(a, keep)
    assert buf.shape == (128, 96 * 9 // 16) and buf.numel() == compressed_numel(128, 96)
    assert torch.equal(decompress(buf, 128, 96), a * keep)


def test_each_64x32_tile_owns_512_consecutive_nibbles():
    k = 96
    r = torch.arange(128)[:, None].expand(128, k // 4)
    g = torch.arange(k // 4)[None, :].expand(128, k // 4)
    n = nibble_index(r, g, k)
    assert torch.equal(n.reshape(-1).sort().values, torch.arange(128 * k // 4))  # a permutation
    tile = (r // 64) * (k // 32) + g // 8
    assert torch.equal(n // 512, tile)


def test_layout_rejects_shapes_it_cannot_take():
    with pytest.raises(ValueError, match="rows % 64"):
        compress(torch.zeros(96, 32), torch.ones(96, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of 32"):
        srelu_sparsify_2to4(torch.zeros(64, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="totals need the counts"):
        srelu_sparsify_2to4(torch.zeros(64, 32, dtype=torch.bfloat16), counts=False, totals=torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("m,k,bands", [(64, 32, 1), (100, 96, 1), (192, 64, 2), (1, 32, 8), (640, 64, 8)])
def test_fused_kernel_equals_reference_bit_for_bit(m, k, bands):
    z = random_z(m, k, seed=m * 1000 + k)
    buf, counts = srelu_sparsify_2to4(z, bands=bands)
    ref, ref_counts = srelu_sparsify_2to4_reference(z)
    assert buf.shape == ref.shape == (padded_rows(m), 9 * k // 16)
    assert torch.equal(buf.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(counts, ref_counts)


@pytest.mark.parametrize("m,k,bands", [(100, 96, 1), (640, 64, 8)])
def test_fused_kernel_totals_for_the_statistics(m, k, bands):
    """On logged steps the same pass reduces what srelu24_kernels/ffn_stats.py needs; the row built from it
    equals the one the statistics compute from the activation itself."""
    from srelu24_kernels.ffn_stats import srelu24_sums, srelu24_sums_from_counts

    z = random_z(m, k, seed=m + k)
    totals = torch.zeros(3, dtype=torch.float64)
    buf, counts = srelu_sparsify_2to4(z, bands=bands, totals=totals)
    ref_buf, ref_counts = srelu_sparsify_2to4_reference(z)
    assert torch.equal(buf.view(torch.int16), ref_buf.view(torch.int16)) and torch.equal(counts, ref_counts)
    want = activation_totals_reference(z)
    assert totals[0] == want[0] > 0                                   # non-zeros: exact
    assert torch.allclose(totals[1:], want[1:], rtol=1e-5) and want[2] > 0
    row = srelu24_sums_from_counts(counts, totals, m, 0.05)
    ref_row = srelu24_sums(F.relu(z).square(), None, 0.05, sparse=True)
    assert torch.allclose(row, ref_row, rtol=1e-5), (row, ref_row)


def test_reference_keeps_the_2_largest_activations():
    z = random_z(64, 64, seed=7)
    buf, counts = srelu_sparsify_2to4_reference(z)
    a = F.relu(z).square()
    a24 = decompress(buf, 64, 64)
    assert torch.equal(a24, a * mask_2to4(a))
    assert ((a24.reshape(64, 16, 4) != 0).sum(-1) <= 2).all()
    assert torch.equal(counts, (a24 != 0).sum(0, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(96, 192), (2048, 8192), (4000, 4128)])
def test_fused_kernel_feeds_cusparselt(m, k):
    """On CUDA: same bytes as the reference, and torch._cslt_sparse_mm on the buffer computes A24 @ B."""
    z = random_z(m, k, seed=m, device="cuda")
    totals = torch.zeros(3, dtype=torch.float64, device="cuda")
    buf, counts = srelu_sparsify_2to4(z, totals=totals)
    want = activation_totals_reference(z)
    assert totals[0] == want[0] and torch.allclose(totals[1:], want[1:], rtol=1e-5)  # float64 atomics on the GPU
    ref, ref_counts = srelu_sparsify_2to4_reference(z)
    assert torch.equal(buf.view(torch.int16), ref.view(torch.int16)) and torch.equal(counts, ref_counts)
    b = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    y = torch._cslt_sparse_mm(buf, b.t()).float()
    want = decompress(ref, padded_rows(m), k).float() @ b.float().t()
    assert ((y - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("recipe", [(True, 0.05, True), (False, 0.0, True), (True, 0.1, False)])
def test_kernel_ffn_equals_the_reference(monkeypatch, recipe):
    """The whole kernel FFN (forward and the three gradients) against srelu24_kernels.srelu24.reference.
    On CPU, cuSPARSELt's product is stood in for by decompress + matmul, so this checks every
    kernel and the plumbing around the GEMMs; the GPU test below uses the real one."""
    from srelu24_kernels.srelu24.reference import SReLU24Recipe, srelu24_ffn

    _cslt_stand_in(monkeypatch)
    r = SReLU24Recipe(*recipe)
    g = torch.Generator().manual_seed(sum(map(hash, recipe)) % 1000)
    x = torch.randn(100, 64, generator=g).bfloat16()
    w1, w2 = torch.randn(64, 64, generator=g) / 8, torch.randn(64, 64, generator=g) / 8
    dy = torch.randn(100, 64, generator=g).bfloat16()
    outs, stats = [], []
    for fn in (srelu24_ffn, kernel_ffn):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        stats.append(torch.zeros(N_SUMS, dtype=torch.float64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xx, a, b, r, stats[-1])
        torch.manual_seed(3)  # the same token permutation for both
        y.backward(dy)
        outs.append([y.float(), xx.grad.float(), a.grad, b.grad])
    for got, want in zip(outs[1], outs[0]):
        assert ((got - want).norm() / want.norm()).item() < 1e-3
    assert stats[0][ELEMENTS] > 0 and torch.allclose(stats[1], stats[0], rtol=1e-4)  # statistics agree


def _cslt_stand_in(monkeypatch):
    """torch._cslt_sparse_mm on CPU: decompress + matmul (transpose_result as torch's: (A B)^T)."""
    def cslt_stand_in(buf, b, transpose_result=False, **kw):
        if buf.dtype != b.dtype:  # as torch's op: one dtype (an fp32 weight must be cast before)
            raise RuntimeError(f"_cslt_sparse_mm stand-in: compressed {buf.dtype} against dense {b.dtype}")
        y = (decompress(buf, buf.shape[0], b.shape[0]).float() @ b.float()).to(torch.bfloat16)
        return y.t().contiguous() if transpose_result else y

    monkeypatch.setattr(torch, "_cslt_sparse_mm", cslt_stand_in, raising=False)


def test_kernel_ops_pass_torch_library_opcheck(monkeypatch):
    """Schema, fake (meta) versions, autograd registration and AOT dispatch of the three ops."""
    import srelu24_kernels.srelu24.op as K

    _cslt_stand_in(monkeypatch)
    g = torch.Generator().manual_seed(5)  # 40 tokens: a partial band; 64 features: two column tiles
    x = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(64, 32, generator=g) / 6).bfloat16().requires_grad_()
    w2 = (torch.randn(32, 64, generator=g) / 8).bfloat16().requires_grad_()
    o = K.OpOptions(SReLU24Recipe(False, 0.05, True))  # no token permutation here: opcheck replays the backward
    for stats in (False, True):
        torch.library.opcheck(K.ffn_forward, forward_args(x, w1, w2, stats, o))
    out = K.ffn_forward(*forward_args(x, w1, w2, False, o))  # A24 and h wanting gradients, as ffn_output gets them
    torch.library.opcheck(K.ffn_output, output_args(out, w2, o))
    dy = torch.randn(out[1].shape, generator=g).bfloat16()
    torch.library.opcheck(K.ffn_backward, backward_args(dy, x.detach(), w1.detach(), w2.detach(), out, o))


def test_kernel_ffn_compiles_without_a_graph_break(monkeypatch):
    """fullgraph=True fails on any graph break; forward and gradients equal eager's."""
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    _cslt_stand_in(monkeypatch)
    r = SReLU24Recipe(True, 0.05, True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 50, 64, generator=g)
    w1, w2 = torch.randn(64, 64, generator=g) / 8, torch.randn(64, 64, generator=g) / 8

    def step(fn):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        stats = torch.zeros(N_SUMS, dtype=torch.float64)
        y = fn(xx, a, b, stats)
        torch.manual_seed(3)  # the same token permutation in both backwards
        (y.float().square().mean()).backward()
        return [y.float(), xx.grad, a.grad, b.grad, stats]

    def ffn(xx, a, b, stats):
        return kernel_ffn(xx, a, b, r, stats)

    torch._dynamo.reset()
    want = step(ffn)
    got = step(torch.compile(ffn, backend="aot_eager", fullgraph=True))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert want[2].dtype == torch.float32 and want[4][ELEMENTS] == 100 * 64  # fp32 grads, stats collected


def test_srelu24_module_on_the_kernel_path_compiles_in_one_graph(monkeypatch):
    """The model's FFN module as the trainer compiles it on a GPU (kernel path forced on CPU)."""
    import model.ffn as ffn
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    _cslt_stand_in(monkeypatch)
    monkeypatch.setattr(ffn, "kernels_available", lambda x: True)
    torch.manual_seed(0)
    m = ffn.SReLU24(64, 64, OpOptions(SReLU24Recipe(False, 0.05, True)))
    m.sparse = m.collect_stats = True
    x = torch.randn(2, 32, 64)
    torch._dynamo.reset()
    want = m(x)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    assert torch.allclose(got.float(), want.float()) and m.stats[ELEMENTS] == 2 * 64 * 64  # stats: both calls
    # training steps as the trainer runs them: statistics on some steps, read and zeroed after
    for collect in (True, False, True, True):
        m.collect_stats = collect
        compiled(x.clone().requires_grad_()).float().sum().backward()
        m.stats.zero_()
    assert not m.stats.requires_grad  # the buffer never joins the autograd graph


@pytest.mark.parametrize("t,f", [(32, 64), (100, 128), (80, 192), (130, 64)])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("reuse", [True, False])
def test_backward_operands_in_one_pass_equal_reference(t, f, permuted, reuse):
    """The one-pass backward kernel writes dZ (feature-dim, permuted rows), S(A24)^T and S(dZ)^T
    bit for bit as the references do, including token counts not a multiple of 32 or 64 (80:
    dZ's rows pad to 128 but the token operands to 96)."""
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, backward_operands_reference

    z, da = random_z(t, f, seed=t + 3 * f), random_z(t, f, seed=t * f + 1).flip(0).contiguous()
    g = torch.Generator().manual_seed(f + t)
    perm = torch.randperm(t, generator=g) if permuted else None
    dense = torch.tensor([f - 3, 2, 5]) if permuted or f == 64 else None  # unsorted, as the counts' sort gives
    got = backward_operands(z, da, perm, dense, reuse_forward_mask=reuse)
    want = backward_operands_reference(z, da, perm, dense, reuse_forward_mask=reuse)
    if reuse:
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    else:
        assert got[0] is None and want[0] is None
    assert_token_operands_equal(got, want)


def test_every_compressed_operand_has_spare_bytes_after_it():
    """cuSPARSELt may read metadata past a compressed operand's end (COMPRESSED_TAIL_BYTES): the
    forward's A24, the backward's three operands and their e4m3 conversion each have that many
    bytes of their own storage after them."""
    from srelu24_kernels.cusparselt.layout import COMPRESSED_TAIL_BYTES
    from srelu24_kernels.float8.sparse import compressed_to_e4m3
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands

    def spare(t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes() - (t.storage_offset() + t.numel()) * t.element_size()

    z, da = random_z(100, 64, seed=21), random_z(100, 64, seed=22)
    a24, _ = srelu_sparsify_2to4(z)
    dz, (at, _), (dzt, _) = backward_operands(z, da, None, torch.tensor([3]))
    a8, _ = compressed_to_e4m3(a24, padded_rows(100), 64)
    for t in (a24, dz, at, dzt, a8):
        assert t.is_contiguous() and spare(t) >= COMPRESSED_TAIL_BYTES


@pytest.mark.parametrize("bands", [2, 4])
def test_backward_operands_with_several_bands_per_program(bands):
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, backward_operands_reference

    z, da = random_z(96, 128, seed=5), random_z(96, 128, seed=6)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(7))
    dense = torch.tensor([100, 3, 77])
    got = backward_operands(z, da, perm, dense, bands=bands)
    want = backward_operands_reference(z, da, perm, dense)
    assert_operands_equal(got, want)


def test_dz_operand_keeps_the_forward_positions():
    """Without a permutation, the backward's dZ operand names the positions the forward kept:
    its metadata is the forward kernel's, word for word."""
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, dz_sparsify_2to4_reference

    z, da = random_z(100, 128, seed=11), random_z(100, 128, seed=12)
    got, _, _ = backward_operands(z, da, None, None)
    assert torch.equal(got.view(torch.int16), dz_sparsify_2to4_reference(z, da).view(torch.int16))
    fwd, _ = srelu_sparsify_2to4(z)
    n = padded_rows(100) * 128 // 2  # values first: [rows, F/2]
    assert torch.equal(got.reshape(-1)[n:].view(torch.int16), fwd.reshape(-1)[n:].view(torch.int16))


@pytest.mark.gpu
def test_kernel_ffn_on_cuda_matches_the_reference():
    """cuSPARSELt for real: output and gradients of the kernel FFN against the PyTorch reference."""
    from srelu24_kernels.srelu24.reference import SReLU24Recipe, srelu24_ffn

    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    w1, w2 = torch.randn(1024, 256, device="cuda") / 16, torch.randn(256, 1024, device="cuda") / 32
    dy = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (srelu24_ffn, kernel_ffn):
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xx, a, b, SReLU24Recipe())
        torch.manual_seed(3)
        y.backward(dy)
        outs.append([y.float(), xx.grad.float(), a.grad, b.grad])
    for got, want in zip(outs[1], outs[0]):
        assert ((got - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.gpu
def test_srelu24_module_compiled_by_inductor_on_cuda():
    """The trainer's compiled path on a GPU: inductor around the custom ops, logged and unlogged
    steps with backward, against eager (same token permutations)."""
    from model.ffn import SReLU24
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    torch.manual_seed(0)
    m = SReLU24(256, 1024, OpOptions(SReLU24Recipe())).cuda()
    m.sparse = True
    compiled = torch.compile(m)
    x = torch.randn(4, 250, 256, device="cuda")
    for collect in (True, False, True):
        results = []
        for fn in (m, compiled):
            m.collect_stats = collect
            m.w1.weight.grad = m.w2.weight.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            torch.manual_seed(3)
            y.float().square().mean().backward()
            results.append([y.float(), m.w1.weight.grad, m.w2.weight.grad, m.stats.clone()])
            m.stats.zero_()
        for got, want in zip(results[1], results[0]):
            assert ((got - want).norm() / want.norm().clamp(min=1e-12)).item() < 1e-2
    assert not m.stats.requires_grad


def _cuda_kernel_built() -> bool:
    from srelu24_kernels.srelu24.native import KERNELS
    return torch.cuda.is_available() and KERNELS.available(None, (8, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_kernel_built(), reason="needs `make kernels` (build/srelu24_kernels.so) and an sm80/sm90 GPU"))])
@pytest.mark.parametrize("t,f,n_dense,permuted", [(4000, 1024, 3, True), (100, 128, 0, False), (80, 192, 5, True),
                                                  (4096, 2048, 100, True), (1000, 64, 64, True), (33, 256, 1, True)])
def test_backward_operands_on_cuda_equal_reference(backend, t, f, n_dense, permuted):
    """The one-pass backward kernels on the GPU (Triton, and the CUDA C++ one when built), bit for
    bit against the reference, on fresh random inputs: token counts off the 32/64 tiles, no, some
    and all features dense, with and without the permutation."""
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, backward_operands_reference

    z, da = random_z(t, f, seed=t + f, device="cuda"), random_z(t, f, seed=t * f, device="cuda").flip(0).contiguous()
    z[t // 2:, f // 2:] = -z[t // 2:, f // 2:]
    perm = torch.randperm(t, device="cuda") if permuted else None
    dense = torch.randperm(f, device="cuda")[:n_dense] if n_dense else None
    got = backward_operands(z, da, perm, dense, backend=backend)
    want = backward_operands_reference(z, da, perm, dense)
    assert_operands_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_kernel_built(), reason="needs `make kernels` (build/srelu24_kernels.so) and an sm80/sm90 GPU")
@pytest.mark.parametrize("t,f,n_dense,permuted", [(4000, 1024, 3, True), (100, 128, 0, False), (80, 192, 5, True),
                                                  (4096, 2048, 100, True), (1000, 64, 64, True), (33, 256, 1, True)])
def test_backward_operands_from_a24_equal_reference(t, f, n_dense, permuted):
    """The backward pass reading the forward's compressed A24 (what the FFN keeps) instead of Z:
    bit for bit the reference over Z, on fresh random inputs with zeros, ties and all-zero groups,
    token counts off the tiles, strided dA rows in one case."""
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands_from_a24, backward_operands_reference

    z = random_z(t, f, seed=t + f + 1, device="cuda")
    z[t // 2:, f // 2:] = -z[t // 2:, f // 2:]
    wide = random_z(t, f + 64, seed=t * f + 1, device="cuda")
    da = wide[:, 64:] if t == 80 else wide[:, :f].contiguous()
    perm = torch.randperm(t, device="cuda") if permuted else None
    dense = torch.randperm(f, device="cuda")[:n_dense] if n_dense else None
    a24 = srelu_sparsify_2to4(z)[0]
    got = backward_operands_from_a24(a24, da, perm, dense)
    want = backward_operands_reference(z, da, perm, dense)
    assert_operands_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_kernel_built(), reason="needs `make kernels` and an sm80/sm90 GPU")
def test_kernel_ffn_keeps_compressed_a24_for_its_backward():
    """With the CUDA kernels the forward op hands autograd A24 (9/16 of Z's bytes), not Z."""
    import srelu24_kernels.srelu24.op as K

    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16) / 16
    w2 = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16) / 32
    saved, _, z, *_ = K.ffn_forward(*forward_args(x, w1, w2, False, K.OpOptions(SReLU24Recipe(True, 0.05, True))))
    want = srelu_sparsify_2to4(x @ w1.t())[0]
    assert saved.shape == (padded_rows(1000), 1024 * 9 // 16) and torch.equal(saved.view(torch.int16),
                                                                             want.view(torch.int16))
    assert z.numel() == 0
    _, _, z, *_ = K.ffn_forward(*forward_args(x, w1, w2, False, K.OpOptions(SReLU24Recipe(True, 0.05, False))))  # the ablation's backward reads Z
    assert z.shape == (1000, 1024)


def test_the_forward_op_keeps_what_its_caller_asks_and_refuses_a24_it_cannot_make():
    """keep_a24 is the op's argument, so it is a constant of a compiled graph (and of Inductor's
    cache key): the fake returns Z (the backward's operand then) only where it is off, and the real
    op refuses A24 where the CUDA kernels cannot make it, in one line, instead of handing back Z in
    its place."""
    import srelu24_kernels.srelu24.op as K

    T, d, F_ = 100, 64, 128
    o = OpOptions(SReLU24Recipe(True, 0.05, True))
    meta = (torch.empty(T, d, dtype=torch.bfloat16, device="meta"), torch.empty(F_, d, dtype=torch.bfloat16, device="meta"),
            torch.empty(d, F_, dtype=torch.bfloat16, device="meta"))
    for keep, z_shape in ((True, (0,)), (False, (T, F_))):  # A24 always (ffn_output's A), Z where it is kept
        args = list(forward_args(*meta, False, o))
        args[8] = keep
        a24, _, z, *_ = K.ffn_forward(*args)
        assert a24.shape == (padded(T, ROWS_PER_BAND), F_ * 9 // 16) and z.shape == z_shape
    x, w1, w2 = torch.randn(T, d, dtype=torch.bfloat16), torch.randn(F_, d, dtype=torch.bfloat16), torch.randn(d, F_, dtype=torch.bfloat16)
    args = list(forward_args(x, w1, w2, False, o))
    assert args[8] is False  # no CUDA kernels on the CPU
    args[8] = True
    with pytest.raises(ValueError, match="asked to keep A24"):
        K.ffn_forward(*args)


def test_relu_comes_back_exactly_from_the_rounded_square():
    """What the backward over A24 relies on (srelu24_kernels/srelu24/csrc/srelu24_sparsify.cu, relu_from_a24): for every
    bf16 z whose square is a normal bf16, bf16(sqrt(bf16(z^2))) == z, and sqrt(a) stays far enough
    (> 2^-11 relative) from a rounding boundary that an approximate sqrt (error ~2^-22) rounds the same."""
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32).to(torch.int16)  # every positive normal bf16
    z = bits.view(torch.bfloat16)
    a = (z.float() * z.float()).to(torch.bfloat16)
    normal = torch.isfinite(a.float()) & (a.float() >= torch.finfo(torch.float32).tiny)
    assert normal.sum() > 16000
    z, a = z[normal], a[normal]
    assert torch.equal(torch.sqrt(a.float()).to(torch.bfloat16), z)
    s, zi = torch.sqrt(a.double()), z.view(torch.int16).int()
    up = (zi + 1).to(torch.int16).view(torch.bfloat16).double()
    down = (zi - 1).to(torch.int16).view(torch.bfloat16).double()
    margin = torch.minimum((z.double() + up) / 2 - s, s - (z.double() + down) / 2) / s
    assert margin.min().item() > 2 ** -11


def test_backward_operands_from_a24_names_what_it_needs():
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands_from_a24

    da = random_z(100, 128, seed=2)
    with pytest.raises(ValueError, match=r"needs A24 as srelu_sparsify_2to4 writes it for dA's 100 tokens: "
                                         r"bf16 \[128, 72\], contiguous; got torch.bfloat16 \(100, 128\)"):
        backward_operands_from_a24(da, da, None, None)
    with pytest.raises(ValueError, match="make kernels.*backward_operands\\(z, ...\\) runs anywhere"):
        backward_operands_from_a24(torch.zeros(128, 72, dtype=torch.bfloat16), da, None, None)  # on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_kernel_built(), reason="needs `make kernels` and an sm80/sm90 GPU")
def test_backward_operands_cuda_kernel_reads_strided_rows():
    """Z and dA as row slices of wider buffers (row strides that are not the feature count)."""
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, backward_operands_reference

    wide = random_z(500, 384, seed=9, device="cuda")
    z, da = wide[:, :256], random_z(500, 320, seed=10, device="cuda")[:, 64:]
    perm = torch.randperm(500, device="cuda")
    dense = torch.tensor([7, 100], device="cuda")
    got = backward_operands(z, da, perm, dense, backend="cuda")
    want = backward_operands_reference(z, da, perm, dense)
    assert_operands_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_kernel_built(), reason="needs `make kernels` and an sm80/sm90 GPU")
@pytest.mark.parametrize("m,k,shift", [(64, 64, 0.0), (100, 128, 1.0), (4000, 1024, 0.5), (16384, 4096, 1.5),
                                       (1000, 16512, 0.0), (33, 192, 2.0)])
def test_sparsify_cuda_kernel_equals_reference(m, k, shift):
    """The forward's CUDA kernel: compressed A24 (padding rows included) and counts, bit for bit,
    on fresh random inputs; strided rows too."""
    z = random_z(m, k, seed=m + k, device="cuda") - shift
    buf, counts = srelu_sparsify_2to4(z, backend="cuda")
    want, want_counts = srelu_sparsify_2to4_reference(z)
    assert torch.equal(buf.view(torch.int16), want.view(torch.int16)) and torch.equal(counts, want_counts)
    wide = torch.cat([z, z[:, :64]], 1)[:, :k]  # row stride k + 64
    buf, counts = srelu_sparsify_2to4(wide, backend="cuda")
    assert torch.equal(buf.view(torch.int16), want.view(torch.int16)) and torch.equal(counts, want_counts)


def test_sparsify_backend_errors_name_the_choices(monkeypatch, tmp_path):
    from srelu24_kernels.srelu24.native import KERNELS

    z = random_z(32, 64, seed=1)
    with pytest.raises(ValueError, match="one of auto, triton, cuda"):
        srelu_sparsify_2to4(z, backend="tilelang")
    monkeypatch.setenv("SRELU24_KERNELS_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(KERNELS, "loaded", [])
    with pytest.raises(ValueError, match="make kernels"):
        srelu_sparsify_2to4(z, backend="cuda")


def test_backward_operands_backend_errors_name_the_choices(monkeypatch, tmp_path):
    from srelu24_kernels.srelu24.native import KERNELS
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands

    z = random_z(32, 64, seed=1)
    with pytest.raises(ValueError, match="one of auto, triton, cuda"):
        backward_operands(z, z, None, None, backend="cublas")
    with pytest.raises(ValueError, match="same shape, dtype and device"):
        backward_operands(z, z.float(), None, None)  # the CUDA kernel would read fp32 as bf16
    monkeypatch.setenv("SRELU24_KERNELS_LIB", str(tmp_path / "missing.so"))
    monkeypatch.setattr(KERNELS, "loaded", [])
    with pytest.raises(ValueError, match="make kernels"):
        backward_operands(z, z, None, None, backend="cuda")  # a CPU tensor, and no library


@pytest.mark.parametrize("k,d,f", [(0, 64, 96), (5, 64, 96), (40, 200, 320), (3, 16, 1000)])
def test_dense_rows_and_columns_equal_indexed_assignment(k, d, f):
    """dW1's rows and dW2's columns of the dense features (k not a multiple of the block, d not a
    multiple of 32, F not of 128); every other element keeps its value; inputs that do not agree,
    and strided indices, are refused by name."""
    from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_columns, write_dense_rows

    g = torch.Generator().manual_seed(k + d)
    dw1, dw2 = torch.randn(f, d, generator=g).bfloat16(), torch.randn(d, f, generator=g).bfloat16()
    dense = torch.randperm(f, generator=g)[:k]
    g1, g2 = torch.randn(k, d, generator=g).bfloat16(), torch.randn(k, d, generator=g).bfloat16()
    want1, want2 = dw1.clone(), dw2.clone()
    want1[dense] = g1
    want2[:, dense] = g2.t()
    slots, n = dense_slots(dense if k else None, f, "cpu")
    write_dense_rows(dw1, dense, g1)
    write_dense_columns(dw2, slots, g2)
    assert n == k and torch.equal(dw1, want1) and torch.equal(dw2, want2)
    with pytest.raises(ValueError, match="do not agree"):
        write_dense_columns(dw2.t().contiguous(), slots, g2)  # d != f in every case
    with pytest.raises(ValueError, match="do not agree"):
        write_dense_rows(dw1, dense, g1[:, :-1].contiguous())
    with pytest.raises(ValueError, match="int32 slots"):
        write_dense_columns(dw2, slots.long(), g2)
    with pytest.raises(ValueError, match="the index: torch.int32 on cpu, strided"):
        write_dense_columns(dw2, torch.stack([slots, slots], 1)[:, 0], g2)


@pytest.mark.parametrize("k,d,f", [(5, 64, 96), (40, 200, 320)])
def test_dense_rows_and_columns_write_bf16_gradients_into_fp32_ones_exactly(k, d, f):
    """An fp32 weight's gradient (srelu24's e4m3 mode) gets the dense features' bf16 products
    widened: the same values as the bf16 writes, .float(); other dtype pairs are refused."""
    from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_columns, write_dense_rows

    g = torch.Generator().manual_seed(k * d)
    dw1, dw2 = torch.randn(f, d, generator=g).bfloat16(), torch.randn(d, f, generator=g).bfloat16()
    dense = torch.randperm(f, generator=g)[:k]
    g1, g2 = torch.randn(k, d, generator=g).bfloat16(), torch.randn(k, d, generator=g).bfloat16()
    slots, _ = dense_slots(dense, f, "cpu")
    dw1_32, dw2_32 = dw1.float(), dw2.float()
    write_dense_rows(dw1, dense, g1)
    write_dense_columns(dw2, slots, g2)
    write_dense_rows(dw1_32, dense, g1)
    write_dense_columns(dw2_32, slots, g2)
    assert dw1_32.dtype == torch.float32 and torch.equal(dw1_32, dw1.float()) and torch.equal(dw2_32, dw2.float())
    with pytest.raises(ValueError, match="gradients of one dtype"):
        write_dense_rows(dw1, dense, g1.float())  # fp32 into bf16 would round


def test_backward_operands_refuses_slots_that_are_not_dense_slots():
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, dense_slots

    z = torch.randn(40, 128).bfloat16()
    dense = torch.tensor([3, 70])
    slots, _ = dense_slots(dense, 128, "cpu")
    with pytest.raises(ValueError, match="slots must be dense_slots"):
        backward_operands(z, z, None, None, slots=slots)  # no dense: k would be 0
    with pytest.raises(ValueError, match="slots must be dense_slots"):
        backward_operands(z, z, None, dense, slots=slots.long())


def test_kernel_ffn_backward_fills_no_zero_gradient_for_z(monkeypatch):
    """Only Y carries a gradient: autograd must not materialise a [T, F] zero gradient for the
    op's Z output before the backward (a memset of the whole activation on every step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    _cslt_stand_in(monkeypatch)
    g = torch.Generator().manual_seed(2)
    T, d, f = 100, 64, 64
    x = torch.randn(T, d, generator=g).bfloat16().requires_grad_()
    w1 = (torch.randn(f, d, generator=g) / 8).bfloat16().requires_grad_()
    w2 = (torch.randn(d, f, generator=g) / 11).bfloat16().requires_grad_()
    fills = []

    class RecordZeroFills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full",
                                               "full_like") and isinstance(out, torch.Tensor) \
                    and tuple(out.shape) == (T, f):
                fills.append(func.__name__)
            return out

    y = kernel_ffn(x, w1, w2, SReLU24Recipe(True, 0.05, True))
    with RecordZeroFills():
        y.float().square().sum().backward()
    assert fills == [] and x.grad is not None and w1.grad is not None and w2.grad is not None
