//! The export's README.md model card: Hugging Face metadata (YAML front matter), what the drafter
//! is for and how it was trained, the acceptance length measured (when `eval` ran), and the one
//! place in the code that writes the SGLang and vLLM command lines that serve it
//! ([`serving_lines`]; docs/SERVING.md says why each flag is there). The target is named by its
//! hub name where that is known, else by its file or folder name (never by a path of the
//! training machine); a drafter that learned from a quantised GGUF target says so.

use crate::{
    experiment::{self, checkpoint::Opened},
    plugins::Registry,
};
use anyhow::Result;
use plugin_api::describe::TargetFacts;
use std::path::{Component, Path};

/// How the target's layers are built: what the serving flags depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// Attention and dense MLPs (Llama, Qwen2, Qwen3).
    Dense,
    /// Attention and routed experts (Qwen3-MoE).
    Moe,
    /// Gated DeltaNet + attention (Qwen3.5, Qwen3.6), dense MLPs.
    Hybrid,
    /// The hybrid with routed experts (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B).
    HybridMoe,
}

impl TargetKind {
    pub fn is_hybrid(self) -> bool {
        matches!(self, Self::Hybrid | Self::HybridMoe)
    }

    fn words(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Moe => "mixture of experts",
            Self::Hybrid => "hybrid (Gated DeltaNet + attention)",
            Self::HybridMoe => "hybrid (Gated DeltaNet + attention) mixture of experts",
        }
    }

    /// From an HF `model_type` or a GGUF `general.architecture`.
    pub fn of_architecture(arch: &str) -> Option<Self> {
        Some(match arch {
            "llama" | "qwen2" | "qwen3" | "mistral" => Self::Dense,
            "qwen3_moe" | "qwen3moe" | "qwen2_moe" | "qwen2moe" => Self::Moe,
            "qwen3_5" | "qwen35" => Self::Hybrid,
            "qwen3_5_moe" | "qwen35moe" | "qwen3_next" | "qwen3next" => Self::HybridMoe,
            _ => return None,
        })
    }
}

/// What the card says of the target.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// `owner/name` on the Hugging Face Hub, where the run says it.
    pub hub: Option<String>,
    /// The hub revision the run read, where it is not `main` (the servers take `--revision`).
    pub revision: Option<String>,
    /// The hub name, else the file or folder name the weights came from.
    pub name: String,
    pub kind: Option<TargetKind>,
    /// A GGUF file: the quantised tensor types it holds (empty: none; None: not readable now).
    pub gguf_quantised: Option<Option<Vec<String>>>,
    /// The target folder's README license, where it has one.
    pub license: Option<String>,
}

/// `models--Owner--Name` in a path (the Hub cache's layout) as `Owner/Name`.
fn hub_cache_name(path: &Path) -> Option<String> {
    path.components().find_map(|c| match c {
        Component::Normal(s) => s.to_str()?.strip_prefix("models--").map(|n| n.replacen("--", "/", 1)),
        _ => None,
    })
}

/// The `license:` of a model folder's README.md front matter.
fn readme_license(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("README.md")).ok()?;
    let front = text.strip_prefix("---\n")?.split("\n---").next()?;
    front.lines().find_map(|l| l.strip_prefix("license:")).map(|v| v.trim().trim_matches('"').to_string())
}

impl Target {
    /// The run's target: `source` where its weights were read (the manifest's), `configured` the
    /// `[target] path` of its config, `facts` what its plugin reads of it now without its weights
    /// (ABI `check`; None when the files are gone or the plugin cannot tell).
    pub fn of_run(source: &str, configured: Option<&str>, facts: Option<&TargetFacts>) -> Self {
        let path = Path::new(source);
        let hub = configured
            .filter(|c| input_files::is_hub_repo_id(c) && !Path::new(c).exists())
            .map(str::to_string)
            .or_else(|| hub_cache_name(path));
        let file_name = path.file_name().map_or(source.to_string(), |n| n.to_string_lossy().to_string());
        let name = hub.clone().unwrap_or(file_name);
        let kind = facts.and_then(|f| match (f.hybrid, f.mixture_of_experts, f.gguf) {
            (true, true, false) => Some(TargetKind::HybridMoe),
            (true, false, false) => Some(TargetKind::Hybrid),
            (false, true, false) => Some(TargetKind::Moe),
            _ => TargetKind::of_architecture(f.model_type.as_str()),
        });
        let gguf_quantised = source
            .ends_with(".gguf")
            .then(|| facts.filter(|f| f.gguf).map(|f| f.quantised.iter().map(|q| q.to_string()).collect()));
        let license = path.is_dir().then(|| readme_license(path)).flatten();
        Target { hub, revision: None, name, kind, gguf_quantised, license }
    }

