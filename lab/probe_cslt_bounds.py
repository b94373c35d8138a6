"""Does any cuSPARSELt algorithm id read past the operands of srelu24's e4m3 2:4 GEMMs?

The 7B study's srelu24 run stopped at its first 2:4 step with an illegal memory access in
cusparseLtMatmul (dX = dZ W1, e4m3, a cached plan at the searched id; lab/LOG.md). This probe
runs every id on the FFN's e4m3 shapes with each operand and the output placed at the very end of
its own allocation (run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that an allocation is a
cudaMalloc of exactly that many bytes), once through torch._cslt_sparse_mm and once through this
project's cached plan (srelu24_kernels/cusparselt/binding.py). A read past an operand shows up
as a fault (an unmapped page after it), or as a compute-sanitizer memcheck report where run under
it. A fault ends the process: rerun with --start at the next case.

    python lab/probe_cslt_bounds.py --info                 # compressed sizes, searched ids
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 python lab/probe_cslt_bounds.py --start 0
"""
import argparse
import sys

import torch

from srelu24_kernels.cusparselt import binding as C
from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4

# (name, M, K, N, transpose_result): the sparse operand is [M, K]; 7B (d 4096, F 16512, 2 x 4096
# tokens) and 1B (d 2048, F 8448, 4 x 2048 tokens) FFN shapes
SHAPES = [("7B Y=A24 W2^T / dX=dZ W1", 8192, 16512, 4096, False),
          ("7B dW2=(S(A24)^T dY)^T", 16512, 8192, 4096, True),
          ("7B dW1=S(dZ)^T X", 16512, 8192, 4096, False),
          ("1B Y / dX", 8192, 8448, 2048, False),
          ("1B dW1", 8448, 8192, 2048, False)]


def at_end(nbytes: int, dtype, shape) -> torch.Tensor:
    """A tensor of `shape` whose last byte is the last byte of a 2 MiB-multiple allocation."""
    total = -(-nbytes // (2 << 20)) * (2 << 20)
    raw = torch.empty(total, dtype=torch.uint8, device="cuda")
    return raw[total - nbytes:].view(dtype).view(shape)


def operands(m: int, k: int, n: int, seed: int):
    """(a8 [m, 5k/8] e4m3 compressed, b8 [k, n] K-major e4m3): from a random Z through the
    project's own sparsify and conversion kernels, copied to the end of their allocations."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    buf, _ = srelu_sparsify_2to4(z)
    a8, _ = fp8_sparse.compressed_to_e4m3(buf, m, k)
    b, _ = fp8_sparse.kmajor_e4m3(torch.randn(k, n, device="cuda", generator=g))
    a_end = at_end(a8.numel(), torch.float8_e4m3fn, a8.shape)
    a_end.copy_(a8)
    bt = b.t()  # [n, k] row-major
    b_end = at_end(bt.numel(), torch.float8_e4m3fn, bt.shape)
    b_end.copy_(bt)
    return a_end, b_end.t()


def info() -> None:
    print(f"torch {torch.__version__}, cuSPARSELt {torch.backends.cusparselt.version()}, "
          f"{torch.cuda.get_device_name()}")
    for name, m, k, n, tr in SHAPES:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            dense = torch.randn(m, k, device="cuda").to(dtype)
            dense.view(m, k // 4, 4)[..., :2] = 0  # 2:4
            try:
                size = torch._cslt_compress(dense).numel() * dense.element_size()
            except RuntimeError as e:
                size = f"refused ({str(e).splitlines()[0]})"
            ours = m * k * 5 // 8 if dtype == torch.float8_e4m3fn else m * k * 9 // 8
            print(f"{name} {str(dtype)[6:]}: _cslt_compress {size} bytes, the project's layout {ours}")
        a8, b8 = operands(m, k, n, 0)
        try:
            found = torch._C._cusparselt.mm_search(a8, b8, None, None, torch.bfloat16, tr)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            found = f"{type(e).__name__}: {e}"
        print(f"{name} e4m3: mm_search -> {found}", flush=True)


def cases(max_alg: int):
    return [(s, alg) for s in SHAPES for alg in range(max_alg + 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--info", action="store_true")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--max-alg", type=int, default=40)
    args = p.parse_args()
    if args.info:
        return info()
    lib = C._library(torch.device("cuda"))
    todo = cases(args.max_alg)
    for i in range(args.start, len(todo)):
        (name, m, k, n, tr), alg = todo[i]
        a8, b8 = operands(m, k, n, i)
        try:
            want = C.torch_mm(a8, b8, alg, tr)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"case {i} {name} alg {alg}: torch refuses ({str(e).splitlines()[0][:80]})", flush=True)
            continue
        print(f"case {i} {name} alg {alg}: torch ok", flush=True)
        plan = C._Plan(lib, m, k, n, True, alg, a8.device, tr, True)
        got = plan.run(a8, b8)
        torch.cuda.synchronize()
        print(f"case {i} {name} alg {alg}: plan ok, equal {torch.equal(got, want)}", flush=True)
    print(f"DONE {len(todo)}")


if __name__ == "__main__":
    sys.exit(main())
