//! A tiny GGUF v3 writer for tests: key-values and tensors in, bytes out, with where each
//! fixed-width field sits (so hostile-input tests can corrupt one field at a time).

use std::path::PathBuf;

/// A metadata value. Type ids are GGUF's (`gguf_type`).
#[derive(Clone, Debug)]
pub enum V {
    U8(u8),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    /// (element type id, elements)
    Arr(u32, Vec<V>),
}

impl V {
    pub fn str(s: &str) -> V {
        V::Str(s.to_string())
    }

    pub fn type_id(&self) -> u32 {
        match self {
            V::U8(_) => 0,
            V::I16(_) => 3,
            V::U32(_) => 4,
            V::I32(_) => 5,
            V::F32(_) => 6,
            V::Bool(_) => 7,
            V::Str(_) => 8,
            V::Arr(..) => 9,
            V::U64(_) => 10,
            V::I64(_) => 11,
            V::F64(_) => 12,
        }
    }
}

/// A tensor to write: name, GGUF-order dims (ne[0] first), ggml type id, raw data bytes.
pub struct WTensor {
    pub name: &'static str,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub data: Vec<u8>,
}

/// Where a fixed-width field sits in the file.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub at: usize,
    pub width: usize,
}

/// A written file and the places in it.
pub struct Gguf {
    pub bytes: Vec<u8>,
    /// Every count, length, type id, dim and offset in the header, metadata and tensor infos.
    pub fields: Vec<Field>,
    /// (tensor name, offset of its type id).
    pub type_ids: Vec<(&'static str, usize)>,
    /// Where each tensor info starts (its name length).
    pub infos_at: Vec<usize>,
    pub data_offset: usize,
}

struct Writer {
    out: Vec<u8>,
    fields: Vec<Field>,
}

impl Writer {
    fn field(&mut self, bytes: &[u8]) {
        self.fields.push(Field { at: self.out.len(), width: bytes.len() });
        self.out.extend_from_slice(bytes);
    }

    fn str(&mut self, s: &str) {
        self.field(&(s.len() as u64).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn value(&mut self, v: &V) {
        match v {
            V::U8(x) => self.field(&x.to_le_bytes()),
            V::I16(x) => self.field(&x.to_le_bytes()),
            V::U32(x) => self.field(&x.to_le_bytes()),
            V::I32(x) => self.field(&x.to_le_bytes()),
            V::U64(x) => self.field(&x.to_le_bytes()),
            V::I64(x) => self.field(&x.to_le_bytes()),
            V::F32(x) => self.field(&x.to_le_bytes()),
            V::F64(x) => self.field(&x.to_le_bytes()),
            V::Bool(x) => self.field(&[*x as u8]),
            V::Str(s) => self.str(s),
            V::Arr(elem, items) => {
                self.field(&elem.to_le_bytes());
                self.field(&(items.len() as u64).to_le_bytes());
                for it in items {
                    self.value(it);
                }
            }
        }
    }
}

/// GGUF v3 with the given KVs and tensors; data padded to `align` (which must match any
/// `general.alignment` KV passed in).
pub fn gguf(kvs: &[(&str, V)], tensors: &[WTensor], align: usize) -> Gguf {
    let mut w = Writer { out: b"GGUF".to_vec(), fields: Vec::new() };
    w.field(&3u32.to_le_bytes());
    w.field(&(tensors.len() as u64).to_le_bytes());
    w.field(&(kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        w.str(k);
        w.field(&v.type_id().to_le_bytes());
        w.value(v);
    }
    let (mut offset, mut offsets, mut type_ids, mut infos_at) = (0usize, Vec::new(), Vec::new(), Vec::new());
    for t in tensors {
        infos_at.push(w.out.len());
        w.str(t.name);
        w.field(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            w.field(&d.to_le_bytes());
        }
        type_ids.push((t.name, w.out.len()));
        w.field(&t.ty.to_le_bytes());
        w.field(&(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len()).next_multiple_of(align);
    }
    let data_offset = w.out.len().next_multiple_of(align);
    for (t, off) in tensors.iter().zip(offsets) {
        w.out.resize(data_offset + off, 0);
        w.out.extend_from_slice(&t.data);
    }
    Gguf { bytes: w.out, fields: w.fields, type_ids, infos_at, data_offset }
}

/// Just the bytes of [`gguf`].
pub fn gguf_bytes(kvs: &[(&str, V)], tensors: &[WTensor], align: usize) -> Vec<u8> {
    gguf(kvs, tensors, align).bytes
}

/// `bytes` written to `name` in `dir`.
pub fn write_temp(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}
