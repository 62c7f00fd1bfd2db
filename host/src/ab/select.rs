//! Choosing a swept arm's value: each value's first-seed run scored on a validation measure
//! only (real tau on the validation prompts, or the validation split's tau-hat or loss at the
//! run's last step), never on the test prompts or training metrics; the best value is the
//! arm's, and `selection.json` records every score and the choice.

use super::{measure::Select, plan::Plan};
use crate::compare::{ArmSweep, Selection, SweepScore, SELECTION_FILE};
use anyhow::{bail, Result};
use std::collections::BTreeMap;

/// The best score's index (the first among equals); None when no value has one.
pub fn best(scores: &[Option<f64>], higher_is_better: bool) -> Option<usize> {
    let key = |x: f64| if higher_is_better { x } else { -x };
    scores
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.map(|s| (i, key(s))))
        .fold(None, |b: Option<(usize, f64)>, (i, k)| match b {
            Some((_, bk)) if bk >= k => b,
            _ => Some((i, k)),
        })
        .map(|(i, _)| i)
}

/// Score every swept value's first-seed run and choose each swept arm's best; arms that sweep
/// nothing are not in it. Fails when an arm has no scored value.
pub fn choose(plan: &Plan) -> Result<Selection> {
    let select = plan.select.unwrap_or(Select::ValTauHat);
    let mut arms = Vec::new();
    for a in plan.arms.iter().filter(|a| !a.fields.is_empty()) {
        let scores: Vec<Option<f64>> = a.points.iter().map(|p| select.score(&p.runs[0].dir)).collect();
        let Some(i) = best(&scores, select.higher_is_better()) else {
            bail!(
                "arm `{}`: none of its swept values has a {} in its run folder ({}): nothing to choose by",
                a.arm,
                select.as_str(),
                a.points.iter().map(|p| p.runs[0].dir.display().to_string()).collect::<Vec<_>>().join(", ")
            );
        };
        let folder =
            |r: &super::plan::ArmRun| r.dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let points = a
            .points
            .iter()
            .zip(&scores)
            .map(|(p, &score)| {
                let point = p.point.as_ref().expect("a swept arm's points are points");
                let values: BTreeMap<String, serde_json::Value> = point
                    .values
                    .iter()
                    .map(|(f, v)| (f.clone(), serde_json::to_value(v).unwrap_or(serde_json::Value::Null)))
                    .collect();
                SweepScore { label: point.label.clone(), values, run: folder(&p.runs[0]), score }
            })
            .collect();
        arms.push(ArmSweep {
            arm: a.arm.clone(),
            fields: a.fields.clone(),
            points,
            chosen: a.points[i].point.as_ref().expect("a point").label.clone(),
            chosen_runs: a.points[i].runs.iter().map(folder).collect(),
        });
    }
    let seed = plan.arms.first().and_then(|a| a.points.first()).map_or(0, |p| p.runs[0].seed);
    Ok(Selection { select: select.as_str().into(), higher_is_better: select.higher_is_better(), seed, arms })
}

/// Write the selection into the A/B folder, whole.
pub fn write(plan: &Plan, selection: &Selection) -> Result<()> {
    crate::experiment::write_json_atomic(&plan.dir.join(SELECTION_FILE), selection)
}
