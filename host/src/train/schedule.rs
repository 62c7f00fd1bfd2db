//! Learning-rate schedule: linear warm-up, then cosine decay to a floor (the DFlash paper: 4% warm-up).

use serde::{Deserialize, Serialize};

/// How a fork's schedule goes on from the step it was forked at (`fork --schedule`, `--rewarm`);
/// kept in the trainer state, so a resumed fork follows it too.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForkSchedule {
    /// The step the run was forked at.
    pub at: u64,
    /// Start a new warm-up + cosine over the steps after `at` (false: continue the position).
    pub restart: bool,
    /// Steps of linear warm-up from `at` that scale the schedule's factor (0: none).
    pub rewarm: u64,
}

/// The learning-rate factor at `step` (1-based) of a run of `total` steps, a fork's shift applied.
pub fn lr_factor(step: u64, total: u64, warmup_frac: f64, min_frac: f64, fork: Option<&ForkSchedule>) -> f64 {
    let Some(f) = fork else { return lr_scale(step, total, warmup_frac, min_frac) };
    let since = step.saturating_sub(f.at);
    let base = if f.restart {
        lr_scale(since, total.saturating_sub(f.at).max(1), warmup_frac, min_frac)
    } else {
        lr_scale(step, total, warmup_frac, min_frac)
    };
    let warm = if f.rewarm > 0 { (since as f64 / f.rewarm as f64).min(1.0) } else { 1.0 };
    base * warm
}

/// The factor in [min_frac, 1] that multiplies the peak learning rate at `step` (1-based).
pub fn lr_scale(step: u64, total: u64, warmup_frac: f64, min_frac: f64) -> f64 {
    let warmup = (warmup_frac * total as f64).round() as u64;
    if step <= warmup && warmup > 0 {
        return step as f64 / warmup as f64;
    }
    // The first step after warm-up runs at the peak; the last one just above the floor.
    let decay_steps = total.saturating_sub(warmup).max(1);
    let progress = ((step.saturating_sub(warmup + 1)) as f64 / decay_steps as f64).clamp(0.0, 1.0);
    min_frac + (1.0 - min_frac) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        let total = 100;
        assert!((lr_scale(1, total, 0.04, 0.0) - 0.25).abs() < 1e-12);
        assert!((lr_scale(4, total, 0.04, 0.0) - 1.0).abs() < 1e-12);
        assert!(lr_scale(50, total, 0.04, 0.0) < 1.0 && lr_scale(50, total, 0.04, 0.0) > 0.4);
        assert!((lr_scale(5, total, 0.04, 0.0) - 1.0).abs() < 1e-12);
        let last = lr_scale(100, total, 0.04, 0.1);
        assert!(last > 0.1 && last < 0.1 + 1e-3, "{last}");
        let mut prev = 1.0;
        for s in 5..=100 {
            let v = lr_scale(s, total, 0.04, 0.0);
            assert!(v <= prev + 1e-12, "not monotone at {s}");
            prev = v;
        }
        // A one-step run without warm-up trains at the peak.
        assert_eq!(lr_scale(1, 1, 0.0, 0.0), 1.0);
    }

    #[test]
    fn a_fork_continues_restarts_or_rewarms_its_schedule() {
        let (total, w, m) = (100, 0.04, 0.1);
        for s in 51..=100 {
            assert_eq!(lr_factor(s, total, w, m, None), lr_scale(s, total, w, m));
        }
        let cont = ForkSchedule { at: 50, restart: false, rewarm: 0 };
        assert_eq!(lr_factor(60, total, w, m, Some(&cont)), lr_scale(60, total, w, m));
        // A restart warms up over 4% of the 50 steps left (2 steps), then decays to the floor.
        let restart = ForkSchedule { at: 50, restart: true, rewarm: 0 };
        assert!((lr_factor(51, total, w, m, Some(&restart)) - 0.5).abs() < 1e-12);
        assert!((lr_factor(53, total, w, m, Some(&restart)) - 1.0).abs() < 1e-12);
        assert!(lr_factor(100, total, w, m, Some(&restart)) < 0.1 + 1e-2);
        // A re-warm of 10 steps: a tenth of the continued factor at the first step, all of it after 10.
        let rewarm = ForkSchedule { at: 50, restart: false, rewarm: 10 };
        assert!((lr_factor(51, total, w, m, Some(&rewarm)) - 0.1 * lr_scale(51, total, w, m)).abs() < 1e-12);
        assert_eq!(lr_factor(60, total, w, m, Some(&rewarm)), lr_scale(60, total, w, m));
    }
}
