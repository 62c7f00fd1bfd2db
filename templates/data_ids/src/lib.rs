//! A data loader for pre-tokenized conversations: the template for data loader plugins.
//!
//! Each line of the file is one sequence, `PROMPT_IDS | RESPONSE_IDS` (token ids of the target's
//! tokenizer, space-separated; the prompt already in the chat template, the response ending
//! with its end-of-turn token). The loss mask covers the response. Batches are right-padded,
//! shuffled per epoch from the seed and the epoch number, and resumable by position.

use plugin_api::{
    describe::{InputFile, SectionCheck},
    serde::Deserialize,
    tch::Tensor,
    DataLoaderPlugin, DataPosition, DataSummary, Describe, HostContext, PluginError, PluginInfo, PluginInstance,
    PluginKind, Section, TrainBatch,
};

/// The `[data]` section (besides `plugin = "ids"`).
#[derive(Debug, Clone, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
pub struct IdsConfig {
    /// The token-id file, relative to the config's folder.
    pub path: String,
    /// Sequences per batch.
    #[serde(default = "default_batch_size")]
    #[describe(range = ">= 1")]
    pub batch_size: usize,
}

/// Checked before anything heavy loads: the fields, and the file is there (the host hashes it
/// into the run's manifest).
impl Section for IdsConfig {
    fn check(&self, ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        if self.batch_size == 0 {
            return Err(PluginError::new("field `batch_size`: must be >= 1"));
        }
        let file = InputFile::existing("path", &self.path, ctx)?;
        Ok(SectionCheck { inputs: vec![file].into(), ..SectionCheck::default() })
    }
}

fn default_batch_size() -> usize {
    2
}

/// One sequence: token ids and the loss mask (1 on the response).
struct Sequence {
    ids: Vec<i64>,
    mask: Vec<i64>,
}

pub struct IdsData {
    cfg: IdsConfig,
    file: std::path::PathBuf,
    seed: u64,
    pad_id: i64,
    sequences: Vec<Sequence>,
    order: Vec<usize>,
    pos: DataPosition,
}

/// `PROMPT | RESPONSE` -> a sequence; `line` (1-based) for errors.
fn parse_line(text: &str, line: usize) -> Result<Sequence, PluginError> {
    let (prompt, response) = text
        .split_once('|')
        .ok_or_else(|| PluginError::new(format!("line {line}: expected `PROMPT_IDS | RESPONSE_IDS`")))?;
    let ids = |s: &str| -> Result<Vec<i64>, PluginError> {
        s.split_whitespace()
            .map(|t| t.parse::<i64>().map_err(|e| PluginError::new(format!("line {line}: `{t}`: {e}"))))
            .collect()
    };
    let (p, r) = (ids(prompt)?, ids(response)?);
    if p.is_empty() || r.is_empty() {
        return Err(PluginError::new(format!("line {line}: an empty prompt or response")));
    }
    let mask = std::iter::repeat(0).take(p.len()).chain(std::iter::repeat(1).take(r.len())).collect();
    Ok(Sequence { ids: [p, r].concat(), mask })
}

/// A permutation of 0..n from a seed (xorshift64*, Fisher-Yates): the same on every machine.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    order
}

impl IdsData {
    fn shuffle_epoch(&mut self) {
        self.order = shuffled(self.sequences.len(), self.seed ^ self.pos.epoch);
    }
}

