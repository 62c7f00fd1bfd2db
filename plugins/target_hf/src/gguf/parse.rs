//! Parsing the header, metadata and tensor infos from the file's bytes, every length and count
//! checked against the bytes that remain before anything is allocated.

use super::{
    types::GgmlType,
    value::{GgufValue, TensorInfo},
};
use std::collections::HashMap;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// ggml tensors have at most 4 dims (GGML_MAX_DIMS).
const MAX_DIMS: usize = 4;
/// Real files nest arrays at most once; a deeper nest is corrupt (and could exhaust the stack).
const MAX_ARRAY_DEPTH: usize = 4;

/// Bounds-checked little-endian reader; errors are plain descriptions, the caller adds where.
pub(super) struct Cursor<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "unexpected end of file at byte {}: need {n} bytes, {} left",
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A u64 count or length that must fit in what is left, `unit` bytes per item at least.
    fn count(&mut self, unit: usize, what: &str) -> Result<usize, String> {
        let at = self.pos;
        let n = self.u64()?;
        let fits = self.remaining() / unit;
        if n > fits as u64 {
            return Err(format!("{what} {n} at byte {at} cannot fit in the {} bytes left", self.remaining()));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.count(1, "string length")?;
        let at = self.pos;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("string at byte {at}: {e}"))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue, String> {
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("bool at byte {} is {b}, not 0 or 1", self.pos - 1)),
            },
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"));
                }
                let elem_ty = self.u32()?;
                let unit = min_value_size(elem_ty).ok_or_else(|| format!("unknown array element type {elem_ty}"))?;
                let n = self.count(unit, "array length")?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(elem_ty, depth + 1).map_err(|e| format!("[{i}]: {e}"))?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            _ => return Err(format!("unknown value type {ty}")),
        })
    }
}

/// Fewest bytes a value of GGUF type `ty` takes (a string or array at least its u64 length).
pub(super) fn min_value_size(ty: u32) -> Option<usize> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        8 | 10 | 11 | 12 => Some(8),
        9 => Some(12),
        _ => None,
    }
}

/// 93000000 -> "93,000,000", for readable sizes in messages.
pub(super) fn commas(n: u128) -> String {
    let digits = n.to_string();
    let groups: Vec<&str> =
        digits.as_bytes().rchunks(3).rev().map(|g| std::str::from_utf8(g).expect("ASCII digits")).collect();
    groups.join(",")
}

/// Header, metadata and tensor infos, parsed and validated from the file's bytes.
pub(super) struct Parsed {
    pub(super) version: u32,
    pub(super) alignment: usize,
    pub(super) data_offset: usize,
    pub(super) metadata: Vec<(String, GgufValue)>,
    pub(super) tensors: Vec<TensorInfo>,
}

pub(super) fn parse(buf: &[u8]) -> Result<Parsed, String> {
    let mut cur = Cursor { buf, pos: 0 };

    // 1. Header.
    let magic = cur.array::<4>().map_err(|e| format!("header: {e}"))?;
    if &magic != MAGIC {
        return Err(format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"));
    }
    let version = cur.u32().map_err(|e| format!("header: {e}"))?;
    if version != 2 && version != 3 {
        // v1 used u32 counts; a byte-swapped (big-endian) file shows up as a huge version.
        return Err(format!("unsupported GGUF version {version} (supported: 2, 3, little-endian)"));
    }
    // Smallest tensor info: name length 8 + n_dims 4 + type 4 + offset 8.
    let n_tensors = cur.count(24, "tensor count").map_err(|e| format!("header: {e}"))?;
    // Smallest KV: key length 8 + type 4 + a 1-byte value.
    let n_kv = cur.count(13, "metadata count").map_err(|e| format!("header: {e}"))?;

    // 2. Metadata.
    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = cur.string().map_err(|e| format!("metadata #{i} key: {e}"))?;
        let value = cur.u32().and_then(|ty| cur.value(ty, 0)).map_err(|e| format!("metadata key {key}: {e}"))?;
        if seen.insert(key.clone(), i).is_some() {
            return Err(format!("metadata key {key} appears twice"));
        }
        metadata.push((key, value));
    }

    let alignment = match seen.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_int() {
            Some(a) if a > 0 && a <= 1 << 30 && (a as u64).is_power_of_two() => a as usize,
            _ => return Err(format!("general.alignment {v:?} is not a power of two")),
        },
    };

    // 3. Tensor infos (sizes need the whole table, bounds need the data offset: checked below).
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = cur.string().map_err(|e| format!("tensor #{i} name: {e}"))?;
        let info = read_tensor_info(&mut cur, name.clone()).map_err(|e| format!("tensor {name}: {e}"))?;
        tensors.push(info);
    }

    // 4. Data section and per-tensor bounds.
    let data_offset = cur.pos.next_multiple_of(alignment);
    let file_len = buf.len();
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(format!(
                "tensor {}: offset {} is not a multiple of the alignment {alignment}",
                t.name, t.offset
            ));
        }
        // u128: a hostile offset near u64::MAX must not overflow the check itself.
        let start = data_offset as u128 + t.offset as u128;
        let end = start + t.n_bytes as u128;
        if end > file_len as u128 {
            return Err(format!(
                "tensor {}: data [{}..{}) beyond end of file ({} bytes)",
                t.name,
                commas(start),
                commas(end),
                commas(file_len as u128)
            ));
        }
    }

    Ok(Parsed { version, alignment, data_offset, metadata, tensors })
}

pub(super) fn read_tensor_info(cur: &mut Cursor, name: String) -> Result<TensorInfo, String> {
    let n_dims = cur.u32()? as usize;
    if n_dims > MAX_DIMS {
        return Err(format!("{n_dims} dims (at most {MAX_DIMS})"));
    }
    let mut dims = Vec::with_capacity(n_dims);
    for _ in 0..n_dims {
        dims.push(cur.u64()?);
    }
    // ggml's dims are int64: a larger one (possible in an empty tensor) is no shape torch can hold.
    if let Some((j, d)) = dims.iter().enumerate().find(|(_, &d)| d > i64::MAX as u64) {
        return Err(format!("dims {dims:?}: ne[{j}] = {d} does not fit int64"));
    }
    let type_id = cur.u32()?;
    let offset = cur.u64()?;

    let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| format!("unknown ggml type id {type_id}"))?;
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("dims {dims:?}: element count overflows"))?;
    // Blocks run along ne[0], so each row must hold whole blocks.
    let row = dims.first().copied().unwrap_or(1);
    if row % ggml_type.block_elems() as u64 != 0 {
        return Err(format!(
            "dims {dims:?}: ne[0] = {row} is not a multiple of the {} block size {}",
            ggml_type.name(),
            ggml_type.block_elems()
        ));
    }
    let n_bytes = (n_elements / ggml_type.block_elems())
        .checked_mul(ggml_type.block_bytes())
        .ok_or_else(|| format!("dims {dims:?}: byte size overflows"))?;
    let offset = usize::try_from(offset).map_err(|_| format!("offset {offset} overflows"))?;
    // Each dim is at most n_elements (or the tensor is empty), so it fits usize.
    let dims = dims.iter().map(|&d| d as usize).collect();
    Ok(TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes })
}
