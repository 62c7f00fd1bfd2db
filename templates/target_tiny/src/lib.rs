//! A tiny causal language model: the template for target plugins.
//!
//! What a target gives the host: its spec, a tokenizer (`tokenizer.json` text) and chat template,
//! the embedding and LM head, the features of any layers for a batch, greedy generation, and a
//! KV-cached decoding session for evaluation. Here the model is a small pre-norm transformer
//! (causal attention without position encodings, SiLU MLP, tied head) with weights drawn from
//! its own seed, and the tokenizer is byte-level (any text, 256 byte tokens plus ChatML's
//! markers). To wrap your own model, replace `TinyLm::random` with a loader
//! (`Tensor::read_safetensors`) and the tokenizer with your model's `tokenizer.json`.

use plugin_api::{
    abi_stable::std_types::{RNone, RSome},
    describe::{SectionCheck, TargetFacts},
    serde::Deserialize,
    tch::{self, Device, Kind, Tensor},
    Describe, HostContext, PluginError, PluginInfo, PluginInstance, PluginKind, Section, TargetPlugin, TargetSpec,
};

/// The `[target]` section (besides `plugin = "tiny_lm"`).
#[derive(Debug, Clone, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
pub struct TinyLmConfig {
    /// Width of the residual stream.
    #[serde(default = "default_hidden")]
    #[describe(range = "a multiple of num_attention_heads")]
    pub hidden_size: u32,
    /// Decoder layers.
    #[serde(default = "default_layers")]
    #[describe(range = ">= 1")]
    pub num_hidden_layers: u32,
    /// Attention heads per layer.
    #[serde(default = "default_heads")]
    #[describe(range = ">= 1")]
    pub num_attention_heads: u32,
    /// Seeds the weights: the same seed is the same model.
    #[serde(default)]
    pub seed: u64,
}

fn default_hidden() -> u32 {
    64
}
fn default_layers() -> u32 {
    4
}
fn default_heads() -> u32 {
    4
}

/// Token ids past the 256 bytes.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const PAD: u32 = 256;
const EOS: u32 = 258;
const VOCAB: i64 = 256 + SPECIALS.len() as i64;
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
const EPS: f64 = 1e-6;

/// GPT-2's byte-to-character map (printable bytes stand for themselves, the others move past
/// 255), which byte-level tokenizers use as their vocabulary.
fn byte_char(b: u8) -> char {
    let kept = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if kept(b) {
        b as char
    } else {
        char::from_u32(256 + (0..b).filter(|&x| !kept(x)).count() as u32).unwrap_or('?')
    }
}

/// A byte-level BPE tokenizer without merges: one token per byte, ChatML markers as specials.
pub fn tokenizer_json() -> String {
    let vocab: Vec<String> = (0..=255u8)
        .map(|b| {
            let c = match byte_char(b) {
                '"' => "\\\"".to_string(),
                '\\' => "\\\\".to_string(),
                c => c.to_string(),
            };
            format!("\"{c}\": {b}")
        })
        .collect();
    let added: Vec<String> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| format!(r#"{{"id": {}, "content": "{s}", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}"#, 256 + i))
        .collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}], "normalizer": null,
"pre_tokenizer": {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}},
"post_processor": null, "decoder": {{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}},
"model": {{"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null, "end_of_word_suffix": null,
"fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": {{{}}}, "merges": []}}}}"#,
        added.join(", "),
        vocab.join(", ")
    )
}

/// One layer's weights.
struct Layer {
    input_norm: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    post_norm: Tensor,
    up: Tensor,
    down: Tensor,
}

/// Each layer's cached keys and values [B, heads, T, head_dim].
type Cache = Vec<Option<(Tensor, Tensor)>>;

pub struct TinyLm {
    cfg: TinyLmConfig,
    embedding: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// The decoding session's cache (`cache_*`).
    session: Cache,
}

