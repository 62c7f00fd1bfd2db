//! On a GPU, the drafter's own backward in bf16 (split attention, with its CUDA kernels: the block
//! part, q/k norm + RoPE, SwiGLU, the residual add + RMSNorm) against autograd's in fp32 on the
//! same weights and inputs: its error is of the size autograd's own bf16 backward has. Ignored by
//! `make test`; `make gpu-test` runs it, and there a missing GPU fails it.

use drafter_dflash::{model::TrainMode, DFlashPlugin, DrafterSection};
use plugin_api::{
    tch::{self, Device, Kind, Tensor},
    DrafterInput, DrafterPlugin, TargetSpec,
};
use test_support::TinySpec;

/// Shapes the kernels take: head dim 64, blocks of 16, hidden 256; one sliding-window layer.
fn drafter(mode: TrainMode, device: Device, kind: Kind) -> DFlashPlugin {
    let target = TargetSpec {
        num_hidden_layers: 4,
        hidden_size: 256,
        vocab_size: 64,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        intermediate_size: 512,
        ..TargetSpec::tiny()
    };
    let section: DrafterSection = plugin_api::parse_section(
        "num_hidden_layers = 2\nblock_size = 16\nnum_target_features = 2\nmask_token_id = 0\n\
         layer_types = [\"sliding_attention\", \"full_attention\"]\nsliding_window = 40",
    )
    .unwrap();
    DFlashPlugin::new(&section.resolve(&target).unwrap(), device, kind).with_mode(mode)
}

/// Parameter gradients (fp32, on the CPU) of sum(out * w) for the drafter `d` on `device` in
/// `kind`, with the reference weights, inputs and w.
fn grads(mut d: DFlashPlugin, weights: &[(String, Tensor)], device: Device, kind: Kind) -> Vec<(String, Tensor)> {
    d.load_weights(weights.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()).unwrap();
    tch::manual_seed(11);
    let (b, s, a) = (2i64, 300i64, 8i64);
    let anchors =
        Tensor::from_slice(&(0..b * a).map(|i| (i % a) * 33 + 5 + (i / a) * 7).collect::<Vec<i64>>()).view([b, a]);
    let on = |t: Tensor| t.to_device(device).to_kind(kind);
    let input = DrafterInput {
        target_hidden: on(Tensor::randn([b, s, 2 * 256], (Kind::Float, Device::Cpu))),
        block_embeds: on(Tensor::randn([b, a * 16, 256], (Kind::Float, Device::Cpu))),
        anchors: anchors.to_device(device),
        anchor_valid: Tensor::ones([b, a], (Kind::Bool, device)),
    };
    let w = Tensor::randn([b, a * 16, 256], (Kind::Float, Device::Cpu)).to_device(device);
    d.anchors_on_host(&anchors).unwrap();
    let out = d.forward(&input).unwrap();
    (out.to_kind(Kind::Float) * w).sum(Kind::Float).backward();
    if out.is_leaf() {
        d.backward(&out.grad()).unwrap();
    }
    d.parameters().into_iter().map(|(n, t)| (n, t.grad().to_kind(Kind::Float).to_device(Device::Cpu))).collect()
}

#[test]
#[ignore = "needs a CUDA device: make gpu-test"]
fn own_backward_in_bf16_on_cuda_is_as_close_to_fp32_as_autograds() {
    let gpu = kernels::cuda_test_device();
    tch::manual_seed(7);
    let reference = drafter(TrainMode::default(), Device::Cpu, Kind::Float);
    let weights = reference.parameters();
    let fp32 = grads(reference, &weights, Device::Cpu, Kind::Float);
    let autograd = grads(drafter(TrainMode::default(), gpu, Kind::BFloat16), &weights, gpu, Kind::BFloat16);
    let own = grads(
        drafter(TrainMode { split_attention: true, checkpoint_layers: false }, gpu, Kind::BFloat16),
        &weights,
        gpu,
        Kind::BFloat16,
    );
    for (((name, want), (_, a)), (_, o)) in fp32.iter().zip(&autograd).zip(&own) {
        let scale = want.abs().max().double_value(&[]);
        let err = |g: &Tensor| (g - want).abs().max().double_value(&[]) / scale;
        let (e_autograd, e_own) = (err(a), err(o));
        eprintln!("{name}: relative max error, autograd bf16 {e_autograd:.2e}, own backward bf16 {e_own:.2e}");
        assert!(scale > 0.0, "{name}: zero gradient");
        assert!(
            e_own <= 2.0 * e_autograd + 1e-2,
            "{name}: own backward {e_own:.2e} against autograd's {e_autograd:.2e}"
        );
    }
}
