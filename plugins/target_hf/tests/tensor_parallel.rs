//! Tensor- and expert-parallel replicas on the CPU (c10d's Gloo, ranks on threads): the features
//! and logits of a replica of T ranks equal the whole model's on one rank within float rounding,
//! for every family: dense (Mistral, the Llama layout, from safetensors and from a GGUF; Gemma 2
//! and 3), the hybrids (Qwen3.5:
//! Gated DeltaNet and gated attention; LFM2: short convolutions and attention), latent attention
//! (DeepSeek-V3, LongCat-Flash) and the MoE families with the experts over E = 2 groups; each
//! rank holds about 1 / T of the split weights; a rank that is gone mid-forward is named.

use c10d::Store;
use plugin_api::tch::{Device, Kind, Tensor};
use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    time::Duration,
};
use target_hf::{
    load,
    model::Decoder,
    tp::{Shard, TpGroup},
    weights::WeightBytes,
    HfTarget,
};

fn fixture(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(format!("target_{arch}"))
}

/// Two right-padded rows of ids below the fixtures' vocabulary (64).
fn ids() -> Tensor {
    Tensor::from_slice(&[3i64, 17, 8, 42, 5, 9, 60, 1, 33, 12, 7, 7, 50, 2, 11, 40, 23, 4]).view([2, 9])
}

