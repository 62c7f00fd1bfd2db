//! DFlash block attention with its own backward, split in two exact parts:
//! - the context keys, through libtorch's fused attention (cuDNN on CUDA in 16-bit, reading the
//!   kv heads for their query heads itself; the memory-efficient kernel in fp32 and flash on the
//!   CPU, with the keys repeated to the query heads) with a staircase bias: a block's queries see
//!   the keys before its anchor;
//! - each block's own keys: one fused kernel each way on CUDA in bf16 ([`block_part`]), small
//!   batched matmuls elsewhere.
//!
//! The context part runs on ranges of whole blocks ([`ContextMask`]): with the anchors known on
//! the host, each range scores only the context keys its blocks can see (its largest anchor), so
//! sorted anchors spread over the sequence cost about half of scoring every query against all S.
//! A range's keys before its smallest anchor are seen by all its queries: that prefix runs
//! without the bias (a bias costs cuDNN ~40% of its rate), and the two are merged through their
//! log-sum-exps like the block part. The staircase tail runs on kernels of its own where they
//! apply ([`context_tail`]: CUDA bf16, blocks of 16, full attention), which walk only the keys
//! each block sees; elsewhere on the fused kernel with the bias.
//!
//! Sliding-window layers (`window` = W, HF's `sliding_window`) are causal: a block's query at
//! offset i sees the context keys anchor+i-W+1..anchor and its block's keys 0..=i, whatever W
//! (SpecForge's training mask; for W >= the block it is the query at position p seeing p-W+1..=p,
//! as SGLang and vLLM serve such a layer). With W shorter than the block, the queries at offsets
//! W-1 and on see no context. The bias carries the per-query lower bound, the block part masks
//! the later block keys.
//!
//! The two softmaxes are merged exactly through their log-sum-exps. Masked SDPA over [context;
//! all blocks] scores every query against all S + A*Bk keys; this scores it against S + Bk. The
//! backward hands the *merged* output and log-sum-exp to the fused kernel's backward, which then
//! yields the context part's exact gradients (as ring attention does), and does the block part
//! itself; on CUDA the runs' overlapping gradients are summed in one pass ([`range_sum`]).
//! libtorch's autograd does not see this op: a drafter using it cuts its graph at the
//! attention output and calls [`backward`] itself (`Drafter::backward`).

use crate::{block_part, context_tail, range_sum};
use tch::{Device, Kind, Tensor};

/// What the backward needs. Tensors as in [`forward`].
pub struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: ContextMask,
    /// The merged output (q's dtype; the tensor returned, [B, N, nh, D] in memory) and
    /// log-sum-exp [B, nh, N] (fp32).
    out: Tensor,
    lse: Tensor,
    /// The fused-kernel runs of each range's context part (none: the range sees no context).
    runs: Vec<Vec<ContextRun>>,
    /// The ranges' tails, where their runs went to [`context_tail`] (`Backend::Tail`).
    tails: Vec<context_tail::Tail>,
    /// Whether the block part ran as the fused kernel ([`block_part`]).
    fused: bool,
    block: i64,
    scale: f64,
}

/// The context bias [B, 1, N, S] in `kind`: 0 where a query sees the key ([`context_visible`]),
/// the most negative finite value elsewhere (a query that sees no context key, as a block at
/// anchor 0, gets a uniform context softmax that weighs exp(-huge) = 0 in the merge, where -inf
/// would give NaN). The last dim is allocated padded to 16 elements, the CUDA kernel's alignment.
pub fn context_bias(anchors: &Tensor, s: i64, block: i64, kind: Kind, window: Option<i64>) -> Tensor {
    let (b, a) = (anchors.size()[0], anchors.size()[1]);
    let padded = (s + 15) / 16 * 16;
    let min = match kind {
        Kind::BFloat16 => -3.3895313892515355e38,
        Kind::Half => -65504.0,
        _ => f32::MIN as f64,
    };
    let mut bias = Tensor::full([b, 1, a * block, padded], min, (kind, anchors.device())).narrow(3, 0, s);
    // In place: an out-of-place fill would return a new, unpadded tensor (the memory-efficient
    // kernel then rejects a row stride such as 181).
    let _ = bias.masked_fill_(&context_visible(anchors, s, block, window).unsqueeze(1), 0.0);
    bias
}

/// [B, N, S] bool: query n (offset i in block n / `block`, anchor a) sees context key j iff
/// j < a, and with a sliding window W also j >= a + i - W + 1.
pub fn context_visible(anchors: &Tensor, s: i64, block: i64, window: Option<i64>) -> Tensor {
    let anchor_of_query = anchors.repeat_interleave_self_int(block, Some(1), None::<i64>).unsqueeze(-1); // [B, N, 1]
    let keys = Tensor::arange(s, (Kind::Int64, anchors.device())).view([1, 1, s]);
    let before = keys.lt_tensor(&anchor_of_query);
    match window {
        None => before,
        Some(w) => {
            let n = anchors.size()[1] * block;
            let offset = Tensor::arange(n, (Kind::Int64, anchors.device())).remainder(block).view([1, n, 1]);
            before.logical_and(&keys.ge_tensor(&(anchor_of_query + offset - (w - 1))))
        }
    }
}

/// [B, N] bool: queries that see no context key (anchor 0, or a window that ends inside the
/// block).
pub fn context_empty(anchors: &Tensor, block: i64, window: Option<i64>) -> Tensor {
    let anchor_of_query = anchors.repeat_interleave_self_int(block, Some(1), None::<i64>); // [B, N]
    let none = anchor_of_query.le(0);
    match window {
        None => none,
        Some(w) => {
            let n = anchors.size()[1] * block;
            let offset = Tensor::arange(n, (Kind::Int64, anchors.device())).remainder(block).unsqueeze(0);
            none.logical_or(&offset.ge(w - 1))
        }
    }
}

/// How many runs of blocks split attention cuts the queries into when the anchors are known on
/// the host (8 at 512 anchors: 64 blocks, 1024 queries a run; of 1 to 16 runs, 8 is the fastest
/// at the Qwen3-8B bench shapes).
pub const CONTEXT_RANGES: usize = 8;

/// The context part's mask: the anchors, the sliding window, the ranges of queries the fused
/// kernel runs on, each against the context keys `first_key..keys` only, and the bias
/// ([`context_bias`]), built the first time a span needs it (the tail kernels do not).
pub struct ContextMask {
    /// [B, A] on the device.
    pub anchors: Tensor,
    pub ranges: Vec<QueryRange>,
    /// HF's `sliding_window` of a `sliding_attention` layer (None: full attention).
    pub window: Option<i64>,
    bias: std::cell::OnceCell<Tensor>,
    s: i64,
    block: i64,
    kind: Kind,
}

