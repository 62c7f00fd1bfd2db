//! Writing a plugin in plain Rust.
//!
//! An author implements one of [`TargetPlugin`], [`DrafterPlugin`], [`OptimizerPlugin`] or
//! [`DataLoaderPlugin`] with std types and tch tensors, returns it from `create` through
//! [`PluginInstance::optimizer`] (or `target`, `drafter`, `data_loader`), and declares the crate
//! once with [`declare_plugin!`](crate::declare_plugin). Everything abi_stable needs is generated
//! here: each author trait has a blanket implementation of its ABI trait ([`crate::Optimizer`]
//! and the others) that converts the values and contains panics.
//!
//! Errors and panics. Every ABI method returns a result, so whatever goes wrong reaches the
//! host as the error of the call that failed, which the host reports with the plugin and the
//! method named. No panic unwinds into the host: the instance the host holds is the author's
//! value inside a [`Contained`], which turns a panic into `Err("panicked: <message>")` and refuses
//! every later call on that instance (the panic may have left it half-updated).

use crate::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{ROption, RResult, RSlice, RStr, RString, RVec},
    },
    CollectivesBox, DataLoader, DataLoader_TO, DataPosition, DataSummary, DecodeInput, DistillOptions, DistillRequest,
    DistilledExport, DraftInput, Drafter, Drafter_TO, ExportedState, ImportReport, NamedTensor, Optimizer,
    Optimizer_TO, ParamState, PluginError, PluginInstance, RoleCount, TargetModel, TargetModel_TO, TargetOutput,
    TargetSpec, TensorHandle,
};
use std::{collections::BTreeMap, sync::OnceLock};
use tch::Tensor;

/// The target LLM: frozen, forward only (the ABI's [`TargetModel`], in plain Rust).
pub trait TargetPlugin: Send + 'static {
    fn spec(&self) -> TargetSpec;

    /// HF `tokenizer.json` text for the model's tokenizer.
    fn tokenizer_json(&self) -> String;

    /// Input embedding matrix [V, H].
    fn embedding(&self) -> Tensor;

    /// Output head [V, H].
    fn lm_head(&self) -> Tensor;

    /// Forward over right-padded token ids [B, S] (int64): the features of `layer_ids` (the
    /// output of layer `id`, HF `hidden_states[id + 1]`) concatenated on the last dim [B, S, n*H],
    /// and the logits [B, S, V] when `want_logits`.
    fn forward(
        &mut self,
        input_ids: &Tensor,
        layer_ids: &[u32],
        want_logits: bool,
    ) -> Result<(Tensor, Option<Tensor>), PluginError>;

    /// Greedy generation for each prompt, up to `max_new_tokens` or a stop token (included).
    fn generate(
        &mut self,
        prompts: Vec<Vec<u32>>,
        max_new_tokens: u32,
        stop_tokens: &[u32],
    ) -> Result<Vec<Vec<u32>>, PluginError>;

    /// Empty the incremental-decoding cache.
    fn cache_reset(&mut self);

    /// Run `input_ids` [1, L] after the cached tokens: their features [1, L, n*H] and logits
    /// [1, L, V]; the cache grows by L.
    fn cache_extend(&mut self, input_ids: &Tensor, layer_ids: &[u32]) -> Result<(Tensor, Tensor), PluginError>;

    /// Keep the first `len` cached positions.
    fn cache_truncate(&mut self, len: u32) -> Result<(), PluginError>;
}

/// One training forward's input for the drafter (the ABI's [`DraftInput`] as tensors).
pub struct DrafterInput {
    /// Target features [B, S, n*H].
    pub target_hidden: Tensor,
    /// Embedded blocks [B, A*Bk, H]: per anchor `[anchor token, MASK x (Bk-1)]`.
    pub block_embeds: Tensor,
    /// Anchor positions [B, A] (int64).
    pub anchors: Tensor,
    /// [B, A] bool: padding anchors are false.
    pub anchor_valid: Tensor,
}

