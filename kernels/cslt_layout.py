"""cuSPARSELt's compressed layout of a 2:4 bf16 matrix on sm90, in pure PyTorch.

The reference for the fused sparsify kernel (kernels/srelu24_sparsify.py). The layout was worked out
and verified byte-for-byte against `torch._cslt_compress` (docs/METHOD.md, cuSPARSELt's compressed layout (sm90)):

- values: [M, K/2] row-major, for each group of 4 along K its 2 kept values in position order;
- metadata, right after, as 16-bit words: a 4-bit nibble per group, p0 | p1 << 2 (p0 < p1 the
  kept positions); nibble j of a word in bits 4j..4j+3; each 64-row x 32-column tile owns 512
  consecutive nibbles, tiles along K first, then down 64-row bands.

M must be a multiple of 64 (pad tokens) and K a multiple of 32.
"""
import torch
from torch import Tensor

ROWS_PER_BAND, COLS_PER_CHUNK = 64, 32


def check_shape(m: int, k: int) -> None:
    if m % ROWS_PER_BAND or k % COLS_PER_CHUNK:
        raise ValueError(f"the sm90 2:4 layout needs rows % {ROWS_PER_BAND} == 0 and cols % {COLS_PER_CHUNK} == 0, "
                         f"got [{m}, {k}]")


def compressed_numel(m: int, k: int) -> int:
    """bf16 elements of the buffer: values M*K/2, then M*K/16 16-bit metadata words (the
    buffer is [M, 9K/16], like torch._cslt_compress's)."""
    return m * k // 2 + m * k // 16


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


def compress(a: Tensor, keep: Tensor) -> Tensor:
    """The compressed buffer (bf16, compressed_numel elements) of a [M, K] under the 2:4 mask
    `keep` (exactly 2 of every 4 along K)."""
    m, k = a.shape
    check_shape(m, k)
    g = keep.reshape(m, k // 4, 4)
    p0, p1 = kept_positions(g)
    groups = a.reshape(m, k // 4, 4)
    values = torch.stack([groups.gather(-1, p0[..., None])[..., 0], groups.gather(-1, p1[..., None])[..., 0]], -1)
    rows = torch.arange(m, device=a.device)[:, None].expand(m, k // 4)
    cols = torch.arange(k // 4, device=a.device)[None, :].expand(m, k // 4)
    nibbles = torch.empty(m * k // 4, dtype=torch.int32, device=a.device)
    nibbles[nibble_index(rows, cols, k).reshape(-1)] = (p0 | (p1 << 2)).reshape(-1).to(torch.int32)
    q = nibbles.reshape(-1, 4)
    words = q[:, 0] | (q[:, 1] << 4) | (q[:, 2] << 8) | (q[:, 3] << 12)
    meta = (((words + 32768) % 65536) - 32768).to(torch.int16).view(torch.bfloat16)  # 16-bit words, reinterpreted
    return torch.cat([values.to(torch.bfloat16).reshape(-1), meta]).view(m, -1)  # 2-D, as _cslt_compress


def decompress(buf: Tensor, m: int, k: int) -> Tensor:
    """Inverse of compress: the dense [M, K] bf16 matrix (zeros where nothing is kept)."""
    check_shape(m, k)
    buf = buf.reshape(-1)
    values = buf[: m * k // 2].reshape(m, k // 4, 2)
    words = buf[m * k // 2:].view(torch.int16).to(torch.int32) & 0xFFFF
    nibbles = torch.stack([(words >> (4 * j)) & 0xF for j in range(4)], -1).reshape(-1)
    rows = torch.arange(m, device=buf.device)[:, None].expand(m, k // 4)
    cols = torch.arange(k // 4, device=buf.device)[None, :].expand(m, k // 4)
    nib = nibbles[nibble_index(rows, cols, k)]
    out = torch.zeros(m, k // 4, 4, dtype=torch.bfloat16, device=buf.device)
    out.scatter_(-1, (nib & 3)[..., None].long(), values[..., :1])
    out.scatter_(-1, ((nib >> 2) & 3)[..., None].long(), values[..., 1:])
    return out.reshape(m, k)
