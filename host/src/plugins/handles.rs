//! The host's handles on created plugins: every ABI call through them, its error prefixed with
//! the plugin and the call (`` drafter plugin `dflash`: forward: <the plugin's message> ``), and
//! the values converted to what the host works with (tensors, vectors, strings).

use anyhow::{anyhow, Result};
use plugin_api::{
    abi_stable::std_types::{RSlice, RVec},
    Batch, CollectivesBox, DataLoaderBox, DataPosition, DataSummary, DecodeInput, DistillOptions, DistillRequest,
    DistilledExport, DraftInput, DrafterBox, ExportedState, ImportReport, NamedTensor, OptimizerBox, PluginError,
    PluginKind, TargetBox, TargetOutput, TargetSpec, TensorHandle,
};
use tch::Tensor;

/// Which plugin a handle calls, for its errors.
#[derive(Clone, Debug)]
struct Who {
    kind: PluginKind,
    name: String,
}

impl Who {
    /// An error of the call `call`: `` <kind> plugin `<name>`: <call>: <message> ``; a CUDA
    /// out-of-memory one as a paragraph that says what would fit (`memory_estimate.rs`).
    fn err<'a>(&'a self, call: &'a str) -> impl FnOnce(PluginError) -> anyhow::Error + 'a {
        move |e| {
            let place = format!("{} plugin `{}`: {call}", self.kind, self.name);
            // A call refused after an earlier panic says so as it is.
            match crate::memory_estimate::is_oom(&e.message) && !e.message.starts_with("refused:") {
                true => anyhow!("{}", crate::memory_estimate::oom_paragraph(&place, &e.message)),
                false => anyhow!("{place}: {e}"),
            }
        }
    }
}

