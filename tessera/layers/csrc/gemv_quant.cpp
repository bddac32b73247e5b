// Weight-only int8 and int4 matrix products by integer dot products: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]),
// the weight stored in 8 or 4 bits with a scale (int4: and a zero) per group of G consecutive k of each output,
// re-packed once at load in blocks of 16 outputs side by side (as gemv.cpp's float weights), k in pairs:
//   int8: w = q * s,            q int8 [N / 16][K / 2][16][2]             s [N / 16][K / G][16]
//         or w = q * s + z,                                               s, z [N / 16][K / G][2][16]
//   int4: w = (q - p) * s + z,  q 0..15 [N / 16][K / 4][16][2] uint8,    s, z [N / 16][K / G][2][16]
//         (p, the zero point, 8 for Tessera's own int4 (torch's formula), 0 for GGUF's q * d + m)
//         (of k = 4t..4t+3, byte (i, 0) holds output i's q at 4t in its low nibble and 4t + 2 in its high one,
//          byte (i, 1) those at 4t + 1 and 4t + 3)
// s and z are float32, bfloat16 or float16 (a GGUF file's float16 scales stay as they are; its K-quants' scales,
// 6-bit integers times a float16, are exact in float32). The int8 form with z holds every GGUF block type (Q4_K,
// Q5_K, Q6_K...) as its integers, so a layer fusing tensors of different types keeps all their bytes' values.
//
// Why integers: de-quantizing each weight to float32 costs 3-4 vector instructions per 16 weights, which on two
// cores is slower than reading them (measured: int8 decode reached 1.4x bfloat16, not 2x). Here x is quantized
// to int16 per row and group (xq = round(x / sx), sx = max |x| of the group / 32767: an error of at most sx / 2
// an element, below a bfloat16 x's own rounding of its largest values), and one instruction (AVX512-VNNI
// vpdpwssd; AVX2 vpmaddwd + vpaddd) adds 32 (16) exact products of int16 pairs into int32 sums. Each group's
// sum becomes float32 once: y += s * sx * sum(q * xq) (with z: + (z - p s) * sx * sum(xq)). int32 holds a group's
// sum for G <= 512 (int8: 127 * 32767 * 512 < 2^31); per-channel int8 is packed as groups of one scale repeated.
//
// Tiles of up to 4 rows x 4 blocks (AVX-512) or 3 rows x 1 block (AVX2): each weight vector, loaded once, is
// used for every row of the tile, so decode reads the weight once in its 8 or 4 bits.
#include <torch/library.h>

#include <cmath>

#include "ops.h"
#include "tiles.h"

namespace {

using namespace tessera_kernels;

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

// One group of x -> int16: xq = round(x / sx) (to nearest, ties to even), sx = max |x| / 32767; returns sum(xq).
template <typename X>
inline int32_t quantize_group(const X* in, int64_t G, int16_t* xq, float& sx) {
  float amax = 0;
  for (int64_t k = 0; k < G; ++k) amax = std::max(amax, std::fabs(static_cast<float>(in[k])));
  const float inv = amax > 0 ? 32767 / amax : 0;
  sx = amax / 32767;
  int32_t sum = 0;
  for (int64_t k = 0; k < G; ++k) {
    xq[k] = static_cast<int16_t>(std::nearbyint(static_cast<float>(in[k]) * inv));
    sum += xq[k];
  }
  return sum;
}

// The same, 16 (AVX-512) or 8 (AVX2) lanes at a time: cvtps_epi32 rounds as nearbyint (to nearest, ties to even,
// MXCSR's default), so the integers are the scalar loop's; ~2 ns an element less than its libm call (~6 us a
// decode layer).
template <typename X>
AVX512 inline int32_t quantize_group_512(const X* in, int64_t G, int16_t* xq, float& sx) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < G; k += 16) {
    const __mmask16 mask = G - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - k)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16_512<X>(in + k, mask)));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 32767 / amax : 0);
  sx = amax / 32767;
  __m512i sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < G; k += 16) {
    const __mmask16 mask = G - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - k)) - 1);
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16_512<X>(in + k, mask), inv));
    _mm512_mask_cvtepi32_storeu_epi16(xq + k, mask, q);
    sum = _mm512_add_epi32(sum, q);
  }
  return _mm512_reduce_add_epi32(sum);
}

