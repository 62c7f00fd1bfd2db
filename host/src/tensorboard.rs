//! TensorBoard event files beside `metrics.jsonl`, so `tensorboard --logdir experiments/` shows a
//! run's scalars. Only what scalars need, written by hand (no protoc, no TensorFlow):
//!
//! - file: `events.out.tfevents.<unix seconds>.<host>`, a sequence of TFRecords;
//! - TFRecord: `u64 len` (LE), `u32 masked_crc32c(len bytes)`, `len` bytes, `u32 masked_crc32c(bytes)`;
//! - each record one `tensorflow.Event` protobuf: `wall_time` (1, double), `step` (2, int64), then
//!   `file_version` (3, string) in the first record, or `summary` (5) with
//!   `Summary.value` (1, repeated) = `{tag (1, string), simple_value (2, float)}`.

use serde_json::Value;
use std::{
    fs::File,
    io::{self, BufWriter, Write},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

/// TensorBoard reads event files whose first record declares this version.
const FILE_VERSION: &str = "brain.Event:2";
/// TFRecord's CRC mask: rotate right by 15 bits, add this constant (tensorflow/core/lib/hash/crc32c.h).
const CRC_MASK_DELTA: u32 = 0xa282_ead8;

pub struct EventWriter {
    pub path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Create `dir/events.out.tfevents.<time>.<host>` and write the file-version record.
    pub fn create(dir: &Path) -> io::Result<Self> {
        let now = unix_now();
        let path = dir.join(format!("events.out.tfevents.{:010}.{}", now as u64, hostname()));
        let file = BufWriter::new(File::create(&path)?);
        let mut w = Self { path, file };
        let mut event = Vec::new();
        put_f64(&mut event, 1, now);
        put_varint_field(&mut event, 2, 0);
        put_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        w.write_record(&event)?;
        w.flush()?;
        Ok(w)
    }

    /// One scalar at `step` (buffered: call `flush` to make it visible).
    pub fn add_scalar(&mut self, tag: &str, step: i64, value: f64) -> io::Result<()> {
        self.add_scalars(step, &[(tag.to_string(), value)])
    }

    /// Several scalars at one `step`, in a single event.
    pub fn add_scalars(&mut self, step: i64, values: &[(String, f64)]) -> io::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_f32(&mut value, 2, *v as f32);
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        put_f64(&mut event, 1, unix_now());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }

    fn write_record(&mut self, data: &[u8]) -> io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc32c(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc32c(data).to_le_bytes())
    }
}

/// Write every numeric field of one metrics record (a `StepMetrics` as JSON) as a scalar at its
/// `step`, in one event, and flush. Tags are grouped as TensorBoard shows sections (see
/// [`tag`]); arrays become `key/k` with k from 1 (`acc`: `train/acc/pos1`, the block position;
/// `val_acc`: `validation/acc/pos1`); nested objects `key/sub`. `step` itself is the x axis, not
/// a scalar.
pub fn log_metrics(writer: &mut EventWriter, record: &Value) -> io::Result<()> {
    let step = record
        .get("step")
        .and_then(Value::as_i64)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "metrics record has no integer `step`"))?;
    let mut values = Vec::new();
    if let Value::Object(map) = record {
        for (key, v) in map {
            if key == "acc" || key == "val_acc" {
                if let Value::Array(items) = v {
                    let group = if key == "acc" { "train" } else { "validation" };
                    for (i, item) in items.iter().enumerate() {
                        flatten(&format!("{group}/acc/pos{}", i + 1), item, &mut values);
                    }
                }
            } else if key != "step" {
                flatten(&tag(key), v, &mut values);
            }
        }
    }
    writer.add_scalars(step, &values)?;
    writer.flush()
}

/// A metric's TensorBoard tag: `train/` what the drafter learns (loss, tau_hat, lr, gradient
/// norm, counters), `validation/` the validation split's scores (`val_*`), `pipeline/` how the
/// stages move (rates, stage seconds, the hidden-state buffer), `system/` the machine (memory,
/// GPUs, time).
pub fn tag(key: &str) -> String {
    const PIPELINE: &[&str] = &[
        "tok_per_s",
        "draft_tok_per_s",
        "target_s",
        "drafter_s",
        "optim_s",
        "wait_s",
        "target_busy",
        "drafter_busy",
        "q_hs",
        "q_hs_now",
        "hs_bytes",
        "hs_peak_bytes",
        "hs_total_bytes",
    ];
    const SYSTEM: &[&str] = &["peak_rss_mb", "gpu_util", "gpu_power_w", "gpu_mem_mb", "eta_s", "elapsed_s"];
    if let Some(rest) = key.strip_prefix("val_") {
        return format!("validation/{rest}");
    }
    let group = if PIPELINE.contains(&key) {
        "pipeline"
    } else if SYSTEM.contains(&key) {
        "system"
    } else {
        "train"
    };
    format!("{group}/{key}")
}