/// Query rows `start..start + len` (whole blocks) see no context key before `first_key` or at or
/// past `keys`, and every key of `first_key..prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryRange {
    pub start: i64,
    pub len: i64,
    pub first_key: i64,
    pub prefix: i64,
    pub keys: i64,
}

impl QueryRange {
    /// The key spans the fused kernel runs on, and whether each needs the bias: the prefix
    /// without it, the rest with it (none when the range sees no context).
    fn spans(&self) -> Vec<(i64, i64, bool)> {
        let parts = [(self.first_key, self.prefix, false), (self.prefix, self.keys, true)];
        parts.into_iter().filter(|&(from, to, _)| to > from).collect()
    }
}

impl ContextMask {
    fn new(anchors: &Tensor, ranges: Vec<QueryRange>, s: i64, block: i64, kind: Kind, window: Option<i64>) -> Self {
        Self { anchors: anchors.shallow_clone(), ranges, window, bias: Default::default(), s, block, kind }
    }

    /// The bias [B, 1, N, S] ([`context_bias`]).
    pub fn bias(&self) -> &Tensor {
        self.bias.get_or_init(|| context_bias(&self.anchors, self.s, self.block, self.kind, self.window))
    }

    /// The bias of range `r`'s queries on context keys `from..to`.
    fn bias_for(&self, r: &QueryRange, from: i64, to: i64) -> Tensor {
        self.bias().narrow(2, r.start, r.len).narrow(3, from, to - from)
    }

    /// The same mask, sharing its tensors (the bias too, if built).
    pub fn shallow_clone(&self) -> Self {
        let bias = self.bias.get().map_or_else(Default::default, |b| b.shallow_clone().into());
        Self { anchors: self.anchors.shallow_clone(), ranges: self.ranges.clone(), bias, ..*self }
    }

    /// One range: every query scored against the whole context (the anchors stay on the device).
    pub fn whole(anchors: &Tensor, s: i64, block: i64, kind: Kind, window: Option<i64>) -> Self {
        check_window(window, block);
        let n = anchors.size()[1] * block;
        let ranges = vec![QueryRange { start: 0, len: n, first_key: 0, prefix: 0, keys: s }];
        Self::new(anchors, ranges, s, block, kind, window)
    }

    /// Up to `ranges` runs of whole blocks, each scored against the keys its blocks can see
    /// ([`query_ranges`]); `host` holds the same anchors as `anchors`, on the CPU.
    pub fn ranged(
        anchors: &Tensor,
        host: &Tensor,
        s: i64,
        block: i64,
        kind: Kind,
        ranges: usize,
        window: Option<i64>,
    ) -> Self {
        check_window(window, block);
        let (b, a) = (host.size()[0], host.size()[1]);
        let flat = Vec::<i64>::try_from(host.to_kind(Kind::Int64).contiguous().view([-1])).expect("int64 anchors");
        let rows: Vec<&[i64]> = flat.chunks(a.max(1) as usize).take(b as usize).collect();
        let ranges = query_ranges(&rows, s, block, ranges, KERNEL_TILE, window);
        Self::new(anchors, ranges, s, block, kind, window)
    }
}

/// A window holds at least the query's own position (the drafters refuse 0).
fn check_window(window: Option<i64>, block: i64) {
    if let Some(w) = window {
        assert!(w >= 1, "sliding window {w} (block {block}): it must hold at least the query's own position");
    }
}

/// The granularity of a [`QueryRange`]: at least `queries` rows (whole blocks), keys rounded up
/// to a multiple of `keys`.
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    pub queries: i64,
    pub keys: i64,
}

/// Ranges of at least 128 queries (the fused kernels' tile), keys in multiples of 256: cuDNN
/// builds an execution plan per shape, tens of milliseconds on the host, so a few distinct key
/// counts keep its cache warm (at 512 sorted anchors over 3,072 tokens, ~9 shapes ever, for 2.6%
/// more keys scored than multiples of 64, whose ~30 shapes stalled the bench's timed steps).
pub const KERNEL_TILE: Tile = Tile { queries: 128, keys: 256 };

/// Split the rows' A anchors each into up to `ranges` runs of whole blocks (the same runs in every
/// row) and give each run the context keys its blocks see in any row: up to its largest anchor,
/// rounded up to `tile.keys` (at most `s`; 0 when every anchor in it is 0), and with a sliding
/// window W from its smallest anchor - W + 1, rounded down to `tile.keys`. Without a window, the
/// keys before its smallest anchor, rounded down to `tile.keys`, are its unbiased prefix.
pub fn query_ranges(
    rows: &[&[i64]],
    s: i64,
    block: i64,
    ranges: usize,
    tile: Tile,
    window: Option<i64>,
) -> Vec<QueryRange> {
    let a = rows.first().map_or(0, |r| r.len());
    let min_blocks = (tile.queries + block - 1) / block;
    let per = a.div_ceil(ranges.max(1)).max(min_blocks as usize).clamp(1, a.max(1));
    (0..a)
        .step_by(per)
        .map(|j| {
            let end = (j + per).min(a);
            let anchors = || rows.iter().flat_map(|r| &r[j..end]).copied();
            let last = anchors().max().unwrap_or(0);
            let keys = if last <= 0 { 0 } else { ((last + tile.keys - 1) / tile.keys * tile.keys).min(s) };
            let smallest = anchors().min().unwrap_or(0);
            let (first_key, prefix) = match window {
                Some(w) if keys > 0 => {
                    let first = ((smallest - w + 1).max(0) / tile.keys * tile.keys).min(keys);
                    (first, first)
                }
                Some(_) => (0, 0),
                None => (0, (smallest / tile.keys * tile.keys).min(keys)),
            };
            QueryRange { start: j as i64 * block, len: (end - j) as i64 * block, first_key, prefix, keys }
        })
        .collect()
}

impl Saved {
    /// Whether the block part ran as the fused kernel (tests, benches).
    pub fn fused(&self) -> bool {
        self.fused
    }

    /// How many ranges' tails ran on the tail kernels (tests, benches).
    pub fn tail_kernels(&self) -> usize {
        self.tails.len()
    }
}

