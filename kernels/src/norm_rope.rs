//! A Qwen3 attention's q/k RMSNorm and rotary embedding as one CUDA kernel each way
//! (csrc/norm_rope.cu), bf16, outside autograd: what `drafter_layers`' attention runs on a GPU
//! when a drafter cuts its graph at the projections. The caller runs libtorch's ops where these
//! do not apply.

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/norm_rope.cu");
const FORWARD: &str = "norm_rope_forward";
const BACKWARD: &str = "norm_rope_backward";
const WARPS: i64 = 8;

/// Whether the kernels apply to x [B, L, H, D] with tables [B, 1, L, D]: bf16 on CUDA with the
/// kernels enabled, x dense, D a multiple of 64 (two elements a lane at least, rotary halves in
/// lanes 16 apart), the tables of x's batch and length.
pub fn applies(x: &Tensor, cos: &Tensor) -> bool {
    let (xs, cs) = (x.size(), cos.size());
    nvrtc::enabled()
        && x.device().is_cuda()
        && x.kind() == Kind::BFloat16
        && cos.kind() == Kind::BFloat16
        && xs.len() == 4
        && x.is_contiguous()
        && xs[3] % 64 == 0
        && xs[3] <= 512
        && cs == [xs[0], 1, xs[1], xs[3]]
}

fn module(x: &Tensor) -> Result<nvrtc::Module, String> {
    let Device::Cuda(ordinal) = x.device() else { return Err("not a CUDA tensor".into()) };
    nvrtc::module(ordinal, SRC, &[("D", x.size()[3])], &[FORWARD, BACKWARD])
}

/// CTAs of 8 warps, a warp a row at a time, enough to fill the GPU a few times over.
fn ctas(rows: i64) -> u32 {
    ((rows + WARPS - 1) / WARPS).clamp(1, 132 * 8) as u32
}

fn config(ctas: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (32 * WARPS as u32, 1, 1), shared_mem_bytes: 0 }
}

/// rope(w * x / rms(x)) of x [B, L, H, D] with `cos` and signed sin `ssin` [B, 1, L, D] (as
/// `drafter_layers::layers::rope_cos_sin` makes them) -> [B, L, H, D], dense.
pub fn forward(x: &Tensor, w: &Tensor, eps: f64, cos: &Tensor, ssin: &Tensor) -> Result<Tensor, String> {
    let m = module(x)?;
    let (w, cos, ssin) =
        (w.to_kind(Kind::BFloat16).contiguous(), cos.contiguous(), ssin.to_kind(Kind::BFloat16).contiguous());
    let y = Tensor::empty(x.size(), (Kind::BFloat16, x.device()));
    let s = x.size();
    let (rows, heads) = (s[0] * s[1] * s[2], s[2] as i32);
    let [px, pw, pc, ps, py] = [x, &w, &cos, &ssin, &y].map(|t| t.data_ptr() as u64);
    let eps32 = eps as f32;
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&px).arg(&pw).arg(&pc).arg(&ps).arg(&py).arg(&rows).arg(&heads).arg(&eps32);
    // SAFETY: x, the tables and y are dense bf16 of the shapes `applies` checked, w has D
    // elements, all on this device; the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config(ctas(rows))) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok(y)
}

/// From dy = dLoss/dy [B, L, H, D] (any strides, the last dim dense): (dx [B, L, H, D] dense,
/// dLoss/dw [D] in fp32).
pub fn backward(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    cos: &Tensor,
    ssin: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor), String> {
    let s = x.size();
    let st = dy.stride();
    if dy.size() != s
        || dy.kind() != Kind::BFloat16
        || st[3] != 1
        || st[..3].iter().any(|v| v % 2 != 0)
        || dy.data_ptr() as usize % 4 != 0
    {
        return Err(format!(
            "dy {:?} {:?} (strides {st:?}): expected x's shape {s:?}, bf16, the last dim dense",
            dy.size(),
            dy.kind()
        ));
    }
    let m = module(x)?;
    let (w, cos, ssin) =
        (w.to_kind(Kind::BFloat16).contiguous(), cos.contiguous(), ssin.to_kind(Kind::BFloat16).contiguous());
    let (rows, heads, len) = (s[0] * s[1] * s[2], s[2] as i32, s[1] as i32);
    let grid = ctas(rows);
    let dx = Tensor::empty(s.as_slice(), (Kind::BFloat16, x.device()));
    let dw_part = Tensor::empty([grid as i64, s[3]], (Kind::Float, x.device()));
    let [px, pw, pc, ps, pdy, pdx, pdw] = [x, &w, &cos, &ssin, dy, &dx, &dw_part].map(|t| t.data_ptr() as u64);
    let (db, dl, dh, eps32) = (st[0], st[1], st[2], eps as f32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(BACKWARD));
    launch.arg(&px).arg(&pw).arg(&pc).arg(&ps).arg(&pdy).arg(&db).arg(&dl).arg(&dh);
    launch.arg(&pdx).arg(&pdw).arg(&rows).arg(&heads).arg(&len).arg(&eps32);
    // SAFETY: as in `forward`; dy has x's shape and is read through its checked strides, dw_part
    // holds a row of D for each of the grid's CTAs.
    unsafe { launch.launch(config(grid)) }.map_err(|e| format!("{BACKWARD}: {e}"))?;
    Ok((dx, dw_part.sum_dim_intlist(&[0i64][..], false, Kind::Float)))
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed) for the head dims Qwen3 models use.
    #[test]
    fn the_kernels_compile() {
        for d in [64, 128, 256] {
            let ptx = super::nvrtc::compile(super::SRC, &[("D", d)]).unwrap_or_else(|e| panic!("D {d}: {e}"));
            let text = ptx.to_src();
            assert!(text.contains(".entry norm_rope_forward") && text.contains(".entry norm_rope_backward"));
        }
    }
}
