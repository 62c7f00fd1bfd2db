//! Decoding with keys and values in a static cache, each forward length recorded once as a CUDA
//! graph and replayed, as serving engines decode: a small model's forward is hundreds of kernels
//! of a few microseconds each, which the host cannot launch as fast as the GPU runs them.
//!
//! The cache's buffers hold `capacity` positions. A forward writes its keys and values at its
//! positions and attends over the whole buffer, masked by position (the query at position p sees
//! keys 0..=p), so its shapes and addresses stay the same from call to call and a rollback only
//! moves the cache's length: positions past it hold stale keys, which the next forward overwrites
//! before any query sees them. A forward of L new tokens is recorded at its first call (which
//! runs as usual) and replayed at the next ones, with their tokens and positions copied into its
//! inputs. A full cache doubles, and its forwards are recorded again. Forwards longer than
//! [`MAX_RECORDED`] tokens (prefills) run op by op on the same cache.

use crate::{
    cache::{Cache, Slot},
    model::Decoder,
};
use kernels::cuda_graph::Replays;
use plugin_api::tch::{Kind, Tensor};

/// The longest forward recorded: verify blocks (blocks of up to 16) and single tokens are;
/// prefills are not.
pub const MAX_RECORDED: i64 = 16;
/// The buffers' first length, in positions.
const FIRST_CAPACITY: i64 = 1024;

pub struct StaticDecoding {
    cache: Cache,
    /// The forwards recorded, by length and feature layers.
    replays: Replays<(i64, Vec<u32>)>,
}

impl StaticDecoding {
    /// A static cache for `model`, its forwards recorded as CUDA graphs on a CUDA device, or why
    /// the model cannot keep one.
    pub fn new(model: &Decoder) -> Result<Self, String> {
        Self::with_capacity(model, FIRST_CAPACITY)
    }

    fn with_capacity(model: &Decoder, capacity: i64) -> Result<Self, String> {
        Ok(Self { cache: model.new_static_cache(capacity)?, replays: Replays::new("the target's forward") })
    }

