// Shared pieces of the native kernels (gemv.cpp, gemv_quant.cpp): loading 16 / 8 weights as float32, the
// float micro-kernels (MR rows of x times NB blocks of 16 outputs, over all of K), the masked store of a tile,
// and the loop over tiles that splits the work between torch's threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tessera_kernels {


enum Isa : int64_t { kAvx2 = 1, kAvx512 = 2 };

// ---- loading 16 / 8 weights as float32 ----------------------------------------------------------------

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

template <typename W>
AVX512 inline __m512 load16_512(const W* p, __mmask16 mask);

template <>
AVX512 inline __m512 load16_512<float>(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
template <>
AVX512 inline __m512 load16_512<c10::BFloat16>(const c10::BFloat16* p, __mmask16 mask) {
  __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
AVX512 inline __m512 load16_512<c10::Half>(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

#define AVX2 __attribute__((target("avx2,fma,f16c")))

template <typename W>
AVX2 inline __m256 load8_256(const W* p);

template <>
AVX2 inline __m256 load8_256<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
AVX2 inline __m256 load8_256<c10::BFloat16>(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
template <>
AVX2 inline __m256 load8_256<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---- micro-kernels: MR rows of x times NB blocks of 16 outputs, over all of K -----------------------------
// Each weight vector is loaded (and widened) once and multiplied by a broadcast of x[m, k] for every row m:
// MR x NB accumulator vectors. AVX-512: up to 6 rows x 4 blocks (24 accumulators); AVX2 (16 registers): up to
// 6 rows x 1 block (two vectors of 8).

constexpr int kBlock = 16;
constexpr int kMaxRows = 6;

// y[m, 16 j + i] = acc[m][j][i] for the nvalid outputs of the tile (a masked store for the last block).
template <int MR, int NB>
AVX512 inline void store_tile(const __m512 (&acc)[MR][NB], float* y, int64_t ldy, int64_t nvalid) {
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t left = nvalid - j * kBlock;
    const __mmask16 mask = left >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + j * kBlock, mask, acc[m][j]);
  }
}

template <typename W, int MR, int NB>
AVX512 void tile_avx512(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t nvalid) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
  #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t stride = K * kBlock;  // from one block to the next
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NB];
  #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = load16_512<W>(w + j * stride + k * kBlock, 0xFFFF);
  #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  store_tile<MR, NB>(acc, y, ldy, nvalid);
}

// y[m, j] for the nvalid outputs of one block, from its two halves lo (0..7) and hi (8..15).
template <int MR>
AVX2 inline void store_tile_avx2(const __m256 (&lo)[MR], const __m256 (&hi)[MR], float* y, int64_t ldy,
                                 int64_t nvalid) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    if (nvalid == kBlock) {
      _mm256_storeu_ps(y + m * ldy, lo[m]);
      _mm256_storeu_ps(y + m * ldy + 8, hi[m]);
      continue;
    }
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, lo[m]);
    _mm256_store_ps(out + 8, hi[m]);
    for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = out[j];
  }
}

template <typename W, int MR, int NB>
AVX2 void tile_avx2(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t nvalid) {
  static_assert(NB == 1, "AVX2 tiles are one block wide");
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* p = w + k * kBlock;
    const __m256 wl = load8_256<W>(p), wh = load8_256<W>(p + 8);
  #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * K + k]);
      lo[m] = _mm256_fmadd_ps(xv, wl, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, wh, hi[m]);
    }
  }
  store_tile_avx2<MR>(lo, hi, y, ldy, nvalid);
}

// ---- dispatch and the loop over tiles ----------------------------------------------------------------

template <typename X, typename W>
using TileFn = void (*)(const X*, int64_t, const W*, float*, int64_t, int64_t);

template <typename W, int MR>
TileFn<float, W> tile_of(int64_t isa, int nb) {
  if (isa == kAvx2) return tile_avx2<W, MR, 1>;
  switch (nb) {
    case 1: return tile_avx512<W, MR, 1>;
    case 2: return tile_avx512<W, MR, 2>;
    case 3: return tile_avx512<W, MR, 3>;
    default: return tile_avx512<W, MR, 4>;
  }
}