/// `size` ranks on threads, each joining the group (rank 0 serves the store) and running `f`.
fn ranks<T: Send>(size: usize, f: impl Fn(usize, TpGroup) -> T + Sync) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let timeout = Duration::from_secs(20);
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (f, mine) = (&f, if rank == 0 { listener.take() } else { None });
                s.spawn(move || {
                    let store = match mine {
                        Some(l) => Store::serve(l, timeout),
                        None => Store::connect("127.0.0.1", port, timeout),
                    }
                    .unwrap();
                    f(rank, TpGroup::new(store, "replica0/", rank, size, Device::Cpu, timeout).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every layer's features [B, L, n*H] and the logits.
fn forward(t: &HfTarget) -> (Tensor, Tensor) {
    let layers: Vec<u32> = (0..t.model.cfg.num_hidden_layers as u32).collect();
    let (f, logits) = t.features(&ids(), &layers, true).unwrap();
    (f, logits.unwrap())
}

/// A replica of `size` ranks (experts over `ep` groups) of fixture `arch` against the whole model:
/// features and logits within rounding on every rank, and each rank's split weights about 1 / T
/// of the whole model's.
fn replica_equals_one_rank(arch: &str, size: usize, ep: usize) {
    replica_at_equals_one_rank(&fixture(arch), arch, size, ep);
}

/// [`replica_equals_one_rank`] of the model at `path` (an HF folder or a GGUF file).
fn replica_at_equals_one_rank(path: &Path, arch: &str, size: usize, ep: usize) {
    let whole = HfTarget::load(path, Device::Cpu, Kind::Float, 4).unwrap();
    let (want_f, want_logits) = forward(&whole);
    let out = ranks(size, |rank, group| {
        let shard = Shard::new(rank, size, ep).unwrap();
        let t = HfTarget::load_shard(path, Device::Cpu, Kind::Float, 4, shard, Some(group)).unwrap();
        let (f, logits) = forward(&t);
        (f, logits, t.model.held)
    });
    let all = whole.model.held.total();
    let parts: usize = out.iter().map(|(_, _, held)| held.part).sum();
    for (rank, (f, logits, held)) in out.iter().enumerate() {
        let what = format!("{arch}, rank {rank} of {size} (expert_parallel {ep})");
        for (name, got, want) in [("features", f, &want_f), ("logits", logits, &want_logits)] {
            assert_eq!(got.size(), want.size(), "{what}: {name}");
            let err = (got - want).abs().max().double_value(&[]);
            let scale = want.abs().max().double_value(&[]);
            assert!(err <= 2e-5 * scale.max(1.0), "{what}: {name} differ by {err:.2e} (scale {scale:.2})");
        }
        // Everything a rank holds is either replicated (read whole: embeddings, norms, routers) or
        // its part (a bias added once over the replica is the first rank's part); the parts are
        // about 1 / T of what the whole model holds beyond the replicated weights (more only where
        // T exceeds the key/value heads, which are then replicated).
        let WeightBytes { whole: replicated, part } = *held;
        let split = all - replicated;
        assert!(parts >= split, "{what}: the ranks' parts ({parts} B together) do not cover {split} B");
        assert!(part * size <= split * 3 / 2, "{what}: {part} B a rank of {split} B split over {size}");
        assert!(replicated < all / 2 && part > 0, "{what}: {held:?} of {all}");
    }
}

#[test]
fn a_dense_replica_over_two_and_four_ranks_equals_one_rank() {
    replica_equals_one_rank("mistral", 2, 1);
    replica_equals_one_rank("mistral", 4, 1);
}

#[test]
fn a_hybrid_replica_over_two_and_four_ranks_equals_one_rank() {
    replica_equals_one_rank("qwen3_5", 2, 1);
    replica_equals_one_rank("qwen3_5", 4, 1);
}

#[test]
fn moe_replicas_with_the_experts_over_two_groups_equal_one_rank() {
    replica_equals_one_rank("qwen3_moe", 2, 2);
    replica_equals_one_rank("qwen3_moe", 4, 2);
    replica_equals_one_rank("qwen3_5_moe", 4, 2);
    // Experts not split, their width over the ranks.
    replica_equals_one_rank("qwen3_5_moe", 2, 1);
}

/// Quantised checkpoints (`make_quant_fixtures.py`): each rank dequantises only its rows and
/// columns, with the scales of the blocks they are in (a head's rows start inside a block of
/// DeepSeek-V3's fixture), and MXFP4 experts split over two groups.
#[test]
fn quantised_replicas_equal_one_rank() {
    replica_equals_one_rank("qwen3_fp8", 2, 1);
    replica_equals_one_rank("deepseek_v3_fp8", 2, 1);
    replica_equals_one_rank("gpt_oss_mxfp4", 2, 2);
}

/// A llama GGUF written here: 2 layers, hidden 64, 4 heads of 16 (2 key/value heads), MLP 256,
/// 64 tokens; its matrices in the quantised types of llama.cpp's files, so that a rank's columns
/// of a row-parallel matrix cut inside blocks (o_proj's Q5_1 blocks of 32 over 4 ranks,
/// down_proj's Q4_K blocks of 256 over 2 and 4), and q/k in llama.cpp's permuted row order.
fn tiny_llama_gguf(dir: &tempfile::TempDir) -> PathBuf {
    use test_support::gguf::{gguf_bytes, write_temp, WTensor as T, V};
    // Deterministic bytes (LCG), masked so that every f16 scale and f32 they make is finite and small.
    let data = |n: usize, seed: u32| -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 24) as u8 & 0x3b
            })
            .collect()
    };
    let ones = |n: usize| -> Vec<u8> { (0..n).flat_map(|i| (1.0f32 + i as f32 / 256.0).to_le_bytes()).collect() };
    let s = V::str;
    let mut toks = vec![s("<|end|>"), s("a"), s("b"), s("ab")];
    toks.extend((4..64).map(|i| V::Str(format!("t{i}"))));
    let mut types = vec![V::I32(3)];
    types.extend((1..64).map(|_| V::I32(1)));
    let kvs = [
        ("general.architecture", s("llama")),
        ("llama.block_count", V::U32(2)),
        ("llama.context_length", V::U32(128)),
        ("llama.embedding_length", V::U32(64)),
        ("llama.feed_forward_length", V::U32(256)),
        ("llama.attention.head_count", V::U32(4)),
        ("llama.attention.head_count_kv", V::U32(2)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("smollm")),
        ("tokenizer.ggml.tokens", V::Arr(8, toks)),
        ("tokenizer.ggml.token_type", V::Arr(5, types)),
        ("tokenizer.ggml.merges", V::Arr(8, vec![s("a b")])),
        ("tokenizer.ggml.bos_token_id", V::U32(0)),
        ("tokenizer.ggml.eos_token_id", V::U32(0)),
    ];
    // Blocks x bytes a block.
    let q = |blocks: usize, bytes: usize| blocks * bytes;
    // The writer takes static names.
    let name =
        |layer: usize, n: &str| -> &'static str { Box::leak(format!("blk.{layer}.{n}.weight").into_boxed_str()) };
    let mut tensors = vec![
        T { name: "token_embd.weight", dims: vec![64, 64], ty: 8, data: data(q(128, 34), 1) },
        T { name: "output_norm.weight", dims: vec![64], ty: 0, data: ones(64) },
    ];
    for layer in 0..2 {
        let seed = 10 * layer as u32 + 2;
        tensors.extend([
            T { name: name(layer, "attn_norm"), dims: vec![64], ty: 0, data: ones(64) },
            T { name: name(layer, "ffn_norm"), dims: vec![64], ty: 0, data: ones(64) },
            T { name: name(layer, "attn_q"), dims: vec![64, 64], ty: 2, data: data(q(128, 18), seed) },
            T { name: name(layer, "attn_k"), dims: vec![64, 32], ty: 3, data: data(q(64, 20), seed + 1) },
            T { name: name(layer, "attn_v"), dims: vec![64, 32], ty: 6, data: data(q(64, 22), seed + 2) },
            T { name: name(layer, "attn_output"), dims: vec![64, 64], ty: 7, data: data(q(128, 24), seed + 3) },
            T { name: name(layer, "ffn_gate"), dims: vec![64, 256], ty: 8, data: data(q(512, 34), seed + 4) },
            T { name: name(layer, "ffn_up"), dims: vec![64, 256], ty: 1, data: data(64 * 256 * 2, seed + 5) },
            T { name: name(layer, "ffn_down"), dims: vec![256, 64], ty: 12, data: data(q(64, 144), seed + 6) },
        ]);
    }
    write_temp(dir, "tiny-llama.gguf", &gguf_bytes(&kvs, &tensors, 32))
}

