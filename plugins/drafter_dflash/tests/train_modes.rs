//! The drafter's own backward (`attention = "split"`, `checkpoint_layers = true`, both): the
//! forward returns a leaf and the backward gives the gradients plain autograd gives through
//! masked SDPA, with full-attention layers and with sliding-window ones (one shorter than a block).

mod common;

use drafter_dflash::{model::TrainMode, DFlashPlugin, DrafterSection};
use kernels::block_attention::{query_ranges, KERNEL_TILE};
use plugin_api::{
    author::Contained,
    tch::{self, Device, Kind, Tensor},
    DraftInput, Drafter, TensorHandle,
};

/// Tests seed torch's one global generator: one at a time.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Layers 0 and 2 sliding (window 5: the context of the later blocks is cut), layer 1 full.
const SLIDING: &str =
    "layer_types = [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]\nsliding_window = 5";
/// A window shorter than the block (2 < 4): a block's queries past its second see no context.
const SHORT_WINDOW: &str =
    "layer_types = [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]\nsliding_window = 2";

fn drafter(mode: TrainMode) -> Contained<DFlashPlugin> {
    drafter_with(mode, "")
}

fn drafter_with(mode: TrainMode, extra: &str) -> Contained<DFlashPlugin> {
    let section: DrafterSection = plugin_api::parse_section(&format!(
        "num_hidden_layers = 3\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 0\n{extra}"
    ))
    .unwrap();
    tch::manual_seed(7);
    Contained::new(
        DFlashPlugin::new(&section.resolve(&common::tiny_target()).unwrap(), Device::Cpu, Kind::Float).with_mode(mode),
    )
}

fn input() -> DraftInput {
    tch::manual_seed(11);
    let opts = (Kind::Float, Device::Cpu);
    DraftInput {
        target_hidden: TensorHandle::new(Tensor::randn([2, 10, 32], opts)),
        block_embeds: TensorHandle::new(Tensor::randn([2, 3 * 4, 16], opts)),
        anchors: TensorHandle::new(Tensor::from_slice(&[1i64, 4, 7, 0, 2, 5]).view([2, 3])),
        anchor_valid: TensorHandle::new(Tensor::from_slice(&[true, true, true, true, true, false]).view([2, 3])),
    }
}

/// Parameter gradients of `sum(out * w)` (w fixed), as the host runs a step.
fn grads(d: &mut Contained<DFlashPlugin>) -> Vec<(String, Tensor)> {
    let out = d.forward(&input()).unwrap().tensor();
    let w = Tensor::randn(out.size(), (Kind::Float, Device::Cpu));
    (&out * &w).sum(Kind::Float).backward();
    if out.is_leaf() && out.requires_grad() {
        d.backward(&TensorHandle::new(out.grad())).unwrap();
    }
    d.parameters().unwrap().into_iter().map(|p| (p.name.to_string(), p.tensor.tensor().grad().copy())).collect()
}

#[test]
fn own_backwards_give_autograds_gradients() {
    let _one = SEEDED.lock().unwrap();
    for extra in ["", SLIDING, SHORT_WINDOW] {
        let plain = grads(&mut drafter_with(TrainMode::default(), extra));
        assert!(plain.iter().any(|(n, _)| n.starts_with("layers.2.")) && plain.iter().any(|(n, _)| n == "fc.weight"));
        for (split_attention, checkpoint_layers) in [(false, true), (true, false), (true, true)] {
            let own = grads(&mut drafter_with(TrainMode { split_attention, checkpoint_layers }, extra));
            assert_eq!(plain.len(), own.len());
            for ((name, a), (_, b)) in plain.iter().zip(&own) {
                let what = format!("{name} (split {split_attention}, checkpoint {checkpoint_layers}, {extra:?})");
                assert!(a.defined() && b.defined(), "{what}: no gradient");
                let scale = a.abs().max().double_value(&[]);
                assert!(scale > 0.0, "{what}: zero gradient");
                let err = (a - b).abs().max().double_value(&[]);
                assert!(err <= 1e-5 * scale, "{what}: max diff {err} vs max grad {scale}");
            }
        }
    }
    // The window changes the model: the sliding drafter's gradients are not the full one's.
    let (full, sliding) =
        (grads(&mut drafter(TrainMode::default())), grads(&mut drafter_with(TrainMode::default(), SLIDING)));
    let moved = full
        .iter()
        .zip(&sliding)
        .any(|((_, a), (_, b))| (a - b).abs().max().double_value(&[]) > 1e-3 * a.abs().max().double_value(&[]));
    assert!(moved, "a window of 5 over 10 positions changed nothing");
}

