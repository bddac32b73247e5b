// One decoder layer of a decode step as one call: RMSNorm -> QKV -> (q/k norm) -> rotary -> K/V into the paged
// cache -> attention over each sequence's blocks -> O (-> norm) + residual -> RMSNorm -> gate/up -> act(gate) * up
// -> down (-> norm) + residual, for the Llama-shaped layers (Llama, Mistral, Qwen2/3 and the VLMs built on them)
// and Gemma 3's (norms of (1 + w) in float32, and after the attention and the MLP too).
//
// Why: eager PyTorch spends ~20 us of Python and dispatch per small op, ~400 us a layer, which at batch-1 decode
// of a 135M model is more than the weights take to read. Here the linears call the native kernels directly, and
// RMSNorm, rotary, the cache write and attention (reading K / V through the block tables, no gather) are one pass
// each, with the eager modules' roundings (tessera/models/llama.py, layers/attention.py, rotary.py,
// layernorm.py): only the order of float32 sums differs.
//
// Under tensor parallelism the layer is three calls (attention, mlp, finish), the ranks' o and down outputs summed
// between them by the caller.
//
// A `DecodeLayer` (a torch custom class) is built once per layer from its weights (each linear in the layout its
// kernel streams); `forward` takes what changes per step: the hidden states, the rotary tables of the step, the
// layer's caches and the step's decode tables.
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "tiles.h"

namespace {

using namespace tessera_kernels;

// How a linear's weight is held (native_kernels.py / cpu_kernels.py: the same kinds).
enum Kind : int64_t { kDense = 0, kNative = 1, kBf16Dot = 2, kInt8 = 3, kInt4 = 4, kOneDnn = 5 };

struct LinearWeight {
  int64_t kind = kDense, n = 0, isa = 0, zero_point = 8;  // zero_point: int4's (gemv_quant.cpp)
  at::Tensor w, scales;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kNative: return gemv(x, w, n, bias, isa);
      case kBf16Dot: return gemv_bf16dot(x, w, n, bias);
      case kInt8: return gemv_int8(x, w, scales, n, bias, isa);
      case kInt4: return gemv_int4(x, w, scales, n, bias, isa, zero_point);
      case kOneDnn: return onednn(x);
      default: return at::linear(x, w, bias);
    }
  }

  at::Tensor onednn(const at::Tensor& x) const {  // mkldnn::_linear_pointwise(x, w, bias, "none", [], "")
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&stack);
    return stack.back().toTensor();
  }
};

// ---- the small ops, natively: one pass each instead of several torch ops ----------------------------------------

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// y = the eager RMSNorm's (layernorm.py) with the same roundings: float32 x * rsqrt(mean(x^2) + eps), rounded to
// x's dtype, times the weight (rounded again); float32: (x * r) * w. Only the order of the sum of squares differs.
// unit_offset: Gemma 3's (models/gemma3.py Gemma3RMSNorm): (x * r) * (1 + w) all in float32, rounded once.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps, bool unit_offset) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * n;
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += as_float(row[i]) * as_float(row[i]);
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      if (unit_offset) {
        const float normed = as_float(row[i]) * scale;
        y[r * n + i] = static_cast<T>(normed * (1.0f + as_float(w[i])));
      } else {
        const T normed = static_cast<T>(as_float(row[i]) * scale);
        y[r * n + i] = static_cast<T>(as_float(w[i]) * as_float(normed));
      }
    }
  }
}

