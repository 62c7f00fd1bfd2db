//! The `[optimizer]` section of the Muon plugin, and which group each parameter goes to.

use optim_math::{AdjustLr, ParamsAdamW};
use plugin_api::{
    tch::{Device, Kind},
    PluginError,
};
use serde::Deserialize;

/// Muon's hyper-parameters plus the AdamW group's. `Default` is torch.optim.Muon 2.11's for the
/// Muon group (momentum 0.95, Nesterov, 5 steps, eps 1e-7) but for three values, the ones every
/// config of this project uses: `adjust_lr = "match_rms_adamw"` (torch: "original"),
/// `weight_decay = 0.0` (torch: 0.1), and an AdamW group whose lr and weight decay are the
/// section's (torch.optim.AdamW's otherwise). With `"match_rms_adamw"` the update RMS is AdamW's,
/// so one learning rate serves both groups and a run switched from AdamW keeps its `lr`; with
/// `"original"` (KellerJordan's) runs use lr ~0.02.
#[derive(Debug, Clone, PartialEq, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields, default)]
pub struct MuonConfig {
    /// Muon group learning rate (the peak; the host's schedule multiplies it).
    #[describe(range = "> 0")]
    pub lr: f64,
    /// Momentum coefficient mu in [0, 1).
    #[describe(range = "in [0, 1)")]
    pub momentum: f64,
    /// Nesterov look-ahead: orthogonalise lerp(g, buf, mu) instead of buf.
    pub nesterov: bool,
    /// Newton-Schulz iterations, 1..=99 (torch refuses 100 and more).
    #[describe(range = "in 1..=99")]
    pub ns_steps: i64,
    /// Lower clamp of the Frobenius norm before Newton-Schulz.
    #[describe(range = "> 0")]
    pub eps: f64,
    /// Decoupled weight decay of the Muon group, applied with the unadjusted lr: p *= 1 - lr*wd.
    #[describe(range = ">= 0")]
    pub weight_decay: f64,
    /// Shape scaling of the Muon update's lr.
    pub adjust_lr: AdjustLr,
    /// Dtype Newton-Schulz computes in.
    pub ns_dtype: NsDtype,
    /// The AdamW group's hyper-parameters (its lr is scaled by the schedule too).
    pub adamw: AdamWGroup,
    /// Names (`*` wildcards) forced to AdamW. Tensors with fewer than 2 dims, or with a size-1 dim
    /// (depthwise conv kernels like GDN's [C, 1, 4]), always go to AdamW.
    pub adamw_patterns: Vec<String>,
    /// Names forced to AdamW without weight decay (gate parameters).
    pub no_decay_patterns: Vec<String>,
    /// Fused matrices orthogonalised part by part along dim 0.
    pub split: Vec<SplitRule>,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            eps: 1e-7,
            weight_decay: 0.0,
            adjust_lr: AdjustLr::MatchRmsAdamw,
            ns_dtype: NsDtype::Auto,
            adamw: AdamWGroup::default(),
            adamw_patterns: vec!["*embed*".into(), "*lm_head*".into()],
            no_decay_patterns: vec!["*A_log".into(), "*dt_bias".into()],
            split: Vec::new(),
        }
    }
}

/// The AdamW group's section (`adamw = { ... }`): AdamW's fields, with `lr` and `weight_decay`
/// the Muon section's unless given.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWGroup {
    /// Peak learning rate of the AdamW group (the host's schedule multiplies it).
    #[describe(range = "> 0", default = "the section's `lr`")]
    pub lr: Option<f64>,
    /// Decay rates of the first and second moment averages.
    #[describe(range = "in [0, 1)")]
    pub betas: [f64; 2],
    /// Added to the denominator's square root.
    #[describe(range = "> 0")]
    pub eps: f64,
    /// Decoupled weight decay: p *= 1 - lr * weight_decay each step.
    #[describe(range = ">= 0", default = "the section's `weight_decay`")]
    pub weight_decay: Option<f64>,
    /// On CUDA, update every tensor in one fused kernel (torch's `AdamW(fused=True)`).
    pub fused: bool,
}

impl Default for AdamWGroup {
    fn default() -> Self {
        let p = ParamsAdamW::default();
        Self { lr: None, betas: p.betas, eps: p.eps, weight_decay: None, fused: p.fused }
    }
}

/// Newton-Schulz compute dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum NsDtype {
    /// bf16 on CUDA (as KellerJordan and torch), f32 on the CPU (bf16 matmuls are slow on a CPU
    /// without bf16 matrix units; with AMX, `bf16` runs the default drafter's 2.7x faster).
    #[default]
    Auto,
    F32,
    /// What torch.optim.Muon does on every device, the CPU included.
    Bf16,
}