/// A GGUF target over 2 and 4 ranks equals one rank, each rank dequantising only its part: the
/// loaded GGUF holds no tensor in memory until the decoder takes it, and each rank's weights (as
/// taken, dequantised) are about 1 / T of what is split.
#[test]
fn a_gguf_replica_dequantises_its_part_and_equals_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_llama_gguf(&dir);
    let loaded = load::load(&path).unwrap();
    assert!(loaded.weights.tensors.is_empty(), "a GGUF was dequantised before the decoder took its tensors");
    assert_eq!(loaded.weights.mapped.len(), 2 + 2 * 9);
    replica_at_equals_one_rank(&path, "llama GGUF", 2, 1);
    replica_at_equals_one_rank(&path, "llama GGUF", 4, 1);
}

#[test]
fn gemma2_replicas_over_two_and_four_ranks_equal_one_rank() {
    // Gemma 2: sliding and global layers, soft-capped scores (per head, so on each rank its own)
    // and logits (of the replicated LM head), norms after each sublayer, GeGLU; over 4 ranks each
    // of its 2 key/value heads is replicated on 2 ranks.
    replica_equals_one_rank("gemma2", 2, 1);
    replica_equals_one_rank("gemma2", 4, 1);
}

#[test]
fn gemma3_and_lfm2_replicas_over_two_ranks_equal_one_rank() {
    // Gemma 3: sliding and global layers, q/k norms, norms after each sublayer, GeGLU.
    replica_equals_one_rank("gemma3_text", 2, 1);
    // LFM2: the short convolutions' channels split, attention with q/k norms.
    replica_equals_one_rank("lfm2", 2, 1);
}

#[test]
fn latent_attention_replicas_equal_one_rank() {
    // DeepSeek-V3: MLA by heads, dense first layer, grouped sigmoid routing and a shared expert.
    replica_equals_one_rank("deepseek_v3", 2, 1);
    replica_equals_one_rank("deepseek_v3", 2, 2);
    replica_equals_one_rank("deepseek_v3", 4, 2);
    // LongCat-Flash: two MLA + MLP sublayers a layer, a shortcut MoE with zero-computation
    // experts (their input added once over the replica).
    replica_equals_one_rank("longcat_flash", 2, 1);
    replica_equals_one_rank("longcat_flash", 2, 2);
}

#[test]
fn glm4_moe_and_gpt_oss_replicas_equal_one_rank() {
    // GLM-4.5: partial RoPE, q/k/v biases, q/k norms, a shared expert.
    replica_equals_one_rank("glm4_moe", 2, 1);
    replica_equals_one_rank("glm4_moe", 2, 2);
    // gpt-oss: sinks split with their heads, biased clamped experts (interleaved gate/up).
    replica_equals_one_rank("gpt_oss", 2, 1);
    replica_equals_one_rank("gpt_oss", 2, 2);
    replica_equals_one_rank("gpt_oss", 4, 2);
}

