//! Offline mode: `dflash-host capture` runs only the targets and writes their features as
//! safetensors shards with an index; `train` with `pipeline.capture = DIR` reads them memory-mapped
//! instead of running the target. The same micro-batches in the same order, so training from a
//! capture follows the online run's loss curve (exactly, when stored in the run's own dtype).
//!
//! `DIR/index.json` lists every micro-batch: its shard and the data position after it.
//! `DIR/shard-NNNNN.safetensors` holds, per micro-batch `b{i}`: `input_ids`, `loss_mask`,
//! `lengths`, `sequence_ids` (int64) and `hidden` [B, S, n*H] in `f32`, `bf16`, or `fp8_e4m3`
//! (raw bytes as uint8, with `hidden_scale` [B, S, 1] f32: per-row absmax / 448).

use super::{
    components::Components,
    distill,
    hidden_cache::HiddenStateCache,
    scheduler::{self, Job, PipelineOptions, Worker},
    stages::{feature_bytes_per_token, next_batch, target_workers, HostBatch, Micro},
};
use crate::outputs::OutDir;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;
use plugin_api::{
    tch::{Device, Kind, Tensor},
    DataPosition, TargetSpec,
};
use serde::{Deserialize, Serialize};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

/// How features are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum StoredDtype {
    F32,
    Bf16,
    Fp8E4m3,
}

