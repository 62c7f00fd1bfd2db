// libtorch's cuDNN attention forward with its log-sum-exp, which tch does not bind (its backward
// it does). Tensors cross as tch's handles (at::Tensor*), a null bias for none; errors come back
// as text.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <cstdio>
#include <optional>
#include <exception>

extern "C" int dflash_cudnn_attention_forward(
    const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* bias, double scale,
    at::Tensor** out, at::Tensor** lse, at::Tensor** cum_q, at::Tensor** cum_k, int64_t* max_q, int64_t* max_k,
    at::Tensor** seed, at::Tensor** offset, char* err, size_t err_len) {
  try {
    std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(*bias) : std::nullopt;
    auto r = at::_scaled_dot_product_cudnn_attention(*q, *k, *v, b, true, 0.0, false, false, scale);
    *out = new at::Tensor(std::get<0>(r));
    *lse = new at::Tensor(std::get<1>(r));
    *cum_q = new at::Tensor(std::get<2>(r));
    *cum_k = new at::Tensor(std::get<3>(r));
    *max_q = std::get<4>(r).expect_int();
    *max_k = std::get<5>(r).expect_int();
    *seed = new at::Tensor(std::get<6>(r));
    *offset = new at::Tensor(std::get<7>(r));
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

// libtorch's switch for whether scaled_dot_product_attention may pick cuDNN's kernel; returns
// what it was.
extern "C" int dflash_allow_cudnn_sdp(int enabled) {
  int was = at::globalContext().userEnabledCuDNNSDP();
  at::globalContext().setSDPUseCuDNN(enabled != 0);
  return was;
}
