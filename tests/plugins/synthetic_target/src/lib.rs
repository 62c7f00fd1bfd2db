//! A synthetic target ("synthetic") for pipeline tests: a word-level ChatML tokenizer, random
//! tied embeddings, features that are the embeddings scaled per layer, `forward_ms` of sleep per
//! forward (a stage with a set time), and a deliberate error or panic at forward
//! `fail_at_forward` (counted per worker instance), or a panic in the value-returning method
//! `panic_in` names (`spec`, `tokenizer_json`). Its section check says how many layers it has
//! and it counts its FLOPs, wrongly on request (`wrong_facts`, `flat_flops`: what `plugins
//! check` names).

use plugin_api::{
    abi_stable::std_types::{RNone, RSome, RString},
    describe::{FlopsPart, FlopsQuery, SectionCheck, TargetFacts},
    serde::Deserialize,
    tch::{Device, Kind, Tensor},
    Describe, HostContext, PluginError, PluginInfo, PluginInstance, PluginKind, Section, TargetPlugin, TargetSpec,
};

#[derive(Debug, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
struct Config {
    /// Feature width.
    #[serde(default = "default_hidden")]
    hidden_size: u32,
    /// Layers.
    #[serde(default = "default_layers")]
    num_hidden_layers: u32,
    /// Sleep per forward, in milliseconds.
    #[serde(default)]
    forward_ms: u64,
    /// 0 = never.
    #[serde(default)]
    fail_at_forward: u64,
    /// Fail by panicking instead of returning an error.
    #[serde(default)]
    panic: bool,
    /// A value-returning method that panics.
    #[serde(default)]
    panic_in: String,
    /// The section check says one layer more than the target has.
    #[serde(default)]
    wrong_facts: bool,
    /// The FLOPs counted the same whatever the layers.
    #[serde(default)]
    flat_flops: bool,
}

impl Section for Config {
    fn check(&self, _ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        let layers = self.num_hidden_layers + u32::from(self.wrong_facts);
        let facts = TargetFacts { model_type: "synthetic".into(), num_hidden_layers: layers, ..TargetFacts::default() };
        Ok(SectionCheck { target: RSome(facts), ..SectionCheck::default() })
    }

    /// A multiply-add per feature a layer (the features are scaled embeddings), and the head.
    fn target_flops(&self, _ctx: &HostContext, q: FlopsQuery) -> Result<Option<Vec<FlopsPart>>, PluginError> {
        let tokens = f64::from(q.batch) * f64::from(q.seq_len);
        let layers = if self.flat_flops { 1.0 } else { f64::from(q.layers) };
        let h = f64::from(self.hidden_size);
        let head = if q.logits { 2.0 * tokens * h * vocab().len() as f64 } else { 0.0 };
        let part = |name: &str, flop: f64| FlopsPart { name: name.into(), flop };
        Ok(Some(vec![part("layers", 2.0 * tokens * h * layers), part("head", head)]))
    }
}

fn default_hidden() -> u32 {
    64
}
fn default_layers() -> u32 {
    4
}

const SPECIALS: [&str; 3] = ["<unk>", "<|im_start|>", "<|im_end|>"];
const WORDS: &str = "user assistant system i you the a to is it and of what do are how that in my me have for not this be with so but what's can your like no yes hi hello good ok well know think just really";

fn vocab() -> Vec<String> {
    SPECIALS.iter().map(|s| s.to_string()).chain(WORDS.split(' ').map(String::from)).collect()
}

fn tokenizer_json() -> String {
    let vocab = vocab();
    let added: Vec<String> = (0..SPECIALS.len())
        .map(|i| format!(r#"{{"id":{i},"content":"{}","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}"#, vocab[i]))
        .collect();
    let entries: Vec<String> = vocab.iter().enumerate().map(|(i, w)| format!(r#""{w}":{i}"#)).collect();
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{}],"normalizer":{{"type":"Lowercase"}},"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{{}}},"unk_token":"<unk>"}}}}"#,
        added.join(","),
        entries.join(",")
    )
}

struct Synthetic {
    cfg: Config,
    embedding: Tensor,
    forwards: u64,
}

impl Synthetic {
    fn make_spec(&self) -> TargetSpec {
        TargetSpec {
            architecture: "synthetic".into(),
            num_hidden_layers: self.cfg.num_hidden_layers,
            hidden_size: self.cfg.hidden_size,
            vocab_size: vocab().len() as u32,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: self.cfg.hidden_size / 4,
            intermediate_size: self.cfg.hidden_size * 2,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
            bos_token_id: RNone,
            eos_token_id: 2,
            pad_token_id: RNone,
            chat_template: RString::new(),
            source: "synthetic".into(),
            source_sha256: format!("synthetic-{}-{}", self.cfg.hidden_size, self.cfg.num_hidden_layers).into(),
        }
    }
}

impl Synthetic {
    fn maybe_panic(&self, method: &str) {
        if self.cfg.panic_in == method {
            panic!("deliberate panic in {method}");
        }
    }
}

impl TargetPlugin for Synthetic {
    fn spec(&self) -> TargetSpec {
        self.maybe_panic("spec");
        self.make_spec()
    }

    fn tokenizer_json(&self) -> String {
        self.maybe_panic("tokenizer_json");
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
        self.forwards += 1;
        if self.cfg.fail_at_forward == self.forwards {
            if self.cfg.panic {
                panic!("deliberate panic at forward {}", self.forwards);
            }
            return Err(PluginError::new(format!("deliberate failure at forward {}", self.forwards)));
        }
        std::thread::sleep(std::time::Duration::from_millis(self.cfg.forward_ms));
        let e = Tensor::embedding(&self.embedding, input_ids, -1, false, false);
        let feats: Vec<Tensor> = layer_ids.iter().map(|&l| &e * (1.0 + l as f64 / 8.0)).collect();
        // Tied head: logits are the embedding's scores.
        let logits = want_logits.then(|| e.matmul(&self.embedding.tr()));
        Ok((Tensor::cat(&feats, -1), logits))
    }

    fn generate(&mut self, _p: Vec<Vec<u32>>, _m: u32, _s: &[u32]) -> Result<Vec<Vec<u32>>, PluginError> {
        Err(PluginError::new("the synthetic target does not generate (set distill = false)"))
    }

    fn cache_reset(&mut self) {}

    fn cache_extend(&mut self, _ids: &Tensor, _layers: &[u32]) -> Result<(Tensor, Tensor), PluginError> {
        Err(PluginError::new("the synthetic target has no KV cache"))
    }

    fn cache_truncate(&mut self, _len: u32) -> Result<(), PluginError> {
        Ok(())
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("synthetic", PluginKind::Target, "0.1.0", "test target: set time per forward, deliberate failures")
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: Config = plugin_api::parse_section(config)?;
    plugin_api::tch::manual_seed(ctx.seed as i64);
    let embedding = Tensor::randn([vocab().len() as i64, cfg.hidden_size as i64], (Kind::Float, Device::Cpu)) * 0.1;
    Ok(PluginInstance::target(Synthetic { cfg, embedding, forwards: 0 }))
}

plugin_api::declare_plugin!(synthetic_target, info, create, section = Config);
