//! Writing a plugin in plain Rust.
//!
//! An author implements one of [`TargetPlugin`], [`DrafterPlugin`], [`OptimizerPlugin`] or
//! [`DataLoaderPlugin`] with std types and tch tensors, returns it from `create` through
//! [`PluginInstance::optimizer`] (or `target`, `drafter`, `data_loader`), and declares the crate
//! once with [`declare_plugin!`](crate::declare_plugin). Everything abi_stable needs is generated
//! here: each author trait has a blanket implementation of its ABI trait ([`crate::Optimizer`]
//! and the others) that converts the values and contains panics.
//!
//! Panics. No panic unwinds into the host. In a method that returns `Result`, a panic becomes
//! `Err("panicked: <message>")`, which the host reports with the plugin and the method named. A
//! method that returns a plain value (`spec`, `parameters`, `base_lr`, `position`, ...) cannot
//! carry an error across the ABI, so a panic there returns a placeholder (empty, zero, the
//! default; a [`TargetSpec`] with an empty `architecture` and the panic in `source`) and poisons
//! the instance: its next `Result` call fails with `` `<method>` panicked: <message> `` without
//! running, and the host, which asks after its calls ([`take_poison`]), stops with that error
//! before it uses the placeholder.

use crate::{
    abi_stable::{
        sabi_trait::TD_Opaque,
        std_types::{ROption, RResult, RSlice, RStr, RString, RVec},
    },
    catch_plugin_panic, CollectivesBox, DataLoader, DataLoader_TO, DataPosition, DataSummary, DecodeInput,
    DistillOptions, DistillRequest, DistilledExport, DraftInput, Drafter, Drafter_TO, NamedTensor, Optimizer,
    Optimizer_TO, PluginError, PluginInstance, TargetModel, TargetModel_TO, TargetOutput, TargetSpec, TensorHandle,
};
use std::sync::{
    atomic::{AtomicBool, Ordering},
    Mutex,
};
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
        PluginInstance::Target(TargetModel_TO::from_value(t, TD_Opaque))
    }

    pub fn drafter(d: impl DrafterPlugin) -> Self {
        PluginInstance::Drafter(Drafter_TO::from_value(d, TD_Opaque))
    }

    pub fn optimizer(o: impl OptimizerPlugin) -> Self {
        PluginInstance::Optimizer(Optimizer_TO::from_value(o, TD_Opaque))
    }

    pub fn data_loader(d: impl DataLoaderPlugin) -> Self {
        PluginInstance::DataLoader(DataLoader_TO::from_value(d, TD_Opaque))
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

// ---- Poisoning: a panic in a value-returning method, reported by the next fallible call. ----

/// Instances (address, type) whose value-returning method panicked, with that method and panic.
static POISONED: Mutex<Vec<(usize, &'static str, String)>> = Mutex::new(Vec::new());
/// Fast path: nothing is poisoned (almost always).
static ANY_POISONED: AtomicBool = AtomicBool::new(false);

fn key<T>(obj: &T) -> (usize, &'static str) {
    (obj as *const T as usize, std::any::type_name::<T>())
}

/// The first poison that `matches` an instance's key, taken.
fn take(matches: impl Fn(usize, &'static str) -> bool) -> Option<String> {
    if !ANY_POISONED.load(Ordering::Acquire) {
        return None;
    }
    let mut list = POISONED.lock().unwrap_or_else(|e| e.into_inner());
    let i = list.iter().position(|(a, t, _)| matches(*a, t))?;
    let (_, _, why) = list.swap_remove(i);
    ANY_POISONED.store(!list.is_empty(), Ordering::Release);
    Some(why)
}

/// The poison of an instance, taken: `Err` once after a value-returning method panicked.
fn poison<T>(obj: &T) -> Result<(), PluginError> {
    let (addr, ty) = key(obj);
    take(|a, t| a == addr && t == ty).map_or(Ok(()), |why| Err(PluginError::new(why)))
}

/// What a value-returning method's panic left on the instance at `address` (the plugin value's
/// address inside its trait object, `obj.sabi_erased_ref()`), taken: `` `<method>` panicked:
/// <message> ``. The host asks after such calls (through the library's `dflash_poison_<name>`
/// symbol, see [`declare_plugin!`](crate::declare_plugin)) so that it stops before it uses the
/// placeholder, e.g. writes a checkpoint without the weights `parameters` should have given.
pub fn take_poison(address: usize) -> Option<String> {
    take(|a, _| a == address)
}

/// A fallible method: refused while the instance is poisoned (`poisoned`, read first), its
/// panic an error.
fn fallible<R>(
    poisoned: Result<(), PluginError>,
    f: impl FnOnce() -> Result<R, PluginError>,
) -> RResult<R, PluginError> {
    poisoned.and_then(|()| catch_plugin_panic(f)).into()
}

/// A value-returning method of the instance `at` ([`key`]): a panic poisons it and gives
/// `placeholder(why)`.
fn value<R>(
    at: (usize, &'static str),
    method: &'static str,
    placeholder: impl FnOnce(&str) -> R,
    f: impl FnOnce() -> R,
) -> R {
    match catch_plugin_panic(|| Ok(f())) {
        Ok(r) => r,
        Err(e) => {
            let msg = e.message.as_str();
            let why = format!("`{method}` panicked: {}", msg.strip_prefix("panicked: ").unwrap_or(msg));
            let r = placeholder(&why);
            POISONED.lock().unwrap_or_else(|e| e.into_inner()).push((at.0, at.1, why));
            ANY_POISONED.store(true, Ordering::Release);
            r
        }
    }
}

fn named(v: RVec<NamedTensor>) -> Vec<(String, Tensor)> {
    v.into_iter().map(|nt| (nt.name.into_string(), nt.tensor.into_tensor())).collect()
}

fn unnamed(v: Vec<(String, Tensor)>) -> RVec<NamedTensor> {
    v.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect()
}

fn empty_tensor() -> TensorHandle {
    TensorHandle::new(Tensor::zeros([0], (tch::Kind::Float, tch::Device::Cpu)))
}

/// What a panicking `spec()` returns: no architecture, the panic in `source`.
pub fn placeholder_spec(why: &str) -> TargetSpec {
    TargetSpec {
        architecture: RString::new(),
        num_hidden_layers: 0,
        hidden_size: 0,
        vocab_size: 0,
        num_attention_heads: 0,
        num_key_value_heads: 0,
        head_dim: 0,
        intermediate_size: 0,
        rope_theta: 0.0,
        rms_norm_eps: 0.0,
        bos_token_id: ROption::RNone,
        eos_token_id: 0,
        pad_token_id: ROption::RNone,
        chat_template: RString::new(),
        source: why.into(),
        source_sha256: RString::new(),
    }
}

impl<T: TargetPlugin> TargetModel for T {
    fn spec(&self) -> TargetSpec {
        value(key(self), "spec", placeholder_spec, || TargetPlugin::spec(self))
    }

    fn tokenizer_json(&self) -> RString {
        value(key(self), "tokenizer_json", |_| RString::new(), || TargetPlugin::tokenizer_json(self).into())
    }

    fn embedding(&self) -> TensorHandle {
        value(key(self), "embedding", |_| empty_tensor(), || TargetPlugin::embedding(self).into())
    }

    fn lm_head(&self) -> TensorHandle {
        value(key(self), "lm_head", |_| empty_tensor(), || TargetPlugin::lm_head(self).into())
    }

    fn forward(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
        want_logits: bool,
    ) -> RResult<TargetOutput, PluginError> {
        fallible(poison(self), || {
            let (hidden, logits) = TargetPlugin::forward(self, &input_ids.tensor(), layer_ids.as_slice(), want_logits)?;
            Ok(TargetOutput { hidden: hidden.into(), logits: logits.map(TensorHandle::new).into() })
        })
    }

    fn generate(
        &mut self,
        prompts: RVec<RVec<u32>>,
        max_new_tokens: u32,
        stop_tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<RVec<u32>>, PluginError> {
        fallible(poison(self), || {
            let prompts = prompts.into_iter().map(RVec::into_vec).collect();
            let out = TargetPlugin::generate(self, prompts, max_new_tokens, stop_tokens.as_slice())?;
            Ok(out.into_iter().map(RVec::from).collect())
        })
    }

    fn cache_reset(&mut self) {
        value(key(self), "cache_reset", |_| (), || TargetPlugin::cache_reset(self))
    }

    fn cache_extend(
        &mut self,
        input_ids: &TensorHandle,
        layer_ids: RSlice<'_, u32>,
    ) -> RResult<TargetOutput, PluginError> {
        fallible(poison(self), || {
            let (hidden, logits) = TargetPlugin::cache_extend(self, &input_ids.tensor(), layer_ids.as_slice())?;
            Ok(TargetOutput { hidden: hidden.into(), logits: ROption::RSome(logits.into()) })
        })
    }

    fn cache_truncate(&mut self, len: u32) -> RResult<(), PluginError> {
        fallible(poison(self), || TargetPlugin::cache_truncate(self, len))
    }
}

impl<T: DrafterPlugin> Drafter for T {
    fn config_json(&self) -> RString {
        value(key(self), "config_json", |_| RString::new(), || DrafterPlugin::config_json(self).into())
    }

    fn target_layer_ids(&self) -> RVec<u32> {
        value(key(self), "target_layer_ids", |_| RVec::new(), || DrafterPlugin::target_layer_ids(self).into())
    }

    fn block_size(&self) -> u32 {
        value(key(self), "block_size", |_| 0, || DrafterPlugin::block_size(self))
    }

    fn mask_token_id(&self) -> u32 {
        value(key(self), "mask_token_id", |_| 0, || DrafterPlugin::mask_token_id(self))
    }

    fn parameters(&self) -> RVec<NamedTensor> {
        value(key(self), "parameters", |_| RVec::new(), || unnamed(DrafterPlugin::parameters(self)))
    }

    fn load_weights(&mut self, weights: RVec<NamedTensor>) -> RResult<(), PluginError> {
        fallible(poison(self), || DrafterPlugin::load_weights(self, named(weights)))
    }

    fn forward(&mut self, input: &DraftInput) -> RResult<TensorHandle, PluginError> {
        fallible(poison(self), || DrafterPlugin::forward(self, &DrafterInput::from_abi(input)).map(TensorHandle::new))
    }

    fn backward(&mut self, grad: &TensorHandle) -> RResult<(), PluginError> {
        fallible(poison(self), || DrafterPlugin::backward(self, &grad.tensor()))
    }

    fn anchors_on_host(&mut self, anchors: &TensorHandle) -> RResult<(), PluginError> {
        fallible(poison(self), || DrafterPlugin::anchors_on_host(self, &anchors.tensor()))
    }

    fn decode_block(&mut self, input: &DecodeInput) -> RResult<ROption<TensorHandle>, PluginError> {
        fallible(poison(self), || {
            let out = DrafterPlugin::decode_block(
                self,
                &input.new_context.tensor(),
                input.context_start,
                &input.block_embeds.tensor(),
            )?;
            Ok(out.map(TensorHandle::new).into())
        })
    }
}

impl<T: OptimizerPlugin> Optimizer for T {
    fn init(&mut self, params: RVec<NamedTensor>) -> RResult<(), PluginError> {
        fallible(poison(self), || OptimizerPlugin::init(self, named(params)))
    }

    fn step(&mut self, lr_scale: f64) -> RResult<(), PluginError> {
        fallible(poison(self), || OptimizerPlugin::step(self, lr_scale))
    }

    fn base_lr(&self) -> f64 {
        value(key(self), "base_lr", |_| 0.0, || OptimizerPlugin::base_lr(self))
    }

    fn state(&self) -> RVec<NamedTensor> {
        value(key(self), "state", |_| RVec::new(), || unnamed(OptimizerPlugin::state(self)))
    }

    fn load_state(&mut self, state: RVec<NamedTensor>) -> RResult<(), PluginError> {
        fallible(poison(self), || OptimizerPlugin::load_state(self, named(state)))
    }

    fn set_collectives(&mut self, collectives: CollectivesBox) -> RResult<(), PluginError> {
        fallible(poison(self), || OptimizerPlugin::set_collectives(self, collectives))
    }
}

impl<T: DataLoaderPlugin> DataLoader for T {
    fn open(&mut self, tokenizer_json: RStr<'_>) -> RResult<DataSummary, PluginError> {
        fallible(poison(self), || DataLoaderPlugin::open(self, tokenizer_json.as_str()))
    }

    fn distill_request(&self) -> DistillRequest {
        value(key(self), "distill_request", |_| DistillRequest::default(), || DataLoaderPlugin::distill_request(self))
    }

    fn set_distilled(&mut self, replies: RVec<RVec<u32>>) -> RResult<DataSummary, PluginError> {
        fallible(poison(self), || {
            DataLoaderPlugin::set_distilled(self, replies.into_iter().map(RVec::into_vec).collect())
        })
    }

    fn next_batch(&mut self) -> RResult<ROption<crate::Batch>, PluginError> {
        fallible(poison(self), || Ok(DataLoaderPlugin::next_batch(self)?.map(TrainBatch::into_abi).into()))
    }

    fn position(&self) -> DataPosition {
        value(key(self), "position", |_| DataPosition::default(), || DataLoaderPlugin::position(self))
    }

    fn seek(&mut self, position: DataPosition) -> RResult<(), PluginError> {
        fallible(poison(self), || DataLoaderPlugin::seek(self, position))
    }

    fn eval_prompts(&mut self, source: RStr<'_>, limit: u32) -> RResult<RVec<RVec<u32>>, PluginError> {
        fallible(poison(self), || {
            Ok(DataLoaderPlugin::eval_prompts(self, source.as_str(), limit)?.into_iter().map(RVec::from).collect())
        })
    }

    fn distill_options(&self) -> DistillOptions {
        value(key(self), "distill_options", |_| DistillOptions::default(), || DataLoaderPlugin::distill_options(self))
    }

    fn export_distilled(&self, path: RStr<'_>) -> RResult<u64, PluginError> {
        fallible(poison(self), || DataLoaderPlugin::export_distilled(self, path.as_str()))
    }

    fn validation_batches(&mut self) -> RResult<RVec<crate::Batch>, PluginError> {
        fallible(poison(self), || {
            Ok(DataLoaderPlugin::validation_batches(self)?.into_iter().map(TrainBatch::into_abi).collect())
        })
    }

    fn export_distilled_summary(&self, path: RStr<'_>) -> RResult<DistilledExport, PluginError> {
        fallible(poison(self), || DataLoaderPlugin::export_distilled_summary(self, path.as_str()))
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
        fn load_state(&mut self, _state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
            Ok(())
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
        assert_eq!(o.base_lr(), 0.5);
        let s = o.state();
        assert_eq!((s[0].name.as_str(), s[0].tensor.tensor().double_value(&[])), ("w.buf", 1.0));
        assert!(o.step(1.0).is_ok());
    }

    #[test]
    fn a_panic_in_a_fallible_method_is_its_error() {
        let mut o = boxed("step");
        let e = o.step(1.0).unwrap_err().to_string();
        assert_eq!(e, "panicked: boom in step");
    }

    #[test]
    fn a_panic_in_a_value_method_poisons_the_next_fallible_call_once() {
        let mut o = boxed("base_lr");
        assert_eq!(o.base_lr(), 0.0, "the placeholder");
        let e = o.step(1.0).unwrap_err().to_string();
        assert_eq!(e, "`base_lr` panicked: boom in base_lr");
        // Reported once; another instance was never poisoned.
        assert!(o.step(1.0).is_ok());
        assert!(boxed("").step(1.0).is_ok());
    }

    #[test]
    fn the_host_finds_the_poison_by_the_address_inside_the_trait_object() {
        let (o, healthy) = (boxed("base_lr"), boxed(""));
        let at = |b: &crate::OptimizerBox| b.obj.sabi_erased_ref().as_ptr() as usize;
        assert_eq!(take_poison(at(&o)), None);
        let _ = (o.base_lr(), healthy.base_lr());
        assert_eq!(take_poison(at(&healthy)), None);
        assert_eq!(take_poison(at(&o)).as_deref(), Some("`base_lr` panicked: boom in base_lr"));
        // Taken: neither the host nor the next fallible call sees it again.
        assert_eq!(take_poison(at(&o)), None);
    }
}
