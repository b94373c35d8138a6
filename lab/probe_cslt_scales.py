"""Can cuSPARSELt apply float8 scales itself on sm90, from device memory?

srelu24's e4m3 2:4 GEMMs scale A per row and B per column (powers of 2) and undo the scales in a
pass over the product (srelu24_kernels/float8/sparse.py: `unscale`), because cuSPARSELt's alpha
vector is refused for e4m3 on sm90. Per-tensor scales would let the GEMM undo them, with no pass
and no host read of a scale, if the library takes them from device memory: the matmul
descriptor's A_SCALE_MODE / B_SCALE_MODE (SCALAR_32F) and A_SCALE_POINTER / B_SCALE_POINTER, which
cuSPARSELt documents for its block-scaled sm100 formats. This probe asks, for one GEMM of the 1B
FFN's shapes, built with the project's own operands (srelu_sparsify_2to4, compressed_to_e4m3,
kmajor_e4m3), and reports each case's statuses and its product against the unscaled one times the
scales:

    unscaled        the descriptors of srelu24_kernels/cusparselt/binding.py (the reference)
    pointers        A_SCALE_POINTER, B_SCALE_POINTER only (mode left at its default)
    scalar modes    A/B_SCALE_MODE = SCALAR_32F and the pointers
    alpha vector    ALPHA_VECTOR_SCALING = 1, alpha a device vector [m] (expected: refused)
    fp32 D, beta 1  D (= C) fp32, beta 1: a product added into an fp32 gradient by the GEMM

    python lab/probe_cslt_scales.py
"""
import ctypes

import torch

from srelu24_kernels.cusparselt import binding as C
from srelu24_kernels.float8 import sparse as fp8_sparse
from srelu24_kernels.srelu24.sparsify import srelu_sparsify_2to4

# cusparseLt.h (0.7+): cusparseLtMatmulDescAttribute_t, cusparseLtMatmulMatrixScale_t
ALPHA_VECTOR_SCALING, A_SCALE_MODE, B_SCALE_MODE, A_SCALE_POINTER, B_SCALE_POINTER = 5, 10, 11, 15, 16
SCALAR_32F = 1
CUDA_R_32F = 0


def plan(lib, m, k, n, alg, attrs, d_dtype=C._CUDA_R_16BF):
    """(status of each step, plan or None): binding._Plan's descriptors for an e4m3 A [m, k] and a
    K-major B, the attributes set on the matmul descriptor before the algorithm is chosen."""
    h, st = lib.handle.ptr, {}
    a, b, d, mm, sel, pl = (C._Opaque() for _ in range(6))
    e4 = C._CUDA_R_8F_E4M3
    st["a"] = lib.cusparseLtStructuredDescriptorInit(h, a.ptr, m, k, k, 16, e4, C._ORDER_ROW, C._SPARSITY_50)
    st["b"] = lib.cusparseLtDenseDescriptorInit(h, b.ptr, n, k, k, 16, e4, C._ORDER_ROW)
    st["d"] = lib.cusparseLtDenseDescriptorInit(h, d.ptr, m, n, n, 16, d_dtype, C._ORDER_ROW)
    st["mm"] = lib.cusparseLtMatmulDescriptorInit(h, mm.ptr, C._OP_N, C._OP_T, a.ptr, b.ptr, d.ptr, d.ptr,
                                                  C._COMPUTE_32F)
    for attr, value in attrs:
        st[f"attr{attr}"] = lib.cusparseLtMatmulDescSetAttribute(h, mm.ptr, attr, ctypes.byref(value),
                                                                 ctypes.sizeof(value))
    st["sel"] = lib.cusparseLtMatmulAlgSelectionInit(h, sel.ptr, mm.ptr, C._ALG_DEFAULT)
    alg_id = ctypes.c_int(alg)
    lib.cusparseLtMatmulAlgSetAttribute(h, sel.ptr, C._ALG_CONFIG_ID, ctypes.byref(alg_id), ctypes.sizeof(alg_id))
    st["plan"] = lib.cusparseLtMatmulPlanInit(h, pl.ptr, mm.ptr, sel.ptr)
    keep = (a, b, d, mm, sel, pl)
    return st, (keep if all(v == 0 for v in st.values()) else None)


