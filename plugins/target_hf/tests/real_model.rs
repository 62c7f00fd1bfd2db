//! The target on the real SmolLM2-135M-Instruct GGUF (installed by `make setup`): it answers like
//! the model, tells text from shuffled text, and loads back identically from an HF folder.

use plugin_api::tch::{Device, Kind, Tensor};
use std::path::PathBuf;
use target_hf::{generate, load, HfTarget};

fn gguf_path() -> PathBuf {
    let cache = std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/dflash"));
    let p = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `make setup`", p.display());
    p
}

fn target() -> HfTarget {
    HfTarget::load(&gguf_path(), Device::Cpu, Kind::Float, 4).unwrap()
}

fn encode(t: &HfTarget, text: &str) -> Vec<u32> {
    t.tokenizer.encode(text, false).unwrap().get_ids().to_vec()
}

/// Mean next-token negative log-likelihood of `ids` under the model.
fn nll(t: &HfTarget, ids: &[u32]) -> f64 {
    let x = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0);
    let (_, logits) = t.features(&x, &[0], true).unwrap();
    let logits = logits.unwrap().squeeze_dim(0);
    let n = ids.len() as i64;
    let logp = logits.narrow(0, 0, n - 1).log_softmax(-1, Kind::Float);
    let next = x.squeeze_dim(0).narrow(0, 1, n - 1);
    -logp.gather(1, &next.unsqueeze(1), false).mean(Kind::Float).double_value(&[])
}

const PARAGRAPH: &str = "The river rises in the hills to the north and flows south through a wide green valley. \
For centuries the farmers who lived along its banks grew wheat and barley, and in the autumn they carried \
their grain to the market town at the mouth of the river, where ships waited to take it across the sea.";

#[test]
fn greedy_answer_names_paris() {
    let t = target();
    let prompt = encode(&t, "The capital of France is");
    let out = generate::greedy(&t.model, &[prompt], 4, &[], 1);
    let text = t.tokenizer.decode(&out[0], false).unwrap();
    assert!(text.starts_with(" Paris"), "got {text:?}");
}

#[test]
fn natural_text_is_far_more_likely_than_the_same_words_shuffled() {
    let t = target();
    let ids = encode(&t, PARAGRAPH);
    let mut words: Vec<&str> = PARAGRAPH.split(' ').collect();
    // A fixed permutation (reverse every 3-word group, then rotate) keeps the test deterministic.
    for c in words.chunks_mut(3) {
        c.reverse();
    }
    words.rotate_left(7);
    let shuffled = encode(&t, &words.join(" "));
    let (ppl, ppl_shuffled) = (nll(&t, &ids).exp(), nll(&t, &shuffled).exp());
    eprintln!("perplexity: text {ppl:.2}, shuffled {ppl_shuffled:.2}");
    assert!(ppl < 30.0, "perplexity of natural text {ppl}");
    assert!(ppl_shuffled > 4.0 * ppl, "shuffled {ppl_shuffled} vs natural {ppl}");
}

#[test]
fn batched_left_padded_generation_equals_one_by_one() {
    let t = target();
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "Once upon a time, there was a little", "1, 2, 3, 4,"]
        .iter()
        .map(|p| encode(&t, p))
        .collect();
    let batched = generate::greedy(&t.model, &prompts, 8, &[], 3);
    for (p, b) in prompts.iter().zip(&batched) {
        let single = generate::greedy(&t.model, std::slice::from_ref(p), 8, &[], 1);
        assert_eq!(&single[0], b);
    }
}

#[test]
fn kv_cache_generation_equals_full_recompute() {
    let t = target();
    let prompt = encode(&t, "Once upon a time, there was a little");
    let cached = generate::greedy(&t.model, std::slice::from_ref(&prompt), 6, &[], 1).remove(0);
    // Without a cache: the full sequence each step, argmax of the last position.
    let mut ids = prompt.clone();
    for _ in 0..6 {
        let x = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0);
        let (_, logits) = t.features(&x, &[0], true).unwrap();
        let next = logits.unwrap().select(1, ids.len() as i64 - 1).argmax(-1, false).int64_value(&[0]);
        ids.push(next as u32);
    }
    assert_eq!(cached, ids[prompt.len()..].to_vec());
}

#[test]
fn hf_folder_round_trip_gives_identical_logits() {
    let loaded = load::load(&gguf_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    load::save_hf_dir(&loaded, dir.path()).unwrap();
    let a = target();
    let b = HfTarget::load(dir.path(), Device::Cpu, Kind::Float, 4).unwrap();
    let ids = encode(&a, PARAGRAPH);
    assert_eq!(ids, encode(&b, PARAGRAPH), "tokenizer differs after the round trip");
    let x = Tensor::from_slice(&ids.iter().map(|&i| i as i64).collect::<Vec<_>>()).unsqueeze(0);
    let (ha, la) = a.features(&x, &[1, 14, 27], true).unwrap();
    let (hb, lb) = b.features(&x, &[1, 14, 27], true).unwrap();
    assert_eq!(ha.size(), vec![1, ids.len() as i64, 3 * 576]);
    assert!(ha.equal(&hb) && la.unwrap().equal(&lb.unwrap()));
}