    /// What the servers load: the hub name, else the folder name (served from where it is), else
    /// for a GGUF file a placeholder for the HF checkpoint of the same model.
    fn served(&self) -> String {
        match (&self.hub, &self.gguf_quantised) {
            (Some(hub), _) => match &self.revision {
                Some(r) => format!("{hub} --revision {r}"),
                None => hub.clone(),
            },
            (None, Some(_)) => NO_HF_CHECKPOINT.into(),
            (None, None) => self.name.clone(),
        }
    }
}

/// The SGLang and vLLM command lines that serve drafter `drafter` (a folder or hub id) with
/// `target`, for blocks of `block` tokens; `kind` unknown gives the lines for a dense target and
/// says what a hybrid one adds; `sliding` says the drafter has sliding-window layers.
pub fn serving_lines(target: &str, drafter: &str, block: u64, kind: Option<TargetKind>, sliding: bool) -> String {
    let mut sglang = format!(
        "python -m sglang.launch_server \\\n  --model-path {target} \\\n  --speculative-algorithm DFLASH \\\n  \
         --speculative-draft-model-path {drafter} \\\n  --speculative-num-draft-tokens {block} \\\n  \
         --mem-fraction-static 0.75"
    );
    match kind {
        Some(k) if k.is_hybrid() => sglang += " \\\n  --mamba-scheduler-strategy extra_buffer",
        Some(_) => {}
        None => sglang += "\n# a Qwen3.5 / Qwen3.6 (hybrid) target also needs: --mamba-scheduler-strategy extra_buffer",
    }
    let vllm = format!(
        "vllm serve {target} \\\n  --speculative-config '{{\"method\": \"dflash\", \"model\": \"{drafter}\", \
         \"num_speculative_tokens\": {}}}' \\\n  --attention-backend flash_attn \\\n  --max-num-batched-tokens 32768",
        block.saturating_sub(1)
    );
    let mut text = format!("SGLang:\n\n```sh\n{sglang}\n```\n\nvLLM:\n\n```sh\n{vllm}\n```\n");
    if sliding {
        text += "\nThe drafter has sliding-window layers (`layer_types`): serve it with a build that supports a \
                 drafter's interleaved sliding-window attention (z-lab's DFlash README names the vLLM one).\n";
    }
    text
}

/// What serving an export takes: the target the servers load, and the drafter's shape.
#[derive(Debug, Clone)]
pub struct Serving {
    /// The target as the model card names it (a hub name, else the folder's name: no path of
    /// this machine in a card that travels with the drafter).
    pub target: String,
    /// The target as the servers load it on this machine: the hub name (and revision) the
    /// manifest records, else the folder's absolute path, else (a GGUF target)
    /// [`NO_HF_CHECKPOINT`].
    pub target_here: String,
    pub block: u64,
    pub kind: Option<TargetKind>,
    pub sliding: bool,
}

impl Serving {
    /// The SGLang and vLLM command lines, with the drafter at `drafter` (a folder or hub id).
    pub fn lines(&self, drafter: &str) -> String {
        serving_lines(&self.target, drafter, self.block, self.kind, self.sliding)
    }

    /// The lines as they run on this machine, the target at [`Serving::target_here`].
    pub fn lines_here(&self, drafter: &str) -> String {
        serving_lines(&self.target_here, drafter, self.block, self.kind, self.sliding)
    }
}