/// q [B, nh, N, D] (N = A blocks of `block`), k/v [B, nkv, S+N, D] ([context; blocks]), `mask`
/// of the same anchors -> output [B, nh, N, D] and what the backward needs.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, mask: &ContextMask, block: i64, scale: f64) -> (Tensor, Saved) {
    let (b, nh, n, d) = size4(q);
    let s = k.size()[2] - n;
    let (k_ctx, v_ctx) = (context_keys(q, k, s), context_keys(q, v, s));

    // 1. Context part: the fused kernel's output and log-sum-exp, range by range, span by span
    //    (the unbiased prefix first). The biased tails go to the tail kernels where they apply,
    //    every range's in one launch.
    let mut tails = tails_of(mask, block);
    let tail_out = (!tails.is_empty() && context_tail::applies(q, k, block, mask.window))
        .then(|| context_tail::forward(q, &k_ctx, &v_ctx, &mask.anchors, &tails, scale).map_err(|e| warn_tail(&e)).ok())
        .flatten();
    if tail_out.is_none() {
        tails.clear();
    }
    let (mut parts, mut runs) = (vec![], vec![]);
    for r in &mask.ranges {
        let (mut spans, mut range_runs) = (vec![], vec![]);
        for (from, to, biased) in r.spans() {
            let keys = |t: &Tensor| t.narrow(2, from, to - from);
            let (o, lse, backend) = match (&tail_out, biased) {
                (Some((o, lse)), true) => (o.narrow(2, r.start, r.len), lse.narrow(2, r.start, r.len), Backend::Tail),
                _ => {
                    let bias = biased.then(|| mask.bias_for(r, from, to));
                    context_forward(&q.narrow(2, r.start, r.len), &keys(&k_ctx), &keys(&v_ctx), bias.as_ref(), scale)
                }
            };
            spans.push((o, lse));
            range_runs.push(ContextRun { from, to, biased, backend });
        }
        parts.push(block_part::ContextPart { start: r.start, len: r.len, spans });
        runs.push(range_runs);
    }

    // 2. Block part, and the merge: softmax over all key sets from their log-sum-exps.
    let window = mask.window.unwrap_or(0);
    let fused_out = block_part::applies(q, block)
        .then(|| {
            block_part::forward(q, k, v, &parts, &mask.anchors, block, window, scale).map_err(|e| warn_unfused(&e)).ok()
        })
        .flatten();
    let fused = fused_out.is_some();
    let (out, lse) = fused_out.unwrap_or_else(|| {
        // The ranges' spans merged, then in one tensor; a range that sees no context gets zeros
        // (its rows' context part weighs nothing).
        let (mut outs, mut lses) = (vec![], vec![]);
        for part in parts {
            let mut spans = part.spans.into_iter();
            let (o, lse) = match (spans.next(), spans.next()) {
                (None, _) => (
                    Tensor::zeros([b, nh, part.len, d], (q.kind(), q.device())),
                    Tensor::zeros([b, nh, part.len], (work_kind(q), q.device())),
                ),
                (Some(only), None) => only,
                (Some(first), Some(second)) => merge_parts(first, second),
            };
            outs.push(o);
            lses.push(lse);
        }
        let (o_ctx, lse_ctx) = (Tensor::cat(&outs, 2), Tensor::cat(&lses, 2));
        composite_forward(q, k, v, mask, o_ctx, lse_ctx, s, block, scale)
    });
    let saved = Saved {
        q: q.shallow_clone(),
        k: k.shallow_clone(),
        v: v.shallow_clone(),
        mask: mask.shallow_clone(),
        fused,
        out: out.shallow_clone(),
        lse,
        runs,
        tails,
        block,
        scale,
    };
    (out, saved)
}

/// The block part and the merge as batched matmuls (the CPU, fp32, and where the fused kernel
/// does not apply): the merged output [B, nh, N, D] ([B, N, nh, D] in memory) and log-sum-exp.
#[allow(clippy::too_many_arguments)]
fn composite_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &ContextMask,
    o_ctx: Tensor,
    lse_ctx: Tensor,
    s: i64,
    block: i64,
    scale: f64,
) -> (Tensor, Tensor) {
    // A query that sees no context (a block at anchor 0): what the kernels return for an
    // all-masked row is not an empty softmax (on CUDA it is not even finite), so make that part
    // weigh nothing.
    let no_context = context_empty(&mask.anchors, block, mask.window).unsqueeze(1); // [B, 1, N]
    let lse_ctx = lse_ctx.masked_fill(&no_context, -1e30);
    let o_ctx = o_ctx.masked_fill(&no_context.unsqueeze(-1), 0.0);

    let blocks = Blocks::new(q, k, v, s, block, mask.window.is_some());
    let dims = blocks.dims;
    let s_blk = blocks.scores(scale); // [R, g*Bk, Bk]
    let lse_ctx = dims.rows(&lse_ctx); // [R, g*Bk]
    let lse = lse_ctx.logaddexp(&s_blk.logsumexp([-1], false));
    let p_blk = (&s_blk - lse.unsqueeze(-1)).exp();
    let o_blk = blocks.times(&p_blk, &blocks.v); // [R, g*Bk, D]
    let w_ctx = (&lse_ctx - &lse).exp().view(dims.grouped_shape(1));
    let merged = dims.grouped_view(&o_ctx) * w_ctx + o_blk.view(dims.grouped_shape(dims.d));
    // Written out in [B, N, nh, D] memory: the output projection reads it as [B, N, nh*D] without
    // a copy of its own to keep for its backward.
    (dims.ungroup_bnhd(&merged, q.kind()), dims.ungroup_rows(&lse))
}

/// Two context spans' (output, log-sum-exp) as one: each output weighed by its share of the merged
/// softmax, exp(lse_i - lse) (0 where lse_i is -inf).
fn merge_parts((o1, l1): (Tensor, Tensor), (o2, l2): (Tensor, Tensor)) -> (Tensor, Tensor) {
    let (l1, l2) = (l1.to_kind(work_kind(&o1)), l2.to_kind(work_kind(&o1)));
    let lse = l1.logaddexp(&l2);
    let weight = |l: &Tensor| (l - &lse).exp().unsqueeze(-1);
    let o = (o1.to_kind(lse.kind()) * weight(&l1)).addcmul_(&o2, &weight(&l2)).to_kind(o1.kind());
    (o, lse)
}