    pub fn len(&self) -> i64 {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    pub fn reset(&mut self) {
        self.cache.set_len(0);
    }

    /// Keep the first `len` positions (`Decoder::truncate`: on static buffers, only the length).
    pub fn truncate(&mut self, model: &Decoder, len: i64) -> Result<(), String> {
        model.truncate(&mut self.cache, len)
    }

    /// Run `ids` [1, L] after the cached positions: the features of `layer_ids` [1, L, n*H] and
    /// the logits [1, L, V].
    pub fn extend(&mut self, model: &Decoder, ids: &Tensor, layer_ids: &[u32]) -> Result<(Tensor, Tensor), String> {
        let device = model.device();
        let (past, l) = (self.cache.len(), ids.size()[1]);
        self.reserve(model, past + l)?;
        let ids = ids.to_device(device);
        let positions = Tensor::arange_start(past, past + l, (Kind::Int64, device)).unsqueeze(0);
        let cache = &mut self.cache;
        // Each run (the warm-up and the recording too) starts from the same cached length.
        let mut call = |inputs: &[Tensor]| {
            cache.set_len(past);
            let (features, logits) = forward(model, cache, &inputs[0], &inputs[1], layer_ids);
            vec![features, logits]
        };
        let mut out = if l <= MAX_RECORDED {
            self.replays.run((l, layer_ids.to_vec()), &[&ids, &positions], call)?
        } else {
            call(&[ids, positions])
        };
        self.cache.set_len(past + l);
        let logits = out.pop().expect("two outputs");
        Ok((out.pop().expect("two outputs"), logits))
    }

    /// Buffers for at least `needed` positions: doubled (the kept keys copied), and the forwards
    /// recorded on the old ones dropped.
    fn reserve(&mut self, model: &Decoder, needed: i64) -> Result<(), String> {
        let capacity = self.cache.capacity.expect("a static cache");
        if needed <= capacity {
            return Ok(());
        }
        let grown = (2 * capacity).max((needed + 255) / 256 * 256);
        let mut cache = model.new_static_cache(grown)?;
        for (old, new) in self.cache.slots.iter().zip(cache.slots.iter_mut()) {
            if let (Slot::Kv(Some((k, v))), Slot::Kv(slot)) = (old, new) {
                let widen = |x: &Tensor| {
                    let s = x.size();
                    let wide = Tensor::zeros([s[0], s[1], grown, s[3]], (x.kind(), x.device()));
                    wide.narrow(2, 0, capacity).copy_(x);
                    wide
                };
                *slot = Some((widen(k), widen(v)));
            }
        }
        cache.set_len(self.cache.len());
        self.replays.clear();
        self.cache = cache;
        Ok(())
    }
}

/// One forward on the static cache: keys up to each query's position visible.
fn forward(
    model: &Decoder,
    cache: &mut Cache,
    ids: &Tensor,
    positions: &Tensor,
    layer_ids: &[u32],
) -> (Tensor, Tensor) {
    let capacity = cache.capacity.expect("a static cache");
    let l = ids.size()[1];
    let keys = Tensor::arange(capacity, (Kind::Int64, ids.device())).unsqueeze(0);
    let mask = keys.le_tensor(&positions.view([l, 1])).view([1, 1, l, capacity]);
    let n = model.cfg.num_hidden_layers;
    let (features, normed) = model.run(ids, positions, Some(&mask), None, Some(cache), n, layer_ids);
    (features, model.logits(&normed.expect("all layers ran")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::DecoderConfig, tp::Shard};
    use plugin_api::tch::Device;

    fn tiny(model_type: &str, device: Device, kind: Kind) -> Decoder {
        let cfg = DecoderConfig {
            model_type: model_type.into(),
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: Some(16),
            vocab_size: 96,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            ..Default::default()
        };
        plugin_api::tch::manual_seed(5);
        Decoder::random_shard(&cfg, device, kind, Shard::WHOLE, None).unwrap()
    }

    /// The largest difference between a static session (first buffers of `capacity`) and the
    /// model's own cache, over the calls of speculative decoding: a prompt, verify blocks cut
    /// back to what was kept, a block at a length seen before (a replay where graphs record),
    /// single tokens, a reset and a second prompt.
    fn largest_gap(model: &Decoder, capacity: i64) -> f64 {
        let _guard = plugin_api::tch::no_grad_guard();
        let mut graphed = StaticDecoding::with_capacity(model, capacity).unwrap();
        let mut plain = model.new_cache(true);
        let layers = [0u32, 2];
        let ids = |t: &[i64]| Tensor::from_slice(t).unsqueeze(0);
        let mut gap = 0f64;
        let mut step = |graphed: &mut StaticDecoding, plain: &mut Cache, t: &[i64], keep: Option<i64>| {
            let (f, l) = graphed.extend(model, &ids(t), &layers).unwrap();
            let (pf, pl) = reference(model, plain, &ids(t), &layers);
            for (a, b) in [(f, pf), (l, pl)] {
                gap = gap.max((a.to_kind(Kind::Float) - b.to_kind(Kind::Float)).abs().max().double_value(&[]));
            }
            if let Some(len) = keep {
                graphed.truncate(model, len).unwrap();
                model.truncate(plain, len).unwrap();
            }
        };
        let prompt: Vec<i64> = (0..40).map(|i| (i * 7 + 3) % 96).collect();
        step(&mut graphed, &mut plain, &prompt, None);
        step(&mut graphed, &mut plain, &[5, 9, 11, 2], Some(42));
        step(&mut graphed, &mut plain, &[8, 1, 30, 4], Some(45));
        step(&mut graphed, &mut plain, &[6, 6, 7, 19], Some(46));
        for t in [3, 77, 12] {
            step(&mut graphed, &mut plain, &[t], None);
        }
        assert_eq!(graphed.len(), 49);
        graphed.reset();
        plain = model.new_cache(true);
        step(&mut graphed, &mut plain, &prompt[..9], None);
        step(&mut graphed, &mut plain, &[2, 4, 8, 16], Some(10));
        gap
    }

    /// The model's own forward on its dynamic cache, as `HfTarget::extend` runs it.
    fn reference(model: &Decoder, cache: &mut Cache, ids: &Tensor, layers: &[u32]) -> (Tensor, Tensor) {
        let device = model.device();
        let ids = ids.to_device(device);
        let (past, l) = (cache.len(), ids.size()[1]);
        let positions = Tensor::arange_start(past, past + l, (Kind::Int64, device)).unsqueeze(0);
        let mask = crate::common::causal_mask(l, past + l, device);
        let n = model.cfg.num_hidden_layers;
        let (f, normed) = model.run(&ids, &positions, Some(&mask), None, Some(cache), n, layers);
        (f, model.logits(&normed.unwrap()))
    }

    /// The static cache gives the dynamic one's features and logits, through rollbacks, a
    /// buffer that grows (16 positions at first) and a reset.
    #[test]
    fn a_static_cache_decodes_as_the_dynamic_one() {
        for family in ["llama", "qwen3"] {
            let model = tiny(family, Device::Cpu, Kind::Float);
            let gap = largest_gap(&model, 16);
            assert!(gap < 1e-5, "{family}: {gap:.2e}");
        }
    }

    /// Only softmax attention without a window, on one rank, keeps a static cache.
    #[test]
    fn a_static_cache_is_refused_where_layers_keep_more() {
        let mut cfg: DecoderConfig = serde_json::from_str(
            r#"{"model_type": "lfm2", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "conv_L_cache": 3,
                "layer_types": ["conv", "full_attention"]}"#,
        )
        .unwrap();
        cfg.rms_norm_eps = 1e-6;
        let model = Decoder::random_shard(&cfg, Device::Cpu, Kind::Float, Shard::WHOLE, None).unwrap();
        let err = StaticDecoding::new(&model).err().unwrap();
        assert!(err.contains("ShortConv"), "{err}");
    }

    /// On a GPU, recorded forwards replay what the dynamic cache computes: f32 to rounding, bf16
    /// within its precision, through growth at the third block (a re-recording) and replays at
    /// every length.
    #[test]
    #[ignore = "needs a CUDA device: make gpu-test"]
    fn cuda_recorded_forwards_decode_as_the_dynamic_cache() {
        let device = kernels::cuda_test_device();
        for (kind, tol) in [(Kind::Float, 1e-4), (Kind::BFloat16, 0.1)] {
            let model = tiny("qwen3", device, kind);
            let gap = largest_gap(&model, 48);
            assert!(gap < tol, "{kind:?}: {gap:.2e}");
            let mut graphed = StaticDecoding::new(&model).unwrap();
            let _ = graphed.extend(&model, &Tensor::from_slice(&[1i64, 2, 3]).unsqueeze(0), &[]).unwrap();
            let _ = graphed.extend(&model, &Tensor::from_slice(&[4i64, 5]).unsqueeze(0), &[]).unwrap();
            assert_eq!(graphed.replays.len(), 2, "both forwards recorded");
        }
    }
}
