// The srelu24 FFN's sparsify passes in CUDA C++: the forward's srelu + 2:4 + compress, and the
// backward's three sparse operands from one pass over Z and dA.
//
// Same contracts as the Triton kernels `_srelu_sparsify_2to4_kernel` (srelu24_kernels/srelu24/sparsify.py, counts
// on, no statistics totals) and `_backward_operands_kernel` (srelu24_kernels/srelu24/sparsify_backward.py, the
// forward mask re-used), and bit-identical to them and to their PyTorch references for finite inputs
// (where dA holds Inf or NaN, or Z is NaN, they may disagree: the kernels take max(z, 0), which drops
// NaN, the Triton kernels' bf16 rounding turns NaN into -0.0, and this file's keys rank NaN highest):
//
//   forward   A24 compressed along features (cuSPARSELt's sm90 layout), kept non-zeros per feature,
//             and where asked each feature's largest A24 value over the tokens
//   backward  dZ compressed along features at the forward's 2:4 positions, rows in permuted order;
//             S(A24)^T and S(dZ)^T, 2:4 along tokens (tokens permuted), transposed; dense features
//             zeroed there and written exactly to [k, Tp] buffers. Where given the forward's maxima,
//             S(A24)^T is written in e4m3 (values scaled per row, e4m3 metadata layout), as
//             srelu24_kernels/float8/sparse.py's compressed_to_e4m3 would convert the bf16 one: 2:4
//             along tokens keeps each group's largest value, so a row's amax is the feature's maximum
//
// Why CUDA: the Triton backward kernel is instruction-bound (high SM issue, low DRAM throughput;
// benchmarks/RESULTS.md). cuSPARSELt's 2:4 metadata layout packs nibbles of rows 8 apart and of
// groups 4 apart into one 16-bit word, so in Triton every word costs cross-thread reductions and
// layout conversions. Here every thread owns whole
// metadata words, and the backward's tile moves once, through shared memory:
//
//   row pass     thread = 8 features (one 16-byte load) x 4 rows {a + 8b + 16c: b = 0, 1}, so a
//                feature-dimension word's row partners (b) are in-thread and its group partners
//                (h, 16 features away) 2 lanes away (one shuffle). The backward puts its masked
//                A24 and dZ tiles in shared memory.
//   token pass   (backward) thread = 2 features {16c + a, 16c + 8 + a} x 32 tokens of one
//                token-dimension operand: 4 whole metadata words, and 2 x 32 contiguous bytes of values
//                (stored as whole 32-byte sectors together with the neighbouring lane; in e4m3, 16 bytes a
//                lane, the other half of the sector from the next chunk's warp).
//
// Build: make kernels (build/srelu24_kernels.so); loaded by srelu24_kernels/srelu24/native.py through ctypes.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kTok = 64;      // tokens per block: one 64-row band of dZ's operand, two 32-token chunks
constexpr int kFeat = 64;     // features per block: one 64-row band of the token-dimension operands
constexpr int kThreads = 128;
#ifndef SRELU24_BW_MIN_BLOCKS
// blocks per SM the backward kernel's register budget must allow: 8 (64 registers; with nvcc 13.0 no
// spill on sm90, 16 bytes on sm80) was the fastest of 8, 6, 5 and 1 at 7B on the H200
// (lab/LOG.md; benchmarks/RESULTS.md)
#define SRELU24_BW_MIN_BLOCKS 8
#endif

// The 2:4 selection of one group (as srelu24_kernels.srelu24.sparsify.top2_of_4): the 2 largest magnitudes win,
// ties to the lower position. m0..m3 are magnitudes as bf16 bits without the sign (for finite values
// their integer order is the float order); key = m << 2 | (3 - position) makes them distinct with
// the tie-break built in, so the kept pair is the keys >= the second largest key.
struct Top2 {
  bool k0, k1, k2, k3;  // kept
  __device__ __forceinline__ uint32_t nibble() const {  // p0 | p1 << 2, p0 < p1 the kept positions
    return (k0 ? 0u : k1 ? 1u : 2u) | (k3 ? 12u : k2 ? 8u : 4u);
  }
  __device__ __forceinline__ uint32_t pair(uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) const {
    return (k0 ? v0 : k1 ? v1 : v2) | ((k3 ? v3 : k2 ? v2 : v1) << 16);  // the kept values, bf16 x2
  }
};

