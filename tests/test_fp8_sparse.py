"""srelu24's e4m3 2:4 GEMMs (srelu24_kernels/float8/sparse.py): the Triton conversion kernels against their
PyTorch references bit for bit (CPU: TRITON_INTERPRET), the power-of-2 scales, and on a GPU the
e4m3 product against its fp32 reference and the FFN's gradients against bf16."""
import pytest
import torch

from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.cusparselt.layout import compress, compress_e4m3, decompress_e4m3, e4m3_metadata
from srelu24_kernels.srelu24.reference import mask_2to4

E4M3 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sparse_bf16(m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 2:4 bf16 [m, k] with rows of very different magnitudes, its mask)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    a[0] = 0.0  # an all-zero row (token padding)
    a[1, :8] = torch.tensor([448.0, -440.0, 1e-4, 0.0, 3e-3, -0.0155, 0.0157, 2.0])  # the row's amax, subnormals
    a = a.bfloat16()
    keep = mask_2to4(a.float())
    return a * keep, keep


@pytest.mark.parametrize("amax", [448.0, 449.0, 1.0, 1.75, 1.7500001, 3e-3, 0.0, 1e30])
def test_pow2_scale_is_the_largest_power_of_2_that_fits(amax):
    s = fp8_sparse.pow2_scale(torch.tensor([amax])).item()
    a = max(amax, fp8_sparse.AMAX_FLOOR)
    assert s == 2.0 ** round(torch.log2(torch.tensor(s)).item())  # a power of 2
    assert a * s <= 448.0 < a * s * 2


def test_rows_to_e4m3_matches_its_reference_bit_for_bit():
    a, _ = sparse_bf16(64, 320, 0)
    got, s = fp8_sparse.rows_to_e4m3(a.to(DEV))
    want, s_ref = fp8_sparse.rows_to_e4m3_reference(a)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_a_nan_makes_its_row_nan_and_leaves_the_others():
    a, _ = sparse_bf16(64, 128, 5)
    a[3, 7] = float("nan")
    a[4, 9] = float("inf")
    got, s = fp8_sparse.rows_to_e4m3(a.to(DEV))
    want, s_ref = fp8_sparse.rows_to_e4m3_reference(a)
    got, s = got.cpu(), s.cpu()
    assert s[3].isnan() and s[4].isnan() and s_ref[3].isnan() and s_ref[4].isnan()
    assert got[3:5].float().isnan().all()
    rest = torch.cat([torch.arange(3), torch.arange(5, 64)])
    assert torch.equal(s[rest], s_ref[rest]) and torch.equal(got[rest].view(torch.uint8), want[rest].view(torch.uint8))


def test_rounding_to_e4m3_ties_go_to_even():
    # values halfway between e4m3 neighbours (normal and subnormal), times scale 1 (row amax 448)
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 0.0029296875, 0.0048828125, 0.015380859375, 240.0]])
    got, s = fp8_sparse.rows_to_e4m3(x.bfloat16().to(DEV))
    assert s.item() == 1.0
    assert torch.equal(got.cpu().view(torch.uint8), x.to(E4M3).view(torch.uint8))


def test_a_huge_finite_row_gets_a_finite_scale():
    # bf16's largest finite values (up to 3.39e38) are finite amaxes, as pow2_scale has them
    a, _ = sparse_bf16(64, 128, 6)
    a[2, 5], a[3, 0] = 3.2e38, -3.3e38
    got, s = fp8_sparse.rows_to_e4m3(a.to(DEV))
    want, s_ref = fp8_sparse.rows_to_e4m3_reference(a)
    assert s_ref[2:4].isfinite().all()
    assert torch.equal(s.cpu(), s_ref) and torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