template <typename X>
AVX2 inline int32_t quantize_group_256(const X* in, int64_t G, int16_t* xq, float& sx) {  // G a multiple of 8
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < G; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8_256<X>(in + k)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 32767 / amax : 0);
  sx = amax / 32767;
  __m256i sum = _mm256_setzero_si256();
  for (int64_t k = 0; k < G; k += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8_256<X>(in + k), inv));
    const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), packed);
    sum = _mm256_add_epi32(sum, q);
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// x [M, K] (float32, bfloat16 or float16) -> int16 [M, K] and, per row and group of G, sx [M, K / G] and
// sx * sum(xq) [M, K / G].
template <typename X>
void quantize_x(const X* x, int64_t M, int64_t K, int64_t G, int16_t* xq, float* sx, float* xsum, int64_t isa) {
  at::parallel_for(0, M * (K / G), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // rows are contiguous, so group i % groups of row i / groups is x + i G
      const int32_t sum = isa == kAvx512 ? quantize_group_512(x + i * G, G, xq + i * G, sx[i])
                          : G % 8 == 0   ? quantize_group_256(x + i * G, G, xq + i * G, sx[i])
                                         : quantize_group(x + i * G, G, xq + i * G, sx[i]);
      xsum[i] = sx[i] * static_cast<float>(sum);
    }
  });
}

struct Operand {  // x quantized, the shape, and the weight's zero point
  const int16_t* xq;
  const float *sx, *xsum;
  int64_t K, G;
  float zero_point;
};

inline int32_t pair_at(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- AVX-512 + VNNI: MR rows x NB blocks -----------------------------------------------------------------------

// 32 int8 weights (16 outputs x a k pair) as int16 pairs.
AVX512VNNI inline __m512i int8_pairs_512(const int8_t* q) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
}

// 64 nibbles (16 outputs x 4 k) as int16 pairs: k 4t, 4t + 1 (lo) and 4t + 2, 4t + 3 (hi).
AVX512VNNI inline void int4_pairs_512(const uint8_t* q, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  lo = _mm512_and_si512(v, _mm512_set1_epi16(15));
  hi = _mm512_srli_epi16(v, 4);
}

template <bool kInt4, bool kZero, typename S, int MR, int NB>
AVX512VNNI void tile_512(Operand a, const void* wp, const S* sc, float* y, int64_t ldy, int64_t nvalid) {
  constexpr int U = MR * NB >= 4 ? 1 : (MR * NB >= 2 ? 2 : 4);
  const int64_t groups = a.K / a.G;
  const int64_t wstride = (kInt4 ? a.K / 2 : a.K) * kBlock, sstride = groups * (kZero ? 2 : 1) * kBlock;
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // U independent sums a tile entry, over alternate k steps: one vpdpwssd chain waits ~5 cycles a step, so a
    // small tile (decode: 1 row x 1 block) would wait on its single chain.
    __m512i isum[MR][NB][U];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) isum[m][j][u] = _mm512_setzero_si512();
    const int64_t steps = kInt4 ? a.G / 4 : a.G / 2, first = g * steps;  // k quads (int4) or pairs (int8)
    for (int64_t i = 0; i < steps; i += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        if (U > 1 && i + u >= steps) break;
        const int64_t t = first + i + u;
        if constexpr (kInt4) {
          const uint8_t* w = static_cast<const uint8_t*>(wp);
          __m512i lo[NB], hi[NB];
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) int4_pairs_512(w + j * wstride + t * 2 * kBlock, lo[j], hi[j]);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512i x01 = _mm512_set1_epi32(pair_at(a.xq + m * a.K + 4 * t));
            const __m512i x23 = _mm512_set1_epi32(pair_at(a.xq + m * a.K + 4 * t + 2));
#pragma GCC unroll 8
            for (int j = 0; j < NB; ++j)
              isum[m][j][u] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[m][j][u], x01, lo[j]), x23, hi[j]);
          }
        } else {
          const int8_t* w = static_cast<const int8_t*>(wp);
          __m512i wv[NB];
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) wv[j] = int8_pairs_512(w + j * wstride + t * 2 * kBlock);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512i xv = _mm512_set1_epi32(pair_at(a.xq + m * a.K + 2 * t));
#pragma GCC unroll 8
            for (int j = 0; j < NB; ++j) isum[m][j][u] = _mm512_dpwssd_epi32(isum[m][j][u], xv, wv[j]);
          }
        }
      }
    }
    // The group's sums into float32: s * sx * sum (with z: + (z - p s) * sx * sum(xq)).
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const S* p = sc + j * sstride + g * (kZero ? 2 : 1) * kBlock;
      const __m512 s = load16_512<S>(p, 0xFFFF);
      const __m512 z =
          kZero ? _mm512_fnmadd_ps(_mm512_set1_ps(a.zero_point), s, load16_512<S>(p + kBlock, 0xFFFF)) : s;
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int64_t i = m * groups + g;
        __m512i sum = isum[m][j][0];
