//! The context part's staircase tails on tensor cores (csrc/context_tail.cu), for CUDA bf16 with
//! blocks of 16, head dims 64 or 128 and up to 8 query heads a kv head, full attention.
//!
//! A range of blocks scores the context keys before its smallest anchor with no mask (its prefix,
//! on cuDNN); the rest of its keys is its tail, where the block at anchor a sees the tail keys
//! before a, all its queries alike. cuDNN scores a tail through a bias over every key at about
//! half its unbiased rate; these kernels walk each block's seen keys only. Every range's tail
//! runs in one launch each way. [`crate::block_attention`] calls them, and cuDNN with the bias
//! where they do not apply or fail.

use crate::{block_part::Arg, nvrtc};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SRC: &str = concat!(include_str!("../csrc/mma.cuh"), include_str!("../csrc/context_tail.cu"));
const FORWARD: &str = "tail_forward";
const BACKWARD_DQ: &str = "tail_backward_dq";
const BACKWARD_DKV: &str = "tail_backward_dkv";
/// The kernel's MAX_TAILS and KTD (keys a CTA of the dk, dv kernel).
const MAX_TAILS: usize = 16;
const KEYS_A_CTA: i64 = 64;

/// One range's tail: blocks `first_block..first_block + blocks` against context keys
/// `from..from + keys`; the block at anchor a sees those before a.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tail {
    pub first_block: i64,
    pub blocks: i64,
    pub from: i64,
    pub keys: i64,
}

/// Whether the kernels take q [B, nh, N, D] and k [B, nkv, S+N, D] with blocks of `block` and
/// sliding window `window` (a window's per-query lower bound is the bias's job).
pub fn applies(q: &Tensor, k: &Tensor, block: i64, window: Option<i64>) -> bool {
    let (nh, d, nkv) = (q.size()[1], q.size()[3], k.size()[1]);
    nvrtc::enabled()
        && q.device().is_cuda()
        && q.kind() == Kind::BFloat16
        && k.kind() == Kind::BFloat16
        && block == 16
        && matches!(d, 64 | 128)
        && nkv > 0
        && nh % nkv == 0
        && (1..=8).contains(&(nh / nkv))
        && window.is_none()
}

/// The kernel's `Tails`, field for field.
#[repr(C)]
#[derive(Default)]
struct Table {
    first_block: [i32; MAX_TAILS],
    blocks: [i32; MAX_TAILS],
    from: [i32; MAX_TAILS],
    keys: [i32; MAX_TAILS],
    first_tile: [i32; MAX_TAILS + 1],
    out_row: [i32; MAX_TAILS],
    n: i32,
}

// SAFETY: plain integers in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Table {}

impl Table {
    /// The tails, with the dk, dv kernel's CTAs and output rows laid out one tail after another.
    fn new(tails: &[Tail]) -> Result<Self, String> {
        if tails.len() > MAX_TAILS {
            return Err(format!("{} tails (at most {MAX_TAILS})", tails.len()));
        }
        let mut t = Table { n: tails.len() as i32, ..Default::default() };
        let (mut tiles, mut rows) = (0i64, 0i64);
        for (i, tail) in tails.iter().enumerate() {
            let int = |x: i64| i32::try_from(x).map_err(|_| format!("{tail:?} does not fit the kernel's ints"));
            (t.first_block[i], t.blocks[i], t.from[i], t.keys[i]) =
                (int(tail.first_block)?, int(tail.blocks)?, int(tail.from)?, int(tail.keys)?);
            (t.first_tile[i], t.out_row[i]) = (int(tiles)?, int(rows)?);
            tiles += (tail.keys + KEYS_A_CTA - 1) / KEYS_A_CTA;
            rows += tail.keys;
        }
        t.first_tile[tails.len()] = i32::try_from(tiles).map_err(|_| "too many key tiles".to_string())?;
        Ok(t)
    }

    fn tiles(&self) -> u32 {
        self.first_tile[self.n as usize] as u32
    }
}

/// The module for q's and k's head dim and query heads a kv head.
fn module(q: &Tensor, k: &Tensor) -> Result<nvrtc::Module, String> {
    let Device::Cuda(device) = q.device() else { return Err("not a CUDA tensor".into()) };
    let (d, g) = (q.size()[3], q.size()[1] / k.size()[1]);
    nvrtc::module(device, SRC, &[("D", d), ("G", g)], &[FORWARD, BACKWARD_DQ, BACKWARD_DKV])
}