template <typename W>
TileFn<float, W> tile_fn(int64_t isa, int mr, int nb) {
  switch (mr) {
    case 1: return tile_of<W, 1>(isa, nb);
    case 2: return tile_of<W, 2>(isa, nb);
    case 3: return tile_of<W, 3>(isa, nb);
    case 4: return tile_of<W, 4>(isa, nb);
    case 5: return tile_of<W, 5>(isa, nb);
    default: return tile_of<W, 6>(isa, nb);
  }
}

// The loop over tiles: run(m0, mr, b0, nb) for every tile of mr <= max_rows rows from m0 by nb <= max_panel
// blocks of 16 outputs from block b0, split between torch's threads.
template <typename Run>
void for_each_tile(int64_t M, int64_t N, int64_t max_rows, int64_t max_panel, Run run) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t row_tiles = (M + max_rows - 1) / max_rows;
  // Panels of up to max_panel blocks, narrower where the threads would get unequal shares (9 items on 2 threads:
  // one waits a ninth of the time) or too few items to split.
  const int64_t threads = at::get_num_threads();
  int64_t panel = max_panel;
  while (panel > 1) {
    const int64_t items = (blocks + panel - 1) / panel * row_tiles;
    const int64_t idle = (items + threads - 1) / threads * threads - items;
    if (items >= 4 * threads && idle * 10 <= items) break;
    panel /= 2;
  }
  const int64_t panels = (blocks + panel - 1) / panel;
  // Work items panel-major: the row tiles of one panel follow each other, its weights warm in cache.
  at::parallel_for(0, panels * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / row_tiles, t = i % row_tiles;
      const int64_t b0 = p * panel, m0 = t * max_rows;
      run(m0, static_cast<int>(std::min<int64_t>(max_rows, M - m0)), b0,
          static_cast<int>(std::min<int64_t>(panel, blocks - b0)));
    }
  });
}

// The float tiles over x [M, ldx] (ldx: its row stride in X elements, also the K the tile runs over), the packed
// weight `block_stride` elements a block, y [M, N]; `tile(mr, nb)` gives the micro-kernel of mr rows by nb blocks.
template <typename X, typename W, typename Select>
void matmul_tiles(const X* x, int64_t M, int64_t ldx, const W* w, int64_t block_stride, int64_t N, float* y,
                  int64_t max_panel, Select tile) {
  for_each_tile(M, N, kMaxRows, max_panel, [&](int64_t m0, int mr, int64_t b0, int nb) {
    const int64_t n0 = b0 * kBlock;
    tile(mr, nb)(x + m0 * ldx, ldx, w + b0 * block_stride, y + m0 * N + n0, N, std::min<int64_t>(nb * kBlock, N - n0));
  });
}

// The op's result from the float32 products y [M, N]: + bias, in `dtype` (x's), in one pass without a torch op
// per step (each costs microseconds, ~120 linears a decode step).
inline at::Tensor finish(const at::Tensor& y, const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (dtype == at::kFloat && !has_bias) return y;
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  const int64_t M = y.size(0), N = y.size(1);
  float* yp = y.data_ptr<float>();
  auto store = [&](auto* out) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) out[m * N + n] = yp[m * N + n] + (bp ? bp[n] : 0.0f);
  };
  if (dtype == at::kFloat) {
    store(yp);
    return y;
  }
  auto out = at::empty({M, N}, y.options().dtype(dtype));
  if (dtype == at::kBFloat16) {
    store(out.data_ptr<c10::BFloat16>());
  } else if (dtype == at::kHalf) {
    store(out.data_ptr<c10::Half>());
  } else {
    if (has_bias) y.add_(b);
    return y.to(dtype);
  }
  return out;
}

}  // namespace tessera_kernels
