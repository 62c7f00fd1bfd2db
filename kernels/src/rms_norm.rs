//! A decoder layer's RMSNorm fused with the residual add next to it, one CUDA kernel each way
//! (csrc/rms_norm.cu), bf16, outside autograd: what a cut decoder layer
//! (`drafter_dflash`'s split-attention training) runs on a GPU. Where they do not apply the caller
//! runs libtorch's ops.

use crate::nvrtc;
use cudarc::driver::{sys::CUdevice_attribute, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/bf16x8.cuh"), include_str!("../csrc/rms_norm.cu"));
const FORWARD: &str = "add_rms_norm";
const BACKWARD: &str = "rms_norm_backward_add";
/// Whether the kernels apply to rows x [.., H]: bf16 on CUDA with the kernels enabled, dense and
/// 16-byte aligned, H a multiple of 8 up to 8,192 (a CTA of 1,024 threads, a group of 8 each).
pub fn applies(x: &Tensor) -> bool {
    let h = x.size().last().copied().unwrap_or(0);
    nvrtc::enabled()
        && x.device().is_cuda()
        && x.kind() == Kind::BFloat16
        && dense(x)
        && h > 0
        && h % 8 == 0
        && h <= 8192
}

fn dense(t: &Tensor) -> bool {
    t.is_contiguous() && t.data_ptr() as usize % 16 == 0
}

/// A CTA's threads for rows of h: one 8-element group each, in whole warps.
fn threads(h: i64) -> i64 {
    (h / 8 + 31) / 32 * 32
}

fn module(x: &Tensor) -> Result<nvrtc::Module, String> {
    let Device::Cuda(ordinal) = x.device() else { return Err("not a CUDA tensor".into()) };
    let h = *x.size().last().expect("applies checked a last dim");
    nvrtc::module(ordinal, SRC, &[("H", h), ("THREADS", threads(h))], &[FORWARD, BACKWARD])
}

/// A CTA a row at a time, as many CTAs as the device holds at once (when there are rows for
/// them): a second, partial wave would leave most SMs idle while it runs.
fn config(m: &nvrtc::Module, function: &str, rows: i64, h: i64) -> Result<LaunchConfig, String> {
    let sms = m
        .stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| e.to_string())?;
    let per_sm = m
        .function(function)
        .occupancy_max_active_blocks_per_multiprocessor(threads(h) as u32, 0, None)
        .map_err(|e| e.to_string())?;
    let ctas = rows.clamp(1, sms as i64 * per_sm.max(1) as i64) as u32;
    Ok(LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (threads(h) as u32, 1, 1), shared_mem_bytes: 0 })
}

/// Checks that `t` matches x for the kernels: same shape, bf16, dense and aligned.
fn like_x(name: &str, t: &Tensor, x: &Tensor) -> Result<(), String> {
    if t.size() != x.size() || t.kind() != Kind::BFloat16 || !dense(t) {
        return Err(format!(
            "{name} {:?} {:?}: expected x's shape {:?}, bf16, dense and 16-byte aligned",
            t.size(),
            t.kind(),
            x.size()
        ));
    }
    Ok(())
}

/// (s, w * s / rms(s)) with s = x + delta, for rows x [.., H] (`applies`) and delta of x's shape
/// (made dense if it is not).
pub fn add_forward(x: &Tensor, delta: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor), String> {
    let delta = delta.contiguous();
    like_x("delta", &delta, x)?;
    let m = module(x)?;
    let w = w.to_kind(Kind::BFloat16).contiguous();
    let (sum, y) =
        (Tensor::empty(x.size(), (Kind::BFloat16, x.device())), Tensor::empty(x.size(), (Kind::BFloat16, x.device())));
    let rows = x.numel() as i64 / x.size().last().expect("a last dim");
    let [px, pd, pw, ps, py] = [x, &delta, &w, &sum, &y].map(|t| t.data_ptr() as u64);
    let eps32 = eps as f32;
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&px).arg(&pd).arg(&pw).arg(&ps).arg(&py).arg(&rows).arg(&eps32);
    let cfg = config(&m, FORWARD, rows, *x.size().last().expect("a last dim"))?;
    // SAFETY: x, delta, sum and y are dense, aligned bf16 of `rows` rows of H (checked above and
    // by `applies`), w has H elements; all on this device; the launch is ordered on libtorch's
    // stream.
    unsafe { launch.launch(cfg) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok((sum, y))
}

/// From dy = dLoss/dy of y = w * x / rms(x) and the residual's gradient g (both of x's shape,
/// made dense if they are not): (g + dLoss/dx, dLoss/dw in fp32).
pub fn backward_add(x: &Tensor, w: &Tensor, eps: f64, dy: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor), String> {
    let (dy, g) = (dy.contiguous(), g.contiguous());
    like_x("dy", &dy, x)?;
    like_x("g", &g, x)?;
    let m = module(x)?;
    let w = w.to_kind(Kind::BFloat16).contiguous();
    let h = *x.size().last().expect("a last dim");
    let rows = x.numel() as i64 / h;
    let cfg = config(&m, BACKWARD, rows, h)?;
    let dx = Tensor::empty(x.size(), (Kind::BFloat16, x.device()));
    let dw_part = Tensor::empty([cfg.grid_dim.0 as i64, h], (Kind::Float, x.device()));
    let [px, pw, pdy, pg, pdx, pdw] = [x, &w, &dy, &g, &dx, &dw_part].map(|t| t.data_ptr() as u64);
    let eps32 = eps as f32;
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(BACKWARD));
    launch.arg(&px).arg(&pw).arg(&pdy).arg(&pg).arg(&pdx).arg(&pdw).arg(&rows).arg(&eps32);
    // SAFETY: as in `add_forward`; dw_part holds a row of H for each of the grid's CTAs.
    unsafe { launch.launch(cfg) }.map_err(|e| format!("{BACKWARD}: {e}"))?;
    Ok((dx, dw_part.sum_dim_intlist(&[0i64][..], false, Kind::Float)))
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed) for hidden sizes from 1,000 (not whole
    /// warps of groups) to 8,192, without spilling to local memory.
    #[test]
    fn the_kernels_compile() {
        for h in [1000, 1024, 2560, 4096, 5120, 8192] {
            let ptx = super::nvrtc::compile(super::SRC, &[("H", h), ("THREADS", super::threads(h))])
                .unwrap_or_else(|e| panic!("H {h}: {e}"));
            let text = ptx.to_src();
            assert!(text.contains(".entry add_rms_norm") && text.contains(".entry rms_norm_backward_add"));
            assert!(!text.contains(".local"), "H {h}: the kernels spill to local memory");
        }
    }
}
