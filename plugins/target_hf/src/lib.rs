//! `target_hf`: decoders in tch, loaded from an HF folder or a GGUF file, every family of
//! `families::FAMILIES`: Llama (Mistral, Ministral), Qwen2, Qwen3, Qwen3-MoE, the Qwen3.5 /
//! Qwen3.6 hybrids (Gated DeltaNet + gated attention; dense and MoE), Gemma 2 and 3, gpt-oss,
//! LFM2, DeepSeek-V3 (Kimi-K2), GLM-4.5 and LongCat-Flash. The target is frozen: forward passes
//! run without autograd.

pub mod attention;
pub mod cache;
pub mod common;
pub mod config;
pub mod decode_graph;
pub mod families;
pub mod flops;
pub mod generate;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod hub;
pub mod layer;
pub mod linear;
pub mod load;
mod longcat;
pub mod memory;
pub mod mla;
pub mod model;
pub mod moe;
pub mod quant;
pub mod qwen3_5;
pub mod random;
pub mod rope;
pub mod short_conv;
pub mod tp;
pub mod weights;

use model::Decoder;
use plugin_api::{
    tch::{Device, Kind, Tensor},
    HostContext, PluginError, PluginInfo, PluginInstance, PluginKind, TargetPlugin, TargetSpec,
};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The `[target]` config section.
#[derive(Debug, Clone, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct TargetSection {
    /// A GGUF file or an HF folder. Relative paths are against the config file's folder;
    /// a leading `$DFLASH_CACHE/` means the cache folder. An `owner/name` that is no local
    /// path is a Hub model, from the HF cache or downloaded into it (`hub.rs`).
    pub path: String,
    /// The Hub model's branch, tag or commit (default `main`).
    #[serde(default)]
    pub revision: Option<String>,
    /// Random weights at the shape of `path`, an HF config.json (or a folder holding one; a
    /// tokenizer.json beside it there is the tokenizer, else a placeholder that reads a text as one
    /// token). For benchmarks at real shapes (`dflash-host bench train`, or `train` on a dataset).
    #[serde(default)]
    pub random_init: bool,
    /// Prompts generated together during self-distillation.
    #[describe(range = ">= 1")]
    #[serde(default = "default_gen_batch")]
    pub generate_batch_size: usize,
    /// Ranks one replica of the target is spread over, its heads and MLP widths split between
    /// them (the run needs a multiple of it; `config explain target` lists the families that split).
    #[describe(range = ">= 1")]
    #[serde(default = "one")]
    pub tensor_parallel: usize,
    /// Groups of a replica's ranks its routed experts are split over (MoE families; divides
    /// `tensor_parallel`).
    #[describe(range = ">= 1")]
    #[serde(default = "one")]
    pub expert_parallel: usize,
    /// The precision of the target's dense projections (attention's q|k|v and o, latent
    /// attention's, the gated MLPs, the Gated DeltaNet layers' projections): `bf16` runs them in the model's dtype (a
    /// quantised checkpoint dequantised on load); `fp8` as FP8 block-scaled GEMMs, the way
    /// serving engines run FP8 checkpoints on Hopper (a CUDA device of compute capability 9.x
    /// only): an FP8 block-scaled checkpoint's weights stay FP8, others are quantised at load in
    /// 128x128 blocks. Embeddings, LM head, norms, routers and routed experts stay in the model's
    /// dtype.
    #[serde(default)]
    pub compute: linear::Compute,
}

fn one() -> usize {
    1
}

fn default_gen_batch() -> usize {
    16
}

pub struct HfTarget {
    pub model: Decoder,
    pub tokenizer: tokenizers::Tokenizer,
    pub spec: TargetSpec,
    pub generate_batch_size: usize,
    /// The incremental-decoding session (`cache_*`), able to roll back into its last extension.
    pub session: cache::Cache,
    /// The session on a static cache with CUDA graphs (`decode_graph.rs`), made at the first
    /// decoding call on a CUDA device where the model can keep one; it then serves `cache_*` and
    /// single-prompt `generate`. `Err`: why not (said once).
    graphed: Option<Result<decode_graph::StaticDecoding, String>>,
    /// Where the replica's group is made, at the first forward (every rank has loaded by then).
    pub pending_group: Option<tp::Rendezvous>,
}

