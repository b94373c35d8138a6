"""Does cuSPARSELt read past the operands of srelu24's e4m3 2:4 GEMMs?

The 7B study's srelu24 run stopped at its first 2:4 step with an illegal memory access in
cusparseLtMatmul (dX = dZ W1, e4m3; lab/LOG.md). This probe makes one GEMM's operands with the
project's own kernels (compressed A from srelu_sparsify_2to4 and compressed_to_e4m3, K-major B
from kmajor_e4m3), optionally copies A and/or B to the end of a 2 MiB-multiple allocation, and
runs the product through torch._cslt_sparse_mm or this project's cached plan. Under
compute-sanitizer with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (an allocation is then a cudaMalloc of
exactly its size) memcheck names any read past an operand, its kernel and its distance; the
allocation-end placement alone does not reliably fault, as consecutive allocations can be
adjacent in the address space.

    python lab/probe_cslt_bounds.py --info      # compressed sizes, searched ids
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        python lab/probe_cslt_bounds.py --shape 0 --alg 0 --end none
"""
import argparse
import sys

import torch
from torch import Tensor

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


def at_end(t: Tensor, pad: int) -> Tensor:
    """A copy of contiguous `t` followed by `pad` spare bytes, ending at the last byte of a 2 MiB-multiple
    allocation (an unmapped page after it once PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""
    nbytes = t.numel() * t.element_size()
    total = -(-(nbytes + pad) // (2 << 20)) * (2 << 20)
    raw = torch.empty(total, dtype=torch.uint8, device="cuda")
    out = raw[total - pad - nbytes:total - pad].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def operands(m: int, k: int, n: int, seed: int):
    """(a8 [m, 5k/8] e4m3 compressed, b8 [k, n] K-major e4m3): from a random Z through the
    project's own sparsify and conversion kernels, in ordinary allocations."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    buf, _ = srelu_sparsify_2to4(z)
    a8, _ = fp8_sparse.compressed_to_e4m3(buf, m, k)
    b, _ = fp8_sparse.kmajor_e4m3(torch.randn(k, n, device="cuda", generator=g))
    return a8, b


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--info", action="store_true")
    p.add_argument("--shape", type=int, default=0, help="index into SHAPES")
    p.add_argument("--alg", type=int, default=0)
    p.add_argument("--end", choices=["none", "a", "b", "ab"], default="ab",
                   help="which operands sit at the end of their allocation")
    p.add_argument("--pad", type=int, default=0, help="spare bytes after each operand placed at the end")
    p.add_argument("--path", choices=["torch", "plan"], default="torch")
    args = p.parse_args()
    if args.info:
        return info()
    name, m, k, n, tr = SHAPES[args.shape]
    tag = f"{name} alg {args.alg} end={args.end} pad={args.pad} {args.path}"
    a8, b8 = operands(m, k, n, 0)
    torch.cuda.synchronize()
    print(f"{tag}: operands ok", flush=True)
    want = C.torch_mm(a8, b8, args.alg, tr)
    torch.cuda.synchronize()
    print(f"{tag}: ordinary allocations ok", flush=True)
    a = at_end(a8, args.pad) if "a" in args.end else a8
    bt = at_end(b8.t(), args.pad) if "b" in args.end else b8.t()  # b8 is the transpose of a row-major [n, k]
    if args.path == "torch":
        got = C.torch_mm(a, bt.t(), args.alg, tr)
    else:
        got = C._Plan(C._library(a.device), m, k, n, True, args.alg, a.device, tr, True).run(a, bt.t())
    torch.cuda.synchronize()
    print(f"{tag}: ok, equal {torch.equal(got, want)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