impl DataLoaderPlugin for IdsData {
    fn open(&mut self, _tokenizer_json: &str) -> Result<DataSummary, PluginError> {
        let text = std::fs::read_to_string(&self.file)
            .map_err(|e| PluginError::new(format!("field `path`: {}: {e}", self.file.display())))?;
        self.sequences = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| parse_line(l, i + 1).map_err(|e| e.context(self.file.display())))
            .collect::<Result<_, _>>()?;
        if self.sequences.is_empty() {
            return Err(PluginError::new(format!("{}: no sequences", self.file.display())));
        }
        self.shuffle_epoch();
        let tokens = self.sequences.iter().map(|s| s.ids.len() as u64).sum();
        let loss_tokens = self.sequences.iter().map(|s| s.mask.iter().sum::<i64>() as u64).sum();
        Ok(DataSummary::new(self.sequences.len() as u64, tokens, loss_tokens, 0, format!("{}", self.file.display())))
    }

    fn next_batch(&mut self) -> Result<Option<TrainBatch>, PluginError> {
        let start = self.pos.index as usize;
        if start >= self.order.len() {
            self.pos = DataPosition { epoch: self.pos.epoch + 1, index: 0 };
            self.shuffle_epoch();
            return Ok(None);
        }
        let end = (start + self.cfg.batch_size).min(self.order.len());
        let picked: Vec<&Sequence> = self.order[start..end].iter().map(|&i| &self.sequences[i]).collect();
        let (b, s) = (picked.len(), picked.iter().map(|q| q.ids.len()).max().unwrap_or(1));
        let (mut ids, mut mask) = (vec![self.pad_id; b * s], vec![0i64; b * s]);
        for (r, q) in picked.iter().enumerate() {
            ids[r * s..r * s + q.ids.len()].copy_from_slice(&q.ids);
            mask[r * s..r * s + q.mask.len()].copy_from_slice(&q.mask);
        }
        let batch = TrainBatch {
            input_ids: Tensor::from_slice(&ids).view([b as i64, s as i64]),
            loss_mask: Tensor::from_slice(&mask).view([b as i64, s as i64]),
            lengths: picked.iter().map(|q| q.ids.len() as u32).collect(),
            sequence_ids: self.order[start..end].iter().map(|&i| i as u64).collect(),
        };
        self.pos.index = end as u64;
        Ok(Some(batch))
    }

    fn position(&self) -> DataPosition {
        self.pos
    }

    fn seek(&mut self, position: DataPosition) -> Result<(), PluginError> {
        if position.index as usize > self.sequences.len() {
            return Err(PluginError::new(format!(
                "position {} is past the epoch's {} sequences",
                position.index,
                self.sequences.len()
            )));
        }
        self.pos = position;
        self.shuffle_epoch();
        Ok(())
    }
}

/// The name a config gives in `plugin = "..."` (`plugins new` replaces it).
const PLUGIN_NAME: &str = "ids";

fn info() -> PluginInfo {
    PluginInfo::new(
        PLUGIN_NAME,
        PluginKind::DataLoader,
        env!("CARGO_PKG_VERSION"),
        "pre-tokenized `PROMPT | RESPONSE` lines (template plugin)",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: IdsConfig = plugin_api::parse_section(config)?;
    cfg.check(ctx)?;
    let spec = ctx.target.as_ref().into_option();
    let pad_id = spec.map_or(0, |s| s.pad_token_id.into_option().unwrap_or(s.eos_token_id)) as i64;
    let file = ctx.resolve_path(&cfg.path);
    Ok(PluginInstance::data_loader(IdsData {
        cfg,
        file,
        seed: ctx.seed,
        pad_id,
        sequences: Vec::new(),
        order: Vec::new(),
        pos: DataPosition::default(),
    }))
}

plugin_api::declare_plugin!(data_ids, info, create, section = IdsConfig);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_a_prompt_then_a_masked_response() {
        let s = parse_line("1 2 3 | 4 5", 1).unwrap();
        assert_eq!((s.ids, s.mask), (vec![1, 2, 3, 4, 5], vec![0, 0, 0, 1, 1]));
        assert!(parse_line("1 2 3", 7).unwrap_err().to_string().starts_with("line 7:"));
        let p = shuffled(10, 3);
        assert_ne!(p, (0..10).collect::<Vec<_>>());
        assert_eq!(p, shuffled(10, 3));
    }
}