impl TinyLm {
    fn random(cfg: TinyLmConfig, device: Device, kind: Kind) -> Self {
        tch::manual_seed(cfg.seed as i64);
        let h = cfg.hidden_size as i64;
        let opts = (kind, device);
        let matrix = |rows: i64, cols: i64| Tensor::randn([rows, cols], opts) / (cols as f64).sqrt();
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| Layer {
                input_norm: Tensor::ones([h], opts),
                q: matrix(h, h),
                k: matrix(h, h),
                v: matrix(h, h),
                o: matrix(h, h),
                post_norm: Tensor::ones([h], opts),
                up: matrix(2 * h, h),
                down: matrix(h, 2 * h),
            })
            .collect();
        let embedding = Tensor::randn([VOCAB, h], opts);
        Self { session: Vec::new(), embedding, layers, norm: Tensor::ones([h], opts), cfg }
    }

    /// Run `ids` [B, L] after the cached positions (causally), extending `cache`: the output of
    /// every layer [B, L, H] each (the last one's after the final norm), and the logits [B, L, V].
    fn run(&self, ids: &Tensor, cache: &mut Cache) -> (Vec<Tensor>, Tensor) {
        let _guard = tch::no_grad_guard();
        let (b, l) = (ids.size()[0], ids.size()[1]);
        let (h, heads) = (self.cfg.hidden_size as i64, self.cfg.num_attention_heads as i64);
        let split = |x: Tensor| x.view([b, -1, heads, h / heads]).transpose(1, 2);
        cache.resize_with(self.layers.len(), || None);
        let mut x = Tensor::embedding(&self.embedding, ids, -1, false, false);
        let mut outputs = Vec::with_capacity(self.layers.len());
        for (layer, kv) in self.layers.iter().zip(cache.iter_mut()) {
            // 1. Attention over the cached keys and these: query i (at past + i) sees keys <= past + i.
            let xn = x.rms_norm([h], Some(&layer.input_norm), EPS);
            let q = split(xn.linear::<&Tensor>(&layer.q, None));
            let (mut k, mut v) =
                (split(xn.linear::<&Tensor>(&layer.k, None)), split(xn.linear::<&Tensor>(&layer.v, None)));
            if let Some((pk, pv)) = kv.as_ref() {
                k = Tensor::cat(&[pk, &k], 2);
                v = Tensor::cat(&[pv, &v], 2);
            }
            let past = k.size()[2] - l;
            let visible = Tensor::ones([l, past + l], (Kind::Bool, x.device())).tril(past);
            let scores = (q.matmul(&k.transpose(-2, -1)) / ((h / heads) as f64).sqrt())
                .masked_fill(&visible.logical_not(), f64::NEG_INFINITY);
            let attn = scores.softmax(-1, scores.kind()).matmul(&v).transpose(1, 2).reshape([b, l, h]);
            *kv = Some((k, v));
            x = &x + attn.linear::<&Tensor>(&layer.o, None);
            // 2. MLP.
            let xn = x.rms_norm([h], Some(&layer.post_norm), EPS);
            x = &x + xn.linear::<&Tensor>(&layer.up, None).silu().linear::<&Tensor>(&layer.down, None);
            outputs.push(x.shallow_clone());
        }
        // As in transformers' `hidden_states`, the last layer's output is taken after the final
        // norm: the LM head's input.
        let normed = x.rms_norm([h], Some(&self.norm), EPS);
        *outputs.last_mut().expect("at least one layer") = normed.shallow_clone();
        (outputs, normed.matmul(&self.embedding.tr()))
    }

    /// The outputs of `layer_ids`, concatenated on the last dim.
    fn features(&self, outputs: &[Tensor], layer_ids: &[u32]) -> Result<Tensor, PluginError> {
        let picked = layer_ids
            .iter()
            .map(|&i| {
                outputs
                    .get(i as usize)
                    .ok_or_else(|| PluginError::new(format!("layer {i}: the model has {} layers", outputs.len())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Tensor::cat(&picked, -1))
    }
}

impl TargetPlugin for TinyLm {
    fn spec(&self) -> TargetSpec {
        let c = &self.cfg;
        TargetSpec {
            architecture: "tiny_lm".into(),
            num_hidden_layers: c.num_hidden_layers,
            hidden_size: c.hidden_size,
            vocab_size: VOCAB as u32,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_attention_heads,
            head_dim: c.hidden_size / c.num_attention_heads,
            intermediate_size: 2 * c.hidden_size,
            rope_theta: 10000.0,
            rms_norm_eps: EPS,
            bos_token_id: RNone,
            eos_token_id: EOS,
            pad_token_id: RSome(PAD),
            chat_template: CHAT_TEMPLATE.into(),
            source: format!("tiny_lm seed {}", c.seed).into(),
            // Identifies the weights for the host's caches: its seed and sizes make them.
            source_sha256: format!(
                "tiny_lm-{}-{}x{}-{}",
                c.seed, c.num_hidden_layers, c.hidden_size, c.num_attention_heads
            )
            .into(),
        }
    }

    fn tokenizer_json(&self) -> String {
        tokenizer_json()
    }

    fn embedding(&self) -> Tensor {
        self.embedding.shallow_clone()
    }

    fn lm_head(&self) -> Tensor {
        self.embedding.shallow_clone()
    }

    fn forward(
        &mut self,
        input_ids: &Tensor,
        layer_ids: &[u32],
        want_logits: bool,
    ) -> Result<(Tensor, Option<Tensor>), PluginError> {
        let (outputs, logits) = self.run(&input_ids.to_device(self.embedding.device()), &mut Vec::new());
        Ok((self.features(&outputs, layer_ids)?, want_logits.then_some(logits)))
    }

    fn generate(
        &mut self,
        prompts: Vec<Vec<u32>>,
        max_new_tokens: u32,
        stop_tokens: &[u32],
    ) -> Result<Vec<Vec<u32>>, PluginError> {
        let device = self.embedding.device();
        let mut replies = Vec::with_capacity(prompts.len());
        for prompt in prompts {
            let (mut cache, mut reply) = (Vec::new(), Vec::new());
            let mut next: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
            while reply.len() < max_new_tokens as usize && !next.is_empty() {
                let (_, logits) = self.run(&Tensor::from_slice(&next).view([1, -1]).to_device(device), &mut cache);
                let token = logits.get(0).get(-1).argmax(-1, false).int64_value(&[]) as u32;
                reply.push(token);
                next = if stop_tokens.contains(&token) { vec![] } else { vec![token as i64] };
            }
            replies.push(reply);
        }
        Ok(replies)
    }

    fn cache_reset(&mut self) {
        self.session.clear();
    }

    fn cache_extend(&mut self, input_ids: &Tensor, layer_ids: &[u32]) -> Result<(Tensor, Tensor), PluginError> {
        let mut cache = std::mem::take(&mut self.session);
        let (outputs, logits) = self.run(&input_ids.to_device(self.embedding.device()), &mut cache);
        self.session = cache;
        Ok((self.features(&outputs, layer_ids)?, logits))
    }

    fn cache_truncate(&mut self, len: u32) -> Result<(), PluginError> {
        for (k, v) in self.session.iter_mut().flatten() {
            let keep = (len as i64).min(k.size()[2]);
            *k = k.narrow(2, 0, keep);
            *v = v.narrow(2, 0, keep);
        }
        Ok(())
    }
}

/// The name a config gives in `plugin = "..."` (`plugins new` replaces it).
const PLUGIN_NAME: &str = "tiny_lm";

fn info() -> PluginInfo {
    PluginInfo::new(
        PLUGIN_NAME,
        PluginKind::Target,
        env!("CARGO_PKG_VERSION"),
        "tiny byte-level causal LM with seeded weights (template plugin)",
    )
}

/// Checked before any weight is made; what the host needs of the model is in its config.
impl Section for TinyLmConfig {
    fn check(&self, _ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        if self.num_hidden_layers == 0 {
            return Err(PluginError::new("field `num_hidden_layers`: must be >= 1"));
        }
        if self.num_attention_heads == 0 || self.hidden_size % self.num_attention_heads != 0 {
            return Err(PluginError::new(format!(
                "field `hidden_size`: {} is not a multiple of `num_attention_heads` ({})",
                self.hidden_size, self.num_attention_heads
            )));
        }
        let facts = TargetFacts {
            model_type: "tiny_lm".into(),
            num_hidden_layers: self.num_hidden_layers,
            ..TargetFacts::default()
        };
        Ok(SectionCheck { target: RSome(facts), ..SectionCheck::default() })
    }
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: TinyLmConfig = plugin_api::parse_section(config)?;
    cfg.check(ctx)?;
    Ok(PluginInstance::target(TinyLm::random(cfg, ctx.tch_device()?, ctx.tch_kind()?)))
}

plugin_api::declare_plugin!(target_tiny, info, create, section = TinyLmConfig);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_map_to_distinct_printable_characters() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!((byte_char(b'a'), byte_char(b' '), byte_char(b'\n')), ('a', 'Ġ', 'Ċ'));
    }
}
