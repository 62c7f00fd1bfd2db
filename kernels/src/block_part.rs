//! The block part of split block attention fused into one kernel each way (csrc/block_part.cu),
//! for CUDA bf16 tensors: each block's g query heads against its own keys, merged with the
//! context part through the log-sum-exps. [`crate::block_attention`] calls it and falls back to
//! its composite of batched matmuls where it does not apply or fails to build.

use crate::nvrtc;
use cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = include_str!("../csrc/block_part.cu");
const THREADS: u32 = 128;
const FORWARD: &str = "block_part_forward";
const BACKWARD: &str = "block_part_backward";

/// Whether the kernels apply to q [B, nh, N, D] with blocks of `block`: bf16 on CUDA, a row of
/// D/4 threads a power of two up to a warp, a block's rows a multiple of the CTA's threads, and
/// shared memory within the static 48 KiB.
pub fn applies(q: &Tensor, block: i64) -> bool {
    let d = q.size()[3];
    let threads = THREADS as i64;
    nvrtc::enabled()
        && q.device().is_cuda()
        && q.kind() == Kind::BFloat16
        && d % 4 == 0
        && (d / 4 > 0 && (d as u64 / 4).is_power_of_two())
        && d / 4 <= 32
        && block % 2 == 0
        && (block * d / 4) % threads == 0
        && 4 * block * (d + 4) * 4 + 2 * block * (block + 1) * 4 + 2 * block * 4 <= 48 << 10
}

/// The kernels' defines: block, head dim and query heads per kv head.
fn module(q: &Tensor, k: &Tensor, block: i64) -> Result<nvrtc::Module, String> {
    let Device::Cuda(device) = q.device() else { return Err("not a CUDA tensor".into()) };
    let (nh, d, nkv) = (q.size()[1], q.size()[3], k.size()[1]);
    nvrtc::module(device, SRC, &[("BK", block), ("D", d), ("G", nh / nkv)], &[FORWARD, BACKWARD])
}

/// A tensor as the kernels take it: device pointer and its first three strides (the last dim
/// must be dense).
struct Arg {
    ptr: u64,
    strides: [i64; 3],
}

impl Arg {
    fn new(t: &Tensor) -> Result<Self, String> {
        let st = t.stride();
        if st.last() != Some(&1) {
            return Err(format!("a tensor of shape {:?} with strides {st:?}: the last dim must be dense", t.size()));
        }
        let s3 = |i: usize| if st.len() > i + 1 { st[i] } else { 0 };
        let (ptr, strides) = (t.data_ptr() as u64, [s3(0), s3(1), s3(2)]);
        // Threads move 4 bf16 (8 bytes) at a time.
        if ptr % 8 != 0 || strides.iter().any(|s| s % 4 != 0) {
            return Err(format!("a tensor with strides {st:?} at {ptr:#x}: rows must be 8-byte aligned"));
        }
        Ok(Self { ptr, strides })
    }

    /// The pointer and the three strides, as the kernels' parameters take a tensor.
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&self.ptr).arg(&self.strides[0]).arg(&self.strides[1]).arg(&self.strides[2]);
    }
}