/// What stands for the target in the serving lines when it was a GGUF file: no HF checkpoint of it
/// is known, and the servers load one.
pub const NO_HF_CHECKPOINT: &str = "HF_CHECKPOINT_OF_THE_TARGET";

/// An export's model card and what serving it takes.
pub struct Card {
    pub text: String,
    pub serving: Serving,
}

/// What the run's target plugin reads of its target now, from the run's `[target]` section
/// resolved as the run resolved it (None: the plugin is not here, or the files are gone).
fn target_facts(run: &toml::Table, manifest: &experiment::Manifest, registry: &Registry) -> Option<TargetFacts> {
    let table = run.get("target")?.as_table()?;
    let section = crate::bench::train::section("target", table).ok()?;
    let plugin = registry.find(plugin_api::PluginKind::Target, &section.plugin).ok()?;
    let ctx = crate::plugins::host_context(
        "cpu",
        "f32",
        0,
        Path::new(&manifest.config_dir),
        &crate::environment::cache_dir(),
    );
    plugin.check(&section, &ctx).ok()?.target.into_option()
}

/// The model card of checkpoint `ckpt` of `exp_dir`, exported to `out`.
pub fn model_card(exp_dir: &Path, ckpt: &Opened, out: &Path, registry: &Registry) -> Result<Card> {
    let manifest = experiment::Manifest::read(exp_dir)?;
    let cfg: serde_json::Value = serde_json::from_str(&ckpt.config_json)?;
    let run: toml::Table = toml::from_str(&std::fs::read_to_string(exp_dir.join(experiment::CONFIG))?)?;
    let field = |section: &str, key: &str| {
        run.get(section).and_then(|s| s.get(key)).map(|v| v.to_string().trim_matches('"').to_string())
    };
    let text = |section: &str, key: &str, or: &str| field(section, key).unwrap_or_else(|| or.to_string());
    let file_name = |p: String| Path::new(&p).file_name().map_or(p.clone(), |n| n.to_string_lossy().to_string());
    let facts = target_facts(&run, &manifest, registry);
    let mut target = Target::of_run(&manifest.target_source, field("target", "path").as_deref(), facts.as_ref());
    if let Some(h) = &manifest.target_hub {
        // The manifest knows the hub name and revision the run resolved.
        target.hub = Some(h.repo.clone());
        target.revision = (h.revision != "main").then(|| h.revision.clone());
    }
    let block = cfg["block_size"].as_u64().unwrap_or(16);
    let id = |k: &str| if cfg[k].is_null() { "none".to_string() } else { cfg[k].to_string() };
    let drafter = out.file_name().map_or("DRAFTER".into(), |n| n.to_string_lossy().to_string());
    let sliding = cfg["layer_types"].as_array().is_some_and(|t| t.iter().any(|l| l == "sliding_attention"));
    let tau = acceptance(exp_dir);

    // 1. Hugging Face metadata.
    let mut card = hf_metadata(&target);
    // 2. What it is, how it was trained.
    card += &format!("# DFlash drafter for `{}`\n\n", target.name);
    card +=
        "A block-diffusion speculative-decoding drafter (DFlash): it reads the target's hidden states and drafts a \
             block of tokens in one forward; the target verifies them, so the output is the target's own. It borrows \
             the target's embedding and LM head and works only with this target.\n\n";
    card += &quantised_warning(&target);
    card += "| | |\n| --- | --- |\n";
    let kind = target.kind.map_or(String::new(), |k| format!(", {}", k.words()));
    card += &format!("| target | `{}`{kind} (SHA-256 `{}`) |\n", target.name, manifest.target_sha256);
    card += &format!(
        "| target token ids | bos {}, eos {}, pad {} |\n",
        id("bos_token_id"),
        id("eos_token_id"),
        id("pad_token_id")
    );
    card +=
        &format!("| data | `{}` (format {}) |\n", file_name(text("data", "path", "?")), text("data", "format", "auto"));
    card += &format!(
        "| training | step {} of {}, seed {}, optimizer {} |\n",
        ckpt.step,
        text("train", "steps", "?"),
        manifest.seed,
        text("optimizer", "plugin", "?")
    );
    card += &format!(
        "| drafter | layers: {}, block size {block}, target layers {} |\n",
        cfg["num_hidden_layers"], cfg["dflash_config"]["target_layer_ids"]
    );
    card += "| weights | bfloat16 (`model.safetensors`) |\n";
    card += &format!("| acceptance length | {tau} |\n\n");
    // 3. Serving.
    let (serving_text, serving) = serving_section(&target, &manifest, &drafter, block, sliding);
    card += &serving_text;
    card += &transformers_section(&drafter, block, &cfg);
    Ok(Card { text: card, serving })
}

