// libtorch's multi-tensor ops for the optimizer step, which tch does not bind: fused AdamW
// (torch.optim.AdamW(fused=True)), one kernel over every parameter instead of a dozen elementwise
// passes per tensor; and the gradient clip's scaling, one kernel over every gradient.
#include <ATen/ops/_foreach_mul.h>
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

// Every tensor times `scale` (a one-element tensor on their device), in place: torch's
// _foreach_mul_ as clip_grad_norm_(foreach=True) calls it.
extern "C" int dflash_foreach_mul_(const at::Tensor* const* ts, size_t n, const at::Tensor* scale, char* err, size_t err_len) {
  try {
    at::_foreach_mul_(list(ts, n), *scale);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}