impl NsDtype {
    pub fn kind(self, device: Device) -> Kind {
        match self {
            NsDtype::F32 => Kind::Float,
            NsDtype::Bf16 => Kind::BFloat16,
            NsDtype::Auto if device.is_cuda() => Kind::BFloat16,
            NsDtype::Auto => Kind::Float,
        }
    }
}

/// `{ pattern = "*qkv_proj.weight", parts = [64, 16, 16] }`: rows of each part, summing to dim 0.
#[derive(Debug, Clone, PartialEq, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct SplitRule {
    /// The parameters the rule applies to, by name (`*` matches any run of characters).
    pub pattern: String,
    /// Rows of each part along dim 0 (they sum to it): each part is orthogonalised on its own.
    pub parts: Vec<i64>,
}

impl MuonConfig {
    pub fn from_toml(text: &str) -> Result<Self, PluginError> {
        let c: Self = plugin_api::parse_section(text)?;
        c.validate()?;
        Ok(c)
    }

    /// The AdamW group's hyper-parameters, `lr` and `weight_decay` the section's where unset.
    pub fn adamw_params(&self) -> ParamsAdamW {
        let g = &self.adamw;
        ParamsAdamW {
            lr: g.lr.unwrap_or(self.lr),
            betas: g.betas,
            eps: g.eps,
            weight_decay: g.weight_decay.unwrap_or(self.weight_decay),
            fused: g.fused,
        }
    }

    /// Range checks; errors name the field.
    pub fn validate(&self) -> Result<(), PluginError> {
        let bad = |field: &str, why: String| Err(PluginError::new(format!("field `{field}`: {why}")));
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return bad("lr", format!("must be > 0, got {}", self.lr));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad("momentum", format!("must be in [0, 1), got {}", self.momentum));
        }
        if !(1..100).contains(&self.ns_steps) {
            return bad("ns_steps", format!("must be in 1..=99, got {}", self.ns_steps));
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return bad("eps", format!("must be > 0, got {}", self.eps));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad("weight_decay", format!("must be >= 0, got {}", self.weight_decay));
        }
        self.adamw_params().validate_in("adamw.")?;
        for (field, patterns) in
            [("adamw_patterns", &self.adamw_patterns), ("no_decay_patterns", &self.no_decay_patterns)]
        {
            if let Some(i) = patterns.iter().position(|p| p.is_empty()) {
                return bad(field, format!("pattern {i} is empty"));
            }
        }
        for (i, rule) in self.split.iter().enumerate() {
            if rule.pattern.is_empty() {
                return bad(&format!("split[{i}].pattern"), "is empty".into());
            }
            if rule.parts.is_empty() || rule.parts.iter().any(|&n| n <= 0) {
                return bad(
                    &format!("split[{i}].parts"),
                    format!("must be a non-empty list of sizes > 0, got {:?}", rule.parts),
                );
            }
        }
        Ok(())
    }
}

/// Which update a parameter gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Muon,
    AdamW,
    /// AdamW with weight decay 0.
    AdamWNoDecay,
}