/// The acceptance length `eval.json` measured, in words, or how to measure it.
fn acceptance(exp_dir: &Path) -> String {
    let eval = experiment::read_json::<serde_json::Value>(&exp_dir.join("eval.json")).ok();
    match &eval {
        Some(e) => {
            let at =
                e["evaluated"]["checkpoint_step"].as_u64().map_or(String::new(), |s| format!(", checkpoint step-{s}"));
            let decoding = match e["max_new_tokens"].as_u64() {
                Some(n) => {
                    format!(", {} decoding of at most {n} new tokens each", e["decoding"].as_str().unwrap_or("greedy"))
                }
                None => String::new(),
            };
            format!(
                "τ {:.3} per response, {:.3} over {} verify cycles (accepted + 1 per cycle), on {} prompts ({}{at}){decoding}; lossless: {}",
                e["tau"].as_f64().unwrap_or(f64::NAN),
                e["tau_pooled"].as_f64().unwrap_or(f64::NAN),
                e["cycles"],
                e["prompts"],
                e["source"].as_str().unwrap_or("?"),
                e["lossless"]
            )
        }
        None => "not measured (run `dflash-host eval --exp-dir EXP`, then export again)".into(),
    }
}

/// The Hugging Face metadata: the YAML front matter.
fn hf_metadata(target: &Target) -> String {
    let mut card = "---\nlibrary_name: transformers\n".to_string();
    if let Some(hub) = &target.hub {
        card += &format!("base_model: {hub}\n");
    }
    if let Some(license) = &target.license {
        card += &format!("license: {license}\n");
    }
    card += "tags:\n- dflash\n- speculative-decoding\n- block-diffusion\n- draft-model\n---\n\n";
    card
}

/// A warning when the target was a GGUF file whose weights are quantised, or could not be read.
fn quantised_warning(target: &Target) -> String {
    if let Some(Some(types)) = &target.gguf_quantised {
        if !types.is_empty() {
            return format!(
                "> **Warning:** this drafter learned from a quantised target, the GGUF file `{}` ({} weights): it read \
                 that model's hidden states. Next to the full-precision checkpoint its acceptance can be lower than \
                 measured here; serve it with the same quantised model, or train on the full-precision target.\n\n",
                target.name,
                types.join(", ")
            );
        }
    } else if let Some(None) = &target.gguf_quantised {
        return format!(
            "> **Warning:** this drafter learned from the GGUF file `{}`, which could not be read at export to say \
             whether its weights are quantised; a drafter that learned from a quantised model's hidden states can \
             accept less next to the full-precision checkpoint.\n\n",
            target.name
        );
    }
    String::new()
}

