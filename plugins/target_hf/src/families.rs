//! The model families the target loads: the HF `model_type`s each answers to, how its layers
//! are built, and the parallelism it runs with. One table: the unknown-`model_type` error,
//! `dflash-host config explain target` and docs/CONFIG.md are all read from it.

/// The families, by how their layers are built ([`FAMILIES`] maps `model_type`s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama's layout: Llama, Mistral and Ministral (their sliding windows from the config).
    Llama,
    Qwen2,
    Qwen3,
    /// Qwen3 attention, routed experts (no shared expert).
    Qwen3Moe,
    /// Gated DeltaNet + gated attention hybrid, dense MLP (Qwen3.5, Qwen3.6).
    Qwen35,
    /// The same hybrid with routed experts and a gated shared expert.
    Qwen35Moe,
    /// Sliding and global attention, soft-capping, GeGLU, norms around both sublayers.
    Gemma2,
    /// Gemma 2's layout with q/k norms and a RoPE base per layer kind.
    Gemma3,
    /// Attention with sinks (sliding and global), routed experts with biases and a clamped SwiGLU.
    GptOss,
    /// Gated short convolutions and attention (LFM2, LFM2.5).
    Lfm2,
    /// Multi-head latent attention, grouped sigmoid routing, a shared expert (DeepSeek-V3, Kimi-K2).
    DeepseekV3,
    /// Attention with partial RoPE, DeepSeek-V3's routing (GLM-4.5).
    Glm4Moe,
    /// Two MLA + MLP sublayers a layer and a shortcut MoE with zero-computation experts.
    LongcatFlash,
}

/// How a family's forward is spread over devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallelism {
    /// On one device, or over the ranks of a replica (`tensor_parallel`): heads and MLP widths split.
    Tensor,
    /// Tensor parallelism, and the routed experts split over groups of ranks (`expert_parallel`).
    TensorExpert,
}

impl Parallelism {
    pub fn describe(self) -> &'static str {
        match self {
            Self::Tensor => "tensor parallel",
            Self::TensorExpert => "tensor and expert parallel",
        }
    }
}

/// One family.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub arch: Arch,
    /// The `model_type`s of its configs (a multimodal checkpoint's text config included).
    pub model_types: &'static [&'static str],
    /// What its layers are, in a line.
    pub layers: &'static str,
    /// Checkpoints of this family, for the listing.
    pub examples: &'static str,
}

impl Family {
    /// The parallelism this family runs with.
    pub fn parallelism(&self) -> Parallelism {
        match self.arch {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35 | Arch::Gemma2 | Arch::Gemma3 | Arch::Lfm2 => {
                Parallelism::Tensor
            }
            Arch::Qwen3Moe | Arch::Qwen35Moe | Arch::GptOss | Arch::DeepseekV3 | Arch::Glm4Moe | Arch::LongcatFlash => {
                Parallelism::TensorExpert
            }
        }
    }
}

