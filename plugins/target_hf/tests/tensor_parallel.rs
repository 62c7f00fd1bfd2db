//! Tensor- and expert-parallel replicas on the CPU (c10d's Gloo, ranks on threads): the features
//! and logits of a replica of T ranks equal the whole model's on one rank within float rounding,
//! for a dense family (Mistral, the Llama layout), the hybrid (Qwen3.5: Gated DeltaNet and gated
//! attention) and two MoE families with the experts over E = 2 groups; each rank holds about
//! 1 / T of the split weights; a rank that is gone mid-forward is named.

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
    for (rank, (f, logits, held)) in out.iter().enumerate() {
        let what = format!("{arch}, rank {rank} of {size} (expert_parallel {ep})");
        for (name, got, want) in [("features", f, &want_f), ("logits", logits, &want_logits)] {
            assert_eq!(got.size(), want.size(), "{what}: {name}");
            let err = (got - want).abs().max().double_value(&[]);
            let scale = want.abs().max().double_value(&[]);
            assert!(err <= 2e-5 * scale.max(1.0), "{what}: {name} differ by {err:.2e} (scale {scale:.2})");
        }
        // Everything a rank holds is either replicated (read whole: embeddings, norms, routers) or
        // its part; the parts are about 1 / T of what the whole model holds beyond the replicated
        // weights (more only where T exceeds the key/value heads, which are then replicated).
        let WeightBytes { whole: replicated, part } = *held;
        let split = all - replicated;
        assert!(part * size >= split, "{what}: the ranks' parts ({part} B each) do not cover {split} B");
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