impl HfTarget {
    /// The whole model at `path`, on one device.
    pub fn load(path: &Path, device: Device, kind: Kind, generate_batch_size: usize) -> Result<Self, String> {
        Self::load_shard(path, device, kind, generate_batch_size, tp::Shard::WHOLE, None)
    }

    /// Random weights at the shape of the config.json `path` (see `TargetSection::random_init`).
    pub fn random(path: &Path, device: Device, kind: Kind, generate_batch_size: usize) -> Result<Self, String> {
        Self::random_shard(path, device, kind, generate_batch_size, tp::Shard::WHOLE, None)
    }

    /// This rank's part of the model at `path` (`tp.rs`): only its rows and columns of each
    /// weight are read; `tp` is the replica's group, every rank of which loads at the same time.
    pub fn load_shard(
        path: &Path,
        device: Device,
        kind: Kind,
        generate_batch_size: usize,
        shard: tp::Shard,
        tp: Option<tp::TpGroup>,
    ) -> Result<Self, String> {
        Self::load_shard_with(path, device, kind, generate_batch_size, shard, tp, linear::Compute::Bf16)
    }

    /// [`load_shard`](Self::load_shard) with the projections in `compute`'s precision.
    pub fn load_shard_with(
        path: &Path,
        device: Device,
        kind: Kind,
        generate_batch_size: usize,
        shard: tp::Shard,
        tp: Option<tp::TpGroup>,
        compute: linear::Compute,
    ) -> Result<Self, String> {
        let load::Loaded { cfg, weights, tokenizer, chat_template } = load::load(path)?;
        let model = Decoder::new_shard_with(&cfg, weights, device, kind, shard, tp, compute)?;
        Self::new(model, tokenizer, chat_template, path, generate_batch_size)
    }

    /// Random weights at the shape of `path` (see [`random`](Self::random)), this rank's part.
    pub fn random_shard(
        path: &Path,
        device: Device,
        kind: Kind,
        generate_batch_size: usize,
        shard: tp::Shard,
        tp: Option<tp::TpGroup>,
    ) -> Result<Self, String> {
        Self::random_shard_with(path, device, kind, generate_batch_size, shard, tp, linear::Compute::Bf16)
    }

    /// [`random_shard`](Self::random_shard) with the projections in `compute`'s precision.
    pub fn random_shard_with(
        path: &Path,
        device: Device,
        kind: Kind,
        generate_batch_size: usize,
        shard: tp::Shard,
        tp: Option<tp::TpGroup>,
        compute: linear::Compute,
    ) -> Result<Self, String> {
        let (cfg, tokenizer) = random::config_and_tokenizer(path)?;
        let model = Decoder::random_shard_with(&cfg, device, kind, shard, tp, compute)?;
        Self::new(model, tokenizer, String::new(), path, generate_batch_size)
    }

    /// Join the replica's group if it is not yet made.
    fn join_group(&mut self) -> Result<(), PluginError> {
        if let Some(r) = self.pending_group.take() {
            self.model.tp = Some(tp::TpGroup::join(&r, self.model.device()).map_err(PluginError::new)?);
        }
        Ok(())
    }

    /// A failed collective of the last forward (tensor parallelism), naming the rank gone.
    fn check_group(&self) -> Result<(), String> {
        self.model.tp.as_ref().map_or(Ok(()), tp::TpGroup::check)
    }

    fn new(
        model: Decoder,
        tokenizer: tokenizers::Tokenizer,
        chat_template: String,
        path: &Path,
        generate_batch_size: usize,
    ) -> Result<Self, String> {
        let spec = TargetSpec {
            chat_template: chat_template.into(),
            source: path.display().to_string().into(),
            source_sha256: sha256_path(path)?.into(),
            ..model.cfg.target_spec().ok_or_else(|| format!("{}: no EOS token id", path.display()))?
        };
        let session = model.new_cache(true);
        Ok(Self { model, tokenizer, spec, generate_batch_size, session, graphed: None, pending_group: None })
    }

