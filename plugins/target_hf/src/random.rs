//! A decoder with random weights at the shape an HF `config.json` gives (`random_init = true`):
//! benchmarks at real shapes without downloading weights. Weights are drawn on the target's
//! device in its dtype (a Qwen3-8B shape is 16 GB in bf16, too much to draw on the host).

use crate::{
    config::{DecoderConfig, Mixer},
    load::Loaded,
    model::Weights,
};
use plugin_api::tch::{Device, Kind, Tensor};
use std::{collections::HashMap, path::Path};

/// A one-token word-level tokenizer: a random model has no vocabulary to decode into.
const PLACEHOLDER_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;

/// `path`: a config.json, or a folder holding one. A tokenizer.json in that folder is the
/// target's tokenizer (training through the whole pipeline on a dataset needs one that makes
/// sequences of real length); otherwise a placeholder.
pub fn load_random(path: &Path, device: Device, kind: Kind) -> Result<Loaded, String> {
    let cfg = DecoderConfig::read(path)?;
    let tokenizer = tokenizer(path)?;
    let weights = random_weights(&cfg, device, kind);
    Ok(Loaded { cfg, weights, tokenizer, chat_template: String::new() })
}

fn tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    let file = path.join("tokenizer.json");
    if path.is_dir() && file.is_file() {
        return tokenizers::Tokenizer::from_file(&file).map_err(|e| format!("{}: {e}", file.display()));
    }
    PLACEHOLDER_TOKENIZER.parse().map_err(|e| format!("placeholder tokenizer: {e}"))
}

/// Every tensor `Decoder::new` looks up, by its HF name: matrices ~ N(0, 0.02) (HF's
/// initializer_range), norm gains 1 (stored as 0 where the norm scales by 1 + w), biases 0; a
/// Gated DeltaNet layer's conv ~ U(-1/sqrt(K), 1/sqrt(K)) (torch's Conv1d), A = exp(A_log) ~
/// U(0, 16) and dt_bias 1 (transformers' init). Routed experts are drawn already stacked
/// (`experts.gate_up_proj`), as transformers holds them.
pub fn random_weights(cfg: &DecoderConfig, device: Device, kind: Kind) -> Weights {
    let (h, f, v) = (cfg.hidden_size as i64, cfg.intermediate_size as i64, cfg.vocab_size as i64);
    let (nh, nkv, d) = (cfg.num_attention_heads as i64, cfg.num_kv_heads() as i64, cfg.head_dim() as i64);
    let mut t = HashMap::new();
    let mut normal = |name: String, shape: &[i64]| {
        t.insert(name, Tensor::randn(shape, (kind, device)) * 0.02);
    };
    normal("model.embed_tokens.weight".into(), &[v, h]);
    if !cfg.tie_word_embeddings {
        normal("lm_head.weight".into(), &[v, h]);
    }
    let s = cfg.linear();
    let (nv, dv) = (s.value_heads as i64, s.value_dim as i64);
    let conv_channels = s.conv_channels() as i64;
    for (i, mixer) in cfg.mixers().iter().enumerate() {
        let p = format!("model.layers.{i}");
        match mixer {
            Mixer::Attention => {
                let q_rows = if cfg.is_hybrid() { 2 * nh * d } else { nh * d };
                normal(format!("{p}.self_attn.q_proj.weight"), &[q_rows, h]);
                normal(format!("{p}.self_attn.k_proj.weight"), &[nkv * d, h]);
                normal(format!("{p}.self_attn.v_proj.weight"), &[nkv * d, h]);
                normal(format!("{p}.self_attn.o_proj.weight"), &[h, nh * d]);
            }
            Mixer::Linear => {
                let q = format!("{p}.linear_attn");
                normal(format!("{q}.in_proj_qkv.weight"), &[conv_channels, h]);
                normal(format!("{q}.in_proj_z.weight"), &[nv * dv, h]);
                normal(format!("{q}.in_proj_b.weight"), &[nv, h]);
                normal(format!("{q}.in_proj_a.weight"), &[nv, h]);
                normal(format!("{q}.out_proj.weight"), &[h, nv * dv]);
            }
        }
        if cfg.is_sparse_layer(i) {
            let m = cfg.moe().expect("a sparse layer has experts");
            let (e, w) = (m.experts as i64, m.intermediate as i64);
            normal(format!("{p}.mlp.gate.weight"), &[e, h]);
            normal(format!("{p}.mlp.experts.gate_up_proj"), &[e, 2 * w, h]);
            normal(format!("{p}.mlp.experts.down_proj"), &[e, h, w]);
            if let Some(sw) = m.shared_intermediate {
                let sw = sw as i64;
                normal(format!("{p}.mlp.shared_expert.gate_proj.weight"), &[sw, h]);
                normal(format!("{p}.mlp.shared_expert.up_proj.weight"), &[sw, h]);
                normal(format!("{p}.mlp.shared_expert.down_proj.weight"), &[h, sw]);
                normal(format!("{p}.mlp.shared_expert_gate.weight"), &[1, h]);
            }
        } else {
            normal(format!("{p}.mlp.gate_proj.weight"), &[f, h]);
            normal(format!("{p}.mlp.up_proj.weight"), &[f, h]);
            normal(format!("{p}.mlp.down_proj.weight"), &[h, f]);
        }
    }
    // Gains: 1, stored as 0 where the norm multiplies by (1 + w).
    let gain = |shape: &[i64]| {
        if cfg.centred_norms() {
            Tensor::zeros(shape, (kind, device))
        } else {
            Tensor::ones(shape, (kind, device))
        }
    };
    t.insert("model.norm.weight".into(), gain(&[h]));
    for (i, mixer) in cfg.mixers().iter().enumerate() {
        let p = format!("model.layers.{i}");
        t.insert(format!("{p}.input_layernorm.weight"), gain(&[h]));
        t.insert(format!("{p}.post_attention_layernorm.weight"), gain(&[h]));
        match mixer {
            Mixer::Attention => {
                if cfg.qk_norm() {
                    t.insert(format!("{p}.self_attn.q_norm.weight"), gain(&[d]));
                    t.insert(format!("{p}.self_attn.k_norm.weight"), gain(&[d]));
                }
                if cfg.qkv_bias() {
                    for (name, n) in [("q_proj", nh * d), ("k_proj", nkv * d), ("v_proj", nkv * d)] {
                        t.insert(format!("{p}.self_attn.{name}.bias"), Tensor::zeros([n], (kind, device)));
                    }
                }
            }
            Mixer::Linear => {
                let q = format!("{p}.linear_attn");
                let k = s.conv_kernel as i64;
                let bound = (k as f64).powf(-0.5);
                let conv = Tensor::rand([conv_channels, 1, k], (kind, device)) * (2.0 * bound) - bound;
                t.insert(format!("{q}.conv1d.weight"), conv);
                let a = (Tensor::rand([nv], (Kind::Float, device)) * 16.0).clamp_min(1e-4);
                t.insert(format!("{q}.A_log"), a.log());
                t.insert(format!("{q}.dt_bias"), Tensor::ones([nv], (kind, device)));
                t.insert(format!("{q}.norm.weight"), Tensor::ones([dv], (kind, device)));
            }
        }
    }
    Weights { tensors: t, source: "random_init".into() }
}

