//! GGUF (v2 and v3) reader over a memory map: header, metadata, tensor infos, and
//! dequantisation to f32 of the ggml types common llama.cpp quantisations use.
//!
//! Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64,
//! the metadata key/values, the tensor infos, padding up to `general.alignment` (default 32),
//! then the tensor data; each tensor's offset is relative to the start of the data.
//!
//! Every length and count read from the file is checked against the bytes that remain before
//! anything is allocated, so a truncated or hostile file gives an error, never a panic or a
//! huge allocation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

mod dequant;
mod parse;
#[cfg(test)]
pub(crate) mod tests;
mod types;
mod value;

use parse::*;
pub use types::GgmlType;
use types::*;
pub use value::{GgufValue, TensorInfo};

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Not a regular file, or not readable (the error names the file).
    #[error("{0}")]
    Input(Box<input_files::InputError>),
    #[error("{}: {what}", .path.display())]
    Format { path: PathBuf, what: String },
    #[error("{}: metadata key {key}: missing", .path.display())]
    MissingKey { path: PathBuf, key: String },
    #[error("{}: metadata key {key}: expected {expected}, found {found}", .path.display())]
    KeyType { path: PathBuf, key: String, expected: &'static str, found: String },
    #[error("{}: no tensor named {name}", .path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor {name}: cannot dequantise ggml type {ty} (supported: {})", .path.display(), supported_names())]
    UnsupportedType { path: PathBuf, name: String, ty: &'static str },
    #[error("{}: tokenizer: {what}", .path.display())]
    Tokenizer { path: PathBuf, what: String },
}

// ---------------------------------------------------------------------------------------------
// The file
// ---------------------------------------------------------------------------------------------

pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses `path`, validating every tensor's data range against the file length.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        // Opened once, refused unless a regular file (a FIFO never blocks), mapped from that
        // handle; as with any mmap, another process truncating or rewriting the file while it is
        // open is outside what this reader can guard against.
        let mmap = input_files::map_regular(&path).map_err(|e| GgufError::Input(Box::new(e)))?;
        let p = parse(&mmap).map_err(|what| GgufError::Format { path: path.clone(), what })?;

        let meta_index = p.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let mut tensor_index = HashMap::with_capacity(p.tensors.len());
        for (i, t) in p.tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                let what = format!("tensor {} appears twice", t.name);
                return Err(GgufError::Format { path, what });
            }
        }
        Ok(GgufFile {
            path,
            mmap,
            version: p.version,
            alignment: p.alignment,
            data_offset: p.data_offset,
            metadata: p.metadata,
            meta_index,
            tensors: p.tensors,
            tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    // --- metadata ---

    /// All key/values in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { path: self.path.clone(), key: key.into() })
    }

    fn key_type(&self, key: &str, expected: &'static str, found: String) -> GgufError {
        GgufError::KeyType { path: self.path.clone(), key: key.into(), expected, found }
    }

    /// An integer of any GGUF integer type, converted to `T` when the value fits.
    fn meta_int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T, GgufError> {
        let v = self.require(key)?;
        match v.as_int() {
            Some(i) => T::try_from(i).map_err(|_| self.key_type(key, expected, format!("{} {i}", v.type_name()))),
            None => Err(self.key_type(key, expected, v.type_name())),
        }
    }

    pub fn meta_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.meta_int(key, "an integer that fits u32")
    }

    pub fn meta_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.meta_int(key, "an integer that fits u64")
    }

    pub fn meta_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.meta_int(key, "an integer that fits i64")
    }

    pub fn meta_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.meta_int(key, "an integer that fits usize")
    }

    /// f32 or f64 (narrowed).
    pub fn meta_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_float().map(|f| f as f32).ok_or_else(|| self.key_type(key, "a float", v.type_name()))
    }

    pub fn meta_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(self.key_type(key, "bool", v.type_name())),
        }
    }

    pub fn meta_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.key_type(key, "string", v.type_name()))
    }

    fn meta_array(&self, key: &str, expected: &'static str) -> Result<&[GgufValue], GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.key_type(key, expected, v.type_name()))
    }

    pub fn meta_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let expected = "array of string";
        let items = self.meta_array(key, expected)?;
        items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| self.key_type(key, expected, format!("array of {}", v.type_name()))))
            .collect()
    }

    /// Elements of any integer type that fit i32.
    pub fn meta_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let expected = "array of integers that fit i32";
        let items = self.meta_array(key, expected)?;
        items
            .iter()
            .map(|v| {
                v.as_int()
                    .and_then(|i| i32::try_from(i).ok())
                    .ok_or_else(|| self.key_type(key, expected, format!("array with {v:?}")))
            })
            .collect()
    }

    /// Elements of type f32 or f64.
    pub fn meta_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let expected = "array of float";
        let items = self.meta_array(key, expected)?;
        items
            .iter()
            .map(|v| {
                v.as_float()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.key_type(key, expected, format!("array of {}", v.type_name())))
            })
            .collect()
    }

    // --- tensors ---

    /// Tensor names in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_info(name).ok_or_else(|| GgufError::MissingTensor { path: self.path.clone(), name: name.into() })
    }

    /// The tensor's raw bytes (in range: `open` checked it).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.require_tensor(name)?;
        let start = self.data_offset + t.offset;
        Ok(&self.mmap[start..start + t.n_bytes])
    }

    /// Torch-order shape and values as f32.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), GgufError> {
        self.dequantize_selected(name, &[], &|row| row)
    }

    /// The part `sel` keeps of tensor `name` (torch order; per dimension its index ranges in
    /// order, an empty list keeping the whole dimension): its shape and values as f32. Blocks run
    /// along the innermost dimension, so the tensor is read one row (all dims but the last) at a
    /// time: only the kept rows are read, and of each only the blocks the kept columns touch; a
    /// column range that cuts a block dequantises that block and keeps its part. `source_row`
    /// maps a row of the tensor as returned (an index over all dims but the last, in the whole
    /// tensor) to the row of the file it is read from (a permutation of the rows, e.g. llama's
    /// Q/K; the identity otherwise).
    pub fn dequantize_selected(
        &self,
        name: &str,
        sel: &[Vec<std::ops::Range<i64>>],
        source_row: &dyn Fn(usize) -> usize,
    ) -> Result<(Vec<usize>, Vec<f32>), GgufError> {
        let t = self.require_tensor(name)?;
        let ty = t.ggml_type;
        let block_fn = ty.0.dequant.ok_or_else(|| GgufError::UnsupportedType {
            path: self.path.clone(),
            name: name.into(),
            ty: ty.name(),
        })?;
        let format =
            |what: String| GgufError::Format { path: self.path.clone(), what: format!("tensor {name}: {what}") };
        // A 0-dim tensor is read as one element of one row.
        let whole = t.torch_shape();
        let shape = if whole.is_empty() { vec![1] } else { whole.clone() };
        let last = shape.len() - 1;
        // Per torch dimension, the index ranges kept.
        let mut kept: Vec<Vec<std::ops::Range<usize>>> = Vec::with_capacity(shape.len());
        for (d, &n) in shape.iter().enumerate() {
            match sel.get(d).filter(|r| !r.is_empty()) {
                None => kept.push(std::iter::once(0..n).collect()),
                Some(ranges) => {
                    if let Some(r) = ranges.iter().find(|r| r.start < 0 || r.start >= r.end || r.end as usize > n) {
                        return Err(format(format!("rows {r:?} of dimension {d} (size {n})")));
                    }
                    kept.push(ranges.iter().map(|r| r.start as usize..r.end as usize).collect());
                }
            }
        }
        if sel.len() > shape.len() && sel[shape.len()..].iter().any(|r| !r.is_empty()) {
            return Err(format(format!("a selection of {} dimensions of a tensor of {}", sel.len(), shape.len())));
        }
        let out_shape: Vec<usize> = kept.iter().map(|r| r.iter().map(|r| r.len()).sum()).collect();
        let n_out = out_shape.iter().product();
        let out_shape = if whole.is_empty() { whole } else { out_shape };
        if n_out == 0 {
            return Ok((out_shape, Vec::new()));
        }
        let (row_len, block_elems, block_bytes) = (shape[last], ty.block_elems(), ty.block_bytes());
        let row_bytes = row_len / block_elems * block_bytes;
        let n_rows = t.n_elements / row_len;
        // The kept rows, as indices over all dims but the last.
        let mut rows = vec![0usize];
        for (ranges, &n) in kept.iter().zip(&shape).take(last) {
            rows =
                rows.iter().flat_map(|&p| ranges.iter().flat_map(move |r| r.clone().map(move |i| p * n + i))).collect();
        }
        let cols = &kept[last];
        let data = self.tensor_data(name)?;
        let mut out = Vec::with_capacity(n_out);
        let mut row = vec![0f32; row_len];
        for r in rows {
            let src = source_row(r);
            if src >= n_rows {
                return Err(format(format!("row {r} is read from row {src} of {n_rows}")));
            }
            let bytes = &data[src * row_bytes..(src + 1) * row_bytes];
            for c in cols {
                for b in c.start / block_elems..c.end.div_ceil(block_elems) {
                    let y = &mut row[b * block_elems..(b + 1) * block_elems];
                    block_fn(&bytes[b * block_bytes..(b + 1) * block_bytes], y);
                }
                out.extend_from_slice(&row[c.clone()]);
            }
        }
        Ok((out_shape, out))
    }
}
