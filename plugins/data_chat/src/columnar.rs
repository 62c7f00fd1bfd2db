//! Parquet and Arrow datasets as HF `datasets` writes them: `Dataset.to_parquet(...)` (snappy by
//! default), and `save_to_disk(dir)` (Arrow IPC stream files listed in `dir/state.json`), or one
//! `.arrow` file of either IPC flavour. Rows become JSON values (nested lists and structs as
//! arrays and objects) and go through the same record parser as the text formats, so every
//! format gives the same records and the same error messages, located by row (0-based, as
//! `datasets` indexes).

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use serde_json::Value;

use crate::schema::{DataError, OnError, ReadReport, Schema};

/// Reads a Parquet file, an Arrow file or a `save_to_disk` folder.
pub fn read(path: &Path, schema: &Schema, on_error: OnError) -> Result<ReadReport, DataError> {
    let file_err = |msg: String| DataError::File { path: path.to_path_buf(), msg };
    let mut report = ReadReport { by_row: true, ..ReadReport::default() };
    let mut row = 0usize;
    let mut take = |batch: &RecordBatch, report: &mut ReadReport, at: &Path| -> Result<(), DataError> {
        for value in rows(batch).map_err(|e| DataError::File { path: at.to_path_buf(), msg: e })? {
            match schema.parse(&value) {
                Ok(record) => report.records.push(record),
                Err(msg) => match on_error {
                    OnError::Fail => return Err(DataError::Row { path: at.to_path_buf(), row, msg }),
                    OnError::Skip => report.skipped.push((row, msg)),
                },
            }
            row += 1;
        }
        Ok(())
    };
    if path.is_dir() {
        for file in dataset_files(path)? {
            for batch in arrow_batches(&file)? {
                take(&batch, &mut report, &file)?;
            }
        }
        return Ok(report);
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if ext == "parquet" {
        let file = input_files::open_regular(path)?;
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .and_then(|b| b.build())
            .map_err(|e| file_err(format!("not a readable Parquet file: {e}")))?;
        for batch in reader {
            let batch = batch.map_err(|e| file_err(format!("reading Parquet: {e}")))?;
            take(&batch, &mut report, path)?;
        }
        return Ok(report);
    }
    for batch in arrow_batches(path)? {
        take(&batch, &mut report, path)?;
    }
    Ok(report)
}

/// A `save_to_disk` folder's `state.json` is a short list of files and fingerprints.
const STATE_JSON_BYTES: u64 = 64 << 20;

/// The Arrow files of a `save_to_disk` folder, in `state.json` order (else sorted by name).
fn dataset_files(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let err = |msg: String| DataError::File { path: dir.to_path_buf(), msg };
    if dir.join("dataset_dict.json").exists() {
        return Err(err("a DatasetDict folder: point `path` at one split's folder (e.g. its train/)".into()));
    }
    let state = dir.join("state.json");
    if state.exists() {
        let text = input_files::read_to_string_capped(&state, STATE_JSON_BYTES)?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| DataError::File { path: state.clone(), msg: format!("malformed JSON: {e}") })?;
        let files = v["_data_files"]
            .as_array()
            .ok_or_else(|| DataError::File { path: state.clone(), msg: "no `_data_files` list".into() })?;
        return files
            .iter()
            .map(|f| {
                f["filename"].as_str().map(|name| dir.join(name)).ok_or_else(|| DataError::File {
                    path: state.clone(),
                    msg: "a `_data_files` entry without `filename`".into(),
                })
            })
            .collect();
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|cause| DataError::Io { path: dir.to_path_buf(), cause })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "arrow"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(err("no state.json and no *.arrow files: not a `save_to_disk` folder".into()));
    }
    Ok(files)
}

/// All record batches of an Arrow IPC file: the stream format `datasets` writes, or the file
/// format (magic `ARROW1`).
fn arrow_batches(path: &Path) -> Result<Vec<RecordBatch>, DataError> {
    let err = |msg: String| DataError::File { path: path.to_path_buf(), msg };
    let mut file = input_files::open_regular(path)?;
    let mut magic = [0u8; 6];
    let is_file_format = file.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
    let file = input_files::open_regular(path)?;
    let batches: Result<Vec<RecordBatch>, _> = if is_file_format {
        arrow_ipc::reader::FileReader::try_new(file, None)
            .map_err(|e| err(format!("not a readable Arrow file: {e}")))?
            .collect()
    } else {
        arrow_ipc::reader::StreamReader::try_new(BufReader::new(file), None)
            .map_err(|e| err(format!("not a readable Arrow stream: {e}")))?
            .collect()
    };
    batches.map_err(|e| err(format!("reading Arrow: {e}")))
}

/// A batch's rows as JSON objects (nulls left out, as a missing key).
fn rows(batch: &RecordBatch) -> Result<Vec<Value>, String> {
    let mut buf = Vec::new();
    let mut writer = arrow_json::LineDelimitedWriter::new(&mut buf);
    writer.write(batch).map_err(|e| format!("converting rows: {e}"))?;
    writer.finish().map_err(|e| format!("converting rows: {e}"))?;
    drop(writer);
    buf.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).map_err(|e| format!("converting rows: {e}")))
        .collect()
}