# 64 x 64 is one 512-byte metadata block; 6 and 9 blocks are no multiples of 4 or 8 blocks a program
# (the interpreter's time goes by programs: one a row, and one per BLOCKS metadata blocks)
@pytest.mark.parametrize("blocks", [1, 2, 8])
@pytest.mark.parametrize("m, k", [(64, 64), (128, 192), (64, 576)])
def test_compressed_to_e4m3_is_the_e4m3_compression_of_the_scaled_matrix(m, k, blocks, monkeypatch):
    monkeypatch.setattr(fp8_sparse, "METADATA_BLOCKS", blocks)
    a, keep = sparse_bf16(m, k, 1)
    buf8, s = fp8_sparse.compressed_to_e4m3(compress(a, keep).to(DEV), m, k)
    a8, s_ref = fp8_sparse.rows_to_e4m3_reference(a)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(buf8.cpu().view(torch.uint8), compress_e4m3(a8, keep))
    assert torch.equal(decompress_e4m3(buf8.cpu(), m, k).float(), a8.float())


@pytest.mark.parametrize("blocks", [1, 2, 8])
@pytest.mark.parametrize("m, k", [(64, 64), (64, 1344), (128, 512)])  # 1, 21 and 16 blocks
def test_the_metadata_conversion_is_e4m3_metadata_on_any_words(m, k, blocks, monkeypatch):
    """Every nibble, not only the six 2:4 patterns: random words behind random values."""
    monkeypatch.setattr(fp8_sparse, "METADATA_BLOCKS", blocks)
    g = torch.Generator().manual_seed(m + k)
    words = torch.randint(-32768, 32768, (m * k // 16,), generator=g, dtype=torch.int32).to(torch.int16)
    values = torch.randn(m * k // 2, generator=g).bfloat16()
    buf = torch.cat([values, words.view(torch.bfloat16)]).view(m, -1)
    out, _ = fp8_sparse.compressed_to_e4m3(buf.to(DEV), m, k)
    assert torch.equal(out.cpu().view(torch.uint8).reshape(-1)[m * k // 2:], e4m3_metadata(words, m, k))


def _b_of_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w [K, N] as B in one of the layouts kmajor_e4m3 takes: the transpose of a row-major, row-major,
    or every other column of a wider row-major (neither)."""
    if layout == "transposed":
        return w.t().contiguous().t()
    if layout == "row-major":
        return w.contiguous()
    wide = torch.zeros(w.shape[0], 2 * w.shape[1], dtype=w.dtype, device=w.device)
    wide[:, ::2] = w
    return wide[:, ::2]


def _on_dev(w: torch.Tensor, layout: str) -> torch.Tensor:
    """_b_of_layout built on DEV: .to() of a strided view would hand over a contiguous copy."""
    b = _b_of_layout(w.to(DEV), layout)
    assert (layout == "strided") == (b.stride(1) == 2)
    return b


@pytest.mark.parametrize("layout", ["transposed", "row-major", "strided"])
def test_kmajor_e4m3_matches_its_reference(layout):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 64, generator=g) * torch.logspace(-2, 2, 64)).bfloat16()
    b = _on_dev(w, layout)
    q, s = fp8_sparse.kmajor_e4m3(b)
    q_ref, s_ref = fp8_sparse.kmajor_e4m3_reference(b.cpu())
    assert q.shape == b.shape and q.t().is_contiguous()  # K-major
    assert torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def _special_columns(k: int, n: int, seed: int) -> torch.Tensor:
    """A bf16 [k, n] with columns of very different magnitudes, and columns with a NaN, +-inf, all
    zeros, a tiny amax (under AMAX_FLOOR), bf16's largest finite values and amaxes at the scales' edges."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(k, n, generator=g) * torch.logspace(-4, 4, n)
    b[k // 2, 1] = float("nan")
    b[k - 1, 2] = float("inf")
    b[0, 3] = -float("inf")
    b[:, 4] = 0.0
    b[:, 5] *= 1e-20
    b[3, 6] = -3.3e38
    b[k - 1, 7], b[1, 8], b[0, 9] = 448.0, 1.75, 1.7578125  # 1.7578125: bf16's first above 1.75
    return b.bfloat16()


def _bits(s: torch.Tensor) -> torch.Tensor:
    return s.cpu().view(torch.int32)  # NaNs compared too


@pytest.mark.parametrize("k, n", [(64, 64), (100, 70), (257, 104), (1100, 40)])  # 1100: three 512-row steps
@pytest.mark.parametrize("layout", ["transposed", "row-major", "strided"])
def test_kmajor_scales_are_pow2_scale_of_the_column_amaxes(k, n, layout):
    cols = _special_columns(k, n, k + n)
    if k > 1024:  # the amaxes and a NaN in the last, partial step
        cols[1090, 10], cols[1050, 11], cols[1099, 12] = 1e30, float("nan"), -2.5e3
    b = _on_dev(cols, layout)
    want = fp8_sparse.pow2_scale(b.cpu().float().abs().amax(0))
    assert want[1:4].isnan().all()
    q, s = fp8_sparse.kmajor_e4m3(b)
    assert torch.equal(_bits(s), _bits(want))
    # the values too: N no multiple of 16 and K over several 512-row steps reach the masked tails
    assert torch.equal(q.cpu().view(torch.uint8), fp8_sparse.kmajor_e4m3_reference(b.cpu())[0].view(torch.uint8))


@pytest.mark.parametrize("layout", ["row-major", "strided"])
def test_kmajor_e4m3_makes_nan_and_inf_columns_nan(layout):
    b = _on_dev(_special_columns(128, 96, 7), layout)
    q, s = fp8_sparse.kmajor_e4m3(b)
    q_ref, s_ref = fp8_sparse.kmajor_e4m3_reference(b.cpu())
    assert torch.equal(_bits(s), _bits(s_ref)) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert q.cpu()[:, 1:4].float().isnan().all() and not q.cpu()[:, 4:].float().isnan().any()


@pytest.mark.parametrize("m, n", [(40, 200), (64, 128), (33, 1)])
def test_unscale_divides_by_row_and_column_scales_in_place(m, n):
    g = torch.Generator().manual_seed(m * n)
    y = torch.randn(m, n, generator=g).bfloat16().to(DEV)
    sr = 2.0 ** torch.randint(-40, 40, (m,), generator=g).float()
    sc = 2.0 ** torch.randint(-40, 40, (n,), generator=g).float()
    sr[m // 2] = float("nan")
    want = (y.cpu().float() * sr.reciprocal()[:, None] * sc.reciprocal()[None, :]).bfloat16()  # sparse_mm's, before
    got = fp8_sparse.unscale_(y, row_scale=sr.to(DEV), col_scale=sc.to(DEV))
    assert got.data_ptr() == y.data_ptr()
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and got[m // 2].isnan().all()
    fine = ~want.isnan()  # NaN's sign bit may differ
    assert torch.equal(got[fine].view(torch.int16), want[fine].view(torch.int16))


@pytest.mark.parametrize("m, n", [(40, 200), (64, 128), (33, 1)])
def test_unscale_to_fp32_is_the_in_place_bf16_result_widened(m, n):
    """An fp32 weight's gradient (unscale, out of place) equals the bf16 path's in-place unscale_,
    .float(), bit for bit: a bf16 times power-of-2 reciprocals is a bf16 (results kept normal)."""
    g = torch.Generator().manual_seed(m + n)
    y = torch.randn(m, n, generator=g).bfloat16()
    y[torch.rand(m, n, generator=g) < 0.3] = 0.0  # the sparse product's zeros (dense features, padding)
    y[0, 0] = -0.0
    sr = (2.0 ** torch.randint(-40, 40, (m,), generator=g).float()).to(DEV)
    sc = (2.0 ** torch.randint(-40, 40, (n,), generator=g).float()).to(DEV)
    got = fp8_sparse.unscale(y.to(DEV), row_scale=sr, col_scale=sc, out_dtype=torch.float32)
    want = fp8_sparse.unscale_(y.to(DEV), row_scale=sr, col_scale=sc).float()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got.cpu().view(torch.int32), want.cpu().view(torch.int32))  # -0.0 too


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_unscale_writes_dense_columns_as_write_dense_columns(out_dtype):
    """dW2's dense features' columns written in the unscaling pass (e4m3 mode) equal unscale followed
    by write_dense_columns, bit for bit, in bf16 (in place) and fp32 (an fp32 weight's gradient)."""
    from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_columns
    g = torch.Generator().manual_seed(3)
    d, f, k = 64, 300, 17  # F not a multiple of the kernel's 128 columns
    y = torch.randn(d, f, generator=g).bfloat16().to(DEV)
    sr = (2.0 ** torch.randint(-8, 8, (d,), generator=g).float()).to(DEV)
    sc = (2.0 ** torch.randint(-8, 8, (f,), generator=g).float()).to(DEV)
    dense = torch.randperm(f, generator=g)[:k].to(DEV)
    slots = dense_slots(dense, f, DEV)[0]
    rows = torch.randn(k, d, generator=g).bfloat16().to(DEV)
    want = fp8_sparse.unscale(y.clone(), row_scale=sr, col_scale=sc, out_dtype=out_dtype)
    write_dense_columns(want, slots, rows)
    got = fp8_sparse.unscale(y.clone(), row_scale=sr, col_scale=sc, out_dtype=out_dtype, dense_columns=(slots, rows))
    assert got.dtype == out_dtype and torch.equal(got, want)
    assert torch.equal(got[:, dense[0]].float(), rows[0].float())
    with pytest.raises(ValueError, match="dense columns"):
        fp8_sparse.unscale(y, row_scale=sr, col_scale=sc, out_dtype=out_dtype, dense_columns=(slots.long(), rows))


def test_unscale_out_of_place_leaves_its_input():
    y = torch.randn(32, 128).bfloat16().to(DEV)
    before = y.clone()
    s = torch.full((32,), 4.0, device=DEV), torch.full((128,), 2.0, device=DEV)
    got = fp8_sparse.unscale(y, row_scale=s[0], col_scale=s[1], out_dtype=torch.float32)
    assert torch.equal(y, before) and torch.equal(got, y.float() / 8)


@pytest.mark.gpu  # the interpreter's cast to bf16 truncates; exact for powers of 2 only
def test_unscale_rounds_reciprocals_of_any_scales_as_torch():
    g = torch.Generator().manual_seed(9)
    y = torch.randn(64, 256, generator=g).bfloat16().to(DEV)
    sr, sc = torch.rand(64, generator=g) * 100 + 1e-3, torch.rand(256, generator=g) * 100 + 1e-3
    want = (y.cpu().float() * sr.reciprocal()[:, None] * sc.reciprocal()[None, :]).bfloat16()
    assert torch.equal(fp8_sparse.unscale_(y, row_scale=sr.to(DEV), col_scale=sc.to(DEV)).cpu().view(torch.int16), want.view(torch.int16))


def test_the_reference_product_is_close_to_bf16():
    m, k, n = 64, 128, 64
    a, keep = sparse_bf16(m, k, 3)
    b = torch.randn(k, n).bfloat16()
    got = fp8_sparse.sparse_mm_reference(compress(a, keep), b).float()
    want = a.float() @ b.float()
    assert ((got - want).norm() / want.norm()).item() < 0.05  # e4m3's 3 mantissa bits on both operands


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_result", [False, True])
@pytest.mark.parametrize("b_layout", ["transposed", "row-major"])
def test_sparse_mm_on_cuda_matches_its_reference(transpose_result, b_layout):
    m, k, n = 256, 512, 192
    a, keep = sparse_bf16(m, k, 4)
    buf = compress(a, keep).cuda()
    w = torch.randn(n, k).bfloat16().cuda()
    b = w.t() if b_layout == "transposed" else w.t().contiguous()
    assert fp8_sparse.usable(buf, b)
    got = fp8_sparse.sparse_mm(buf, b, transpose_result).float()
    want = fp8_sparse.sparse_mm_reference(buf, b, transpose_result).float()
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # the same e4m3 values; bf16 output


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_dense_mm_is_the_product_of_the_e4m3_rows_and_columns(layout):
    """The dense features' rows of a weight gradient (dense_mm): rows as rows_to_e4m3 casts them, B
    as kmajor_e4m3 does; on the CPU through torch's CPU _scaled_mm."""
    g = torch.Generator().manual_seed(5)
    r, k, n = 40, 128, 48  # r: the dense features, any count
    a = (torch.randn(r, k, generator=g) * torch.logspace(-3, 3, r)[:, None]).bfloat16()
    a[3] = 0.0  # a dense feature that is zero at every token
    b = _on_dev((torch.randn(k, n, generator=g) * torch.logspace(-2, 2, n)).bfloat16(), layout)
    got = fp8_sparse.dense_mm(a.to(DEV), *fp8_sparse.kmajor_e4m3(b)).cpu()
    want = fp8_sparse.dense_mm_reference(a, b.cpu())
    bf16 = (a.float() @ b.cpu().float()).bfloat16()
    assert got.shape == (r, n) and got.dtype == torch.bfloat16 and not got[3].any()
    per_row = [_rel(got[i], want[i]) for i in range(r) if i != 3]  # each row at its own scale
    assert max(per_row) < 1e-2, max(per_row)
    assert _rel(got, want) < 0.2 * _rel(want, bf16)  # the e4m3 product, not the bf16 one


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 8192, 16384, 16416])  # 16416: over rowwise_e4m3's row length
def test_dense_mm_one_launch_rows_cast_as_rows_to_e4m3(k, monkeypatch):
    """dense_mm's fused rows cast (fp8_gemm.rowwise_e4m3) gives the bytes and scales of
    rows_to_e4m3, and so the same product as the unfused path, at the tokens a 7B FFN has."""
    from srelu24_kernels.float8 import gemm as fp8_gemm
    g = torch.Generator(device="cuda").manual_seed(k)
    a = (torch.randn(40, k, device="cuda", generator=g) * torch.logspace(-3, 3, 40, device="cuda")[:, None]).bfloat16()
    a[7] = 0.0
    b = torch.randn(k, 96, device="cuda", generator=g).bfloat16()
    fused = fp8_gemm.rowwise_e4m3(a)
    if fused is not None:
        q, s = fp8_sparse.rows_to_e4m3(a)
        assert torch.equal(fused[0].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(fused[2][:, 0], s.reciprocal())
    got = fp8_sparse.dense_mm(a, *fp8_sparse.kmajor_e4m3(b))
    monkeypatch.setattr(fp8_gemm, "rowwise_e4m3", lambda t: None)
    assert torch.equal(got, fp8_sparse.dense_mm(a, *fp8_sparse.kmajor_e4m3(b)))


def test_the_references_dense_columns_are_write_dense_columns():
    """sparse_and_dense_mm_reference with slots (dW2 in e4m3 mode, fp32 weights) is the product
    widened, with the dense rows stored as its columns as write_dense_columns stores them."""
    from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_columns
    m, k, n, r = 128, 256, 64, 9
    a, keep = sparse_bf16(m, k, 8)
    buf = compress(a, keep)
    rows, b = torch.randn(r, k).bfloat16(), torch.randn(k, n).bfloat16()
    slots = dense_slots(torch.randperm(m)[:r], m, "cpu")[0]
    y, yd = fp8_sparse.sparse_and_dense_mm_reference(buf, rows, b, True)
    want = y.float().to(DEV)
    write_dense_columns(want, slots.to(DEV), yd.to(DEV))
    got, none = fp8_sparse.sparse_and_dense_mm_reference(buf, rows, b, True, torch.float32, slots)
    assert none is None and got.dtype == torch.float32 and torch.equal(got, want.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_result", [False, True])
def test_sparse_and_dense_mm_share_one_conversion_of_b(transpose_result):
    m, k, n, r = 256, 512, 192, 24
    a, keep = sparse_bf16(m, k, 6)
    buf = compress(a, keep).cuda()
    rows = torch.randn(r, k, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    y, yd = fp8_sparse.sparse_and_dense_mm(buf, rows, b, transpose_result)
    assert torch.equal(y, fp8_sparse.sparse_mm(buf, b, transpose_result))
    assert torch.equal(yd, fp8_sparse.dense_mm(rows, *fp8_sparse.kmajor_e4m3(b)))
    if transpose_result:  # dW2: the dense rows as its columns, written in the unscaling pass
        from srelu24_kernels.srelu24.sparsify_backward import dense_slots, write_dense_columns
        slots = dense_slots(torch.randperm(m, device="cuda")[:r], m, "cuda")[0]
        want = y.clone()
        write_dense_columns(want, slots, yd)
        fused, none = fp8_sparse.sparse_and_dense_mm(buf, rows, b, True, slots=slots)
        assert none is None and torch.equal(fused, want)
    y0, none = fp8_sparse.sparse_and_dense_mm(buf, None, b, transpose_result)
    assert none is None and torch.equal(y0, y)
    ref, ref_d = fp8_sparse.sparse_and_dense_mm_reference(buf, rows, b, transpose_result)
    assert _rel(y, ref) < 1e-2 and _rel(yd, ref_d) < 1e-2
    if transpose_result:
        ref_fused, none = fp8_sparse.sparse_and_dense_mm_reference(buf, rows, b, True, torch.float32, slots)
        assert none is None and ref_fused.dtype == torch.float32 and _rel(fused, ref_fused) < 1e-2


def _ffn_outputs(x, w1, w2, dy, float8: str, sparse_float8: bool, reuse_forward_mask: bool = True) -> list:
    from helpers import kernel_ffn
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    for t in (x, w1, w2):
        t.grad = None
    # no token permutation (the model's FFN gets its tokens permuted by the block): the runs compare
    # the same 2:4 choices along tokens, not another random order's
    recipe = SReLU24Recipe(token_permutation=False, reuse_forward_mask=reuse_forward_mask)
    y = kernel_ffn(x, w1, w2, recipe, float8=float8, sparse_float8=sparse_float8)
    y.backward(dy)
    return [t.float() for t in (y, x.grad, w1.grad, w2.grad)]


@pytest.mark.gpu
def test_srelu24_ffn_in_e4m3_is_its_reference_and_near_bf16(monkeypatch):
    torch.manual_seed(0)
    T, d, F_ = 512, 256, 1024
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(F_, d, device="cuda") * d ** -0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(d, F_, device="cuda") * F_ ** -0.5).bfloat16().requires_grad_()
    dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    bf16 = _ffn_outputs(x, w1, w2, dy, "none", False)
    dense8 = _ffn_outputs(x, w1, w2, dy, "rowwise", False)  # the 2:4 GEMMs in bf16
    e4m3 = _ffn_outputs(x, w1, w2, dy, "rowwise", True)
    monkeypatch.setattr(fp8_sparse, "sparse_mm", fp8_sparse.sparse_mm_reference)  # Y, dX
    monkeypatch.setattr(fp8_sparse, "sparse_and_dense_mm", fp8_sparse.sparse_and_dense_mm_reference)  # dW1, dW2
    reference = _ffn_outputs(x, w1, w2, dy, "rowwise", True)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for what, got, ref, b16, d8 in zip(("Y", "dX", "dW1", "dW2"), e4m3, reference, bf16, dense8):
        assert rel(got, ref) < 1e-2, f"{what}: {rel(got, ref):.4f} from the fp32 product of the same e4m3 values"
        assert not torch.equal(got, d8), f"{what}: the 2:4 GEMMs did not change"
        # float8's dense GEMMs already flip 2:4 choices (6-17% from bf16 at this size, as on the CPU);
        # e4m3 in the 2:4 GEMMs may add a little, not double it
        assert rel(got, b16) < 1.25 * rel(d8, b16) + 0.02, f"{what}: {rel(got, b16):.3f} against {rel(d8, b16):.3f}"


def _recorded_weight_dtypes(monkeypatch, w_dtype, float8: str, sparse_float8: bool) -> tuple:
    """The dtypes srelu24_kernels.srelu24.op.ffn hands the forward op (recorded, not run; Y's op gets
    the same W2)."""
    import srelu24_kernels.srelu24.op as K
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    seen = []

    def recording(x, w1, w2, *args):
        seen.append((x.dtype, w1.dtype, w2.dtype))
        return (x, x.new_empty(x.shape[0], w2.shape[0]), x, x, x.new_empty(0, dtype=torch.float64),
                x.new_empty(0, dtype=torch.uint8), x.new_empty(0), x.new_empty(0))

    def output(a24, h, w2, *args):
        assert w2.dtype == seen[-1][2]
        return h.new_zeros(h.shape), h.new_empty(0), h.new_empty(0)

    monkeypatch.setattr(K, "ffn_forward", recording)
    monkeypatch.setattr(K, "ffn_output", output)
    x = torch.randn(2, 8, 16)
    K.ffn(x, torch.randn(32, 16, dtype=w_dtype), torch.randn(16, 32, dtype=w_dtype),
          K.OpOptions(SReLU24Recipe(), float8, sparse_float8))
    return seen[0]


@pytest.mark.parametrize("float8, sparse_float8", [("none", True), ("none", False), ("rowwise", False),
                                                   ("tensorwise", False)])
def test_the_kernel_ffn_casts_weights_to_bf16_outside_the_op_except_in_e4m3_mode(monkeypatch, float8, sparse_float8):
    """The bf16 paths as before: weights cast outside the op (autograd casts their gradients back)."""
    bf16 = torch.bfloat16
    assert _recorded_weight_dtypes(monkeypatch, torch.float32, float8, sparse_float8) == (bf16, bf16, bf16)


@pytest.mark.parametrize("float8", ["rowwise", "tensorwise"])
def test_the_kernel_ffn_hands_fp32_weights_to_the_op_in_e4m3_mode(monkeypatch, float8):
    bf16, fp32 = torch.bfloat16, torch.float32
    assert _recorded_weight_dtypes(monkeypatch, fp32, float8, True) == (bf16, fp32, fp32)
    assert _recorded_weight_dtypes(monkeypatch, bf16, float8, True) == (bf16, bf16, bf16)  # FSDP2's all-gathered
    assert _recorded_weight_dtypes(monkeypatch, torch.float16, float8, True) == (bf16, bf16, bf16)


def test_the_ops_fakes_take_fp32_weights_and_give_fp32_weight_gradients():
    import srelu24_kernels.srelu24.op as K
    from helpers import backward_args, forward_args, output_args
    from srelu24_kernels.srelu24.reference import SReLU24Recipe

    T, d, F_ = 100, 64, 128
    x = torch.empty(T, d, dtype=torch.bfloat16, device="meta")
    w1, w2 = torch.empty(F_, d, device="meta"), torch.empty(d, F_, device="meta")
    o = K.OpOptions(SReLU24Recipe(False, 0.05, True), "rowwise")
    out = K.ffn_forward(*forward_args(x, w1, w2, False, o))
    y, *_ = K.ffn_output(*output_args(out, w2, o))
    assert y.dtype == out[0].dtype == out[2].dtype == torch.bfloat16 and y.shape == (T, d)
    dx, dw1, dw2, *_ = K.ffn_backward(*backward_args(torch.empty_like(y), x, w1, w2, out, o))
    assert dx.dtype == torch.bfloat16 and dw1.dtype == dw2.dtype == torch.float32
    assert dw1.shape == w1.shape and dw2.shape == w2.shape
    with pytest.raises(ValueError, match="bf16 or fp32 weights"):
        K.ffn_forward(*forward_args(x, w1.half(), w2, False, o))


def _fp32_weight_runs(dev, T, d, F_, float8, representable: bool, reuse_forward_mask: bool = True) -> tuple:
    """The FFN in e4m3 mode with fp32 weights, and with the same weights cast to bf16 first
    (representable: fp32 weights that hold bf16 values); (outputs, outputs) as _ffn_outputs'."""
    torch.manual_seed(1)
    x = torch.randn(T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w1, w2 = torch.randn(F_, d, device=dev) * d ** -0.5, torch.randn(d, F_, device=dev) * F_ ** -0.5
    if representable:
        w1, w2 = w1.bfloat16().float(), w2.bfloat16().float()
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    dy = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
    fp32 = _ffn_outputs(x, w1, w2, dy, float8, True, reuse_forward_mask)
    assert w1.grad.dtype == w2.grad.dtype == torch.float32
    return fp32, _ffn_outputs(x, *_bf16_leaves(w1, w2), dy, float8, True, reuse_forward_mask)


def _bf16_leaves(*ws: torch.Tensor) -> list:
    return [w.detach().bfloat16().requires_grad_() for w in ws]


@pytest.mark.parametrize("float8", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("reuse_forward_mask", [True, False])  # False: dX by a dense bf16 GEMM with W1
def test_the_op_in_e4m3_mode_takes_fp32_weights_through_its_bf16_fallbacks(monkeypatch, float8, reuse_forward_mask):
    """On the CPU every 2:4 GEMM is a bf16 fallback (cuSPARSELt stood in for; like torch's op, the
    stand-in refuses an fp32 B), which casts the fp32 weights inside the op; fp32 weights that hold
    bf16 values give the bf16 weights' results exactly (the weight gradients come back fp32: the
    bf16 ones, widened)."""
    from helpers import cpu_scaled_mm_runs
    from test_kernels import _cslt_stand_in

    if not cpu_scaled_mm_runs(float8):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm does not run {float8} (torch 2.13 does)")
    _cslt_stand_in(monkeypatch)
    fp32, bf16 = _fp32_weight_runs("cpu", 100, 64, 64, float8, True, reuse_forward_mask)
    for what, got, want in zip(("Y", "dX", "dW1", "dW2"), fp32, bf16):
        assert torch.equal(got, want), what


@pytest.mark.gpu
@pytest.mark.parametrize("float8", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("T", [512, 470])  # 470: padded to 480 tokens, the weight gradients' bf16 fallback
def test_srelu24_ffn_in_e4m3_takes_fp32_weights_as_their_bf16_casts(float8, T):
    """fp32 weights straight into the e4m3 op (no casts around it) against the same weights cast to
    bf16 first. Holding bf16 values, the two convert to the same e4m3 bytes (the unscaling's fp32
    output being the bf16 one widened): equal results. Any fp32 values: e4m3 of fp32 and of its bf16
    rounding differ where the double rounding does (a few % of the values, by one e4m3 step),
    which flips some 2:4 choices: 3-6% apart on the CPU's fallbacks at these shapes."""
    for representable in (True, False):
        fp32, bf16 = _fp32_weight_runs("cuda", T, 256, 1024, float8, representable)
        for what, got, want in zip(("Y", "dX", "dW1", "dW2"), fp32, bf16):
            if representable:
                assert torch.equal(got, want), what
            else:
                assert _rel(got, want) < 0.1, f"{what}: {_rel(got, want):.4f}"
