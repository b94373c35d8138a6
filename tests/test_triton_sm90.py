"""The float8 Triton kernels compile for sm90 (Hopper) on any machine: triton.compile down to a
cubin with the ptxas in Triton's wheel. The interpreter runs the kernels' Python, not their
lowering; this catches what only the GPU compiler would reject. In a subprocess, because the
test session runs Triton in interpreter mode (tests/conftest.py)."""
import subprocess
import sys

from helpers import BASE_ENV, ROOT, background

SHARDS = 2  # every other kernel in each of two processes

SCRIPT = r'''
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from srelu24_kernels.float8 import cast as fp8_cast, gemm as fp8_gemm, sparse as fp8_sparse
from srelu24_kernels.srelu24 import sparsify_backward as srelu24_sparsify_backward

CAST = {"x_ptr": "*bf16", "s_ptr": "*fp32", "out_ptr": "*u8", "M": "i32", "N": "i32", "stride_m": "i32",
        "stride_n": "i32", "SCALE": "constexpr", "TRANSPOSE": "constexpr", "E5M2": "constexpr", "FMAX": "constexpr",
        "BM": "constexpr", "BN": "constexpr"}
kernels = [(f"scaled_cast e5m2={e5} scale={sc} transpose={tr}", fp8_cast._scaled_cast_kernel, CAST,
            {"SCALE": sc, "TRANSPOSE": tr, "E5M2": e5, "FMAX": 57344.0 if e5 else 448.0, "BM": 64, "BN": 64})
           for e5 in (False, True) for sc in (0, 1, 2) for tr in (False, True)]
COLUMN_CAST = {"b_ptr": "*bf16", "amax_ptr": "*i32", "out_ptr": "*u8", "scale_ptr": "*fp32", "inv_ptr": "*fp32",
               "K": "i32", "N": "i32", "stride_k": "i32", "stride_n": "i32", "BK": "constexpr", "BN": "constexpr"}
kernels += [
    ("rows_to_e4m3", fp8_sparse._rows_to_e4m3_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32",
     "stride_x": "i32", "C": "constexpr", "BLOCK": "constexpr"}, {"C": 8256, "BLOCK": 1024}),
    ("column_amax", fp8_cast._column_amax_kernel, {"b_ptr": "*bf16", "amax_ptr": "*i32", "K": "i32", "N": "i32",
     "stride_k": "i32", "stride_n": "i32", "BK": "constexpr", "BN": "constexpr"},
     dict(zip(("BK", "BN"), fp8_cast.COLUMN_AMAX_TILE)), {"num_warps": 8}),  # as column_amax_bits launches it
    ("column_cast", fp8_cast._column_cast_kernel, COLUMN_CAST, {"BK": 64, "BN": 64}),
    *[(f"compressed_to_e4m3 blocks={n}", fp8_sparse._compressed_to_e4m3_kernel, {"x_ptr": "*bf16", "words_ptr": "*i32",
       "out_ptr": "*u8", "scale_ptr": "*fp32", "M": "i32", "n_blocks": "i32", "C": "constexpr", "BLOCK": "constexpr",
       "BLOCKS": "constexpr"}, {"C": 8256, "BLOCK": 1024, "BLOCKS": n}) for n in (1, 2, 8)],
    *[(f"unscale out={out} dense_columns={dense}", fp8_sparse._unscale_kernel, {"y_ptr": "*bf16", "out_ptr": f"*{out}",
       "sr_ptr": "*fp32", "sc_ptr": "*fp32", "slot_ptr": "*i32" if dense else "*bf16", "g_ptr": "*bf16", "M": "i32",
       "N": "i32", "DENSE_COLUMNS": "constexpr", "BM": "constexpr", "BN": "constexpr"},
       {"DENSE_COLUMNS": dense, "BM": 32, "BN": 128})
      for out in ("bf16", "fp32") for dense in (False, True)],  # in place; an fp32 weight's gradient; dW2's dense columns
    # srelu24's fp32 weights in e4m3 mode: the conversions that read them
    *[(f"scaled_cast fp32 scale={sc} transpose={tr}", fp8_cast._scaled_cast_kernel, {**CAST, "x_ptr": "*fp32"},
       {"SCALE": sc, "TRANSPOSE": tr, "E5M2": False, "FMAX": 448.0, "BM": 64, "BN": 64})
      for sc, tr in ((0, False), (0, True), (2, True))],  # W1 tensorwise; W2's columns (dA), tensorwise and rowwise
    ("amax_to_scale fp32", fp8_gemm._amax_to_scale_kernel, {"amax_ptr": "*fp32", "scale_ptr": "*fp32",
     "inv_ptr": "*fp32", "n": "i32", "FMAX": "constexpr", "POW2": "constexpr", "BLOCK": "constexpr"},
     {"FMAX": 448.0, "POW2": False, "BLOCK": 1024}),  # tensorwise's scale of an fp32 weight
    # the bf16 fallbacks' dense features into an fp32 weight's gradient
    ("dense_rows fp32", srelu24_sparsify_backward._dense_rows_kernel, {"w_ptr": "*fp32", "dense_ptr": "*i64",
     "g_ptr": "*bf16", "k": "i32", "D": "i32", "BLOCK_K": "constexpr", "BLOCK_D": "constexpr"},
     {"BLOCK_K": 32, "BLOCK_D": 128}),
    ("dense_columns fp32", srelu24_sparsify_backward._dense_columns_kernel, {"w_ptr": "*fp32", "slot_ptr": "*i32",
     "g_ptr": "*bf16", "D": "i32", "F": "i32", "BLOCK_D": "constexpr", "BLOCK_F": "constexpr"},
     {"BLOCK_D": 32, "BLOCK_F": 128}),
    ("rows_to_e4m3 fp32", fp8_sparse._rows_to_e4m3_kernel, {"x_ptr": "*fp32", "out_ptr": "*u8", "scale_ptr": "*fp32",
     "stride_x": "i32", "C": "constexpr", "BLOCK": "constexpr"}, {"C": 4096, "BLOCK": 1024}),
    ("column_amax fp32", fp8_cast._column_amax_kernel, {"b_ptr": "*fp32", "amax_ptr": "*i32", "K": "i32", "N": "i32",
     "stride_k": "i32", "stride_n": "i32", "BK": "constexpr", "BN": "constexpr"},
     dict(zip(("BK", "BN"), fp8_cast.COLUMN_AMAX_TILE)), {"num_warps": 8}),
    ("column_cast fp32", fp8_cast._column_cast_kernel, {**COLUMN_CAST, "b_ptr": "*fp32"},
     {"BK": 64, "BN": 64}),  # W1 for dX, W2 for dA
    ("rowwise_e4m3 fp32", fp8_gemm._rowwise_e4m3_kernel, {"x_ptr": "*fp32", "out_ptr": "*u8", "scale_ptr": "*fp32",
     "inv_ptr": "*fp32", "M": "i32", "stride_m": "i32", "K": "constexpr", "BK": "constexpr", "BM": "constexpr"},
     {"K": 4096, "BK": 4096, "BM": fp8_gemm.ROWWISE_ELEMENTS // 4096}, {"num_warps": 8}),
    *[(f"rowwise_e4m3 K={k}", fp8_gemm._rowwise_e4m3_kernel, {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32",
       "inv_ptr": "*fp32", "M": "i32", "stride_m": "i32", "K": "constexpr", "BK": "constexpr", "BM": "constexpr"},
       {"K": k, "BK": triton.next_power_of_2(k), "BM": fp8_gemm.ROWWISE_ELEMENTS // triton.next_power_of_2(k)},
       {"num_warps": 8}) for k in (4096, 1000)],  # as rowwise_e4m3 launches it
    *[(f"amax_to_scale fmax={fmax} pow2={pow2}", fp8_gemm._amax_to_scale_kernel, {"amax_ptr": "*bf16", "scale_ptr": "*fp32",
       "inv_ptr": "*fp32", "n": "i32", "FMAX": "constexpr", "POW2": "constexpr", "BLOCK": "constexpr"},
       {"FMAX": fmax, "POW2": pow2, "BLOCK": 1024}) for fmax, pow2 in ((448.0, True), (448.0, False), (57344.0, False))],
]
shard, shards = map(int, sys.argv[1:3])
for name, fn, signature, constexprs, *options in kernels[shard::shards]:
    k = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options=options[0] if options else None)
    assert "cubin" in k.asm and k.asm["ptx"], name
    # the casts use the GPU's conversion, not the interpreter's bit-level rounding (its 1.5 2^23 constant)
    assert "0f4B400000" not in k.asm["ptx"], name + " rounds on the bits"
    print("compiled", name)
'''


@background
def launches(ctx):
    """The compiling processes, launched with the session (helpers.background)."""
    env = {k: v for k, v in BASE_ENV.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(ctx.tmp("triton") / "triton_cache")
    env["PYTHONPATH"] = str(ROOT)

    def compile_shard(shard: int):
        return lambda: subprocess.run([sys.executable, "-c", SCRIPT, str(shard), str(SHARDS)], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=600)

    return {f"test_float8_kernels_compile_for_sm90[{shard}]": compile_shard(shard) for shard in range(SHARDS)}


def test_float8_kernels_compile_for_sm90(launched):
    runs = [launched[f"test_float8_kernels_compile_for_sm90[{shard}]"].result() for shard in range(SHARDS)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert sum(r.stdout.count("compiled") for r in runs) == 37
