// Weight-streaming matrix products for decode steps: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a
// few rows of x, the weight float32, bfloat16 or float16, re-packed once at load as [N / 16][K][16]: the 16
// outputs of a block side by side at each k, so each thread reads one sequential stream per block, and each
// weight vector, loaded once, is multiplied by a broadcast of x[m, k] for every row m (one accumulator
// vector of 16 outputs per row of x; few rows get several chains over k). 16-bit weights are widened to
// float32 in registers (exact): products and sums are float32 whatever the weight type, on every ISA.
//
// The ISA is the caller's choice (the Python side asks the CPU; ATEN_CPU_CAPABILITY=avx2 forces AVX2 on a
// newer one): AVX-512 (F, BW, VL) or AVX2 + FMA + F16C, each compiled with its own target attribute, so one
// build runs on every x86-64 CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

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
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, lo[m]);
    _mm256_store_ps(out + 8, hi[m]);
    for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = out[j];
  }
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

// The loop over tiles. x [M, ldx] (ldx: its row stride in X elements), the packed weight `block_stride`
// elements a block, y [M, N]; `tile(mr, nb)` gives the micro-kernel of mr rows by nb blocks.
template <typename X, typename W, typename Select>
void matmul_tiles(const X* x, int64_t M, int64_t ldx, const W* w, int64_t block_stride, int64_t N, float* y,
                  int64_t max_panel, Select tile) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t row_tiles = (M + kMaxRows - 1) / kMaxRows;
  // Panels of up to max_panel blocks, fewer where that would leave threads idle.
  int64_t panel = max_panel;
  while (panel > 1 && (blocks + panel - 1) / panel * row_tiles < 4 * at::get_num_threads()) panel /= 2;
  const int64_t panels = (blocks + panel - 1) / panel;
  // Work items panel-major: the row tiles of one panel follow each other, its weights warm in cache.
  at::parallel_for(0, panels * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / row_tiles, t = i % row_tiles;
      const int64_t b0 = p * panel, m0 = t * kMaxRows;
      const int nb = static_cast<int>(std::min<int64_t>(panel, blocks - b0));
      const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      const int64_t n0 = b0 * kBlock;
      tile(mr, nb)(x + m0 * ldx, ldx, w + b0 * block_stride, y + m0 * N + n0, N,
                   std::min<int64_t>(nb * kBlock, N - n0));
    }
  });
}

template <typename W>
void matmul_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t isa) {
  matmul_tiles(x, M, K, w, K * kBlock, N, y, isa == kAvx512 ? 4 : 1,
               [isa](int mr, int nb) { return tile_fn<W>(isa, mr, nb); });
}

// ---- bfloat16 weights and x by bf16 dot products (AVX512-BF16) ---------------------------------------------
// The weight packed as [N / 16, K2 / 2, 16, 2] (K2: K rounded up to even, zeros past K): at each pair of k the
// 16 outputs' two weights side by side, as vdpbf16ps takes them; x's two values at those k are broadcast as
// one 32-bit pair. Each instruction adds two exact products to a float32 accumulator (two multiply-adds a lane,
// where widening does one), which is what oneDNN's bfloat16 kernels do too.

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c,avx512bf16")))

template <int MR, int NB>
AVX512BF16 void tile_bf16dot(const uint16_t* x, int64_t K2, const uint16_t* w, float* y, int64_t ldy, int64_t nvalid) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t stride = K2 * kBlock;  // from one block to the next
  for (int64_t kp = 0; kp < K2 / 2; ++kp) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * stride + kp * 2 * kBlock);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K2 + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  store_tile<MR, NB>(acc, y, ldy, nvalid);
}

template <int MR>
TileFn<uint16_t, uint16_t> bf16dot_of(int nb) {
  switch (nb) {
    case 1: return tile_bf16dot<MR, 1>;
    case 2: return tile_bf16dot<MR, 2>;
    case 3: return tile_bf16dot<MR, 3>;
    default: return tile_bf16dot<MR, 4>;
  }
}

TileFn<uint16_t, uint16_t> bf16dot_fn(int mr, int nb) {
  switch (mr) {
    case 1: return bf16dot_of<1>(nb);
    case 2: return bf16dot_of<2>(nb);
    case 3: return bf16dot_of<3>(nb);
    case 4: return bf16dot_of<4>(nb);
    case 5: return bf16dot_of<5>(nb);
    default: return bf16dot_of<6>(nb);
  }
}

at::Tensor gemv_bf16dot(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kBlock && packed.size(3) == 2 &&
                  packed.size(1) == (x.size(1) + 1) / 2 && packed.size(0) * kBlock >= N &&
                  packed.scalar_type() == at::kBFloat16,
              "tessera::gemv_bf16dot: x [M, K] and a bfloat16 weight packed as [N / 16, K / 2, 16, 2] expected, got ",
              x.sizes(), " and ", packed.sizes(), " (", packed.scalar_type(), ")");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1) * 2;
  auto xb = x.to(at::kBFloat16);
  if (K2 != K) xb = at::constant_pad_nd(xb, {0, K2 - K});  // a zero past K meets the weight's zero
  xb = xb.contiguous();
  const auto w = packed.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  matmul_tiles(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K2,
               reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K2 * kBlock, N, y.data_ptr<float>(), 4,
               [](int mr, int nb) { return bf16dot_fn(mr, nb); });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x.size(1) &&
                  packed.size(0) * kBlock >= N,
              "tessera::gemv: x [M, K] and a packed weight [N / 16, K, 16] expected, got ", x.sizes(), " and ",
              packed.sizes());
  TORCH_CHECK(isa == kAvx2 || isa == kAvx512, "tessera::gemv: isa must be 1 (AVX2) or 2 (AVX-512)");
  const auto x32 = x.to(at::kFloat).contiguous();
  const auto w = packed.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  switch (w.scalar_type()) {
    case at::kFloat:
      matmul_impl<float>(x32.data_ptr<float>(), M, K, w.data_ptr<float>(), N, y.data_ptr<float>(), isa);
      break;
    case at::kBFloat16:
      matmul_impl<c10::BFloat16>(x32.data_ptr<float>(), M, K, w.data_ptr<c10::BFloat16>(), N, y.data_ptr<float>(), isa);
      break;
    case at::kHalf:
      matmul_impl<c10::Half>(x32.data_ptr<float>(), M, K, w.data_ptr<c10::Half>(), N, y.data_ptr<float>(), isa);
      break;
    default:
      TORCH_CHECK(false, "tessera::gemv: weight dtype ", w.scalar_type(), " is not float32, bfloat16 or float16");
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(tessera, m) {
  m.def("gemv(Tensor x, Tensor packed, int n, Tensor? bias, int isa) -> Tensor");
  m.def("gemv_bf16dot(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("gemv_bf16dot", gemv_bf16dot);
}