impl DrafterInput {
    pub fn from_abi(input: &DraftInput) -> Self {
        Self {
            target_hidden: input.target_hidden.tensor(),
            block_embeds: input.block_embeds.tensor(),
            anchors: input.anchors.tensor(),
            anchor_valid: input.anchor_valid.tensor(),
        }
    }
}

/// The drafter architecture (the ABI's [`Drafter`], in plain Rust).
pub trait DrafterPlugin: Send + 'static {
    /// The checkpoint's `config.json`.
    fn config_json(&self) -> String;

    /// Target layers whose outputs the drafter reads, in order.
    fn target_layer_ids(&self) -> Vec<u32>;

    fn block_size(&self) -> u32;

    fn mask_token_id(&self) -> u32;

    /// Trainable parameters named as in the checkpoint, sharing storage with the model.
    fn parameters(&self) -> Vec<(String, Tensor)>;

    /// Copy weights in by name; every parameter must be present with its shape.
    fn load_weights(&mut self, weights: Vec<(String, Tensor)>) -> Result<(), PluginError>;

    /// Block hidden states after the final norm: [B, A*Bk, H] (see [`Drafter::forward`]).
    fn forward(&mut self, input: &DrafterInput) -> Result<Tensor, PluginError>;

    /// Parameter gradients from dLoss/d(output), for a drafter whose `forward` returns a leaf.
    fn backward(&mut self, grad: &Tensor) -> Result<(), PluginError> {
        let _ = grad;
        Err(PluginError::new("this drafter returned a leaf from forward but has no backward"))
    }

    /// The next training `forward`'s anchors [B, A] on the CPU (see [`Drafter::anchors_on_host`]).
    fn anchors_on_host(&mut self, anchors: &Tensor) -> Result<(), PluginError> {
        let _ = anchors;
        Ok(())
    }

    /// A decoding draft with the context kept between calls (see [`Drafter::decode_block`]):
    /// `new_context` [1, n, L*H] from position `context_start`, then the block [1, Bk, H].
    /// `Ok(None)`: this drafter keeps no context.
    fn decode_block(
        &mut self,
        new_context: &Tensor,
        context_start: u32,
        block_embeds: &Tensor,
    ) -> Result<Option<Tensor>, PluginError> {
        let _ = (new_context, context_start, block_embeds);
        Ok(None)
    }
}

/// The optimizer (the ABI's [`Optimizer`], in plain Rust): owns per-parameter state and updates
/// the parameters in place from their `.grad`.
pub trait OptimizerPlugin: Send + 'static {
    /// The parameters to update, once, before the first step.
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError>;

    /// One update; the configured learning rate(s) times `lr_scale` (the host's schedule).
    fn step(&mut self, lr_scale: f64) -> Result<(), PluginError>;

    /// The peak learning rate, for logging.
    fn base_lr(&self) -> f64;

    /// State to checkpoint, named `<param name>.<slot>` plus scalars like `step`.
    fn state(&self) -> Vec<(String, Tensor)>;

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError>;

    /// Data-parallel ranks' collectives, lent before `init` when there is more than one rank.
    fn set_collectives(&mut self, collectives: CollectivesBox) -> Result<(), PluginError> {
        let _ = collectives;
        Ok(())
    }

    /// The state by parameter and [role](crate::roles), for a fork that carries it to another
    /// optimizer; None: not exported. `plugins check` holds an optimizer that exports to a round
    /// trip: export, import into a fresh instance, export again gives the same tensors.
    fn export_state(&self) -> Option<StateByRole> {
        None
    }

    /// Take over `state` after `init`: each role that maps onto this optimizer's state, by
    /// parameter name (copy the tensors: they may be another optimizer's live state); parameters
    /// not in it keep their fresh state. None: this optimizer cannot import.
    fn import_state(&mut self, state: StateByRole) -> Result<Option<Imported>, PluginError> {
        let _ = state;
        Ok(None)
    }
}