#pragma GCC unroll 4
        for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, isum[m][j][u]);
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(a.sx[i])), acc[m][j]);
        if constexpr (kZero) acc[m][j] = _mm512_fmadd_ps(z, _mm512_set1_ps(a.xsum[i]), acc[m][j]);
      }
    }
  }
  store_tile<MR, NB>(acc, y, ldy, nvalid);
}

// ---- AVX2: MR rows x 1 block (two halves of 8 outputs) ----------------------------------------------------------

template <bool kInt4, bool kZero, typename S, int MR>
AVX2 void tile_256(Operand a, const void* wp, const S* sc, float* y, int64_t ldy, int64_t nvalid) {
  const int64_t groups = a.K / a.G;
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i ilo[MR], ihi[MR];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) ilo[m] = ihi[m] = _mm256_setzero_si256();
    if constexpr (kInt4) {
      const uint8_t* w = static_cast<const uint8_t*>(wp);
      const __m256i nibble = _mm256_set1_epi16(15);
      for (int64_t t = g * a.G / 4; t < (g + 1) * a.G / 4; ++t) {
        const uint8_t* p = w + t * 2 * kBlock;
        const __m256i vl = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i vh = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBlock)));
        const __m256i l01 = _mm256_and_si256(vl, nibble), l23 = _mm256_srli_epi16(vl, 4);
        const __m256i h01 = _mm256_and_si256(vh, nibble), h23 = _mm256_srli_epi16(vh, 4);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i x01 = _mm256_set1_epi32(pair_at(a.xq + m * a.K + 4 * t));
          const __m256i x23 = _mm256_set1_epi32(pair_at(a.xq + m * a.K + 4 * t + 2));
          ilo[m] = _mm256_add_epi32(ilo[m], _mm256_add_epi32(_mm256_madd_epi16(x01, l01), _mm256_madd_epi16(x23, l23)));
          ihi[m] = _mm256_add_epi32(ihi[m], _mm256_add_epi32(_mm256_madd_epi16(x01, h01), _mm256_madd_epi16(x23, h23)));
        }
      }
    } else {
      const int8_t* w = static_cast<const int8_t*>(wp);
      for (int64_t kp = g * a.G / 2; kp < (g + 1) * a.G / 2; ++kp) {
        const int8_t* p = w + kp * 2 * kBlock;
        const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kBlock)));
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i xv = _mm256_set1_epi32(pair_at(a.xq + m * a.K + 2 * kp));
          ilo[m] = _mm256_add_epi32(ilo[m], _mm256_madd_epi16(xv, wl));
          ihi[m] = _mm256_add_epi32(ihi[m], _mm256_madd_epi16(xv, wh));
        }
      }
    }
    const S* p = sc + g * (kZero ? 2 : 1) * kBlock;
    const __m256 sl = load8_256<S>(p), sh = load8_256<S>(p + 8);
    __m256 zl = sl, zh = sh;
    if constexpr (kZero) {
      zl = _mm256_fnmadd_ps(_mm256_set1_ps(a.zero_point), sl, load8_256<S>(p + kBlock));
      zh = _mm256_fnmadd_ps(_mm256_set1_ps(a.zero_point), sh, load8_256<S>(p + kBlock + 8));
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const int64_t i = m * groups + g;
      const __m256 sx = _mm256_set1_ps(a.sx[i]);
      lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ilo[m]), _mm256_mul_ps(sl, sx), lo[m]);
      hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ihi[m]), _mm256_mul_ps(sh, sx), hi[m]);
      if constexpr (kZero) {
        const __m256 xs = _mm256_set1_ps(a.xsum[i]);
        lo[m] = _mm256_fmadd_ps(zl, xs, lo[m]);
        hi[m] = _mm256_fmadd_ps(zh, xs, hi[m]);
      }
    }
  }
  store_tile_avx2<MR>(lo, hi, y, ldy, nvalid);
}

