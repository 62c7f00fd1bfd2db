//! Decoding with the drafter's context kept between draft cycles (`decode_block`) gives what the
//! forward over the whole context gives, cycle after cycle, with full-attention layers and with
//! sliding-window ones whose window the growing context outruns, one shorter than a block.

mod common;

use drafter_dflash::{model::TrainMode, DFlashPlugin, DrafterSection};
use plugin_api::{
    abi_stable::std_types::ROption,
    author::Contained,
    tch::{self, Device, Kind, Tensor},
    DecodeInput, DraftInput, Drafter, TensorHandle,
};

fn drafter(extra: &str) -> Contained<DFlashPlugin> {
    let section: DrafterSection = plugin_api::parse_section(&format!(
        "num_hidden_layers = 3\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 0\n{extra}"
    ))
    .unwrap();
    tch::manual_seed(7);
    Contained::new(
        DFlashPlugin::new(&section.resolve(&common::tiny_target()).unwrap(), Device::Cpu, Kind::Float)
            .with_mode(TrainMode::default()),
    )
}

fn decode(
    d: &mut Contained<DFlashPlugin>,
    new_context: &Tensor,
    context_start: u32,
    block: &Tensor,
) -> Result<Tensor, String> {
    let input = DecodeInput {
        new_context: TensorHandle::new(new_context.shallow_clone()),
        context_start,
        block_embeds: TensorHandle::new(block.shallow_clone()),
    };
    match d.decode_block(&input).into_result() {
        Ok(ROption::RSome(h)) => Ok(h.tensor()),
        Ok(ROption::RNone) => Err("the dflash drafter keeps no context".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn kept_context_equals_the_whole_context_forward() {
    let _guard = tch::no_grad_guard();
    let sliding =
        "layer_types = [\"sliding_attention\", \"full_attention\", \"sliding_attention\"]\nsliding_window = 5";
    // A window shorter than the block (2 < 4) as well.
    let short = sliding.replace("sliding_window = 5", "sliding_window = 2");
    for extra in ["", sliding, short.as_str()] {
        let mut d = drafter(extra);
        tch::manual_seed(11);
        let context = Tensor::randn([1, 24, 32], (Kind::Float, Device::Cpu));
        // Cycles that accept 2, 0 and 5 drafts after a 7-token prompt, then a new sequence.
        let mut start = 0;
        for end in [7i64, 10, 11, 17, 5] {
            if end < start {
                start = 0;
            }
            let block = Tensor::randn([1, 4, 16], (Kind::Float, Device::Cpu));
            let got = decode(&mut d, &context.narrow(1, start, end - start), start as u32, &block).unwrap();
            let whole = DraftInput {
                target_hidden: TensorHandle::new(context.narrow(1, 0, end)),
                block_embeds: TensorHandle::new(block.shallow_clone()),
                anchors: TensorHandle::new(Tensor::from_slice(&[end]).view([1, 1])),
                anchor_valid: TensorHandle::new(Tensor::ones([1, 1], (Kind::Bool, Device::Cpu))),
            };
            let want = d.forward(&whole).unwrap().tensor();
            let err = (&got - &want).abs().max().double_value(&[]);
            assert!(err < 1e-5, "{extra:?}, anchor {end}: max diff {err}");
            start = end;
        }
    }
}

#[test]
fn a_context_that_does_not_follow_on_is_refused() {
    let _guard = tch::no_grad_guard();
    let mut d = drafter("");
    let block = Tensor::randn([1, 4, 16], (Kind::Float, Device::Cpu));
    let _ = decode(&mut d, &Tensor::randn([1, 6, 32], (Kind::Float, Device::Cpu)), 0, &block).unwrap();
    let err = decode(&mut d, &Tensor::randn([1, 2, 32], (Kind::Float, Device::Cpu)), 4, &block).unwrap_err();
    assert!(err.contains("context_start is 4") && err.contains("holds 6"), "{err}");
}