/// `*` matches any run of characters (dots included), every other character itself; the whole
/// name must match.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // After a `*`: where the pattern resumes, and how much of the name the `*` has eaten so far.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi + 1, ni));
            pi += 1;
        } else if pi < p.len() && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if let Some((resume, eaten)) = star {
            // Backtrack: the last `*` eats one more character.
            star = Some((resume, eaten + 1));
            pi = resume;
            ni = eaten + 1;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

impl MuonConfig {
    /// The group of parameter `name` with shape `shape`: no-decay patterns first, then AdamW
    /// patterns, then shape (fewer than 2 dims, or a size-1 dim -> AdamW), else Muon.
    pub fn route(&self, name: &str, shape: &[i64]) -> Group {
        let any = |patterns: &[String]| patterns.iter().any(|p| glob_match(p, name));
        if any(&self.no_decay_patterns) {
            Group::AdamWNoDecay
        } else if any(&self.adamw_patterns) || shape.len() < 2 || shape.iter().any(|&d| d <= 1) {
            Group::AdamW
        } else {
            Group::Muon
        }
    }

    /// The first split rule matching `name`.
    pub fn split_for(&self, name: &str) -> Option<&SplitRule> {
        self.split.iter().find(|r| glob_match(&r.pattern, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob() {
        assert!(glob_match("*embed*", "model.embed_tokens.weight"));
        assert!(glob_match("*A_log", "layers.0.linear_attn.A_log"));
        assert!(!glob_match("*A_log", "layers.0.linear_attn.A_log.x"));
        assert!(glob_match("layers.*.qkv_proj.weight", "layers.12.qkv_proj.weight"));
        assert!(glob_match("a*b*c", "aXbYbZc"));
        assert!(!glob_match("a*b*c", "aXbYbZ"));
        assert!(glob_match("*", ""));
        assert!(glob_match("exact", "exact"));
        assert!(!glob_match("exact", "exact2"));
        assert!(glob_match("**x", "abx"));
    }

    #[test]
    fn example_config_parses() {
        let c = MuonConfig::from_toml(
            r#"
lr = 0.02
momentum = 0.95
nesterov = true
ns_steps = 5
weight_decay = 0.0
adjust_lr = "match_rms_adamw"
ns_dtype = "bf16"
adamw = { lr = 3e-3, betas = [0.9, 0.999], eps = 1e-8, weight_decay = 0.0 }
adamw_patterns = ["*embed*", "*lm_head*"]
no_decay_patterns = ["*A_log", "*dt_bias"]
split = [{ pattern = "*qkv_proj.weight", parts = [64, 16, 16] }]
"#,
        )
        .unwrap();
        assert_eq!(c.lr, 0.02);
        assert_eq!(c.adjust_lr, AdjustLr::MatchRmsAdamw);
        assert_eq!(c.ns_dtype, NsDtype::Bf16);
        assert_eq!(c.adamw_params().lr, 3e-3);
        assert_eq!(c.split[0].parts, vec![64, 16, 16]);
        assert_eq!(MuonConfig::from_toml("").unwrap(), MuonConfig::default());
    }

    /// Every bad value's error names its field.
    #[test]
    fn config_errors_name_fields() {
        let cases: &[(&str, &str)] = &[
            ("lr = -1.0", "field `lr`"),
            ("lr = 0.0", "field `lr`"),
            ("momentum = 1.0", "field `momentum`"),
            ("momentum = -0.1", "field `momentum`"),
            ("ns_steps = 0", "field `ns_steps`"),
            ("ns_steps = 100", "field `ns_steps`"),
            ("eps = 0.0", "field `eps`"),
            ("weight_decay = -0.1", "field `weight_decay`"),
            ("adjust_lr = \"moonlight\"", "field `adjust_lr`"),
            ("ns_dtype = \"f16\"", "field `ns_dtype`"),
            ("nesterov = 1", "field `nesterov`"),
            ("adamw = { lr = 0.0 }", "field `adamw.lr`"),
            ("adamw = { betas = [0.9, 1.0] }", "field `adamw.betas`"),
            ("adamw = { eps = -1.0 }", "field `adamw.eps`"),
            ("adamw = { weight_decay = -1.0 }", "field `adamw.weight_decay`"),
            ("adamw_patterns = [\"\"]", "field `adamw_patterns`"),
            ("no_decay_patterns = [\"x\", \"\"]", "field `no_decay_patterns`"),
            ("split = [{ pattern = \"\", parts = [1] }]", "field `split[0].pattern`"),
            ("split = [{ pattern = \"w\", parts = [] }]", "field `split[0].parts`"),
            ("split = [{ pattern = \"w\", parts = [4, 0] }]", "field `split[0].parts`"),
            ("lrr = 1.0", "unknown field `lrr`"),
            ("split = [{ pattern = \"w\", part = [1] }]", "unknown field `part`"),
        ];
        for (text, want) in cases {
            let e = MuonConfig::from_toml(text).unwrap_err().to_string();
            assert!(e.contains(want), "`{text}`: error `{e}` does not name {want}");
        }
    }

    #[test]
    fn routing_by_name_and_shape() {
        let c = MuonConfig::default();
        assert_eq!(c.route("layers.0.self_attn.q_proj.weight", &[64, 64]), Group::Muon);
        assert_eq!(c.route("layers.0.mlp.down_proj.weight", &[64, 96]), Group::Muon);
        assert_eq!(c.route("model.embed_tokens.weight", &[101, 64]), Group::AdamW);
        assert_eq!(c.route("lm_head.weight", &[101, 64]), Group::AdamW);
        assert_eq!(c.route("layers.0.input_layernorm.weight", &[64]), Group::AdamW);
        assert_eq!(c.route("layers.0.self_attn.o_proj.bias", &[64]), Group::AdamW);
        assert_eq!(c.route("layers.0.linear_attn.conv1d.weight", &[96, 1, 4]), Group::AdamW);
        assert_eq!(c.route("layers.0.linear_attn.A_log", &[4]), Group::AdamWNoDecay);
        assert_eq!(c.route("layers.0.linear_attn.dt_bias", &[4]), Group::AdamWNoDecay);
        assert_eq!(c.route("scalar", &[]), Group::AdamW);
        assert_eq!(c.route("row", &[1, 64]), Group::AdamW);
        assert_eq!(c.route("conv2d.weight", &[8, 4, 3, 3]), Group::Muon);
    }
}