/// An optimizer's state by parameter and role (the ABI's [`ExportedState`] in plain Rust).
#[derive(Debug, Default)]
pub struct StateByRole {
    /// Updates taken (what bias corrections count from); None when it means nothing to it.
    pub step: Option<u64>,
    /// Per parameter (its name): role -> tensor of the parameter's shape, fp32.
    pub params: Vec<(String, BTreeMap<String, Tensor>)>,
}

impl StateByRole {
    fn into_abi(self) -> ExportedState {
        ExportedState {
            step: self.step.into(),
            params: self
                .params
                .into_iter()
                .map(|(name, roles)| ParamState {
                    param: name.into(),
                    roles: roles.into_iter().map(|(r, t)| NamedTensor::new(r, t)).collect(),
                })
                .collect(),
        }
    }

    fn from_abi(s: ExportedState) -> Self {
        let params =
            s.params.into_iter().map(|p| (p.param.into_string(), named(p.roles).into_iter().collect())).collect();
        Self { step: s.step.into_option(), params }
    }
}

/// What an import took over (the ABI's [`ImportReport`] in plain Rust): count each role as it is
/// taken or passed over.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Imported {
    /// Role -> parameters it was taken for.
    pub used: BTreeMap<String, u64>,
    /// Role -> parameters it was given for but not taken.
    pub ignored: BTreeMap<String, u64>,
    /// Whether the step count was taken.
    pub step: bool,
    /// What was made up where nothing mapped, one line each.
    pub notes: Vec<String>,
}

impl Imported {
    /// `role` taken for one more parameter.
    pub fn took(&mut self, role: &str) {
        *self.used.entry(role.to_string()).or_default() += 1;
    }

    /// `role` given for one more parameter but not taken.
    pub fn passed(&mut self, role: &str) {
        *self.ignored.entry(role.to_string()).or_default() += 1;
    }

    fn into_abi(self) -> ImportReport {
        let counts = |m: BTreeMap<String, u64>| -> RVec<RoleCount> {
            m.into_iter().map(|(role, params)| RoleCount { role: role.into(), params }).collect()
        };
        ImportReport {
            used: counts(self.used),
            ignored: counts(self.ignored),
            step: self.step,
            notes: self.notes.into_iter().map(RString::from).collect(),
        }
    }
}

/// A batch of right-padded token sequences (the ABI's [`Batch`](crate::Batch) as tensors).
pub struct TrainBatch {
    /// [B, S] int64.
    pub input_ids: Tensor,
    /// [B, S] int64, 1 on tokens the drafter learns to predict.
    pub loss_mask: Tensor,
    /// Unpadded length of each sequence.
    pub lengths: Vec<u32>,
    /// A stable id per sequence (same tokens, same id, every epoch).
    pub sequence_ids: Vec<u64>,
}

impl TrainBatch {
    fn into_abi(self) -> crate::Batch {
        crate::Batch {
            input_ids: self.input_ids.into(),
            loss_mask: self.loss_mask.into(),
            lengths: self.lengths.into(),
            sequence_ids: self.sequence_ids.into(),
        }
    }
}