// rotary.py's apply_rotary on [B, H, D] rows with cos / signed sin [B, R], elementwise with the eager roundings:
// out[i] = x[i] * cos[i] + x[(i + R / 2) mod R] * sin[i] (each product and the sum rounded to T), i < R.
template <typename T>
void rotate_rows(const T* x, int64_t batch, int64_t heads, int64_t d, int64_t x_row, int64_t x_head, const T* cos,
                 const T* sin, int64_t r, T* out) {
  const int64_t half = r / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const T* in = x + b * x_row + h * x_head;
      T* o = out + (b * heads + h) * d;
      for (int64_t i = 0; i < r; ++i) {
        const T a = static_cast<T>(as_float(in[i]) * as_float(cos[b * r + i]));
        const T c = static_cast<T>(as_float(in[(i + half) % r]) * as_float(sin[b * r + i]));
        o[i] = static_cast<T>(as_float(a) + as_float(c));
      }
      for (int64_t i = r; i < d; ++i) o[i] = in[i];
    }
}

// q . key and acc += p * value over D floats (D a multiple of 8), 8 lanes at a time (AVX2 + FMA, which every CPU
// that runs the native kernels has): the scalar loops' one dependent sum took ~50 us a layer.
template <typename C>
AVX2 float dot8(const float* q, const C* key, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_256<C>(key + i), acc);
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

template <typename C>
AVX2 void axpy8(float p, const C* value, float* acc, int64_t d) {
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8_256<C>(value + i), _mm256_loadu_ps(acc + i)));
}

// AVX-512, D a multiple of 16: the dot in two chains; the weighted sum of values kept in registers over all
// positions, 64 dimensions at a time (a 64-wide head: one pass), instead of a load and a store per position.
template <typename C>
AVX512 float dot16(const float* q, const C* key, int64_t d) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16_512<C>(key + i, 0xFFFF), a);
    b = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load16_512<C>(key + i + 16, 0xFFFF), b);
  }
  if (i < d) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16_512<C>(key + i, 0xFFFF), a);
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

// acc[0, d) = sum over the n positions of p[l] * value(l)[0, d), value(l) = values + offsets[l].
template <typename C>
AVX512 void weighted_sum16(const float* p, const C* values, const int64_t* offsets, int64_t n, int64_t d, float* acc) {
  for (int64_t c = 0; c < d; c += 64) {
    const int64_t width = std::min<int64_t>(64, d - c);  // a multiple of 16
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t l = 0; l < n; ++l) {
      const __m512 pv = _mm512_set1_ps(p[l]);
      const C* v = values + offsets[l] + c;
      s0 = _mm512_fmadd_ps(pv, load16_512<C>(v, 0xFFFF), s0);
      if (width > 16) s1 = _mm512_fmadd_ps(pv, load16_512<C>(v + 16, 0xFFFF), s1);
      if (width > 32) s2 = _mm512_fmadd_ps(pv, load16_512<C>(v + 32, 0xFFFF), s2);
      if (width > 48) s3 = _mm512_fmadd_ps(pv, load16_512<C>(v + 48, 0xFFFF), s3);
    }
    _mm512_storeu_ps(acc + c, s0);
    if (width > 16) _mm512_storeu_ps(acc + c + 16, s1);
    if (width > 32) _mm512_storeu_ps(acc + c + 32, s2);
    if (width > 48) _mm512_storeu_ps(acc + c + 48, s3);
  }
}

template <typename C>
float dot(const float* q, const C* key, int64_t d, bool avx512) {
  if (avx512 && d % 16 == 0) return dot16(q, key, d);
  if (d % 8 == 0) return dot8(q, key, d);
  float sum = 0;
  for (int64_t i = 0; i < d; ++i) sum += q[i] * as_float(key[i]);
  return sum;
}

template <typename C>
void weighted_sum(const float* p, const C* values, const int64_t* offsets, int64_t n, int64_t d, float* acc,
                  bool avx512) {
  if (avx512 && d % 16 == 0) return weighted_sum16(p, values, offsets, n, d, acc);
  std::fill(acc, acc + d, 0.0f);
  for (int64_t l = 0; l < n; ++l) {
    if (d % 8 == 0) {
      axpy8(p[l], values + offsets[l], acc, d);
    } else {
      for (int64_t i = 0; i < d; ++i) acc[i] += p[l] * as_float(values[offsets[l] + i]);
    }
  }
}