__device__ __forceinline__ Top2 top2(uint32_t m0, uint32_t m1, uint32_t m2, uint32_t m3) {
  const uint32_t c0 = m0 << 2 | 3, c1 = m1 << 2 | 2, c2 = m2 << 2 | 1, c3 = m3 << 2;
  const uint32_t hi01 = max(c0, c1), hi23 = max(c2, c3);
  const uint32_t second = max(min(hi01, hi23), max(min(c0, c1), min(c2, c3)));
  return Top2{c0 >= second, c1 >= second, c2 >= second, c3 >= second};
}

__device__ __forceinline__ float bf16_to_float(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ __forceinline__ uint32_t float_to_bf16(float x) {  // round to nearest, ties to even
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ uint32_t half_of(const uint4& q, int i) {  // bf16 element i (0..7) of 8
  const uint32_t w = i < 2 ? q.x : i < 4 ? q.y : i < 6 ? q.z : q.w;
  return (w >> (16 * (i & 1))) & 0xFFFF;
}

// The row pass's thread layout over a [64 rows, 64 features] block: thread t owns features
// 8o..8o+7 (o = t % 8) of rows a + 8b + 16c for b = 0, 1 and c = cp, cp + 2 (s = t / 8, a = s % 8,
// cp = s / 8). Its groups 2o, 2o + 1 are groups 4h + m (m = 2 (o % 2) + e) of the 32-column chunk
// o / 4, so the partner with the other h is 2 lanes away.
struct RowLayout {
  int o, a, cp, h;
  __device__ explicit RowLayout(int t) : o(t & 7), a((t >> 3) & 7), cp(t >> 6), h((t >> 1) & 1) {}
  __device__ int row(int j) const { return a + 8 * (j & 1) + 16 * (cp + 2 * (j >> 1)); }  // j = b + 2 ci
};

// One metadata word of a feature-dimension operand from the nibbles of this thread's two groups
// (e = 0, 1) of rows b = 0, 1: part[e] holds them at bits 4b + 8h. The h = 0 thread of a pair writes
// the word of its group e = 0 (m = 2 (o % 2)), the h = 1 thread that of e = 1; returns it and m.
__device__ __forceinline__ uint32_t combine_word(const uint32_t (&part)[2], const RowLayout& L, int* m) {
  const uint32_t mine = part[0] | (part[1] << 16);
  const uint32_t both = mine | __shfl_xor_sync(0xFFFFFFFFu, mine, 2);
  *m = 2 * (L.o & 1) + L.h;
  return (both >> (16 * L.h)) & 0xFFFF;
}

// Position of word (row block c, row a, m) of the 64x32 metadata tile `tile` (cuSPARSELt's layout).
__device__ __forceinline__ int64_t word_index(int64_t tile, int c, int a, int m) { return tile * 128 + 4 * (8 * c + a) + m; }

// The forward's kept pair of group e (0, 1) of this thread's 8 features in one row of A24 (cuSPARSELt's
// layout, as srelu_sparsify_kernel writes it): values `pair` (bf16 x2) and positions nibble p0 | p1 << 2.
// The row's two nibbles of groups 2o, 2o + 1 sit in words 2 (o % 2) and 2 (o % 2) + 1 of the row's
// (c, a) line of its 64x32 tile, at nibble b + 2h: one aligned 32-bit load (see combine_word).
__device__ __forceinline__ uint32_t a24_nibbles(const uint16_t* __restrict__ meta, int64_t row, int F, int band,
                                                const RowLayout& L) {
  const int rr = (int)(row & 63);
  const int64_t tile = (row >> 6) * (F / 32) + band * 2 + (L.o >> 2);
  const int64_t word = word_index(tile, rr >> 4, rr & 7, 2 * (L.o & 1));
  const uint32_t both = __ldg(reinterpret_cast<const uint32_t*>(meta + word));
  const int shift = 4 * (((rr >> 3) & 1) + 2 * L.h);
  return ((both >> shift) & 0xF) | (((both >> (16 + shift)) & 0xF) << 4);  // group 2o, then 2o + 1
}

// relu(z) from a = bf16(relu(z)^2), as the forward kernel rounded it: bf16(sqrt(a)) == z for every bf16
// z with a normal and finite (1.1e-19 <= z <= 1.8e19; checked for all bf16 values). sqrt(a) lies at
// least 2^-10.15 (relative) from a bf16 rounding boundary there, so the hardware reciprocal square
// root (error about 2^-22) rounds to the same z as a correctly rounded sqrt, without its slow path.
// Outside that range: a = 0 gives 0, a subnormal a an approximate z, a = inf NaN.
__device__ __forceinline__ float relu_from_a24(uint32_t a_bits) {
  const float a = bf16_to_float(a_bits);
  return a > 0.0f ? bf16_to_float(float_to_bf16(a * rsqrtf(a))) : 0.0f;
}

// cast.pow2_scale of a non-negative amax given by its bits: the largest power of 2 s with amax s <= 448
// (e4m3's largest), 2^(8 - e) or 2^(7 - e) for amax = m 2^e with m > 1.75; amaxes under 1e-12 (an
// all-zero row) as 1e-12; NaN for inf.
__device__ __forceinline__ float pow2_scale(uint32_t amax_bits) {
  const uint32_t bits = __float_as_uint(fmaxf(__uint_as_float(amax_bits), 1e-12f));
  const int e = (int)((bits >> 23) & 0xFF) - 127;
  if (e == 128) return __uint_as_float(0x7FC00000u);
  const int e_s = 8 - e - ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return __uint_as_float((uint32_t)(e_s + 127) << 23);
}

// Two bf16 (a kept pair: low half first) times s, rounded to e4m3 (ties to even, as Triton's
// conversion in compressed_to_e4m3: cvt.rn.satfinite), as two bytes, the low half's first.
__device__ __forceinline__ uint32_t e4m3x2(uint32_t pair, float s) {
  const float2 f = make_float2(bf16_to_float(pair & 0xFFFF) * s, bf16_to_float(pair >> 16) * s);
  return (uint32_t)__nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
}

// kFromA24: the row pass reads the forward's compressed A24 (values + metadata) instead of Z, so the
// FFN keeps 9/16 of Z's bytes for its backward; relu(z) comes back exactly (relu_from_a24) and the
// kept positions are the forward's own.
template <bool kFromA24>
__global__ void __launch_bounds__(kThreads, SRELU24_BW_MIN_BLOCKS) backward_operands_kernel(
    const uint16_t* __restrict__ z, const uint16_t* __restrict__ a24m, const uint16_t* __restrict__ da,
    const int* __restrict__ order,
    const int* __restrict__ slots, uint16_t* __restrict__ dzv, uint16_t* __restrict__ dzm, uint16_t* __restrict__ av,
    uint16_t* __restrict__ am, uint16_t* __restrict__ afull, uint16_t* __restrict__ gv, uint16_t* __restrict__ gm,
    uint16_t* __restrict__ gfull, const uint32_t* __restrict__ a_amax, float* __restrict__ a_scale, int T, int Tp,
    int F, int64_t stride_z, int64_t stride_da) {
  // masked A24 and dZ tiles, [token][feature], for the token-dimension operands
  __shared__ __align__(16) uint16_t s_tile[2][kTok][kFeat];

  // token blocks fastest: blocks running together write long runs of each token-dimension operand
  // row (bands fastest, or groups of bands, measured up to 3% slower on the H200)
  const int tok0 = blockIdx.x * kTok;
  const int band = blockIdx.y;
  const int t = threadIdx.x;
  // the token pass's dense-buffer rows, loaded now so that their latency hides behind the row pass
  const int slot_of[2] = {slots[band * kFeat + 16 * ((t & 31) >> 3) + (t & 7)],
                          slots[band * kFeat + 16 * ((t & 31) >> 3) + 8 + (t & 7)]};

  // ---- row pass: Z and dA rows (gathered through the token order), dZ's operand, the masked tiles ----
  {
    const RowLayout L(t);
    const int64_t col = (int64_t)band * kFeat + 8 * L.o;
    uint4 zq[4], dq[4];  // kFromA24: zq[j].x, .y the kept pairs of groups 2o, 2o + 1, .z their nibbles
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // all loads first: 8 x 16 bytes in flight per thread
      const int tok = tok0 + L.row(j);
      zq[j] = dq[j] = make_uint4(0, 0, 0, 0);  // padding tokens read as zeros
      if (tok < T) {
        const int64_t src = order[tok];
        if constexpr (kFromA24) {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(z + src * (F / 2) + (int64_t)band * (kFeat / 2) + 4 * L.o));
          zq[j] = make_uint4(v.x, v.y, a24_nibbles(a24m, src, F, band, L), 0);
        } else {
          zq[j] = __ldg(reinterpret_cast<const uint4*>(z + src * stride_z + col));
        }
        dq[j] = __ldg(reinterpret_cast<const uint4*>(da + src * stride_da + col));
      }
    }
#pragma unroll
    for (int ci = 0; ci < 2; ++ci) {
      uint32_t part[2] = {0, 0};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int j = b + 2 * ci, r = L.row(j);
        uint32_t kept[2], ma[4], md[4];  // per group: dZ's kept values; masked A24 and dZ (bf16 pairs)
        if constexpr (kFromA24) {
          // only the two kept values of a group: relu(z) = bf16(sqrt(a)), dZ = bf16(dA * 2 relu(z)).
          // Padding rows (zeros, nibble 0) give zeros and nibble (0, 1), as from Z.
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t pair = e ? zq[j].y : zq[j].x, nib = (zq[j].z >> (4 * e)) & 0xF;
            const uint32_t p0 = nib & 3, p1 = nib >> 2, v0 = pair & 0xFFFF, v1 = pair >> 16;
            const uint32_t d0 = half_of(dq[j], 4 * e), d1 = half_of(dq[j], 4 * e + 1);
            const uint32_t d2 = half_of(dq[j], 4 * e + 2), d3 = half_of(dq[j], 4 * e + 3);
            const float r0 = relu_from_a24(v0), r1 = relu_from_a24(v1);
            const uint32_t g0 = float_to_bf16(bf16_to_float(p0 == 0 ? d0 : p0 == 1 ? d1 : d2) * (2.0f * r0));
            const uint32_t g1 = float_to_bf16(bf16_to_float(p1 == 3 ? d3 : p1 == 2 ? d2 : d1) * (2.0f * r1));
            kept[e] = g0 | (g1 << 16);
            part[e] |= (nib ? nib : 4u) << (4 * b + 8 * L.h);  // a padding row's zero nibble: (0, 1)
            ma[2 * e] = (p0 == 0 ? v0 : 0u) | ((p0 == 1 ? v0 : p1 == 1 ? v1 : 0u) << 16);
            ma[2 * e + 1] = (p0 == 2 ? v0 : p1 == 2 ? v1 : 0u) | ((p1 == 3 ? v1 : 0u) << 16);
            md[2 * e] = (p0 == 0 ? g0 : 0u) | ((p0 == 1 ? g0 : p1 == 1 ? g1 : 0u) << 16);
            md[2 * e + 1] = (p0 == 2 ? g0 : p1 == 2 ? g1 : 0u) | ((p1 == 3 ? g1 : 0u) << 16);
          }
        } else {
          uint32_t abits[8], dbits[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float rz = fmaxf(bf16_to_float(half_of(zq[j], i)), 0.0f);
            abits[i] = float_to_bf16(rz * rz);
            dbits[i] = float_to_bf16(bf16_to_float(half_of(dq[j], i)) * (2.0f * rz));  // rounded once, as torch does
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t* ag = abits + 4 * e;
            const uint32_t* dg = dbits + 4 * e;
            const Top2 sel = top2(ag[0], ag[1], ag[2], ag[3]);  // the forward mask (a >= 0)
            kept[e] = sel.pair(dg[0], dg[1], dg[2], dg[3]);
            part[e] |= sel.nibble() << (4 * b + 8 * L.h);
            ma[2 * e] = (sel.k0 ? ag[0] : 0u) | ((sel.k1 ? ag[1] : 0u) << 16);
            ma[2 * e + 1] = (sel.k2 ? ag[2] : 0u) | ((sel.k3 ? ag[3] : 0u) << 16);
            md[2 * e] = (sel.k0 ? dg[0] : 0u) | ((sel.k1 ? dg[1] : 0u) << 16);
            md[2 * e + 1] = (sel.k2 ? dg[2] : 0u) | ((sel.k3 ? dg[3] : 0u) << 16);
          }
        }
        *reinterpret_cast<uint2*>(dzv + (int64_t)(tok0 + r) * (F / 2) + (int64_t)band * (kFeat / 2) + 4 * L.o) =
            make_uint2(kept[0], kept[1]);
        *reinterpret_cast<uint4*>(&s_tile[0][r][8 * L.o]) = make_uint4(ma[0], ma[1], ma[2], ma[3]);
        *reinterpret_cast<uint4*>(&s_tile[1][r][8 * L.o]) = make_uint4(md[0], md[1], md[2], md[3]);
      }
      int m;
      const uint32_t word = combine_word(part, L, &m);
      const int64_t tile = (int64_t)(tok0 / kTok) * (F / 32) + band * 2 + (L.o >> 2);
      dzm[word_index(tile, L.cp + 2 * ci, L.a, m)] = (uint16_t)word;
    }
  }
  __syncthreads();

  // ---- token pass: warp 2w + k: operand w (A24, dZ), 32-token chunk k; lane = a + 8c ----
  const int w = t >> 6, k = (t >> 5) & 1, lane = t & 31, a = lane & 7, c = lane >> 3;
  const int kc = tok0 / 32 + k;
  if (kc * 32 >= Tp) return;  // dZ's rows are padded to 64, the token operands only to 32
  uint16_t* val = w ? gv : av;
  uint16_t* meta = w ? gm : am;
  uint16_t* full = w ? gfull : afull;
  // S(A24)^T in e4m3 (a_amax given, the a24 variant only): warp-uniform, as w is
  const bool e4m3 = w == 0 && a_amax != nullptr;
  uint32_t nib[2][8];
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int f = 16 * c + 8 * b + a;
    const int64_t feat = (int64_t)band * kFeat + f;
    uint32_t v[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = s_tile[w][32 * k + i][f];
    const int slot = slot_of[b];
    if (slot >= 0) {  // a dense feature: its exact values to full[slot], zeros in the 2:4 operand
      uint4* dst = reinterpret_cast<uint4*>(full + (int64_t)slot * Tp + (int64_t)kc * 32);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t* x = v + 8 * j;
        dst[j] = make_uint4(x[0] | x[1] << 16, x[2] | x[3] << 16, x[4] | x[5] << 16, x[6] | x[7] << 16);
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) v[i] = 0;
    }
    uint32_t out[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const uint32_t* x = v + 4 * g;
      const Top2 sel = top2(x[0] & 0x7FFF, x[1] & 0x7FFF, x[2] & 0x7FFF, x[3] & 0x7FFF);
      nib[b][g] = sel.nibble();
      out[g] = sel.pair(x[0], x[1], x[2], x[3]);
    }
    if (e4m3) {  // the row's scale from the forward's maximum (a dense feature's row is zeros: amax 0)
      const float s = pow2_scale(slot >= 0 ? 0u : __ldg(a_amax + feat));
      if (blockIdx.x == 0 && k == 0) a_scale[feat] = s;
      uint8_t* row8 = reinterpret_cast<uint8_t*>(val) + feat * (Tp / 2) + (int64_t)kc * 16;  // 16 kept values
      *reinterpret_cast<uint4*>(row8) = make_uint4(e4m3x2(out[0], s) | e4m3x2(out[1], s) << 16,
                                                   e4m3x2(out[2], s) | e4m3x2(out[3], s) << 16,
                                                   e4m3x2(out[4], s) | e4m3x2(out[5], s) << 16,
                                                   e4m3x2(out[6], s) | e4m3x2(out[7], s) << 16);
      continue;
    }
    // lanes a and a ^ 1 write the two 16-byte halves of one 32-byte sector per store (ncu showed L2
    // throughput as the limit with each half its own request; faster at 7B): the even lane's row
    // first, then the odd's
    const bool odd = a & 1;
    uint32_t recv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) recv[i] = __shfl_xor_sync(0xFFFFFFFFu, odd ? out[i] : out[4 + i], 1);
    // selects, not branches: both lanes of a pair must be in the same store instruction
    uint4* row_even = reinterpret_cast<uint4*>(val + (feat - odd) * (Tp / 2) + (int64_t)kc * 16) + odd;
    uint4* row_odd = row_even + Tp / 16;  // the next feature's row, same half
    const uint4 mine_lo = make_uint4(out[0], out[1], out[2], out[3]), mine_hi = make_uint4(out[4], out[5], out[6], out[7]);
    const uint4 theirs = make_uint4(recv[0], recv[1], recv[2], recv[3]);
    *row_even = odd ? theirs : mine_lo;
    *row_odd = odd ? mine_hi : theirs;
  }
  if (e4m3) {
    // e4m3 metadata (layout.nibble_index_e4m3): a 64-row x 64-token tile owns 512 bytes, shared by
    // this chunk kc and its neighbour; byte b | (kc & 1) << 1 | q << 2 | a << 4 | c << 7 holds the
    // nibbles of groups 2q (low) and 2q + 1 of row 16c + 8b + a, so rows b = 0, 1 make one 16-bit word
    uint8_t* tile8 = reinterpret_cast<uint8_t*>(meta) + ((int64_t)band * (Tp / 64) + (kc >> 1)) * 512;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t lo = nib[0][2 * q] | nib[0][2 * q + 1] << 4, hi = nib[1][2 * q] | nib[1][2 * q + 1] << 4;
      *reinterpret_cast<uint16_t*>(tile8 + ((kc & 1) << 1 | q << 2 | a << 4 | c << 7)) = (uint16_t)(lo | hi << 8);
    }
    return;
  }
  uint32_t words[4];