/// The data loader (the ABI's [`DataLoader`], in plain Rust).
pub trait DataLoaderPlugin: Send + 'static {
    /// Read and tokenize with the target's tokenizer (`tokenizer.json` text).
    fn open(&mut self, tokenizer_json: &str) -> Result<DataSummary, PluginError>;

    /// Prompts whose replies the target regenerates (empty when none are left).
    fn distill_request(&self) -> DistillRequest {
        DistillRequest::default()
    }

    /// The regenerated replies, in `distill_request` order.
    fn set_distilled(&mut self, replies: Vec<Vec<u32>>) -> Result<DataSummary, PluginError> {
        let _ = replies;
        Err(PluginError::new("this data loader asked for no self-distillation"))
    }

    /// The next batch, or None at the end of an epoch (the next call starts the next epoch).
    fn next_batch(&mut self) -> Result<Option<TrainBatch>, PluginError>;

    fn position(&self) -> DataPosition;

    fn seek(&mut self, position: DataPosition) -> Result<(), PluginError>;

    /// Evaluation prompts, never trained on, each ending with the generation prompt.
    fn eval_prompts(&mut self, source: &str, limit: u32) -> Result<Vec<Vec<u32>>, PluginError> {
        let _ = limit;
        Err(PluginError::new(format!("this data loader has no evaluation prompts (asked for `{source}`)")))
    }

    /// How to answer `distill_request`'s prompts.
    fn distill_options(&self) -> DistillOptions {
        DistillOptions::default()
    }

    /// After self-distillation, write the records as chat JSONL; the number written.
    fn export_distilled(&self, path: &str) -> Result<u64, PluginError> {
        let _ = path;
        Err(PluginError::new("this data loader cannot export its self-distilled replies"))
    }

    /// The validation split as batches, never trained on, the same every call (empty: none).
    fn validation_batches(&mut self) -> Result<Vec<TrainBatch>, PluginError> {
        Ok(Vec::new())
    }

    /// `export_distilled`, with what was not written and why.
    fn export_distilled_summary(&self, path: &str) -> Result<DistilledExport, PluginError> {
        Ok(DistilledExport { records: self.export_distilled(path)?, ..DistilledExport::default() })
    }
}

impl PluginInstance {
    pub fn target(t: impl TargetPlugin) -> Self {
        PluginInstance::Target(TargetModel_TO::from_value(Contained::new(t), TD_Opaque))
    }

    pub fn drafter(d: impl DrafterPlugin) -> Self {
        PluginInstance::Drafter(Drafter_TO::from_value(Contained::new(d), TD_Opaque))
    }

    pub fn optimizer(o: impl OptimizerPlugin) -> Self {
        PluginInstance::Optimizer(Optimizer_TO::from_value(Contained::new(o), TD_Opaque))
    }

    pub fn data_loader(d: impl DataLoaderPlugin) -> Self {
        PluginInstance::DataLoader(DataLoader_TO::from_value(Contained::new(d), TD_Opaque))
    }
}

impl DistillRequest {
    pub fn new(prompts: Vec<Vec<u32>>, max_new_tokens: u32, stop_tokens: Vec<u32>) -> Self {
        Self { prompts: prompts.into_iter().map(RVec::from).collect(), max_new_tokens, stop_tokens: stop_tokens.into() }
    }
}

impl DataSummary {
    pub fn new(sequences: u64, tokens: u64, loss_tokens: u64, skipped: u64, description: impl Into<String>) -> Self {
        Self { sequences, tokens, loss_tokens, skipped, description: RString::from(description.into()) }
    }
}

/// An author's plugin as the ABI sees it: what [`PluginInstance::target`] (and the others)
/// hand the host. Every call runs under [`catch_plugin_panic`], so a panic is the error of the
/// call that panicked (`panicked: <message>`). A panic may have left the plugin half-updated (an
/// optimizer step that moved some parameters, a cache half-extended), so every later call on the
/// instance is refused without running: `` refused: `<method>` panicked before: <message> ``.
pub struct Contained<P> {
    plugin: P,
    /// The first call that panicked: `` `<method>` panicked before: <message> ``.
    panicked: OnceLock<String>,
}

impl<P> Contained<P> {
    pub fn new(plugin: P) -> Self {
        Self { plugin, panicked: OnceLock::new() }
    }

    /// `f` on the plugin, unless an earlier call panicked; a panic in it is its error.
    fn call<R>(&self, method: &str, f: impl FnOnce(&P) -> Result<R, PluginError>) -> RResult<R, PluginError> {
        let plugin = &self.plugin;
        guarded(&self.panicked, method, || f(plugin))
    }

    /// [`Contained::call`] for a method that takes `&mut self`.
    fn call_mut<R>(
        &mut self,
        method: &str,
        f: impl FnOnce(&mut P) -> Result<R, PluginError>,
    ) -> RResult<R, PluginError> {
        let plugin = &mut self.plugin;
        guarded(&self.panicked, method, || f(plugin))
    }
}