/// `random_init` replicas (weights drawn at the config's shapes, each rank its part): every new
/// family builds over 2 ranks (the experts over 2 groups), runs through the group to finite
/// features, and each rank draws about half of what the whole model draws beyond the replicated
/// weights.
#[test]
fn random_replicas_of_every_new_family_draw_their_part() {
    for (arch, ep) in
        [("gemma3_text", 1), ("lfm2", 1), ("deepseek_v3", 2), ("glm4_moe", 2), ("gpt_oss", 2), ("longcat_flash", 2)]
    {
        let path = fixture(arch).join("config.json");
        let all = HfTarget::random(&path, Device::Cpu, Kind::Float, 4).unwrap().model.held.total();
        let out = ranks(2, |rank, group| {
            let shard = Shard::new(rank, 2, ep).unwrap();
            let t = HfTarget::random_shard(&path, Device::Cpu, Kind::Float, 4, shard, Some(group)).unwrap();
            let (f, logits) = forward(&t);
            (f.isfinite().all().int64_value(&[]) == 1 && logits.isfinite().all().int64_value(&[]) == 1, t.model.held)
        });
        for (rank, (finite, held)) in out.iter().enumerate() {
            let split = all - held.whole;
            assert!(*finite, "{arch}, rank {rank}: features not finite");
            assert!(held.part * 2 <= split * 3 / 2 && held.part * 3 >= split, "{arch}, rank {rank}: {held:?} of {all}");
        }
    }
}

/// Rank 1 of 2 stops after the first layer (its group dropped, its heartbeat stopped, as when its
/// process dies): rank 0's forward fails at the next all-reduce with an error naming rank 1.
#[test]
fn a_rank_gone_mid_forward_is_named() {
    let path = fixture("mistral");
    let out = ranks(2, |rank, group| {
        let shard = Shard::new(rank, 2, 1).unwrap();
        let t = HfTarget::load_shard(&path, Device::Cpu, Kind::Float, 4, shard, Some(group)).unwrap();
        if rank == 1 {
            let ids = ids();
            let positions = Tensor::arange(9, (Kind::Int64, Device::Cpu)).unsqueeze(0).expand([2, 9], false);
            let _ = t.model.run(&ids, &positions, None, None, None, 1, &[0]);
            drop(t);
            return Ok(());
        }
        t.features(&ids(), &[0, 1, 2, 3], false).map(|_| ())
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(e.starts_with("tensor-parallel rank 1 gone (no heartbeat for 3 s)"), "{e}");
    assert!(e.contains("failed on tensor-parallel rank 0"), "{e}");
}

/// Expert parallelism for a model without routed experts is refused naming the field and the
/// families that have it.
#[test]
fn expert_parallelism_without_routed_experts_is_refused() {
    for arch in ["mistral", "gemma2"] {
        let loaded = load::load(&fixture(arch)).unwrap();
        let shard = Shard::new(0, 2, 2).unwrap();
        let e = Decoder::new_shard(&loaded.cfg, loaded.weights, Device::Cpu, Kind::Float, shard, None).err().unwrap();
        assert!(e.starts_with(&format!("field `expert_parallel` = 2: `{arch}` has no routed experts")), "{e}");
        assert!(e.contains("qwen3_moe, qwen3_5_moe") && !e.contains("llama"), "{e}");
    }
}

/// The new families' splits are checked from the config alone, naming the field: heads of latent
/// attention, the short convolution's channels, the routed experts over the groups.
#[test]
fn uneven_splits_are_refused_from_the_config() {
    let cfg = |arch: &str| target_hf::config::DecoderConfig::read(&fixture(arch).join("config.json")).unwrap();
    let shard = |size, ep| Shard::new(0, size, ep).unwrap();
    let e = target_hf::tp::check(&cfg("deepseek_v3"), shard(8, 1)).unwrap_err();
    assert_eq!(e, "field `tensor_parallel` = 8: the attention heads (4) is not a multiple of 8");
    let mut lfm2 = cfg("lfm2");
    lfm2.hidden_size = 30;
    let e = target_hf::tp::check(&lfm2, shard(4, 1)).unwrap_err();
    assert!(e.starts_with("field `tensor_parallel` = 4: the short convolution's channels"), "{e}");
    let mut gpt_oss = cfg("gpt_oss");
    gpt_oss.num_experts = Some(6);
    let e = target_hf::tp::check(&gpt_oss, shard(4, 4)).unwrap_err();
    assert_eq!(e, "field `expert_parallel` = 4: the number of routed experts (6) is not a multiple of 4");
    // LongCat-Flash's shortcut MoE, beside the dense MLPs of every layer.
    let mut longcat = cfg("longcat_flash");
    longcat.moe_intermediate_size = Some(6);
    let e = target_hf::tp::check(&longcat, shard(4, 1)).unwrap_err();
    assert_eq!(
        e,
        "field `tensor_parallel / expert_parallel` = 4: an expert's intermediate size (6) is not a multiple of 4"
    );
}
