//! `report --plan BENCH.json --gpus G`: how to split G GPUs between the target and the drafter,
//! from `bench train`'s figures (its `--json` file) for that target and drafter. A replica is k
//! GPUs running the target's forward beside one GPU running the drafter's step, fed through the
//! hidden-state buffer; G / (k + 1) replicas train data-parallel. A replica's rate is that of its
//! slower stage: min(k / target forward, 1 / drafter step) batches a second. The alternative is
//! every GPU running both, one after the other (the bench's `pipeline` phase). The gradient
//! all-reduce between replicas is not counted.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::Path;

/// The bench's figures the plan needs (seconds per micro-batch of `batch_size` x `seq_len`).
#[derive(Debug, Clone, PartialEq)]
pub struct StageTimes {
    pub target_s: f64,
    pub drafter_s: f64,
    /// Target then drafter on one GPU.
    pub colocated_s: f64,
    pub batch_size: u64,
    pub seq_len: u64,
}

/// One way to use the GPUs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Split {
    /// Target GPUs and drafter GPUs a replica (0 drafter GPUs: both on every GPU).
    pub target_gpus: u64,
    pub drafter_gpus: u64,
    pub replicas: u64,
    /// GPUs left without work.
    pub idle: u64,
    /// Micro-batches a second over all replicas, and target tokens a second.
    pub batches_per_s: f64,
    pub tok_per_s: f64,
    /// `target` or `drafter` (the slower stage of a replica; `both` when colocated).
    pub bound_by: String,
    /// The slower stage's busy time over the faster's (1: balanced).
    pub imbalance: f64,
}

/// Reads `bench train --json`'s file (or its whole output: the last line that is a JSON object).
pub fn read_bench(path: &Path) -> Result<StageTimes> {
    let text = input_files::read_to_string_capped(path, 16 << 20)?;
    let file = path.display();
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("{file}: no JSON object (write one with `bench train --json FILE`)"))?;
    let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{file}: not valid JSON"))?;
    // Seconds a step in 1 ns..=1 day, and shapes below 2^24, so no rate or token count the plan
    // derives overflows or reads inf.
    let num = |phase: &str, key: &str| {
        v.get(phase)
            .and_then(|p| p.get(key))
            .and_then(|x| x.as_f64())
            .filter(|x| (1e-9..=86_400.0).contains(x))
            .with_context(|| format!("{file}: no `{phase}.{key}` in 1e-9..=86400 s (is it `bench train`'s JSON?)"))
    };
    let int = |key: &str| {
        v.get(key)
            .and_then(|x| x.as_u64())
            .filter(|n| (1..1 << 24).contains(n))
            .with_context(|| format!("{file}: no `{key}` in 1..{}", 1 << 24))
    };
    Ok(StageTimes {
        target_s: num("target_features", "step_s")?,
        drafter_s: num("drafter_step", "step_s")?,
        colocated_s: num("pipeline", "step_s")?,
        batch_size: int("batch_size")?,
        seq_len: int("seq_len")?,
    })
}

/// The most GPUs a plan splits: it lists a split for every number of target GPUs a drafter GPU
/// serves, and no pipeline spreads one target over more GPUs than a large cluster job holds.
pub const MAX_GPUS: u64 = 4096;

/// Every split of `gpus`, the best (most tokens a second, then fewest GPUs busy) first.
pub fn plan(t: &StageTimes, gpus: u64) -> Result<Vec<Split>> {
    if gpus == 0 {
        bail!("--gpus: at least one GPU");
    }
    if gpus > MAX_GPUS {
        bail!("--gpus {gpus}: at most {MAX_GPUS} (the plan lists a split for each number of target GPUs)");
    }
    let tokens = (t.batch_size * t.seq_len) as f64;
    let mut out = vec![Split {
        target_gpus: 1,
        drafter_gpus: 0,
        replicas: gpus,
        idle: 0,
        batches_per_s: gpus as f64 / t.colocated_s,
        tok_per_s: gpus as f64 / t.colocated_s * tokens,
        bound_by: "both".into(),
        imbalance: 1.0,
    }];
    for k in 1..gpus {
        let replicas = gpus / (k + 1);
        let (target_rate, drafter_rate) = (k as f64 / t.target_s, 1.0 / t.drafter_s);
        let rate = replicas as f64 * target_rate.min(drafter_rate);
        out.push(Split {
            target_gpus: k,
            drafter_gpus: 1,
            replicas,
            idle: gpus - replicas * (k + 1),
            batches_per_s: rate,
            tok_per_s: rate * tokens,
            bound_by: if target_rate <= drafter_rate { "target" } else { "drafter" }.into(),
            imbalance: target_rate.max(drafter_rate) / target_rate.min(drafter_rate),
        });
    }
    out.sort_by(|a, b| b.tok_per_s.total_cmp(&a.tok_per_s).then(a.idle.cmp(&b.idle)));
    Ok(out)
}