    /// Features of `layer_ids` concatenated [B, S, n*H] and optionally logits, for right-padded
    /// ids (causal attention, so padding at the end changes nothing before it).
    pub fn features(
        &self,
        ids: &Tensor,
        layer_ids: &[u32],
        want_logits: bool,
    ) -> Result<(Tensor, Option<Tensor>), String> {
        let n = self.model.cfg.num_hidden_layers;
        if let Some(bad) = layer_ids.iter().find(|&&i| i as usize >= n) {
            return Err(format!("layer id {bad} out of range (the target has {n} layers)"));
        }
        let _guard = plugin_api::tch::no_grad_guard();
        let ids = ids.to_device(self.model.device());
        let (b, s) = (ids.size()[0], ids.size()[1]);
        let positions = Tensor::arange(s, (Kind::Int64, ids.device())).unsqueeze(0).expand([b, s], false);
        // Only the layers up to the deepest feature are needed unless logits are.
        let upto = if want_logits { n } else { layer_ids.iter().max().map_or(0, |&m| m as usize + 1) };
        let (hidden, normed) = self.model.run(&ids, &positions, None, None, None, upto, layer_ids);
        let logits = normed.map(|h| self.model.logits(&h));
        self.check_group()?;
        Ok((hidden, logits))
    }
}

impl HfTarget {
    /// The static-cache session, where decoding runs on one (a CUDA device, graphs not turned
    /// off, a model that can keep one).
    fn graphed(&mut self) -> Option<(&Decoder, &mut decode_graph::StaticDecoding)> {
        if self.graphed.is_none() && self.model.device().is_cuda() && kernels::cuda_graph::enabled() {
            let made = decode_graph::StaticDecoding::new(&self.model);
            if let Err(why) = &made {
                eprintln!("target: decoding runs op by op, without CUDA graphs: {why}");
            }
            self.graphed = Some(made);
        }
        match &mut self.graphed {
            Some(Ok(g)) => Some((&self.model, g)),
            _ => None,
        }
    }

    /// Extend the session's cache by `ids` [1, L]: features of `layer_ids` and logits.
    pub fn extend(&mut self, ids: &Tensor, layer_ids: &[u32]) -> Result<(Tensor, Tensor), String> {
        let n = self.model.cfg.num_hidden_layers;
        if let Some(bad) = layer_ids.iter().find(|&&i| i as usize >= n) {
            return Err(format!("layer id {bad} out of range (the target has {n} layers)"));
        }
        let _guard = plugin_api::tch::no_grad_guard();
        if let Some((model, g)) = self.graphed() {
            return g.extend(model, ids, layer_ids);
        }
        let device = self.model.device();
        let ids = ids.to_device(device);
        let (past, l) = (self.session.len(), ids.size()[1]);
        let positions = Tensor::arange_start(past, past + l, (Kind::Int64, device)).unsqueeze(0);
        // Query i sees every cached key and the new keys up to itself.
        let q = Tensor::arange_start(past, past + l, (Kind::Int64, device)).unsqueeze(1);
        let k = Tensor::arange(past + l, (Kind::Int64, device)).unsqueeze(0);
        let mask = k.le_tensor(&q).unsqueeze(0).unsqueeze(0);
        let (hidden, normed) =
            self.model.run(&ids, &positions, Some(&mask), None, Some(&mut self.session), n, layer_ids);
        self.check_group()?;
        Ok((hidden, self.model.logits(&normed.expect("all layers ran"))))
    }
}