#[cfg(test)]
mod tests {
    use crate::HfTarget;
    use plugin_api::tch::{Device, Kind, Tensor};

    #[test]
    fn a_random_target_has_the_configs_shape_and_runs() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 50, "eos_token_id": 1}"#;
        std::fs::write(dir.path().join("config.json"), cfg).unwrap();
        let t = HfTarget::random(dir.path(), Device::Cpu, Kind::Float, 1).unwrap();
        assert_eq!((t.spec.num_hidden_layers, t.spec.hidden_size, t.spec.head_dim, t.spec.vocab_size), (3, 32, 16, 50));
        assert_eq!(t.model.lm_head.size(), vec![50, 32]);
        assert!(!t.model.lm_head.equal(&t.model.embed_tokens), "untied head is its own tensor");
        let ids = Tensor::from_slice(&[3i64, 7, 9, 11]).view([1, 4]);
        let (hidden, logits) = t.features(&ids, &[0, 2], true).unwrap();
        assert_eq!(hidden.size(), vec![1, 4, 64]);
        assert_eq!(logits.unwrap().size(), vec![1, 4, 50]);
        assert!(hidden.isfinite().all().int64_value(&[]) == 1 && hidden.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }

    #[test]
    fn a_tokenizer_json_beside_the_config_is_the_random_targets_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "eos_token_id": 1}"#;
        std::fs::write(dir.path().join("config.json"), cfg).unwrap();
        let text = "<|im_start|>user b a c<|im_end|>";
        // Without one, the placeholder reads the whole text as one unknown token.
        let t = HfTarget::random(dir.path(), Device::Cpu, Kind::Float, 1).unwrap();
        assert_eq!(t.tokenizer.encode(text, false).unwrap().get_ids(), &[0]);
        let tok = r#"{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 1, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true}, {"id": 2, "content": "<|im_end|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4},
                "unk_token": "<unk>"}}"#;
        std::fs::write(dir.path().join("tokenizer.json"), tok).unwrap();
        let t = HfTarget::random(dir.path(), Device::Cpu, Kind::Float, 1).unwrap();
        assert_eq!(t.tokenizer.encode(text, false).unwrap().get_ids(), &[1, 0, 4, 3, 0, 2]);
        // A config.json named directly keeps the placeholder: the folder may hold other models' files.
        let t = HfTarget::random(&dir.path().join("config.json"), Device::Cpu, Kind::Float, 1).unwrap();
        assert_eq!(t.tokenizer.encode(text, false).unwrap().get_ids(), &[0]);
        // A broken one is an error naming the file, not a silent placeholder.
        std::fs::write(dir.path().join("tokenizer.json"), "{").unwrap();
        let err = HfTarget::random(dir.path(), Device::Cpu, Kind::Float, 1).err().expect("a broken tokenizer.json");
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
