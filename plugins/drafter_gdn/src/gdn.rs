//! One Gated DeltaNet mixer, `layers.{i}.linear_attn` (FLA `GatedDeltaNet` for
//! the math and init), reading a DFlash block and the target context.
//!
//! Weights (Qwen3.5 names where it has separate tensors; its fused `in_proj_qkv` is split into
//! q/k/v so Muon orthogonalises each on its own): `q_proj`, `k_proj` [nk*dk, H], `v_proj`,
//! `z_proj` (output gate, Qwen3.5 `in_proj_z`) [nv*dv, H], `a_proj`, `b_proj` (decay and write
//! gates, `in_proj_a` / `in_proj_b`) [nv, H], `conv1d.weight` [2*nk*dk + nv*dv, 1, K] (depthwise,
//! over the q|k|v channels as Qwen3.5's), `A_log`, `dt_bias` [nv], `norm.weight` [dv] (gated
//! RMSNorm), `out_proj` [H, nv*dv].
//!
//! How the context enters: a block is the continuation of the context stream at its anchor.
//! The context tokens (fused target features) go through this layer's k/v/a/b projections and
//! conv, and the recurrence over them, run once per sequence, gives the state after the first
//! `anchor` positions. Each block then runs as its own sequence of Bk tokens from that state, its
//! conv reading the K-1 context rows before the anchor as history. So a block sees exactly the
//! context strictly before its anchor, and never another block; inside a block the recurrence is
//! causal (token k reads block tokens 0..=k), where DFlash's attention is bidirectional.

use crate::config::GdnConfig;
use drafter_layers::layers::{linear, INITIALIZER_RANGE};
use gated_deltanet::{delta_rule, depthwise_conv, l2norm};
use plugin_api::tch::{nn, nn::Module, Kind, Tensor};

#[derive(Debug)]
pub struct GatedDeltaNet {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    z_proj: nn::Linear,
    a_proj: nn::Linear,
    b_proj: nn::Linear,
    out_proj: nn::Linear,
    /// Depthwise causal conv over the q|k|v channels: [C, 1, K].
    conv1d: Tensor,
    /// log A: the decay rate per value head (g = -A softplus(a + dt_bias)).
    a_log: Tensor,
    dt_bias: Tensor,
    /// Gated RMSNorm weight, per value-head dim.
    norm_weight: Tensor,
    key_heads: i64,
    value_heads: i64,
    key_dim: i64,
    value_dim: i64,
    kernel: i64,
    chunk: i64,
    eps: f64,
}

impl GatedDeltaNet {
    pub fn new(p: nn::Path, cfg: &GdnConfig) -> Self {
        let h = cfg.hidden_size;
        let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        let kernel = cfg.linear_conv_kernel_dim as i64;
        let channels = (2 * nk * dk + nv * dv) as i64;
        // Conv: torch's default for a depthwise Conv1d, U(-1/sqrt(K), 1/sqrt(K)).
        let bound = (kernel as f64).powf(-0.5);
        let conv1d = (&p / "conv1d").var("weight", &[channels, 1, kernel], nn::Init::Uniform { lo: -bound, up: bound });
        // Gates as FLA / Mamba2 initialise them: A ~ U(0, 16); softplus(dt_bias) = dt, log-uniform
        // in [1e-3, 1e-1], so early decays exp(g) are mostly close to 1.
        let device = p.device();
        let a = (Tensor::rand([nv as i64], (Kind::Float, device)) * 16.0).clamp_min(1e-4);
        let a_log = p.var_copy("A_log", &a.log());
        let (dt_min, dt_max) = (1e-3f64, 1e-1f64);
        let dt = (Tensor::rand([nv as i64], (Kind::Float, device)) * (dt_max.ln() - dt_min.ln()) + dt_min.ln())
            .exp()
            .clamp_min(1e-4);
        let inverse_softplus = &dt + (-(-&dt).expm1()).log();
        let dt_bias = p.var_copy("dt_bias", &inverse_softplus);
        Self {
            q_proj: linear(&p, "q_proj", h, nk * dk, INITIALIZER_RANGE),
            k_proj: linear(&p, "k_proj", h, nk * dk, INITIALIZER_RANGE),
            v_proj: linear(&p, "v_proj", h, nv * dv, INITIALIZER_RANGE),
            z_proj: linear(&p, "z_proj", h, nv * dv, INITIALIZER_RANGE),
            a_proj: linear(&p, "a_proj", h, nv, INITIALIZER_RANGE),
            b_proj: linear(&p, "b_proj", h, nv, INITIALIZER_RANGE),
            out_proj: linear(&p, "out_proj", nv * dv, h, INITIALIZER_RANGE),
            conv1d,
            a_log,
            dt_bias,
            norm_weight: (&p / "norm").ones("weight", &[dv as i64]),
            key_heads: nk as i64,
            value_heads: nv as i64,
            key_dim: dk as i64,
            value_dim: dv as i64,
            kernel,
            chunk: cfg.chunk_size as i64,
            eps: cfg.rms_norm_eps,
        }
    }