/// Each range's biased tail as the tail kernels take it (without a window, the biased spans are
/// exactly the tails).
fn tails_of(mask: &ContextMask, block: i64) -> Vec<context_tail::Tail> {
    let tail = |r: &QueryRange| {
        let (from, to, _) = r.spans().into_iter().find(|&(_, _, biased)| biased)?;
        Some(context_tail::Tail { first_block: r.start / block, blocks: r.len / block, from, keys: to - from })
    };
    mask.ranges.iter().filter_map(tail).collect()
}

fn warn_tail(e: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED
        .call_once(|| eprintln!("block attention: the tail kernels are unavailable ({e}); using cuDNN with the bias"));
}

fn warn_unfused(e: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| eprintln!("block attention: the fused block part is unavailable ({e}); using batched matmuls"));
}

/// One range's context part: the output [B, nh, n, D], log-sum-exp [B, nh, n] (fp32) and the
/// kernel that ran it.
fn context_forward(
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> (Tensor, Tensor, Backend) {
    let (b, nh, n, _) = size4(q);
    if q.device() == Device::Cpu {
        let (o, lse) =
            Tensor::internal_scaled_dot_product_flash_attention_for_cpu(q, k_ctx, v_ctx, 0.0, false, bias, scale);
        return (o, lse, Backend::CpuFlash);
    }
    let per_head = bias.map(|bias| bias.expand([b, nh, n, k_ctx.size()[2]], false));
    let cudnn = if takes_cudnn(q) {
        cudnn::forward(q, k_ctx, v_ctx, per_head.as_ref(), scale)
    } else {
        Err(format!("{:?} inputs", q.kind()))
    };
    match cudnn {
        Ok((o, lse, backend)) => (o, lse.view([b, nh, n]), backend),
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            if matches!(q.kind(), Kind::BFloat16 | Kind::Half) {
                WARNED.call_once(|| {
                    eprintln!("block attention: cuDNN attention unavailable ({e}); using the memory-efficient kernel")
                });
            }
            let (k_ctx, v_ctx) = (repeat_heads(k_ctx, nh), repeat_heads(v_ctx, nh));
            let (o, lse, seed, offset) = Tensor::internal_scaled_dot_product_efficient_attention(
                q,
                &k_ctx,
                &v_ctx,
                per_head.as_ref(),
                true,
                0.0,
                false,
                scale,
            );
            (o, lse.narrow(2, 0, n), Backend::Efficient { seed, offset })
        }
    }
}

/// The gradients (dq, dk, dv) of the loss from `d_out` = dLoss/d(output). dk and dv [B, nkv,
/// S+N, D] are [B, S+N, nkv, D] in memory, the layout the k and v projections' backward reads.
pub fn backward(saved: &Saved, d_out: &Tensor) -> (Tensor, Tensor, Tensor) {
    let Saved { q, k, v, mask, out, lse, runs, tails, fused, block, scale } = saved;
    let causal = mask.window.is_some();
    let (b, nh, n, d) = size4(q);
    let (nkv, s) = (k.size()[1], k.size()[2] - n);
    let g = nh / nkv;
    let wk = work_kind(q);
    let d_out = &d_out.to_kind(q.kind());
    // Rebuilt rather than kept from the forward (where repeated to the query heads, 0.2 GB a
    // layer at the bench shapes).
    let (k_ctx, v_ctx) = (&context_keys(q, k, s), &context_keys(q, v, s));

    // 1. Context part, range by range, span by span: the fused backward with the merged output
    //    and log-sum-exp (so each span's are its exact share). Each run's dq covers its range's
    //    rows, its dk and dv its span of keys (spans of different ranges overlap). The tails that
    //    ran on the tail kernels first, all in one launch each way: dq for every row, dk and dv
    //    one tail after another.
    let (mut dq_runs, mut dk_runs, mut dv_runs) = (vec![], vec![], vec![]);
    let tail_grads = (!tails.is_empty())
        .then(|| {
            context_tail::backward(q, k_ctx, v_ctx, d_out, out, lse, &mask.anchors, tails, *scale)
                .map_err(|e| warn_tail(&e))
                .ok()
        })
        .flatten();
    let mut tail_row = 0;
    if let Some((dq_t, _, _)) = &tail_grads {
        dq_runs.push((dq_t.shallow_clone(), 0));
    }
    for (r, range_runs) in mask.ranges.iter().zip(runs) {
        if range_runs.is_empty() {
            continue; // a range that sees no context
        }
        let rows = |t: &Tensor| t.narrow(2, r.start, r.len);
        // dO and O contiguous [B, nh, n, D], as the kernels return O: with other strides cuDNN's
        // D = rowsum(dO * O) comes out wrong. Made for the first run that needs them (a range
        // with only a tail on the tail kernels: none).
        let dense_rows = std::cell::OnceCell::new();
        for run in range_runs {
            let len = run.to - run.from;
            let keys = |t: &Tensor| t.narrow(2, run.from, len);
            if let (Backend::Tail, Some((_, dk_t, dv_t))) = (&run.backend, &tail_grads) {
                dk_runs.push((dk_t.narrow(2, tail_row, len), run.from));
                dv_runs.push((dv_t.narrow(2, tail_row, len), run.from));
                tail_row += len;
                continue;
            }
            let bias = run.biased.then(|| mask.bias_for(r, run.from, run.to));
            // A tail whose kernels failed in the backward: cuDNN's forward for its state, then
            // its backward.
            let cudnn_run;
            let backend = match &run.backend {
                Backend::Tail => {
                    cudnn_run = context_forward(&rows(q), &keys(k_ctx), &keys(v_ctx), bias.as_ref(), *scale).2;
                    &cudnn_run
                }
                other => other,
            };
            let (d_out_r, out_r, lse_r) =
                dense_rows.get_or_init(|| (dense(&rows(d_out)), dense(&rows(out)), rows(lse).contiguous()));
            let (dq_r, dk_r, dv_r) = context_backward(
                backend,
                d_out_r,
                &rows(q),
                &keys(k_ctx),
                &keys(v_ctx),
                out_r,
                lse_r,
                bias.as_ref(),
                *scale,
            );
            // Per query head where the kernel took the keys repeated: summed over each group.
            let sum_groups = |x: Tensor| match x.size()[1] == nkv {
                true => x,
                false => x.view([b, nkv, g, len, d]).sum_dim_intlist(&[2i64][..], false, wk),
            };
            dq_runs.push((dq_r, r.start));
            dk_runs.push((sum_groups(dk_r), run.from));
            dv_runs.push((sum_groups(dv_r), run.from));
        }
    }

    // 2. The runs summed into the gradients' context rows (one pass on CUDA, fp32 adds
    //    elsewhere), then the block part: the fused kernel adds to dq and writes the block rows of
    //    dk and dv.
    let dq = Tensor::empty([b, nh, n, d], (if *fused { q.kind() } else { wk }, q.device()));
    let position_major = |kind: Kind| Tensor::empty([b, s + n, nkv, d], (kind, k.device())).transpose(1, 2);
    let (dk, dv) = (position_major(k.kind()), position_major(v.kind()));
    sum_runs_into(&dq, &dq_runs, wk);
    sum_runs_into(&dk.narrow(2, 0, s), &dk_runs, wk);
    sum_runs_into(&dv.narrow(2, 0, s), &dv_runs, wk);
    if *fused {
        match block_part::backward(q, k, v, d_out, out, lse, &dq, &dk, &dv, *block, mask.window.unwrap_or(0), *scale) {
            Ok(()) => return (dq, dk, dv),
            Err(e) => warn_unfused(&e),
        }
    }
    let (dq_blk, dk_blk, dv_blk) = composite_backward(q, k, v, d_out, out, lse, s, *block, causal, *scale);
    let dims = Blocks::dims_of(q, k, *block);
    // dq_ctx += dq_blk, added in fp32 and rounded once.
    let _ = dims.grouped_view(&dq).g_add_(&dq_blk.view(dims.grouped_shape(d)));
    dk.narrow(2, s, n).copy_(&dk_blk.view([b, nkv, n, d]));
    dv.narrow(2, s, n).copy_(&dv_blk.view([b, nkv, n, d]));
    (dq.to_kind(q.kind()), dk, dv)
}

