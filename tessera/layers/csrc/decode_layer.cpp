// One decoder layer of a decode step as one call: RMSNorm -> QKV -> (q/k norm) -> rotary -> K/V into the paged
// cache -> attention over each sequence's blocks -> O + residual -> RMSNorm -> gate/up -> act(gate) * up -> down
// + residual, for the Llama-shaped layers (Llama, Mistral, Qwen2/3 and the VLMs built on them).
//
// Why: eager PyTorch spends ~20 us of Python and dispatch per small op, ~400 us a layer, which at batch-1 decode
// of a 135M model is more than the weights take to read. Here the same ops run from C++, in the same order and
// dtypes as the eager modules (tessera/models/llama.py, layers/attention.py, rotary.py, layernorm.py), so the
// numbers are the eager path's bit for bit, and the linears call the native kernels directly.
//
// A `DecodeLayer` (a torch custom class) is built once per layer from its weights (each linear in the layout its
// kernel streams); `forward` takes what changes per step: the hidden states, the rotary tables of the step, the
// layer's caches and the step's decode tables.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

namespace {

using namespace tessera_kernels;

// How a linear's weight is held (native_kernels.py / cpu_kernels.py: the same kinds).
enum Kind : int64_t { kDense = 0, kNative = 1, kBf16Dot = 2, kInt8 = 3, kInt4 = 4, kOneDnn = 5 };

struct LinearWeight {
  int64_t kind = kDense, n = 0, isa = 0;
  at::Tensor w, scales;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kNative: return gemv(x, w, n, bias, isa);
      case kBf16Dot: return gemv_bf16dot(x, w, n, bias);
      case kInt8: return gemv_int8(x, w, scales, n, bias, isa);
      case kInt4: return gemv_int4(x, w, scales, n, bias, isa);
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

// layernorm.py's RMSNorm: F.rms_norm in float32 with the weight where both are float32, else weight * the
// float32 norm rounded to x's dtype.
struct Norm {
  at::Tensor weight;
  double eps = 1e-6;
  bool defined() const { return weight.defined(); }
  at::Tensor operator()(const at::Tensor& x) const {
    const std::vector<int64_t> shape = {weight.size(0)};
    if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat) return at::rms_norm(x, shape, weight, eps);
    return weight * at::rms_norm(x.to(at::kFloat), shape, c10::nullopt, eps).to(x.scalar_type());
  }
};

// rotary.py's apply_rotary: x * cos + roll(x, R / 2) * signed_sin on the first R features.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t r = cos.size(-1);
  if (r == x.size(-1)) return x * cos + at::roll(x, {r / 2}, {-1}) * sin;
  const auto rot = x.narrow(-1, 0, r);
  return at::cat({rot * cos + at::roll(rot, {r / 2}, {-1}) * sin, x.narrow(-1, r, x.size(-1) - r)}, -1);
}

struct DecodeLayer : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, activation;  // activation: 0 silu, 1 gelu (tanh)
  double scale;
  Norm input_norm, post_norm, q_norm, k_norm;
  LinearWeight qkv, o, gate_up, down;

  DecodeLayer(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, int64_t activation)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), activation(activation), scale(scale) {}

  void set_norm(const std::string& name, at::Tensor weight, double eps) {
    Norm& norm = name == "input" ? input_norm : name == "post" ? post_norm : name == "q" ? q_norm : k_norm;
    TORCH_CHECK(name == "input" || name == "post" || name == "q" || name == "k", "DecodeLayer: no norm ", name);
    norm = Norm{std::move(weight), eps};
  }

  void set_linear(const std::string& name, int64_t kind, at::Tensor w, c10::optional<at::Tensor> scales,
                  c10::optional<at::Tensor> bias, int64_t n, int64_t isa) {
    TORCH_CHECK(name == "qkv" || name == "o" || name == "gate_up" || name == "down", "DecodeLayer: no linear ", name);
    LinearWeight& l = name == "qkv" ? qkv : name == "o" ? o : name == "gate_up" ? gate_up : down;
    l = LinearWeight{kind, n, isa, std::move(w), scales.value_or(at::Tensor()), std::move(bias)};
  }

  // x [B, hidden], one decode token of B sequences; cos / signed sin [B, 1, R]; the caches [blocks, block_size,
  // kv_heads, head_dim]; slots [B]; tables [B, blocks] and mask [B, L] of the visible cache positions; for one
  // sequence (B == 1) its visible keys [start, end) instead of the mask. -> [B, hidden]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& mask,
                     int64_t start, int64_t end) {
    const int64_t batch = x.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
    // attention: models/llama.py LlamaAttention.forward
    const auto qkv_out = qkv(input_norm(x));
    auto q = qkv_out.narrow(-1, 0, q_width).view({batch, heads, head_dim});
    auto k = qkv_out.narrow(-1, q_width, kv_width).view({batch, kv_heads, head_dim});
    const auto v = qkv_out.narrow(-1, q_width + kv_width, kv_width).reshape({batch, kv_heads, head_dim});
    if (q_norm.defined()) {
      q = q_norm(q);
      k = k_norm(k);
    }
    q = rotate(q, cos, sin);
    k = rotate(k, cos, sin);
    // layers/attention.py PagedAttention.forward and _decode
    k_cache.view({-1, kv_heads, head_dim}).index_copy_(0, slots, k.to(k_cache.scalar_type()));
    v_cache.view({-1, kv_heads, head_dim}).index_copy_(0, slots, v.to(v_cache.scalar_type()));
    const auto flat = tables.flatten();
    auto keys = k_cache.index_select(0, flat).view({batch, -1, kv_heads, head_dim}).transpose(1, 2).to(x.scalar_type());
    auto values = v_cache.index_select(0, flat).view({batch, -1, kv_heads, head_dim}).transpose(1, 2).to(x.scalar_type());
    const auto grouped = q.view({batch, kv_heads, heads / kv_heads, head_dim});
    c10::optional<at::Tensor> visible;
    if (batch == 1) {
      keys = keys.narrow(2, start, end - start);
      values = values.narrow(2, start, end - start);
    } else {
      visible = mask.view({batch, 1, 1, -1});
    }
    const auto attn = at::scaled_dot_product_attention(grouped, keys, values, visible, 0.0, false, scale);
    auto hidden = x + o(attn.reshape({batch, q_width}));
    // MLP: LlamaMLP.forward
    const auto gu = gate_up(post_norm(hidden));
    const int64_t inter = gu.size(-1) / 2;
    const auto gate = gu.narrow(-1, 0, inter), up = gu.narrow(-1, inter, inter);
    const auto act = activation == 0 ? at::silu(gate) : at::gelu(gate, "tanh");
    return hidden + down(act * up);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera, m) {
  m.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<int64_t, int64_t, int64_t, double, int64_t>())
      .def("set_norm", &DecodeLayer::set_norm)
      .def("set_linear", &DecodeLayer::set_linear)
      .def("forward", &DecodeLayer::forward);
}
