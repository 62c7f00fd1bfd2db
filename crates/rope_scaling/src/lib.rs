//! HF's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) and the inverse
//! frequencies transformers' `ROPE_INIT_FUNCTIONS` compute for it: default, linear, dynamic NTK,
//! llama3 and yarn. The target and the drafters share this math; the tensors are built by each
//! (tch). Anything else is refused with the key or type named.
//!
//! A drafter reads its config with [`RopeScaling::from_json`], which refuses `dynamic`: its
//! frequencies follow the sequence length in transformers but are fixed at load in SGLang and
//! vLLM (sized for `max_position_embeddings * factor`), so no RoPE a drafter trains with would
//! be the one it is served with. A target reads with [`RopeScaling::from_json_any`] and computes
//! dynamic frequencies per forward, as transformers does.

use serde_json::{Map, Value};

/// A RoPE scaling; `null` in a config is [`RopeScaling::Default`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum RopeScaling {
    #[default]
    Default,
    /// Positions divided by `factor` (every frequency / factor).
    Linear { factor: f64 },
    /// Dynamic NTK: past `max_position_embeddings` the base grows with the sequence length.
    Dynamic { factor: f64 },
    /// Llama 3.1: low frequencies / factor, high ones kept, a smooth ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
    /// YaRN (NTK-by-parts) with its attention factor on cos and sin.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
}

impl RopeScaling {
    /// From HF's `rope_scaling` (null, or an object with `rope_type` or the older `type`): the
    /// kinds whose frequencies are fixed (what a drafter is served with).
    pub fn from_json(v: &Value) -> Result<Self, String> {
        Self::parse(v, false)
    }

    /// [`from_json`](Self::from_json) and `dynamic` too (a target, run as transformers runs it).
    pub fn from_json_any(v: &Value) -> Result<Self, String> {
        Self::parse(v, true)
    }