/// `out` [B, H, rows, D] = the runs ([B, H, len, D], each with the row it starts at) summed over
/// the rows each covers, zeros elsewhere: one kernel on CUDA ([`range_sum`]), else fp32 adds.
fn sum_runs_into(out: &Tensor, runs: &[(Tensor, i64)], wk: Kind) {
    if range_sum::applies(out, runs) {
        match range_sum::sum_into(out, runs) {
            Ok(()) => return,
            Err(e) => warn_unfused(&e),
        }
    }
    let total = Tensor::zeros(out.size(), (wk, out.device()));
    for (t, from) in runs {
        let _ = total.narrow(2, *from, t.size()[2]).g_add_(t);
    }
    out.shallow_clone().copy_(&total);
}

/// `t` [B, H, len, D] as a contiguous copy. On CUDA the run-sum kernel copies it (one run): a
/// row's D elements are one 16-byte load a thread, where libtorch's copy of this permuted layout
/// (o and dO are [B, N, H, D] in memory) moves it at a fraction of the bandwidth.
fn dense(t: &Tensor) -> Tensor {
    if t.is_contiguous() {
        return t.shallow_clone();
    }
    let out = Tensor::empty(t.size(), (t.kind(), t.device()));
    let run = [(t.shallow_clone(), 0)];
    match range_sum::applies(&out, &run) && range_sum::sum_into(&out, &run).is_ok() {
        true => out,
        false => t.contiguous(),
    }
}

/// The block part's backward as batched matmuls: P from the merged log-sum-exp, then softmax
/// backward with the full row's D = rowsum(dO * O). (dq [R, g*Bk, D], dk and dv [R, Bk, D]) in
/// the work kind.
#[allow(clippy::too_many_arguments)]
fn composite_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    s: i64,
    block: i64,
    causal: bool,
    scale: f64,
) -> (Tensor, Tensor, Tensor) {
    let blocks = Blocks::new(q, k, v, s, block, causal);
    let (dims, wk) = (blocks.dims, blocks.wk);
    let p = (blocks.scores(scale) - dims.rows(lse).unsqueeze(-1)).exp(); // [R, g*Bk, Bk]
    let d_o = dims.grouped(d_out); // [R, g*Bk, D]
    let row = dims.rows(&(d_out.to_kind(wk) * out).sum_dim_intlist(&[-1i64][..], false, wk));
    // Rows are (query head, position): products contracting them sum over the g heads too.
    let dv_blk = blocks.times(&p.transpose(1, 2), &d_o); // [R, Bk, D]
    let ds = &p * (blocks.times(&d_o, &blocks.v.transpose(1, 2)) - row.unsqueeze(-1)) * scale;
    let dq_blk = blocks.times(&ds, &blocks.k); // [R, g*Bk, D]
    let dk_blk = blocks.times(&ds.transpose(1, 2), &blocks.q); // [R, Bk, D]
    (dq_blk, dk_blk, dv_blk)
}

/// One range's context backward: (dq, dk, dv), dk and dv per kv head or per query head as the
/// keys came. `d_out`, `out` and `lse` come contiguous.
#[allow(clippy::too_many_arguments)]
fn context_backward(
    backend: &Backend,
    d_out: &Tensor,
    q: &Tensor,
    k_ctx: &Tensor,
    v_ctx: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> (Tensor, Tensor, Tensor) {
    let (b, nh, n, _) = size4(q);
    let s = k_ctx.size()[2];
    let per_head = || bias.map(|bias| bias.expand([b, nh, n, s], false));
    match backend {
        Backend::CpuFlash => Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k_ctx, v_ctx, out, lse, 0.0, false, bias, scale,
        ),
        Backend::Cudnn { cum_q, cum_k, max_q, max_k, seed, offset } => {
            let lse = lse.view([b, nh, n, 1]);
            // An undefined tensor is libtorch's "no bias".
            let bias = per_head().unwrap_or_else(Tensor::new);
            Tensor::internal_scaled_dot_product_cudnn_attention_backward(
                d_out, q, k_ctx, v_ctx, out, &lse, seed, offset, &bias, cum_q, cum_k, *max_q, *max_k, 0.0, false, scale,
            )
        }
        Backend::Tail => unreachable!("a tail's backward runs on the tail kernels, or its cuDNN forward's state"),
        Backend::Efficient { seed, offset } => {
            // The kernel's own layout, [B, M, heads, D], as libtorch's SDPA backward passes it.
            let t = |x: &Tensor| x.transpose(1, 2);
            let (k_ctx, v_ctx) = (&repeat_heads(k_ctx, nh), &repeat_heads(v_ctx, nh));
            // The kernel keeps log-sum-exps padded to 32 queries.
            let lse_padded = Tensor::zeros([b, nh, (n + 31) / 32 * 32], (Kind::Float, q.device()));
            lse_padded.narrow(2, 0, n).copy_(lse);
            // dO and O dense in that layout too: with other strides the kernel's D = rowsum(dO * O)
            // comes out wrong.
            let (d_out_t, out_t) = (t(d_out).contiguous(), t(out).contiguous());
            let (dq, dk, dv, _) = Tensor::internal_efficient_attention_backward(
                &d_out_t,
                &t(q),
                &t(k_ctx),
                &t(v_ctx),
                per_head().as_ref(),
                &out_t,
                None::<&Tensor>,
                None,
                n,
                s,
                &lse_padded,
                0.0,
                seed,
                offset,
                0,
                false,
                scale,
                None,
                None,
                false,
            );
            (t(&dq), t(&dk), t(&dv))
        }
    }
}

