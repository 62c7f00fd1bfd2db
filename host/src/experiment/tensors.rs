//! safetensors files read strictly, from a file already open: the header must be a JSON object
//! with each tensor name once (a name given twice is refused, not silently overwritten), known
//! dtypes, shapes whose byte size is the span the offsets give, and spans that tile the data
//! exactly; floating-point tensors must hold finite values. Reading from the open handle means a
//! file unlinked meanwhile (a training run pruning the checkpoint) is still read whole. Every
//! error is one line naming the file and, where it is about one, the tensor.

use anyhow::{bail, Context, Result};
use plugin_api::{
    tch::{Kind, Tensor},
    NamedTensor,
};
use serde::{
    de::{Error as _, MapAccess, Visitor},
    Deserialize, Deserializer,
};
use std::{
    collections::HashSet,
    fmt,
    fs::File,
    io::{Read, Seek, SeekFrom},
    path::Path,
};

/// A header larger than this is no header a drafter's checkpoint has (the safetensors crate's
/// own limit).
const MAX_HEADER: u64 = 100 << 20;

/// The dtypes libtorch holds: safetensors name -> (kind, bytes an element).
fn kind_of(dtype: &str) -> Option<(Kind, u64)> {
    Some(match dtype {
        "F64" => (Kind::Double, 8),
        "F32" => (Kind::Float, 4),
        "F16" => (Kind::Half, 2),
        "BF16" => (Kind::BFloat16, 2),
        "I64" => (Kind::Int64, 8),
        "I32" => (Kind::Int, 4),
        "I16" => (Kind::Int16, 2),
        "I8" => (Kind::Int8, 1),
        "U8" => (Kind::Uint8, 1),
        "BOOL" => (Kind::Bool, 1),
        _ => return None,
    })
}

/// The safetensors name of a kind, for messages.
pub fn dtype_name(kind: Kind) -> String {
    match kind {
        Kind::Double => "F64".into(),
        Kind::Float => "F32".into(),
        Kind::Half => "F16".into(),
        Kind::BFloat16 => "BF16".into(),
        Kind::Int64 => "I64".into(),
        Kind::Int => "I32".into(),
        Kind::Int16 => "I16".into(),
        Kind::Int8 => "I8".into(),
        Kind::Uint8 => "U8".into(),
        Kind::Bool => "BOOL".into(),
        other => format!("{other:?}"),
    }
}

pub fn is_float(kind: Kind) -> bool {
    matches!(kind, Kind::Double | Kind::Float | Kind::Half | Kind::BFloat16)
}

/// The header's entries in file order, a name given twice refused.
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Once;
        impl<'de> Visitor<'de> for Once {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let (mut seen, mut out) = (HashSet::new(), Vec::new());
                while let Some((name, value)) = map.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(name.clone()) {
                        return Err(A::Error::custom(format!("tensor name `{name}` appears twice")));
                    }
                    out.push((name, value));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Once)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

struct Planned {
    name: String,
    kind: Kind,
    shape: Vec<i64>,
    begin: u64,
    end: u64,
}