fn flatten(tag: &str, v: &Value, out: &mut Vec<(String, f64)>) {
    match v {
        Value::Number(n) => out.extend(n.as_f64().map(|x| (tag.to_string(), x))),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten(&format!("{tag}/{}", i + 1), item, out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                flatten(&format!("{tag}/{k}"), item, out);
            }
        }
        _ => {}
    }
}

pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(CRC_MASK_DELTA)
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let clean: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')).collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

/// Temporary files of [`truncate_after`].
const TRUNCATING: &str = ".tb-truncating-";

/// Drop the events after `step` from every event file in `dir` (a resume from the checkpoint at
/// `step`: the run's later events are written again), and a record a crash cut short. Each file
/// is rewritten through a temporary file and renamed; files with nothing to drop are untouched.
pub fn truncate_after(dir: &Path, step: u64) -> anyhow::Result<()> {
    use anyhow::Context;
    let files = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for e in files.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(TRUNCATING) {
            let _ = std::fs::remove_file(e.path()); // a truncation a kill interrupted
        }
        if !name.starts_with("events.out.tfevents.") {
            continue;
        }
        let path = e.path();
        // Event files grow with the run (a few hundred bytes a step); cap what is read anyway.
        let bytes = input_files::read_capped(&path, 1 << 34)?;
        let mut kept = Vec::with_capacity(bytes.len());
        let mut pos = 0;
        while let Some((data, end)) = next_record(&bytes, pos) {
            if event_step(data).is_some_and(|s| s > step) {
                break; // events are in step order
            }
            kept.extend_from_slice(&bytes[pos..end]);
            pos = end;
        }
        if kept.len() < bytes.len() {
            // The temporary name has no "tfevents" in it: TensorBoard must never read it.
            let tmp = dir.join(format!("{TRUNCATING}{}", std::process::id()));
            crate::atomic_write::write_synced(&tmp, &kept)?;
            std::fs::rename(&tmp, &path)
                .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        }
    }
    Ok(())
}

/// The record at `pos` (its data and where the next begins), if it is whole and its CRCs hold.
fn next_record(bytes: &[u8], pos: usize) -> Option<(&[u8], usize)> {
    let len_bytes = bytes.get(pos..pos + 8)?;
    let len = usize::try_from(u64::from_le_bytes(len_bytes.try_into().ok()?)).ok()?;
    let len_crc = u32::from_le_bytes(bytes.get(pos + 8..pos + 12)?.try_into().ok()?);
    let end = pos.checked_add(16)?.checked_add(len)?;
    let data = bytes.get(pos + 12..pos + 12 + len)?;
    let data_crc = u32::from_le_bytes(bytes.get(end - 4..end)?.try_into().ok()?);
    (len_crc == masked_crc32c(len_bytes) && data_crc == masked_crc32c(data)).then_some((data, end))
}

/// An Event's `step` (field 2); None when absent or unreadable.
fn event_step(mut b: &[u8]) -> Option<u64> {
    fn varint(b: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first()?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Some(v);
            }
        }
        None
    }
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let skip = match key & 7 {
            0 => {
                let v = varint(&mut b)?;
                if key >> 3 == 2 {
                    return Some(v);
                }
                0
            }
            1 => 8,
            2 => usize::try_from(varint(&mut b)?).ok()?,
            5 => 4,
            _ => return None,
        };
        b = b.get(skip..)?;
    }
    None
}

// Protobuf wire format: key = (field << 3) | wire type; 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32.

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, (field as u64) << 3);
    put_varint(out, v);
}

