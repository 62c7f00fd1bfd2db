//! The DFlash drafter (the DFlash paper; z-lab `dflash/model.py` for the layer order): target features
//! fused by `fc` + `hidden_norm`, then Qwen3 decoder layers whose attention takes Q from the block
//! tokens and K/V from [context; block], each block seeing the context strictly before its anchor
//! and itself (a `sliding_attention` layer: the context within `sliding_window` positions of each
//! query, and its block causal). Weight names equal the z-lab checkpoint's. The layers are
//! `drafter_layers`'.

use crate::config::DFlashConfig;
use drafter_layers::layers::{linear, rope_cos_sin, Attention, AttentionInputs, Mlp, MlpCut, ProjCut, RmsNorm};
use kernels::block_attention;
use plugin_api::tch::{self as tch, nn, nn::Module, Device, Kind, Tensor};

pub use kernels::block_attention::CONTEXT_RANGES;

#[derive(Debug)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn new(p: nn::Path, cfg: &DFlashConfig, window: Option<i64>) -> Self {
        let h = cfg.hidden_size as i64;
        Self {
            self_attn: Attention::new(&p / "self_attn", &cfg.dense_shape(), window),
            mlp: Mlp::new(&p / "mlp", &cfg.dense_shape()),
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, cfg.rms_norm_eps),
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, cfg.rms_norm_eps),
        }
    }

    fn forward(&self, x: &Tensor, ctx: &Tensor, at: &AttentionInputs) -> Tensor {
        // The context enters K/V as fused (hidden_norm'd), not through input_layernorm.
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), ctx, at);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }

    /// `forward` for one decoding block against the layer's kept context keys/values.
    fn forward_decode(
        &self,
        x: &Tensor,
        context: &(Tensor, Tensor),
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Tensor {
        let x = x + self.self_attn.forward_decode(&self.input_layernorm.forward(x), context, cos, sin, mask);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }

    /// `forward` with split block attention, outside autograd: [`backward_cut`](Self::backward_cut)
    /// is written out. Each residual add is fused with the norm after it where a GPU kernel
    /// applies (`RmsNorm::forward_add`).
    fn forward_cut(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        at: &AttentionInputs,
        masks: &ContextMasks,
        block: i64,
    ) -> (Tensor, Cut) {
        tch::no_grad(|| {
            let mask = masks.for_layer(self.self_attn.window);
            let (q, k, v, proj) = self.self_attn.project_cut(&self.input_layernorm.forward(x), ctx, at);
            let attention = kernels::profiler::range("block attention");
            let (o, saved) = block_attention::forward(&q, &k, &v, mask, block, self.self_attn.scale());
            drop(attention);
            let merged = self.self_attn.heads_merged(&o);
            let (x1, normed) = self.post_attention_layernorm.forward_add(x, &self.self_attn.output_merged(&merged));
            let (mlp_out, mlp) = self.mlp.forward_cut(&normed);
            (&x1 + mlp_out, Cut { x1, proj, merged, saved, mlp })
        })
    }

    /// [`forward_cut`](Self::forward_cut)'s backward, for its input x, from g = dLoss/d(output):
    /// dLoss/dx, and (weight, gradient) pairs for the layer's weights; the context's gradient is
    /// added into `d_ctx`. The residual's gradient joins each norm's in its backward
    /// (`RmsNorm::backward_add`). Outside autograd, as the forward: the layer's input leaf
    /// requires grad, and the norms' fallback would otherwise record a graph on it.
    fn backward_cut(
        &self,
        x: &Tensor,
        cut: &Cut,
        g: &Tensor,
        at: &AttentionInputs,
        ctx: &Tensor,
        d_ctx: &mut Tensor,
    ) -> (Tensor, Vec<(Tensor, Tensor)>) {
        tch::no_grad(|| {
            let (d_normed, mlp) = self.mlp.cut_grads(&cut.mlp, g);
            let (dx1, d_post_norm) = self.post_attention_layernorm.backward_add(&cut.x1, &d_normed, g);
            let (d_o, d_out) = self.self_attn.output_grads(&cut.merged, &dx1);
            let attention = kernels::profiler::range("block attention");
            let (dq, dk, dv) = block_attention::backward(&cut.saved, &d_o);
            drop(attention);
            let (d_normed, proj) = self.self_attn.cut_grads(&cut.proj, at, ctx, &dq, &dk, &dv, d_ctx);
            let (dx, d_input_norm) = self.input_layernorm.backward_add(x, &d_normed, &dx1);
            let mut weights: Vec<_> = mlp.into_iter().chain(proj).collect();
            weights.push(d_out);
            weights.push((self.post_attention_layernorm.weight().shallow_clone(), d_post_norm));
            weights.push((self.input_layernorm.weight().shallow_clone(), d_input_norm));
            (dx, weights)
        })
    }
}

