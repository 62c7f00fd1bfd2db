//! The four plugin kinds and the values they exchange.
//!
//! Data flows one way: data loader -> target (no grad, hidden states) -> drafter (block hidden
//! states) -> host loss (shared LM head) -> optimizer. The host owns the schedule, anchors, loss,
//! accumulation and checkpoints; plugins own their math and their config section.
//!
//! Every method returns `RResult<_, PluginError>`: whatever goes wrong in a plugin, a panic
//! included, comes back as the error of the call that failed.
//!
//! Within a major version, methods are only ever appended (below the `last_prefix_field` marker of
//! each trait) so a plugin built against an older minor version keeps loading; changing a method
//! that exists is a new major version.

use crate::{NamedTensor, PluginError, TensorHandle};
use abi_stable::{
    sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
    StableAbi,
};

/// Facts about a loaded target model that the host, drafter and data loader need.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TargetSpec {
    /// `llama`, `qwen2`, `qwen3`.
    pub architecture: RString,
    pub num_hidden_layers: u32,
    pub hidden_size: u32,
    pub vocab_size: u32,
    pub num_attention_heads: u32,
    pub num_key_value_heads: u32,
    pub head_dim: u32,
    pub intermediate_size: u32,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub bos_token_id: ROption<u32>,
    pub eos_token_id: u32,
    pub pad_token_id: ROption<u32>,
    /// Jinja chat template from the checkpoint (empty if none).
    pub chat_template: RString,
    /// Where the weights came from and their SHA-256 (for manifests and caches).
    pub source: RString,
    pub source_sha256: RString,
}

/// The target's forward output.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct TargetOutput {
    /// Features of the requested layers concatenated on the last dim: [B, S, n*H].
    pub hidden: TensorHandle,
    /// Logits [B, S, V], only when asked.
    pub logits: ROption<TensorHandle>,
}

/// The target LLM: frozen, forward only.
#[sabi_trait]
pub trait TargetModel: Send {
    fn spec(&self) -> RResult<TargetSpec, PluginError>;

    /// HF `tokenizer.json` text for the model's tokenizer.
    fn tokenizer_json(&self) -> RResult<RString, PluginError>;

    /// Input embedding matrix [V, H] (frozen; the drafter embeds its blocks with it).
    fn embedding(&self) -> RResult<TensorHandle, PluginError>;

    /// Output head [V, H] (frozen; the drafter's logits go through it).
    fn lm_head(&self) -> RResult<TensorHandle, PluginError>;

    /// Forward over right-padded token ids [B, S] (int64). `layer_ids` pick the features: the
    /// output of layer `id` (HF `hidden_states[id + 1]`).
    fn forward(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
        want_logits: bool,
    ) -> RResult<TargetOutput, PluginError>;

    /// Greedy generation for each prompt (token ids), up to `max_new_tokens` or a stop token
    /// (included in the result).
    fn generate(
        &mut self,
        prompts: RVec<RVec<u32>>,
        max_new_tokens: u32,
        stop_tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<RVec<u32>>, PluginError>;

    // Incremental decoding (speculative-decoding eval): one sequence's KV cache kept inside the
    // target. Added in ABI 1.1.

    /// Empty the cache.
    fn cache_reset(&mut self) -> RResult<(), PluginError>;

    /// Run `input_ids` [1, L] after the cached tokens (causally, at positions len..len+L): their
    /// features [1, L, n*H] and logits [1, L, V]; the cache grows by L.
    fn cache_extend(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
    ) -> RResult<TargetOutput, PluginError>;

    /// Keep the first `len` cached positions (drops rejected draft tokens).
    #[sabi(last_prefix_field)]
    fn cache_truncate(&mut self, len: u32) -> RResult<(), PluginError>;
}

/// One training forward's input for the drafter.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct DraftInput {
    /// Target features [B, S, n*H] of the layers the drafter asked for.
    pub target_hidden: TensorHandle,
    /// Embedded blocks [B, A*Bk, H]: per anchor `[anchor token, MASK x (Bk-1)]`.
    pub block_embeds: TensorHandle,
    /// Anchor positions [B, A] (int64). Block j covers positions `anchors[j] + 0..Bk`.
    pub anchors: TensorHandle,
    /// [B, A] bool: padding anchors are false (their outputs are ignored by the loss).
    pub anchor_valid: TensorHandle,
}

/// The drafter architecture (dense DFlash, GDN hybrid, ...).
#[sabi_trait]
pub trait Drafter: Send {
    /// The checkpoint's `config.json` (z-lab format for DFlash drafters).
    fn config_json(&self) -> RResult<RString, PluginError>;

