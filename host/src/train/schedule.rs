//! Learning-rate schedule: linear warm-up, then cosine decay to a floor (the DFlash paper: 4% warm-up).

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
}
