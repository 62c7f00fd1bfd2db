//! A drafter's clauses: the output's shape, determinism under a seed, gradients, its config and
//! weights re-creating it.

use super::kit::{max_diff, Clause, Kit, CPU};
use crate::plugins::handles::DrafterHandle;
use anyhow::{anyhow, bail, Result};
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    DraftInput, HostContext, NamedTensor, PluginInstance, PluginKind, TensorHandle,
};

impl Kit<'_> {
    fn drafter_box(&self, ctx: &HostContext) -> Result<DrafterHandle> {
        tch::manual_seed(ctx.seed as i64);
        let PluginInstance::Drafter(d) = self.create(PluginKind::Drafter, &self.section, ctx)? else { unreachable!() };
        Ok(DrafterHandle::new(d, &self.section.plugin))
    }

    pub(super) fn drafter(&self) -> Result<Vec<Clause>> {
        let ctx = self.ctx_with_target()?;
        let spec = ctx.target.clone().unwrap();
        let h = spec.hidden_size as i64;
        let input = |d: &DrafterHandle| -> Result<DraftInput> {
            let (b, s, a, bk) = (2i64, 24i64, 2i64, d.block_size()? as i64);
            let n = d.target_layer_ids()?.len() as i64;
            tch::manual_seed(7);
            Ok(DraftInput {
                target_hidden: TensorHandle::new(Tensor::randn([b, s, n * h], CPU)),
                block_embeds: TensorHandle::new(Tensor::randn([b, a * bk, h], CPU)),
                anchors: TensorHandle::new(Tensor::from_slice(&[3i64, 11, 5, 13]).view([b, a])),
                anchor_valid: TensorHandle::new(Tensor::ones([b, a], (Kind::Bool, Device::Cpu))),
            })
        };
        let forward = |d: &mut DrafterHandle| -> Result<Tensor> {
            let x = input(d)?;
            d.anchors_on_host(&x.anchors)?;
            d.forward(&x)
        };
        let mut out = Vec::new();
        out.push(self.clause("output shape [B, A*Bk, H]", || {
            let mut d = self.drafter_box(&ctx)?;
            let y = tch::no_grad(|| forward(&mut d))?;
            let want = vec![2, 2 * d.block_size()? as i64, h];
            if y.size() != want {
                bail!("output {:?}, expected {want:?}", y.size());
            }
            Ok(())
        }));
        out.push(self.clause("deterministic under a seed", || {
            let mut a = self.drafter_box(&ctx)?;
            let mut b = self.drafter_box(&ctx)?;
            let (ya, yb) = tch::no_grad(|| Ok::<_, anyhow::Error>((forward(&mut a)?, forward(&mut b)?)))?;
            let d = max_diff(&ya, &yb);
            if d > 0.0 {
                bail!("two drafters created with seed {} differ by {d:e}", ctx.seed);
            }
            Ok(())
        }));
        out.push(self.clause("gradients reach every trainable parameter", || {
            let mut d = self.drafter_box(&ctx)?;
            let y = forward(&mut d)?;
            if y.requires_grad() && y.is_leaf() {
                let g = Tensor::ones_like(&y);
                d.backward(&TensorHandle::new(g))?;
            } else {
                (&y * y.ones_like().cumsum(-1, Kind::Float)).sum(Kind::Float).backward();
            }
            let missing: Vec<String> = d
                .parameters()?
                .iter()
                .filter(|p| {
                    let g = p.tensor.tensor().grad();
                    !g.defined() || g.abs().sum(Kind::Double).double_value(&[]) == 0.0
                })
                .map(|p| p.name.to_string())
                .collect();
            if !missing.is_empty() {
                bail!("no gradient for {}", missing.join(", "));
            }
            Ok(())
        }));
        out.push(self.clause("config_json parses and its weights re-create the same model", || {
            let mut a = self.drafter_box(&ctx)?;
            let json = a.config_json()?;
            serde_json::from_str::<serde_json::Value>(&json).map_err(|e| anyhow!("config_json is not JSON: {e}"))?;
            let mut other = ctx.clone();
            other.seed = ctx.seed + 1;
            let mut b = self.drafter_box(&other)?;
            if b.config_json()? != json {
                bail!("the same section gives another config_json");
            }
            let weights: Vec<NamedTensor> = a
                .parameters()?
                .iter()
                .map(|p| NamedTensor::new(p.name.to_string(), p.tensor.tensor().detach().copy()))
                .collect();
            b.load_weights(weights.into())?;
            let (ya, yb) = tch::no_grad(|| Ok::<_, anyhow::Error>((forward(&mut a)?, forward(&mut b)?)))?;
            let d = max_diff(&ya, &yb);
            if d > 0.0 {
                bail!("a drafter given the first one's weights differs by {d:e}");
            }
            Ok(())
        }));
        Ok(out)
    }
}
