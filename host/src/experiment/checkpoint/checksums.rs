//! A checkpoint file's CRC-32C (and SHA-256), streamed from an open file, and what
//! `checksums.json` records for it.

use anyhow::{anyhow, Context, Result};
use sha2::{Digest, Sha256};
use std::{
    fs::File,
    io::{Read, Seek, SeekFrom},
    path::Path,
};

/// CRC-32C of an open file from its start (and its SHA-256 when `sha` is asked), streamed: a
/// checkpoint of a large drafter is not read into memory for it.
pub(super) fn crc_of(f: &mut File, path: &Path, sha: bool) -> Result<(u32, Option<String>)> {
    f.seek(SeekFrom::Start(0)).with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut crc, mut digest) = (0u32, sha.then(Sha256::new));
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok((crc, digest.map(|d| format!("{:x}", d.finalize()))));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        if let Some(d) = digest.as_mut() {
            d.update(&buf[..n]);
        }
    }
}

pub(super) fn file_crc(path: &Path) -> Result<u32> {
    Ok(crc_of(&mut input_files::open_regular(path)?, path, false)?.0)
}

pub(super) fn checksum_mismatch(path: &Path, got: u32, want: &str) -> anyhow::Error {
    anyhow!(
        "{}: checksum mismatch (CRC-32C {got:08x}, recorded {want}): the file is truncated or corrupt",
        path.display()
    )
}

/// The checksum `checksums.json` records for `file`.
pub(super) fn recorded<'a>(
    sums: &'a serde_json::Map<String, serde_json::Value>,
    sums_path: &Path,
    file: &str,
) -> Result<&'a str> {
    sums.get(file).and_then(|v| v.as_str()).with_context(|| format!("{}: no checksum for {file}", sums_path.display()))
}