/// SHA-256 over the regular files of the folder `path` (in name order; a hub snapshot's links
/// followed), or of the file `path`; each opened through `input_files`, so none is a FIFO.
fn sha256_path(path: &Path) -> Result<String, String> {
    let mut h = Sha256::new();
    let files: Vec<PathBuf> = match input_files::check_path(path).map_err(|e| e.to_string())? {
        input_files::PathKind::Dir => {
            let entries = std::fs::read_dir(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut f: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
            f.sort();
            f
        }
        input_files::PathKind::File => vec![path.to_path_buf()],
    };
    for f in files {
        let mut file = input_files::open_regular(&f).map_err(|e| e.to_string())?;
        std::io::copy(&mut file, &mut h).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    Ok(format!("{:x}", h.finalize()))
}

impl TargetPlugin for HfTarget {
    fn spec(&self) -> TargetSpec {
        self.spec.clone()
    }

    fn tokenizer_json(&self) -> String {
        self.tokenizer.to_string(false).expect("tokenizer serializes")
    }

    fn embedding(&self) -> Tensor {
        self.model.embed_tokens.shallow_clone()
    }

    fn lm_head(&self) -> Tensor {
        self.model.lm_head.shallow_clone()
    }

    fn forward(
        &mut self,
        input_ids: &Tensor,
        layer_ids: &[u32],
        want_logits: bool,
    ) -> Result<(Tensor, Option<Tensor>), PluginError> {
        self.join_group()?;
        self.features(input_ids, layer_ids, want_logits).map_err(PluginError::new)
    }

    fn generate(
        &mut self,
        prompts: Vec<Vec<u32>>,
        max_new_tokens: u32,
        stop_tokens: &[u32],
    ) -> Result<Vec<Vec<u32>>, PluginError> {
        self.join_group()?;
        if let ([prompt], Some((model, g))) = (prompts.as_slice(), self.graphed()) {
            let reply = generate::greedy_static(model, g, prompt, max_new_tokens as usize, stop_tokens);
            return Ok(vec![reply.map_err(PluginError::new)?]);
        }
        let replies =
            generate::greedy(&self.model, &prompts, max_new_tokens as usize, stop_tokens, self.generate_batch_size);
        self.check_group().map_err(PluginError::new)?;
        Ok(replies)
    }

    fn cache_reset(&mut self) {
        match self.graphed() {
            Some((_, g)) => g.reset(),
            None => self.session = self.model.new_cache(true),
        }
    }

    fn cache_extend(&mut self, input_ids: &Tensor, layer_ids: &[u32]) -> Result<(Tensor, Tensor), PluginError> {
        self.join_group()?;
        self.extend(input_ids, layer_ids).map_err(PluginError::new)
    }

    fn cache_truncate(&mut self, len: u32) -> Result<(), PluginError> {
        match self.graphed.as_mut().and_then(|g| g.as_mut().ok()) {
            Some(g) => g.truncate(&self.model, len as i64),
            None => self.model.truncate(&mut self.session, len as i64),
        }
        .map_err(PluginError::new)
    }
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "hf",
        PluginKind::Target,
        env!("CARGO_PKG_VERSION"),
        "Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5 / Gemma 2-3 / gpt-oss / LFM2 / DeepSeek-V3 / GLM-4.5 / LongCat-Flash decoder from an HF folder or a GGUF file",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let section: TargetSection = plugin_api::parse_section(config)?;
    if section.generate_batch_size == 0 {
        return Err(PluginError::new("field `generate_batch_size`: must be >= 1"));
    }
    let path = hub::target_path(&section.path, ctx.resolve_path(&section.path), section.revision.as_deref())
        .map_err(PluginError::new)?;
    let (device, kind) = (ctx.tch_device()?, ctx.tch_kind()?);
    check_compute(section.compute, device)?;
    let (shard, rendezvous) = replica(&section, ctx)?;
    let build = if section.random_init { HfTarget::random_shard_with } else { HfTarget::load_shard_with };
    let mut target = build(&path, device, kind, section.generate_batch_size, shard, None, section.compute)
        .map_err(|e| PluginError::new(if e.starts_with("field `") { e } else { format!("field `path`: {e}") }))?;
    target.pending_group = rendezvous;
    Ok(PluginInstance::target(target))
}

/// `compute = "fp8"` needs the block-scaled FP8 GEMM: a CUDA device of compute capability 9.x.
pub fn check_compute(compute: linear::Compute, device: Device) -> Result<(), PluginError> {
    if compute == linear::Compute::Fp8 && !kernels::fp8::gemm_supported(device) {
        let on = match device {
            Device::Cuda(i) => format!("CUDA device {i}, which is not of compute capability 9.x (Hopper)"),
            Device::Cpu => "the CPU".to_string(),
            other => format!("{other:?}"),
        };
        return Err(PluginError::new(format!(
            "field `compute` = \"fp8\": FP8 GEMMs run on a CUDA device of compute capability 9.x (Hopper) only; \
             this run is on {on}: use compute = \"bf16\""
        )));
    }
    Ok(())
}

/// This rank's part of the target and where its replica meets, from `tensor_parallel` /
/// `expert_parallel` and the replica the host formed.
fn replica(section: &TargetSection, ctx: &HostContext) -> Result<(tp::Shard, Option<tp::Rendezvous>), PluginError> {
    let (t, e) = (section.tensor_parallel, section.expert_parallel);
    let shard = |rank: usize| tp::Shard::new(rank, t.max(1), e).map_err(PluginError::new);
    match (ctx.replica.as_ref().into_option(), t) {
        (_, 0) => Err(PluginError::new("field `tensor_parallel`: must be >= 1")),
        (None, 1) => Ok((shard(0)?, None)),
        (None, t) => Err(PluginError::new(format!(
            "field `tensor_parallel` = {t}: a replica of {t} ranks needs the run launched over a multiple of {t} ranks \
             (`train --nproc N` or torchrun)"
        ))),
        (Some(g), t) if g.size as usize != t => Err(PluginError::new(format!(
            "field `tensor_parallel` = {t}: the host formed replicas of {} ranks",
            g.size
        ))),
        (Some(g), _) => Ok((
            shard(g.rank as usize)?,
            (t > 1).then(|| tp::Rendezvous {
                store: g.store.to_string(),
                prefix: g.prefix.to_string(),
                rank: g.rank as usize,
                size: t,
                timeout: std::time::Duration::from_secs(g.timeout_s),
            }),
        )),
    }
}

impl TargetSection {
    /// Where `path` is, as `create` finds it (one lookup): a local file or folder, a hub model in
    /// the local cache, or one to download.
    fn locate(&self, ctx: &HostContext) -> Result<hub::Location, PluginError> {
        hub::locate(&self.path, ctx.resolve_path(&self.path), self.revision.as_deref())
            .map_err(|e| PluginError::new(format!("field `path`: {e}")))
    }

    /// The checkpoint's config.json, where `path` is an HF folder or file that is here (None for
    /// a GGUF file or a model still to download).
    fn decoder_config(&self, ctx: &HostContext) -> Result<Option<config::DecoderConfig>, PluginError> {
        Ok(match self.locate(ctx)? {
            hub::Location::Local(p) | hub::Location::Snapshot { path: p, .. } => config::DecoderConfig::read(&p).ok(),
            hub::Location::NotCached(_) => None,
        })
    }
}

impl TargetSection {
    /// What the checkpoint's config (or a GGUF file's metadata) says, without the weights.
    fn facts(&self, ctx: &HostContext) -> Result<Option<plugin_api::describe::TargetFacts>, PluginError> {
        use plugin_api::describe::TargetFacts;
        let path = match self.locate(ctx)? {
            hub::Location::Local(p) | hub::Location::Snapshot { path: p, .. } => p,
            hub::Location::NotCached(_) => return Ok(None),
        };
        if path.extension().is_some_and(|e| e == "gguf") {
            let Ok(g) = gguf::GgufFile::open(&path) else { return Ok(None) };
            let arch = g.meta_str("general.architecture").unwrap_or_default().to_string();
            let mut quantised: Vec<String> = g
                .tensors()
                .iter()
                .map(|t| t.ggml_type.name().to_string())
                .filter(|t| !matches!(t.as_str(), "F32" | "F16" | "BF16" | "F64"))
                .collect();
            quantised.sort();
            quantised.dedup();
            let layers = g.meta_u64(&format!("{arch}.block_count")).unwrap_or(0) as u32;
            let moe = g.meta_u64(&format!("{arch}.expert_count")).is_ok_and(|n| n > 0);
            return Ok(Some(TargetFacts {
                model_type: arch.into(),
                num_hidden_layers: layers,
                mixture_of_experts: moe,
                hybrid: false,
                gguf: true,
                quantised: quantised.into_iter().map(Into::into).collect(),
            }));
        }
        Ok(self.decoder_config(ctx)?.map(|c| TargetFacts {
            model_type: c.model_type.clone().into(),
            num_hidden_layers: c.num_hidden_layers as u32,
            mixture_of_experts: c.moe().is_some(),
            hybrid: c.is_hybrid(),
            ..TargetFacts::default()
        }))
    }
}

impl plugin_api::Section for TargetSection {
    /// The fields, and `path` found as `create` will find it, without reading the weights.
    fn check(&self, ctx: &HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        use plugin_api::describe::{HubModel, InputFile, SectionCheck};
        if self.generate_batch_size == 0 {
            return Err(PluginError::new("field `generate_batch_size`: must be >= 1"));
        }
        let mut check = SectionCheck::default();
        let shard = tp::Shard::new(0, self.tensor_parallel, self.expert_parallel).map_err(PluginError::new)?;
        match self.locate(ctx)? {
            hub::Location::Local(_) => check.inputs.push(InputFile::existing("path", &self.path, ctx)?),
            hub::Location::Snapshot { repo, revision, commit, path } => {
                let path: String = path.display().to_string();
                // The snapshot is what the run reads: the manifest hashes it as `path`.
                check.inputs.push(InputFile { field: "path".into(), path: path.clone().into() });
                check.hub = Some(HubModel {
                    repo: repo.into(),
                    revision: revision.into(),
                    commit: commit.into(),
                    path: path.into(),
                })
                .into();
            }
            hub::Location::NotCached(missing) if hub::offline() => {
                return Err(PluginError::new(format!(
                    "field `path`: {missing}; not downloaded, as HF_HUB_OFFLINE is set"
                )))
            }
            hub::Location::NotCached(_) => {} // `create` downloads it
        }
        // The model splits as `tensor_parallel` / `expert_parallel` say.
        if !shard.is_whole() || self.expert_parallel > 1 {
            if let Some(cfg) = self.decoder_config(ctx)? {
                tp::check(&cfg, shard).map_err(PluginError::new)?;
            }
        }
        check.target = self.facts(ctx)?.into();
        Ok(check)
    }

    fn notes() -> String {
        format!(
            "The families it loads, by the `model_type` of the checkpoint's config.json:\n\n{}",
            families::markdown()
        )
    }

    /// Counted by architecture from the checkpoint's config.json (hybrid and MoE layers, active
    /// experts only); unknown for a GGUF file.
    fn target_flops(
        &self,
        ctx: &HostContext,
        q: plugin_api::describe::FlopsQuery,
    ) -> Result<Option<Vec<plugin_api::describe::FlopsPart>>, PluginError> {
        let Some(cfg) = self.decoder_config(ctx)? else { return Ok(None) };
        let f = flops::forward(&cfg, q.layers as usize, q.batch as usize, q.seq_len as usize, q.logits);
        let part = |name: &str, flop: f64| plugin_api::describe::FlopsPart { name: name.into(), flop };
        Ok(Some(vec![
            part("attention", f.attention),
            part("gdn", f.gdn),
            part("conv", f.conv),
            part("mlp", f.mlp),
            part("head", f.head),
        ]))
    }

    /// Its weights on one rank and the forward's working set at the query, from the checkpoint's
    /// config.json (`memory.rs`); unknown for a GGUF file.
    fn memory(
        &self,
        ctx: &HostContext,
        q: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>, PluginError> {
        use plugin_api::describe::{MemoryPart, MemoryScale, SectionMemory};
        let Some(cfg) = self.decoder_config(ctx)? else { return Ok(None) };
        let elem = match ctx.tch_kind()? {
            Kind::Float => 4.0,
            _ => 2.0,
        };
        let (tp, fp8) = (self.tensor_parallel, self.compute == linear::Compute::Fp8);
        let weights = memory::weight_bytes(&cfg, tp, elem, fp8);
        let (shape, layers) = ((q.batch as usize, q.seq_len as usize), q.layers as usize);
        let working = memory::forward_working_set(&cfg, shape, layers, q.logits, tp, (elem, fp8));
        Ok(Some(SectionMemory {
            parts: vec![
                MemoryPart::new("target weights", weights, MemoryScale::TargetWeights),
                MemoryPart::new("target forward (working set)", working, MemoryScale::Batch),
            ]
            .into(),
            target: cfg.target_spec().into(),
            ..SectionMemory::default()
        }))
    }
}

plugin_api::declare_plugin!(target_hf, info, create, section = TargetSection);
