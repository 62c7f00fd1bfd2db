//! Tensor- and expert-parallel replicas on the CPU (c10d's Gloo, ranks on threads): the features
//! and logits of a replica of T ranks equal the whole model's on one rank within float rounding,
//! for every family that splits: dense (Mistral, the Llama layout; Gemma 3), the hybrids (Qwen3.5:
//! Gated DeltaNet and gated attention; LFM2: short convolutions and attention), latent attention
//! (DeepSeek-V3, LongCat-Flash) and the MoE families with the experts over E = 2 groups; each
//! rank holds about 1 / T of the split weights; a rank that is gone mid-forward is named.

use c10d::Store;
use plugin_api::tch::{Device, Kind, Tensor};
use std::{net::TcpListener, path::PathBuf, time::Duration};
use target_hf::{
    load,
    model::{Decoder, WeightBytes},
    tp::{Shard, TpGroup},
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
    let path = fixture(arch);
    let whole = HfTarget::load(&path, Device::Cpu, Kind::Float, 4).unwrap();
    let (want_f, want_logits) = forward(&whole);
    let out = ranks(size, |rank, group| {
        let shard = Shard::new(rank, size, ep).unwrap();
        let t = HfTarget::load_shard(&path, Device::Cpu, Kind::Float, 4, shard, Some(group)).unwrap();
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
            t.model.run(&ids, &positions, None, None, None, 1);
            drop(t);
            return Ok(());
        }
        t.features(&ids(), &[0, 1, 2, 3], false).map(|_| ())
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(e.starts_with("tensor-parallel rank 1 gone (no heartbeat for 3 s)"), "{e}");
    assert!(e.contains("failed on tensor-parallel rank 0"), "{e}");
}

/// A family without tensor parallelism is refused naming the field and the families that have it;
/// so is expert parallelism for a dense model.
#[test]
fn families_without_the_parallelism_asked_for_are_refused() {
    let loaded = load::load(&fixture("gemma2")).unwrap();
    let e =
        Decoder::new_shard(&loaded.cfg, loaded.weights, Device::Cpu, Kind::Float, Shard::new(0, 2, 1).unwrap(), None)
            .err()
            .unwrap();
    assert!(e.starts_with("field `tensor_parallel` = 2: `gemma2` models run on a single device"), "{e}");
    assert!(e.contains("llama, mistral") && e.contains("qwen3_5_moe"), "{e}");
    let loaded = load::load(&fixture("mistral")).unwrap();
    let e =
        Decoder::new_shard(&loaded.cfg, loaded.weights, Device::Cpu, Kind::Float, Shard::new(0, 2, 2).unwrap(), None)
            .err()
            .unwrap();
    assert!(e.starts_with("field `expert_parallel` = 2: `mistral` has no routed experts"), "{e}");
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
