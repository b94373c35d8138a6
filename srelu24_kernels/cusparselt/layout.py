"""cuSPARSELt's compressed layout of a 2:4 bf16 matrix on sm90, in pure PyTorch.

The reference for the fused sparsify kernel (srelu24_kernels/srelu24/sparsify.py). The layout was worked out
and verified byte-for-byte against `torch._cslt_compress` (docs/METHOD.md, cuSPARSELt's compressed layout (sm90)):

- values: [M, K/2] row-major, for each group of 4 along K its 2 kept values in position order;
- metadata, right after, as 16-bit words: a 4-bit nibble per group, p0 | p1 << 2 (p0 < p1 the
  kept positions); nibble j of a word in bits 4j..4j+3; each 64-row x 32-column tile owns 512
  consecutive nibbles, tiles along K first, then down 64-row bands.

M must be a multiple of 64 (pad tokens) and K a multiple of 32.

e4m3 (float8_e4m3fn) matrices, worked out the same way (a probe named in lab/LOG.md, and
tests/test_cslt_layout_e4m3.py against buffers of torch._cslt_compress): the values are the same
[M, K/2] row-major stream, one byte each; the metadata follows as bytes, the same nibbles (low
nibble first), but each 64-row x 64-column tile owns 1024 consecutive nibbles, in another order
(nibble_index_e4m3). One e4m3 tile covers two bf16 tiles of the same band, so a bf16 buffer's
metadata becomes an e4m3 buffer's by one fixed permutation of each 512-byte block
(e4m3_metadata). K must be a multiple of 64.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

ROWS_PER_BAND, COLS_PER_CHUNK = 64, 32


def padded(n: int, multiple: int) -> int:
    """n rounded up to a multiple: a compressed operand's rows to ROWS_PER_BAND, a 2:4 reduction
    dimension to COLS_PER_CHUNK (the sparse operands' tokens pad to one or the other)."""
    return -(-n // multiple) * multiple


def pad_rows(t: Tensor, multiple: int) -> Tensor:
    """t [n, ...] with zero rows appended up to padded(n, multiple) (t itself where none are needed)."""
    extra = padded(t.shape[0], multiple) - t.shape[0]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, extra)) if extra else t


def check_shape(m: int, k: int) -> None:
    if m % ROWS_PER_BAND or k % COLS_PER_CHUNK:
        raise ValueError(f"the sm90 2:4 layout needs rows % {ROWS_PER_BAND} == 0 and cols % {COLS_PER_CHUNK} == 0, "
                         f"got [{m}, {k}]")


def compressed_numel(m: int, k: int) -> int:
    """bf16 elements of the buffer: values M*K/2, then M*K/16 16-bit metadata words (the
    buffer is [M, 9K/16], like torch._cslt_compress's)."""
    return m * k // 2 + m * k // 16


# cuSPARSELt reads a compressed operand's metadata in whole blocks of its kernel's K tile, so where
# K is not a multiple of that tile it reads past the buffer: at the 7B FFN's K = 16512 (129 x 128),
# id 0's e4m3 kernel (128x64x256 tiles) reads 1024 bytes past the last band's metadata
# (compute-sanitizer, lab/LOG.md). That read faults only where the buffer ends a mapped range of
# memory, which depends on the run's allocation history: it stopped the 7B study's srelu24 at its
# first 2:4 step. Every compressed buffer is allocated with this many spare bytes after it
# (a K tile of 2048 columns' worth of metadata, eight times the 256 seen).
COMPRESSED_TAIL_BYTES = 16384


