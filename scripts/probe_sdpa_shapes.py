"""Does attention cost more when every call has a new key length, as in decoding? SmolLM2-135M's
shapes (9 query heads, 3 KV heads of 64): the target's one-token step (a boolean mask) and the
drafter's 8-token block (no mask), f32 and bf16, each with the default backend choice and with
cuDNN's attention turned off. Run on the GPU: python3 scripts/probe_sdpa_shapes.py"""
import time

import torch
import torch.nn.functional as F


def bench(dtype, q_len, masked, grow, calls=200):
    dev = "cuda"
    q = torch.randn(1, 9, q_len, 64, device=dev, dtype=dtype)
    times = []
    for i in range(calls):
        s = 300 + (i if grow else 0)
        k = torch.randn(1, 3, s, 64, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        mask = torch.ones(1, 1, q_len, s, device=dev, dtype=torch.bool) if masked else None
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times = sorted(times[10:])
    return 1e3 * sum(times) / len(times), 1e3 * times[len(times) // 2]


print("torch", torch.__version__, torch.cuda.get_device_name())
for cudnn in (True, False):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    for dtype in (torch.float32, torch.bfloat16):
        for name, q_len, masked in (("target step", 1, True), ("drafter block", 8, False)):
            for grow in (False, True):
                mean, med = bench(dtype, q_len, masked, grow)
                print(f"cudnn {'on ' if cudnn else 'off'} {str(dtype):15} {name:13} {'new length each call' if grow else 'same length         '}: mean {mean:.3f} ms, median {med:.3f} ms")