/// The author's value, read (a plugin's own tests look at its state through it).
impl<P> std::ops::Deref for Contained<P> {
    type Target = P;

    fn deref(&self) -> &P {
        &self.plugin
    }
}

fn guarded<R>(
    panicked: &OnceLock<String>,
    method: &str,
    f: impl FnOnce() -> Result<R, PluginError>,
) -> RResult<R, PluginError> {
    if let Some(why) = panicked.get() {
        return RResult::RErr(PluginError::new(format!("refused: {why}")));
    }
    match crate::module::catch_panic(f) {
        Ok(r) => r.into(),
        Err(message) => {
            let _ = panicked.set(format!("`{method}` panicked before: {message}"));
            RResult::RErr(PluginError::new(format!("panicked: {message}")))
        }
    }
}

fn named(v: RVec<NamedTensor>) -> Vec<(String, Tensor)> {
    v.into_iter().map(|nt| (nt.name.into_string(), nt.tensor.into_tensor())).collect()
}

fn unnamed(v: Vec<(String, Tensor)>) -> RVec<NamedTensor> {
    v.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect()
}

impl<T: TargetPlugin> TargetModel for Contained<T> {
    fn spec(&self) -> RResult<TargetSpec, PluginError> {
        self.call("spec", |t| Ok(t.spec()))
    }

    fn tokenizer_json(&self) -> RResult<RString, PluginError> {
        self.call("tokenizer_json", |t| Ok(t.tokenizer_json().into()))
    }

    fn embedding(&self) -> RResult<TensorHandle, PluginError> {
        self.call("embedding", |t| Ok(t.embedding().into()))
    }

    fn lm_head(&self) -> RResult<TensorHandle, PluginError> {
        self.call("lm_head", |t| Ok(t.lm_head().into()))
    }

    fn forward(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
        want_logits: bool,
    ) -> RResult<TargetOutput, PluginError> {
        self.call_mut("forward", |t| {
            let (hidden, logits) = t.forward(&input_ids.tensor(), layer_ids.as_slice(), want_logits)?;
            Ok(TargetOutput { hidden: hidden.into(), logits: logits.map(TensorHandle::new).into() })
        })
    }

    fn generate(
        &mut self,
        prompts: RVec<RVec<u32>>,
        max_new_tokens: u32,
        stop_tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<RVec<u32>>, PluginError> {
        self.call_mut("generate", |t| {
            let prompts = prompts.into_iter().map(RVec::into_vec).collect();
            let out = t.generate(prompts, max_new_tokens, stop_tokens.as_slice())?;
            Ok(out.into_iter().map(RVec::from).collect())
        })
    }

    fn cache_reset(&mut self) -> RResult<(), PluginError> {
        self.call_mut("cache_reset", |t| {
            t.cache_reset();
            Ok(())
        })
    }

    fn cache_extend(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
    ) -> RResult<TargetOutput, PluginError> {
        self.call_mut("cache_extend", |t| {
            let (hidden, logits) = t.cache_extend(&input_ids.tensor(), layer_ids.as_slice())?;
            Ok(TargetOutput { hidden: hidden.into(), logits: ROption::RSome(logits.into()) })
        })
    }

    fn cache_truncate(&mut self, len: u32) -> RResult<(), PluginError> {
        self.call_mut("cache_truncate", |t| t.cache_truncate(len))
    }
}

impl<T: DrafterPlugin> Drafter for Contained<T> {
    fn config_json(&self) -> RResult<RString, PluginError> {
        self.call("config_json", |d| Ok(d.config_json().into()))
    }

    fn target_layer_ids(&self) -> RResult<RVec<u32>, PluginError> {
        self.call("target_layer_ids", |d| Ok(d.target_layer_ids().into()))
    }

    fn block_size(&self) -> RResult<u32, PluginError> {
        self.call("block_size", |d| Ok(d.block_size()))
    }

    fn mask_token_id(&self) -> RResult<u32, PluginError> {
        self.call("mask_token_id", |d| Ok(d.mask_token_id()))
    }

