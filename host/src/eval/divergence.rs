//! Where a speculative response parts from the target's own greedy one, and how close the
//! target's choice was there. In 16-bit floats the verify forward over a block rounds
//! differently from a forward over one token, so where the target's top two tokens nearly tie
//! either can win; in f32 any difference is a fault.

use super::report::{Divergence, PromptTokens};
use crate::pipeline::components::Components;
use anyhow::{anyhow, Result};
use plugin_api::{
    tch::{self, Kind, Tensor},
    TensorHandle,
};

impl Divergence {
    /// Where `t`'s responses first differ, with the target's top two logits there; None where
    /// they are equal.
    pub fn find(c: &mut Components, t: &PromptTokens) -> Result<Option<Self>> {
        let (a, b) = (&t.target_ids, &t.speculative_ids);
        let Some(token) =
            a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))
        else {
            return Ok(None);
        };
        let _guard = tch::no_grad_guard();
        let ids: Vec<i64> = t.prompt_ids.iter().chain(&a[..token]).map(|&x| x as i64).collect();
        let out = c.target.forward(&TensorHandle::new(Tensor::from_slice(&ids).unsqueeze(0)), &[], true)?;
        let logits = out.logits.into_option().ok_or_else(|| anyhow!("target gave no logits"))?.into_tensor();
        let (top, _) = logits.select(1, -1).to_kind(Kind::Float).topk(2, -1, true, true);
        let top = Vec::<f64>::try_from(top.flatten(0, -1).to_kind(Kind::Double))?;
        Ok(Some(Divergence {
            prompt: t.prompt,
            token,
            target_id: a.get(token).copied(),
            speculative_id: b.get(token).copied(),
            top_logits: [top[0], top[1]],
        }))
    }

    /// `prompt 4 at token 12 (logits 15.23 / 15.19)`.
    pub fn describe(&self) -> String {
        let [first, second] = self.top_logits;
        format!("prompt {} at token {} (top logits {first:.3} / {second:.3})", self.prompt, self.token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first differing new token, or the end of the shorter response; the target's top two
    /// logits there, largest first, the target's token among them when they do not tie.
    #[test]
    fn a_divergence_is_the_first_differing_token_with_the_targets_top_two_logits() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = super::super::decode::tests::tiny_components(dir.path());
        let prompt = vec![5u32, 9, 3, 7, 2];
        let reply = c.target.generate(vec![prompt.clone()], 6, &[]).unwrap().remove(0);
        let tokens = |speculative: Vec<u32>| PromptTokens {
            prompt: 3,
            prompt_ids: prompt.clone(),
            target_ids: reply.clone(),
            speculative_ids: speculative,
        };
        assert!(Divergence::find(&mut c, &tokens(reply.clone())).unwrap().is_none());
        let mut other = reply.clone();
        other[4] = (other[4] + 1) % 32;
        let d = Divergence::find(&mut c, &tokens(other.clone())).unwrap().unwrap();
        assert_eq!((d.prompt, d.token, d.target_id, d.speculative_id), (3, 4, Some(reply[4]), Some(other[4])));
        assert!(d.top_logits[0] >= d.top_logits[1], "{:?}", d.top_logits);
        assert!(d.describe().starts_with("prompt 3 at token 4 (top logits"), "{}", d.describe());
        let d = Divergence::find(&mut c, &tokens(reply[..2].to_vec())).unwrap().unwrap();
        assert_eq!((d.token, d.speculative_id), (2, None));
    }
}
