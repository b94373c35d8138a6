"""Dump torch._cslt_compress's output for e4m3 2:4 matrices built to reveal its layout, and for
random ones to verify a layout formula against (run on the GPU; the analysis runs anywhere):

    python lab/probe_cslt_fp8_layout.py --out fp8_layout.pt

Bit-plane probes on one [M, K] shape: probe b of the values gives every kept element the value
1 or 2 by bit b of its flat index r * K + c (one fixed random 2:4 mask), so the index of the
element behind every value byte is read back from the bits; probe b of the metadata keeps
positions (0, 1) or (2, 3) of each group of 4 by bit b of the group's flat index, so every
metadata bit that changes names its group. Random matrices of several shapes follow, with
their compressed buffers.
"""
import argparse
import sys

import torch

E4M3 = torch.float8_e4m3fn


def mask_24(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(m, k // 4, 4, generator=gen).argsort(-1) < 2).reshape(m, k)


def compress(a: torch.Tensor) -> torch.Tensor:
    """The compressed buffer's bytes (uint8, on the CPU) of a CPU e4m3 matrix."""
    return torch._cslt_compress(a.cuda()).view(torch.uint8).reshape(-1).cpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--out", default="fp8_layout.pt")
    args = ap.parse_args()
    m, k = args.m, args.k
    gen = torch.Generator().manual_seed(0)
    keep = mask_24(m, k, gen)
    flat = torch.arange(m * k).reshape(m, k)
    values = []
    for b in range((m * k - 1).bit_length()):
        a = torch.where(((flat >> b) & 1).bool(), 1.0, 2.0) * keep
        values.append(compress(a.to(E4M3)))
    groups = torch.arange(m * k // 4).reshape(m, k // 4)
    pair_01 = torch.tensor([True, True, False, False])
    meta = []
    for b in range((m * k // 4 - 1).bit_length()):
        bit = ((groups >> b) & 1).bool()[..., None]
        g_keep = torch.where(bit, ~pair_01, pair_01).reshape(m, k)
        meta.append(compress((torch.ones(m, k) * g_keep).to(E4M3)))
    base = compress((torch.ones(m, k) * pair_01.repeat(m, k // 4)).to(E4M3))
    randoms = []
    for rm, rk in ((m, k), (64, 64), (192, 320), (256, 1024), (1024, 2048)):
        a = (torch.randn(rm, rk, generator=gen) * mask_24(rm, rk, gen)).to(E4M3)
        randoms.append({"a": a.view(torch.uint8), "c": compress(a)})
    torch.save({"m": m, "k": k, "keep": keep, "values": values, "meta": meta, "base": base, "randoms": randoms,
                "torch": str(torch.__version__), "cusparselt": torch.backends.cusparselt.version()}, args.out)
    print(f"compressed e4m3 [{m}, {k}]: {base.numel()} bytes ({base.numel() / (m * k):.4f} per element); "
          f"randoms: " + ", ".join(f"{tuple(r['a'].shape)} -> {r['c'].numel()}" for r in randoms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
