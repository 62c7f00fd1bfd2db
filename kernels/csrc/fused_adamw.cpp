// libtorch's fused multi-tensor AdamW (torch.optim.AdamW(fused=True)), which tch does not bind:
// one kernel over every parameter instead of a dozen elementwise passes per tensor.
#include <ATen/ops/_fused_adamw.h>
#include <cstdio>
#include <exception>
#include <vector>

static std::vector<at::Tensor> list(const at::Tensor* const* ts, size_t n) {
  std::vector<at::Tensor> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back(*ts[i]);
  return v;
}

// `step` is one float tensor on the parameters' device holding the step number (already
// incremented), read by every tensor's update.
extern "C" int dflash_fused_adamw(
    const at::Tensor* const* params, const at::Tensor* const* grads, const at::Tensor* const* exp_avgs,
    const at::Tensor* const* exp_avg_sqs, size_t n, const at::Tensor* step, double lr, double beta1, double beta2,
    double weight_decay, double eps, char* err, size_t err_len) {
  try {
    std::vector<at::Tensor> steps(n, *step);
    at::_fused_adamw_(list(params, n), list(grads, n), list(exp_avgs, n), list(exp_avg_sqs, n), {}, steps, lr, beta1,
                      beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