    fn parameters(&self) -> RResult<RVec<NamedTensor>, PluginError> {
        self.call("parameters", |d| Ok(unnamed(d.parameters())))
    }

    fn load_weights(&mut self, weights: RVec<NamedTensor>) -> RResult<(), PluginError> {
        self.call_mut("load_weights", |d| d.load_weights(named(weights)))
    }

    fn forward(&mut self, input: &DraftInput) -> RResult<TensorHandle, PluginError> {
        self.call_mut("forward", |d| d.forward(&DrafterInput::from_abi(input)).map(TensorHandle::new))
    }

    fn backward(&mut self, grad: &TensorHandle) -> RResult<(), PluginError> {
        self.call_mut("backward", |d| d.backward(&grad.tensor()))
    }

    fn anchors_on_host(&mut self, anchors: &TensorHandle) -> RResult<(), PluginError> {
        self.call_mut("anchors_on_host", |d| d.anchors_on_host(&anchors.tensor()))
    }

    fn decode_block(&mut self, input: &DecodeInput) -> RResult<ROption<TensorHandle>, PluginError> {
        self.call_mut("decode_block", |d| {
            let out = d.decode_block(&input.new_context.tensor(), input.context_start, &input.block_embeds.tensor())?;
            Ok(out.map(TensorHandle::new).into())
        })
    }
}

impl<T: OptimizerPlugin> Optimizer for Contained<T> {
    fn init(&mut self, params: RVec<NamedTensor>) -> RResult<(), PluginError> {
        self.call_mut("init", |o| o.init(named(params)))
    }

    fn step(&mut self, lr_scale: f64) -> RResult<(), PluginError> {
        self.call_mut("step", |o| o.step(lr_scale))
    }

    fn base_lr(&self) -> RResult<f64, PluginError> {
        self.call("base_lr", |o| Ok(o.base_lr()))
    }

    fn state(&self) -> RResult<RVec<NamedTensor>, PluginError> {
        self.call("state", |o| Ok(unnamed(o.state())))
    }

    fn load_state(&mut self, state: RVec<NamedTensor>) -> RResult<(), PluginError> {
        self.call_mut("load_state", |o| o.load_state(named(state)))
    }

    fn set_collectives(&mut self, collectives: CollectivesBox) -> RResult<(), PluginError> {
        self.call_mut("set_collectives", |o| o.set_collectives(collectives))
    }

    fn export_state(&self) -> RResult<ROption<ExportedState>, PluginError> {
        self.call("export_state", |o| Ok(o.export_state().map(StateByRole::into_abi).into()))
    }

    fn import_state(&mut self, state: ExportedState) -> RResult<ROption<ImportReport>, PluginError> {
        self.call_mut("import_state", |o| {
            Ok(o.import_state(StateByRole::from_abi(state))?.map(Imported::into_abi).into())
        })
    }
}

impl<T: DataLoaderPlugin> DataLoader for Contained<T> {
    fn open(&mut self, tokenizer_json: RStr<'_>) -> RResult<DataSummary, PluginError> {
        self.call_mut("open", |d| d.open(tokenizer_json.as_str()))
    }

    fn distill_request(&self) -> RResult<DistillRequest, PluginError> {
        self.call("distill_request", |d| Ok(d.distill_request()))
    }

    fn set_distilled(&mut self, replies: RVec<RVec<u32>>) -> RResult<DataSummary, PluginError> {
        self.call_mut("set_distilled", |d| d.set_distilled(replies.into_iter().map(RVec::into_vec).collect()))
    }

    fn next_batch(&mut self) -> RResult<ROption<crate::Batch>, PluginError> {
        self.call_mut("next_batch", |d| Ok(d.next_batch()?.map(TrainBatch::into_abi).into()))
    }

    fn position(&self) -> RResult<DataPosition, PluginError> {
        self.call("position", |d| Ok(d.position()))
    }

    fn seek(&mut self, position: DataPosition) -> RResult<(), PluginError> {
        self.call_mut("seek", |d| d.seek(position))
    }