#pragma unroll
  for (int m = 0; m < 4; ++m)
    words[m] = nib[0][m] | (nib[1][m] << 4) | (nib[0][4 + m] << 8) | (nib[1][4 + m] << 12);
  const int64_t tile = (int64_t)band * (Tp / 32) + kc;
  *reinterpret_cast<uint2*>(meta + word_index(tile, c, a, 0)) = make_uint2(words[0] | words[1] << 16, words[2] | words[3] << 16);
}

// The forward: A24 = 2:4(relu(Z)^2) compressed, the kept non-zeros per feature, and where amax is
// given each feature's largest kept value (float32 bits, atomically maxed in). A block runs `bands`
// 64-row bands of one 64-feature block, so the atomics come once per bands x 64 rows.
__global__ void __launch_bounds__(kThreads) srelu_sparsify_kernel(
    const uint16_t* __restrict__ z, uint16_t* __restrict__ val, uint16_t* __restrict__ meta, int* __restrict__ counts,
    uint32_t* __restrict__ amax, int M, int Mp, int K, int64_t stride_z, int bands) {
  __shared__ uint32_t s_counts[kThreads / 32][kFeat];
  __shared__ uint32_t s_amax[kThreads / 32][kFeat];
  const RowLayout L(threadIdx.x);
  // feature blocks fastest: blocks running together read whole rows (5% faster than row groups fastest)
  const int fb = blockIdx.x % (K / kFeat), row_group = blockIdx.x / (K / kFeat);
  const int64_t col = (int64_t)fb * kFeat + 8 * L.o;
  uint32_t cnt[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // kept non-zeros of this thread's 8 features
  // their largest kept values as bf16 bits: A24 >= +0 (relu(z)^2, NaN dropped), so the bits order as the values
  uint32_t top[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int bi = 0; bi < bands; ++bi) {
    const int tok0 = (row_group * bands + bi) * kTok;
    if (tok0 >= Mp) break;  // the same for the whole block
    uint4 zq[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = tok0 + L.row(j);
      zq[j] = row < M ? __ldg(reinterpret_cast<const uint4*>(z + row * stride_z + col)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int ci = 0; ci < 2; ++ci) {
      uint32_t part[2] = {0, 0};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int j = b + 2 * ci;
        uint32_t abits[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float rz = fmaxf(bf16_to_float(half_of(zq[j], i)), 0.0f);
          abits[i] = float_to_bf16(rz * rz);
        }
        uint32_t kept[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t* ag = abits + 4 * e;
          const Top2 sel = top2(ag[0], ag[1], ag[2], ag[3]);
          kept[e] = sel.pair(ag[0], ag[1], ag[2], ag[3]);
          part[e] |= sel.nibble() << (4 * b + 8 * L.h);
          cnt[4 * e] += sel.k0 && ag[0];
          cnt[4 * e + 1] += sel.k1 && ag[1];
          cnt[4 * e + 2] += sel.k2 && ag[2];
          cnt[4 * e + 3] += sel.k3 && ag[3];
          top[4 * e] = max(top[4 * e], sel.k0 ? ag[0] : 0u);
          top[4 * e + 1] = max(top[4 * e + 1], sel.k1 ? ag[1] : 0u);
          top[4 * e + 2] = max(top[4 * e + 2], sel.k2 ? ag[2] : 0u);
          top[4 * e + 3] = max(top[4 * e + 3], sel.k3 ? ag[3] : 0u);
        }
        *reinterpret_cast<uint2*>(val + (int64_t)(tok0 + L.row(j)) * (K / 2) + (int64_t)fb * (kFeat / 2) + 4 * L.o) =
            make_uint2(kept[0], kept[1]);
      }
      int m;
      const uint32_t word = combine_word(part, L, &m);
      const int64_t tile = (int64_t)(tok0 / kTok) * (K / 32) + fb * 2 + (L.o >> 2);
      meta[word_index(tile, L.cp + 2 * ci, L.a, m)] = (uint16_t)word;
    }
  }
  // the 16 threads with this o: lanes 8 and 16 apart in a warp, then the 4 warps through shared memory
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    cnt[i] += __shfl_xor_sync(0xFFFFFFFFu, cnt[i], 8);
    cnt[i] += __shfl_xor_sync(0xFFFFFFFFu, cnt[i], 16);
    top[i] = max(top[i], __shfl_xor_sync(0xFFFFFFFFu, top[i], 8));
    top[i] = max(top[i], __shfl_xor_sync(0xFFFFFFFFu, top[i], 16));
  }
  if (lane < 8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s_counts[warp][8 * lane + i] = cnt[i];
      s_amax[warp][8 * lane + i] = top[i];
    }
  }
  __syncthreads();
  if (threadIdx.x < kFeat) {
    const uint32_t n = s_counts[0][threadIdx.x] + s_counts[1][threadIdx.x] + s_counts[2][threadIdx.x] + s_counts[3][threadIdx.x];
    if (n) atomicAdd(counts + (int64_t)fb * kFeat + threadIdx.x, (int)n);
    const uint32_t m = max(max(s_amax[0][threadIdx.x], s_amax[1][threadIdx.x]), max(s_amax[2][threadIdx.x], s_amax[3][threadIdx.x]));
    if (amax != nullptr && m) atomicMax(amax + (int64_t)fb * kFeat + threadIdx.x, m << 16);  // bf16 bits -> float32's
  }
}

}  // namespace