fn put_f64(out: &mut Vec<u8>, field: u32, v: f64) {
    put_varint(out, ((field as u64) << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, field: u32, v: f32) {
    put_varint(out, ((field as u64) << 3) | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, ((field as u64) << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the test reader decodes from one Event.
    #[derive(Debug, Default)]
    struct Event {
        wall_time: f64,
        step: i64,
        file_version: Option<String>,
        values: Vec<(String, f32)>,
    }

    /// Split a file into TFRecords, checking both CRCs of each.
    fn read_records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < bytes.len() {
            let len_bytes = &bytes[pos..pos + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc32c(len_bytes), "length CRC of record {}", out.len());
            let data = &bytes[pos + 12..pos + 12 + len];
            let data_crc = u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
            assert_eq!(data_crc, masked_crc32c(data), "data CRC of record {}", out.len());
            out.push(data.to_vec());
            pos += 16 + len;
        }
        assert_eq!(pos, bytes.len(), "trailing bytes");
        out
    }

    fn varint(b: &[u8], pos: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[*pos];
            *pos += 1;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte < 0x80 {
                return v;
            }
            shift += 7;
        }
    }

    /// Walk protobuf fields: (field number, wire type, payload bytes or varint value).
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>, u64)> {
        let mut out = Vec::new();
        let mut pos = 0;
        while pos < b.len() {
            let key = varint(b, &mut pos);
            let (field, wire) = (key >> 3, key & 7);
            match wire {
                0 => {
                    let v = varint(b, &mut pos);
                    out.push((field, wire, vec![], v));
                }
                1 => {
                    out.push((field, wire, b[pos..pos + 8].to_vec(), 0));
                    pos += 8;
                }
                2 => {
                    let n = varint(b, &mut pos) as usize;
                    out.push((field, wire, b[pos..pos + n].to_vec(), 0));
                    pos += n;
                }
                5 => {
                    out.push((field, wire, b[pos..pos + 4].to_vec(), 0));
                    pos += 4;
                }
                w => panic!("unexpected wire type {w}"),
            }
        }
        out
    }

    fn parse_event(b: &[u8]) -> Event {
        let mut e = Event::default();
        for (field, wire, bytes, v) in fields(b) {
            match (field, wire) {
                (1, 1) => e.wall_time = f64::from_le_bytes(bytes.try_into().unwrap()),
                (2, 0) => e.step = v as i64,
                (3, 2) => e.file_version = Some(String::from_utf8(bytes).unwrap()),
                (5, 2) => {
                    for (f, w, value, _) in fields(&bytes) {
                        assert_eq!((f, w), (1, 2), "Summary.value");
                        let (mut tag, mut x) = (String::new(), f32::NAN);
                        for (f, w, b, _) in fields(&value) {
                            match (f, w) {
                                (1, 2) => tag = String::from_utf8(b).unwrap(),
                                (2, 5) => x = f32::from_le_bytes(b.try_into().unwrap()),
                                other => panic!("unexpected Summary.Value field {other:?}"),
                            }
                        }
                        e.values.push((tag, x));
                    }
                }
                other => panic!("unexpected Event field {other:?}"),
            }
        }
        e
    }

    fn read_events(path: &Path) -> Vec<Event> {
        read_records(&std::fs::read(path).unwrap()).iter().map(|r| parse_event(r)).collect()
    }

    #[test]
    fn a_resume_drops_the_events_after_its_checkpoint_and_a_cut_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        for step in 1..=6 {
            w.add_scalar("loss", step, step as f64).unwrap();
        }
        w.flush().unwrap();
        let path = w.path.clone();
        drop(w);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_within(40..60); // half a record, as a crash leaves it
        std::fs::write(&path, &bytes).unwrap();
        truncate_after(dir.path(), 4).unwrap();
        let steps: Vec<i64> = read_events(&path).iter().map(|e| e.step).collect();
        assert_eq!(steps, [0, 1, 2, 3, 4], "the file-version record, then steps through 4");
        let before = std::fs::read(&path).unwrap();
        truncate_after(dir.path(), 9).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // CRC-32C (Castagnoli) of "123456789" is 0xE3069283 (RFC 3720, B.4).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let crc = 0xe306_9283u32;
        assert_eq!(masked_crc32c(b"123456789"), crc.rotate_right(15).wrapping_add(CRC_MASK_DELTA));
    }

    #[test]
    fn varints_encode_like_protobuf() {
        let enc = |v| {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            b
        };
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(150), [0x96, 0x01]);
        assert_eq!(enc(u64::MAX).len(), 10);
        // A negative step is sent as its 64-bit two's complement, like protobuf's int64.
        let mut b = Vec::new();
        put_varint_field(&mut b, 2, -1i64 as u64);
        assert_eq!(fields(&b)[0].3 as i64, -1);
    }

    #[test]
    fn scalars_round_trip_with_valid_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let name = w.path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        for step in 0..5 {
            w.add_scalar("loss", step, 10.0 / (step + 1) as f64).unwrap();
        }
        w.add_scalar("a/long/tag name", 1_000_000_000_000, -0.25).unwrap();
        w.flush().unwrap();
        let events = read_events(&w.path);
        assert_eq!(events.len(), 7);
        assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
        assert!(events[0].wall_time > 1.5e9, "wall time {}", events[0].wall_time);
        for (i, e) in events[1..6].iter().enumerate() {
            assert_eq!(e.step, i as i64);
            assert_eq!(e.values, vec![("loss".to_string(), 10.0 / (i + 1) as f32)]);
            assert!(e.wall_time >= events[0].wall_time);
        }
        assert_eq!(events[6].step, 1_000_000_000_000);
        assert_eq!(events[6].values, vec![("a/long/tag name".to_string(), -0.25)]);
    }

    #[test]
    fn log_metrics_writes_every_numeric_field_and_each_accuracy_position() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let rec = serde_json::json!({
            "step": 20, "epoch": 0, "tokens": 9757, "draft_tokens": 14625, "loss": 7.0987,
            "acc": [0.5, 0.25, 0.125], "tau_hat": 1.8, "lr": 4e-6, "grad_norm": 7.39,
            "tok_per_s": 219.8, "target_s": 1.06, "drafter_s": 1.13, "optim_s": 0.014, "elapsed_s": 51.09,
            "note": "ignored", "flag": true
        });
        log_metrics(&mut w, &rec).unwrap();
        // Flushed by log_metrics: readable without dropping the writer.
        let events = read_events(&w.path);
        assert_eq!(events.len(), 2);
        let e = &events[1];
        assert_eq!(e.step, 20);
        let tags: Vec<&str> = e.values.iter().map(|(t, _)| t.as_str()).collect();
        for want in [
            "train/epoch",
            "train/tokens",
            "train/draft_tokens",
            "train/loss",
            "train/acc/pos1",
            "train/acc/pos2",
            "train/acc/pos3",
            "train/tau_hat",
            "train/lr",
            "train/grad_norm",
        ] {
            assert!(tags.contains(&want), "missing {want} in {tags:?}");
        }
        for want in
            ["pipeline/tok_per_s", "pipeline/target_s", "pipeline/drafter_s", "pipeline/optim_s", "system/elapsed_s"]
        {
            assert!(tags.contains(&want), "missing {want} in {tags:?}");
        }
        assert_eq!(e.values.len(), 15, "{tags:?}");
        assert!(!tags.iter().any(|t| t.ends_with("step") || t.ends_with("note") || t.ends_with("flag")));
        let get = |t: &str| e.values.iter().find(|(tag, _)| tag == t).unwrap().1;
        assert_eq!(get("train/acc/pos2"), 0.25);
        assert_eq!(get("train/loss"), 7.0987f32);
        assert_eq!(tag("q_hs"), "pipeline/q_hs");
        assert_eq!(tag("val_tau_hat"), "validation/tau_hat");
        assert!(log_metrics(&mut w, &serde_json::json!({"loss": 1.0})).is_err(), "a record without step is refused");
    }

    /// The MLflow route (docs: trackers): `scripts/trackers/mlflow_import.py --dry-run` reads
    /// these event files with its own TFRecord and protobuf reader and would log every scalar at
    /// its step under its TensorBoard tag, the config as `section.key` params and the results
    /// files as artifacts; a record cut short by a crash is left out.
    #[test]
    fn the_mlflow_import_script_reads_every_scalar_of_the_event_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        let rec = serde_json::json!({"step": 20, "loss": 7.0987, "acc": [0.5, 0.25], "tau_hat": 1.8, "val_loss": 6.5,
            "gpu_util": [55.0, 61.0]});
        log_metrics(&mut w, &rec).unwrap();
        w.add_scalars(21, &[("train_step/loss".to_string(), 6.75), ("train_step/lr".to_string(), 3e-4)]).unwrap();
        w.flush().unwrap();
        let mut written: Vec<(String, i64, f32)> = read_events(&w.path)
            .into_iter()
            .flat_map(|e| e.values.into_iter().map(move |(t, v)| (t, e.step, v)))
            .collect();
        let torn = std::fs::read(&w.path).unwrap();
        // A crash in the middle of the next record: its header and part of its data.
        std::fs::write(&w.path, [&torn[..], &torn[..20]].concat()).unwrap();
        std::fs::write(dir.path().join("config.toml"), "name = \"x\"\n[train]\nsteps = 8\n[optimizer]\nlr = 0.003\n")
            .unwrap();
        std::fs::write(dir.path().join("eval.json"), "{}").unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/trackers/mlflow_import.py");
        let out = std::process::Command::new("python3").arg(&script).arg(dir.path()).arg("--dry-run").output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut read: Vec<(String, i64, f32)> = got["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m[0].as_str().unwrap().into(), m[1].as_i64().unwrap(), m[2].as_f64().unwrap() as f32))
            .collect();
        written.sort_by(|a, b| a.partial_cmp(b).unwrap());
        read.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(read, written);
        assert_eq!(written.len(), 9, "{written:?}");
        assert!(
            read.contains(&("validation/loss".into(), 20, 6.5))
                && read.contains(&("system/gpu_util/2".into(), 20, 61.0))
        );
        assert_eq!(got["params"], serde_json::json!({"name": "x", "train.steps": "8", "optimizer.lr": "0.003"}));
        let files: Vec<&str> = got["artifacts"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert!(files.len() == 2 && files[0].ends_with("config.toml") && files[1].ends_with("eval.json"), "{files:?}");
    }
}
