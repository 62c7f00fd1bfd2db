use super::*;
use crate::bench::train::{bench_estimate, BenchConfig};
use std::path::Path;

/// The estimate of a bench config, on the CPU in `dtype`: each part by name.
fn bench(name: &str, dtype: &str) -> (Estimate, std::collections::BTreeMap<String, u64>) {
    let registry = Registry::new(&[]).unwrap();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/bench");
    let cfg: BenchConfig = toml::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap();
    let ctx = crate::plugins::host_context("cpu", dtype, 0, &dir, Path::new("/nonexistent"));
    let e = bench_estimate(&registry, &cfg, &ctx).unwrap().unwrap();
    let parts = e.parts.iter().map(|p| (p.name.clone(), p.bytes)).collect();
    (e, parts)
}

/// configs/bench/tiny.toml by hand, in f32: a qwen3 target of 4 layers (hidden 64, MLP 128,
/// 4 / 2 heads of 16, vocabulary 100, untied), 2 x 64 tokens, a 2-layer drafter of block 4 on
/// target layers [0, 2], 8 anchors a sequence, AdamW.
#[test]
fn the_tiny_bench_estimate_is_its_parts_counted_by_hand() {
    let (e, parts) = bench("tiny.toml", "f32");
    let target_layer = 64 * (64 + 2 * 32 + 64) + 3 * 64 * 128;
    let target = 4 * target_layer + 2 * 100 * 64;
    assert_eq!(target, 160_256);
    assert_eq!(parts["target weights"], target * 4);
    // One layer's input, normed copy and residual (3 x 64) and its MLP's 3 x 128, 128 tokens:
    // more than the head's last hidden states, their normed copy and the logits (2 x 64 + 100).
    assert_eq!(parts["target forward (working set)"], 128 * (3 * 64 + 3 * 128) * 4);
    let drafter_layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64;
    let drafter = 64 * 128 + 2 * 64 + 2 * drafter_layer;
    assert_eq!(drafter, 82_368);
    assert_eq!((parts["drafter weights"], parts["drafter gradients"]), (drafter * 4, drafter * 4));
    // The features of 2 layers, 128 tokens of 64; the context made of them (fc, hidden_norm)
    // and each layer's context keys before and after norm and RoPE, and values (3 x 2 x 16).
    assert_eq!(parts["target features"], 128 * 2 * 64 * 4);
    assert_eq!(parts["drafter context"], 128 * 2 * 64 * 4 + 2 * 128 * 3 * 32 * 4);
    // 2 x 8 anchors x 4 block tokens: each layer's 4 x 64 + 3 x 64 + 3 x 32 + 2 x 128 values and
    // 4 heads' f32 log-sum-exp; once the last output and its norm (2 x 64) and the last layer's
    // backward (3 x 128 + 2 x 64), more than the loss's 100 logits and 4 x 64 a token.
    let layer = 4 * 64 + 3 * 64 + 3 * 32 + 2 * 128 + 4;
    assert_eq!(parts["drafter activations (blocks)"], 64 * (2 * layer + 2 * 64 + 3 * 128 + 2 * 64) * 4);
    assert_eq!(parts["AdamW moments (fp32)"], drafter * 8);
    assert!(!parts.contains_key("fp32 master weights"), "f32 parameters need no master copy");
    assert_eq!(parts["CUDA context and workspaces"], CUDA_OVERHEAD);
    // The step's activations (more than its gradients) beside what is always held.
    let activations = ["target features", "drafter context", "drafter activations (blocks)"];
    let step: u64 = activations.iter().map(|p| parts[*p]).sum();
    assert!(step > parts["drafter gradients"]);
    assert_eq!(e.total(), parts.values().sum::<u64>() - parts["drafter gradients"]);
    assert_eq!(e.step_peak(), step);
    assert_eq!(e.shape, Shape { batch: 2, seq_len: 64, anchors_per_seq: 8 });
}