extern "C" {

// Bumped whenever an exported signature changes; srelu24_kernels/srelu24/native.py checks it.
int srelu24_kernels_abi_version() { return 4; }

// z: [M, K] bf16 (row stride in elements); val/meta: A24's compressed values and metadata ([Mp, K]
// with Mp = M padded to 64: padding rows as zeros); counts: [K] int32, zeroed by the caller; amax: null,
// or [K] float32 zeroed by the caller, into which each feature's largest A24 value goes. K % 64 ==
// 0, the row stride % 8 == 0, pointers 16-byte aligned. bands: 64-row bands per block (>= 1).
int srelu24_sparsify(const void* z, void* val, void* meta, int* counts, void* amax, int M, int Mp, int K,
                     int64_t stride_z, int bands, cudaStream_t stream) {
  if (Mp == 0 || K == 0) return 0;
  const int n_bands = Mp / kTok;
  const dim3 grid((n_bands + bands - 1) / bands * (K / kFeat));
  srelu_sparsify_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(z), static_cast<uint16_t*>(val),
                                                       static_cast<uint16_t*>(meta), counts,
                                                       static_cast<uint32_t*>(amax), M, Mp, K, stride_z, bands);
  return (int)cudaGetLastError();
}

// z, da: [T, F] bf16 (row strides in elements); order: [T] int32 token order; slots: [F] int32 (the
// dense buffer row of a dense feature, -1 otherwise). Outputs as the Triton kernel's: dzv/dzm the
// values/metadata of dZ's operand ([Tr, F] with Tr = T padded to 64), av/am and gv/gm those of
// S(A24)^T and S(dZ)^T ([F, Tp], Tp = T padded to 32), afull/gfull [k, Tp]. F % 64 == 0, the row
// strides % 8 == 0 and all pointers 16-byte aligned. Returns 0, or a cudaError_t of the launch.
int srelu24_backward_operands(const void* z, const void* da, const int* order, const int* slots, void* dzv, void* dzm,
                           void* av, void* am, void* afull, void* gv, void* gm, void* gfull, int T, int Tp, int Tr,
                           int F, int64_t stride_z, int64_t stride_da, cudaStream_t stream) {
  if (Tr == 0 || F == 0) return 0;
  backward_operands_kernel<false><<<dim3(Tr / kTok, F / kFeat), kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(z), nullptr, static_cast<const uint16_t*>(da), order, slots,
      static_cast<uint16_t*>(dzv), static_cast<uint16_t*>(dzm), static_cast<uint16_t*>(av), static_cast<uint16_t*>(am),
      static_cast<uint16_t*>(afull), static_cast<uint16_t*>(gv), static_cast<uint16_t*>(gm),
      static_cast<uint16_t*>(gfull), nullptr, nullptr, T, Tp, F, stride_z, stride_da);
  return (int)cudaGetLastError();
}

