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

// ---- one block of 16 outputs ------------------------------------------------------------------------

constexpr int kBlock = 16;

template <typename W>
AVX512 inline __m512 load_block512(const W* p) { return load16_512<W>(p, 0xFFFF); }

template <typename W, int MB>
AVX512 void block_avx512(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t nvalid) {
  constexpr int U = MB == 1 ? 4 : MB == 2 ? 2 : 1;  // independent chains for few rows of x
  __m512 acc[U][MB];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MB; ++m) acc[u][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) {
      const __m512 wv = load_block512<W>(w + (k + u) * kBlock);
      for (int m = 0; m < MB; ++m) acc[u][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k + u]), wv, acc[u][m]);
    }
  for (; k < K; ++k) {
    const __m512 wv = load_block512<W>(w + k * kBlock);
    for (int m = 0; m < MB; ++m) acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[0][m]);
  }
  const __mmask16 mask = nvalid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << nvalid) - 1);
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[0][m];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][m]);
    _mm512_mask_storeu_ps(y + m * ldy, mask, sum);
  }
}

template <typename W, int MB>
AVX2 void block_avx2(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t nvalid) {
  constexpr int U = MB == 1 ? 2 : 1;
  __m256 lo[U][MB], hi[U][MB];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MB; ++m) lo[u][m] = hi[u][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) {
      const W* p = w + (k + u) * kBlock;
      const __m256 wl = load8_256<W>(p), wh = load8_256<W>(p + 8);
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_set1_ps(x[m * K + k + u]);
        lo[u][m] = _mm256_fmadd_ps(xv, wl, lo[u][m]);
        hi[u][m] = _mm256_fmadd_ps(xv, wh, hi[u][m]);
      }
    }
  for (; k < K; ++k) {
    const W* p = w + k * kBlock;
    const __m256 wl = load8_256<W>(p), wh = load8_256<W>(p + 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * K + k]);
      lo[0][m] = _mm256_fmadd_ps(xv, wl, lo[0][m]);
      hi[0][m] = _mm256_fmadd_ps(xv, wh, hi[0][m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m256 l = lo[0][m], h = hi[0][m];
    for (int u = 1; u < U; ++u) l = _mm256_add_ps(l, lo[u][m]), h = _mm256_add_ps(h, hi[u][m]);
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, l);
    _mm256_store_ps(out + 8, h);
    for (int64_t j = 0; j < nvalid; ++j) y[m * ldy + j] = out[j];
  }
}

template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t);

template <typename W, int MB>
BlockFn<W> block_fn_of(int64_t isa) {
  return isa == kAvx512 ? block_avx512<W, MB> : block_avx2<W, MB>;
}

template <typename W>
BlockFn<W> block_fn(int64_t isa, int mb) {
  switch (mb) {
    case 1: return block_fn_of<W, 1>(isa);
    case 2: return block_fn_of<W, 2>(isa);
    case 3: return block_fn_of<W, 3>(isa);
    case 4: return block_fn_of<W, 4>(isa);
    case 5: return block_fn_of<W, 5>(isa);
    case 6: return block_fn_of<W, 6>(isa);
    case 7: return block_fn_of<W, 7>(isa);
    default: return block_fn_of<W, 8>(isa);
  }
}

constexpr int kMaxBlockRows = 8;

template <typename W>
void packed_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t isa) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t nvalid = std::min<int64_t>(kBlock, N - b * kBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxBlockRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxBlockRows, M - m0));
        block_fn<W>(isa, mb)(x + m0 * K, K, w + b * K * kBlock, y + m0 * N + b * kBlock, N, nvalid);
      }
    }
  });
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
      packed_impl<float>(x32.data_ptr<float>(), M, K, w.data_ptr<float>(), N, y.data_ptr<float>(), isa);
      break;
    case at::kBFloat16:
      packed_impl<c10::BFloat16>(x32.data_ptr<float>(), M, K, w.data_ptr<c10::BFloat16>(), N, y.data_ptr<float>(), isa);
      break;
    case at::kHalf:
      packed_impl<c10::Half>(x32.data_ptr<float>(), M, K, w.data_ptr<c10::Half>(), N, y.data_ptr<float>(), isa);
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
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("gemv", gemv);
}