fn config(q: &Tensor, k: &Tensor, block: i64) -> LaunchConfig {
    let (b, n, nkv) = (q.size()[0], q.size()[2], k.size()[1]);
    LaunchConfig { grid_dim: ((n / block) as u32, nkv as u32, b as u32), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// q [B, nh, N, D], k/v [B, nkv, S+N, D], the context part's output o_ctx [B, nh, N, D] and
/// log-sum-exp lse_ctx [B, nh, N] (fp32; rows that see no context are ignored), and `pre`, the
/// same of a second context span where it ran in two (-inf log-sum-exp in the rows it did not),
/// anchors [B, A] -> the merged output [B, nh, N, D] ([B, N, nh, D] in memory) and log-sum-exp
/// [B, nh, N]. `window` > 0: a sliding-window layer's block part (causal within the block;
/// window >= block).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &Tensor, k: &Tensor, v: &Tensor, o_ctx: &Tensor, lse_ctx: &Tensor, pre: Option<(&Tensor, &Tensor)>, anchors: &Tensor, block: i64,
    window: i64, scale: f64,
) -> Result<(Tensor, Tensor), String> {
    let m = module(q, k, block)?;
    let (b, nh, n, d) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let s = k.size()[2] - n;
    let out = Tensor::empty([b, n, nh, d], (q.kind(), q.device())).transpose(1, 2);
    let lse = Tensor::empty([b, nh, n], (Kind::Float, q.device()));
    let lse_ctx = lse_ctx.to_kind(Kind::Float).contiguous();
    let anchors = anchors.to_kind(Kind::Int64).contiguous();
    let [aq, ak, av, ac, ao] = [q, k, v, o_ctx, &out].map(Arg::new);
    let (aq, ak, av, ac, ao) = (aq?, ak?, av?, ac?, ao?);
    let (p_lse_ctx, p_anchors, p_lse) = (lse_ctx.data_ptr() as u64, anchors.data_ptr() as u64, lse.data_ptr() as u64);
    // No second span: a null log-sum-exp (its output pointer is never read).
    let lse_pre = pre.map(|(_, l)| l.to_kind(Kind::Float).contiguous());
    let ap = match pre {
        Some((o, _)) => Arg::new(o)?,
        None => Arg { ptr: 0, strides: [0; 3] },
    };
    let p_lse_pre = lse_pre.as_ref().map_or(0u64, |l| l.data_ptr() as u64);
    let (nh32, n32, s32, w32, scale32) = (nh as i32, n as i32, s as i32, window_arg(window)?, scale as f32);
    let mut launch = m.stream.launch_builder(m.function(FORWARD));
    for a in [&aq, &ak, &av, &ac] {
        a.push(&mut launch);
    }
    launch.arg(&p_lse_ctx);
    ap.push(&mut launch);
    launch.arg(&p_lse_pre).arg(&p_anchors);
    ao.push(&mut launch);
    launch.arg(&p_lse).arg(&nh32).arg(&n32).arg(&s32).arg(&w32).arg(&scale32);
    // SAFETY: the arguments match the kernel's signature; every pointer is a live tensor's data
    // on this device with the strides passed, and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config(q, k, block)) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok((out, lse))
}

/// The block part's backward: adds the block keys' share to `dq` [B, nh, N, D] (in place) and
/// writes the block rows of `dk`, `dv` [B, nkv, S+N, D] (dense); `out` and `lse` the merged
/// output and log-sum-exp of the forward.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor, k: &Tensor, v: &Tensor, d_out: &Tensor, out: &Tensor, lse: &Tensor, dq: &Tensor, dk: &Tensor, dv: &Tensor,
    block: i64, window: i64, scale: f64,
) -> Result<(), String> {
    let m = module(q, k, block)?;
    let (nh, n) = (q.size()[1], q.size()[2]);
    let s = k.size()[2] - n;
    if !dk.is_contiguous() || !dv.is_contiguous() || !lse.is_contiguous() {
        return Err("dk, dv and lse must be dense".into());
    }
    let [aq, ak, av, ad, ao, ag, adk] = [q, k, v, d_out, out, dq, dk].map(Arg::new);
    let (aq, ak, av, ad, ao, ag, adk) = (aq?, ak?, av?, ad?, ao?, ag?, adk?);
    let (p_lse, p_dv) = (lse.data_ptr() as u64, dv.data_ptr() as u64);
    let (nh32, n32, s32, w32, scale32) = (nh as i32, n as i32, s as i32, window_arg(window)?, scale as f32);
    let mut launch = m.stream.launch_builder(m.function(BACKWARD));
    for a in [&aq, &ak, &av, &ad, &ao] {
        a.push(&mut launch);
    }
    launch.arg(&p_lse);
    ag.push(&mut launch);
    launch.arg(&adk.ptr).arg(&p_dv).arg(&adk.strides[0]).arg(&adk.strides[1]).arg(&adk.strides[2]);
    launch.arg(&nh32).arg(&n32).arg(&s32).arg(&w32).arg(&scale32);
    // SAFETY: as in `forward`; dk and dv are dense with the same shape, so they share strides.
    unsafe { launch.launch(config(q, k, block)) }.map_err(|e| format!("{BACKWARD}: {e}"))?;
    Ok(())
}

/// The window as the kernels take it (0: full attention).
fn window_arg(window: i64) -> Result<i32, String> {
    i32::try_from(window.max(0)).map_err(|_| format!("sliding window {window} does not fit an int"))
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed) at the bench shapes and a smaller one.
    #[test]
    fn the_kernels_compile() {
        for (bk, d, g) in [(16, 128, 4), (16, 64, 2), (32, 32, 1)] {
            let ptx = super::nvrtc::compile(super::SRC, &[("BK", bk), ("D", d), ("G", g)]);
            let ptx = ptx.unwrap_or_else(|e| panic!("BK {bk} D {d} G {g}: {e}"));
            let text = ptx.to_src();
            assert!(text.contains(".entry block_part_forward") && text.contains(".entry block_part_backward"));
        }
    }
}
