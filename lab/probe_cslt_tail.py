"""Does what lies after a compressed e4m3 operand change cuSPARSELt's product, id by id?

cuSPARSELt's id-0 e4m3 kernel reads 1024 bytes past the compressed A at the 7B FFN's K = 16512
(lab/probe_cslt_bounds.py under compute-sanitizer); the operands now have spare bytes after them
(layout.COMPRESSED_TAIL_BYTES), uninitialised. In the trainer most ids' products then differed
from id 0's at that shape, while on fresh (zeroed) memory all ids agreed. This probe fills the
spare bytes with zeros, 0xFF or random bytes and compares every id's product with the float32
product of the decompressed operands: overall, and over the last 128 rows (the last band).

    python lab/probe_cslt_tail.py --shapes 0 3
"""
import argparse

import torch

from lab.probe_cslt_bounds import SHAPES, operands
from srelu24_kernels.cusparselt import binding as C
from srelu24_kernels.cusparselt.layout import decompress_e4m3


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    return raw.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", type=int, nargs="+", default=[0, 3])
    p.add_argument("--max-alg", type=int, default=30)
    args = p.parse_args()
    for s in args.shapes:
        name, m, k, n, tr = SHAPES[s]
        a8, b8 = operands(m, k, n, s)
        ref = decompress_e4m3(a8, m, k).float() @ b8.float()
        ref = ref.t() if tr else ref
        raw = storage_bytes(a8)
        used = a8.numel()
        print(f"{name}: A {list(a8.shape)}, {raw.numel() - used} spare bytes after it", flush=True)
        print("id | rel. error, zero tail | 0xFF tail | random tail | last 128 rows, zero / 0xFF / random")
        for alg in range(args.max_alg + 1):
            errs, last = [], []
            for fill in ("zero", "ff", "random"):
                tail = raw[used:]
                if fill == "zero":
                    tail.zero_()
                elif fill == "ff":
                    tail.fill_(255)
                else:
                    tail.copy_(torch.randint(0, 256, tail.shape, dtype=torch.uint8, device=tail.device))
                try:
                    got = C.torch_mm(a8, b8, alg, tr).float()
                except RuntimeError:
                    errs = None
                    break
                d = got - ref
                errs.append((d.norm() / ref.norm()).item())
                rows = (slice(None), slice(-128, None)) if tr else (slice(-128, None), slice(None))
                last.append((d[rows].norm() / ref[rows].norm()).item())
            if errs is None:
                print(f"{alg} | refused: the last id is {alg - 1}", flush=True)
                break
            print(f"{alg} | " + " | ".join(f"{e:.2e}" for e in errs) + " | " + " / ".join(f"{e:.2e}" for e in last),
                  flush=True)


if __name__ == "__main__":
    main()
