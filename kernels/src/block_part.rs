//! The block part of split block attention fused into one kernel each way, for CUDA bf16
//! tensors: each block's g query heads against its own keys, merged with the context part
//! through the log-sum-exps. Blocks of 16 with head dims 64 or 128 run on tensor cores
//! (csrc/block_part_mma.cu), other shapes on the SIMT kernels (csrc/block_part.cu), with the same
//! parameters. [`crate::block_attention`] calls it and falls back to its composite of batched
//! matmuls where it does not apply or fails to build.

use crate::nvrtc;
use cudarc::driver::{DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/block_part_spans.cuh"), include_str!("../csrc/block_part.cu"));
const SRC_MMA: &str = concat!(
    include_str!("../csrc/block_part_spans.cuh"),
    include_str!("../csrc/mma.cuh"),
    include_str!("../csrc/block_part_mma.cu")
);
const THREADS: u32 = 128;
/// The tensor-core forward's warps a CTA (a query head each).
const MMA_WARPS: i64 = 4;
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
        && 4 * block * (d + 4) * 4 + 2 * block * (block + 1) * 4 + (1 + MAX_SPANS as i64) * block * 4 <= 48 << 10
}

/// The two implementations of the same kernels.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kernels {
    Simt,
    Mma,
}

/// The tensor-core kernels where the block is one 16-row tile, the head dim 64 or 128, a kv
/// head's query heads at most 16 (the backward's warps a CTA) and every row the kernels read or
/// write 16-byte aligned; else the SIMT ones.
fn kernels(q: &Tensor, k: &Tensor, block: i64, args: &[&Arg]) -> Kernels {
    let d = q.size()[3];
    let group = q.size()[1] / k.size()[1];
    if block == 16 && matches!(d, 64 | 128) && group <= 16 && args.iter().all(|a| a.aligned(16)) {
        Kernels::Mma
    } else {
        Kernels::Simt
    }
}

/// The kernels' module: block, head dim and query heads per kv head.
fn module(q: &Tensor, k: &Tensor, block: i64, kernels: Kernels) -> Result<nvrtc::Module, String> {
    let Device::Cuda(device) = q.device() else { return Err("not a CUDA tensor".into()) };
    let (nh, d, nkv) = (q.size()[1], q.size()[3], k.size()[1]);
    match kernels {
        Kernels::Simt => nvrtc::module(device, SRC, &[("BK", block), ("D", d), ("G", nh / nkv)], &[FORWARD, BACKWARD]),
        Kernels::Mma => nvrtc::module(device, SRC_MMA, &[("D", d), ("G", nh / nkv)], &[FORWARD, BACKWARD]),
    }
}

/// A tensor as the kernels take it: device pointer and its first three strides (the last dim
/// must be dense). Also the tail kernels' ([`crate::context_tail`]).
pub(crate) struct Arg {
    pub(crate) ptr: u64,
    pub(crate) strides: [i64; 3],
}

impl Arg {
    pub(crate) fn new(t: &Tensor) -> Result<Self, String> {
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

    /// Whether every row starts on a `bytes` boundary (bf16 elements).
    pub(crate) fn aligned(&self, bytes: u64) -> bool {
        self.ptr % bytes == 0 && self.strides.iter().all(|&s| (2 * s as u64) % bytes == 0)
    }

    /// The pointer and the three strides, as the kernels' parameters take a tensor.
    pub(crate) fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
        launch.arg(&self.ptr).arg(&self.strides[0]).arg(&self.strides[1]).arg(&self.strides[2]);
    }
}