/// How to serve it: SGLang's and vLLM's command lines, with the target they load.
fn serving_section(
    target: &Target,
    manifest: &experiment::Manifest,
    drafter: &str,
    block: u64,
    sliding: bool,
) -> (String, Serving) {
    let mut card = String::new();
    card += "## Serving\n\n";
    card += &format!(
        "`{drafter}` below is this folder: give its path, or its hub id once uploaded. The lines are those of the \
         servers' DFlash support (SGLang's `DFLASH` algorithm, vLLM's `dflash` method)"
    );
    card += match target.kind {
        Some(k) if k.is_hybrid() => {
            "; the target is a hybrid, so SGLang keeps its recurrent state in the buffers speculative decoding needs \
             (`--mamba-scheduler-strategy extra_buffer`).\n\n"
        }
        _ => ".\n\n",
    };
    if target.hub.is_none() && target.gguf_quantised.is_some() {
        card += "The target was read from a GGUF file; the servers load the same model as an HF checkpoint.\n\n";
    } else if target.hub.is_none() {
        card += &format!("`{}` is the folder the target was read from.\n\n", target.name);
    }
    let target_here = match (&target.hub, &target.gguf_quantised) {
        (None, None) => {
            let source = Path::new(&manifest.target_source);
            let abs = source.canonicalize().or_else(|_| std::path::absolute(source));
            abs.map_or(manifest.target_source.clone(), |p| p.display().to_string())
        }
        _ => target.served(),
    };
    let serving = Serving { target: target.served(), target_here, block, kind: target.kind, sliding };
    card += &serving.lines(drafter);
    (card, serving)
}

/// Loading it with transformers, and the shapes its forward takes.
fn transformers_section(drafter: &str, block: u64, cfg: &serde_json::Value) -> String {
    let mut card = String::new();
    card += "\n## Transformers\n\n";
    card += &format!(
        "```python\nfrom transformers import AutoModel\n\ndrafter = AutoModel.from_pretrained(\"{drafter}\", \
         trust_remote_code=True)\n# target_hidden [B, S, {n} x hidden] (the target layers above), block_embeds [B, A x \
         {block}, hidden], anchors [B, A]\nhidden = drafter(target_hidden, block_embeds, anchors)  # then the target's \
         LM head\n```\n\n`dflash.py` holds the drafter's forward (the z-lab layout, written for this export).\n",
        n = cfg["dflash_config"]["target_layer_ids"].as_array().map_or(0, Vec::len)
    );
    card
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_is_named_by_its_hub_name_or_file_never_a_path() {
        let t = Target::of_run("/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/abc123", None, None);
        assert_eq!((t.hub.as_deref(), t.name.as_str()), (Some("Qwen/Qwen3-8B"), "Qwen/Qwen3-8B"));
        let t = Target::of_run("/data/models/Qwen3.5-35B-A3B", Some("Qwen/Qwen3.5-35B-A3B"), None);
        assert_eq!(t.name, "Qwen/Qwen3.5-35B-A3B");
        let t = Target::of_run("/data/models/Qwen3.5-35B-A3B", Some("/data/models/Qwen3.5-35B-A3B"), None);
        assert_eq!((t.hub, t.name.as_str()), (None, "Qwen3.5-35B-A3B"));
        let t = Target::of_run("/gone/SmolLM2-135M-Instruct.Q4_1.gguf", None, None);
        assert_eq!((t.name.as_str(), t.gguf_quantised.clone()), ("SmolLM2-135M-Instruct.Q4_1.gguf", Some(None)));
        assert_eq!(t.served(), "HF_CHECKPOINT_OF_THE_TARGET");
    }

    #[test]
    fn a_hybrid_target_gets_sglangs_mamba_buffers_and_an_unknown_one_is_told() {
        let lines = |kind| serving_lines("Qwen/Qwen3.5-4B", "d", 16, kind, false);
        for kind in [TargetKind::Hybrid, TargetKind::HybridMoe] {
            assert!(lines(Some(kind)).contains("  --mamba-scheduler-strategy extra_buffer\n```"), "{kind:?}");
        }
        for kind in [TargetKind::Dense, TargetKind::Moe] {
            assert!(!lines(Some(kind)).contains("mamba"), "{kind:?}");
        }
        assert!(lines(None).contains("\n# a Qwen3.5 / Qwen3.6 (hybrid) target also needs: --mamba-scheduler-strategy"));
        let all = lines(Some(TargetKind::Dense));
        for want in [
            "--speculative-algorithm DFLASH",
            "--speculative-draft-model-path d",
            "--speculative-num-draft-tokens 16",
            "\"num_speculative_tokens\": 15",
            "--attention-backend flash_attn",
            "--max-num-batched-tokens 32768",
        ] {
            assert!(all.contains(want), "{want}: {all}");
        }
    }
}
