"""cuSPARSELt's e4m3 2:4 layout (srelu24_kernels/cusparselt/layout.py) against buffers torch._cslt_compress wrote
on an H200 (tests/data/cslt_e4m3_compress.json: random 2:4 e4m3 matrices and their compressed
bytes), and the bf16-to-e4m3 metadata permutation against both layouts' formulas."""
import base64
import json
from pathlib import Path

import pytest
import torch

from srelu24_kernels.cusparselt.layout import (compress, compress_e4m3, compressed_bytes_e4m3, decompress_e4m3, e4m3_metadata,
                                 nibble_index_e4m3)
from srelu24_kernels.srelu24.reference import mask_2to4

E4M3 = torch.float8_e4m3fn


def _bytes(b64: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)


CASES = [{"a": _bytes(c["a"]).view(*c["shape"]), "compressed": _bytes(c["compressed"])}
         for c in json.loads((Path(__file__).parent / "data" / "cslt_e4m3_compress.json").read_text())["cases"]]


def kept_mask(a: torch.Tensor) -> torch.Tensor:
    """The non-zeros, plus positions 3 (then 2) in groups with fewer than two: where
    _cslt_compress points a group's unused slots (seen in the recorded buffers)."""
    m, k = a.shape
    keep = (a.view(torch.uint8) & 0x7F != 0).reshape(m, k // 4, 4).clone()
    for pos in (3, 2, 1, 0):
        short = keep.sum(-1) < 2
        keep[..., pos] |= short
    return keep.reshape(m, k)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_compress_e4m3_matches_cusparselt_bytes(case):
    a, want = CASES[case]["a"].view(E4M3), CASES[case]["compressed"]
    m, k = a.shape
    got = compress_e4m3(a, kept_mask(a))
    assert got.shape == (m, k * 5 // 8) and got.numel() == compressed_bytes_e4m3(m, k)
    assert torch.equal(got.reshape(-1), want)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_decompress_e4m3_inverts_cusparselt_bytes(case):
    a, buf = CASES[case]["a"].view(E4M3), CASES[case]["compressed"]
    assert torch.equal(decompress_e4m3(buf, *a.shape).float(), a.float())  # -0 (zeroed negatives) reads back as 0


def test_each_64x64_tile_owns_1024_consecutive_nibbles():
    m, k = 128, 192
    r = torch.arange(m)[:, None].expand(m, k // 4)
    g = torch.arange(k // 4)[None, :].expand(m, k // 4)
    n = nibble_index_e4m3(r, g, k)
    assert torch.equal(n.reshape(-1).sort().values, torch.arange(m * k // 4))
    assert torch.equal(n // 1024, (r // 64) * (k // 64) + g // 16)


@pytest.mark.parametrize("shape", [(64, 64), (192, 320)])
def test_bf16_metadata_permuted_is_the_e4m3_metadata(shape):
    m, k = shape
    a = torch.relu(torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))) ** 2
    keep = mask_2to4(a)
    bf16_meta = compress(a.bfloat16(), keep).reshape(-1)[m * k // 2:]
    e4m3 = compress_e4m3(a.to(E4M3), keep).reshape(-1)
    assert torch.equal(e4m3_metadata(bf16_meta, m, k), e4m3[m * k // 2:])


def test_e4m3_layout_rejects_columns_not_a_multiple_of_64():
    with pytest.raises(ValueError, match="cols % 64"):
        compress_e4m3(torch.zeros(64, 96).to(E4M3), torch.ones(64, 96, dtype=torch.bool))
