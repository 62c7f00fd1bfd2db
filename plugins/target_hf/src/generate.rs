//! Batched greedy generation with a KV / recurrent cache (self-distillation, eval baselines).

use crate::{decode_graph::StaticDecoding, model::Decoder};
use plugin_api::tch::{Kind, Tensor};

/// Greedy continuation of each prompt, up to `max_new` tokens or a stop token (kept). Prompts
/// are grouped by length into batches of `batch`, left-padded, and returned in input order.
pub fn greedy(model: &Decoder, prompts: &[Vec<u32>], max_new: usize, stop: &[u32], batch: usize) -> Vec<Vec<u32>> {
    let _guard = plugin_api::tch::no_grad_guard();
    // Every step has a new key length, and cuDNN's attention plans per shape (60 ms each in
    // bf16 on an H200): self-distillation and eval baselines decode without it.
    let _no_cudnn = kernels::CudnnAttentionOff::new();
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(prompts[i].len()));
    let mut out = vec![Vec::new(); prompts.len()];
    for chunk in order.chunks(batch.max(1)) {
        let group: Vec<&[u32]> = chunk.iter().map(|&i| prompts[i].as_slice()).collect();
        for (&i, reply) in chunk.iter().zip(greedy_batch(model, &group, max_new, stop)) {
            out[i] = reply;
        }
    }
    out
}

fn greedy_batch(model: &Decoder, prompts: &[&[u32]], max_new: usize, stop: &[u32]) -> Vec<Vec<u32>> {
    let device = model.device();
    let b = prompts.len() as i64;
    let l = prompts.iter().map(|p| p.len()).max().unwrap_or(0).max(1) as i64;
    // 1. Left-pad (id 0; masked out) so every prompt ends at the last column.
    let mut ids = vec![0i64; (b * l) as usize];
    let mut valid = vec![false; (b * l) as usize];
    for (r, p) in prompts.iter().enumerate() {
        let start = l as usize - p.len();
        for (c, &t) in p.iter().enumerate() {
            ids[r * l as usize + start + c] = t as i64;
            valid[r * l as usize + start + c] = true;
        }
    }
    let ids = Tensor::from_slice(&ids).view([b, l]).to_device(device);
    let mut key_valid = Tensor::from_slice(&valid).view([b, l]).to_device(device);
    let positions = (key_valid.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0);
    // 2. Prefill: causal and not padding; a padding query sees itself so no row is empty. The
    //    Gated DeltaNet layers zero the padding rows, so each row's recurrence starts at its
    //    first token.
    let causal = Tensor::ones([l, l], (Kind::Bool, device)).tril(0).unsqueeze(0);
    let eye = Tensor::eye(l, (Kind::Bool, device)).unsqueeze(0);
    let mask = (causal.logical_and(&key_valid.unsqueeze(1))).logical_or(&eye).unsqueeze(1);
    let mut cache = model.new_cache(false);
    let n = model.cfg.num_hidden_layers;
    let (_, normed) = model.run(&ids, &positions, Some(&mask), Some(&key_valid), Some(&mut cache), n, &[]);
    let mut next = model.logits(&normed.expect("all layers ran").select(1, l - 1)).argmax(-1, false); // [B]
    let mut pos = positions.select(1, l - 1) + 1;
    // 3. Decode one token a step for every row until each has stopped.
    let mut replies = vec![Vec::new(); prompts.len()];
    let mut done = vec![false; prompts.len()];
    // `pos` is the rows' positions as a tensor, not a counter to zip with.
    #[allow(clippy::explicit_counter_loop)]
    for step in 0..max_new {
        let tokens: Vec<i64> = Vec::try_from(&next.to_device(plugin_api::tch::Device::Cpu)).expect("int64 tokens");
        for (r, &t) in tokens.iter().enumerate() {
            if !done[r] {
                replies[r].push(t as u32);
                done[r] = stop.contains(&(t as u32));
            }
        }
        if step + 1 == max_new || done.iter().all(|&d| d) {
            break;
        }
        key_valid = Tensor::cat(&[&key_valid, &Tensor::ones([b, 1], (Kind::Bool, device))], 1);
        let mask = key_valid.unsqueeze(1).unsqueeze(1); // [B, 1, 1, T]
        let (_, normed) = model.run(&next.unsqueeze(1), &pos.unsqueeze(1), Some(&mask), None, Some(&mut cache), n, &[]);
        next = model.logits(&normed.expect("all layers ran").select(1, 0)).argmax(-1, false);
        pos += 1;
    }
    replies
}

/// Greedy continuation of one prompt on a static-cache session (`decode_graph.rs`): the prompt's
/// forward, then one recorded forward a token. The same tokens as [`greedy`] up to rounding.
pub fn greedy_static(
    model: &Decoder,
    session: &mut StaticDecoding,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
) -> Result<Vec<u32>, String> {
    let _guard = plugin_api::tch::no_grad_guard();
    let _no_cudnn = kernels::CudnnAttentionOff::new();
    session.reset();
    let ids = Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).unsqueeze(0);
    let (_, logits) = session.extend(model, &ids, &[])?;
    let mut next = logits.select(1, -1).argmax(-1, true); // [1, 1]
    let mut reply = Vec::new();
    while reply.len() < max_new {
        let token = next.int64_value(&[0, 0]) as u32;
        reply.push(token);
        if stop.contains(&token) || reply.len() == max_new {
            break;
        }
        let (_, logits) = session.extend(model, &next, &[])?;
        next = logits.select(1, 0).argmax(-1, true);
    }
    Ok(reply)
}