    /// Target layers whose outputs the drafter reads, in order.
    fn target_layer_ids(&self) -> RResult<RVec<u32>, PluginError>;

    fn block_size(&self) -> RResult<u32, PluginError>;

    fn mask_token_id(&self) -> RResult<u32, PluginError>;

    /// Trainable parameters, named as in the checkpoint. Handles share storage with the model, so
    /// gradients accumulate in them and optimizer updates are seen by the model.
    fn parameters(&self) -> RResult<RVec<NamedTensor>, PluginError>;

    /// Copy weights in by name; every parameter must be present with its shape.
    fn load_weights(&mut self, weights: RVec<NamedTensor>) -> RResult<(), PluginError>;

    /// Block hidden states after the final norm: [B, A*Bk, H]. Each block sees the context
    /// strictly before its anchor and itself (bidirectionally), never another block.
    ///
    /// Usually the output carries its autograd graph and the host's `backward` reaches the
    /// parameters. A drafter that runs its own backward (layer checkpointing, kernels with a
    /// hand-written backward) returns a *leaf* that requires grad instead; the host then calls
    /// [`backward`](Self::backward) with the loss's gradient w.r.t. it.
    #[sabi(last_prefix_field)]
    fn forward(&mut self, input: &DraftInput) -> RResult<TensorHandle, PluginError>;

    /// Accumulate parameter gradients from `grad` = dLoss/d(last forward's output). Called only
    /// when that output was a leaf; a drafter built before this method existed never returns one.
    fn backward(&mut self, grad: &TensorHandle) -> RResult<(), PluginError> {
        let _ = grad;
        RResult::RErr(PluginError::new("this drafter returned a leaf from forward but has no backward"))
    }

    /// The next training `forward`'s anchors [B, A] again, on the CPU, given just before it (ABI
    /// 1.2). A drafter whose kernel shapes depend on where the blocks start (how many context keys
    /// each run of blocks can see) reads them here instead of copying them back from the device,
    /// which would wait for the GPU; others ignore them.
    fn anchors_on_host(&mut self, anchors: &TensorHandle) -> RResult<(), PluginError> {
        let _ = anchors;
        RResult::ROk(())
    }

    /// One speculative-decoding draft of one sequence, the drafter keeping its context between
    /// calls (ABI 1.5): see [`DecodeInput`]. Returns the block's hidden states [1, Bk, H], what
    /// `forward` gives over the whole context, or None when the drafter keeps no context (the
    /// host then calls `forward` with all of it, as before this method existed).
    fn decode_block(&mut self, input: &DecodeInput) -> RResult<ROption<TensorHandle>, PluginError> {
        let _ = input;
        RResult::ROk(ROption::RNone)
    }
}

/// A decoding draft's input: what the target verified since the last call, and the next block.
/// A drafter's context is only ever verified positions, so it grows and is never cut.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct DecodeInput {
    /// Target features [1, n, L*H] of positions `context_start..context_start + n`.
    pub new_context: TensorHandle,
    /// Positions the drafter already holds for this sequence; 0 starts a new one (what it held
    /// is dropped). Any other value must equal what it holds.
    pub context_start: u32,
    /// The block `[anchor, MASK x (Bk-1)]` embedded [1, Bk, H], its anchor at position
    /// `context_start + n`.
    pub block_embeds: TensorHandle,
}

/// The optimizer: owns per-parameter state, updates parameters in place from their `.grad`.
#[sabi_trait]
pub trait Optimizer: Send {
    /// The parameters to update, once, before the first step.
    fn init(&mut self, params: RVec<NamedTensor>) -> RResult<(), PluginError>;

    /// One update. `lr_scale` is the host's schedule factor (warm-up, decay) in [0, 1]; the
    /// optimizer multiplies its configured learning rate(s) by it.
    fn step(&mut self, lr_scale: f64) -> RResult<(), PluginError>;

    /// The peak learning rate, for logging.
    fn base_lr(&self) -> RResult<f64, PluginError>;

    /// State to checkpoint, named `<param name>.<slot>` plus scalars like `step`.
    fn state(&self) -> RResult<RVec<NamedTensor>, PluginError>;

    #[sabi(last_prefix_field)]
    fn load_state(&mut self, state: RVec<NamedTensor>) -> RResult<(), PluginError>;

    /// Data-parallel replicas (ABI 1.3): the host lends its collectives once, before `init`, when
    /// the run has more than one rank. An optimizer may split its work across the ranks with them
    /// (distributed Muon: each rank orthogonalises its share of the matrices, then the updates are
    /// all-gathered). One that ignores them runs replicated: every rank does the whole step on
    /// the same summed gradients, with the same result.
    fn set_collectives(&mut self, collectives: CollectivesBox) -> RResult<(), PluginError> {
        let _ = collectives;
        RResult::ROk(())
    }

