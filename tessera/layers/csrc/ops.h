// The native ops other native code calls directly (the fused decoder layer): the weight-streaming products of
// gemv.cpp and gemv_quant.cpp. Arguments as the torch ops of the same names (native_kernels.py).
#pragma once

#include <ATen/ATen.h>

namespace tessera_kernels {

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                int64_t isa);
at::Tensor gemv_bf16dot(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const c10::optional<at::Tensor>& bias);
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t isa);
at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                     const c10::optional<at::Tensor>& bias, int64_t isa, int64_t zero_point);

}  // namespace tessera_kernels