#[derive(Debug)]
pub struct DFlashDrafter {
    pub cfg: DFlashConfig,
    fc: nn::Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl DFlashDrafter {
    pub fn new(root: &nn::Path, cfg: &DFlashConfig) -> Self {
        let h = cfg.hidden_size;
        let n_feat = cfg.dflash_config.target_layer_ids.len();
        Self {
            cfg: cfg.clone(),
            fc: linear(root, "fc", n_feat * h, h, cfg.initializer_range),
            hidden_norm: RmsNorm::new(root / "hidden_norm", h as i64, cfg.rms_norm_eps),
            layers: cfg
                .windows()
                .into_iter()
                .enumerate()
                .map(|(i, w)| DecoderLayer::new(root / "layers" / i, cfg, w))
                .collect(),
            norm: RmsNorm::new(root / "norm", h as i64, cfg.rms_norm_eps),
        }
    }

    /// target_hidden [B, S, n*H], block_embeds [B, A*Bk, H], anchors [B, A] (int64)
    /// -> block hidden states [B, A*Bk, H] after the final norm.
    pub fn forward(&self, target_hidden: &Tensor, block_embeds: &Tensor, anchors: &Tensor) -> Tensor {
        let (ctx, at) = self.context(target_hidden, block_embeds, anchors, true);
        let mut x = block_embeds.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, &ctx, &at);
        }
        self.norm.forward(&x)
    }

    /// The target features fused, [B, S, n*H] -> [B, S, H]; RoPE positions (block token k of
    /// anchor a at a + k, the context at 0..S-1); and, for masked attention, the mask: context
    /// keys strictly before the query's anchor, the query's own block.
    fn context(
        &self,
        target_hidden: &Tensor,
        block_embeds: &Tensor,
        anchors: &Tensor,
        masked: bool,
    ) -> (Tensor, AttentionInputs) {
        let ctx = self.hidden_norm.forward(&self.fc.forward(target_hidden));
        let (s, bk) = (target_hidden.size()[1], self.cfg.block_size as i64);
        (
            ctx,
            AttentionInputs::new(
                anchors,
                s,
                bk,
                &self.cfg.dense_shape(),
                block_embeds.kind(),
                masked,
                self.cfg.window(),
            ),
        )
    }

    /// One speculative-decoding block with the context kept in `cache`: `new_context` [1, n,
    /// L*H] holds the target features of positions `start..start+n` (start 0: a new sequence),
    /// `block_embeds` [1, Bk, H] the block at `start + n`. Equals [`forward`](Self::forward) over
    /// the whole context with that one anchor, for the cost of the new positions and the block.
    pub fn decode_block(
        &self,
        cache: &mut DecodeCache,
        new_context: &Tensor,
        start: i64,
        block_embeds: &Tensor,
    ) -> Result<Tensor, String> {
        if start == 0 {
            cache.clear();
        }
        if start != cache.len {
            return Err(format!(
                "context_start is {start}, but the drafter holds {} positions of this sequence",
                cache.len
            ));
        }
        let shape = self.cfg.dense_shape();
        let (kind, device) = (block_embeds.kind(), block_embeds.device());
        let rope = |from: i64, n: i64| {
            let positions = Tensor::arange_start(from, from + n, (Kind::Int64, device)).unsqueeze(0);
            rope_cos_sin(&positions, shape.head_dim, shape.rope_theta, &shape.rope_scaling, kind)
        };
        // 1. The new positions' keys and values in every layer, appended to the kept ones: the
        //    context (fused features) enters every layer's K/V as it is, so a layer's context K/V
        //    never change once computed.
        let n = new_context.size()[1];
        if cache.layers.is_empty() || n > 0 {
            let fused = self.hidden_norm.forward(&self.fc.forward(new_context));
            let (cos, sin) = rope(start, n);
            let new = self.layers.iter().map(|l| l.self_attn.keys_values(&fused, &cos, &sin));
            cache.layers = match std::mem::take(&mut cache.layers) {
                kept if kept.is_empty() => new.collect(),
                kept => kept
                    .into_iter()
                    .zip(new)
                    .map(|((k, v), (nk, nv))| (Tensor::cat(&[k, nk], 2), Tensor::cat(&[v, nv], 2)))
                    .collect(),
            };
            cache.len += n;
        }
        // 2. The block over the kept context: a full-attention layer sees all of it and all of
        //    its block; a sliding layer only the window before each query, causal in the block.
        let (s, bk) = (cache.len, block_embeds.size()[1]);
        let (cos, sin) = rope(s, bk);
        let sliding = self.cfg.window().map(|w| decode_window_mask(s, bk, w, device));
        let mut x = block_embeds.shallow_clone();
        for (layer, context) in self.layers.iter().zip(&cache.layers) {
            let mask = layer.self_attn.window.and(sliding.as_ref());
            x = layer.forward_decode(&x, context, &cos, &sin, mask);
        }
        Ok(self.norm.forward(&x))
    }

    /// [`decode_block`](Self::decode_block) on static buffers (`decode_graph.rs`): each layer's
    /// context keys and values sit in `buffers` [1, Hkv, C, D], the new context's written at
    /// positions `start` [1] (int64, on the device) onwards, and the block attends to them masked
    /// to the positions before its anchor, and to itself. Its shapes and addresses stay the same
    /// from call to call for one context length, so a CUDA graph can replay it. Full-attention
    /// layers only ([`static_support`](Self::static_support)).
    pub fn decode_block_static(
        &self,
        buffers: &mut [(Tensor, Tensor)],
        new_context: &Tensor,
        start: &Tensor,
        block_embeds: &Tensor,
    ) -> Tensor {
        let shape = self.cfg.dense_shape();
        let (kind, device) = (block_embeds.kind(), block_embeds.device());
        let rope = |positions: &Tensor| {
            rope_cos_sin(&positions.unsqueeze(0), shape.head_dim, shape.rope_theta, &shape.rope_scaling, kind)
        };
        let (n, bk, capacity) = (new_context.size()[1], block_embeds.size()[1], buffers[0].0.size()[2]);
        // 1. The new context's keys and values into the buffers.
        let at = start + Tensor::arange(n, (Kind::Int64, device));
        let fused = self.hidden_norm.forward(&self.fc.forward(new_context));
        let (cos, sin) = rope(&at);
        for (layer, (k_kept, v_kept)) in self.layers.iter().zip(buffers.iter_mut()) {
            let (k, v) = layer.self_attn.keys_values(&fused, &cos, &sin);
            let _ = k_kept.index_copy_(2, &at, &k);
            let _ = v_kept.index_copy_(2, &at, &v);
        }
        // 2. The block at the anchor (position start + n): the context before it, and itself.
        let anchor = start + n;
        let (cos, sin) = rope(&(&anchor + Tensor::arange(bk, (Kind::Int64, device))));
        let before = Tensor::arange(capacity, (Kind::Int64, device)).lt_tensor(&anchor);
        let mask = Tensor::cat(
            &[before.view([1, capacity]).expand([bk, capacity], false), Tensor::ones([bk, bk], (Kind::Bool, device))],
            1,
        )
        .view([1, 1, bk, capacity + bk]);
        let mut x = block_embeds.shallow_clone();
        for (layer, context) in self.layers.iter().zip(buffers.iter()) {
            x = layer.forward_decode(&x, context, &cos, &sin, Some(&mask));
        }
        self.norm.forward(&x)
    }

    /// Whether [`decode_block_static`](Self::decode_block_static) computes this drafter: not
    /// where a sliding layer's window would need a mask of its own.
    pub fn static_support(&self) -> Result<(), String> {
        match self.cfg.window() {
            Some(_) => Err("it has sliding-window layers".into()),
            None => Ok(()),
        }
    }

    /// Empty key and value buffers of `capacity` positions for
    /// [`decode_block_static`](Self::decode_block_static), a pair a layer.
    pub fn static_buffers(&self, capacity: i64, kind: Kind, device: Device) -> Vec<(Tensor, Tensor)> {
        let shape = self.cfg.dense_shape();
        let size = [1, shape.num_key_value_heads as i64, capacity, shape.head_dim as i64];
        self.layers.iter().map(|_| (Tensor::zeros(size, (kind, device)), Tensor::zeros(size, (kind, device)))).collect()
    }

    /// The training forward when the drafter runs its own backward (`mode` asks for split
    /// attention or layer checkpointing): the output is a leaf, and [`backward`](Self::backward)
    /// takes the tape. The graph is cut into one segment per layer (with split attention, a
    /// layer runs outside autograd and its backward is written out); with checkpointing only each
    /// layer's input is kept and the segment is rebuilt in backward, for one more forward pass of
    /// the layers.
    ///
    /// `host_anchors`, the same anchors on the CPU, let split attention score each run of blocks
    /// against only the context keys it can see ([`block_attention::ContextMask::ranged`]).
    pub fn forward_train(
        &self,
        target_hidden: &Tensor,
        block_embeds: &Tensor,
        anchors: &Tensor,
        host_anchors: Option<&Tensor>,
        mode: TrainMode,
    ) -> (Tensor, Tape) {
        let (ctx, at) = self.context(target_hidden, block_embeds, anchors, !mode.split_attention);
        // A leaf for the layers: their gradients w.r.t. the context add up in it.
        let ctx_leaf = ctx.detach().set_requires_grad(true);
        let (s, bk, kind) = (target_hidden.size()[1], self.cfg.block_size as i64, block_embeds.kind());
        // One context mask per kind of layer the drafter has (full, and its sliding window).
        let windows = self.cfg.windows();
        let mask = mode.split_attention.then(|| {
            let make = |window: Option<i64>| match host_anchors {
                Some(host) => block_attention::ContextMask::ranged(anchors, host, s, bk, kind, CONTEXT_RANGES, window),
                None => block_attention::ContextMask::whole(anchors, s, bk, kind, window),
            };
            let window = windows.iter().flatten().next().copied();
            ContextMasks {
                full: windows.iter().any(Option::is_none).then(|| make(None)),
                sliding: window.map(|w| make(Some(w))),
            }
        });
        let mut x = block_embeds.shallow_clone();
        let mut kept = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let _range = kernels::profiler::range(&format!("layer {i}"));
            if mode.checkpoint_layers {
                kept.push(Kept::Input(x.shallow_clone()));
                x = tch::no_grad(|| self.segment(i, layer, &x, &ctx_leaf, &at, mask.as_ref()).y);
            } else {
                let seg = self.segment(i, layer, &x, &ctx_leaf, &at, mask.as_ref());
                x = seg.y.detach();
                kept.push(Kept::Segment(seg));
            }
        }
        let last = x.detach().set_requires_grad(true);
        let out = self.norm.forward(&last);
        let leaf = out.detach().set_requires_grad(true);
        (leaf, Tape { ctx, ctx_leaf, at, mask, kept, last, out })
    }

    /// Gradients from `grad` = dLoss/d(output) into the parameters, last layer first.
    pub fn backward(&self, tape: Tape, grad: &Tensor) {
        let Tape { ctx, ctx_leaf, at, mask, kept, last, out } = tape;
        pull(&[(&out, grad)]);
        let mut g = last.grad();
        // The cut layers' context gradients add up here (the others' in ctx_leaf's own).
        let mut d_ctx = ctx_leaf.zeros_like();
        for (i, (layer, k)) in self.layers.iter().zip(kept).enumerate().rev() {
            let _range = kernels::profiler::range(&format!("layer {i}"));
            let seg = match k {
                Kept::Input(x) => self.segment(i, layer, &x, &ctx_leaf, &at, mask.as_ref()),
                Kept::Segment(seg) => seg,
            };
            // (The first layer's input is the frozen embedding: its gradient goes unused.)
            g = match &seg.cut {
                Some(cut) => {
                    let (dx, weights) = layer.backward_cut(&seg.x, cut, &g, &at, &ctx_leaf, &mut d_ctx);
                    pull(&weights.iter().map(|(w, d)| (w, d)).collect::<Vec<_>>());
                    dx
                }
                None => {
                    pull(&[(&seg.y, &g)]);
                    seg.x.grad()
                }
            };
        }
        let from_autograd = ctx_leaf.grad();
        if from_autograd.defined() {
            d_ctx += from_autograd;
        }
        pull(&[(&ctx, &d_ctx)]);
    }

    /// Layer `i` on `x` (made a leaf): through autograd, or with split attention outside it.
    fn segment(
        &self,
        i: usize,
        layer: &DecoderLayer,
        x: &Tensor,
        ctx: &Tensor,
        at: &AttentionInputs,
        mask: Option<&ContextMasks>,
    ) -> Segment {
        let x = x.detach().set_requires_grad(i > 0);
        match mask {
            None => Segment { y: layer.forward(&x, ctx, at), x, cut: None },
            Some(mask) => {
                let (y, cut) = layer.forward_cut(&x, ctx, at, mask, self.cfg.block_size as i64);
                Segment { x, y, cut: Some(cut) }
            }
        }
    }
}

