"""Compiles the project's Triton kernels for sm90 (Hopper) on a machine without a GPU, through the
product's own launch code: tests/test_compile_sm90.py runs it in subprocesses, outside the
interpreter mode of the test session (tests/conftest.py).

    python tests/compile_sm90.py SHARD SHARDS

Triton's active driver is replaced by one that names an sm90 target, and every launch compiles
(to PTX and a cubin, with the ptxas in Triton's wheel) without running: the wrappers are called
on CPU tensors of the 1B and 7B FFN's shapes (uninitialised: nothing is read), so each kernel is
compiled with the arguments, constexprs and num_warps its launch site gives it. Where a wrapper
chooses its path by `is_cuda`, the GPU branch's launcher is called instead. A line per
compilation, `compiled <module>.<kernel> shared=<bytes> <constexpr>=<value>,...`, and from shard 0 a line per kernel the
package defines, `kernel <module>.<kernel>`, so that the test can tell one that nothing compiled.
"""
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 232448  # bytes of shared memory a block may use on sm90 (227 KiB)
BITWISE_ROUNDING = "0f4B400000"  # 1.5 2^23 in PTX: the interpreter's rounding on the bits (float8/cast.py)

# the FFN's shapes: (d, F, tokens of a micro-batch) at 1B (8 x 2048) and 7B (2 x 4096)
SHAPES = {"1B": (2048, 8448, 16384), "7B": (4096, 16512, 8192)}