// Decode attention over the paged cache, the step's k / v written first: per sequence b and query head, softmax of
// scale * q . k over the cache positions its mask row shows (table order), times v; float32 sums, the output
// rounded to T. cache [blocks, block_size, kv_heads, D]; tables [B, nb]; mask [B, nb * block_size]. The visible
// positions' cache offsets are listed once per sequence (no division per position and head).
template <typename T, typename C>
void decode_attention(const T* q, const T* k, const T* v, int64_t q_row, int64_t kv_row, int64_t v_row, C* k_cache,
                      C* v_cache,
                      const int64_t* slots, const int64_t* tables, const bool* mask, int64_t batch, int64_t nb,
                      int64_t block_size, int64_t heads, int64_t kv_heads, int64_t d, float scale, T* out,
                      bool avx512) {
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < d; ++i) {
        k_cache[(slots[b] * kv_heads + h) * d + i] = static_cast<C>(as_float(k[b * kv_row + h * d + i]));
        v_cache[(slots[b] * kv_heads + h) * d + i] = static_cast<C>(as_float(v[b * v_row + h * d + i]));
      }
  const int64_t group = heads / kv_heads, positions = nb * block_size;
  std::vector<int64_t> offsets(batch * positions), counts(batch);  // the visible slots' offsets (kv head 0)
  for (int64_t b = 0; b < batch; ++b) {
    int64_t n = 0;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t first = tables[b * nb + j] * block_size;
      for (int64_t t = 0; t < block_size; ++t)
        if (mask[b * positions + j * block_size + t]) offsets[b * positions + n++] = (first + t) * kv_heads * d;
    }
    counts[b] = n;
  }
  const int64_t work = batch * heads * positions * d;
  at::parallel_for(0, batch * heads, std::max<int64_t>(1, (batch * heads) * (1 << 15) / std::max<int64_t>(work, 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> scores(positions), qf(d), acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads, g = h / group, n = counts[b];
      const int64_t* offset = offsets.data() + b * positions;
      for (int64_t i = 0; i < d; ++i) qf[i] = as_float(q[b * q_row + h * d + i]);
      const C* keys = k_cache + g * d;
      float best = -INFINITY;
      for (int64_t l = 0; l < n; ++l) {
        scores[l] = dot(qf.data(), keys + offset[l], d, avx512) * scale;
        best = std::max(best, scores[l]);
      }
      float total = 0;
      for (int64_t l = 0; l < n; ++l) {
        scores[l] = std::exp(scores[l] - best);
        total += scores[l];
      }
      weighted_sum(scores.data(), v_cache + g * d, offset, n, d, acc.data(), avx512);
      for (int64_t i = 0; i < d; ++i) out[(b * heads + h) * d + i] = static_cast<T>(acc[i] / total);
    }
  });
}

// out = a + b, rounded to T as the eager residual add rounds it.
template <typename T>
void add_rows(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(as_float(a[i]) + as_float(b[i]));
}

template <typename F>
void with_dtype(at::ScalarType t, F f) {
  switch (t) {
    case at::kFloat: f(float()); break;
    case at::kBFloat16: f(c10::BFloat16()); break;
    case at::kHalf: f(c10::Half()); break;
    default: TORCH_CHECK(false, "DecodeLayer: dtype ", t, " is not float32, bfloat16 or float16");
  }
}

// layernorm.py's RMSNorm on the last dimension (rms_norm_rows: its roundings, natively).
struct Norm {
  at::Tensor weight;
  double eps = 1e-6;
  bool unit_offset = false;
  bool defined() const { return weight.defined(); }
  at::Tensor operator()(const at::Tensor& x) const {
    TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "DecodeLayer: a norm weight of ", weight.scalar_type(),
                " for x of ", x.scalar_type());
    const auto xc = x.contiguous();
    auto y = at::empty_like(xc);
    const int64_t n = weight.size(0);
    with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      rms_norm_rows(xc.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), xc.numel() / n, n, static_cast<float>(eps),
                    unit_offset);
    });
    return y;
  }
};