// ---- dispatch ----------------------------------------------------------------------------------------------

template <typename S>
using QuantTile = void (*)(Operand, const void*, const S*, float*, int64_t, int64_t);

template <bool kInt4, bool kZero, typename S, int MR>
QuantTile<S> tile_of(int64_t isa, int nb) {
  if (isa == kAvx2) return tile_256<kInt4, kZero, S, (MR < 3 ? MR : 3)>;
  switch (nb) {
    case 1: return tile_512<kInt4, kZero, S, MR, 1>;
    case 2: return tile_512<kInt4, kZero, S, MR, 2>;
    case 3: return tile_512<kInt4, kZero, S, MR, 3>;
    default: return tile_512<kInt4, kZero, S, MR, 4>;
  }
}

template <bool kInt4, bool kZero, typename S>
QuantTile<S> tile_fn(int64_t isa, int mr, int nb) {
  switch (mr) {
    case 1: return tile_of<kInt4, kZero, S, 1>(isa, nb);
    case 2: return tile_of<kInt4, kZero, S, 2>(isa, nb);
    case 3: return tile_of<kInt4, kZero, S, 3>(isa, nb);
    default: return tile_of<kInt4, kZero, S, 4>(isa, nb);
  }
}

template <bool kInt4, bool kZero, typename S>
void quant_matmul(Operand a, int64_t M, const void* w, const S* sc, int64_t N, float* y, int64_t isa) {
  const int64_t groups = a.K / a.G;
  const int64_t wstride = (kInt4 ? a.K / 2 : a.K) * kBlock, sstride = groups * (kZero ? 2 : 1) * kBlock;
  // AVX-512: 4 rows x 2 blocks, or 2 x 4 for one or two rows (int32 and float32 sums: 2 x MR x NB registers).
  const int64_t rows = isa == kAvx2 ? 3 : (M <= 2 ? 2 : 4), panel = isa == kAvx2 ? 1 : (M <= 2 ? 1 : 2);
  for_each_tile(M, N, rows, panel, [&](int64_t m0, int mr, int64_t b0, int nb) {
    const int64_t n0 = b0 * kBlock;
    Operand rows_of = {a.xq + m0 * a.K, a.sx + m0 * groups, a.xsum + m0 * groups, a.K, a.G, a.zero_point};
    tile_fn<kInt4, kZero, S>(isa, mr, nb)(rows_of, static_cast<const int8_t*>(w) + b0 * wstride, sc + b0 * sstride,
                                   y + m0 * N + n0, N, std::min<int64_t>(nb * kBlock, N - n0));
  });
}

template <bool kInt4, bool kZero, typename S>
void quant_matmul_of(Operand a, int64_t M, const at::Tensor& w, const at::Tensor& sc, int64_t N, float* y,
                     int64_t isa) {
  quant_matmul<kInt4, kZero>(a, M, w.data_ptr(), sc.data_ptr<S>(), N, y, isa);
}

template <bool kInt4, bool kZero>
void quant_matmul_scaled(Operand a, int64_t M, const at::Tensor& w, const at::Tensor& sc, int64_t N, float* y,
                         int64_t isa) {
  switch (sc.scalar_type()) {
    case at::kFloat: return quant_matmul_of<kInt4, kZero, float>(a, M, w, sc, N, y, isa);
    case at::kBFloat16: return quant_matmul_of<kInt4, kZero, c10::BFloat16>(a, M, w, sc, N, y, isa);
    case at::kHalf: return quant_matmul_of<kInt4, kZero, c10::Half>(a, M, w, sc, N, y, isa);
    default: TORCH_CHECK(false, "tessera: scales of ", sc.scalar_type(), " are not float32, bfloat16 or float16");
  }
}