/// The block part's shapes. Its rows are grouped by (sequence, kv head, block): R = B*nkv*A
/// groups, each with the g query heads' Bk positions as g*Bk rows against the block's own Bk
/// keys, so every product is one batched matmul with no broadcast copies.
#[derive(Clone, Copy)]
struct Dims {
    b: i64,
    nkv: i64,
    g: i64,
    a: i64,
    block: i64,
    d: i64,
}

impl Dims {
    fn groups(&self) -> i64 {
        self.b * self.nkv * self.a
    }

    /// [B, nkv, A, g, Bk, x]: the grouped order, as a 6-d shape.
    fn grouped_shape(&self, x: i64) -> [i64; 6] {
        [self.b, self.nkv, self.a, self.g, self.block, x]
    }

    /// [B, nh, N, x] seen in the grouped order [B, nkv, A, g, Bk, x] (a view).
    fn grouped_view(&self, t: &Tensor) -> Tensor {
        let x = t.size()[3];
        t.view([self.b, self.nkv, self.g, self.a, self.block, x]).permute([0, 1, 3, 2, 4, 5])
    }

    /// [B, nh, N, x] -> [R, g*Bk, x] (a copy).
    fn grouped(&self, t: &Tensor) -> Tensor {
        let x = t.size()[3];
        self.grouped_view(t).reshape([self.groups(), self.g * self.block, x])
    }

    /// Per-row values [B, nh, N] -> [R, g*Bk].
    fn rows(&self, t: &Tensor) -> Tensor {
        let (b, nkv, g, a, bk) = (self.b, self.nkv, self.g, self.a, self.block);
        t.view([b, nkv, g, a, bk]).permute([0, 1, 3, 2, 4]).reshape([self.groups(), g * bk])
    }

    /// [R, g*Bk] -> [B, nh, N].
    fn ungroup_rows(&self, t: &Tensor) -> Tensor {
        let (b, nkv, g, a, bk) = (self.b, self.nkv, self.g, self.a, self.block);
        t.view([b, nkv, a, g, bk]).permute([0, 1, 3, 2, 4]).reshape([b, nkv * g, a * bk])
    }

    /// A grouped [B, nkv, A, g, Bk, D] result as [B, nh, N, D] in `kind`, [B, N, nh, D] in memory
    /// (one pass: the cast and the permutation together).
    fn ungroup_bnhd(&self, t: &Tensor, kind: Kind) -> Tensor {
        let (b, nkv, g, a, bk, d) = (self.b, self.nkv, self.g, self.a, self.block, self.d);
        let out = Tensor::empty([b, a, bk, nkv, g, d], (kind, t.device()));
        out.permute([0, 3, 1, 4, 2, 5]).copy_(&t.view(self.grouped_shape(d)));
        out.view([b, a * bk, nkv * g, d]).transpose(1, 2)
    }
}

/// The block tokens' q [R, g*Bk, D] and own k / v [R, Bk, D] in the inputs' dtype ([`Dims`]).
struct Blocks {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dims: Dims,
    /// Some(16-bit dtype) on CUDA: products take 16-bit operands with fp32 accumulation and output,
    /// as the fused kernels do (probabilities and their gradients rounded to 16 bits first).
    half: Option<Kind>,
    wk: Kind,
    /// A sliding-window layer's block part: a query sees its block's keys up to its own.
    causal: bool,
}

impl Blocks {
    fn dims_of(q: &Tensor, k: &Tensor, block: i64) -> Dims {
        let (b, nh, n, d) = size4(q);
        let nkv = k.size()[1];
        Dims { b, nkv, g: nh / nkv, a: n / block, block, d }
    }

    fn new(q: &Tensor, k: &Tensor, v: &Tensor, s: i64, block: i64, causal: bool) -> Self {
        let dims = Self::dims_of(q, k, block);
        let own = |t: &Tensor| t.narrow(2, s, dims.a * block).reshape([dims.groups(), block, dims.d]);
        let half = (matches!(q.kind(), Kind::BFloat16 | Kind::Half) && q.device().is_cuda()).then(|| q.kind());
        Self { q: dims.grouped(q), k: own(k), v: own(v), dims, half, wk: work_kind(q), causal }
    }

    /// a @ b (batched) in fp32, or f64 for f64 inputs.
    fn times(&self, a: &Tensor, b: &Tensor) -> Tensor {
        match self.half {
            Some(kind) => a.to_kind(kind).bmm_dtype(&b.to_kind(kind), Kind::Float),
            None => a.to_kind(self.wk).bmm(&b.to_kind(self.wk)),
        }
    }

    /// Scaled scores of each group's rows against its block's own keys [R, g*Bk, Bk]; causal:
    /// -inf past the row's own position (row r is position r % Bk).
    fn scores(&self, scale: f64) -> Tensor {
        let s = self.times(&self.q, &self.k.transpose(1, 2)) * scale;
        if !self.causal {
            return s;
        }
        let bk = self.dims.block;
        let pos = Tensor::arange(self.dims.g * bk, (Kind::Int64, s.device())).remainder(bk).unsqueeze(1);
        let later = Tensor::arange(bk, (Kind::Int64, s.device())).unsqueeze(0).gt_tensor(&pos); // [g*Bk, Bk]
        s.masked_fill(&later, f64::NEG_INFINITY)
    }
}

/// One fused-kernel run of a range's context part: keys `from..to`, with the bias or without.
struct ContextRun {
    from: i64,
    to: i64,
    biased: bool,
    backend: Backend,
}

/// The fused kernel behind a context run.
enum Backend {
    CpuFlash,
    Cudnn {
        cum_q: Tensor,
        cum_k: Tensor,
        max_q: i64,
        max_k: i64,
        seed: Tensor,
        offset: Tensor,
    },
    /// The memory-efficient kernel (when cuDNN attention is not available), with its dropout RNG
    /// state (unused: no dropout) passed back as it expects.
    Efficient {
        seed: Tensor,
        offset: Tensor,
    },
    /// A range's biased tail on the tail kernels ([`context_tail`]), which need no state.
    Tail,
}