class CompileOnly:
    """A driver for triton.runtime.driver: an sm90 target, device 0, the null stream."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_launches(report):
    """Every JITFunction launch compiles for TARGET and runs nothing; report(fn, kernel) after each."""
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        report(self, kernel)
        return kernel

    driver.set_active(CompileOnly())
    JITFunction.run = compile_only


def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def weight_conversions():
    """srelu24's kept e4m3 conversions of fp32 (and bf16) W1 [F, d], W2 [d, F]: the tensorwise pairs
    (paired.py) and one by one (rowwise: fp8_sparse.kmajor_e4m3, fp8_gemm.b_operand's casts); X's
    pair (e4m3) in the tensorwise forward and dY's (e5m2 and e4m3) in its backward."""
    from srelu24_kernels.float8 import gemm, paired, sparse
    for d, f, t in SHAPES.values():
        for dt in (torch.float32, torch.bfloat16):
            w1, w2 = empty(f, d, dtype=dt), empty(d, f, dtype=dt)
            paired.paired_casts(w1, "tensor", "cols")
            paired.paired_casts(w2, "rows", "tensor")
            sparse.kmajor_e4m3(w2.t())   # Y's B: rows of W2
            sparse.kmajor_e4m3(w1)       # dX's B: columns of W1
            gemm.rowwise_e4m3(w1)        # Z's B, rowwise
        paired.paired_casts(empty(t, d), "tensor", "cols", dtypes=(paired.E5M2, paired.E4M3))  # dY's pair
        paired.paired_casts(empty(t, d), "tensor", "cols")  # X's pair (forward)


def scaled_casts():
    """cast.scaled_cast: one scale, one per row, one per column; transposed or not; e4m3 and e5m2 from
    bf16 (activations, gradients), e4m3 from fp32 (weights)."""
    from srelu24_kernels.float8.cast import E4M3, E5M2, scaled_cast
    m, n = 256, 320
    for dt, dtypes in ((torch.bfloat16, (E4M3, E5M2)), (torch.float32, (E4M3,))):
        t = empty(m, n, dtype=dt)
        for dtype in dtypes:
            for scale in (empty(1, dtype=torch.float32), empty(m, 1, dtype=torch.float32),
                          empty(1, n, dtype=torch.float32)):
                for transpose in (False, True):
                    scaled_cast(t, scale, dtype, transpose)


def scales_and_rows():
    """fp8_gemm's scale kernel (amaxes in bf16 and fp32, both formats) and its one-launch rowwise
    cast of activations [T, K] (K = d, F) and gradients."""
    from srelu24_kernels.float8 import gemm
    for dt in (torch.bfloat16, torch.float32):
        for fmax in (448.0, 57344.0):
            for pow2 in ((False, True) if dt == torch.bfloat16 else (False,)):
                gemm.amax_to_scale_kernel(empty(1, dtype=dt), fmax, pow2)
        gemm.amax_to_scale_kernel(empty(256, 1, dtype=dt), 448.0, dt == torch.bfloat16)  # rowwise amaxes
    for d, f, t in SHAPES.values():
        for k in (d, f, t):  # t: dW's K, the tokens
            gemm.rowwise_e4m3(empty(64, k))
    gemm.rowwise_e4m3(empty(64, 1000))  # a row length that is not a power of 2's


def sparse_operands():
    """The 2:4 GEMMs' e4m3 operands and unscaling (fp8_sparse): a compressed [m, k] buffer per GEMM
    (Y, dX: k = F; dW2, dW1: k = the padded tokens), the dense rows' cast, the product's unscaling
    in place, into fp32, with dW2's dense columns, added into .grad."""
    from srelu24_kernels.cusparselt.layout import compressed_numel, empty_compressed
    from srelu24_kernels.float8 import sparse
    for d, f, t in SHAPES.values():
        for m, k in ((t, f), (f, t)):
            buf = empty_compressed(compressed_numel(m, k), torch.bfloat16, "cpu").view(m, -1)
            sparse.compressed_to_e4m3(buf, m, k)
        sparse.rows_to_e4m3(empty(64, t))  # the dense features' rows [k, T] (dense_mm off the GPU path)
    y, rows, cols = empty(256, 384), empty(256, dtype=torch.float32), empty(384, dtype=torch.float32)
    slots, g = torch.full((384,), -1, dtype=torch.int32), empty(8, 256)
    sparse.unscale_(y, row_scale=rows, col_scale=cols)
    for out_dtype in (torch.bfloat16, torch.float32):
        for dense in (None, (slots, g)):
            for into in (None, empty(256, 384, dtype=out_dtype)):
                sparse.unscale(y, row_scale=rows, col_scale=cols, out_dtype=out_dtype, dense_columns=dense,
                               accumulate_into=into)


def sparsify_passes():
    """The Triton sparsify passes (sparsify.py, sparsify_backward.py) as the op runs them without the
    CUDA library: the forward with and without the statistics and counts, the backward's operands
    with and without the forward's mask, and the dense features' rows and columns."""
    from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4
    from srelu24_kernels.srelu24.sparsify_backward import backward_operands, write_dense_columns, write_dense_rows
    t, f, d = 256, 512, 128
    z = empty(t, f)
    srelu_sparsify_2to4(z, backend="triton")
    srelu_sparsify_2to4(z, totals=torch.zeros(3, dtype=torch.float64), backend="triton")
    srelu_sparsify_2to4(z, counts=False, backend="triton")
    dense = torch.arange(4)
    for reuse in (True, False):
        backward_operands(z, empty(t, f), torch.randperm(t), dense, reuse_forward_mask=reuse, backend="triton")
    for dt in (torch.float32, torch.bfloat16):
        for accumulate in (False, True):
            write_dense_rows(empty(f, d, dtype=dt), dense, empty(4, d), accumulate=accumulate)
        slots = torch.full((f,), -1, dtype=torch.int32)
        slots[:4] = torch.arange(4, dtype=torch.int32)
        write_dense_columns(empty(d, f, dtype=dt), slots, empty(4, d))


CASES = [weight_conversions, scaled_casts, scales_and_rows, sparse_operands, sparsify_passes]


def kernels() -> list[str]:
    """Every kernel of the srelu24_kernels package: its JITFunctions named `*_kernel` (the others are
    device functions that kernels call)."""
    import importlib
    import pkgutil

    import srelu24_kernels
    names = []
    for info in pkgutil.walk_packages(srelu24_kernels.__path__, "srelu24_kernels."):
        module = importlib.import_module(info.name)
        names += [f"{info.name}.{k}" for k, v in vars(module).items()
                  if isinstance(v, JITFunction) and k.endswith("_kernel") and v.fn.__module__ == info.name]
    return names


def main(shard: int, shards: int) -> None:
    def report(fn, kernel):
        name = f"{fn.fn.__module__}.{fn.fn.__name__}"
        ptx = kernel.asm["ptx"]
        assert kernel.asm.get("cubin"), f"{name}: no cubin"
        assert BITWISE_ROUNDING not in ptx or "float8" not in fn.fn.__module__, \
            f"{name} rounds to float8 on the bits (the interpreter's path), not with the GPU's conversion"
        assert kernel.metadata.shared <= MAX_SHARED, f"{name} needs {kernel.metadata.shared} bytes of shared memory"
        names = fn.arg_names  # the constexprs (and the arguments Triton specialised on) of this build
        consts = ",".join(f"{names[k[0]]}={v}" for k, v in sorted(kernel.src.constants.items()) if len(k) == 1)
        print(f"compiled {name} shared={kernel.metadata.shared} {consts or '-'}", flush=True)

    compile_launches(report)
    for case in CASES[shard::shards]:
        case()
    if shard == 0:
        for name in kernels():
            print("kernel", name)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
