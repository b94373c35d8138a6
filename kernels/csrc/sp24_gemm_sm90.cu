// 2:4-sparse bf16 GEMMs on Hopper (sm90a) from CUTLASS 3.x, behind a plain C ABI that
// kernels/cutlass_sp24.py calls through ctypes (no torch headers, no extension build).
//
//   D [M, N] (bf16) = A [M, K] (2:4 along K, compressed) @ B [K, N] (bf16), fp32 accumulation
//
// A is passed compressed: its kept values row-major [M, K/2] and CUTLASS's metadata E
// (SparseConfig::fill_layoutE; kernels/cslt_layout.py "cutlass_k64/128" is its PyTorch
// reference; the FFN's Triton kernels write cuSPARSELt's layout, not this one).
// B comes row-major [K, N] ("n" major) or as the transpose of a row-major [N, K] ("k" major);
// D row-major [M, N] or column-major (the transpose of a row-major [N, M]: the weight
// gradient dW2 comes out in the layout the weight has).
//
// One object file per tile configuration (-DSP24_CFG=n), so that make can build them in
// parallel; each exports
//   sp24_gemm_c<n>_<b major><d major>(a, e, b, d, M, N, K, workspace, workspace_bytes, stream)
//   sp24_gemm_c<n>_workspace(M, N, K)
// and configuration 0 also exports the CUTLASS compressor for the tests
// (sp24_compress_k<TileK>) and sp24_abi_version.
#include <cstdint>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/transform/device/transform_universal_adapter.hpp"
#include "cutlass/transform/kernel/sparse_gemm_compressor.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

#if !defined(SP24_CFG)
#define SP24_CFG 0
#endif

namespace {

using Element = cutlass::bfloat16_t;
using Acc = float;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;
using ProblemShape = Shape<int, int, int, int>;
constexpr int kAlign = 8;  // 16 bytes of bf16: TMA's alignment

// status codes returned to Python (kernels/cutlass_sp24.py names them)
enum : int { kOk = 0, kCannotImplement = 1, kWorkspaceTooSmall = 2, kInitFailed = 3, kRunFailed = 4, kNotBuilt = 5 };

// Check, initialise and enqueue a CUTLASS device operator (the GEMMs and the compressor alike).
template <class Op>
int launch(typename Op::Arguments const& args, void* ws, size_t ws_bytes, cudaStream_t stream) {
  Op op;
  if (op.can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  if (Op::get_workspace_size(args) > ws_bytes) return kWorkspaceTooSmall;
  if (op.initialize(args, ws, stream) != cutlass::Status::kSuccess) return kInitFailed;
  if (op.run(stream) != cutlass::Status::kSuccess) return kRunFailed;
  return cudaGetLastError() == cudaSuccess ? kOk : kRunFailed;
}

template <class TileShape, class ClusterShape, class Schedule, class LayoutB, class LayoutD>
struct Sp24Gemm {
  using EpilogueSchedule = cute::conditional_t<cute::is_same_v<Schedule, Pingpong>,
                                               cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassSparseTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc,
      void, LayoutD, kAlign,          // no C operand: D = A @ B
      Element, LayoutD, kAlign, EpilogueSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassSparseTensorOp,
      Element, RowMajor, kAlign, Element, LayoutB, kAlign, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using SparseConfig = typename CollectiveMainloop::SparseConfig;
  using ElementE = typename CollectiveMainloop::ElementE;

  static typename Gemm::Arguments arguments(const void* a, const void* e, const void* b, void* d,
                                            int M, int N, int K) {
    ProblemShape problem{M, N, K, 1};
    auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(N, K, 1));
    auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(M, N, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        problem,
        {static_cast<const Element*>(a), SparseConfig::fill_layoutA(problem),
         static_cast<const Element*>(b), stride_b,
         static_cast<const ElementE*>(e), SparseConfig::fill_layoutE(problem)},
        {{1.0f, 0.0f}, nullptr, stride_d, static_cast<Element*>(d), stride_d}};
    args.hw_info.sm_count = sm_count();
    return args;
  }

  static int sm_count() {  // once per process: the adapter would query it on every call
    // (device 0's count: every GPU of a host is the same model on the machines this serves)
    static int count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
    return count;
  }

  static size_t workspace(int M, int N, int K) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, M, N, K));
  }

  static int run(const void* a, const void* e, const void* b, void* d, int M, int N, int K,
                 void* ws, size_t ws_bytes, cudaStream_t stream) {
    return launch<Gemm>(arguments(a, e, b, d, M, N, K), ws, ws_bytes, stream);
  }
};