    /// x: block tokens [B, A*Bk, H] (input-normed); ctx: fused context [B, S, H]; anchors [B, A].
    /// -> [B, A*Bk, H].
    pub fn forward(&self, x: &Tensor, ctx: &Tensor, anchors: &Tensor) -> Tensor {
        let (b, s, hidden) = (ctx.size()[0], ctx.size()[1], ctx.size()[2]);
        let a = anchors.size()[1];
        let bk = x.size()[1] / a;
        let history = self.kernel - 1;
        let anchors = anchors.clamp(0, s);
        let q_channels = self.key_heads * self.key_dim;

        // 1. Context: K-1 zero rows of conv history before position 0, then k/v projections,
        //    conv over the k|v channels, gates; the recurrence's state at every anchor.
        let ctx_padded = ctx.constant_pad_nd([0, 0, history, 0]); // [B, K-1+S, H]
        let kv = Tensor::cat(&[self.k_proj.forward(&ctx_padded), self.v_proj.forward(&ctx_padded)], -1);
        let kv = depthwise_conv(&kv, &self.conv1d.narrow(0, q_channels, kv.size()[2])).silu(); // [B, S, C_k+C_v]
        let k_ctx = self.heads(&kv.narrow(-1, 0, q_channels), self.key_heads, self.key_dim, true);
        let v_ctx =
            self.heads(&kv.narrow(-1, q_channels, kv.size()[2] - q_channels), self.value_heads, self.value_dim, false);
        let (g_ctx, beta_ctx) = self.gates(ctx);
        let states = delta_rule::states_at(&k_ctx, &v_ctx, &g_ctx, &beta_ctx, &anchors, self.chunk).reshape([
            b * a,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        ]);

        // 2. Blocks, each its own sequence [K-1 context rows before the anchor; Bk block tokens]:
        //    the conv continues the context, the recurrence starts from the anchor's state.
        let rows = anchors.unsqueeze(-1) + Tensor::arange(history, (Kind::Int64, x.device())); // [B, A, K-1] in ctx_padded
        let rows = (rows + Tensor::arange(b, (Kind::Int64, x.device())).view([b, 1, 1]) * (s + history)).view([-1]);
        let before = ctx_padded.reshape([-1, hidden]).index_select(0, &rows).view([b * a, history, hidden]);
        let blocks = x.reshape([b * a, bk, hidden]);
        let stream = Tensor::cat(&[before, blocks.shallow_clone()], 1); // [B*A, K-1+Bk, H]
        let qkv = Tensor::cat(
            &[self.q_proj.forward(&stream), self.k_proj.forward(&stream), self.v_proj.forward(&stream)],
            -1,
        );
        let qkv = depthwise_conv(&qkv, &self.conv1d).silu(); // [B*A, Bk, C]
        let q = self.heads(&qkv.narrow(-1, 0, q_channels), self.key_heads, self.key_dim, true);
        let k = self.heads(&qkv.narrow(-1, q_channels, q_channels), self.key_heads, self.key_dim, true);
        let v = self.heads(
            &qkv.narrow(-1, 2 * q_channels, qkv.size()[2] - 2 * q_channels),
            self.value_heads,
            self.value_dim,
            false,
        );
        let (g, beta) = self.gates(&blocks);
        let (o, _) = delta_rule::chunked(&q, &k, &v, &g, &beta, Some(&states), self.chunk); // [B*A, nv, Bk, dv]

        // 3. Gated RMSNorm per value head, norm(o) * silu(z), then the out projection.
        let o = o.transpose(1, 2); // [B*A, Bk, nv, dv], fp32
        let z = self.z_proj.forward(&blocks).view([b * a, bk, self.value_heads, self.value_dim]).to_kind(Kind::Float);
        let normed = &o * (o.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
        let gated = normed * self.norm_weight.to_kind(Kind::Float) * z.silu();
        self.out_proj.forward(&gated.to_kind(x.kind()).reshape([b, a * bk, self.value_heads * self.value_dim]))
    }

    /// [B, L, heads*dim] -> [B, nv, L, dim] in fp32; q/k are L2-normalised (FLA: eps 1e-6) and
    /// repeated to the value heads when there are more of those.
    fn heads(&self, t: &Tensor, heads: i64, dim: i64, qk: bool) -> Tensor {
        let (b, l) = (t.size()[0], t.size()[1]);
        let mut t = t.to_kind(Kind::Float).view([b, l, heads, dim]);
        if qk {
            t = l2norm(&t);
            if self.value_heads > heads {
                t = t.repeat_interleave_self_int(self.value_heads / heads, Some(2), None::<i64>);
            }
        }
        t.transpose(1, 2)
    }

    /// Log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), in
    /// fp32: [B, L, H] -> ([B, nv, L], [B, nv, L]).
    fn gates(&self, x: &Tensor) -> (Tensor, Tensor) {
        let a = self.a_proj.forward(x).to_kind(Kind::Float) + self.dt_bias.to_kind(Kind::Float);
        let g = -(self.a_log.to_kind(Kind::Float).exp()) * a.softplus();
        let beta = self.b_proj.forward(x).to_kind(Kind::Float).sigmoid();
        (g.transpose(1, 2), beta.transpose(1, 2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DrafterSection;
    use plugin_api::{tch::Device, TargetSpec};
    use test_support::TinySpec;

    fn tiny_config(section: &str) -> GdnConfig {
        let spec = TargetSpec {
            hidden_size: 24,
            num_attention_heads: 3,
            num_key_value_heads: 1,
            intermediate_size: 40,
            ..TargetSpec::tiny()
        };
        let s: DrafterSection = plugin_api::parse_section(section).unwrap();
        s.resolve(&spec).unwrap()
    }

    /// The layer as the design states it, one anchor at a time: the block appended to the
    /// context before its anchor makes one sequence, which goes through the projections, a
    /// zero-padded causal conv and the step-by-step recurrence from a zero state; the block's
    /// part of the output is the block's result.
    fn continued_stream(m: &GatedDeltaNet, x_block: &Tensor, ctx_prefix: &Tensor) -> Tensor {
        let bk = x_block.size()[0];
        let seq = Tensor::cat(&[ctx_prefix, x_block], 0).unsqueeze(0); // [1, a+Bk, H]
        let padded = seq.constant_pad_nd([0, 0, m.kernel - 1, 0]);
        let qkv = Tensor::cat(&[m.q_proj.forward(&padded), m.k_proj.forward(&padded), m.v_proj.forward(&padded)], -1);
        let qkv = depthwise_conv(&qkv, &m.conv1d).silu();
        let qc = m.key_heads * m.key_dim;
        let q = m.heads(&qkv.narrow(-1, 0, qc), m.key_heads, m.key_dim, true);
        let k = m.heads(&qkv.narrow(-1, qc, qc), m.key_heads, m.key_dim, true);
        let v = m.heads(&qkv.narrow(-1, 2 * qc, qkv.size()[2] - 2 * qc), m.value_heads, m.value_dim, false);
        let (g, beta) = m.gates(&seq);
        let (o, _) = delta_rule::naive(&q, &k, &v, &g, &beta, None);
        let l = seq.size()[1];
        let o = o.narrow(2, l - bk, bk).transpose(1, 2); // [1, Bk, nv, dv]
        let z = m.z_proj.forward(&x_block.unsqueeze(0)).view([1, bk, m.value_heads, m.value_dim]);
        let normed = &o * (o.square().mean_dim(-1, true, Kind::Float) + m.eps).rsqrt();
        m.out_proj.forward(&(normed * &m.norm_weight * z.silu()).reshape([bk, -1]))
    }

    /// The batched layer (context recurrence once, states at anchors, blocks from those states)
    /// equals running each block as the continuation of its context prefix; anchors at 0, at
    /// chunk boundaries, inside chunks and at S; grouped value heads and a 3-wide conv too.
    #[test]
    fn blocks_continue_the_context_stream() {
        for section in [
            "mask_token_id = 63\nchunk_size = 4\nblock_size = 3",
            "mask_token_id = 63\nchunk_size = 8\nblock_size = 5\nlinear_num_value_heads = 6\nlinear_value_head_dim = 4\nlinear_conv_kernel_dim = 3",
        ] {
            let cfg = tiny_config(section);
            tch::manual_seed(5);
            let vs = nn::VarStore::new(Device::Cpu);
            let m = GatedDeltaNet::new(vs.root() / "linear_attn", &cfg);
            let (b, s, bk) = (2, 17, cfg.block_size as i64);
            let anchors = Tensor::from_slice(&[0i64, 4, 8, 11, 1, 2, 16, 17]).view([b, 4]);
            let a = anchors.size()[1];
            let ctx = Tensor::randn([b, s, 24], (Kind::Float, Device::Cpu));
            let x = Tensor::randn([b, a * bk, 24], (Kind::Float, Device::Cpu));
            let got = m.forward(&x, &ctx, &anchors).view([b, a, bk, 24]);
            for bi in 0..b {
                for j in 0..a {
                    let at = anchors.int64_value(&[bi, j]);
                    let want = continued_stream(&m, &x.get(bi).narrow(0, j * bk, bk), &ctx.get(bi).narrow(0, 0, at));
                    let out = got.get(bi).get(j);
                    let err = (&out - &want).square().mean(Kind::Double).sqrt().double_value(&[])
                        / want.square().mean(Kind::Double).sqrt().double_value(&[]);
                    assert!(err < 1e-4, "{section}: row {bi} anchor {at}: rel. RMS error {err:.2e}");
                }
            }
        }
    }
}