pub const FAMILIES: &[Family] = &[
    Family {
        arch: Arch::Llama,
        model_types: &["llama", "mistral", "ministral"],
        layers: "attention (sliding-window layers where the config names them) and a SwiGLU MLP",
        examples: "Llama 2/3, SmolLM2, Mistral 7B, Ministral 8B",
    },
    Family {
        arch: Arch::Qwen2,
        model_types: &["qwen2"],
        layers: "attention with q/k/v biases, SwiGLU MLP",
        examples: "Qwen2.5",
    },
    Family {
        arch: Arch::Qwen3,
        model_types: &["qwen3"],
        layers: "attention with q/k norms, SwiGLU MLP",
        examples: "Qwen3",
    },
    Family {
        arch: Arch::Qwen3Moe,
        model_types: &["qwen3_moe"],
        layers: "Qwen3 attention, routed experts",
        examples: "Qwen3-30B-A3B, Qwen3-235B-A22B",
    },
    Family {
        arch: Arch::Qwen35,
        model_types: &["qwen3_5", "qwen3_5_text"],
        layers: "Gated DeltaNet layers and gated attention (3 to 1), SwiGLU MLP",
        examples: "Qwen3.5, Qwen3.6 (dense)",
    },
    Family {
        arch: Arch::Qwen35Moe,
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        layers: "the Qwen3.5 hybrid with routed experts and a gated shared expert",
        examples: "Qwen3.5-35B-A3B",
    },
    Family {
        arch: Arch::Gemma2,
        model_types: &["gemma2"],
        layers: "sliding and global attention, soft-capped scores and logits, GeGLU MLP, sandwich norms",
        examples: "Gemma 2",
    },
    Family {
        arch: Arch::Gemma3,
        model_types: &["gemma3_text"],
        layers: "sliding and global attention (each with its RoPE), q/k norms, GeGLU MLP, sandwich norms",
        examples: "Gemma 3 (the text model of every size)",
    },
    Family {
        arch: Arch::GptOss,
        model_types: &["gpt_oss"],
        layers: "sliding and global attention with sinks, routed experts (clamped SwiGLU with biases)",
        examples: "gpt-oss-20b, gpt-oss-120b (bf16 weights)",
    },
    Family {
        arch: Arch::Lfm2,
        model_types: &["lfm2"],
        layers: "gated short convolutions and attention with q/k norms, SwiGLU MLP",
        examples: "LFM2, LFM2.5",
    },
    Family {
        arch: Arch::DeepseekV3,
        model_types: &["deepseek_v3", "kimi_k2"],
        layers: "multi-head latent attention, routed experts (grouped sigmoid routing) with a shared expert",
        examples: "DeepSeek-V3, DeepSeek-R1, Kimi-K2, Moonlight",
    },
    Family {
        arch: Arch::Glm4Moe,
        model_types: &["glm4_moe"],
        layers: "attention (half the head rotated), routed experts with a shared expert",
        examples: "GLM-4.5, GLM-4.5-Air, GLM-4.6",
    },
    Family {
        arch: Arch::LongcatFlash,
        model_types: &["longcat_flash"],
        layers: "two latent-attention + MLP sublayers a layer, routed and zero-computation experts on a shortcut",
        examples: "LongCat-Flash",
    },
];

/// The family of `model_type`.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.model_types.contains(&model_type))
}

/// The `model_type`s whose family runs with `p` (tensor parallelism: the expert-parallel ones too).
pub fn supporting(p: Parallelism) -> Vec<&'static str> {
    let runs = |f: &Family| p == Parallelism::Tensor || f.parallelism() == Parallelism::TensorExpert;
    FAMILIES.iter().filter(|f| runs(f)).flat_map(|f| f.model_types.iter().copied()).collect()
}

/// Every `model_type` the target loads, in the table's order.
pub fn supported() -> Vec<&'static str> {
    FAMILIES.iter().flat_map(|f| f.model_types.iter().copied()).collect()
}

/// The table as Markdown: family, `model_type`s, layers, parallelism, examples.
pub fn markdown() -> String {
    let mut md = String::from(
        "| family | `model_type` | layers | parallelism | checkpoints |\n| --- | --- | --- | --- | --- |\n",
    );
    for f in FAMILIES {
        let types: Vec<String> = f.model_types.iter().map(|t| format!("`{t}`")).collect();
        md.push_str(&format!(
            "| {:?} | {} | {} | {} | {} |\n",
            f.arch,
            types.join(", "),
            f.layers,
            f.parallelism().describe(),
            f.examples
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_type_names_one_family() {
        let all = supported();
        for t in &all {
            assert_eq!(all.iter().filter(|x| *x == t).count(), 1, "{t} listed twice");
            assert!(family(t).is_some());
        }
        assert_eq!(family("mistral").unwrap().arch, Arch::Llama);
        assert!(family("mamba2").is_none());
        let md = markdown();
        assert_eq!(md.lines().count(), FAMILIES.len() + 2);
        assert!(md.contains("| Gemma2 | `gemma2` |") && md.contains("tensor parallel |"), "{md}");
        assert!(
            md.contains("| Qwen35Moe | `qwen3_5_moe`, `qwen3_5_moe_text` |")
                && md.contains("tensor and expert parallel")
        );
        assert_eq!(
            supporting(Parallelism::TensorExpert),
            [
                "qwen3_moe",
                "qwen3_5_moe",
                "qwen3_5_moe_text",
                "gpt_oss",
                "deepseek_v3",
                "kimi_k2",
                "glm4_moe",
                "longcat_flash"
            ]
        );
        let tensor = supporting(Parallelism::Tensor);
        assert!(tensor.contains(&"mistral") && tensor.contains(&"gemma3_text") && tensor.contains(&"lfm2"));
        // Every family splits its heads and widths.
        assert_eq!(tensor, supported());
    }
}
