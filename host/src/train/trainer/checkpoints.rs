//! When the trainer writes a checkpoint, in one place: every `checkpoint_every` steps, at the
//! last step, and when the run stops early (a signal, `--stop-at`); never of non-finite weights,
//! so a diverged step leaves the last good checkpoint as the one a resume starts from.

use crate::config::TrainConfig;

pub(super) struct CheckpointPolicy {
    /// Every this many steps (0: none but the last and a stop's).
    every: u64,
    /// The schedule's last step.
    last: u64,
}

/// What the policy says after a step.
#[derive(Debug, PartialEq)]
pub(super) enum Checkpoint {
    NotDue,
    Write,
    /// Due, but the weights are not finite: the last good checkpoint stays the latest.
    NonFinite,
}

impl CheckpointPolicy {
    pub(super) fn new(t: &TrainConfig) -> Self {
        CheckpointPolicy { every: t.checkpoint_every, last: t.steps }
    }

    /// `stopping`: a signal or `--stop-at` ends the run after this step. `finite` is asked only
    /// when a checkpoint is due (it reads every weight).
    pub(super) fn after_step(&self, step: u64, stopping: bool, finite: impl FnOnce() -> bool) -> Checkpoint {
        let due = (self.every > 0 && step % self.every == 0) || step == self.last || stopping;
        match (due, due && finite()) {
            (false, _) => Checkpoint::NotDue,
            (true, true) => Checkpoint::Write,
            (true, false) => Checkpoint::NonFinite,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_is_due_every_n_steps_at_the_last_and_on_a_stop_but_never_of_non_finite_weights() {
        let p = CheckpointPolicy { every: 3, last: 10 };
        let due: Vec<u64> = (1..=10).filter(|&s| p.after_step(s, false, || true) == Checkpoint::Write).collect();
        assert_eq!(due, [3, 6, 9, 10]);
        assert_eq!(p.after_step(4, true, || true), Checkpoint::Write, "a stop writes one");
        assert_eq!(p.after_step(6, false, || false), Checkpoint::NonFinite);
        assert_eq!(p.after_step(4, false, || panic!("weights read when nothing is due")), Checkpoint::NotDue);
        let last_only = CheckpointPolicy { every: 0, last: 5 };
        let due: Vec<u64> = (1..=5).filter(|&s| last_only.after_step(s, false, || true) == Checkpoint::Write).collect();
        assert_eq!(due, [5]);
    }
}
