//! A data loader's clauses: seeking to a saved position, the loss mask.

use super::kit::{Clause, Kit};
use crate::plugins::handles::DataHandle;
use anyhow::{bail, Result};
use plugin_api::{tch::Tensor, DataPosition, PluginInstance, PluginKind};

impl Kit<'_> {
    fn data_box(&self, tokenizer: &str) -> Result<DataHandle> {
        let PluginInstance::DataLoader(d) =
            self.create(PluginKind::DataLoader, &self.section, &self.ctx_with_target()?)?
        else {
            unreachable!()
        };
        let mut d = DataHandle::new(d, &self.section.plugin);
        d.open(tokenizer)?;
        if !d.distill_request()?.prompts.is_empty() {
            bail!("the data loader asks for self-distillation; check it with a section that turns it off (e.g. --section '... distill = false')");
        }
        Ok(d)
    }

    pub(super) fn data_loader(&self) -> Result<Vec<Clause>> {
        let tokenizer = self.target_box()?.tokenizer_json()?;
        let batches = |d: &mut DataHandle, n: usize| -> Result<Vec<(Tensor, Tensor)>> {
            let mut out = Vec::new();
            for _ in 0..4 * n {
                if out.len() == n {
                    break;
                }
                if let Some(b) = d.next_batch()? {
                    out.push((b.input_ids.tensor(), b.loss_mask.tensor()));
                }
            }
            if out.len() < n {
                bail!("{} batches in {} calls of next_batch", out.len(), 4 * n);
            }
            Ok(out)
        };
        let mut out = Vec::new();
        out.push(self.clause("seeking to a saved position gives the same batches", || {
            let mut a = self.data_box(&tokenizer)?;
            batches(&mut a, 1)?;
            let saved: DataPosition = a.position()?;
            let want = batches(&mut a, 3)?;
            let mut b = self.data_box(&tokenizer)?;
            b.seek(saved)?;
            let got = batches(&mut b, 3)?;
            for (i, ((wi, wm), (gi, gm))) in want.iter().zip(&got).enumerate() {
                if wi.size() != gi.size() || !wi.equal(gi) || !wm.equal(gm) {
                    bail!("batch {} after seeking to {saved:?} differs from the one after that position", i + 1);
                }
            }
            Ok(())
        }));
        out.push(self.clause("the loss mask is on response tokens only", || {
            let mut d = self.data_box(&tokenizer)?;
            let (mut seen, mut calls) = (0, 0);
            while seen < 2 {
                calls += 1;
                if calls > 8 {
                    bail!("no batch in {calls} calls of next_batch");
                }
                let Some(b) = d.next_batch()? else { continue };
                seen += 1;
                let ids: Vec<Vec<i64>> = Vec::try_from(b.input_ids.tensor())?;
                let mask: Vec<Vec<i64>> = Vec::try_from(b.loss_mask.tensor())?;
                for (row, (ids, mask)) in ids.iter().zip(&mask).enumerate() {
                    let len = b.lengths.get(row).copied().unwrap_or(0) as usize;
                    if len == 0 || len > ids.len() {
                        bail!("sequence {row}: length {len} for a row of {} tokens", ids.len());
                    }
                    if mask.iter().any(|&m| m != 0 && m != 1) {
                        bail!("sequence {row}: the loss mask holds values other than 0 and 1");
                    }
                    if mask[len..].contains(&1) {
                        bail!("sequence {row}: padding (positions {len}..) is in the loss mask");
                    }
                    if mask[0] == 1 {
                        bail!("sequence {row}: its first token is in the loss mask (a response always has a prompt before it)");
                    }
                    if !mask.contains(&1) {
                        bail!("sequence {row}: no response token in its loss mask");
                    }
                    if mask.iter().filter(|&&m| m == 1).count() == len - 1 {
                        bail!("sequence {row}: every token after the first is in the loss mask (prompts too?)");
                    }
                }
            }
            Ok(())
        }));
        Ok(out)
    }
}
