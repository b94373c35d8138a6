"""The one-pass float8 cast (srelu24_kernels/float8/cast.py) against PyTorch's scale, clamp and cast, bit for
bit (CPU: TRITON_INTERPRET, whose own float8 cast the kernel does not rely on)."""
import pytest
import torch

from srelu24_kernels.float8.cast import E4M3, E5M2, scaled_cast, scaled_cast_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def awkward(m: int, n: int) -> torch.Tensor:
    """bf16 values over many magnitudes, with ties, subnormals, values past the formats' range and -0."""
    g = torch.Generator().manual_seed(m * n)
    t = torch.randn(m, n, generator=g) * torch.logspace(-9, 5, n)[None, :]
    t[0, :10] = torch.tensor([1.0625, 1.1875, -1.0625, 0.0029296875, 0.015380859375, 3e-5, 1e-7, 500.0, 7e4, -0.0])
    return t.bfloat16()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_kind", ["tensor", "row", "column"])
@pytest.mark.parametrize("transpose", [False, True])
def test_scaled_cast_equals_torch_bit_for_bit(dtype, scale_kind, transpose):
    m, n = 70, 130  # not tile multiples
    t = awkward(m, n)
    scale = {"tensor": torch.tensor(3.0), "row": torch.rand(m, 1) * 4, "column": torch.rand(1, n) * 4}[scale_kind]
    want = scaled_cast_reference(t, scale, dtype)
    got = scaled_cast(t.to(DEV), scale.to(DEV), dtype, transpose=transpose).cpu()
    if transpose:
        assert got.shape == (n, m) and got.is_contiguous()
        got = got.t()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -7, 0.75])
def test_scaled_cast_equals_torch_on_every_bf16_value(dtype, scale):
    """All 65,536 bf16 bit patterns, NaN and inf included: on a GPU the cast is the cvt instruction,
    here the bit-level rounding; both must give torch's bytes (its NaNs only as NaN: ours are 0x7F)."""
    t = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    want = scaled_cast_reference(t, torch.tensor(scale), dtype)
    got = scaled_cast(t.to(DEV), torch.tensor(scale).to(DEV), dtype).cpu()
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scaled_cast_keeps_nan(dtype):
    t = awkward(8, 64)
    for i, bits in enumerate((0x7FFF, 0x7FC0, -1)):  # NaNs of several payloads and signs (-1: 0xFFFF)
        t.view(torch.int16)[i, 3] = bits
    want = scaled_cast_reference(t, torch.tensor(2.0), dtype)
    got = scaled_cast(t.to(DEV), torch.tensor(2.0).to(DEV), dtype).cpu()
    assert got[:3, 3].float().isnan().all()
    finite = ~want.float().isnan()
    assert torch.equal(got.view(torch.uint8)[finite], want.view(torch.uint8)[finite])


@pytest.mark.parametrize("scale", [3.0, 2.0 ** -7])
def test_scaled_cast_of_fp32_equals_torch(scale):
    """fp32 input (srelu24's fp32 weights in e4m3 mode): values between bf16's, ties of the format."""
    g = torch.Generator().manual_seed(11)
    t = torch.randn(70, 130, generator=g) * torch.logspace(-6, 3, 130)[None, :]
    t[0, :4] = torch.tensor([1.0625, 1.0625 + 2.0 ** -20, -448.5, 1e-7])
    for dtype in (E4M3, E5M2):
        want = scaled_cast_reference(t, torch.tensor(scale), dtype)
        got = scaled_cast(t.to(DEV), torch.tensor(scale).to(DEV), dtype).cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # W2's column scales for dA = dY W2, written transposed (K-major), as fp8_gemm casts an fp32 W2
    cols = torch.full((1, 130), scale) * 2.0 ** torch.randint(-3, 4, (1, 130), generator=g).float()
    for s in (torch.tensor(scale), cols):
        want = scaled_cast_reference(t, s, E4M3).t().contiguous()
        got = scaled_cast(t.to(DEV), s.to(DEV), E4M3, transpose=True).cpu()
        assert got.shape == (130, 70) and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_scaled_cast_reads_any_strides():
    t = awkward(96, 64)
    want = scaled_cast_reference(t.t(), torch.tensor(0.5), E4M3)
    got = scaled_cast(t.to(DEV).t(), torch.tensor(0.5).to(DEV), E4M3).cpu()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_scaled_cast_rejects_a_scale_of_another_shape():
    with pytest.raises(ValueError, match=r"give one element, \[4, 1\] or \[1, 8\]"):
        scaled_cast(torch.zeros(4, 8), torch.ones(8), E4M3)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("grad", [False, True])
def test_float8_gemm_operands_on_cuda_equal_the_pytorch_path(recipe, grad):
    """srelu24_kernels/float8/gemm.py's operands through the Triton cast (CUDA) against the PyTorch expression (CPU)."""
    from srelu24_kernels.float8 import gemm as fp8_gemm

    a, b = awkward(256, 512), awkward(512, 192)
    for bb in (b, b.t().contiguous().t()):  # B row-major, and the transpose of a row-major (W1^T)
        got = fp8_gemm._operands(a.cuda(), bb.cuda(), recipe, grad)
        want = fp8_gemm._operands(a, bb, recipe, grad)
        assert got[2].stride(0) == 1  # B column-major, as torch._scaled_mm takes it
        for g, w in zip(got, want):
            g = g.cpu()
            assert g.shape == w.shape
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)) if g.element_size() == 1 else torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_columns_to_e4m3_equals_its_reference(dtype):
    """A row-major B's per-column conversion (fp8_sparse's X, dY and W1, fp8_gemm's W2), K-major:
    bytes, scales and reciprocals bit for bit; a NaN column stays NaN."""
    from srelu24_kernels.float8.cast import columns_to_e4m3, columns_to_e4m3_reference
    b = awkward(70, 130).to(dtype)
    b[3, 7] = float("nan")
    want_q, want_s = columns_to_e4m3_reference(b)
    nan = want_s.isnan()
    assert nan[7] and nan.sum() == 1
    q, s, inv = columns_to_e4m3(b.to(DEV))
    assert q.shape == (130, 70) and q.is_contiguous() and torch.equal(s.cpu().isnan(), nan)
    assert torch.equal(s.cpu()[~nan], want_s[~nan]) and torch.equal(inv.cpu()[~nan], 1 / want_s[~nan])
    assert inv.cpu()[7].isnan()
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))  # the NaN column's bytes too (0x7F)
