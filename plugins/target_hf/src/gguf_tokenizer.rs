//! A HF `tokenizers` tokenizer rebuilt from the vocabulary a GGUF carries (llama.cpp's
//! `tokenizer.ggml.*` keys), for byte-level BPE models (`tokenizer.ggml.model` = "gpt2").
//!
//! The pieces mirror the model's own tokenizer.json: BPE over the GGUF tokens and merges, the
//! pre-tokenizer chosen by `tokenizer.ggml.pre`, a ByteLevel decoder, control / user-defined
//! tokens as special added tokens, and no post-processor (no BOS is added; chat templates
//! spell out their own special tokens).

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::gguf::{GgufError, GgufFile};

/// llama.cpp token types (gguf TokenType) that become special added tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Qwen2's split regex, from its tokenizer.json.
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split regex: as Qwen2's but numbers in runs of up to 3 digits.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How the HF tokenizer.json of a `tokenizer.ggml.pre` family prepares text for BPE.
struct PreConfig {
    /// The split regex; None = ByteLevel's own GPT-2 regex.
    regex: Option<&'static str>,
    /// Split every digit off first (HF `Digits(individual_digits=true)`).
    digits: bool,
    /// Unicode NFC normalisation first (Qwen2's tokenizer.json has it).
    nfc: bool,
    /// BPE `ignore_merges`: a word that is itself a token is not merged up (Llama 3).
    ignore_merges: bool,
}

/// The `tokenizer.ggml.pre` values whose HF equivalent is known. Names are llama.cpp's; the
/// digit group shares llama.cpp's `\p{N}` + GPT-2 regex split.
fn pre_config(pre: &str) -> Option<PreConfig> {
    let (regex, digits, nfc, ignore_merges) = match pre {
        "gpt-2" => (None, false, false, false),
        "smollm" | "starcoder" | "refact" | "codeshell" => (None, true, false, false),
        "qwen2" | "deepseek-r1-qwen" => (Some(QWEN2_REGEX), false, true, false),
        "llama-bpe" | "llama3" | "llama-v3" => (Some(LLAMA3_REGEX), false, false, true),
        _ => return None,
    };
    Some(PreConfig { regex, digits, nfc, ignore_merges })
}

const KNOWN_PRE: &str =
    "gpt-2, smollm, starcoder, refact, codeshell, qwen2, deepseek-r1-qwen, llama-bpe, llama3, llama-v3";

fn tok_err(g: &GgufFile, what: impl Into<String>) -> GgufError {
    GgufError::Tokenizer { path: g.path().to_path_buf(), what: what.into() }
}