/// libtorch's cuDNN attention forward through csrc/cudnn_attention.cpp: tch binds its backward
/// but not the forward that returns the log-sum-exp.
mod cudnn {
    use crate::ffi::{dflash_cudnn_attention_forward, with_error_buffer};
    use std::ffi::c_void;
    use tch::Tensor;

    /// The output, the log-sum-exp [B, nh, N, 1] (natural log) and what the backward wants back.
    /// `bias` None: every query sees every key.
    pub fn forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        bias: Option<&Tensor>,
        scale: f64,
    ) -> Result<(Tensor, Tensor, super::Backend), String> {
        let mut p = [std::ptr::null_mut::<c_void>(); 6];
        let (mut max_q, mut max_k) = (0i64, 0i64);
        let [out, lse, cum_q, cum_k, seed, offset] = &mut p;
        // SAFETY: tch handles are at::Tensor*; the shim only reads the inputs and, on success,
        // returns six new at::Tensor* that the Tensors below take ownership of.
        with_error_buffer(|err, err_len| unsafe {
            dflash_cudnn_attention_forward(
                q.as_ptr() as _,
                k.as_ptr() as _,
                v.as_ptr() as _,
                bias.map_or(std::ptr::null_mut(), |b| b.as_ptr() as _),
                scale,
                out,
                lse,
                cum_q,
                cum_k,
                &mut max_q,
                &mut max_k,
                seed,
                offset,
                err,
                err_len,
            )
        })?;
        // SAFETY: see above.
        let t = |x: *mut c_void| unsafe { Tensor::from_ptr(x as _) };
        let backend =
            super::Backend::Cudnn { cum_q: t(p[2]), cum_k: t(p[3]), max_q, max_k, seed: t(p[4]), offset: t(p[5]) };
        Ok((t(p[0]), t(p[1]), backend))
    }
}

/// The context part of k or v [B, nkv, S+N, D] as the context kernel for `q` takes it: cuDNN reads
/// the kv heads' keys for their query heads itself (GQA), the CPU kernel wants them repeated.
fn context_keys(q: &Tensor, t: &Tensor, s: i64) -> Tensor {
    let ctx = t.narrow(2, 0, s);
    match takes_cudnn(q) {
        true => ctx,
        false => repeat_heads(&ctx, q.size()[1]),
    }
}

/// Whether the context part of `q` runs on cuDNN's kernel: 16-bit on CUDA (for fp32 it returns
/// NaN rather than an error).
fn takes_cudnn(q: &Tensor) -> bool {
    q.device().is_cuda() && matches!(q.kind(), Kind::BFloat16 | Kind::Half)
}

/// k or v [B, nkv, L, D] repeated to `nh` heads [B, nh, L, D] (a copy; as it is when nkv = nh).
fn repeat_heads(t: &Tensor, nh: i64) -> Tensor {
    let (b, nkv, l, d) = size4(t);
    match nkv == nh {
        true => t.shallow_clone(),
        false => t.unsqueeze(2).expand([b, nkv, nh / nkv, l, d], false).reshape([b, nh, l, d]),
    }
}

