//! A Gated DeltaNet layer's work around the chunked scan as two CUDA kernels (csrc/gdn_prep.cu,
//! csrc/gdn_gated_norm.cu), forward only, bf16: what a hybrid target's layer runs on a GPU without autograd.
//! - [`chunks`]: the per-chunk quantities the scan (`gdn_scan`) reads, built on chip from the conv
//!   output, in place of the L2 norms, the key heads' repeat, the head-first fp32 layouts, the
//!   decay mask, the WY inverse and its batched matmuls;
//! - [`gated_norm`]: the output's gated RMSNorm, rmsnorm(o) * w * silu(z), in one pass.

use crate::{gdn_scan, nvrtc};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/mma.cuh"), include_str!("../csrc/gdn_prep.cu"));
const SRC_NORM: &str = concat!(include_str!("../csrc/mma.cuh"), include_str!("../csrc/gdn_gated_norm.cu"));
const PREP: &str = "gdn_chunk_prep";
const NORM: &str = "gdn_gated_norm";
const CHUNK: i64 = gdn_scan::CHUNK;
/// Static shared memory a CTA may take.
const SHARED_LIMIT: i64 = 48 * 1024;

/// A layer's heads: `key_heads` q and k heads of `key_dim`, `value_heads` v heads of `value_dim`
/// (value head h reads key head h / (value_heads / key_heads)).
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub key_heads: i64,
    pub value_heads: i64,
    pub key_dim: i64,
    pub value_dim: i64,
}

impl Heads {
    /// Channels of the conv output: q | k | v.
    pub fn channels(&self) -> i64 {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// Whether the kernels take these heads: dims multiples of 64 whose tiles fit in shared memory,
    /// key heads dividing the value heads.
    fn fit(&self) -> bool {
        let (dk, dv) = (self.key_dim, self.value_dim);
        let pitch = |d: i64| CHUNK * (d + 8) * 2;
        let buffer = pitch(dk).max(CHUNK * (CHUNK + 1) * 4).max(pitch(dv));
        dk > 0
            && dv > 0
            && dk % 64 == 0
            && dv % 64 == 0
            && self.key_heads > 0
            && self.value_heads % self.key_heads == 0
            && pitch(dk) + buffer + 3 * CHUNK * 4 <= SHARED_LIMIT
    }
}

/// Whether the kernels apply to a conv output `qkv` [B, L, channels]: bf16 on CUDA with the
/// kernels enabled, heads [`Heads::fit`] takes.
pub fn applies(qkv: &Tensor, heads: &Heads) -> bool {
    nvrtc::enabled()
        && qkv.device().is_cuda()
        && qkv.kind() == Kind::BFloat16
        && qkv.dim() == 3
        && qkv.size()[2] == heads.channels()
        && heads.fit()
}

/// What [`chunks`] builds, as `gdn_scan::ScanInputs` takes it (BH = B x value heads, n chunks).
pub struct Chunks {
    pub u: Tensor,
    pub w: Tensor,
    pub q_decayed: Tensor,
    pub intra: Tensor,
    pub k_to_end: Tensor,
    pub decay: Tensor,
}

/// The chunks' quantities from the conv output `qkv` [B, L, q | k | v] bf16 and the gates `g`
/// (log decay) and `beta` [B, value heads, L] fp32. q and k are L2-normalised here and q scaled
/// by key_dim^-0.5.
pub fn chunks(qkv: &Tensor, heads: &Heads, g: &Tensor, beta: &Tensor) -> Result<Chunks, String> {
    let Device::Cuda(ordinal) = qkv.device() else { return Err("not a CUDA tensor".into()) };
    if !heads.fit() || qkv.size()[2] != heads.channels() {
        return Err(format!("qkv {:?} with heads {heads:?}: not a layout the kernel takes", qkv.size()));
    }
    let (b, l) = (qkv.size()[0], qkv.size()[1]);
    let (nk, nv, dk, dv) = (heads.key_heads, heads.value_heads, heads.key_dim, heads.value_dim);
    let gates = |name: &str, t: &Tensor| -> Result<Tensor, String> {
        if t.size() != [b, nv, l] {
            return Err(format!("{name}: shape {:?}, expected {:?}", t.size(), [b, nv, l]));
        }
        Ok(t.to_kind(Kind::Float).contiguous())
    };
    let (g, beta) = (gates("g", g)?, gates("beta", beta)?);
    let qkv = qkv.contiguous();
    let (bh, n) = (b * nv, (l + CHUNK - 1) / CHUNK);
    if bh > 65_535 {
        return Err(format!("{bh} sequence heads: over a launch's 65,535"));
    }
    let empty = |shape: &[i64], kind: Kind| Tensor::empty(shape, (kind, qkv.device()));
    let out = Chunks {
        u: empty(&[bh, n, CHUNK, dv], Kind::Float),
        w: empty(&[bh, n, CHUNK, dk], Kind::BFloat16),
        q_decayed: empty(&[bh, n, CHUNK, dk], Kind::BFloat16),
        intra: empty(&[bh, n, CHUNK, CHUNK], Kind::BFloat16),
        k_to_end: empty(&[bh, n, dk, CHUNK], Kind::BFloat16),
        decay: empty(&[bh, n], Kind::Float),
    };
    if bh == 0 || n == 0 {
        return Ok(out);
    }
    let m = nvrtc::module(ordinal, SRC, &[("DK", dk), ("DV", dv)], &[PREP])?;
    let ptr = |t: &Tensor| t.data_ptr() as u64;
    let (p_qkv, p_g, p_beta) = (ptr(&qkv), ptr(&g), ptr(&beta));
    let (p_u, p_w, p_qd, p_intra, p_kte, p_decay) =
        (ptr(&out.u), ptr(&out.w), ptr(&out.q_decayed), ptr(&out.intra), ptr(&out.k_to_end), ptr(&out.decay));
    let row = heads.channels();
    let int = |x: i64| i32::try_from(x).map_err(|e| format!("{x}: {e}"));
    let (q_off, k_off, v_off) = (0i32, int(nk * dk)?, int(2 * nk * dk)?);
    let (heads32, rep, l32, n32) = (int(nv)?, int(nv / nk)?, int(l)?, int(n)?);
    let scale = (dk as f32).powf(-0.5);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(PREP));
    launch.arg(&p_qkv).arg(&row).arg(&q_off).arg(&k_off).arg(&v_off).arg(&heads32).arg(&rep);
    launch.arg(&p_g).arg(&p_beta).arg(&l32).arg(&n32).arg(&scale);
    launch.arg(&p_u).arg(&p_w).arg(&p_qd).arg(&p_intra).arg(&p_kte).arg(&p_decay);
    let grid = (u32::try_from(n).map_err(|e| e.to_string())?, bh as u32, 1);
    let config = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's signature; qkv, g and beta are dense with the
    // checked shapes, the outputs dense with the shapes the kernel writes, all on this device,
    // and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{PREP}: {e}"))?;
    Ok(out)
}

