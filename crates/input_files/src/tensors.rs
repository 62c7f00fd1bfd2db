//! safetensors files read through [`map_regular`](crate::map_regular): the file is opened once,
//! refused unless it is a regular file, memory-mapped from that handle, its header checked by the
//! `safetensors` crate (offsets within the file, no overlaps), and each tensor copied out of the
//! map. Nothing is read whole into memory first (a 5 GB shard costs its tensors, not twice that).

use crate::{map_regular, InputError};
use safetensors::{Dtype, SafeTensors};
use std::path::Path;
use tch::{Kind, Tensor};

/// The torch dtype of a safetensors dtype, where torch has one.
fn kind(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// Every tensor of the safetensors file at `path`, sorted by name; errors name the file (and the
/// tensor).
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>, InputError> {
    let map = map_regular(path)?;
    let format = |what: String| InputError::Format { path: path.to_path_buf(), what };
    let st = SafeTensors::deserialize(&map).map_err(|e| format(format!("not a safetensors file: {e}")))?;
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let kind =
            kind(view.dtype()).ok_or_else(|| format!("tensor `{name}`: dtype {:?} has no torch type", view.dtype()));
        let kind = kind.map_err(format)?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t =
            Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| format(format!("tensor `{name}`: {e}")))?;
        out.push((name.to_string(), t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_come_back_by_name_and_a_bad_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).reshape([2, 3]);
        let b = Tensor::from_slice(&[1i64, -2]);
        Tensor::write_safetensors(&[("a", &a), ("b", &b)], &path).unwrap();
        let got = read_safetensors(&path).unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(got[0].1.equal(&a) && got[1].1.equal(&b));
        // Cut short: the header's offsets run past the end, refused naming the file.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = read_safetensors(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: not a safetensors file", path.display())), "{err}");
        let err = read_safetensors(Path::new("/dev/zero")).unwrap_err().to_string();
        assert_eq!(err, "/dev/zero: not a regular file (a character device)");
    }
}