/// The largest finite float8 e4m3fn value.
const FP8_E4M3_MAX: f64 = 448.0;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaptureIndex {
    pub version: u32,
    pub target_source: String,
    pub target_sha256: String,
    pub layer_ids: Vec<u32>,
    pub hidden_size: u32,
    pub dtype: StoredDtype,
    pub batches: Vec<BatchEntry>,
    pub shards: Vec<String>,
    /// CRC-32C of each shard file (hex), checked when the capture is opened: a shard changed or
    /// cut short is refused, not read as features. Absent in captures written before.
    #[serde(default)]
    pub shard_crc32c: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchEntry {
    pub shard: usize,
    pub epoch: u64,
    pub index: u64,
}

pub struct CaptureOptions {
    pub dtype: StoredDtype,
    /// Micro-batches to capture (default: the config's steps x grad_accum).
    pub micro_batches: u64,
    pub shard_bytes: usize,
}

/// Run the targets over the data and write the capture.
pub fn capture(
    cfg: &crate::config::RunConfig,
    mut c: Components,
    out: &OutDir,
    cache_dir: &Path,
    opts: &CaptureOptions,
) -> Result<CaptureIndex> {
    if out.path.join("index.json").exists() {
        bail!("{}: a capture is already there", out.path.display());
    }
    let _ = distill::prepare_data(&mut c, cache_dir)?;
    let spec = c.target.spec()?;
    let layer_ids: Vec<u32> = c.drafter.target_layer_ids()?;
    let devices = cfg.target_devices();
    let per_token = feature_bytes_per_token(cfg, layer_ids.len(), spec.hidden_size);
    let (data, target, extra) = (&mut c.data, &mut c.target, &mut c.extra_targets);
    let mut produced = 0;
    let cache = HiddenStateCache::new(cfg.train.hidden_cache_mb << 20, per_token);
    let cache_p = Arc::clone(&cache);
    let producer = move || -> Result<Option<Job<HostBatch>>> {
        if produced == opts.micro_batches {
            return Ok(None);
        }
        let mut b = next_batch(data)?;
        b.index = produced;
        b.cache_ticket = Some(cache_p.plan(&b.sequence_ids, &b.lengths));
        produced += 1;
        Ok(Some(Job { bytes: b.input_ids.numel() * per_token, payload: b }))
    };
    let workers = target_workers(target, extra, &devices, &layer_ids, &cache, Device::Cpu);
    let pipe = PipelineOptions { buffer_bytes: cfg.pipeline.buffer_bytes(), deterministic: true };
    let bar = ProgressBar::new(opts.micro_batches).with_style(
        ProgressStyle::with_template("capture {bar:30} {pos}/{len} batches  {msg}  ETA {eta}").expect("template"),
    );
    let mut index = CaptureIndex {
        version: 1,
        target_source: spec.source.to_string(),
        target_sha256: spec.source_sha256.to_string(),
        layer_ids: layer_ids.clone(),
        hidden_size: spec.hidden_size,
        dtype: opts.dtype,
        batches: Vec::new(),
        shards: Vec::new(),
        shard_crc32c: Vec::new(),
    };
    scheduler::run(&pipe, producer, workers, |feed| {
        let mut shard: Vec<(String, Tensor)> = Vec::new();
        let mut shard_bytes = 0;
        while let Some(ready) = feed.next()? {
            let m = &ready.item;
            let i = index.batches.len();
            let tensors = stored_tensors(i, m, opts.dtype);
            shard_bytes += tensors.iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum::<usize>();
            shard.extend(tensors);
            index.batches.push(BatchEntry {
                shard: index.shards.len(),
                epoch: m.position.epoch,
                index: m.position.index,
            });
            if shard_bytes >= opts.shard_bytes {
                write_shard(out, &mut index, &mut shard)?;
                shard_bytes = 0;
            }
            bar.inc(1);
            bar.set_message(format!("{} shards", index.shards.len()));
        }
        if !shard.is_empty() {
            write_shard(out, &mut index, &mut shard)?;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    // The index last: a capture without one is unfinished and is refused by `train`.
    out.write("index.json", (serde_json::to_string_pretty(&index)? + "\n").as_bytes())?;
    Ok(index)
}

fn stored_tensors(i: usize, m: &Micro, dtype: StoredDtype) -> Vec<(String, Tensor)> {
    let ints = |v: &[i64]| Tensor::from_slice(v);
    let lengths: Vec<i64> = m.lengths.iter().map(|&l| l as i64).collect();
    let ids: Vec<i64> = m.sequence_ids.iter().map(|&l| l as i64).collect();
    let h = m.hidden.to_device(Device::Cpu);
    let mut out = vec![
        (format!("b{i}.input_ids"), m.input_ids.to_device(Device::Cpu).to_kind(Kind::Int64)),
        (format!("b{i}.loss_mask"), m.loss_mask.to_device(Device::Cpu).to_kind(Kind::Int64)),
        (format!("b{i}.lengths"), ints(&lengths)),
        (format!("b{i}.sequence_ids"), ints(&ids)),
    ];
    match dtype {
        StoredDtype::F32 => out.push((format!("b{i}.hidden"), h.to_kind(Kind::Float))),
        StoredDtype::Bf16 => out.push((format!("b{i}.hidden"), h.to_kind(Kind::BFloat16))),
        StoredDtype::Fp8E4m3 => {
            let (q, scale) = fp8_quantize(&h);
            out.push((format!("b{i}.hidden"), q));
            out.push((format!("b{i}.hidden_scale"), scale));
        }
    }
    out.into_iter().map(|(n, t)| (n, t.contiguous())).collect()
}

/// Per-row (last dim) absmax scaling into float8 e4m3fn, returned as raw bytes (uint8) and the
/// f32 scales [.., 1].
pub fn fp8_quantize(h: &Tensor) -> (Tensor, Tensor) {
    let h = h.to_kind(Kind::Float);
    let scale = h.abs().amax([-1i64].as_slice(), true).clamp_min(1e-12) / FP8_E4M3_MAX;
    let q = (&h / &scale).to_kind(Kind::Float8e4m3fn).view_dtype(Kind::Uint8);
    (q, scale)
}

pub fn fp8_dequantize(q: &Tensor, scale: &Tensor) -> Tensor {
    q.view_dtype(Kind::Float8e4m3fn).to_kind(Kind::Float) * scale
}

/// Write the shard's tensors as the next `shard-NNNNN.safetensors` in `out`, its checksum in the
/// index.
fn write_shard(out: &OutDir, index: &mut CaptureIndex, shard: &mut Vec<(String, Tensor)>) -> Result<()> {
    let name = format!("shard-{:05}.safetensors", index.shards.len());
    let views = shard.iter().map(|(n, t)| StoredTensor::new(t).map(|v| (n.as_str(), v))).collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None).with_context(|| format!("serialising {name}"))?;
    out.write(&name, &bytes)?;
    index.shard_crc32c.push(format!("{:08x}", crc32c::crc32c(&bytes)));
    index.shards.push(name);
    shard.clear();
    Ok(())
}

/// A contiguous CPU tensor as safetensors serialises it (tch writes safetensors only to a path).
struct StoredTensor<'a> {
    tensor: &'a Tensor,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
}

impl<'a> StoredTensor<'a> {
    fn new(tensor: &'a Tensor) -> Result<Self> {
        let dtype = match tensor.kind() {
            Kind::Float => safetensors::Dtype::F32,
            Kind::BFloat16 => safetensors::Dtype::BF16,
            Kind::Int64 => safetensors::Dtype::I64,
            Kind::Uint8 => safetensors::Dtype::U8,
            kind => bail!("a capture stores no {kind:?} tensor"),
        };
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(Self { tensor, dtype, shape })
    }
}

impl safetensors::View for StoredTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let mut bytes = vec![0; self.data_len()];
        self.tensor.copy_data_u8(&mut bytes, self.tensor.numel());
        bytes.into()
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}

/// A capture opened for training: shards memory-mapped, micro-batches read by number.
pub struct CaptureReader {
    dir: PathBuf,
    index: CaptureIndex,
    shards: Vec<Shard>,
}

/// A mapped shard and its safetensors header, parsed once.
struct Shard {
    map: Mmap,
    /// Where tensor data starts (after the length and the JSON header).
    data_start: usize,
    metadata: safetensors::tensor::Metadata,
}

impl CaptureReader {
    pub fn open(dir: &Path, target: &TargetSpec) -> Result<Self> {
        let index_path = dir.join("index.json");
        let text = input_files::read_to_string_capped(&index_path, 1 << 30).with_context(|| {
            format!("{}: no capture index (an unfinished capture, or not a capture folder)", index_path.display())
        })?;
        let index: CaptureIndex =
            serde_json::from_str(&text).with_context(|| format!("{}: not a capture index", index_path.display()))?;
        if index.target_sha256 != target.source_sha256.as_str() {
            bail!(
                "{}: captured from target {} (SHA-256 {}), but the config's target is {} ({})",
                dir.display(),
                index.target_source,
                &index.target_sha256[..16.min(index.target_sha256.len())],
                target.source,
                &target.source_sha256[..16.min(target.source_sha256.len())]
            );
        }
        if index.batches.is_empty() {
            bail!("{}: the capture holds no batches", dir.display());
        }
        if index.shard_crc32c.is_empty() {
            tracing::warn!(
                "{}: the capture has no shard checksums (written by an older host); its shards are not verified",
                dir.display()
            );
        } else if index.shard_crc32c.len() != index.shards.len() {
            bail!(
                "{}: {} shard checksums for {} shards",
                index_path.display(),
                index.shard_crc32c.len(),
                index.shards.len()
            );
        }
        let shards = index
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let path = dir.join(s);
                let file = input_files::open_regular(&path)?;
                // SAFETY: capture shards are written once and never modified while mapped.
                let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
                if let Some(want) = index.shard_crc32c.get(i) {
                    let got = format!("{:08x}", crc32c::crc32c(&map));
                    if &got != want {
                        bail!(
                            "{}: checksum mismatch (CRC-32C {got}, recorded {want}): the shard is corrupt or cut short",
                            path.display()
                        );
                    }
                }
                let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&map)
                    .with_context(|| format!("{}: corrupt shard", path.display()))?;
                Ok(Shard { data_start: 8 + header_len, metadata, map })
            })
            .collect::<Result<_>>()?;
        tracing::info!(
            "capture {}: {} micro-batches in {} shards ({:?})",
            dir.display(),
            index.batches.len(),
            index.shards.len(),
            index.dtype
        );
        Ok(Self { dir: dir.to_path_buf(), index, shards })
    }

    pub fn check_layers(&self, layer_ids: &[u32]) -> Result<()> {
        if self.index.layer_ids != layer_ids {
            bail!(
                "{}: captured target layers {:?}, but the drafter reads {:?}",
                self.dir.display(),
                self.index.layer_ids,
                layer_ids
            );
        }
        Ok(())
    }

    fn tensor(&self, shard: usize, name: &str) -> Result<Tensor> {
        let (sh, file) = (&self.shards[shard], &self.index.shards[shard]);
        let info = sh.metadata.info(name).with_context(|| format!("{file}: no tensor `{name}`"))?;
        let kind = match info.dtype {
            safetensors::Dtype::F32 => Kind::Float,
            safetensors::Dtype::BF16 => Kind::BFloat16,
            safetensors::Dtype::I64 => Kind::Int64,
            safetensors::Dtype::U8 => Kind::Uint8,
            d => bail!("{file}: tensor `{name}` has unexpected dtype {d:?}"),
        };
        let (start, end) = info.data_offsets;
        let data = sh
            .map
            .get(sh.data_start + start..sh.data_start + end)
            .with_context(|| format!("{file}: tensor `{name}` runs past the end"))?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        Ok(Tensor::f_from_data_size(data, &shape, kind)?)
    }

    /// Micro-batch `n` (wrapping around when training asks for more than was captured).
    pub fn batch(&self, n: u64) -> Result<HostBatch> {
        let i = (n % self.index.batches.len() as u64) as usize;
        if n as usize == self.index.batches.len() {
            tracing::warn!(
                "capture {}: all {} micro-batches used; starting over",
                self.dir.display(),
                self.index.batches.len()
            );
        }
        let e = &self.index.batches[i];
        let ints = |name: &str| -> Result<Vec<i64>> {
            Ok(Vec::<i64>::try_from(self.tensor(e.shard, &format!("b{i}.{name}"))?)?)
        };
        Ok(HostBatch {
            input_ids: self.tensor(e.shard, &format!("b{i}.input_ids"))?,
            loss_mask: self.tensor(e.shard, &format!("b{i}.loss_mask"))?,
            lengths: ints("lengths")?.into_iter().map(|l| l as u32).collect(),
            sequence_ids: ints("sequence_ids")?.into_iter().map(|l| l as u64).collect(),
            position: DataPosition { epoch: e.epoch, index: e.index },
            index: n,
            cache_ticket: None,
        })
    }

    /// The worker that reads each batch's features.
    pub fn worker(&self, _drafter: Device) -> Worker<'_, HostBatch, Micro> {
        Worker {
            name: format!("capture {}", self.dir.display()),
            work: Box::new(move |b: HostBatch| {
                let i = (b.index % self.index.batches.len() as u64) as usize;
                let shard = self.index.batches[i].shard;
                let raw = self.tensor(shard, &format!("b{i}.hidden"))?;
                let hidden = match self.index.dtype {
                    StoredDtype::Fp8E4m3 => fp8_dequantize(&raw, &self.tensor(shard, &format!("b{i}.hidden_scale"))?),
                    _ => raw,
                };
                Ok(b.with_features(hidden))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_corrupt_shard_is_refused_naming_it() {
        use test_support::TinySpec;
        let dir = tempfile::tempdir().unwrap();
        let spec = TargetSpec { hidden_size: 4, source: "t".into(), source_sha256: "abc".into(), ..TargetSpec::tiny() };
        let mut index = CaptureIndex {
            version: 1,
            target_source: "t".into(),
            target_sha256: "abc".into(),
            layer_ids: vec![1],
            hidden_size: 4,
            dtype: StoredDtype::F32,
            batches: vec![BatchEntry { shard: 0, epoch: 0, index: 1 }],
            shards: Vec::new(),
            shard_crc32c: Vec::new(),
        };
        let mut shard =
            vec![("b0.hidden".to_string(), Tensor::ones([1, 2, 4], (Kind::Float, plugin_api::tch::Device::Cpu)))];
        let out = OutDir::create("--out", dir.path(), Vec::new()).unwrap();
        write_shard(&out, &mut index, &mut shard).unwrap();
        fs::write(dir.path().join("index.json"), serde_json::to_string(&index).unwrap()).unwrap();
        CaptureReader::open(dir.path(), &spec).unwrap();
        // One weight turned NaN: the file still parses, and was read as a non-finite step.
        let path = dir.path().join("shard-00000.safetensors");
        let mut bytes = fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
        fs::write(&path, bytes).unwrap();
        let err = format!("{:#}", CaptureReader::open(dir.path(), &spec).err().unwrap());
        assert!(err.contains("shard-00000.safetensors: checksum mismatch"), "{err}");
    }

    #[test]
    fn a_link_planted_in_the_capture_folder_is_replaced_never_written_through() {
        let root = tempfile::tempdir().unwrap();
        let (outside, dir) = (root.path().join("weights.safetensors"), root.path().join("capture"));
        fs::write(&outside, "not a shard").unwrap();
        fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("shard-00000.safetensors")).unwrap();
        let out = OutDir::create("--out", &dir, Vec::new()).unwrap();
        let mut index = CaptureIndex {
            version: 1,
            target_source: "t".into(),
            target_sha256: "abc".into(),
            layer_ids: vec![1],
            hidden_size: 2,
            dtype: StoredDtype::Bf16,
            batches: vec![BatchEntry { shard: 0, epoch: 0, index: 1 }],
            shards: Vec::new(),
            shard_crc32c: Vec::new(),
        };
        let hidden = Tensor::from_slice(&[1.5f32, -2.0]).to_kind(Kind::BFloat16);
        let mut shard = vec![
            ("b0.hidden".to_string(), hidden.shallow_clone()),
            ("b0.lengths".to_string(), Tensor::from_slice(&[2i64])),
        ];
        write_shard(&out, &mut index, &mut shard).unwrap();
        assert_eq!(fs::read_to_string(&outside).unwrap(), "not a shard");
        let path = dir.join("shard-00000.safetensors");
        assert!(fs::symlink_metadata(&path).unwrap().is_file(), "still a link");
        // The bytes are the safetensors tch reads back, and the index's checksum is theirs.
        let back = Tensor::read_safetensors(&path).unwrap();
        let got = |n: &str| back.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
        assert!(got("b0.hidden").equal(&hidden) && got("b0.lengths").equal(&Tensor::from_slice(&[2i64])));
        assert_eq!(index.shard_crc32c, [format!("{:08x}", crc32c::crc32c(&fs::read(&path).unwrap()))]);
        let names: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["shard-00000.safetensors"], "no temporary file left");
    }

    #[test]
    fn fp8_round_trip_keeps_rows_within_e4m3_precision() {
        plugin_api::tch::manual_seed(0);
        let h = Tensor::randn([2, 5, 64], (Kind::Float, Device::Cpu))
            * Tensor::from_slice(&[0.01f32, 100.0]).view([2, 1, 1]);
        let (q, s) = fp8_quantize(&h);
        assert_eq!(q.kind(), Kind::Uint8);
        let back = fp8_dequantize(&q, &s);
        // e4m3 has 3 mantissa bits: relative error per element <= 2^-4, plus the smallest
        // normals; per-row scaling keeps both the tiny and the large rows accurate.
        let rel = ((&back - &h).norm() / h.norm()).double_value(&[]);
        assert!(rel < 0.04, "relative error {rel}");
        let small = (back.get(0) - h.get(0)).abs().max().double_value(&[]);
        assert!(small < 0.01 * 0.2, "small rows lose their values without per-row scales: {small}");
    }
}