    /// The state by parameter and [`role`](crate::roles) (ABI 2.1), for a fork that carries it to
    /// another optimizer. None: this optimizer does not export its state so (one built before 2.1
    /// never does).
    fn export_state(&self) -> RResult<ROption<ExportedState>, PluginError> {
        RResult::ROk(ROption::RNone)
    }

    /// Take over another optimizer's exported state (ABI 2.1), after `init`: each role that maps
    /// onto this optimizer's state, by parameter name; a parameter not in `state` keeps its fresh
    /// state. Returns what was taken and what was not; None: this optimizer cannot import.
    fn import_state(&mut self, state: ExportedState) -> RResult<ROption<ImportReport>, PluginError> {
        let _ = state;
        RResult::ROk(ROption::RNone)
    }
}

/// An optimizer's state by parameter and role (ABI 2.1): what `export_state` gives and
/// `import_state` takes. The checkpoint format (`state`) is each optimizer's own; this is what
/// two optimizers have in common.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct ExportedState {
    /// Updates taken so far (what bias corrections count from); None when it means nothing to
    /// this optimizer.
    pub step: ROption<u64>,
    pub params: RVec<ParamState>,
}

/// One parameter's state tensors, each named by its [`role`](crate::roles).
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct ParamState {
    /// The parameter's name, as `init` gave it.
    pub param: RString,
    /// Tensors of the parameter's shape, `name` = the role.
    pub roles: RVec<NamedTensor>,
}

/// What `import_state` took over (ABI 2.1).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct ImportReport {
    /// Roles taken, each with the number of parameters it was taken for.
    pub used: RVec<RoleCount>,
    /// Roles given but not taken (nothing of this optimizer's maps onto them), likewise.
    pub ignored: RVec<RoleCount>,
    /// Whether the step count was taken.
    pub step: bool,
    /// What the optimizer made up where nothing mapped, one line each (`second_moment seeded from
    /// first_moment for 6 parameters`).
    pub notes: RVec<RString>,
}

#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct RoleCount {
    pub role: RString,
    pub params: u64,
}

/// Collectives across the data-parallel replicas (ABI 1.3), lent by the host (libtorch's c10d:
/// Gloo for CPU tensors, NCCL for CUDA tensors). Every rank must make the same calls in the
/// same order; a call fails, never hangs, when a rank is gone.
#[sabi_trait]
pub trait Collectives: Send {
    /// This process's rank, 0..world.
    fn rank(&self) -> u32;

    fn world(&self) -> u32;

    /// Every rank's `input` into `outputs[rank]`, in place: `world` contiguous tensors of the
    /// input's shape, dtype and device.
    #[sabi(last_prefix_field)]
    fn all_gather(&mut self, outputs: RSlice<'_, TensorHandle>, input: &TensorHandle) -> RResult<(), PluginError>;
}

/// A batch of token sequences, right-padded.
#[repr(C)]
#[derive(StableAbi, Debug)]
pub struct Batch {
    /// [B, S] int64.
    pub input_ids: TensorHandle,
    /// [B, S] int64, 1 on tokens the drafter learns to predict (responses), 0 elsewhere.
    pub loss_mask: TensorHandle,
    /// Unpadded length of each sequence.
    pub lengths: RVec<u32>,
    /// A stable id per sequence (same tokens, same id, every epoch), so the host can cache the
    /// target's features across epochs.
    pub sequence_ids: RVec<u64>,
}

/// Where a data loader is, for resume.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataPosition {
    pub epoch: u64,
    /// Sequences consumed in this epoch.
    pub index: u64,
}

/// What a data loader holds after `open`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct DataSummary {
    pub sequences: u64,
    pub tokens: u64,
    pub loss_tokens: u64,
    /// Records skipped as malformed (when the config allows skipping).
    pub skipped: u64,
    pub description: RString,
}

/// Prompts for the target to answer greedily; their replies replace the dataset's.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Default)]
pub struct DistillRequest {
    /// Token ids, each ending with the generation prompt.
    pub prompts: RVec<RVec<u32>>,
    pub max_new_tokens: u32,
    /// Tokens that end a reply (kept in it), e.g. `<|im_end|>`.
    pub stop_tokens: RVec<u32>,
}