def empty_compressed(numel: int, dtype: torch.dtype, device) -> Tensor:
    """An uninitialised flat buffer of `numel` elements for a compressed operand, followed in its
    storage by COMPRESSED_TAIL_BYTES spare bytes that cuSPARSELt may read."""
    return torch.empty(numel + -(-COMPRESSED_TAIL_BYTES // dtype.itemsize), dtype=dtype, device=device)[:numel]


def nibble_index(r: Tensor, g: Tensor, k: int) -> Tensor:
    """Position in the metadata nibble stream of row r, group g (column // 4) of an [M, k] matrix."""
    rb, rr = r // 64, r % 64
    kc, gg = g // 8, g % 8
    inner = (((rr >> 3) & 1) | (((gg >> 2) & 1) << 1) | ((gg & 1) << 2) | (((gg >> 1) & 1) << 3)
             | ((rr & 7) << 4) | (((rr >> 4) & 3) << 7))
    return (rb * (k // 32) + kc) * 512 + inner


def kept_positions(keep: Tensor) -> tuple[Tensor, Tensor]:
    """First and second kept position (0..3) of each group of a [..., 4] mask with 2 kept."""
    k1, k2, k3 = keep[..., 1], keep[..., 2], keep[..., 3]
    p0 = torch.where(keep[..., 0], 0, torch.where(k1, 1, 2))
    p1 = torch.where(k3, 3, torch.where(k2, 2, 1))
    return p0, p1


def _nibble_stream(words: Tensor, per_word: int) -> Tensor:
    """The nibbles (int32, low first) of a 1-D tensor of 16-bit or 8-bit words."""
    w = words.to(torch.int32) & ((1 << (4 * per_word)) - 1)
    return torch.stack([(w >> (4 * j)) & 0xF for j in range(per_word)], -1).reshape(-1)


def _pack_bytes(nibbles: Tensor) -> Tensor:
    q = nibbles.reshape(-1, 2)
    return (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)


def _group_grid(m: int, k: int, device) -> tuple[Tensor, Tensor]:
    """(row, group) of every group of 4 of an [m, k] matrix, each [m, k/4]."""
    rows = torch.arange(m, device=device)[:, None].expand(m, k // 4)
    return rows, torch.arange(k // 4, device=device)[None, :].expand(m, k // 4)


def _values_and_nibbles(a: Tensor, keep: Tensor, index) -> tuple[Tensor, Tensor]:
    """The kept values [m, k/4, 2] of a under `keep`, and the nibble stream (int32) in the order of
    `index` (nibble_index or nibble_index_e4m3)."""
    m, k = a.shape
    p0, p1 = kept_positions(keep.reshape(m, k // 4, 4))
    groups = a.reshape(m, k // 4, 4)
    values = torch.stack([groups.gather(-1, p0[..., None])[..., 0], groups.gather(-1, p1[..., None])[..., 0]], -1)
    nibbles = torch.empty(m * k // 4, dtype=torch.int32, device=a.device)
    nibbles[index(*_group_grid(m, k, a.device), k).reshape(-1)] = (p0 | (p1 << 2)).reshape(-1).to(torch.int32)
    return values, nibbles


def _place_values(values: Tensor, nibbles: Tensor, m: int, k: int, index) -> Tensor:
    """The dense [m, k] matrix (values' dtype, zeros elsewhere) of a value stream and its nibbles."""
    values = values.reshape(m, k // 4, 2)
    nib = nibbles[index(*_group_grid(m, k, values.device), k)]
    out = torch.zeros(m, k // 4, 4, dtype=values.dtype, device=values.device)
    out.scatter_(-1, (nib & 3)[..., None].long(), values[..., :1])
    out.scatter_(-1, ((nib >> 2) & 3)[..., None].long(), values[..., 1:])
    return out.reshape(m, k)


def compress(a: Tensor, keep: Tensor) -> Tensor:
    """The compressed buffer (bf16, compressed_numel elements) of a [M, K] under the 2:4 mask
    `keep` (exactly 2 of every 4 along K)."""
    m, k = a.shape
    check_shape(m, k)
    values, nibbles = _values_and_nibbles(a, keep, nibble_index)
    q = nibbles.reshape(-1, 4)
    words = q[:, 0] | (q[:, 1] << 4) | (q[:, 2] << 8) | (q[:, 3] << 12)
    meta = (((words + 32768) % 65536) - 32768).to(torch.int16).view(torch.bfloat16)  # 16-bit words, reinterpreted
    return torch.cat([values.to(torch.bfloat16).reshape(-1), meta]).view(m, -1)  # 2-D, as _cslt_compress


def decompress(buf: Tensor, m: int, k: int) -> Tensor:
    """Inverse of compress: the dense [M, K] bf16 matrix (zeros where nothing is kept)."""
    check_shape(m, k)
    buf = buf.reshape(-1)
    return _place_values(buf[: m * k // 2], _nibble_stream(buf[m * k // 2:].view(torch.int16), 4), m, k, nibble_index)


E4M3_COLS_PER_CHUNK = 64


def check_shape_e4m3(m: int, k: int) -> None:
    if m % ROWS_PER_BAND or k % E4M3_COLS_PER_CHUNK:
        raise ValueError(f"the sm90 e4m3 2:4 layout needs rows % {ROWS_PER_BAND} == 0 and cols % "
                         f"{E4M3_COLS_PER_CHUNK} == 0, got [{m}, {k}]")


def compressed_bytes_e4m3(m: int, k: int) -> int:
    """Bytes of an e4m3 buffer: values M*K/2, then M*K/8 of metadata ([M, 5K/8], as _cslt_compress)."""
    return m * k // 2 + m * k // 8


def nibble_index_e4m3(r: Tensor, g: Tensor, k: int) -> Tensor:
    """Position in an e4m3 buffer's metadata nibble stream of row r, group g of an [M, k] matrix."""
    rb, rr = r // 64, r % 64
    kc, gg = g // 16, g % 16
    inner = ((gg & 1) | (((rr >> 3) & 1) << 1) | (((gg >> 3) & 1) << 2) | (((gg >> 1) & 3) << 3)
             | ((rr & 7) << 5) | (((rr >> 4) & 3) << 8))
    return (rb * (k // 64) + kc) * 1024 + inner


def compress_e4m3(a: Tensor, keep: Tensor) -> Tensor:
    """The compressed e4m3 buffer (uint8 [M, 5K/8]) of an e4m3 a [M, K] under the 2:4 mask `keep`."""
    m, k = a.shape
    check_shape_e4m3(m, k)
    values, nibbles = _values_and_nibbles(a.view(torch.uint8), keep, nibble_index_e4m3)
    return torch.cat([values.reshape(-1), _pack_bytes(nibbles)]).view(m, -1)


def decompress_e4m3(buf: Tensor, m: int, k: int) -> Tensor:
    """Inverse of compress_e4m3: the dense e4m3 [M, K] (zeros where nothing is kept)."""
    check_shape_e4m3(m, k)
    buf = buf.reshape(-1).view(torch.uint8)
    out = _place_values(buf[: m * k // 2], _nibble_stream(buf[m * k // 2:], 2), m, k, nibble_index_e4m3)
    return out.view(torch.float8_e4m3fn)


_PERMUTATION: dict = {}


def bf16_to_e4m3_nibble_order(device) -> Tensor:
    """P [1024]: nibble i of an e4m3 tile's metadata is nibble P[i] of the two bf16 tiles it covers."""
    if device not in _PERMUTATION:
        rr = torch.arange(64)[:, None].expand(64, 16)
        gg = torch.arange(16)[None, :].expand(64, 16)
        p = torch.empty(1024, dtype=torch.long)
        p[nibble_index_e4m3(rr, gg, 64).reshape(-1)] = nibble_index(rr, gg, 64).reshape(-1)
        _PERMUTATION[device] = p.to(device)
    return _PERMUTATION[device]


def e4m3_metadata(bf16_metadata: Tensor, m: int, k: int) -> Tensor:
    """A bf16 buffer's metadata (its M*K/16 16-bit words, any 16-bit dtype) as an e4m3 buffer's
    (M*K/8 bytes, uint8): the same nibbles, permuted within each 1024-nibble block."""
    check_shape_e4m3(m, k)
    nibbles = _nibble_stream(bf16_metadata.reshape(-1).view(torch.int16), 4).view(-1, 1024)
    return _pack_bytes(nibbles[:, bf16_to_e4m3_nibble_order(nibbles.device)])