/// The grid: a CTA per (block, head, sequence), `heads` the query heads (forward) or the kv heads
/// (backward, which sums the group's gradients in the CTA). On tensor cores the forward does
/// MMA_WARPS query heads a CTA and the backward's CTA is a warp per query head of its kv head.
fn config(q: &Tensor, heads: i64, block: i64, kernels: Kernels, forward: bool) -> LaunchConfig {
    let (b, n) = (q.size()[0], q.size()[2]);
    let (ctas, threads) = match (kernels, forward) {
        (Kernels::Simt, _) => (heads, THREADS),
        (Kernels::Mma, true) => ((heads + MMA_WARPS - 1) / MMA_WARPS, MMA_WARPS as u32 * 32),
        (Kernels::Mma, false) => (heads, 32 * (q.size()[1] / heads) as u32),
    };
    LaunchConfig {
        grid_dim: ((n / block) as u32, ctas as u32, b as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One range of the context part as its fused kernel ran it: query rows `start..start + len`,
/// and per span of keys (none, one, or the unbiased prefix and the biased rest) the output
/// [B, nh, len, D] and log-sum-exp [B, nh, len].
pub struct ContextPart {
    pub start: i64,
    pub len: i64,
    pub spans: Vec<(Tensor, Tensor)>,
}

/// The kernel's MAX_RANGES and MAX_SPANS.
const MAX_RANGES: usize = 16;
const MAX_SPANS: usize = 2;

/// The kernel's `Parts`, field for field.
#[repr(C)]
#[derive(Default)]
struct Parts {
    start: [i32; MAX_RANGES],
    len: [i32; MAX_RANGES],
    spans: [i32; MAX_RANGES],
    o: [[u64; MAX_SPANS]; MAX_RANGES],
    lse: [[u64; MAX_SPANS]; MAX_RANGES],
    ob: [[i64; MAX_SPANS]; MAX_RANGES],
    oh: [[i64; MAX_SPANS]; MAX_RANGES],
    on: [[i64; MAX_SPANS]; MAX_RANGES],
    n: i32,
}

// SAFETY: plain integers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Parts {}

/// q [B, nh, N, D], k/v [B, nkv, S+N, D], the context part range by range (rows that see no
/// context are ignored), anchors [B, A] -> the merged output [B, nh, N, D] ([B, N, nh, D] in
/// memory) and log-sum-exp [B, nh, N]. `window` > 0: a sliding-window layer's block part (causal
/// within the block; rows i >= window - 1 see no context).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    parts: &[ContextPart],
    anchors: &Tensor,
    block: i64,
    window: i64,
    scale: f64,
) -> Result<(Tensor, Tensor), String> {
    if parts.len() > MAX_RANGES || parts.iter().any(|p| p.spans.len() > MAX_SPANS) {
        let spans = parts.iter().map(|p| p.spans.len()).max().unwrap_or(0);
        return Err(format!(
            "{} context ranges, up to {spans} spans each (at most {MAX_RANGES}, of {MAX_SPANS})",
            parts.len()
        ));
    }
    let (b, nh, n, d) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let s = k.size()[2] - n;
    let out = Tensor::empty([b, n, nh, d], (q.kind(), q.device())).transpose(1, 2);
    let lse = Tensor::empty([b, nh, n], (Kind::Float, q.device()));
    let anchors = anchors.to_kind(Kind::Int64).contiguous();
    let mut table = Parts { n: parts.len() as i32, ..Default::default() };
    // The log-sum-exps as the kernel reads them (fp32, dense), alive until the launch is queued.
    let (mut lses, mut span_args) = (vec![], vec![]);
    for (r, part) in parts.iter().enumerate() {
        (table.start[r], table.len[r], table.spans[r]) = (part.start as i32, part.len as i32, part.spans.len() as i32);
        for (p, (o, l)) in part.spans.iter().enumerate() {
            let a = Arg::new(o)?;
            let l = l.to_kind(Kind::Float).contiguous();
            (table.o[r][p], table.lse[r][p]) = (a.ptr, l.data_ptr() as u64);
            (table.ob[r][p], table.oh[r][p], table.on[r][p]) = (a.strides[0], a.strides[1], a.strides[2]);
            lses.push(l);
            span_args.push(a);
        }
    }
    let [aq, ak, av, ao] = [q, k, v, &out].map(Arg::new);
    let (aq, ak, av, ao) = (aq?, ak?, av?, ao?);
    let kernels = kernels(q, k, block, &[&aq, &ak, &av, &ao].into_iter().chain(&span_args).collect::<Vec<_>>());
    let m = module(q, k, block, kernels)?;
    let (p_anchors, p_lse) = (anchors.data_ptr() as u64, lse.data_ptr() as u64);
    let (nh32, n32, s32, w32, scale32) = (nh as i32, n as i32, s as i32, window_arg(window)?, scale as f32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    for a in [&aq, &ak, &av] {
        a.push(&mut launch);
    }
    launch.arg(&table).arg(&p_anchors);
    ao.push(&mut launch);
    launch.arg(&p_lse).arg(&nh32).arg(&n32).arg(&s32).arg(&w32).arg(&scale32);
    // SAFETY: the arguments match the kernel's signature; every pointer is a live tensor's data
    // on this device with the strides passed (the table's too: `parts` and `lses` outlive the
    // queueing), and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(config(q, nh, block, kernels, true)) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok((out, lse))
}

/// The block part's backward: adds the block keys' share to `dq` [B, nh, N, D] (in place) and
/// writes the block rows of `dk`, `dv` [B, nkv, S+N, D] (any strides, the same for both, the
/// last dim dense); `out` and `lse` the merged output and log-sum-exp of the forward.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    block: i64,
    window: i64,
    scale: f64,
) -> Result<(), String> {
    let (nh, n) = (q.size()[1], q.size()[2]);
    let s = k.size()[2] - n;
    if dk.size() != dv.size() || dk.stride() != dv.stride() || !lse.is_contiguous() {
        return Err(format!(
            "dk {:?} and dv {:?} must share shape and strides ({:?}, {:?}), lse be dense",
            dk.size(),
            dv.size(),
            dk.stride(),
            dv.stride()
        ));
    }
    let [aq, ak, av, ad, ao, ag, adk, adv] = [q, k, v, d_out, out, dq, dk, dv].map(Arg::new);
    let (aq, ak, av, ad, ao, ag, adk, adv) = (aq?, ak?, av?, ad?, ao?, ag?, adk?, adv?);
    let p_lse = lse.data_ptr() as u64;
    let kernels = kernels(q, k, block, &[&aq, &ak, &av, &ad, &ao, &ag, &adk, &adv]);
    let m = module(q, k, block, kernels)?;
    let (nh32, n32, s32, w32, scale32) = (nh as i32, n as i32, s as i32, window_arg(window)?, scale as f32);
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(BACKWARD));
    for a in [&aq, &ak, &av, &ad, &ao] {
        a.push(&mut launch);
    }
    launch.arg(&p_lse);
    ag.push(&mut launch);
    launch.arg(&adk.ptr).arg(&adv.ptr).arg(&adk.strides[0]).arg(&adk.strides[1]).arg(&adk.strides[2]);
    launch.arg(&nh32).arg(&n32).arg(&s32).arg(&w32).arg(&scale32);
    // SAFETY: as in `forward`; dk and dv have the same shape and strides (checked above).
    unsafe { launch.launch(config(q, k.size()[1], block, kernels, false)) }.map_err(|e| format!("{BACKWARD}: {e}"))?;
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
        assert_eq!(std::mem::size_of::<super::Parts>(), 3 * 16 * 4 + 5 * 16 * 2 * 8 + 8, "the kernel's Parts layout");
        for (bk, d, g) in [(16, 128, 4), (16, 64, 2), (32, 32, 1)] {
            let ptx = super::nvrtc::compile(super::SRC, &[("BK", bk), ("D", d), ("G", g)]);
            let ptx = ptx.unwrap_or_else(|e| panic!("BK {bk} D {d} G {g}: {e}"));
            let text = ptx.to_src();
            assert!(text.contains(".entry block_part_forward") && text.contains(".entry block_part_backward"));
            // The range table is read at constant offsets: no copy of it in local memory.
            assert!(!text.contains(".local"), "BK {bk} D {d} G {g}: the kernels use local memory");
        }
        for (d, g) in [(128, 4), (64, 2), (128, 1), (64, 8)] {
            let ptx = super::nvrtc::compile(super::SRC_MMA, &[("D", d), ("G", g)]);
            let text = ptx.unwrap_or_else(|e| panic!("tensor cores, D {d} G {g}: {e}")).to_src();
            assert!(text.contains(".entry block_part_forward") && text.contains(".entry block_part_backward"));
            assert!(text.contains("mma.sync.aligned.m16n8k16"), "D {d} G {g}: no tensor-core instruction");
            assert!(!text.contains(".local"), "tensor cores, D {d} G {g}: the kernels use local memory");
            if let Ok(dir) = std::env::var("DFLASH_PTX_DIR") {
                std::fs::write(format!("{dir}/block_part_mma_d{d}_g{g}.ptx"), &text).unwrap();
            }
        }
    }
}
