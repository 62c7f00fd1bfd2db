//! A data loader plugin ("faulty_data") of eight fixed sequences (a 3-token prompt, a 3-token
//! response), two a batch, that breaks on request: `mask_prompt = true` puts the prompt in the
//! loss mask (`plugins check`: not on responses only); `panic_in = "METHOD"` panics in that
//! method (`position`, `next_batch`, `distill_request`, ...); `phantom_input = true` makes its
//! section check name a file that is not there. Its section takes unknown fields (no
//! `deny_unknown_fields`), which `plugins check` names.

use plugin_api::{
    describe::{InputFile, SectionCheck},
    serde::Deserialize,
    tch::Tensor,
    DataLoaderPlugin, DataPosition, DataSummary, Describe, DistillRequest, HostContext, PluginError, PluginInfo,
    PluginInstance, PluginKind, Section, TrainBatch,
};

#[derive(Debug, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde")]
struct Config {
    /// Put the prompt in the loss mask.
    #[serde(default)]
    mask_prompt: bool,
    /// A method that panics.
    #[serde(default)]
    panic_in: String,
    /// The section check names a file that is not there.
    #[serde(default)]
    phantom_input: bool,
}

impl Section for Config {
    fn check(&self, _ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        let mut check = SectionCheck::default();
        if self.phantom_input {
            check.inputs.push(InputFile { field: "phantom_input".into(), path: "/nonexistent/phantom.ids".into() });
        }
        Ok(check)
    }
}

const SEQUENCES: i64 = 8;
const LEN: i64 = 6;

struct Faulty {
    cfg: Config,
    pos: DataPosition,
}

impl Faulty {
    fn maybe_panic(&self, method: &str) {
        if self.cfg.panic_in == method {
            panic!("deliberate panic in {method}");
        }
    }
}

impl DataLoaderPlugin for Faulty {
    fn open(&mut self, _tokenizer_json: &str) -> Result<DataSummary, PluginError> {
        self.maybe_panic("open");
        Ok(DataSummary::new(
            SEQUENCES as u64,
            (SEQUENCES * LEN) as u64,
            (SEQUENCES * 3) as u64,
            0,
            "eight fixed sequences",
        ))
    }

    fn distill_request(&self) -> DistillRequest {
        self.maybe_panic("distill_request");
        DistillRequest::default()
    }

    fn next_batch(&mut self) -> Result<Option<TrainBatch>, PluginError> {
        self.maybe_panic("next_batch");
        let i = self.pos.index as i64;
        if i >= SEQUENCES {
            self.pos = DataPosition { epoch: self.pos.epoch + 1, index: 0 };
            return Ok(None);
        }
        // Sequence s: 1, 100+s, 200+s | 300+s, 400+s, 2.
        let ids: Vec<i64> = (i..i + 2).flat_map(|s| [1, 100 + s, 200 + s, 300 + s, 400 + s, 2]).collect();
        let first = if self.cfg.mask_prompt { 1 } else { 0 };
        let mask: Vec<i64> = (0..2).flat_map(|_| [first, first, first, 1, 1, 1]).collect();
        self.pos.index += 2;
        Ok(Some(TrainBatch {
            input_ids: Tensor::from_slice(&ids).view([2, LEN]),
            loss_mask: Tensor::from_slice(&mask).view([2, LEN]),
            lengths: vec![LEN as u32; 2],
            sequence_ids: vec![i as u64, i as u64 + 1],
        }))
    }

    fn position(&self) -> DataPosition {
        self.maybe_panic("position");
        self.pos
    }

    fn seek(&mut self, position: DataPosition) -> Result<(), PluginError> {
        self.pos = position;
        Ok(())
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("faulty_data", PluginKind::DataLoader, "0.1.0", "test data loader that breaks on request")
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: Config = plugin_api::parse_section(config)?;
    Ok(PluginInstance::data_loader(Faulty { cfg, pos: DataPosition::default() }))
}

plugin_api::declare_plugin!(faulty_data, info, create, section = Config);