/// configs/bench/qwen3-8b.toml in bf16: Qwen3-8B (8.19B parameters) and its published 5-layer
/// drafter (1.05B trained: fc 4096 x 5 x 4096 and five Qwen3 layers), 4 x 3072 tokens, 512
/// anchors of 16, AdamW with fp32 moments and masters.
#[test]
fn the_qwen3_8b_bench_estimate_is_its_parts_counted_by_hand() {
    let (e, parts) = bench("qwen3-8b.toml", "bf16");
    let target: u64 = 36 * (4096 * (4096 + 2048 + 4096) + 3 * 4096 * 12288) + 2 * 151_936 * 4096;
    assert_eq!(target / 10_000_000, 819, "Qwen3-8B's 8.19B parameters");
    assert_eq!(parts["target weights"], 2 * target);
    let tokens = 4 * 3072;
    // The head's last hidden states, their normed copy and the logits.
    assert_eq!(parts["target forward (working set)"], tokens * (2 * 4096 + 151_936) * 2);
    let layer = 4096 * 4096 + 2 * 1024 * 4096 + 4096 * 4096 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096;
    let drafter: u64 = 4096 * 5 * 4096 + 2 * 4096 + 5 * layer;
    assert_eq!(drafter, 1_048_626_432, "the drafter's 1.05B parameters");
    assert_eq!(parts["drafter weights"], 2 * drafter);
    assert_eq!(parts["target features"], tokens * 5 * 4096 * 2);
    assert_eq!(parts["drafter context"], tokens * 2 * 4096 * 2 + 5 * tokens * 3 * 1024 * 2);
    let block_tokens = 4 * 512 * 16;
    // Each layer's kept values (bf16, and 32 heads' f32 log-sum-exp); once: the last output,
    // its norm and the last layer's backward (3 x 12288 + 2 x 4096), more than the loss's 1,536
    // rows of 151,936 logits and 4 x 4096 a block token.
    let kept = 4 * 4096 + 3 * 4096 + 3 * 1024 + 2 * 12288 + 2 * 32;
    let once = 2 * 4096 + 3 * 12288 + 2 * 4096;
    assert!(once * block_tokens > 1536 * 151_936 + 4 * 4096 * block_tokens);
    assert_eq!(parts["drafter activations (blocks)"], block_tokens * (5 * kept + once) * 2);
    assert_eq!(parts["AdamW moments (fp32)"], 8 * drafter);
    assert_eq!(parts["fp32 master weights"], 4 * drafter);
    assert_eq!(parts["fp32 gradients in the step"], 4 * drafter);
    // With checkpoint_layers: one layer's blocks and context, and every layer's input.
    let checkpointed = tokens * 7 * 4096 * 2 + tokens * 3 * 1024 * 2 + block_tokens * (kept + 5 * 4096 + once) * 2;
    assert_eq!(e.checkpointed, Some(checkpointed));
    // FP8: the target's layers at a byte a weight and a scale a block, its embedding and head
    // in bf16 (the plugin's own count: target_hf's memory.rs).
    let layers = 36 * (4096 * (4096 + 2048 + 4096) + 3 * 4096 * 12288);
    let fp8 = e.fp8_target_weights.expect("the hf target counts its FP8 weights");
    assert_eq!(fp8 - (layers + 2 * 151_936 * 4096 * 2), 36 * 4 * (48 * 32 + 32 * 32 + 2 * 96 * 32 + 32 * 96));
}

/// The Qwen3.6-27B hybrid's text model: 24.35B in its 64 layers (48 Gated DeltaNet, 16 gated
/// attention) + 2 x 1.27B embedding and head = 26.9B (the config's own note).
#[test]
fn the_qwen3_6_27b_target_has_its_published_parameter_count() {
    let (_, parts) = bench("qwen3.6-27b.toml", "bf16");
    let params = parts["target weights"] as f64 / 2.0;
    assert!((params / 1e9 - 26.9).abs() < 0.05, "{params}");
}

fn part(name: &str, gib: f64, scale: MemoryScale, drafter: bool) -> Part {
    Part { name: name.into(), bytes: (gib * (1u64 << 30) as f64) as u64, scale, drafter }
}