def run(lib, keep, a8, b8, out, alpha_ptr=None, beta=0.0):
    h = lib.handle.ptr
    ws = ctypes.c_size_t(0)
    s = lib.cusparseLtMatmulGetWorkspace(h, keep[5].ptr, ctypes.byref(ws))
    workspace = torch.empty(max(ws.value, 1), dtype=torch.uint8, device=a8.device)
    stream = (ctypes.c_void_p * 1)(torch.cuda.current_stream().cuda_stream)
    alpha, b_ = ctypes.c_float(1.0), ctypes.c_float(beta)
    s = s or lib.cusparseLtMatmul(h, keep[5].ptr, alpha_ptr if alpha_ptr is not None else ctypes.byref(alpha),
                                  a8.data_ptr(), b8.data_ptr(), ctypes.byref(b_), out.data_ptr(), out.data_ptr(),
                                  workspace.data_ptr(), stream, 1)
    torch.cuda.synchronize()
    return s


def main() -> None:
    torch.manual_seed(0)
    m, k, n = 8192, 8448, 2048  # 1B: Y = A24 W2^T, half a micro-batch of tokens
    z = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    buf, _ = srelu_sparsify_2to4(z)
    a8, _ = fp8_sparse.compressed_to_e4m3(buf, m, k)
    b8, _ = fp8_sparse.kmajor_e4m3(torch.randn(k, n, device="cuda") / k ** 0.5)
    alg = C.searched_alg(a8, b8)
    lib = C._library(a8.device)
    lib.cusparseLtMatmulDescSetAttribute = getattr(ctypes.CDLL(C._find_library()), "cusparseLtMatmulDescSetAttribute")
    lib.cusparseLtMatmulDescSetAttribute.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p,
                                                                             ctypes.c_size_t]
    ver = ctypes.c_int(0)
    lib.cusparseLtGetVersion(lib.handle.ptr, ctypes.byref(ver))
    print(f"cuSPARSELt {ver.value}, {torch.cuda.get_device_name()}, alg {alg}")

    st, keep = plan(lib, m, k, n, alg, [])
    ref = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    s = run(lib, keep, a8, b8, ref)
    print(f"unscaled: {st} run {s}, |ref| {ref.float().norm():.4e}")
    sa = torch.tensor([2.0], device="cuda")
    sb = torch.tensor([0.25], device="cuda")
    want = (ref.float() * 0.5).bfloat16()
    pa, pb = ctypes.c_void_p(sa.data_ptr()), ctypes.c_void_p(sb.data_ptr())
    mode = ctypes.c_int(SCALAR_32F)
    for name, attrs in (("pointers", [(A_SCALE_POINTER, pa), (B_SCALE_POINTER, pb)]),
                        ("scalar modes", [(A_SCALE_MODE, mode), (B_SCALE_MODE, mode),
                                          (A_SCALE_POINTER, pa), (B_SCALE_POINTER, pb)])):
        st, keep = plan(lib, m, k, n, alg, attrs)
        if keep is None:
            print(f"{name}: refused {st}")
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        s = run(lib, keep, a8, b8, out)
        print(f"{name}: {st} run {s}; product == unscaled x 0.5: {torch.equal(out, want)}, "
              f"== unscaled: {torch.equal(out, ref)}, rel. diff to x0.5 "
              f"{((out.float() - want.float()).norm() / want.float().norm()).item():.3e}")

    one = ctypes.c_int(1)
    st, keep = plan(lib, m, k, n, alg, [(ALPHA_VECTOR_SCALING, one)])
    if keep is None:
        print(f"alpha vector: refused {st}")
    else:
        alpha = torch.full((m,), 0.5, device="cuda")
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        s = run(lib, keep, a8, b8, out, alpha_ptr=ctypes.c_void_p(alpha.data_ptr()))
        print(f"alpha vector: {st} run {s}; == unscaled x 0.5: {torch.equal(out, want)}")

    st, keep = plan(lib, m, k, n, alg, [], d_dtype=CUDA_R_32F)
    if keep is None:
        print(f"fp32 D: refused {st}")
    else:
        acc = torch.randn(m, n, device="cuda")
        want32 = acc + ref.float()
        got = acc.clone()
        s = run(lib, keep, a8, b8, got, beta=1.0)
        print(f"fp32 D, beta 1: {st} run {s}; rel. diff to acc + bf16 product "
              f"{((got - want32).norm() / want32.norm()).item():.3e} (bf16 rounding of the product: ~2e-3 x |ref|/|acc+ref|)")


if __name__ == "__main__":
    main()