macro_rules! handle {
    ($(#[$doc:meta])* $handle:ident, $raw:ty, $kind:expr) => {
        $(#[$doc])*
        pub struct $handle {
            raw: $raw,
            who: Who,
        }

        impl $handle {
            /// A handle on `raw`, an instance of the plugin named `name`.
            pub fn new(raw: $raw, name: &str) -> Self {
                Self { raw, who: Who { kind: $kind, name: name.to_string() } }
            }

            /// The plugin's name.
            pub fn name(&self) -> &str {
                &self.who.name
            }

            /// The ABI trait object itself, for what measures the ABI's own cost.
            pub fn raw(&self) -> &$raw {
                &self.raw
            }

            /// The ABI trait object, for a host wrapper around it (a target replica's lead).
            pub fn into_raw(self) -> $raw {
                self.raw
            }
        }
    };
}

handle!(
    /// The target model.
    TargetHandle,
    TargetBox,
    PluginKind::Target
);
handle!(
    /// The drafter.
    DrafterHandle,
    DrafterBox,
    PluginKind::Drafter
);
handle!(
    /// The optimizer.
    OptimizerHandle,
    OptimizerBox,
    PluginKind::Optimizer
);
handle!(
    /// The data loader.
    DataHandle,
    DataLoaderBox,
    PluginKind::DataLoader
);

impl TargetHandle {
    pub fn spec(&self) -> Result<TargetSpec> {
        self.raw.spec().into_result().map_err(self.who.err("spec"))
    }

    pub fn tokenizer_json(&self) -> Result<String> {
        Ok(self.raw.tokenizer_json().into_result().map_err(self.who.err("tokenizer_json"))?.into_string())
    }

    pub fn embedding(&self) -> Result<Tensor> {
        Ok(self.raw.embedding().into_result().map_err(self.who.err("embedding"))?.into_tensor())
    }

    pub fn lm_head(&self) -> Result<Tensor> {
        Ok(self.raw.lm_head().into_result().map_err(self.who.err("lm_head"))?.into_tensor())
    }

    pub fn forward(&mut self, input_ids: &TensorHandle, layer_ids: &[u32], want_logits: bool) -> Result<TargetOutput> {
        self.raw
            .forward(input_ids, RSlice::from_slice(layer_ids), want_logits)
            .into_result()
            .map_err(self.who.err("forward"))
    }

    pub fn generate(
        &mut self,
        prompts: Vec<Vec<u32>>,
        max_new_tokens: u32,
        stop_tokens: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        let prompts = prompts.into_iter().map(RVec::from).collect();
        let out = self.raw.generate(prompts, max_new_tokens, RSlice::from_slice(stop_tokens));
        Ok(out.into_result().map_err(self.who.err("generate"))?.into_iter().map(RVec::into_vec).collect())
    }

    pub fn cache_reset(&mut self) -> Result<()> {
        self.raw.cache_reset().into_result().map_err(self.who.err("cache_reset"))
    }

    pub fn cache_extend(&mut self, input_ids: &TensorHandle, layer_ids: &[u32]) -> Result<TargetOutput> {
        self.raw
            .cache_extend(input_ids, RSlice::from_slice(layer_ids))
            .into_result()
            .map_err(self.who.err("cache_extend"))
    }

    pub fn cache_truncate(&mut self, len: u32) -> Result<()> {
        self.raw.cache_truncate(len).into_result().map_err(self.who.err("cache_truncate"))
    }
}

impl DrafterHandle {
    pub fn config_json(&self) -> Result<String> {
        Ok(self.raw.config_json().into_result().map_err(self.who.err("config_json"))?.into_string())
    }

    pub fn target_layer_ids(&self) -> Result<Vec<u32>> {
        Ok(self.raw.target_layer_ids().into_result().map_err(self.who.err("target_layer_ids"))?.into_vec())
    }

    pub fn block_size(&self) -> Result<u32> {
        self.raw.block_size().into_result().map_err(self.who.err("block_size"))
    }

    pub fn mask_token_id(&self) -> Result<u32> {
        self.raw.mask_token_id().into_result().map_err(self.who.err("mask_token_id"))
    }

    pub fn parameters(&self) -> Result<RVec<NamedTensor>> {
        self.raw.parameters().into_result().map_err(self.who.err("parameters"))
    }

    pub fn load_weights(&mut self, weights: RVec<NamedTensor>) -> Result<()> {
        self.raw.load_weights(weights).into_result().map_err(self.who.err("load_weights"))
    }

    pub fn forward(&mut self, input: &DraftInput) -> Result<Tensor> {
        Ok(self.raw.forward(input).into_result().map_err(self.who.err("forward"))?.into_tensor())
    }

    pub fn backward(&mut self, grad: &TensorHandle) -> Result<()> {
        self.raw.backward(grad).into_result().map_err(self.who.err("backward"))
    }

    pub fn anchors_on_host(&mut self, anchors: &TensorHandle) -> Result<()> {
        self.raw.anchors_on_host(anchors).into_result().map_err(self.who.err("anchors_on_host"))
    }

    pub fn decode_block(&mut self, input: &DecodeInput) -> Result<Option<Tensor>> {
        let out = self.raw.decode_block(input).into_result().map_err(self.who.err("decode_block"))?;
        Ok(out.into_option().map(TensorHandle::into_tensor))
    }
}

impl OptimizerHandle {
    pub fn init(&mut self, params: RVec<NamedTensor>) -> Result<()> {
        self.raw.init(params).into_result().map_err(self.who.err("init"))
    }

    pub fn step(&mut self, lr_scale: f64) -> Result<()> {
        self.raw.step(lr_scale).into_result().map_err(self.who.err("step"))
    }

    pub fn base_lr(&self) -> Result<f64> {
        self.raw.base_lr().into_result().map_err(self.who.err("base_lr"))
    }

    pub fn state(&self) -> Result<RVec<NamedTensor>> {
        self.raw.state().into_result().map_err(self.who.err("state"))
    }

    pub fn load_state(&mut self, state: RVec<NamedTensor>) -> Result<()> {
        self.raw.load_state(state).into_result().map_err(self.who.err("load_state"))
    }

    pub fn set_collectives(&mut self, collectives: CollectivesBox) -> Result<()> {
        self.raw.set_collectives(collectives).into_result().map_err(self.who.err("set_collectives"))
    }

    /// The state by parameter and role; None when the optimizer does not export it.
    pub fn export_state(&self) -> Result<Option<ExportedState>> {
        Ok(self.raw.export_state().into_result().map_err(self.who.err("export_state"))?.into_option())
    }

    /// Take over exported state; None when the optimizer cannot import.
    pub fn import_state(&mut self, state: ExportedState) -> Result<Option<ImportReport>> {
        Ok(self.raw.import_state(state).into_result().map_err(self.who.err("import_state"))?.into_option())
    }
}

impl DataHandle {
    pub fn open(&mut self, tokenizer_json: &str) -> Result<DataSummary> {
        self.raw.open(tokenizer_json.into()).into_result().map_err(self.who.err("open"))
    }

    pub fn distill_request(&self) -> Result<DistillRequest> {
        self.raw.distill_request().into_result().map_err(self.who.err("distill_request"))
    }

    pub fn set_distilled(&mut self, replies: Vec<Vec<u32>>) -> Result<DataSummary> {
        let replies = replies.into_iter().map(RVec::from).collect();
        self.raw.set_distilled(replies).into_result().map_err(self.who.err("set_distilled"))
    }

    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        Ok(self.raw.next_batch().into_result().map_err(self.who.err("next_batch"))?.into_option())
    }

    pub fn position(&self) -> Result<DataPosition> {
        self.raw.position().into_result().map_err(self.who.err("position"))
    }

    pub fn seek(&mut self, position: DataPosition) -> Result<()> {
        self.raw.seek(position).into_result().map_err(self.who.err("seek"))
    }

    pub fn eval_prompts(&mut self, source: &str, limit: u32) -> Result<Vec<Vec<u32>>> {
        let out = self.raw.eval_prompts(source.into(), limit).into_result().map_err(self.who.err("eval_prompts"))?;
        Ok(out.into_iter().map(RVec::into_vec).collect())
    }

    pub fn distill_options(&self) -> Result<DistillOptions> {
        self.raw.distill_options().into_result().map_err(self.who.err("distill_options"))
    }

    pub fn validation_batches(&mut self) -> Result<Vec<Batch>> {
        Ok(self.raw.validation_batches().into_result().map_err(self.who.err("validation_batches"))?.into_vec())
    }

    pub fn export_distilled_summary(&self, path: &str) -> Result<DistilledExport> {
        self.raw.export_distilled_summary(path.into()).into_result().map_err(self.who.err("export_distilled"))
    }
}