/// Tensors as the kernels take them: every row 16-byte aligned (cp.async moves 16 bytes).
fn args<const N: usize>(ts: [&Tensor; N]) -> Result<[Arg; N], String> {
    let mut out = Vec::with_capacity(N);
    for t in ts {
        let a = Arg::new(t)?;
        if !a.aligned(16) {
            return Err(format!(
                "a tensor of shape {:?} with strides {:?}: rows must be 16-byte aligned",
                t.size(),
                t.stride()
            ));
        }
        out.push(a);
    }
    Ok(out.try_into().unwrap_or_else(|_| unreachable!()))
}

/// Anchors [B, A] as the kernels read them (int64, rows dense).
fn anchors_arg(anchors: &Tensor) -> Tensor {
    anchors.to_kind(Kind::Int64).contiguous()
}

/// q [B, nh, N, D], the context keys k, v [B, nkv, S, D], anchors [B, A] -> every tail's output
/// [B, nh, N, D] and log-sum-exp [B, nh, N] (fp32), each block's rows from its range's tail (a
/// block that sees none of it, or is in no tail: zeros and -inf).
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    anchors: &Tensor,
    tails: &[Tail],
    scale: f64,
) -> Result<(Tensor, Tensor), String> {
    let (b, nh, n, d) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let table = Table::new(tails)?;
    let out = Tensor::empty([b, nh, n, d], (q.kind(), q.device()));
    let lse = Tensor::empty([b, nh, n], (Kind::Float, q.device()));
    let anchors = anchors_arg(anchors);
    let [aq, ak, av, ao] = args([q, k, v, &out])?;
    let m = module(q, k)?;
    let (p_anchors, ab, p_lse, lb, lh) =
        (anchors.data_ptr() as u64, anchors.stride()[0], lse.data_ptr() as u64, lse.stride()[0], lse.stride()[1]);
    let scale32 = scale as f32;
    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(FORWARD));
    for a in [&aq, &ak, &av] {
        a.push(&mut launch);
    }
    launch.arg(&table).arg(&p_anchors).arg(&ab);
    ao.push(&mut launch);
    launch.arg(&p_lse).arg(&lb).arg(&lh).arg(&scale32);
    // SAFETY: the arguments match the kernel's signature; every pointer is a live tensor's data
    // on this device with the strides passed, and the launch is ordered on libtorch's stream.
    unsafe { launch.launch(query_grid(q, k, anchors.size()[1])) }.map_err(|e| format!("{FORWARD}: {e}"))?;
    Ok((out, lse))
}