// int8 scales of rank 3 are s only; rank 4 are (s, z). int4's are always (s, z).
template <bool kInt4>
at::Tensor run_quant(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t isa, int64_t zero_point) {
  const int64_t M = x.size(0), K = x.size(1), G = K / scales.size(1);
  const auto xc = x.contiguous();
  // One scratch buffer: xq [M, K] int16, then sx and sx * sum(xq) [M, K / G] float32 each.
  auto scratch = at::empty({M * K * 2 + 2 * M * (K / G) * 4}, x.options().dtype(at::kByte));
  int16_t* xq = reinterpret_cast<int16_t*>(scratch.data_ptr<uint8_t>());
  float* sx = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>() + M * K * 2);
  float* xsum = sx + M * (K / G);
  switch (xc.scalar_type()) {
    case at::kFloat: quantize_x(xc.data_ptr<float>(), M, K, G, xq, sx, xsum, isa); break;
    case at::kBFloat16: quantize_x(xc.data_ptr<c10::BFloat16>(), M, K, G, xq, sx, xsum, isa); break;
    case at::kHalf: quantize_x(xc.data_ptr<c10::Half>(), M, K, G, xq, sx, xsum, isa); break;
    default: quantize_x(xc.to(at::kFloat).data_ptr<float>(), M, K, G, xq, sx, xsum, isa);
  }
  const Operand a = {xq, sx, xsum, K, G, static_cast<float>(zero_point)};
  const auto w = packed.contiguous();
  const auto sc = scales.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (kInt4 || sc.dim() == 4)
    quant_matmul_scaled<kInt4, true>(a, M, w, sc, N, y.data_ptr<float>(), isa);
  else
    quant_matmul_scaled<kInt4, false>(a, M, w, sc, N, y.data_ptr<float>(), isa);
  return finish(y, bias, x.scalar_type());
}

}  // namespace

namespace tessera_kernels {

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t isa) {
  const bool zeros = scales.dim() == 4;  // (s, z) pairs
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && (scales.dim() == 3 || zeros) && packed.scalar_type() == at::kChar &&
                  packed.size(1) * 2 == x.size(1) && packed.size(2) == kBlock && packed.size(3) == 2 &&
                  packed.size(0) * kBlock >= N && scales.size(0) == packed.size(0) &&
                  scales.size(scales.dim() - 1) == kBlock && (!zeros || scales.size(2) == 2) && scales.size(1) > 0 &&
                  x.size(1) % scales.size(1) == 0 && (x.size(1) / scales.size(1)) % 2 == 0 &&
                  x.size(1) / scales.size(1) <= 512,
              "tessera::gemv_int8: x [M, K], int8 [N / 16, K / 2, 16, 2] and scales [N / 16, K / G, 16] or [N / 16, "
              "K / G, 2, 16] (G even, <= 512) expected, got ", x.sizes(), ", ", packed.sizes(), " and ",
              scales.sizes());
  TORCH_CHECK(isa == kAvx2 || isa == kAvx512, "tessera::gemv_int8: isa must be 1 (AVX2) or 2 (AVX-512 + VNNI)");
  return run_quant<false>(x, packed, scales, N, bias, isa, 0);
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t isa, int64_t zero_point) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && scales.dim() == 4 && packed.scalar_type() == at::kByte &&
                  packed.size(1) * 4 == x.size(1) && packed.size(2) == kBlock && packed.size(3) == 2 &&
                  packed.size(0) * kBlock >= N && scales.size(0) == packed.size(0) && scales.size(2) == 2 &&
                  scales.size(3) == kBlock && scales.size(1) > 0 && x.size(1) % scales.size(1) == 0 &&
                  (x.size(1) / scales.size(1)) % 4 == 0 && x.size(1) / scales.size(1) <= 4096,
              "tessera::gemv_int4: x [M, K], uint8 [N / 16, K / 4, 16, 2] and scales [N / 16, K / G, 2, 16] (G a "
              "multiple of 4, <= 4096) expected, got ", x.sizes(), ", ", packed.sizes(), " and ", scales.sizes());
  TORCH_CHECK(isa == kAvx2 || isa == kAvx512, "tessera::gemv_int4: isa must be 1 (AVX2) or 2 (AVX-512 + VNNI)");
  TORCH_CHECK(zero_point >= 0 && zero_point <= 15, "tessera::gemv_int4: the zero point must be in 0..15");
  return run_quant<true>(x, packed, scales, N, bias, isa, zero_point);
}

}  // namespace tessera_kernels

TORCH_LIBRARY_FRAGMENT(tessera, m) {
  m.def("gemv_int8(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, int isa) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, int isa, int zero_point=8) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("gemv_int8", tessera_kernels::gemv_int8);
  m.impl("gemv_int4", tessera_kernels::gemv_int4);
}