/// fp32 for the block part and the merge (f64 when the inputs are, for the tests).
fn work_kind(q: &Tensor) -> Kind {
    if q.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// The mask masked SDPA takes over [context; all blocks] [B, 1, N, S+N]: the context keys the
/// query sees ([`context_visible`]), and the query's own block, all of it, or with a sliding
/// window its keys up to the query's own, however short the window (the drafters' masked path,
/// and the reference this module is checked against).
pub fn masked_sdpa_mask(anchors: &Tensor, s: i64, block: i64, window: Option<i64>) -> Tensor {
    check_window(window, block);
    let (b, a) = (anchors.size()[0], anchors.size()[1]);
    let (n, device) = (a * block, anchors.device());
    let idx = Tensor::arange(n, (Kind::Int64, device));
    let block_id = idx.divide_scalar_mode(block, "floor");
    let mut own = block_id.unsqueeze(1).eq_tensor(&block_id.unsqueeze(0));
    if window.is_some() {
        own = own.logical_and(&idx.unsqueeze(0).le_tensor(&idx.unsqueeze(1)));
    }
    let own = own.unsqueeze(0).expand([b, n, n], false);
    Tensor::cat(&[context_visible(anchors, s, block, window), own], 2).unsqueeze(1)
}

fn size4(t: &Tensor) -> (i64, i64, i64, i64) {
    let s = t.size();
    (s[0], s[1], s[2], s[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Split attention equals masked SDPA over [context; blocks], forward and gradients, with GQA,
    /// blocks at anchor 0 (no context) and at the last position: over the whole context, and in
    /// ranges that score fewer keys, one of them none, one an unbiased prefix and a biased tail,
    /// one its prefix alone; full attention and sliding windows (one as long as the block, where
    /// the block's last query sees no context, and shorter ones, where more of them see none and
    /// the last range sees no context at all with a window of 1).
    #[test]
    fn split_attention_equals_masked_sdpa() {
        let (b, nh, nkv, d, s, block) = (2, 4, 2, 8, 11, 4);
        let anchors = Tensor::from_slice(&[0i64, 0, 3, 10, 0, 5, 6, 10]).view([2, 4]);
        let n = 4 * block;
        let opts = (Kind::Double, Device::Cpu);
        let rows = [&[0i64, 0, 3, 10][..], &[0, 5, 6, 10]];
        for window in [None, Some(1), Some(2), Some(4), Some(6)] {
            let q = Tensor::randn([b, nh, n, d], opts).set_requires_grad(true);
            let k = Tensor::randn([b, nkv, s + n, d], opts).set_requires_grad(true);
            let v = Tensor::randn([b, nkv, s + n, d], opts).set_requires_grad(true);
            let mask = masked_sdpa_mask(&anchors, s, block, window);
            let scale = 0.3;
            let want = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&mask), 0.0, false, Some(scale), true);
            let d_out = Tensor::randn([b, nh, n, d], opts);
            (&want * &d_out).sum(Kind::Double).backward();

            let ranges = query_ranges(&rows, s, block, 4, Tile { queries: block, keys: 2 }, window);
            // A range's first context key: with a window, its smallest anchor - W + 1 rounded down
            // to the tile (2), and it runs biased from there; without one, from 0, its keys before
            // the smallest anchor unbiased (the third range's 0..2; all of the last range's).
            let first = |smallest: i64| window.map_or(0, |w| (smallest - w + 1).max(0) / 2 * 2);
            let prefix = |p: i64, first: i64| if window.is_some() { first } else { p };
            let expect = [
                (0, 4, 0, 0, 0),
                (4, 4, first(0), prefix(0, first(0)), 6),
                (8, 4, first(3), prefix(2, first(3)), 6),
                (12, 4, first(10), prefix(10, first(10)), 10),
            ];
            let expect: Vec<_> = expect
                .iter()
                .map(|&(start, len, first_key, prefix, keys)| QueryRange { start, len, first_key, prefix, keys })
                .collect();
            assert_eq!(ranges[..], expect[..], "window {window:?}");
            let ranged = ContextMask::new(&anchors, ranges, s, block, Kind::Double, window);
            for mask in [ContextMask::whole(&anchors, s, block, Kind::Double, window), ranged] {
                let (got, saved) = tch::no_grad(|| forward(&q.detach(), &k.detach(), &v.detach(), &mask, block, scale));
                let (dq, dk, dv) = tch::no_grad(|| backward(&saved, &d_out));
                for (name, x, y) in
                    [("out", &want, &got), ("dq", &q.grad(), &dq), ("dk", &k.grad(), &dk), ("dv", &v.grad(), &dv)]
                {
                    let err = (x - y).abs().max().double_value(&[]);
                    assert!(err < 1e-13, "{name} (window {window:?}, {:?}): max |diff| {err}", mask.ranges);
                }
            }
        }
    }

    /// The masks by their definition, position by position: block key j of anchor a sits at
    /// a + j; full attention sees the context before the anchor and the whole block; a sliding
    /// window W sees the context positions p-W+1.. of the query at p and its block's keys up to
    /// its own, also when W is shorter than the block (then the queries at offsets W-1 and on
    /// see no context, and still their block's earlier keys).
    #[test]
    fn masks_follow_the_position_rules() {
        let (s, block) = (12i64, 4i64);
        let rows = [[0i64, 2, 7], [11, 5, 3]];
        let anchors = Tensor::from_slice(&rows.concat()).view([2, 3]);
        for window in [None, Some(1), Some(2), Some(3), Some(4), Some(5), Some(9)] {
            let mask = masked_sdpa_mask(&anchors, s, block, window);
            let got: Vec<bool> = Vec::try_from(mask.flatten(0, -1)).unwrap();
            let n = 3 * block;
            let mut want = Vec::new();
            for row in &rows {
                for qi in 0..n {
                    let (a, i) = (row[(qi / block) as usize], qi % block);
                    let p = a + i;
                    let in_window = |pos: i64| window.is_none_or(|w| pos > p - w && pos <= p);
                    for key in 0..s + n {
                        want.push(if key < s {
                            key < a && in_window(key)
                        } else {
                            let (kb, j) = ((key - s) / block, (key - s) % block);
                            kb == qi / block && (window.is_none() || j <= i)
                        });
                    }
                }
            }
            assert_eq!(got, want, "window {window:?}");
            let empty: Vec<bool> = Vec::try_from(context_empty(&anchors, block, window).flatten(0, -1)).unwrap();
            let visible = context_visible(&anchors, s, block, window).any_dim(-1, false).logical_not();
            assert_eq!(empty, Vec::<bool>::try_from(visible.flatten(0, -1)).unwrap(), "window {window:?}");
        }
    }

    /// Ranges hold at least a tile of queries, keys round up to the tile and stop at S, the
    /// unbiased prefix rounds down; with a window they start at the tile below their smallest
    /// anchor - W + 1.
    #[test]
    fn query_ranges_follow_the_tiles() {
        let row: Vec<i64> = (0..40).map(|j| j * 20).collect(); // anchors 0..780
        let r = query_ranges(&[&row], 1000, 16, 8, KERNEL_TILE, None); // 8 blocks (128 queries) a range
        let got: Vec<_> = r.iter().map(|r| (r.start, r.len, r.first_key, r.prefix, r.keys)).collect();
        // Smallest anchors 0, 160, 320, 480, 640: prefixes rounded down to 256.
        assert_eq!(
            got,
            [
                (0, 128, 0, 0, 256),
                (128, 128, 0, 0, 512),
                (256, 128, 0, 256, 512),
                (384, 128, 0, 256, 768),
                (512, 128, 0, 512, 1000)
            ]
        );
        assert_eq!(
            query_ranges(&[&row], 1000, 16, 1, KERNEL_TILE, None),
            [QueryRange { start: 0, len: 640, first_key: 0, prefix: 0, keys: 1000 }]
        );
        // Window 300: the ranges' smallest anchors 0, 160, 320, 480, 640 start at 0, 0, 0, 0, 256.
        let r = query_ranges(&[&row], 1000, 16, 8, KERNEL_TILE, Some(300));
        assert_eq!(r.iter().map(|r| r.first_key).collect::<Vec<_>>(), [0, 0, 0, 0, 256]);
        assert!(r.iter().all(|r| r.prefix == r.first_key), "a window's ranges run biased whole: {r:?}");
        let r = query_ranges(&[&row], 1000, 16, 8, KERNEL_TILE, Some(100));
        assert_eq!(r.iter().map(|r| r.first_key).collect::<Vec<_>>(), [0, 0, 0, 256, 512]);
    }

    /// The bias keeps its padded rows (the memory-efficient kernel needs a row stride that is a
    /// multiple of 4; a context of 181 keys once reached it unpadded), and its values.
    #[test]
    fn context_bias_rows_stay_padded() {
        let anchors = Tensor::from_slice(&[0i64, 5, 181]).view([1, 3]);
        let bias = context_bias(&anchors, 181, 2, Kind::Float, None);
        assert_eq!(bias.size(), [1, 1, 6, 181]);
        assert_eq!(bias.stride()[2], 192);
        let visible = bias.eq(0.0).sum(Kind::Int64).int64_value(&[]);
        assert_eq!(visible, 2 * (5 + 181));
        // Window 4: offset 0 sees the 3 keys before its anchor, offset 1 sees 2.
        let bias = context_bias(&anchors, 181, 2, Kind::Float, Some(4));
        assert_eq!(bias.stride()[2], 192);
        assert_eq!(bias.eq(0.0).sum(Kind::Int64).int64_value(&[]), 2 * (3 + 2));
    }
}
