//! The chunked gated delta rule's scan over chunks as one CUDA kernel (csrc/gdn_scan.cu), forward
//! only: what `gated_deltanet::chunked_with` runs for a target's Gated DeltaNet layers in bf16 on a
//! GPU, in place of its loop of batched GEMMs (which stays as the fallback and the reference).

use crate::nvrtc;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/gdn_scan.cu");
const FORWARD: &str = "gdn_scan_forward";
/// Steps per chunk the kernel is written for.
pub const CHUNK: i64 = 64;

/// Whether the kernel applies: CUDA, kernels enabled, chunks of 64, a key dim that is a multiple
/// of 64 and a value dim of 32 columns or a multiple of 64.
pub fn applies(device: Device, chunk: i64, dk: i64, dv: i64) -> bool {
    nvrtc::enabled() && device.is_cuda() && chunk == CHUNK && dk % 64 == 0 && dk > 0 && tile(dv).is_some()
}

/// Value columns a CTA takes.
fn tile(dv: i64) -> Option<i64> {
    match dv {
        _ if dv > 0 && dv % 64 == 0 => Some(64),
        32 => Some(32),
        _ => None,
    }
}

/// The inputs of the scan, per chunk (`n` of them), for `bh` = batch x heads:
/// - `u` fp32 [BH, n, 64, dv]: the chunk's writes when entered with a zero state;
/// - `w` bf16 [BH, n, 64, dk]: how the entering state shifts them (writes = u - w S);
/// - `q_decayed` bf16 [BH, n, 64, dk]: the scaled queries decayed to their step;
/// - `intra` bf16 [BH, n, 64, 64]: the intra-chunk scores applied to the writes;
/// - `k_to_end` bf16 [BH, n, dk, 64]: the keys decayed to the chunk's end, transposed;
/// - `decay` fp32 [BH, n]: the whole chunk's decay of the state;
/// - `state` fp32 [BH, dk, dv]: the state entering the first chunk.
pub struct ScanInputs<'a> {
    pub u: &'a Tensor,
    pub w: &'a Tensor,
    pub q_decayed: &'a Tensor,
    pub intra: &'a Tensor,
    pub k_to_end: &'a Tensor,
    pub decay: &'a Tensor,
    pub state: &'a Tensor,
}

/// The scan: the outputs fp32 [BH, n * 64, dv] and the final state fp32 [BH, dk, dv].
pub fn forward(x: &ScanInputs) -> Result<(Tensor, Tensor), String> {
    let device = x.u.device();
    let Device::Cuda(ordinal) = device else { return Err("not a CUDA tensor".into()) };
    let (bh, n, dv, dk) = (x.u.size()[0], x.u.size()[1], x.u.size()[3], x.w.size()[3]);
    let dvt = tile(dv).ok_or_else(|| format!("value dim {dv}: the kernel takes 32 or a multiple of 64"))?;
    let check = |name: &str, t: &Tensor, kind: Kind, shape: &[i64]| -> Result<Tensor, String> {
        if t.size() != shape {
            return Err(format!("{name}: shape {:?}, expected {shape:?}", t.size()));
        }
        Ok(t.to_kind(kind).contiguous())
    };
    let u = check("u", x.u, Kind::Float, &[bh, n, CHUNK, dv])?;
    let w = check("w", x.w, Kind::BFloat16, &[bh, n, CHUNK, dk])?;
    let qd = check("q_decayed", x.q_decayed, Kind::BFloat16, &[bh, n, CHUNK, dk])?;
    let intra = check("intra", x.intra, Kind::BFloat16, &[bh, n, CHUNK, CHUNK])?;
    let kte = check("k_to_end", x.k_to_end, Kind::BFloat16, &[bh, n, dk, CHUNK])?;
    let decay = check("decay", x.decay, Kind::Float, &[bh, n])?;
    // The kernel writes the final state over its input: a copy of its own.
    let state = x.state.to_kind(Kind::Float).reshape([bh, dk, dv]).copy();
    let o = Tensor::empty([bh, n * CHUNK, dv], (Kind::Float, device));
    let m = nvrtc::module(ordinal, SRC, &[("DK", dk), ("DVT", dvt)], &[FORWARD])?;
    let ptr = |t: &Tensor| t.data_ptr() as u64;
    let (pu, pw, pq, pi, pk, pd, ps, po) =
        (ptr(&u), ptr(&w), ptr(&qd), ptr(&intra), ptr(&kte), ptr(&decay), ptr(&state), ptr(&o));
    let (n32, dv32) = (i32::try_from(n).map_err(|e| e.to_string())?, dv as i32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    launch.arg(&pu).arg(&pw).arg(&pq).arg(&pi).arg(&pk).arg(&pd).arg(&ps).arg(&po).arg(&n32).arg(&dv32);
    let config =
        LaunchConfig { grid_dim: (bh as u32, (dv / dvt) as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; every pointer is a live, dense tensor
    // of the checked shape on this device, and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok((o, state))
}

#[cfg(test)]
mod tests {
    /// The kernel compiles with NVRTC (no GPU needed) for the shapes it takes.
    #[test]
    fn the_kernel_compiles() {
        for (dk, dvt) in [(128, 64), (64, 32), (256, 64)] {
            let ptx = super::nvrtc::compile(super::SRC, &[("DK", dk), ("DVT", dvt)]);
            let ptx = ptx.unwrap_or_else(|e| panic!("DK {dk} DVT {dvt}: {e}"));
            assert!(ptx.to_src().contains(".entry gdn_scan_forward"));
            assert!(ptx.to_src().contains("mma.sync.aligned.m16n8k16"));
        }
    }
}