// The same pass reading the forward's compressed A24 instead of Z: a24v/a24m its values [Tr, F/2] and
// metadata (srelu_sparsify's output for these T rows, Tr = T padded to 64); the rest as above. Equal to
// the pass over Z bit for bit wherever every positive z is in [1.1e-19, 1.8e19] (bf16(z^2) normal).
// a_amax: null, or srelu_sparsify's amax for the same rows: then av/am are S(A24)^T's e4m3 values and
// metadata ([F, Tp] as compressed_to_e4m3 lays them out, Tp % 64 == 0) and a_scale [F] float32 gets
// its row scales.
int srelu24_backward_operands_a24(const void* a24v, const void* a24m, const void* da, const int* order, const int* slots,
                               void* dzv, void* dzm, void* av, void* am, void* afull, void* gv, void* gm, void* gfull,
                               const void* a_amax, void* a_scale, int T, int Tp, int Tr, int F, int64_t stride_da,
                               cudaStream_t stream) {
  if (Tr == 0 || F == 0) return 0;
  backward_operands_kernel<true><<<dim3(Tr / kTok, F / kFeat), kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(a24v), static_cast<const uint16_t*>(a24m), static_cast<const uint16_t*>(da), order,
      slots, static_cast<uint16_t*>(dzv), static_cast<uint16_t*>(dzm), static_cast<uint16_t*>(av),
      static_cast<uint16_t*>(am), static_cast<uint16_t*>(afull), static_cast<uint16_t*>(gv), static_cast<uint16_t*>(gm),
      static_cast<uint16_t*>(gfull), static_cast<const uint32_t*>(a_amax), static_cast<float*>(a_scale), T, Tp, F, 0,
      stride_da);
  return (int)cudaGetLastError();
}

}  // extern "C"
