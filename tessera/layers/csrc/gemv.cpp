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
#include <torch/library.h>

#include "ops.h"
#include "tiles.h"

namespace {

using namespace tessera_kernels;

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

}  // namespace

namespace tessera_kernels {

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
  return finish(y, bias, x.scalar_type());
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
  return finish(y, bias, x.scalar_type());
}

}  // namespace tessera_kernels

TORCH_LIBRARY(tessera, m) {
  m.def("gemv(Tensor x, Tensor packed, int n, Tensor? bias, int isa) -> Tensor");
  m.def("gemv_bf16dot(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tessera, CPU, m) {
  m.impl("gemv", tessera_kernels::gemv);
  m.impl("gemv_bf16dot", tessera_kernels::gemv_bf16dot);
}
