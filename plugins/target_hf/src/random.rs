//! A decoder with random weights at the shape an HF `config.json` gives (`random_init = true`):
//! benchmarks at real shapes without downloading weights. Weights are drawn on the target's
//! device in its dtype (a Qwen3-8B shape is 16 GB in bf16, too much to draw on the host), each
//! when the decoder looks it up, so every family gets its own tensors without a list here.

use crate::{
    config::DecoderConfig,
    model::Decoder,
    weights::{Loader, Weights},
};
use plugin_api::tch::{Device, Kind};
use std::{collections::HashMap, path::Path};
use tokenizers::Tokenizer;

/// A one-token word-level tokenizer: a random model has no vocabulary to decode into.
const PLACEHOLDER_TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;

/// `path`: a config.json, or a folder holding one. A tokenizer.json in that folder is the
/// target's tokenizer (training through the whole pipeline on a dataset needs one that makes
/// sequences of real length); otherwise a placeholder. The weights are drawn as the decoder looks
/// them up ([`Decoder::random_shard`]), on the target's device in its dtype.
pub fn config_and_tokenizer(path: &Path) -> Result<(DecoderConfig, Tokenizer), String> {
    Ok((DecoderConfig::read(path)?, tokenizer(path)?))
}

fn tokenizer(path: &Path) -> Result<Tokenizer, String> {
    let file = path.join("tokenizer.json");
    if path.is_dir() && file.is_file() {
        return Tokenizer::from_file(&file).map_err(|e| format!("{}: {e}", file.display()));
    }
    PLACEHOLDER_TOKENIZER.parse().map_err(|e| format!("placeholder tokenizer: {e}"))
}

/// Every tensor `Decoder::new` looks up for `cfg`, by its HF name, drawn by [`draw`] (routed
/// experts drawn already stacked, `experts.gate_up_proj`, as transformers holds them). For
/// tests that write a random checkpoint; builds the decoder once on the way.
pub fn random_weights(cfg: &DecoderConfig, device: Device, kind: Kind) -> Weights {
    let mut empty = Weights::in_memory(HashMap::new(), "random_init");
    let mut ld = Loader { random: true, drawn: Some(HashMap::new()), ..Loader::new(&mut empty, device, kind) };
    Decoder::build(cfg, &mut ld).expect("a valid config builds");
    Weights::in_memory(ld.drawn.take().unwrap_or_default(), "random_init")
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
