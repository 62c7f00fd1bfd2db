//! Training the drafter: the loop ([`trainer`]), one optimizer step ([`step_runner`], shared with
//! `bench train`) made of the drafter's loss and the step's reductions ([`step`]), what is kept
//! between steps ([`state`]), the validation split scored every `eval_every` steps
//! ([`validation`]), and the DFlash pieces the step is made of: anchors, the loss, the
//! learning-rate schedule.

pub mod anchors;
pub mod carry;
pub mod fork;
pub mod loss;
pub mod schedule;
pub mod start;
pub mod state;
pub mod step;
pub mod step_runner;
pub mod trainer;
pub mod validation;

pub use state::{DistillSummary, ResumeFrom, StepMetrics, TrainSummary, TrainerState};
pub use step::DraftLoss;
pub use step_runner::StepRunner;
pub use trainer::{train, RunFolder, TrainOptions};