#[test]
fn drafting_without_grad_is_the_plain_forward() {
    let _one = SEEDED.lock().unwrap();
    let mode = TrainMode { split_attention: true, checkpoint_layers: true };
    let (mut plain, mut checkpointed) = (drafter(TrainMode::default()), drafter(mode));
    let a = tch::no_grad(|| plain.forward(&input()).unwrap().tensor());
    let b = tch::no_grad(|| checkpointed.forward(&input()).unwrap().tensor());
    assert!(!b.requires_grad());
    assert!(a.allclose(&b, 1e-6, 1e-6, false));
    let err = checkpointed.backward(&TensorHandle::new(a)).into_result().unwrap_err();
    assert!(err.to_string().contains("without a training forward"), "{err}");
}

/// With the anchors on the host, split attention runs the context in runs of blocks, each against
/// only the keys it sees (with a sliding window, from past key 0 too; without one, the keys all
/// its queries see without the bias), and still gives autograd's
/// gradients through masked SDPA.
#[test]
fn split_attention_in_runs_of_blocks_gives_autograds_gradients() {
    let _one = SEEDED.lock().unwrap();
    // 64 blocks of 4 a row over 600 positions: two runs of 32 blocks (128 queries, the tile).
    let (s, a) = (600i64, 64i64);
    let rows: Vec<Vec<i64>> = vec![(0..a).map(|j| j * 9).collect(), (0..a).map(|j| j * 9 + 7).collect()];
    let ranges = query_ranges(&[&rows[0], &rows[1]], s, 4, drafter_dflash::model::CONTEXT_RANGES, KERNEL_TILE, None);
    assert_eq!(ranges.len(), 2);
    assert!(ranges[0].keys < s, "{ranges:?}");
    // The second run's keys before 256 (its smallest anchor 288, rounded down) run unbiased.
    assert_eq!((ranges[1].prefix, ranges[1].keys), (256, s), "{ranges:?}");
    // Window 24: the second run starts at key 256 (its smallest anchor 288, less 23, rounded down
    // to the tile).
    let windowed =
        query_ranges(&[&rows[0], &rows[1]], s, 4, drafter_dflash::model::CONTEXT_RANGES, KERNEL_TILE, Some(24));
    assert_eq!(windowed[1].first_key, 256, "{windowed:?}");
    let window =
        "layer_types = [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]\nsliding_window = 24";
    let anchors = Tensor::from_slice(&rows.concat()).view([2, a]);
    let input = || {
        tch::manual_seed(13);
        let opts = (Kind::Float, Device::Cpu);
        DraftInput {
            target_hidden: TensorHandle::new(Tensor::randn([2, s, 32], opts)),
            block_embeds: TensorHandle::new(Tensor::randn([2, a * 4, 16], opts)),
            anchors: TensorHandle::new(anchors.shallow_clone()),
            anchor_valid: TensorHandle::new(Tensor::ones([2, a], (Kind::Bool, Device::Cpu))),
        }
    };
    let grads = |d: &mut Contained<DFlashPlugin>, host: bool| {
        if host {
            d.anchors_on_host(&TensorHandle::new(anchors.copy())).unwrap();
        }
        let out = d.forward(&input()).unwrap().tensor();
        let w = Tensor::randn(out.size(), (Kind::Float, Device::Cpu));
        (&out * &w).sum(Kind::Float).backward();
        if out.is_leaf() {
            d.backward(&TensorHandle::new(out.grad())).unwrap();
        }
        d.parameters()
            .unwrap()
            .into_iter()
            .map(|p| (p.name.to_string(), p.tensor.tensor().grad().copy()))
            .collect::<Vec<_>>()
    };
    for extra in ["", window] {
        let plain = grads(&mut drafter_with(TrainMode::default(), extra), false);
        let runs = grads(&mut drafter_with(TrainMode { split_attention: true, checkpoint_layers: false }, extra), true);
        for ((name, a), (_, b)) in plain.iter().zip(&runs) {
            let scale = a.abs().max().double_value(&[]);
            let err = (a - b).abs().max().double_value(&[]);
            assert!(scale > 0.0 && err <= 1e-5 * scale, "{name} ({extra:?}): max diff {err} vs max grad {scale}");
        }
    }
}