    fn parse(v: &Value, dynamic: bool) -> Result<Self, String> {
        let obj = match v {
            Value::Null => return Ok(Self::Default),
            Value::Object(o) => o,
            other => return Err(format!("expected null or an object, got {other}")),
        };
        let kind = match (obj.get("rope_type"), obj.get("type")) {
            (Some(Value::String(t)), _) | (None, Some(Value::String(t))) => t.as_str(),
            (None, None) => return Err("no `rope_type`".into()),
            _ => return Err("`rope_type` must be a string".into()),
        };
        let keys: &[&str] = match kind {
            "default" => &[],
            "linear" => &["factor"],
            "dynamic" if dynamic => &["factor"],
            "dynamic" => return Err(
                "rope_type `dynamic` is not supported for a drafter: transformers recomputes its frequencies for each \
                            sequence length, SGLang and vLLM fix them at load, so no single RoPE matches serving"
                    .into(),
            ),
            "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
            "yarn" => &[
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "attention_factor",
                "mscale",
                "mscale_all_dim",
                "truncate",
            ],
            other => {
                let known =
                    if dynamic { "default, linear, dynamic, llama3, yarn" } else { "default, linear, llama3, yarn" };
                return Err(format!("rope_type `{other}` is not supported ({known})"));
            }
        };
        if let Some(extra) =
            obj.keys().find(|k| !["rope_type", "type"].contains(&k.as_str()) && !keys.contains(&k.as_str()))
        {
            return Err(format!("key `{extra}` is not supported for rope_type `{kind}`"));
        }
        let num = |k: &str| -> Result<Option<f64>, String> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => Ok(n.as_f64()),
                Some(other) => Err(format!("`{k}` must be a number, got {other}")),
            }
        };
        let need = |k: &str| num(k)?.ok_or_else(|| format!("rope_type `{kind}` needs `{k}`"));
        let positive =
            |k: &str, x: f64| if x > 0.0 && x.is_finite() { Ok(x) } else { Err(format!("`{k}` must be > 0, got {x}")) };
        Ok(match kind {
            "default" => Self::Default,
            "linear" => Self::Linear { factor: positive("factor", need("factor")?)? },
            "dynamic" => Self::Dynamic { factor: positive("factor", need("factor")?)? },
            "llama3" => {
                let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
                if high <= low {
                    return Err(format!("`high_freq_factor` {high} must exceed `low_freq_factor` {low}"));
                }
                Self::Llama3 {
                    factor: positive("factor", need("factor")?)?,
                    low_freq_factor: positive("low_freq_factor", low)?,
                    high_freq_factor: high,
                    original_max_position_embeddings: positive(
                        "original_max_position_embeddings",
                        need("original_max_position_embeddings")?,
                    )?,
                }
            }
            _ => Self::Yarn {
                // transformers infers a missing factor from max_position_embeddings; the serving
                // engines do not agree on it, so it must be given.
                factor: positive("factor", need("factor")?)?,
                original_max_position_embeddings: positive(
                    "original_max_position_embeddings",
                    need("original_max_position_embeddings")?,
                )?,
                beta_fast: num("beta_fast")?.unwrap_or(32.0),
                beta_slow: num("beta_slow")?.unwrap_or(1.0),
                attention_factor: num("attention_factor")?,
                mscale: num("mscale")?,
                mscale_all_dim: num("mscale_all_dim")?,
                truncate: match obj.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => return Err(format!("`truncate` must be a boolean, got {other}")),
                },
            },
        })
    }

    /// HF's `rope_scaling` value (null for the default).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        match *self {
            Self::Default => return Value::Null,
            Self::Linear { factor } => {
                put("rope_type", "linear".into());
                put("factor", factor.into());
            }
            Self::Dynamic { factor } => {
                put("rope_type", "dynamic".into());
                put("factor", factor.into());
            }
            Self::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                put("rope_type", "llama3".into());
                put("factor", factor.into());
                put("low_freq_factor", low_freq_factor.into());
                put("high_freq_factor", high_freq_factor.into());
                put("original_max_position_embeddings", whole(original_max_position_embeddings));
            }
            Self::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                put("rope_type", "yarn".into());
                put("factor", factor.into());
                put("original_max_position_embeddings", whole(original_max_position_embeddings));
                put("beta_fast", beta_fast.into());
                put("beta_slow", beta_slow.into());
                for (k, v) in
                    [("attention_factor", attention_factor), ("mscale", mscale), ("mscale_all_dim", mscale_all_dim)]
                {
                    if let Some(v) = v {
                        put(k, v.into());
                    }
                }
                if !truncate {
                    put("truncate", false.into());
                }
            }
        }
        Value::Object(m)
    }

    /// Whether the frequencies depend on the sequence length (use
    /// [`inv_freq_at`](Self::inv_freq_at)).
    pub fn depends_on_length(&self) -> bool {
        matches!(self, Self::Dynamic { .. })
    }

    /// The inverse frequencies (rotary dims / 2, f64) and the factor on cos and sin, as
    /// transformers' `ROPE_INIT_FUNCTIONS` compute them at load (`dynamic`: as for a sequence
    /// within `max_position_embeddings`, i.e. unscaled).
    pub fn inv_freq(&self, rotary_dim: usize, theta: f64) -> (Vec<f64>, f64) {
        self.inv_freq_at(rotary_dim, theta, 0, 1)
    }

    /// [`inv_freq`](Self::inv_freq) for a forward whose largest position is `seq_len - 1`, in a
    /// model of `max_position_embeddings`: dynamic NTK raises the base to
    /// theta * (factor * L / max - (factor - 1)) ^ (d / (d - 2)) with L = max(seq_len, max)
    /// (transformers' `_compute_dynamic_ntk_parameters`); the other kinds ignore both.
    pub fn inv_freq_at(
        &self,
        rotary_dim: usize,
        theta: f64,
        seq_len: usize,
        max_position_embeddings: usize,
    ) -> (Vec<f64>, f64) {
        let d = rotary_dim as f64;
        let powers =
            |theta: f64| -> Vec<f64> { (0..rotary_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / d)).collect() };
        let base = powers(theta);
        match *self {
            Self::Default => (base, 1.0),
            Self::Dynamic { factor } => {
                let max = max_position_embeddings as f64;
                let len = (seq_len as f64).max(max);
                (powers(theta * (factor * len / max - (factor - 1.0)).powf(d / (d - 2.0))), 1.0)
            }
            Self::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            Self::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let freqs = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            Self::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention = attention_factor.unwrap_or(match (mscale, mscale_all_dim) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => get_mscale(factor, m) / get_mscale(factor, all),
                    _ => get_mscale(factor, 1.0),
                });
                let correction_dim =
                    |rotations: f64| (d * (old / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln());
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001; // transformers' guard against a zero-width ramp
                }
                let freqs = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect();
                (freqs, attention)
            }
        }
    }
}