/// A 27B-shaped run at batch 4 x 3072 and 512 anchors on 80 GiB: what fits, part by part.
#[test]
fn the_refusal_names_the_largest_parts_and_what_would_fit() {
    let e = Estimate {
        parts: vec![
            part("target weights", 50.0, MemoryScale::TargetWeights, false),
            part("target forward (working set)", 4.0, MemoryScale::Batch, false),
            part("drafter weights", 2.0, MemoryScale::Fixed, true),
            part("AdamW moments (fp32)", 8.0, MemoryScale::Fixed, false),
            part("target features and drafter context", 4.0, MemoryScale::Batch, true),
            part("drafter activations (blocks)", 32.0, MemoryScale::BatchAnchors, true),
        ],
        shape: Shape { batch: 4, seq_len: 3072, anchors_per_seq: 512 },
        tensor_parallel: 1,
        checkpointed: Some((12u64 << 30) / 2),
        grad_accum: 1,
        fp8_target_weights: Some(25u64 << 30),
        unknown: vec![],
    };
    let device = 80u64 << 30;
    assert_eq!(gib(e.total()), 100.0);
    // 60 GiB fixed, 10 GiB a sequence: 2 sequences; 100 - 32 = 68 GiB without the blocks, at
    // 1/16 GiB an anchor: 192 anchors.
    assert_eq!(e.largest_batch(device), Some(2));
    assert_eq!(e.largest_anchors(device), Some(192));
    assert_eq!(e.with_checkpointing().map(gib), Some(70.0));
    assert_eq!(gib(e.with_tensor_parallel(2)), 75.0);
    assert_eq!(e.with_fp8_target().map(gib), Some(75.0));
    let text = e.refusal("cuda:0", device);
    let want = "not enough device memory: this config needs about 100.0 GiB on cuda:0, which has 80.0 GiB \
        (batch 4 x 3072 tokens, 512 anchors a sequence): target weights 50.0 GiB, drafter activations (blocks) \
        32.0 GiB, AdamW moments (fp32) 8.0 GiB, target forward (working set) 4.0 GiB, 6.0 GiB in 2 smaller parts. \
        What would fit: a micro-batch of 2 sequences (now 4); or 192 anchors a sequence (`anchors_per_seq`, now \
        512); or `checkpoint_layers = true` in [drafter] (70.0 GiB); or `tensor_parallel = 2` in [target] over 2 \
        GPUs (75.0 GiB on the first); or an FP8 target, `compute = \"fp8\"` in [target] on Hopper (75.0 GiB). To \
        run it anyway: \
        --no-memory-check.";
    assert_eq!(text, want);
    assert!(!text.contains('\n'), "one paragraph");
    // Where nothing alone fits, it says so.
    let tight = e.refusal("cuda:0", 50u64 << 30);
    assert!(tight.contains("Nothing of the batch, anchors"), "{tight}");
}

#[test]
fn device_sizes_read_as_bytes_or_gib() {
    assert_eq!(parse_bytes("25769803776"), Some(24 << 30));
    assert_eq!(parse_bytes("24GiB"), Some(24 << 30));
    assert_eq!(parse_bytes("0.5 GiB"), Some(1 << 29));
    assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
    assert_eq!((parse_bytes("24 parsecs"), parse_bytes("-1"), parse_bytes("")), (None, None, None));
}

/// libtorch's out-of-memory error, as a plugin's panic carries it (frames and all), through the
/// boundary: one paragraph, libtorch's first sentences and the advice, no allocator notes.
#[test]
fn a_libtorch_oom_is_one_paragraph_with_the_advice() {
    let libtorch = "called `Result::unwrap()` on an `Err` value: Torch(\"CUDA out of memory. Tried to allocate \
        2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Including non-PyTorch memory, \
        this process has 78.13 GiB memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and \
        1.40 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\\nframe #0: c10::Error::Error(\
        c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\\nframe #1: ...\")";
    let err = plugin_api::catch_plugin_panic::<()>(|| panic!("{libtorch}")).unwrap_err();
    assert!(is_oom(&err.message));
    let text = oom_paragraph("drafter plugin `dflash`: forward", &err.message);
    assert!(
        text.starts_with(
            "out of device memory in drafter plugin `dflash`: forward: CUDA out of memory. Tried to allocate 2.00 \
             GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is free. Including non-PyTorch memory, \
             this process has 78.13 GiB memory in use. "
        ),
        "{text}"
    );
    for advice in ["`anchors_per_seq`", "`checkpoint_layers = true`", "`tensor_parallel = N`", "FP8 target"] {
        assert!(text.contains(advice), "{advice} not in {text}");
    }
    for noise in ["frame #", "PYTORCH_CUDA_ALLOC_CONF", "\n"] {
        assert!(!text.contains(noise), "{noise:?} in {text}");
    }
    assert!(is_oom_error(&anyhow::anyhow!("{text}").context("step 3")));
    // A panic of the host's own tch calls, caught where the step runs.
    let host = catch_host_panic::<()>("the drafter's step", || panic!("{libtorch}")).unwrap_err();
    assert!(format!("{host:#}").starts_with("out of device memory in the drafter's step: CUDA out of memory."));
}