struct DecodeLayer : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, activation, isa;  // activation: 0 silu, 1 gelu (tanh); isa: attention's
  double scale;
  // post: before the MLP (Llama's post_attention_layernorm, Gemma 3's pre_feedforward_layernorm); attn_out and
  // mlp_out (Gemma 3): on the attention's and the MLP's outputs, before their residual adds
  Norm input_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  LinearWeight qkv, o, gate_up, down;

  DecodeLayer(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, int64_t activation, int64_t isa)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), activation(activation), isa(isa), scale(scale) {}

  void set_norm(const std::string& name, at::Tensor weight, double eps, bool unit_offset) {
    TORCH_CHECK(name == "input" || name == "post" || name == "q" || name == "k" || name == "attn_out" ||
                    name == "mlp_out",
                "DecodeLayer: no norm ", name);
    Norm& norm = name == "input" ? input_norm : name == "post" ? post_norm : name == "q" ? q_norm
               : name == "k" ? k_norm : name == "attn_out" ? attn_out_norm : mlp_out_norm;
    norm = Norm{std::move(weight), eps, unit_offset};
  }

  void set_linear(const std::string& name, int64_t kind, at::Tensor w, c10::optional<at::Tensor> scales,
                  c10::optional<at::Tensor> bias, int64_t n, int64_t isa, int64_t zero_point) {
    TORCH_CHECK(name == "qkv" || name == "o" || name == "gate_up" || name == "down", "DecodeLayer: no linear ", name);
    LinearWeight& l = name == "qkv" ? qkv : name == "o" ? o : name == "gate_up" ? gate_up : down;
    l = LinearWeight{kind, n, isa, zero_point, std::move(w), scales.value_or(at::Tensor()), std::move(bias)};
  }

  // x [B, hidden], one decode token of B sequences; cos / signed sin [B, 1, R]; the caches [blocks, block_size,
  // kv_heads, head_dim]; slots [B]; tables [B, blocks] and mask [B, blocks * block_size] of the visible cache
  // positions. -> [B, hidden]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& mask) {
    const auto [hidden, down_out] = mlp(x, attention(x, cos, sin, k_cache, v_cache, slots, tables, mask));
    return finish(hidden, down_out);
  }

  // Under tensor parallelism the o and down projections hold this rank's columns: the caller sums their outputs
  // over the ranks between the three parts (what RowParallelLinear's all-reduce does in the eager layer).
  //   attention(x, ...) -> o_proj(attention(norm(x)))        (this rank's part of the sum)
  //   mlp(x, o)         -> (h = x + norm(o), down(act(gate) * up of norm(h)))   (o summed; down: this rank's part)
  //   finish(h, down)   -> h + norm(down)                     (down summed)
  at::Tensor attention(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                       at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& mask) {
    const int64_t batch = x.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    // attention: models/llama.py LlamaAttention.forward
    const auto qkv_out = qkv(input_norm(x)).contiguous();  // [B, q | k | v]
    const int64_t width = qkv_out.size(1);
    // q and k as they are in qkv_out (row stride `width`), or normed copies (Qwen3, Gemma 3's q/k norms)
    at::Tensor q_normed, k_normed;
    if (q_norm.defined()) {
      q_normed = q_norm(qkv_out.narrow(-1, 0, q_width).view({batch, heads, head_dim}));
      k_normed = k_norm(qkv_out.narrow(-1, q_width, kv_width).view({batch, kv_heads, head_dim}));
    }
    // rotary, the cache write and attention natively (layers/attention.py's numbers up to float32 sums)
    const int64_t r = cos.size(-1);
    auto q_rot = at::empty({batch, heads, head_dim}, x.options());
    auto k_rot = at::empty({batch, kv_heads, head_dim}, x.options());
    auto attn = at::empty({batch, heads, head_dim}, x.options());
    const auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
    const auto slots_c = slots.to(at::kLong).contiguous(), tables_c = tables.to(at::kLong).contiguous();
    const auto mask_c = mask.to(at::kBool).contiguous();
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
                "DecodeLayer: contiguous key and value caches of one dtype expected");
    with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* base = qkv_out.data_ptr<T>();
      const T* q = q_normed.defined() ? q_normed.data_ptr<T>() : base;
      const T* k = k_normed.defined() ? k_normed.data_ptr<T>() : base + q_width;
      const int64_t q_row = q_normed.defined() ? q_width : width, k_row = k_normed.defined() ? kv_width : width;
      rotate_rows(q, batch, heads, head_dim, q_row, head_dim, cos_c.data_ptr<T>(), sin_c.data_ptr<T>(), r,
                  q_rot.data_ptr<T>());
      rotate_rows(k, batch, kv_heads, head_dim, k_row, head_dim, cos_c.data_ptr<T>(), sin_c.data_ptr<T>(), r,
                  k_rot.data_ptr<T>());
      with_dtype(k_cache.scalar_type(), [&](auto cache_tag) {
        using C = decltype(cache_tag);
        decode_attention<T, C>(q_rot.data_ptr<T>(), k_rot.data_ptr<T>(), base + q_width + kv_width, q_width, kv_width,
                               width, k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), slots_c.data_ptr<int64_t>(),
                               tables_c.data_ptr<int64_t>(), mask_c.data_ptr<bool>(), batch, tables_c.size(1),
                               k_cache.size(1), heads, kv_heads, head_dim, static_cast<float>(scale),
                               attn.data_ptr<T>(), isa == kAvx512);
      });
    });
    return o(attn.view({batch, q_width})).contiguous();
  }

  // o (+ its norm) + residual, then the MLP (LlamaMLP.forward) up to down's output
  std::tuple<at::Tensor, at::Tensor> mlp(const at::Tensor& x, const at::Tensor& o_out) {
    const auto xc = x.contiguous();
    auto hidden = at::empty_like(xc);
    const auto o_normed = attn_out_norm.defined() ? attn_out_norm(o_out) : o_out.contiguous();
    const auto gu = gate_up(post_norm(residual(xc, o_normed, hidden))).contiguous();
    // act(gate) * up by ATen's vectorized activations (a scalar exp per element cost ~30 us a layer)
    const int64_t inter = gu.size(-1) / 2;
    const auto gate = gu.narrow(-1, 0, inter), up = gu.narrow(-1, inter, inter);
    const auto act = (activation == 0 ? at::silu(gate) : at::gelu(gate, "tanh")).mul_(up);
    return {hidden, down(act).contiguous()};
  }

  // (+ down's norm) + residual
  at::Tensor finish(const at::Tensor& hidden, const at::Tensor& down_out) {
    const auto d = mlp_out_norm.defined() ? mlp_out_norm(down_out) : down_out.contiguous();
    return residual(hidden, d, at::empty_like(hidden));
  }

  // out = a + b (same shapes, contiguous, x's dtype)
  static const at::Tensor& residual(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
    TORCH_CHECK(a.scalar_type() == b.scalar_type(), "DecodeLayer: a residual of ", b.scalar_type(), " for ",
                a.scalar_type());
    with_dtype(a.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      add_rows(a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), a.numel());
    });
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera, m) {
  m.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t, int64_t>())
      .def("set_norm", &DecodeLayer::set_norm)
      .def("set_linear", &DecodeLayer::set_linear)
      .def("forward", &DecodeLayer::forward)
      .def("attention", &DecodeLayer::attention)
      .def("mlp", &DecodeLayer::mlp)
      .def("finish", &DecodeLayer::finish);
}
