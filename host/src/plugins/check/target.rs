//! A target's clauses: the requested layers' features, the KV cache against recomputation.

use super::kit::{max_diff, Clause, Kit};
use crate::plugins::handles::TargetHandle;
use anyhow::{anyhow, bail, Result};
use plugin_api::{tch::Tensor, PluginInstance, PluginKind, TensorHandle};

impl Kit<'_> {
    pub(super) fn target(&self) -> Result<Vec<Clause>> {
        let PluginInstance::Target(t) = self.create(PluginKind::Target, &self.section, &self.ctx)? else {
            unreachable!()
        };
        let mut t = TargetHandle::new(t, &self.section.plugin);
        let spec = t.spec()?;
        let (n, h) = (spec.num_hidden_layers, spec.hidden_size as i64);
        let v = spec.vocab_size as i64;
        let ids = Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 8, 4]).remainder(v).view([1, 8]);
        let layers = [0u32, n.saturating_sub(1)];
        let mut out = Vec::new();
        out.push(self.clause("features of the requested layers", || {
            let both = t.forward(&TensorHandle::new(ids.shallow_clone()), &layers, true)?;
            let hidden = both.hidden.tensor();
            if hidden.size() != [1, 8, 2 * h] {
                bail!("features of 2 layers: {:?}, expected [1, 8, {}]", hidden.size(), 2 * h);
            }
            let logits = both.logits.into_option().ok_or_else(|| anyhow!("no logits when asked for"))?.tensor();
            if logits.size() != [1, 8, v] {
                bail!("logits {:?}, expected [1, 8, {v}]", logits.size());
            }
            for (i, &l) in layers.iter().enumerate() {
                let one = t.forward(&TensorHandle::new(ids.shallow_clone()), &[l], false)?.hidden.tensor();
                let d = max_diff(&one, &hidden.narrow(-1, i as i64 * h, h));
                if d > 1e-5 {
                    bail!("layer {l} asked alone differs from its slice of [{}, {}] by {d:e}", layers[0], layers[1]);
                }
            }
            if layers[0] != layers[1] {
                let d = max_diff(&hidden.narrow(-1, 0, h), &hidden.narrow(-1, h, h));
                if d == 0.0 {
                    bail!("layers {} and {} give the same features", layers[0], layers[1]);
                }
            }
            Ok(())
        }));
        out.push(self.clause("KV-cache extend / truncate equals recomputation", || {
            let full = t.forward(&TensorHandle::new(ids.shallow_clone()), &layers, true)?;
            let logits_of = |o: plugin_api::TargetOutput| o.logits.into_option().map(|l| l.tensor()).ok_or_else(|| anyhow!("no logits"));
            let (fh, fl) = (full.hidden.tensor(), logits_of(full)?);
            t.cache_reset()?;
            let a = t.cache_extend(&TensorHandle::new(ids.narrow(1, 0, 5)), &layers)?;
            // Two positions that a truncate drops again, then the true continuation.
            let _ = t.cache_extend(&TensorHandle::new(ids.narrow(1, 6, 2)), &layers)?;
            t.cache_truncate(5)?;
            let b = t.cache_extend(&TensorHandle::new(ids.narrow(1, 5, 3)), &layers)?;
            let hidden = Tensor::cat(&[a.hidden.tensor(), b.hidden.tensor()], 1);
            let logits = Tensor::cat(&[logits_of(a)?, logits_of(b)?], 1);
            let (dh, dl) = (max_diff(&hidden, &fh), max_diff(&logits, &fl));
            let scale = fl.abs().max().double_value(&[]).max(1.0);
            if dh > 1e-3 * fh.abs().max().double_value(&[]).max(1.0) || dl > 1e-3 * scale {
                bail!("extend 5, extend 2, truncate to 5, extend 3 differs from one forward: features by {dh:e}, logits by {dl:e}");
            }
            Ok(())
        }));
        Ok(out)
    }
}