/// The plan as `report --plan` prints it.
pub fn lines(t: &StageTimes, gpus: u64, splits: &[Split]) -> Vec<String> {
    let mut out = vec![
        format!(
            "bench          target forward {:.3} s, drafter step {:.3} s, both on one GPU {:.3} s (batch {} x {} tokens)",
            t.target_s, t.drafter_s, t.colocated_s, t.batch_size, t.seq_len
        ),
        format!("plan for {gpus} GPU{}  (best first; the all-reduce between replicas not counted)", plural(gpus)),
    ];
    for (i, s) in splits.iter().enumerate() {
        let shape = if s.drafter_gpus == 0 {
            format!("every GPU runs both ({} replica{})", s.replicas, plural(s.replicas))
        } else {
            format!(
                "{}-1: {} target GPU{} + 1 drafter GPU, x{} replica{}{}",
                s.target_gpus,
                s.target_gpus,
                plural(s.target_gpus),
                s.replicas,
                plural(s.replicas),
                if s.idle > 0 { format!(", {} idle", s.idle) } else { String::new() }
            )
        };
        let bound = match s.bound_by.as_str() {
            "both" => String::new(),
            b => format!(", bound by the {b} ({:.2}x the other)", s.imbalance),
        };
        out.push(format!(
            "{} {shape}: {:.2} batches/s, {:.0} target tok/s{bound}",
            if i == 0 { "  best" } else { "      " },
            s.batches_per_s,
            s.tok_per_s
        ));
    }
    out
}

fn plural(n: u64) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(target_s: f64, drafter_s: f64, colocated_s: f64) -> StageTimes {
        StageTimes { target_s, drafter_s, colocated_s, batch_size: 2, seq_len: 100 }
    }

    #[test]
    fn a_target_three_times_the_drafter_step_is_balanced_by_three_target_gpus_to_one() {
        // 0.3 s a target forward, 0.1 s a drafter step: 3-1 gives 10 batches/s on 4 GPUs.
        let t = times(0.3, 0.1, 0.5);
        let p = plan(&t, 4).unwrap();
        let best = &p[0];
        assert_eq!((best.target_gpus, best.drafter_gpus, best.replicas, best.idle), (3, 1, 1, 0));
        assert!((best.batches_per_s - 10.0).abs() < 1e-9 && (best.tok_per_s - 2000.0).abs() < 1e-6);
        assert!((best.imbalance - 1.0).abs() < 1e-9);
        // 1-1 x2: each replica 1 / 0.3 batches/s, bound by the target (3x the drafter's rate).
        let one_one = p.iter().find(|s| s.target_gpus == 1 && s.drafter_gpus == 1).unwrap();
        assert_eq!(one_one.replicas, 2);
        assert!((one_one.batches_per_s - 2.0 / 0.3).abs() < 1e-9 && one_one.bound_by == "target");
        assert!((one_one.imbalance - 3.0).abs() < 1e-9);
        // Colocated: 4 / 0.5 = 8 batches/s; 2-1 leaves a GPU idle.
        let colocated = p.iter().find(|s| s.drafter_gpus == 0).unwrap();
        assert!((colocated.batches_per_s - 8.0).abs() < 1e-9);
        let two_one = p.iter().find(|s| s.target_gpus == 2).unwrap();
        assert_eq!((two_one.replicas, two_one.idle), (1, 1));
        assert!(lines(&t, 4, &p)[2].contains("3-1: 3 target GPUs + 1 drafter GPU, x1 replica: 10.00 batches/s"));
    }

    #[test]
    fn a_drafter_bound_pair_is_worse_than_colocating_when_the_target_is_cheap() {
        // The target forward 0.05 s, the drafter 0.2 s: a split leaves target GPUs waiting.
        let p = plan(&times(0.05, 0.2, 0.25), 2).unwrap();
        assert_eq!(p[0].drafter_gpus, 0, "{p:?}");
        assert!((p[0].batches_per_s - 8.0).abs() < 1e-9);
        assert_eq!(p[1].bound_by, "drafter");
        assert!((p[1].batches_per_s - 5.0).abs() < 1e-9);
        assert!(plan(&times(1.0, 1.0, 2.0), 0).is_err());
    }

    #[test]
    fn the_bench_json_is_read_from_its_file_or_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.json");
        let json = serde_json::json!({
            "batch_size": 4, "seq_len": 512,
            "target_features": {"step_s": 0.3}, "drafter_step": {"step_s": 0.1}, "pipeline": {"step_s": 0.42},
        });
        std::fs::write(&path, format!("bench train: a table\n{json}\n")).unwrap();
        let t = read_bench(&path).unwrap();
        assert_eq!(t, StageTimes { target_s: 0.3, drafter_s: 0.1, colocated_s: 0.42, batch_size: 4, seq_len: 512 });
        std::fs::write(&path, "{\"batch_size\": 4}").unwrap();
        let e = read_bench(&path).unwrap_err();
        assert!(format!("{e:#}").contains("bench.json: no `target_features.step_s` in 1e-9..=86400 s"), "{e:#}");
        // Absurd figures are refused, not planned with (no inf rate, no overflowing token count).
        for (key, value, want) in [
            ("target_features", serde_json::json!({"step_s": 1e-300}), "no `target_features.step_s` in"),
            ("drafter_step", serde_json::json!({"step_s": 1e300}), "no `drafter_step.step_s` in"),
            ("batch_size", serde_json::json!(u64::MAX), "no `batch_size` in 1..16777216"),
        ] {
            let mut bad = json.clone();
            bad[key] = value;
            std::fs::write(&path, bad.to_string()).unwrap();
            let e = format!("{:#}", read_bench(&path).unwrap_err());
            assert!(e.contains(want), "{key}: {e}");
        }
    }
}
