"""CUTLASS's sm90 2:4 metadata layouts (kernels/cslt_layout.py) and the CUTLASS GEMM library
(kernels/cutlass_sp24.py, built by `make cutlass`): the layout formula on CPU; on a Hopper GPU
with the library built, CUTLASS's own compressor writes exactly that layout and every tile
configuration computes A @ B."""
import pytest
import torch

from kernels import cutlass_sp24
from kernels.cslt_layout import compress, decompress, nibble_index
from model.sparse24 import mask_2to4


@pytest.mark.parametrize("layout,atom_k", [("cutlass_k64", 64), ("cutlass_k128", 128)])
def test_cutlass_layout_is_a_permutation_of_64_row_atoms(layout, atom_k):
    """Every nibble has one place; each 64-row x atom_k-column atom owns a contiguous block, atoms
    going down the rows first; a 16-bit word holds 4 consecutive groups of one row."""
    m, k = 192, 2 * atom_k
    r = torch.arange(m)[:, None].expand(m, k // 4)
    g = torch.arange(k // 4)[None, :].expand(m, k // 4)
    n = nibble_index(r, g, k, layout, m)
    assert torch.equal(n.reshape(-1).sort().values, torch.arange(m * k // 4))
    atom = (g * 4 // atom_k) * (m // 64) + r // 64
    assert torch.equal(n // (64 * atom_k // 4), atom)
    assert torch.equal(n[:, ::4] // 4, n[:, 3::4] // 4) and torch.equal(n[:, 1::4] - n[:, ::4], torch.ones_like(n[:, ::4]))


@pytest.mark.parametrize("layout", ["cutlass_k64", "cutlass_k128"])
def test_cutlass_layout_round_trip_and_shape_check(layout):
    a = torch.randn(128, 256).bfloat16()
    keep = mask_2to4(a)
    assert torch.equal(decompress(compress(a, keep, layout), 128, 256, layout), a * keep)
    with pytest.raises(ValueError, match="cols % 128"):
        compress(torch.zeros(64, 64), torch.ones(64, 64, dtype=torch.bool), "cutlass_k128")
    with pytest.raises(ValueError, match="unknown 2:4 layout 'cutlass'.*cusparselt"):
        compress(a, keep, "cutlass")


@pytest.fixture
def hopper(monkeypatch):
    """Pretend to be on an sm90 GPU, so that only the library decides."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cutlass_sp24._LIB, "loaded", [])


def test_library_absent_means_not_available(monkeypatch, tmp_path, hopper):
    monkeypatch.setenv("SP24_CUTLASS_LIB", str(tmp_path / "missing.so"))
    assert not cutlass_sp24.available()
    assert cutlass_sp24._LIB.loaded == [None]  # looked for once, remembered


def test_unloadable_library_warns_and_is_not_available(monkeypatch, tmp_path, hopper):
    bogus = tmp_path / "sp24_cutlass.so"
    bogus.write_text("not a shared object")
    monkeypatch.setenv("SP24_CUTLASS_LIB", str(bogus))
    with pytest.warns(RuntimeWarning, match="CUTLASS 2:4 library unusable"):
        assert not cutlass_sp24.available()
    assert not cutlass_sp24.available()  # remembered, no second attempt


def test_cutlass_layouts_need_the_row_count():
    with pytest.raises(ValueError, match="needs the row count"):
        nibble_index(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 128, "cutlass_k64")


needs_library = pytest.mark.skipif(not cutlass_sp24.available(), reason="needs `make cutlass` and a Hopper GPU")


def _random_24(m, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return a * mask_2to4(a)


@pytest.mark.gpu
@needs_library
@pytest.mark.parametrize("tile_k", [64, 128])
def test_cutlass_compressor_writes_our_layout(tile_k):
    a = _random_24(320, 512)
    got = cutlass_sp24.compress(a, tile_k)
    assert torch.equal(got.view(torch.int16), compress(a, a != 0, f"cutlass_k{tile_k}").view(torch.int16))


@pytest.mark.gpu
@needs_library
@pytest.mark.parametrize("cfg", sorted(cutlass_sp24.CONFIGS))
@pytest.mark.parametrize("b_layout,out_transposed", [("k", False), ("n", False), ("n", True)])
def test_every_configuration_computes_the_product(cfg, b_layout, out_transposed):
    m, k, n = 384, 1024, 256
    a = _random_24(m, k)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_layout == "k" else \
        torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    buf = compress(a, a != 0, f"cutlass_k{cutlass_sp24.TILE_K[cfg]}")
    got = cutlass_sp24.mm(buf, b, cfg, out_transposed=out_transposed)
    want = a.float() @ b.float()
    assert got.shape == (m, n)
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3