// The tile configurations; scripts/bench_sp24_gemm.py times them all at the FFN's shapes.
#if SP24_CFG == 0
using CfgTile = Shape<_128, _128, _128>; using CfgCluster = Shape<_1, _2, _1>; using CfgSched = Coop;
#elif SP24_CFG == 1
using CfgTile = Shape<_128, _256, _64>;  using CfgCluster = Shape<_1, _2, _1>; using CfgSched = Coop;
#elif SP24_CFG == 2
using CfgTile = Shape<_256, _128, _64>;  using CfgCluster = Shape<_2, _1, _1>; using CfgSched = Coop;
#elif SP24_CFG == 3
using CfgTile = Shape<_128, _128, _128>; using CfgCluster = Shape<_2, _1, _1>; using CfgSched = Pingpong;
#elif SP24_CFG == 4
using CfgTile = Shape<_128, _128, _64>;  using CfgCluster = Shape<_1, _2, _1>; using CfgSched = Coop;
// 2x2 clusters: A and B tiles both multicast, a quarter less L2 traffic per tile than 1x2 / 2x1 (the
// sparse GEMM streams its operands twice as fast as the dense one at the same tile)
#elif SP24_CFG == 5
using CfgTile = Shape<_128, _256, _64>;  using CfgCluster = Shape<_2, _2, _1>; using CfgSched = Coop;
#elif SP24_CFG == 6
using CfgTile = Shape<_256, _128, _64>;  using CfgCluster = Shape<_2, _2, _1>; using CfgSched = Coop;
#else
#error "unknown SP24_CFG"
#endif

}  // namespace

#define SP24_CAT2(a, b) a##b
#define SP24_CAT(a, b) SP24_CAT2(a, b)
#define SP24_NAME(suffix) SP24_CAT(SP24_CAT(sp24_gemm_c, SP24_CFG), suffix)

// <B major><D major>: n = row-major B [K, N], k = B given as a row-major [N, K];
// r = row-major D [M, N], c = column-major D.
#define SP24_EXPORT(suffix, LB, LD)                                                              \
  extern "C" int SP24_NAME(suffix)(const void* a, const void* e, const void* b, void* d, int M, \
                                   int N, int K, void* ws, size_t ws_bytes, cudaStream_t s) {    \
    return Sp24Gemm<CfgTile, CfgCluster, CfgSched, LB, LD>::run(a, e, b, d, M, N, K, ws, ws_bytes, s);    \
  }                                                                                              \
  extern "C" size_t SP24_CAT(SP24_NAME(suffix), _workspace)(int M, int N, int K) {              \
    return Sp24Gemm<CfgTile, CfgCluster, CfgSched, LB, LD>::workspace(M, N, K);                           \
  }

SP24_EXPORT(_kr, ColMajor, RowMajor)  // Y = A24 W2^T: B = W2 [d, F], row-major [N, K]
SP24_EXPORT(_nr, RowMajor, RowMajor)  // dX = dZ W1, dW1 = S(dZ)^T X: B row-major [K, N]
SP24_EXPORT(_nc, RowMajor, ColMajor)  // dW2 = (S(A24)^T dY)^T written as [d, F]

#if SP24_CFG == 0
namespace {
// CUTLASS's own compressor: the tests compare the metadata our Triton kernels write with it.
template <int TileK>
struct Compress {
  using G = Sp24Gemm<Shape<_128, _128, Int<TileK>>, Shape<_1, _1, _1>, Coop, ColMajor, RowMajor>;
  using Kernel = cutlass::transform::kernel::StructuredSparseCompressor<
      ProblemShape, Element, RowMajor, typename G::SparseConfig, cutlass::arch::Sm90>;
  using Op = cutlass::transform::device::TransformUniversalAdapter<Kernel>;

  static int run(const void* a_dense, void* a_comp, void* e, int M, int K, void* ws, size_t ws_bytes,
                 cudaStream_t stream) {
    ProblemShape problem{M, 1, K, 1};
    auto stride_a = cutlass::make_cute_packed_stride(cutlass::gemm::TagToStrideA_t<RowMajor>{}, make_shape(M, K, 1));
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = G::sm_count();
    return launch<Op>(typename Op::Arguments{problem, {a_dense, stride_a, a_comp, e}, hw}, ws, ws_bytes, stream);
  }
};
}  // namespace

extern "C" int sp24_compress_k64(const void* a, void* ac, void* e, int M, int K, void* ws, size_t wsb, cudaStream_t s) {
  return Compress<64>::run(a, ac, e, M, K, ws, wsb, s);
}
extern "C" int sp24_compress_k128(const void* a, void* ac, void* e, int M, int K, void* ws, size_t wsb, cudaStream_t s) {
  return Compress<128>::run(a, ac, e, M, K, ws, wsb, s);
}
// Bumped whenever an exported signature changes; kernels/cutlass_sp24.py refuses other values.
extern "C" int sp24_abi_version() { return 1; }
#endif
