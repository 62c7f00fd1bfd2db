//! Cross-entropy statistics and the softmax gradient of logit rows (fp32, or bf16 as the model's
//! LM head gives them) in two passes over the logits (csrc/cross_entropy.cu), for the loss's
//! chunks on CUDA. libtorch's log-softmax, exp and argmax take five; at a 152K vocabulary those
//! passes are most of the loss's time.

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/bf16x8.cuh"), include_str!("../csrc/cross_entropy.cu"));
const KERNELS: [&str; 4] = ["ce_row_stats_f32", "ce_softmax_grad_f32", "ce_row_stats_bf16", "ce_softmax_grad_bf16"];
const STATS_THREADS: u32 = 512;
const GRAD_THREADS: u32 = 256;
/// Groups of one 16-byte load a thread of the gradient kernel takes (its GRAD_GROUPS).
const GRAD_GROUPS: u32 = 2;

/// Per row of z: the label's log-probability [c] (fp32), whether the argmax is the label [c]
/// (bool), and when asked for, (softmax - onehot) times a scale per row [c, V] in bf16.
pub struct Rows {
    pub logp_label: Tensor,
    pub hit: Tensor,
    pub grad: Option<Tensor>,
}

/// The kernels for z [c, V] (fp32 or bf16, CUDA, rows of whole 16-byte loads) against labels [c]
/// (int64); with `grad` = (kind, row scale [c]), the gradient too (bf16 only), each row times its
/// scale. bf16 logits are consumed: their gradient is written over them. Err(z) hands the logits
/// back where the kernels do not apply or fail (the caller then runs libtorch's ops).
pub fn rows(z: Tensor, labels: &Tensor, grad: Option<(Kind, &Tensor)>) -> Result<Rows, Tensor> {
    let (c, v) = (z.size()[0], z.size()[1]);
    let lanes = match z.kind() {
        Kind::Float => 4,
        Kind::BFloat16 => 8,
        _ => return Err(z),
    };
    let applies = nvrtc::enabled()
        && z.device().is_cuda()
        && z.stride()[1] == 1
        && z.stride()[0] % lanes == 0
        && v % lanes == 0
        && (z.data_ptr() as usize) % 16 == 0
        && c > 0
        && c <= 65_535 // the gradient kernel's grid.y
        && grad.is_none_or(|(k, _)| k == Kind::BFloat16);
    if !applies {
        return Err(z);
    }
    launch(&z, labels, grad.map(|(_, scale)| scale), c, v, lanes).map_err(|e| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!("loss: the fused cross-entropy kernels are unavailable ({e}); using libtorch's ops")
        });
        z
    })
}

fn launch(
    z: &Tensor,
    labels: &Tensor,
    grad_scale: Option<&Tensor>,
    c: i64,
    v: i64,
    lanes: i64,
) -> Result<Rows, String> {
    let Device::Cuda(device) = z.device() else { unreachable!("checked by `rows`") };
    let m = nvrtc::module(device, SRC, &[], &KERNELS)?;
    let (stats_fn, grad_fn) = if z.kind() == Kind::Float { (KERNELS[0], KERNELS[1]) } else { (KERNELS[2], KERNELS[3]) };
    let labels = labels.to_kind(Kind::Int64).contiguous();
    let opts = (Kind::Float, z.device());
    let (lse, logp_label) = (Tensor::empty([c], opts), Tensor::empty([c], opts));
    let hit = Tensor::empty([c], (Kind::Bool, z.device()));
    let (pz, ld, v32, pl) = (z.data_ptr() as u64, z.stride()[0], v as i32, labels.data_ptr() as u64);
    let (p_lse, p_logp, p_hit) = (lse.data_ptr() as u64, logp_label.data_ptr() as u64, hit.data_ptr() as u64);
    let stream = m.stream();
    let mut stats = stream.launch_builder(m.function(stats_fn));
    stats.arg(&pz).arg(&ld).arg(&v32).arg(&pl).arg(&p_lse).arg(&p_logp).arg(&p_hit);
    let cfg = LaunchConfig { grid_dim: (c as u32, 1, 1), block_dim: (STATS_THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: arguments as the kernel declares them; z is [c, V] of the kernel's type with row
    // stride `ld` and 16-byte aligned rows (checked by `rows`), the outputs are fresh dense
    // tensors of c elements; the launch is ordered on libtorch's stream.
    unsafe { stats.launch(cfg) }.map_err(|e| format!("{stats_fn}: {e}"))?;
    let grad = if let Some(scale) = grad_scale {
        let scale = scale.to_kind(Kind::Float).contiguous();
        // Over bf16 logits in place (the kernel reads each logit before it writes it).
        let out = match z.kind() {
            Kind::BFloat16 => z.shallow_clone(),
            _ => Tensor::empty([c, v], (Kind::BFloat16, z.device())),
        };
        let (p_scale, po, ldo) = (scale.data_ptr() as u64, out.data_ptr() as u64, out.stride()[0]);
        let stream = m.stream();
        let mut g = stream.launch_builder(m.function(grad_fn));
        g.arg(&pz).arg(&ld).arg(&v32).arg(&pl).arg(&p_lse).arg(&p_scale).arg(&po).arg(&ldo);
        let loads = (v / lanes) as u32;
        let cfg = LaunchConfig {
            grid_dim: (loads.div_ceil(GRAD_THREADS * GRAD_GROUPS), c as u32, 1),
            block_dim: (GRAD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; `scale` is c dense fp32 elements, `out` [c, V] bf16 with row stride
        // `ldo`: a fresh dense tensor, or z itself (bf16), whose every element the thread that
        // writes it has read first.
        unsafe { g.launch(cfg) }.map_err(|e| format!("{grad_fn}: {e}"))?;
        Some(out)
    } else {
        None
    };
    Ok(Rows { logp_label, hit, grad })
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed), in registers.
    #[test]
    fn the_kernels_compile() {
        let ptx = super::nvrtc::compile(super::SRC, &[]).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for name in super::KERNELS {
            assert!(text.contains(&format!(".entry {name}(")), "{name}");
        }
        // The label's entry is picked at constant offsets: no row of logits in local memory.
        assert!(!text.contains(".local"), "the kernels use local memory");
    }
}