    fn eval_prompts(&mut self, source: RStr<'_>, limit: u32) -> RResult<RVec<RVec<u32>>, PluginError> {
        self.call_mut("eval_prompts", |d| {
            Ok(d.eval_prompts(source.as_str(), limit)?.into_iter().map(RVec::from).collect())
        })
    }

    fn distill_options(&self) -> RResult<DistillOptions, PluginError> {
        self.call("distill_options", |d| Ok(d.distill_options()))
    }

    fn export_distilled(&self, path: RStr<'_>) -> RResult<u64, PluginError> {
        self.call("export_distilled", |d| d.export_distilled(path.as_str()))
    }

    fn validation_batches(&mut self) -> RResult<RVec<crate::Batch>, PluginError> {
        self.call_mut("validation_batches", |d| {
            Ok(d.validation_batches()?.into_iter().map(TrainBatch::into_abi).collect())
        })
    }

    fn export_distilled_summary(&self, path: RStr<'_>) -> RResult<DistilledExport, PluginError> {
        self.call("export_distilled_summary", |d| d.export_distilled_summary(path.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sgd {
        params: Vec<Tensor>,
        panic_in: &'static str,
    }

    impl OptimizerPlugin for Sgd {
        fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
            self.params = params.into_iter().map(|(_, t)| t).collect();
            Ok(())
        }
        fn step(&mut self, _lr_scale: f64) -> Result<(), PluginError> {
            if self.panic_in == "step" {
                panic!("boom in step");
            }
            Ok(())
        }
        fn base_lr(&self) -> f64 {
            if self.panic_in == "base_lr" {
                panic!("boom in base_lr");
            }
            0.5
        }
        fn state(&self) -> Vec<(String, Tensor)> {
            vec![("w.buf".into(), Tensor::from(1.0f32))]
        }
        fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
            match state.is_empty() {
                true => Err(PluginError::new("no state to load")),
                false => Ok(()),
            }
        }
    }

    fn boxed(panic_in: &'static str) -> crate::OptimizerBox {
        let PluginInstance::Optimizer(o) = PluginInstance::optimizer(Sgd { params: vec![], panic_in }) else {
            unreachable!()
        };
        o
    }

    #[test]
    fn values_convert_across_the_trait_object() {
        let mut o = boxed("");
        o.init(vec![NamedTensor::new("w", Tensor::from(2.0f32))].into()).unwrap();
        assert_eq!(o.base_lr().unwrap(), 0.5);
        let s = o.state().unwrap();
        assert_eq!((s[0].name.as_str(), s[0].tensor.tensor().double_value(&[])), ("w.buf", 1.0));
        assert!(o.step(1.0).is_ok());
    }

    #[test]
    fn a_panic_in_a_fallible_method_is_its_error() {
        let mut o = boxed("step");
        let e = o.step(1.0).unwrap_err().to_string();
        assert_eq!(e, "panicked: boom in step");
        assert_eq!(o.step(1.0).unwrap_err().to_string(), "refused: `step` panicked before: boom in step");
    }

    #[test]
    fn a_panic_in_a_value_method_is_its_error_and_the_instance_is_refused_after() {
        let mut o = boxed("base_lr");
        assert_eq!(o.base_lr().unwrap_err().to_string(), "panicked: boom in base_lr");
        // Every later call is refused without running; another instance is untouched.
        let refused = "refused: `base_lr` panicked before: boom in base_lr";
        assert_eq!(o.step(1.0).unwrap_err().to_string(), refused);
        assert_eq!(o.state().unwrap_err().to_string(), refused);
        assert_eq!(boxed("").base_lr().unwrap(), 0.5);
    }

    #[test]
    fn an_error_the_plugin_returns_leaves_the_instance_usable() {
        let mut o = boxed("");
        assert_eq!(o.load_state(RVec::new()).unwrap_err().to_string(), "no state to load");
        assert!(o.step(1.0).is_ok());
    }
}