/// Whole numbers as JSON integers (HF writes `original_max_position_embeddings` as one).
fn whole(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        Value::from(x as i64)
    } else {
        Value::from(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn configs_parse_round_trip_and_refuse_what_is_not_honoured() {
        assert_eq!(RopeScaling::from_json(&Value::Null).unwrap(), RopeScaling::Default);
        for v in [
            json!({"rope_type": "linear", "factor": 2.0}),
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0, "beta_slow": 1.0}),
        ] {
            let r = RopeScaling::from_json(&v).unwrap();
            assert_eq!(r.to_json(), v);
            assert_eq!(RopeScaling::from_json(&r.to_json()).unwrap(), r);
        }
        // The older `type` key reads the same.
        assert_eq!(
            RopeScaling::from_json(&json!({"type": "linear", "factor": 2.0})).unwrap(),
            RopeScaling::Linear { factor: 2.0 }
        );
        let err = |v: Value| RopeScaling::from_json(&v).unwrap_err();
        assert!(err(json!({"rope_type": "dynamic", "factor": 2.0}))
            .contains("rope_type `dynamic` is not supported for a drafter"));
        let dynamic = json!({"rope_type": "dynamic", "factor": 2.0});
        assert_eq!(RopeScaling::from_json_any(&dynamic).unwrap(), RopeScaling::Dynamic { factor: 2.0 });
        assert_eq!(RopeScaling::from_json_any(&dynamic).unwrap().to_json(), dynamic);
        assert!(RopeScaling::from_json_any(&json!({"rope_type": "longrope"}))
            .unwrap_err()
            .contains("`longrope` is not supported"));
        assert!(err(json!({"rope_type": "linear", "factor": 2.0, "short_factor": [1]})).contains("key `short_factor`"));
        assert!(err(json!({"rope_type": "yarn", "factor": 4.0})).contains("needs `original_max_position_embeddings`"));
        assert!(err(json!({"rope_type": "linear", "factor": -1.0})).contains("`factor` must be > 0"));
    }

    #[test]
    fn linear_divides_every_frequency_and_llama3_keeps_the_high_ones() {
        let (base, a) = RopeScaling::Default.inv_freq(8, 10000.0);
        assert_eq!(a, 1.0);
        assert!((base[1] - 10000f64.powf(-0.25)).abs() < 1e-15);
        let (lin, _) = RopeScaling::Linear { factor: 4.0 }.inv_freq(8, 10000.0);
        assert!(lin.iter().zip(&base).all(|(l, b)| (l * 4.0 - b).abs() < 1e-15));
        let l3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        };
        let (f, _) = l3.inv_freq(8, 10000.0);
        assert_eq!(f[0], base[0], "wavelength 2 pi < 16: kept");
        assert!((f[3] - base[3] / 8.0).abs() < 1e-18, "wavelength > 64: divided");
    }

    #[test]
    fn dynamic_ntk_raises_the_base_only_past_the_context() {
        let dynamic = RopeScaling::Dynamic { factor: 2.0 };
        let (base, _) = RopeScaling::Default.inv_freq(8, 10000.0);
        assert_eq!(dynamic.inv_freq(8, 10000.0).0, base);
        assert_eq!(dynamic.inv_freq_at(8, 10000.0, 64, 64).0, base, "within the context: unscaled");
        // 128 positions in a 64 context, factor 2: base 10000 * (2 * 2 - 1) ^ (8 / 6).
        let (f, a) = dynamic.inv_freq_at(8, 10000.0, 128, 64);
        let theta = 10000.0 * 3f64.powf(8.0 / 6.0);
        assert_eq!(a, 1.0);
        assert!((f[1] - theta.powf(-0.25)).abs() < 1e-15, "{} vs {}", f[1], theta.powf(-0.25));
        assert_eq!(f[0], 1.0);
    }
}