/// The tails' backward: from `d_out` and the *merged* output and log-sum-exp of the forward
/// (`out` [B, nh, N, D], `lse` [B, nh, N] dense fp32) -> dq [B, nh, N, D] (zeros for rows that
/// see no tail key), and dk, dv [B, nkv, sum of the tails' keys, D]: tail i's keys at the rows
/// after the tails before it.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    anchors: &Tensor,
    tails: &[Tail],
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor), String> {
    let (b, nh, n, d) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let nkv = k.size()[1];
    if lse.kind() != Kind::Float || !lse.is_contiguous() || lse.size() != [b, nh, n] {
        return Err(format!("log-sum-exp {:?} {:?}: dense fp32 [{b}, {nh}, {n}] wanted", lse.kind(), lse.size()));
    }
    let table = Table::new(tails)?;
    let rows: i64 = tails.iter().map(|t| t.keys).sum();
    let dq = Tensor::empty([b, nh, n, d], (q.kind(), q.device()));
    let dsum = Tensor::empty([b, nh, n], (Kind::Float, q.device()));
    let dk = Tensor::empty([b, nkv, rows, d], (k.kind(), k.device()));
    let dv = Tensor::empty([b, nkv, rows, d], (k.kind(), k.device()));
    let anchors = anchors_arg(anchors);
    let [aq, ak, av, ad, ao, ag, adk] = args([q, k, v, d_out, out, &dq, &dk])?;
    let m = module(q, k)?;
    let (p_lse, p_dsum, lb, lh) = (lse.data_ptr() as u64, dsum.data_ptr() as u64, lse.stride()[0], lse.stride()[1]);
    let (p_anchors, ab, p_dv) = (anchors.data_ptr() as u64, anchors.stride()[0], dv.data_ptr() as u64);
    let scale32 = scale as f32;

    let stream = m.stream();
    let mut launch = stream.launch_builder(m.function(BACKWARD_DQ));
    for a in [&aq, &ak, &av, &ad, &ao] {
        a.push(&mut launch);
    }
    launch.arg(&p_lse).arg(&p_dsum).arg(&lb).arg(&lh).arg(&table).arg(&p_anchors).arg(&ab);
    ag.push(&mut launch);
    launch.arg(&scale32);
    // SAFETY: as in `forward`; dsum has lse's shape and strides (both dense).
    unsafe { launch.launch(query_grid(q, k, anchors.size()[1])) }.map_err(|e| format!("{BACKWARD_DQ}: {e}"))?;

    if table.tiles() > 0 {
        let stream = m.stream();
        let mut launch = stream.launch_builder(m.function(BACKWARD_DKV));
        for a in [&aq, &ak, &av, &ad] {
            a.push(&mut launch);
        }
        launch.arg(&p_lse).arg(&p_dsum).arg(&lb).arg(&lh).arg(&table).arg(&p_anchors).arg(&ab);
        launch.arg(&adk.ptr).arg(&p_dv).arg(&adk.strides[0]).arg(&adk.strides[1]).arg(&adk.strides[2]).arg(&scale32);
        let grid = (table.tiles(), nkv as u32, b as u32);
        let config = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as above; dk and dv are fresh dense tensors of the same shape, D written after
        // the dq kernel on the same stream.
        unsafe { launch.launch(config) }.map_err(|e| format!("{BACKWARD_DKV}: {e}"))?;
    }
    Ok((dq, dk, dv))
}

/// The query-major kernels' grid: a CTA a (block, kv head, sequence), a warp a query head.
fn query_grid(q: &Tensor, k: &Tensor, blocks: i64) -> LaunchConfig {
    let g = (q.size()[1] / k.size()[1]) as u32;
    LaunchConfig {
        grid_dim: (blocks as u32, k.size()[1] as u32, q.size()[0] as u32),
        block_dim: (32 * g, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    /// The kernels compile with NVRTC (no GPU needed) for the head dims and groups they take,
    /// without local memory (the tail table read at constant offsets, nothing spilled), and the
    /// table matches the kernel's layout.
    #[test]
    fn the_kernels_compile() {
        assert_eq!(std::mem::size_of::<super::Table>(), (4 * 16 + 17 + 16 + 1) * 4, "the kernel's Tails layout");
        for (d, g) in [(128, 4), (64, 2), (128, 1), (64, 8)] {
            let ptx = super::nvrtc::compile(super::SRC, &[("D", d), ("G", g)]);
            let text = ptx.unwrap_or_else(|e| panic!("D {d} G {g}: {e}")).to_src();
            for entry in [super::FORWARD, super::BACKWARD_DQ, super::BACKWARD_DKV] {
                assert!(text.contains(&format!(".entry {entry}")), "D {d} G {g}: no {entry}");
            }
            assert!(text.contains("ldmatrix.sync.aligned.m8n8.x4.trans") && text.contains("cp.async"), "D {d} G {g}");
            assert!(!text.contains(".local"), "D {d} G {g}: the kernels use local memory");
        }
    }

    /// The table lays the tails' dk, dv CTAs and rows out one after another.
    #[test]
    fn the_table_lays_tails_out_in_order() {
        let tail = |first_block, from, keys| super::Tail { first_block, blocks: 4, from, keys };
        let t = super::Table::new(&[tail(0, 0, 256), tail(4, 256, 100), tail(8, 256, 0)]).unwrap();
        assert_eq!((t.n, &t.first_tile[..4], &t.out_row[..3]), (3, &[0, 4, 6, 6][..], &[0, 256, 356][..]));
        assert_eq!(t.tiles(), 6);
        assert!(super::Table::new(&vec![tail(0, 0, 1); 17]).is_err());
    }
}