/// Builds the byte-level BPE tokenizer a "gpt2"-model GGUF describes.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer, GgufError> {
    // 1. Which tokenizer.
    let model = g.meta_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(tok_err(
            g,
            format!("tokenizer.ggml.model is {model:?}; only \"gpt2\" (byte-level BPE) is supported"),
        ));
    }
    let pre = g.meta_str("tokenizer.ggml.pre")?;
    let cfg = pre_config(pre)
        .ok_or_else(|| tok_err(g, format!("unknown tokenizer.ggml.pre {pre:?} (known: {KNOWN_PRE})")))?;

    // 2. Vocabulary, merges and token types.
    let tokens = g.meta_str_array("tokenizer.ggml.tokens")?;
    let types = g.meta_i32_array("tokenizer.ggml.token_type")?;
    if types.len() != tokens.len() {
        return Err(tok_err(g, format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, &tok) in tokens.iter().enumerate() {
        if let Some(first) = vocab.insert(tok.to_string(), id as u32) {
            return Err(tok_err(g, format!("token {tok:?} appears twice (ids {first} and {id})")));
        }
    }
    // Merges are "left right"; byte-level tokens never hold a real space (it is "Ġ").
    let merges = g
        .meta_str_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(tok_err(g, format!("merge #{i} {m:?} is not two tokens separated by a space"))),
        })
        .collect::<Result<Vec<_>, _>>()?;

    // 3. Model.
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(cfg.ignore_merges)
        .build()
        .map_err(|e| tok_err(g, format!("BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);

    // 4. Normaliser and pre-tokenizer. ByteLevel runs its GPT-2 regex only when no split
    //    regex came first.
    if cfg.nfc {
        tok.with_normalizer(Some(NFC));
    }
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    if cfg.digits {
        steps.push(Digits::new(true).into());
    }
    if let Some(re) = cfg.regex {
        let split = Split::new(SplitPattern::Regex(re.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| tok_err(g, format!("split regex: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, true, cfg.regex.is_none()).into());
    tok.with_pre_tokenizer(Some(Sequence::new(steps)));
    // The decoder maps the byte-level characters back to bytes; its flags do not matter there.
    tok.with_decoder(Some(ByteLevel::default()));

    // 5. Control and user-defined tokens are matched whole, before any splitting.
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(&t, _)| AddedToken::from(t.to_string(), true))
        .collect();
    tok.add_special_tokens(&special);
    Ok(tok)
}

/// BOS / EOS / padding token ids, each None when the GGUF does not set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    /// From `tokenizer.ggml.{bos,eos,padding}_token_id`; a present key of a wrong type errors.
    pub fn from_gguf(g: &GgufFile) -> Result<SpecialIds, GgufError> {
        let id = |key: &str| match g.get(key) {
            None => Ok(None),
            Some(_) => g.meta_u32(key).map(Some),
        };
        Ok(SpecialIds {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
        })
    }
}

/// The Jinja chat template (`tokenizer.chat_template`), if the GGUF has one.
pub fn chat_template(g: &GgufFile) -> Option<String> {
    g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::{gguf_bytes, smollm_path, write_temp, W};

    /// A tiny "gpt2" vocabulary: ids 0 <|end|> (control), 1 a, 2 b, 3 Ġ, 4 1, 5 2, 6 ab, 7 Ġab.
    fn tiny(model: &'static str, pre: &'static str) -> Vec<u8> {
        let toks = ["<|end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab"];
        let types = [3, 1, 1, 1, 1, 1, 1, 1];
        gguf_bytes(
            &[
                ("tokenizer.ggml.model", W::str(model)),
                ("tokenizer.ggml.pre", W::str(pre)),
                ("tokenizer.ggml.tokens", W::Arr(8, toks.iter().map(|t| W::str(t)).collect())),
                ("tokenizer.ggml.token_type", W::Arr(5, types.iter().map(|&t| W::I32(t)).collect())),
                ("tokenizer.ggml.merges", W::Arr(8, vec![W::str("a b"), W::str("Ġ ab")])),
                ("tokenizer.ggml.bos_token_id", W::U32(0)),
                ("tokenizer.ggml.eos_token_id", W::U32(0)),
                ("tokenizer.chat_template", W::str("{{ messages }}")),
            ],
            &[],
            32,
        )
    }

    fn open_tiny(dir: &tempfile::TempDir, model: &'static str, pre: &'static str) -> GgufFile {
        GgufFile::open(write_temp(dir, "tok.gguf", &tiny(model, pre))).unwrap()
    }

    #[test]
    fn tiny_vocab_encodes_for_each_pre_family() {
        let dir = tempfile::tempdir().unwrap();
        for pre in ["smollm", "qwen2", "gpt-2", "llama-bpe"] {
            let g = open_tiny(&dir, "gpt2", pre);
            let tok = tokenizer_from_gguf(&g).unwrap();
            let text = "ab ab12<|end|>";
            let enc = tok.encode(text, false).unwrap();
            // "ab" | " ab" -> "Ġab" | "1" | "2" | the control token, matched whole.
            assert_eq!(enc.get_ids(), &[6, 7, 4, 5, 0], "pre {pre}");
            assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text, "pre {pre}");
            assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "ab ab12", "pre {pre}");
        }
    }

    #[test]
    fn tiny_special_ids_and_template() {
        let dir = tempfile::tempdir().unwrap();
        let g = open_tiny(&dir, "gpt2", "smollm");
        assert_eq!(SpecialIds::from_gguf(&g).unwrap(), SpecialIds { bos: Some(0), eos: Some(0), pad: None });
        assert_eq!(chat_template(&g).as_deref(), Some("{{ messages }}"));
    }

    #[test]
    fn unknown_model_or_pre_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = tokenizer_from_gguf(&open_tiny(&dir, "gpt2", "mystery-pre")).unwrap_err().to_string();
        assert!(e.contains("tok.gguf") && e.contains("unknown tokenizer.ggml.pre \"mystery-pre\""), "{e}");
        let e = tokenizer_from_gguf(&open_tiny(&dir, "llama", "smollm")).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.model is \"llama\""), "{e}");
    }

    // --- the real model ---

    fn smollm() -> (GgufFile, Tokenizer) {
        let g = GgufFile::open(smollm_path()).unwrap();
        let tok = tokenizer_from_gguf(&g).unwrap();
        (g, tok)
    }

    #[test]
    fn smollm_special_tokens() {
        let (g, tok) = smollm();
        assert_eq!(g.meta_str("tokenizer.ggml.pre").unwrap(), "smollm");
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(tok.get_vocab_size(true), 49152);
        let enc = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
        let ids = enc.get_ids();
        assert_eq!((ids[0], ids[ids.len() - 1]), (1, 2), "{ids:?}");
        assert_eq!(enc.get_tokens()[0], "<|im_start|>");
        assert_eq!(tok.decode(ids, true).unwrap(), "user\nHi");

        let sp = SpecialIds::from_gguf(&g).unwrap();
        assert!(sp.bos.is_some() && sp.eos.is_some(), "{sp:?}");
        assert!(chat_template(&g).unwrap().contains("<|im_start|>"));
    }

    #[test]
    fn smollm_round_trips_and_splits_digits() {
        let (_, tok) = smollm();
        for s in [
            "Hello, world!",
            "12345",
            "café 日本",
            "line one\nline two\n\n  indented",
            "   leading spaces",
            "tabs\tand trailing space ",
            "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n",
        ] {
            let ids = tok.encode(s, false).unwrap().get_ids().to_vec();
            assert_eq!(tok.decode(&ids, false).unwrap(), s, "ids {ids:?}");
        }

        let digit = |d: &str| tok.token_to_id(d).unwrap();
        let ids = tok.encode("12345", false).unwrap().get_ids().to_vec();
        assert_eq!(ids, ["1", "2", "3", "4", "5"].map(digit));

        // Ids SmolLM2's HF tokenizer gives (as published alongside a public GGUF tokenizer
        // port); in the first the space before the digits stands alone ("Ġ" = 216).
        for (s, want) in [
            ("Hello world! 123", &[19556, 905, 17, 216, 33, 34, 35][..]),
            ("Café déjà vu.", &[51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]),
            ("  multiple   spaces", &[216, 2701, 256, 5600]),
            ("\n", &[198]),
        ] {
            assert_eq!(tok.encode(s, false).unwrap().get_ids(), want, "{s:?}");
        }
    }
}