/// Every tensor of the safetensors file open as `file` (read from its start), checked as the
/// module doc says; `path` names it in errors.
pub fn read(file: &mut File, path: &Path) -> Result<Vec<NamedTensor>> {
    let at = |what: String| format!("{}: {what}", path.display());
    let size = file.metadata().with_context(|| at("reading".into()))?.len();
    file.seek(SeekFrom::Start(0)).with_context(|| at("reading".into()))?;
    let mut len = [0u8; 8];
    if size < 8 {
        bail!(at(format!("{size} bytes: too short for a safetensors file (an 8-byte header length first)")));
    }
    file.read_exact(&mut len).with_context(|| at("reading".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || n > size - 8 {
        bail!(at(format!("header length {n} does not fit the file of {size} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).with_context(|| at("reading the header".into()))?;
    let Entries(entries) =
        serde_json::from_slice(&header).map_err(|e| anyhow::anyhow!(at(format!("header not valid: {e}"))))?;
    let data_len = size - 8 - n;
    let mut plan = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let tensor = |what: String| at(format!("tensor `{name}`: {what}"));
        let e: Entry = serde_json::from_value(value).map_err(|e| anyhow::anyhow!(tensor(format!("{e}"))))?;
        let (kind, elem) =
            kind_of(&e.dtype).with_context(|| tensor(format!("dtype `{}` is not supported", e.dtype)))?;
        let numel = e.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let bytes = numel.and_then(|n| n.checked_mul(elem)).filter(|&b| b <= data_len);
        let [begin, end] = e.data_offsets;
        match bytes {
            Some(b) if end >= begin && end - begin == b && end <= data_len => {}
            _ => bail!(tensor(format!(
                "{} {:?} needs {} bytes, its offsets {begin}..{end} span {} of the {data_len} bytes of data",
                e.dtype,
                e.shape,
                bytes.map_or("more than the file's".to_string(), |b| b.to_string()),
                end.saturating_sub(begin)
            ))),
        }
        let shape = e.shape.iter().map(|&d| d as i64).collect();
        plan.push(Planned { name, kind, shape, begin, end });
    }
    // The spans, in order, must cover the data exactly: no gap, no overlap, nothing after.
    let mut order: Vec<usize> = (0..plan.len()).collect();
    order.sort_by_key(|&i| (plan[i].begin, plan[i].end));
    let mut next = 0u64;
    for &i in &order {
        if plan[i].begin != next {
            bail!(at(format!(
                "tensor `{}` starts at byte {} of the data, expected {next} (tensors overlap or leave a gap)",
                plan[i].name, plan[i].begin
            )));
        }
        next = plan[i].end;
    }
    if next != data_len {
        bail!(at(format!("the tensors cover {next} of the {data_len} bytes of data")));
    }
    let mut out: Vec<Option<Tensor>> = (0..plan.len()).map(|_| None).collect();
    let mut buf = Vec::new();
    for &i in &order {
        let p = &plan[i];
        buf.resize((p.end - p.begin) as usize, 0);
        file.read_exact(&mut buf).with_context(|| at(format!("reading tensor `{}`", p.name)))?;
        let t = Tensor::f_from_data_size(&buf, &p.shape, p.kind).with_context(|| at(format!("tensor `{}`", p.name)))?;
        if is_float(p.kind) {
            let bad = t.isfinite().logical_not().sum(Kind::Int64).int64_value(&[]);
            if bad > 0 {
                bail!(at(format!(
                    "tensor `{}` holds {bad} non-finite values (NaN or infinity) of {}",
                    p.name,
                    t.numel()
                )));
            }
        }
        out[i] = Some(t);
    }
    Ok(plan.into_iter().zip(out).map(|(p, t)| NamedTensor::new(p.name, t.expect("every tensor read"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use plugin_api::tch::Device;

    /// A safetensors file of `header` (JSON) and `data`.
    fn file(dir: &Path, header: &str, data: &[u8]) -> std::path::PathBuf {
        let p = dir.join("t.safetensors");
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn read_err(p: &Path) -> String {
        format!("{:#}", read(&mut File::open(p).unwrap(), p).unwrap_err())
    }

    #[test]
    fn what_libtorch_writes_reads_back_equal() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        let a = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
        let b = Tensor::from_slice(&[1i64, 2, 3]);
        let c = Tensor::randn([4], (Kind::BFloat16, Device::Cpu));
        Tensor::write_safetensors(&[("a", &a), ("b", &b), ("c", &c)], &p).unwrap();
        let back = read(&mut File::open(&p).unwrap(), &p).unwrap();
        let names: Vec<&str> = back.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), 3);
        for (name, want) in [("a", &a), ("b", &b), ("c", &c)] {
            let got = back.iter().find(|t| t.name.as_str() == name).unwrap().tensor.tensor();
            assert!(got.equal(want), "{name}");
        }
    }

    #[test]
    fn a_tampered_file_is_refused_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let four = [0u8; 16];
        // A name given twice (JSON parsers keep the last silently).
        let p = file(
            d,
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            &four,
        );
        assert!(read_err(&p).contains("tensor name `w` appears twice"), "{}", read_err(&p));
        // A shape that does not match the span, a gap, bytes left over, a dtype libtorch lacks.
        let p = file(d, r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#, &four);
        assert!(
            read_err(&p).contains("tensor `w`: F32 [3] needs 12 bytes, its offsets 0..16 span 16"),
            "{}",
            read_err(&p)
        );
        let p = file(
            d,
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
            &four[..12],
        );
        assert!(read_err(&p).contains("tensor `b` starts at byte 8 of the data, expected 4"), "{}", read_err(&p));
        let p = file(d, r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &four);
        assert!(read_err(&p).contains("the tensors cover 8 of the 16 bytes"), "{}", read_err(&p));
        let p = file(d, r#"{"w":{"dtype":"F8_E4M3","shape":[16],"data_offsets":[0,16]}}"#, &four);
        assert!(read_err(&p).contains("tensor `w`: dtype `F8_E4M3` is not supported"), "{}", read_err(&p));
        // Sizes whose product overflows, or far past the file: refused before anything is allocated.
        let p = file(d, r#"{"w":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,16]}}"#, &four);
        assert!(read_err(&p).contains("needs more than the file's bytes"), "{}", read_err(&p));
        // NaN and infinity in floating-point tensors.
        let mut nan = f32::NAN.to_le_bytes().to_vec();
        nan.extend_from_slice(&1.0f32.to_le_bytes());
        let p = file(d, r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, &nan);
        assert!(
            read_err(&p).contains("tensor `w` holds 1 non-finite values (NaN or infinity) of 2"),
            "{}",
            read_err(&p)
        );
        // Not JSON, a header longer than the file, a file too short for one.
        let p = file(d, "{\"w\": [", &four);
        assert!(read_err(&p).contains("header not valid"), "{}", read_err(&p));
        std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
        assert!(read_err(&p).contains("header length 1000 does not fit the file of 8 bytes"), "{}", read_err(&p));
        std::fs::write(&p, [1u8, 2]).unwrap();
        assert!(read_err(&p).contains("2 bytes: too short"), "{}", read_err(&p));
        assert!(read_err(&p).starts_with(&p.display().to_string()), "{}", read_err(&p));
    }

    #[test]
    fn a_file_removed_after_it_was_opened_is_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        let a = Tensor::randn([64, 8], (Kind::Float, Device::Cpu));
        Tensor::write_safetensors(&[("a", &a)], &p).unwrap();
        let mut f = File::open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        let back = read(&mut f, &p).unwrap();
        assert!(back[0].tensor.tensor().equal(&a));
    }
}
