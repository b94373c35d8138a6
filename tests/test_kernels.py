"""The fused srelu + 2:4 sparsify kernel against its PyTorch reference (CPU: TRITON_INTERPRET,
small sizes), and the cuSPARSELt layout reference against its own inverse and the formula."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cslt_layout import compress, compressed_numel, decompress, nibble_index
from kernels.sparsify24 import padded_rows, srelu_sparsify24, srelu_sparsify24_reference
from model.sparse24 import mask_2to4


def random_z(m: int, k: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(m, k, generator=g).bfloat16()
    z[: m // 3, : k // 4] -= 2.0                                   # sparse region: all-zero groups after relu
    z[m // 2, :8] = 1.0                                            # exact ties
    z[-1, 8:16] = torch.tensor([0.5, -0.5, 0.5, 0.25, 0.0, 0.0, 3.0, 3.0])
    return z.to(device)


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
        srelu_sparsify24(torch.zeros(64, 48, dtype=torch.bfloat16))


@pytest.mark.parametrize("m,k,bands", [(64, 32, 1), (100, 96, 1), (192, 64, 2), (1, 32, 8), (640, 128, 8)])
def test_fused_kernel_equals_reference_bit_for_bit(m, k, bands):
    z = random_z(m, k, seed=m * 1000 + k)
    buf, counts = srelu_sparsify24(z, bands=bands)
    ref, ref_counts = srelu_sparsify24_reference(z)
    assert buf.shape == ref.shape == (padded_rows(m), 9 * k // 16)
    assert torch.equal(buf.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(counts, ref_counts)


def test_reference_keeps_the_2_largest_activations():
    z = random_z(64, 64, seed=7)
    buf, counts = srelu_sparsify24_reference(z)
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
    buf, counts = srelu_sparsify24(z)
    ref, ref_counts = srelu_sparsify24_reference(z)
    assert torch.equal(buf.view(torch.int16), ref.view(torch.int16)) and torch.equal(counts, ref_counts)
    b = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    y = torch._cslt_sparse_mm(buf, b.t()).float()
    want = decompress(ref, padded_rows(m), k).float() @ b.float().t()
    assert ((y - want).norm() / want.norm()).item() < 1e-2