/// How the target answers a [`DistillRequest`] (ABI 1.4). The default is what a data loader
/// built before 1.3 gets: greedy replies.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct DistillOptions {
    /// 0 = greedy; otherwise softmax sampling at this temperature.
    pub temperature: f64,
    /// Seeds the sampling, per prompt (so a reply does not depend on what it is batched with).
    pub seed: u64,
    /// Replies the whole self-distillation regenerates, over all its requests (at most; 0 =
    /// unknown), for the progress bar.
    pub replies_total: u64,
}

impl Default for DistillOptions {
    fn default() -> Self {
        DistillOptions { temperature: 0.0, seed: 0, replies_total: 0 }
    }
}

/// What [`DataLoader::export_distilled_summary`] wrote and what it did not (ABI 1.7), so the
/// host's summary accounts for every reply it generated.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq)]
pub struct DistilledExport {
    /// Records written.
    pub records: u64,
    /// Of the replies the target generated, those in records not written (a validation split's).
    pub replies_not_written: u64,
    /// Each kind of record not written: how many, what they are and why, e.g. `2 validation
    /// records with their 2 replies (held out: never trained on)`.
    pub not_written: RVec<RString>,
}

/// The data loader: records -> tokenized, masked, shuffled batches.
#[sabi_trait]
pub trait DataLoader: Send {
    /// Read and tokenize with the target's tokenizer (`tokenizer.json` text).
    fn open(&mut self, tokenizer_json: RStr<'_>) -> RResult<DataSummary, PluginError>;

    /// Self-distillation: prompts whose replies the target regenerates (none when it is off, or
    /// when every reply has arrived). The host asks again after each `set_distilled`: a loader
    /// that regenerates several turns of a conversation asks for them one round at a time.
    fn distill_request(&self) -> RResult<DistillRequest, PluginError>;

    /// The regenerated replies, in `distill_request` order.
    fn set_distilled(&mut self, replies: RVec<RVec<u32>>) -> RResult<DataSummary, PluginError>;

    /// The next batch, or None at the end of an epoch; the call after that starts the next epoch,
    /// shuffled anew from the seed and the epoch number.
    fn next_batch(&mut self) -> RResult<ROption<Batch>, PluginError>;

    fn position(&self) -> RResult<DataPosition, PluginError>;

    fn seek(&mut self, position: DataPosition) -> RResult<(), PluginError>;

    /// Evaluation prompts, never trained on (ABI 1.1): `source` is `holdout` (records the config
    /// holds out: the test prompts), `validation` (the prompts of [`validation_batches`]'s
    /// sequences, ABI 1.6), a named set the plugin knows (`humaneval` for data_chat) or a chat
    /// JSONL file; each ends with the generation prompt; at most `limit`.
    ///
    /// [`validation_batches`]: Self::validation_batches
    #[sabi(last_prefix_field)]
    fn eval_prompts(&mut self, source: RStr<'_>, limit: u32) -> RResult<RVec<RVec<u32>>, PluginError>;

    /// How to answer `distill_request`'s prompts (ABI 1.4): sampling temperature and seed, and
    /// the number of replies to expect.
    fn distill_options(&self) -> RResult<DistillOptions, PluginError> {
        RResult::ROk(DistillOptions::default())
    }

    /// After self-distillation, write the records as chat JSONL (OpenAI `messages`) with the
    /// target's replies as their text (ABI 1.4); returns the number of records written.
    fn export_distilled(&self, path: RStr<'_>) -> RResult<u64, PluginError> {
        let _ = path;
        RResult::RErr(PluginError::new("this data loader cannot export its self-distilled replies"))
    }

    /// The validation split as batches (ABI 1.6): sequences never trained on, disjoint from the
    /// `holdout` evaluation prompts, the same batches in the same order at every call (after
    /// self-distillation, like `next_batch`). Their prompts are `eval_prompts("validation")`.
    /// Empty when the loader has none, as for a loader built before this method existed.
    fn validation_batches(&mut self) -> RResult<RVec<Batch>, PluginError> {
        RResult::ROk(RVec::new())
    }

    /// [`export_distilled`](Self::export_distilled), and an account of what was not written
    /// (ABI 1.7). A loader built before this method gives the count alone.
    fn export_distilled_summary(&self, path: RStr<'_>) -> RResult<DistilledExport, PluginError> {
        self.export_distilled(path).map(|records| DistilledExport { records, ..DistilledExport::default() })
    }
}

pub type TargetBox = TargetModel_TO<'static, RBox<()>>;
pub type DrafterBox = Drafter_TO<'static, RBox<()>>;
pub type OptimizerBox = Optimizer_TO<'static, RBox<()>>;
pub type DataLoaderBox = DataLoader_TO<'static, RBox<()>>;
pub type CollectivesBox = Collectives_TO<'static, RBox<()>>;