/// rmsnorm(o) * weight * silu(z) per value head: `o` fp32 [B, H, L, dv] (any strides, dv dense),
/// `z` bf16 [B, L, H * dv] (rows may be strided), `weight` [dv] -> bf16 [B, L, H * dv], dense.
/// silu(z) is rounded to bf16 before the product, as libtorch computes it in z's dtype.
pub fn gated_norm(o: &Tensor, z: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor, String> {
    let Device::Cuda(ordinal) = o.device() else { return Err("not a CUDA tensor".into()) };
    let (b, h, l, dv) = (o.size()[0], o.size()[1], o.size()[2], o.size()[3]);
    if o.kind() != Kind::Float || o.stride()[3] != 1 || dv % 64 != 0 {
        return Err(format!(
            "o {:?} {:?} (strides {:?}): fp32 with dense rows of a multiple of 64",
            o.size(),
            o.kind(),
            o.stride()
        ));
    }
    if z.size() != [b, l, h * dv] || z.kind() != Kind::BFloat16 || z.stride()[2] != 1 {
        return Err(format!("z {:?} {:?}: expected bf16 {:?} with dense rows", z.size(), z.kind(), [b, l, h * dv]));
    }
    let weight = weight.to_kind(Kind::Float).contiguous();
    let y = Tensor::empty([b, l, h * dv], (Kind::BFloat16, o.device()));
    let rows = b * l * h;
    if rows == 0 {
        return Ok(y);
    }
    // The kernel reads o as [B * H, Lp, dv] rows: the scan's layout, or any with these strides.
    let (sb, sh, sl) = (o.stride()[0], o.stride()[1], o.stride()[2]);
    if sl != dv || sb != h * sh {
        let dense = o.contiguous();
        return gated_norm(&dense, z, &weight, eps);
    }
    let lp = sh / dv;
    let m = nvrtc::module(ordinal, SRC_NORM, &[("DV", dv)], &[NORM])?;
    let (p_o, p_z, p_w, p_y) =
        (o.data_ptr() as u64, z.data_ptr() as u64, weight.data_ptr() as u64, y.data_ptr() as u64);
    let int = |x: i64| i32::try_from(x).map_err(|e| format!("{x}: {e}"));
    let (z_row, l32, lp32, h32, eps32) = (z.stride()[1], int(l)?, int(lp)?, int(h)?, eps as f32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(NORM));
    launch.arg(&p_o).arg(&p_z).arg(&z_row).arg(&p_w).arg(&p_y).arg(&l32).arg(&lp32).arg(&h32).arg(&rows).arg(&eps32);
    let config = nvrtc::grid_stride(rows as u64, 4, 128);
    // SAFETY: the arguments match the kernel's signature; o is read as [B * H, Lp, dv] rows (its
    // strides checked above), z through its row stride with dense heads, weight and y dense, all
    // on this device, and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config) }.map_err(|e| format!("{NORM}: {e}"))?;
    Ok(y)
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed) for the dims they take.
    #[test]
    fn the_kernels_compile() {
        for (dk, dv) in [(128, 128), (64, 64), (64, 128)] {
            let ptx = super::nvrtc::compile(super::SRC, &[("DK", dk), ("DV", dv)]);
            let ptx = ptx.unwrap_or_else(|e| panic!("DK {dk} DV {dv}: {e}")).to_src();
            assert!(ptx.contains(".entry gdn_chunk_prep"));
            assert!(ptx.contains("mma.sync.aligned.m16n8k16") && ptx.contains("ldmatrix.sync.aligned.m8n8.x2.trans"));
            let ptx = super::nvrtc::compile(super::SRC_NORM, &[("DV", dv)]);
            assert!(ptx.unwrap_or_else(|e| panic!("DV {dv}: {e}")).to_src().contains(".entry gdn_gated_norm"));
        }
    }

    /// The shared-memory check: Qwen3.5 / Qwen3.6's 128-dim heads fit, 256-dim keys do not.
    #[test]
    fn heads_fit_in_shared_memory() {
        let heads = |key_dim, value_dim| super::Heads { key_heads: 16, value_heads: 48, key_dim, value_dim };
        assert!(heads(128, 128).fit());
        assert!(!heads(256, 128).fit());
        assert!(!heads(96, 128).fit());
        assert!(!super::Heads { key_heads: 5, ..heads(128, 128) }.fit());
    }
}