/// Backward from several outputs at once, each with its gradient, in one pass of the engine.
fn pull(pairs: &[(&Tensor, &Tensor)]) {
    kernels::autograd::backward(pairs).unwrap_or_else(|e| panic!("drafter backward: {e}"));
}

/// One sequence's drafter context while decoding: each layer's context keys (RoPE'd) and
/// values [1, nkv, S, D]. The context is only ever verified positions, so it only grows.
#[derive(Default)]
pub struct DecodeCache {
    layers: Vec<(Tensor, Tensor)>,
    len: i64,
}

impl DecodeCache {
    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// A sliding-window layer's decoding mask [1, 1, Bk, S+Bk] for a block at position `s` after
/// `s` context positions: query s+i sees context keys j > s+i-W and block keys up to its own.
fn decode_window_mask(s: i64, bk: i64, window: i64, device: Device) -> Tensor {
    let q = Tensor::arange_start(s, s + bk, (Kind::Int64, device)).unsqueeze(1);
    let context = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(0).gt_tensor(&(q - window));
    let own = Tensor::ones([bk, bk], (Kind::Bool, device)).tril(0);
    Tensor::cat(&[context, own], 1).view([1, 1, bk, s + bk])
}

/// How the drafter trains (the `[drafter]` section's `attention` and `checkpoint_layers`).
#[derive(Debug, Clone, Copy, Default)]
pub struct TrainMode {
    pub split_attention: bool,
    pub checkpoint_layers: bool,
}

impl TrainMode {
    /// Whether training goes through `forward_train` / `backward`.
    pub fn own_backward(&self) -> bool {
        self.split_attention || self.checkpoint_layers
    }
}

/// Split attention's context masks: one for the full-attention layers, one for the
/// sliding-window layers (each only when the drafter has such layers).
pub struct ContextMasks {
    full: Option<block_attention::ContextMask>,
    sliding: Option<block_attention::ContextMask>,
}

impl ContextMasks {
    fn for_layer(&self, window: Option<i64>) -> &block_attention::ContextMask {
        match window {
            None => self.full.as_ref(),
            Some(_) => self.sliding.as_ref(),
        }
        .expect("a mask for every kind of layer the drafter has")
    }
}

/// What [`DFlashDrafter::forward_train`] keeps for the backward.
pub struct Tape {
    /// The fused context with its graph (fc, hidden_norm), and the leaf the layers read.
    ctx: Tensor,
    ctx_leaf: Tensor,
    at: AttentionInputs,
    mask: Option<ContextMasks>,
    kept: Vec<Kept>,
    /// The last layer's output as a leaf, and the final norm of it.
    last: Tensor,
    out: Tensor,
}

enum Kept {
    /// Checkpointing: the layer's input, no graph.
    Input(Tensor),
    Segment(Segment),
}

/// One layer from its input leaf `x` to `y`: autograd's graph, or with split attention none
/// (the `cut` has what its written-out backward takes).
struct Segment {
    x: Tensor,
    y: Tensor,
    cut: Option<Cut>,
}

/// What [`DecoderLayer::backward_cut`] takes besides the layer's input: the residual sum after the
/// attention, the attention's projections, its output with heads merged, what its backward needs,
/// and the MLP's.
struct Cut {
    x1: Tensor,
    proj: ProjCut,
    merged: Tensor,
    saved: block_attention::Saved,
    mlp: MlpCut,
}

/// Build on `device` with weights of `kind`.
pub fn build(cfg: &DFlashConfig, device: Device, kind: Kind) -> (nn::VarStore, DFlashDrafter) {
    let mut vs = nn::VarStore::new(device);
    let model = DFlashDrafter::new(&vs.root(), cfg);
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    (vs, model)
}
