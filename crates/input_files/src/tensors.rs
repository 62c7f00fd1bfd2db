//! safetensors files read through [`map_regular`](crate::map_regular): the file is opened once,
//! refused unless it is a regular file, memory-mapped from that handle, its header checked by the
//! `safetensors` crate (offsets within the file, no overlaps), and each tensor copied out of the
//! map. Nothing is read whole into memory first (a 5 GB shard costs its tensors, not twice that).

use crate::{map_regular, InputError};
use safetensors::{Dtype, SafeTensors};
use std::{ops::Range, path::Path, sync::Arc};
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
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::F8_E5M2 => Kind::Float8e5m2,
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

/// A tensor of a mapped safetensors file, read when asked: whole, or only a selection of its
/// rows and columns (a tensor-parallel rank's shard), copying just those bytes out of the map.
#[derive(Clone)]
pub struct LazyTensor {
    map: Arc<memmap2::Mmap>,
    /// Where its bytes are in the map.
    bytes: Range<usize>,
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// The file, for errors.
    path: Arc<Path>,
    name: String,
}

impl std::fmt::Debug for LazyTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} {:?} {:?}", self.path.display(), self.name, self.kind, self.shape)
    }
}

/// Per dimension, the index ranges kept (in order); an empty list (or a missing dimension) keeps
/// the whole dimension.
pub type Selection = [Vec<Range<i64>>];

/// The shape `shape` has after `sel`.
pub fn selected_shape(shape: &[i64], sel: &Selection) -> Vec<i64> {
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| match sel.get(d) {
            Some(r) if !r.is_empty() => r.iter().map(|r| r.end - r.start).sum(),
            _ => n,
        })
        .collect()
}

/// The contiguous byte runs (offset, length) of a row-major tensor of `shape` and element size
/// `elt` that `sel` keeps, in order, adjacent runs merged.
pub fn selected_runs(shape: &[i64], elt: usize, sel: &Selection) -> Vec<(usize, usize)> {
    let full = |d: usize| sel.get(d).is_none_or(|r| r.is_empty());
    // Dimensions after the last selected one are read whole: one run per index before it.
    let Some(last) = (0..shape.len()).rev().find(|&d| !full(d)) else {
        return vec![(0, shape.iter().product::<i64>() as usize * elt)];
    };
    let inner = shape[last + 1..].iter().product::<i64>() as usize * elt;
    let ranges = |d: usize| -> Vec<Range<i64>> {
        if full(d) {
            std::iter::once(0..shape[d]).collect()
        } else {
            sel[d].clone()
        }
    };
    // Element offsets (in units of `shape[d]` blocks) of every kept index before `last`.
    let mut prefixes = vec![0usize];
    for (d, &n) in shape.iter().enumerate().take(last) {
        let mut next = Vec::new();
        for &p in &prefixes {
            for r in ranges(d) {
                next.extend((r.start..r.end).map(|i| p * n as usize + i as usize));
            }
        }
        prefixes = next;
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for p in prefixes {
        for r in ranges(last) {
            let start = (p * shape[last] as usize + r.start as usize) * inner;
            let len = (r.end - r.start) as usize * inner;
            match runs.last_mut() {
                Some((s, l)) if *s + *l == start => *l += len,
                _ => runs.push((start, len)),
            }
        }
    }
    runs
}

impl LazyTensor {
    /// The whole tensor.
    pub fn read(&self) -> Result<Tensor, InputError> {
        self.read_selected(&[])
    }

    /// The part `sel` keeps (its ranges within the shape), copied out of the map: only those
    /// bytes are touched.
    pub fn read_selected(&self, sel: &Selection) -> Result<Tensor, InputError> {
        let format = |what: String| InputError::Format { path: self.path.to_path_buf(), what };
        for (d, ranges) in sel.iter().enumerate() {
            let n = self.shape.get(d).copied().unwrap_or(0);
            if let Some(r) = ranges.iter().find(|r| r.start < 0 || r.end > n || r.start >= r.end) {
                return Err(format(format!("tensor `{}`: rows {r:?} of dimension {d} (size {n})", self.name)));
            }
        }
        let data = &self.map[self.bytes.clone()];
        let runs = selected_runs(&self.shape, self.kind.elt_size_in_bytes(), sel);
        let mut bytes = Vec::with_capacity(runs.iter().map(|r| r.1).sum());
        for (start, len) in runs {
            bytes.extend_from_slice(&data[start..start + len]);
        }
        Tensor::f_from_data_size(&bytes, &selected_shape(&self.shape, sel), self.kind)
            .map_err(|e| format(format!("tensor `{}`: {e}", self.name)))
    }
}

/// Every tensor of the safetensors file at `path`, sorted by name, mapped and not read yet; the
/// header is checked here (errors name the file and the tensor).
pub fn lazy_safetensors(path: &Path) -> Result<Vec<(String, LazyTensor)>, InputError> {
    let map = Arc::new(map_regular(path)?);
    let format = |what: String| InputError::Format { path: path.to_path_buf(), what };
    let st = SafeTensors::deserialize(&map).map_err(|e| format(format!("not a safetensors file: {e}")))?;
    let base = map.as_ptr() as usize;
    let shared: Arc<Path> = Arc::from(path);
    let mut out = Vec::with_capacity(st.len());
    for (name, view) in st.iter() {
        let kind =
            kind(view.dtype()).ok_or_else(|| format!("tensor `{name}`: dtype {:?} has no torch type", view.dtype()));
        let kind = kind.map_err(format)?;
        let start = view.data().as_ptr() as usize - base;
        out.push((
            name.to_string(),
            LazyTensor {
                map: Arc::clone(&map),
                bytes: start..start + view.data().len(),
                kind,
                shape: view.shape().iter().map(|&d| d as i64).collect(),
                path: Arc::clone(&shared),
                name: name.to_string(),
            },
        ));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // selections: one range a dimension
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

    /// A selection reads just its rows and columns, equal to slicing the whole tensor.
    #[test]
    fn a_selection_reads_the_rows_and_columns_it_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a = Tensor::arange(4 * 6 * 5, (Kind::Float, tch::Device::Cpu)).reshape([4, 6, 5]);
        Tensor::write_safetensors(&[("a", &a)], &path).unwrap();
        let lazy = lazy_safetensors(&path).unwrap().remove(0).1;
        assert!(lazy.read().unwrap().equal(&a));
        let sel = [vec![1..3], vec![0..2, 4..6]];
        let want = Tensor::cat(&[a.narrow(0, 1, 2).narrow(1, 0, 2), a.narrow(0, 1, 2).narrow(1, 4, 2)], 1);
        assert!(lazy.read_selected(&sel).unwrap().equal(&want));
        let cols = [vec![], vec![], vec![3..5]];
        assert!(lazy.read_selected(&cols).unwrap().equal(&a.narrow(2, 3, 2)));
        // Whole rows merge into one run.
        assert_eq!(selected_runs(&[4, 6, 5], 4, &[vec![1..3]]), vec![(120, 240)]);
        let err = lazy.read_selected(&[vec![3..5]]).unwrap_err().to_string();
        assert!(err.contains("tensor `a`: rows 3..5 of dimension 0 (size 4)"), "{err}");
    }
}
