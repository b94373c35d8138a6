"""Time the CUDA sparsify kernels (kernels/csrc/srelu24_sparsify.cu) of several builds side by side,
e.g. builds with other register budgets, each in its own process (the library loads once):

    nvcc ... -DSRELU24_BW_MIN_BLOCKS=6 -shared kernels/csrc/srelu24_sparsify.cu -o build/srelu24_kernels_b6.so
    python lab/probe_cuda_kernels.py build/srelu24_kernels.so build/srelu24_kernels_b6.so

Per build and shape (7B and 1B, T=16384): the backward and forward kernels' median ms (triton
do_bench), and whether the backward's output equals the Triton kernel's bit for bit.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"7B": (4096, 16384, 16384), "1B": (2048, 8192, 16384)}


def measure() -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kernels.srelu24_sparsify import srelu_sparsify_2to4
    from kernels.srelu24_sparsify_backward import backward_operands
    from kernels.srelu24_reference import densest_from_counts, random_token_order

    out = {}
    for name, (d, f, t) in SHAPES.items():
        torch.manual_seed(0)
        bf = torch.bfloat16
        z = F.linear(torch.randn(t, d, device="cuda", dtype=bf), torch.randn(f, d, device="cuda", dtype=bf) * d ** -0.5)
        da = torch.randn(t, f, device="cuda", dtype=bf)
        perm = random_token_order(t, "cuda")
        dense = densest_from_counts(srelu_sparsify_2to4(z)[1], 0.05)
        flat = lambda r: [r[0]] + [x for p in r[1:] for x in p]  # noqa: E731
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(
            flat(backward_operands(z, da, perm, dense, backend="cuda")),
            flat(backward_operands(z, da, perm, dense, backend="triton"))))
        bench = lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
        out[name] = {"bw_ms": bench(lambda: backward_operands(z, da, perm, dense, backend="cuda")),
                     "fw_ms": bench(lambda: srelu_sparsify_2to4(z, backend="cuda")), "bw_equals_triton": same}
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure()))
        return 0
    rows = {}
    for lib in sys.argv[1:]:
        env = dict(os.environ, SRELU24_KERNELS_LIB=str(Path(lib).resolve()))
        res = subprocess.run([sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True)
        if res.returncode:
            print(f"{lib}: failed\n{res.stderr[-2000:]}")
            continue
        rows[lib] = json.loads(res.stdout.strip().splitlines()[-1])
    print("| build | " + " | ".join(f"{s} bw ms | {s} fw ms | {s} bw == Triton" for s in SHAPES) + " |")
    for lib, r in rows.items():
        print(f"| {Path(lib).name} | " + " | ".join(f"{r[s]['bw_ms']:.3f} | {r[s]['fw_ms']:.3f} | {r[s]['bw_equals_triton']}"
                                                for s in SHAPES) + " |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
