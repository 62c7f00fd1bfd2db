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
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// ggml tensors have at most 4 dims (GGML_MAX_DIMS).
const MAX_DIMS: usize = 4;
/// Real files nest arrays at most once; a deeper nest is corrupt (and could exhaust the stack).
const MAX_ARRAY_DEPTH: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {what}", .path.display())]
    Format { path: PathBuf, what: String },
    #[error("{}: metadata key {key}: missing", .path.display())]
    MissingKey { path: PathBuf, key: String },
    #[error("{}: metadata key {key}: expected {expected}, found {found}", .path.display())]
    KeyType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{}: no tensor named {name}", .path.display())]
    MissingTensor { path: PathBuf, name: String },
    #[error("{}: tensor {name}: cannot dequantise ggml type {ty} (supported: {})", .path.display(), supported_names())]
    UnsupportedType {
        path: PathBuf,
        name: String,
        ty: &'static str,
    },
    #[error("{}: tokenizer: {what}", .path.display())]
    Tokenizer { path: PathBuf, what: String },
}

// ---------------------------------------------------------------------------------------------
// ggml types
// ---------------------------------------------------------------------------------------------

/// Dequantises one block: `block.len()` = block bytes, `out.len()` = block elements.
type BlockFn = fn(&[u8], &mut [f32]);

struct TypeInfo {
    id: u32,
    name: &'static str,
    block_bytes: usize,
    block_elems: usize,
    dequant: Option<BlockFn>,
}

const QK_K: usize = 256;

/// Every ggml type id in use (ids 4, 5, 31-33, 36-38 were removed from ggml). Sizes are
/// ggml's `sizeof(block_*)`; they let `open` bounds-check tensors we cannot dequantise too.
#[rustfmt::skip]
static GGML_TYPES: &[TypeInfo] = &[
    TypeInfo { id: 0,  name: "F32",     block_bytes: 4,   block_elems: 1,    dequant: Some(dequant_f32) },
    TypeInfo { id: 1,  name: "F16",     block_bytes: 2,   block_elems: 1,    dequant: Some(dequant_f16) },
    TypeInfo { id: 2,  name: "Q4_0",    block_bytes: 18,  block_elems: 32,   dequant: Some(dequant_q4_0) },
    TypeInfo { id: 3,  name: "Q4_1",    block_bytes: 20,  block_elems: 32,   dequant: Some(dequant_q4_1) },
    TypeInfo { id: 6,  name: "Q5_0",    block_bytes: 22,  block_elems: 32,   dequant: Some(dequant_q5_0) },
    TypeInfo { id: 7,  name: "Q5_1",    block_bytes: 24,  block_elems: 32,   dequant: Some(dequant_q5_1) },
    TypeInfo { id: 8,  name: "Q8_0",    block_bytes: 34,  block_elems: 32,   dequant: Some(dequant_q8_0) },
    TypeInfo { id: 9,  name: "Q8_1",    block_bytes: 36,  block_elems: 32,   dequant: None },
    TypeInfo { id: 10, name: "Q2_K",    block_bytes: 84,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 11, name: "Q3_K",    block_bytes: 110, block_elems: QK_K, dequant: None },
    TypeInfo { id: 12, name: "Q4_K",    block_bytes: 144, block_elems: QK_K, dequant: Some(dequant_q4_k) },
    TypeInfo { id: 13, name: "Q5_K",    block_bytes: 176, block_elems: QK_K, dequant: Some(dequant_q5_k) },
    TypeInfo { id: 14, name: "Q6_K",    block_bytes: 210, block_elems: QK_K, dequant: Some(dequant_q6_k) },
    TypeInfo { id: 15, name: "Q8_K",    block_bytes: 292, block_elems: QK_K, dequant: None },
    TypeInfo { id: 16, name: "IQ2_XXS", block_bytes: 66,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 17, name: "IQ2_XS",  block_bytes: 74,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 18, name: "IQ3_XXS", block_bytes: 98,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 19, name: "IQ1_S",   block_bytes: 50,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 20, name: "IQ4_NL",  block_bytes: 18,  block_elems: 32,   dequant: None },
    TypeInfo { id: 21, name: "IQ3_S",   block_bytes: 110, block_elems: QK_K, dequant: None },
    TypeInfo { id: 22, name: "IQ2_S",   block_bytes: 82,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 23, name: "IQ4_XS",  block_bytes: 136, block_elems: QK_K, dequant: None },
    TypeInfo { id: 24, name: "I8",      block_bytes: 1,   block_elems: 1,    dequant: None },
    TypeInfo { id: 25, name: "I16",     block_bytes: 2,   block_elems: 1,    dequant: None },
    TypeInfo { id: 26, name: "I32",     block_bytes: 4,   block_elems: 1,    dequant: None },
    TypeInfo { id: 27, name: "I64",     block_bytes: 8,   block_elems: 1,    dequant: None },
    TypeInfo { id: 28, name: "F64",     block_bytes: 8,   block_elems: 1,    dequant: None },
    TypeInfo { id: 29, name: "IQ1_M",   block_bytes: 56,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 30, name: "BF16",    block_bytes: 2,   block_elems: 1,    dequant: Some(dequant_bf16) },
    TypeInfo { id: 34, name: "TQ1_0",   block_bytes: 54,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 35, name: "TQ2_0",   block_bytes: 66,  block_elems: QK_K, dequant: None },
    TypeInfo { id: 39, name: "MXFP4",   block_bytes: 17,  block_elems: 32,   dequant: None },
];

fn supported_names() -> String {
    let names: Vec<&str> = GGML_TYPES
        .iter()
        .filter(|t| t.dequant.is_some())
        .map(|t| t.name)
        .collect();
    names.join(", ")
}

/// A ggml tensor type known to this reader (only ids in `GGML_TYPES` can be constructed).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(&'static TypeInfo);

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().find(|t| t.id == id).map(GgmlType)
    }
    pub fn id(self) -> u32 {
        self.0.id
    }
    pub fn name(self) -> &'static str {
        self.0.name
    }
    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        self.0.block_bytes
    }
    /// Elements in one block.
    pub fn block_elems(self) -> usize {
        self.0.block_elems
    }
    pub fn can_dequantize(self) -> bool {
        self.0.dequant.is_some()
    }
}

impl PartialEq for TypeInfo {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl Eq for TypeInfo {}

impl std::fmt::Debug for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// Per-block dequantisers: llama.cpp's dequantize_row_* for one block, same arithmetic order.
// ---------------------------------------------------------------------------------------------

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn dequant_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn dequant_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// Q4_0: d f16, qs[16]; element j is the low nibble of qs[j], element j+16 the high nibble;
/// x = (q - 8) * d.
fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: d f16, m f16, qs[16]; x = q * d + m.
fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0xF) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_0: d f16, qh u32 (bit i = 5th bit of element i), qs[16] as in Q4_0; x = (q - 16) * d.
fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let hi0 = ((qh >> j) & 1) << 4;
        let hi1 = ((qh >> (j + 16)) & 1) << 4;
        out[j] = (((qs[j] & 0xF) as u32 | hi0) as i32 - 16) as f32 * d;
        out[j + 16] = (((qs[j] >> 4) as u32 | hi1) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: d f16, m f16, qh u32, qs[16]; x = q * d + m.
fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let hi0 = ((qh >> j) & 1) << 4;
        let hi1 = ((qh >> (j + 16)) & 1) << 4;
        out[j] = ((qs[j] & 0xF) as u32 | hi0) as f32 * d + m;
        out[j + 16] = ((qs[j] >> 4) as u32 | hi1) as f32 * d + m;
    }
}

/// Q8_0: d f16, qs[32] i8; x = q * d.
fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block j (0..8) from the 12 packed bytes of Q4_K / Q5_K:
/// sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7
/// keep their low 4 bits in bytes 8-11 and their top 2 bits in the spare high bits of 0-7.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: d f16, dmin f16, scales[12], qs[128]; 8 sub-blocks of 32. Each 64 elements share 32
/// bytes of qs: the low nibbles are the first sub-block, the high nibbles the second.
/// x = d * scale * q - dmin * min.
fn dequant_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let q = &qs[chunk * 32..chunk * 32 + 32];
        let y = &mut out[chunk * 64..chunk * 64 + 64];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: d f16, dmin f16, scales[12], qh[32], qs[128]; as Q4_K plus a 5th bit per element:
/// for 64-element chunk c, bit 2c of qh[l] belongs to the first sub-block, bit 2c+1 to the
/// second.
fn dequant_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let ql = &qs[chunk * 32..chunk * 32 + 32];
        let y = &mut out[chunk * 64..chunk * 64 + 64];
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0xF) + hi1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + hi2) as f32 - m2;
        }
    }
}

/// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] i8, d f16; 16 sub-blocks of
/// 16. Per 128-element half: ql's 64 bytes hold elements 0-31/32-63 (low nibbles) and 64-95/
/// 96-127 (high nibbles); qh's 32 bytes hold 2 bits for each of the four quarters.
/// x = d * scale * (q - 32).
fn dequant_q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let y = &mut out[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata values
// ---------------------------------------------------------------------------------------------

/// One metadata value. Arrays keep their elements only (an empty array loses its element
/// type, which no reader needs).
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// Short type name for error messages, e.g. "u32", "string", "array of string".
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::U8(_) => "u8".into(),
            GgufValue::I8(_) => "i8".into(),
            GgufValue::U16(_) => "u16".into(),
            GgufValue::I16(_) => "i16".into(),
            GgufValue::U32(_) => "u32".into(),
            GgufValue::I32(_) => "i32".into(),
            GgufValue::U64(_) => "u64".into(),
            GgufValue::I64(_) => "i64".into(),
            GgufValue::F32(_) => "f32".into(),
            GgufValue::F64(_) => "f64".into(),
            GgufValue::Bool(_) => "bool".into(),
            GgufValue::String(_) => "string".into(),
            GgufValue::Array(v) => match v.first() {
                Some(e) => format!("array of {}", e.type_name()),
                None => "empty array".into(),
            },
        }
    }

    /// Any integer type, widened (i128 holds every u64 and i64).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor infos
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: dims[0] (ne[0]) is the fastest-varying dim.
    pub dims: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: usize,
    pub n_elements: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Shape in torch (row-major) order: the GGUF dims reversed.
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

/// Bounds-checked little-endian reader; errors are plain descriptions, the caller adds where.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
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
            return Err(format!(
                "{what} {n} at byte {at} cannot fit in the {} bytes left",
                self.remaining()
            ));
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
                let unit = min_value_size(elem_ty)
                    .ok_or_else(|| format!("unknown array element type {elem_ty}"))?;
                let n = self.count(unit, "array length")?;
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(
                        self.value(elem_ty, depth + 1)
                            .map_err(|e| format!("[{i}]: {e}"))?,
                    );
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
fn min_value_size(ty: u32) -> Option<usize> {
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
fn commas(n: u128) -> String {
    let digits = n.to_string();
    let groups: Vec<&str> = digits
        .as_bytes()
        .rchunks(3)
        .rev()
        .map(|g| std::str::from_utf8(g).expect("ASCII digits"))
        .collect();
    groups.join(",")
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

/// Header, metadata and tensor infos, parsed and validated from the file's bytes.
struct Parsed {
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<TensorInfo>,
}

fn parse(buf: &[u8]) -> Result<Parsed, String> {
    let mut cur = Cursor { buf, pos: 0 };

    // 1. Header.
    let magic = cur.array::<4>().map_err(|e| format!("header: {e}"))?;
    if &magic != MAGIC {
        return Err(format!(
            "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        ));
    }
    let version = cur.u32().map_err(|e| format!("header: {e}"))?;
    if version != 2 && version != 3 {
        // v1 used u32 counts; a byte-swapped (big-endian) file shows up as a huge version.
        return Err(format!(
            "unsupported GGUF version {version} (supported: 2, 3, little-endian)"
        ));
    }
    // Smallest tensor info: name length 8 + n_dims 4 + type 4 + offset 8.
    let n_tensors = cur
        .count(24, "tensor count")
        .map_err(|e| format!("header: {e}"))?;
    // Smallest KV: key length 8 + type 4 + a 1-byte value.
    let n_kv = cur
        .count(13, "metadata count")
        .map_err(|e| format!("header: {e}"))?;

    // 2. Metadata.
    let mut metadata = Vec::with_capacity(n_kv);
    let mut seen = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = cur
            .string()
            .map_err(|e| format!("metadata #{i} key: {e}"))?;
        let value = cur
            .u32()
            .and_then(|ty| cur.value(ty, 0))
            .map_err(|e| format!("metadata key {key}: {e}"))?;
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
        let info =
            read_tensor_info(&mut cur, name.clone()).map_err(|e| format!("tensor {name}: {e}"))?;
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

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

fn read_tensor_info(cur: &mut Cursor, name: String) -> Result<TensorInfo, String> {
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

    let ggml_type =
        GgmlType::from_id(type_id).ok_or_else(|| format!("unknown ggml type id {type_id}"))?;
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
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        n_elements,
        n_bytes,
    })
}

impl GgufFile {
    /// Maps and parses `path`, validating every tensor's data range against the file length.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; as with any mmap, another process truncating or
        // rewriting the file while it is open is outside what this reader can guard against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let p = parse(&mmap).map_err(|what| GgufError::Format {
            path: path.clone(),
            what,
        })?;

        let meta_index = p
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
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
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    fn key_type(&self, key: &str, expected: &'static str, found: String) -> GgufError {
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.into(),
            expected,
            found,
        }
    }

    /// An integer of any GGUF integer type, converted to `T` when the value fits.
    fn meta_int<T: TryFrom<i128>>(
        &self,
        key: &str,
        expected: &'static str,
    ) -> Result<T, GgufError> {
        let v = self.require(key)?;
        match v.as_int() {
            Some(i) => T::try_from(i)
                .map_err(|_| self.key_type(key, expected, format!("{} {i}", v.type_name()))),
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
        v.as_float()
            .map(|f| f as f32)
            .ok_or_else(|| self.key_type(key, "a float", v.type_name()))
    }

    pub fn meta_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(self.key_type(key, "bool", v.type_name())),
        }
    }

    pub fn meta_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str()
            .ok_or_else(|| self.key_type(key, "string", v.type_name()))
    }

    fn meta_array(&self, key: &str, expected: &'static str) -> Result<&[GgufValue], GgufError> {
        let v = self.require(key)?;
        v.as_array()
            .ok_or_else(|| self.key_type(key, expected, v.type_name()))
    }

    pub fn meta_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let expected = "array of string";
        let items = self.meta_array(key, expected)?;
        items
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    self.key_type(key, expected, format!("array of {}", v.type_name()))
                })
            })
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
                v.as_float().map(|f| f as f32).ok_or_else(|| {
                    self.key_type(key, expected, format!("array of {}", v.type_name()))
                })
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
        self.tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor {
                path: self.path.clone(),
                name: name.into(),
            })
    }

    /// The tensor's raw bytes (in range: `open` checked it).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.require_tensor(name)?;
        let start = self.data_offset + t.offset;
        Ok(&self.mmap[start..start + t.n_bytes])
    }

    /// Torch-order shape and values as f32.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), GgufError> {
        let t = self.require_tensor(name)?;
        let ty = t.ggml_type;
        let block_fn = ty.0.dequant.ok_or_else(|| GgufError::UnsupportedType {
            path: self.path.clone(),
            name: name.into(),
            ty: ty.name(),
        })?;
        let data = self.tensor_data(name)?;
        let mut out = vec![0f32; t.n_elements];
        for (block, y) in data
            .chunks_exact(ty.block_bytes())
            .zip(out.chunks_exact_mut(ty.block_elems()))
        {
            block_fn(block, y);
        }
        Ok((t.torch_shape(), out))
    }
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    // --- a tiny GGUF writer (also used by gguf_tokenizer's tests) ---

    pub(crate) enum W {
        U32(u32),
        I32(i32),
        F32(f32),
        Bool(bool),
        Str(&'static str),
        /// (element type id, elements)
        Arr(u32, Vec<W>),
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn type_id(v: &W) -> u32 {
        match v {
            W::U32(_) => 4,
            W::I32(_) => 5,
            W::F32(_) => 6,
            W::Bool(_) => 7,
            W::Str(_) => 8,
            W::Arr(..) => 9,
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &W) {
        match v {
            W::U32(x) => out.extend(x.to_le_bytes()),
            W::I32(x) => out.extend(x.to_le_bytes()),
            W::F32(x) => out.extend(x.to_le_bytes()),
            W::Bool(x) => out.push(*x as u8),
            W::Str(s) => put_str(out, s),
            W::Arr(elem, items) => {
                out.extend(elem.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for it in items {
                    put_value(out, it);
                }
            }
        }
    }

    /// A tensor to write: name, GGUF-order dims, ggml type id, raw data bytes.
    pub(crate) struct WTensor {
        pub name: &'static str,
        pub dims: Vec<u64>,
        pub ty: u32,
        pub data: Vec<u8>,
    }

    /// GGUF v3 bytes with the given KVs and tensors; data padded to `align` (which must match
    /// any `general.alignment` KV passed in).
    pub(crate) fn gguf_bytes(kvs: &[(&str, W)], tensors: &[WTensor], align: usize) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut out, k);
            out.extend(type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        let data_start = out.len().next_multiple_of(align);
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend(&t.data);
        }
        out
    }

    pub(crate) fn write_temp(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn run(ty: u32, block: &[u8]) -> Vec<f32> {
        let t = GgmlType::from_id(ty).unwrap();
        assert_eq!(block.len(), t.block_bytes(), "{} block size", t.name());
        let mut out = vec![f32::NAN; t.block_elems()];
        (t.0.dequant.unwrap())(block, &mut out);
        out
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }

    /// Deterministic small pseudo-random numbers (LCG) for quant values.
    fn lcg(seed: u32) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            s >> 16
        }
    }

    // --- per-type dequantisation of hand-built blocks ---
    // Each test picks scales and quants, packs them per the published block layout, and
    // computes the expected value of each element straight from the format's formula.
    // Scales are powers of two so the float results are exact in any evaluation order.

    #[test]
    fn float_types() {
        assert_eq!(run(0, &(-1.25f32).to_le_bytes()), vec![-1.25]);
        assert_eq!(run(1, &f16_bytes(3.5)), vec![3.5]);
        // bf16 is the top 16 bits of an f32.
        let b = ((-0.375f32).to_bits() >> 16) as u16;
        assert_eq!(run(30, &b.to_le_bytes()), vec![-0.375]);
    }

    #[test]
    fn q8_0() {
        let d = 0.5;
        let q: Vec<i8> = (0..32).map(|i| (i * 8 - 128) as i8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(q.iter().map(|&x| x as u8));
        let want: Vec<f32> = q.iter().map(|&x| x as f32 * d).collect();
        assert_close(&run(8, &block), &want, "q8_0");
    }

    /// 32 4-bit quants packed as Q4_0/Q4_1 do: element j < 16 in the low nibble of byte j,
    /// element j + 16 in its high nibble.
    fn pack_nibbles_32(q: &[u8]) -> Vec<u8> {
        (0..16).map(|j| (q[j] & 0xF) | (q[j + 16] << 4)).collect()
    }

    #[test]
    fn q4_0() {
        let mut r = lcg(1);
        let q: Vec<u8> = (0..32).map(|_| (r() % 16) as u8).collect();
        let d = 0.25;
        let mut block = f16_bytes(d).to_vec();
        block.extend(pack_nibbles_32(&q));
        let want: Vec<f32> = q.iter().map(|&x| (x as f32 - 8.0) * d).collect();
        assert_close(&run(2, &block), &want, "q4_0");
    }

    #[test]
    fn q4_1() {
        let mut r = lcg(2);
        let q: Vec<u8> = (0..32).map(|_| (r() % 16) as u8).collect();
        let (d, m) = (0.125, -1.5);
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(m));
        block.extend(pack_nibbles_32(&q));
        let want: Vec<f32> = q.iter().map(|&x| x as f32 * d + m).collect();
        assert_close(&run(3, &block), &want, "q4_1");
    }

    /// 5-bit quants: low 4 bits packed as Q4_0, bit 4 of element j in bit j of a u32.
    fn pack_q5(q: &[u8]) -> (u32, Vec<u8>) {
        let qh = (0..32).fold(0u32, |acc, j| acc | (((q[j] >> 4) as u32 & 1) << j));
        let lo: Vec<u8> = q.iter().map(|x| x & 0xF).collect();
        (qh, pack_nibbles_32(&lo))
    }

    #[test]
    fn q5_0() {
        let mut r = lcg(3);
        let q: Vec<u8> = (0..32).map(|_| (r() % 32) as u8).collect();
        let d = 0.5;
        let (qh, qs) = pack_q5(&q);
        let mut block = f16_bytes(d).to_vec();
        block.extend(qh.to_le_bytes());
        block.extend(qs);
        let want: Vec<f32> = q.iter().map(|&x| (x as f32 - 16.0) * d).collect();
        assert_close(&run(6, &block), &want, "q5_0");
    }

    #[test]
    fn q5_1() {
        let mut r = lcg(4);
        let q: Vec<u8> = (0..32).map(|_| (r() % 32) as u8).collect();
        let (d, m) = (0.0625, 2.0);
        let (qh, qs) = pack_q5(&q);
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(m));
        block.extend(qh.to_le_bytes());
        block.extend(qs);
        let want: Vec<f32> = q.iter().map(|&x| x as f32 * d + m).collect();
        assert_close(&run(7, &block), &want, "q5_1");
    }

    /// Packs 8 six-bit (scale, min) pairs into the 12 K-quant scale bytes: pairs 0-3 in the
    /// low 6 bits of bytes 0-3 / 4-7; pairs 4-7 with low nibbles in bytes 8-11 (scale low,
    /// min high) and their top 2 bits in the high bits of bytes 0-3 (scale) / 4-7 (min).
    fn pack_k_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        s
    }

    /// 256 4-bit quants as Q4_K/Q5_K lay them out: 64-element chunk c uses qs[32c..32c+32],
    /// its first 32 elements in the low nibbles and the next 32 in the high nibbles.
    fn pack_k_nibbles(q: &[u8]) -> Vec<u8> {
        let mut qs = vec![0u8; 128];
        for (e, &x) in q.iter().enumerate() {
            let (c, l, high) = (e / 64, e % 32, (e % 64) >= 32);
            qs[c * 32 + l] |= if high { (x & 0xF) << 4 } else { x & 0xF };
        }
        qs
    }

    /// Six-bit scales and mins with the top bits set, so the high-bit packing is exercised.
    const K_SC: [u8; 8] = [1, 63, 17, 32, 48, 5, 60, 33];
    const K_MN: [u8; 8] = [0, 7, 63, 40, 16, 62, 3, 50];

    #[test]
    fn q4_k() {
        let mut r = lcg(5);
        let q: Vec<u8> = (0..256).map(|_| (r() % 16) as u8).collect();
        let (d, dmin) = (0.5, 0.25);
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(dmin));
        block.extend(pack_k_scales(&K_SC, &K_MN));
        block.extend(pack_k_nibbles(&q));
        let want: Vec<f32> = (0..256)
            .map(|e| d * K_SC[e / 32] as f32 * q[e] as f32 - dmin * K_MN[e / 32] as f32)
            .collect();
        assert_close(&run(12, &block), &want, "q4_k");
    }

    #[test]
    fn q5_k() {
        let mut r = lcg(6);
        let q: Vec<u8> = (0..256).map(|_| (r() % 32) as u8).collect();
        let (d, dmin) = (0.25, 0.5);
        // Bit 4 of element e (sub-block s = e / 32) lives in bit s of qh[e % 32].
        let mut qh = [0u8; 32];
        for (e, &x) in q.iter().enumerate() {
            qh[e % 32] |= ((x >> 4) & 1) << (e / 32);
        }
        let lo: Vec<u8> = q.iter().map(|x| x & 0xF).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(dmin));
        block.extend(pack_k_scales(&K_SC, &K_MN));
        block.extend(qh);
        block.extend(pack_k_nibbles(&lo));
        let want: Vec<f32> = (0..256)
            .map(|e| d * K_SC[e / 32] as f32 * q[e] as f32 - dmin * K_MN[e / 32] as f32)
            .collect();
        assert_close(&run(13, &block), &want, "q5_k");
    }

    #[test]
    fn q6_k() {
        let mut r = lcg(7);
        let q: Vec<u8> = (0..256).map(|_| (r() % 64) as u8).collect();
        let sc: [i8; 16] = [
            1, -2, 3, -4, 127, -128, 7, 8, -9, 10, 11, -12, 13, 14, -15, 16,
        ];
        let d = 0.125;
        // Element e: half h = e / 128; within it quarter k = (e % 128) / 32 and l = e % 32.
        // Low 4 bits: ql[64h + l + 32 (k odd)], low nibble for k < 2, high for k >= 2.
        // High 2 bits: qh[32h + l] bits 2k..2k+2. Scale: sc[e / 16].
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for (e, &x) in q.iter().enumerate() {
            let (h, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let i = 64 * h + l + if k % 2 == 1 { 32 } else { 0 };
            ql[i] |= if k < 2 { x & 0xF } else { (x & 0xF) << 4 };
            qh[32 * h + l] |= (x >> 4) << (2 * k);
        }
        let mut block = ql.to_vec();
        block.extend(qh);
        block.extend(sc.iter().map(|&s| s as u8));
        block.extend(f16_bytes(d));
        let want: Vec<f32> = (0..256)
            .map(|e| d * sc[e / 16] as f32 * (q[e] as f32 - 32.0))
            .collect();
        assert_close(&run(14, &block), &want, "q6_k");
    }

    #[test]
    fn type_table_is_consistent() {
        for (i, t) in GGML_TYPES.iter().enumerate() {
            assert!(
                GGML_TYPES[i + 1..]
                    .iter()
                    .all(|u| u.id != t.id && u.name != t.name),
                "{}",
                t.name
            );
            assert!(t.block_bytes > 0 && t.block_elems > 0);
        }
        assert_eq!(
            supported_names(),
            "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16"
        );
    }

    // --- a small file written here ---

    fn small_file() -> Vec<u8> {
        let a: Vec<u8> = [1.0f32, -2.0, 3.5, 0.0, 0.25, -8.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        // Q8_0, two blocks (dims [32, 2]): d = 0.5 and d = 2, quants -16..16 / 15..-17.
        let mut b = Vec::new();
        for (d, first) in [(0.5f32, -16i32), (2.0, 15)] {
            b.extend(f16_bytes(d));
            let step = if first < 0 { 1 } else { -1 };
            b.extend((0..32).map(|i| (first + step * i) as i8 as u8));
        }
        gguf_bytes(
            &[
                ("general.architecture", W::Str("llama")),
                ("general.alignment", W::U32(64)),
                ("llama.block_count", W::U32(30)),
                ("llama.rope.freq_base", W::F32(100000.0)),
                ("neg", W::I32(-3)),
                ("flag", W::Bool(true)),
                ("names", W::Arr(8, vec![W::Str("a"), W::Str("bé")])),
                (
                    "nested",
                    W::Arr(
                        9,
                        vec![W::Arr(5, vec![W::I32(1), W::I32(-2)]), W::Arr(5, vec![])],
                    ),
                ),
            ],
            &[
                WTensor {
                    name: "a",
                    dims: vec![3, 2],
                    ty: 0,
                    data: a,
                },
                WTensor {
                    name: "b",
                    dims: vec![32, 2],
                    ty: 8,
                    data: b,
                },
            ],
            64,
        )
    }

    #[test]
    fn small_file_parses() {
        let dir = tempfile::tempdir().unwrap();
        let p = write_temp(&dir, "small.gguf", &small_file());
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        assert_eq!(g.meta_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.meta_u32("llama.block_count").unwrap(), 30);
        assert_eq!(g.meta_u64("llama.block_count").unwrap(), 30);
        assert_eq!(g.meta_usize("general.alignment").unwrap(), 64);
        assert_eq!(g.meta_i64("neg").unwrap(), -3);
        assert_eq!(g.meta_f32("llama.rope.freq_base").unwrap(), 1e5);
        assert!(g.meta_bool("flag").unwrap());
        assert_eq!(g.meta_str_array("names").unwrap(), vec!["a", "bé"]);
        let nested = g.get("nested").unwrap().as_array().unwrap();
        assert_eq!(
            nested[0],
            GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2)])
        );
        assert_eq!(nested[1], GgufValue::Array(vec![]));
        assert_eq!(g.metadata().count(), 8);

        // Errors name the file and the key.
        let e = g.meta_u32("neg").unwrap_err().to_string();
        assert!(
            e.contains("small.gguf") && e.contains("neg") && e.contains("i32 -3"),
            "{e}"
        );
        let e = g.meta_str("llama.block_count").unwrap_err().to_string();
        assert!(
            e.contains("llama.block_count") && e.contains("expected string, found u32"),
            "{e}"
        );
        let e = g.meta_u32("nope").unwrap_err().to_string();
        assert!(
            e.contains("small.gguf") && e.contains("nope: missing"),
            "{e}"
        );
        assert!(g.meta_i32_array("names").is_err());

        assert_eq!(g.tensor_names().collect::<Vec<_>>(), vec!["a", "b"]);
        let ta = g.tensor_info("a").unwrap();
        assert_eq!(
            (ta.ggml_type, ta.n_elements, ta.n_bytes),
            (GgmlType::from_id(0).unwrap(), 6, 24)
        );
        let (shape, v) = g.dequantize("a").unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(v, vec![1.0, -2.0, 3.5, 0.0, 0.25, -8.0]);
        let (shape, v) = g.dequantize("b").unwrap();
        assert_eq!(shape, vec![2, 32]);
        let want: Vec<f32> = (0..32)
            .map(|i| (i - 16) as f32 * 0.5)
            .chain((0..32).map(|i| (15 - i) as f32 * 2.0))
            .collect();
        assert_eq!(v, want);
        assert_eq!(g.tensor_data("b").unwrap().len(), 68);
        let e = g.dequantize("c").unwrap_err().to_string();
        assert!(e.contains("no tensor named c"), "{e}");
    }

    #[test]
    fn truncation_never_panics() {
        let bytes = small_file();
        let dir = tempfile::tempdir().unwrap();
        for cut in 0..bytes.len() {
            let p = write_temp(&dir, "cut.gguf", &bytes[..cut]);
            match GgufFile::open(&p) {
                Ok(_) => panic!("a file cut to {cut} of {} bytes opened", bytes.len()),
                Err(e) => assert!(e.to_string().contains("cut.gguf"), "{e}"),
            }
        }
    }

    #[test]
    fn truncated_tensor_data_is_named() {
        let bytes = small_file();
        let dir = tempfile::tempdir().unwrap();
        let p = write_temp(&dir, "short.gguf", &bytes[..bytes.len() - 1]);
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(
            e.contains("short.gguf")
                && e.contains("tensor b: data [")
                && e.contains("beyond end of file"),
            "{e}"
        );
    }

    /// Header + one KV whose value bytes are given raw.
    fn one_kv(ty: u32, value: &[u8]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend(1u64.to_le_bytes());
        put_str(&mut out, "k");
        out.extend(ty.to_le_bytes());
        out.extend(value);
        out
    }

    #[test]
    fn hostile_fields_give_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = |name: &str, bytes: Vec<u8>| {
            let p = write_temp(&dir, name, &bytes);
            GgufFile::open(&p).unwrap_err().to_string()
        };
        let mut huge_str = u64::MAX.to_le_bytes().to_vec();
        huge_str.extend(b"xyz");
        assert!(err("s.gguf", one_kv(8, &huge_str)).contains("string length"));
        // An array claiming 2^60 u64 elements must not be allocated.
        let mut huge_arr = 10u32.to_le_bytes().to_vec();
        huge_arr.extend((1u64 << 60).to_le_bytes());
        assert!(err("a.gguf", one_kv(9, &huge_arr)).contains("array length"));
        // Arrays nested past the limit.
        let mut deep = Vec::new();
        for _ in 0..10 {
            deep.extend(9u32.to_le_bytes());
            deep.extend(1u64.to_le_bytes());
        }
        assert!(err("d.gguf", one_kv(9, &deep)).contains("nested"));
        assert!(err("t.gguf", one_kv(13, &[0; 8])).contains("unknown value type 13"));
        assert!(err("b.gguf", one_kv(7, &[2])).contains("not 0 or 1"));
        let mut bad_utf8 = 2u64.to_le_bytes().to_vec();
        bad_utf8.extend([0xff, 0xfe]);
        assert!(err("u.gguf", one_kv(8, &bad_utf8)).contains("metadata key k"));

        let mut v1 = small_file();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(err("v1.gguf", v1).contains("unsupported GGUF version 1"));
        assert!(err("m.gguf", b"GGML\x03\0\0\0".to_vec()).contains("not a GGUF file"));
        let mut counts = small_file();
        counts[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err("c.gguf", counts).contains("tensor count"));

        // Tensor-level problems name the tensor.
        let t = |dims: Vec<u64>, ty: u32| {
            gguf_bytes(
                &[],
                &[WTensor {
                    name: "blk.0.w",
                    dims,
                    ty,
                    data: vec![0; 68],
                }],
                32,
            )
        };
        let e = err("ty.gguf", t(vec![32, 2], 4));
        assert!(
            e.contains("tensor blk.0.w") && e.contains("unknown ggml type id 4"),
            "{e}"
        );
        let e = err("blk.gguf", t(vec![16, 2], 8));
        assert!(
            e.contains("tensor blk.0.w") && e.contains("not a multiple of the Q8_0 block size 32"),
            "{e}"
        );
        let e = err("dims.gguf", t(vec![1, 1, 1, 1, 1], 0));
        assert!(e.contains("5 dims"), "{e}");
        let e = err("ovf.gguf", t(vec![1 << 40, 1 << 40], 0));
        assert!(e.contains("overflows"), "{e}");
        let e = err("big.gguf", t(vec![32, 1 << 20], 8));
        assert!(
            e.contains("tensor blk.0.w: data [") && e.contains("beyond end of file"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_type_names_tensor_and_type() {
        let dir = tempfile::tempdir().unwrap();
        // Q2_K, one block of zeros.
        let bytes = gguf_bytes(
            &[],
            &[WTensor {
                name: "w",
                dims: vec![256],
                ty: 10,
                data: vec![0; 84],
            }],
            32,
        );
        let g = GgufFile::open(write_temp(&dir, "q2k.gguf", &bytes)).unwrap();
        let e = g.dequantize("w").unwrap_err().to_string();
        assert!(
            e.contains("q2k.gguf") && e.contains("tensor w") && e.contains("Q2_K"),
            "{e}"
        );
    }

    #[test]
    fn commas_format() {
        assert_eq!(commas(0), "0");
        assert_eq!(commas(999), "999");
        assert_eq!(commas(93_000_000), "93,000,000");
        assert_eq!(commas(1_234), "1,234");
    }

    // --- the real model ---

    /// `$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf` (DFLASH_CACHE defaults to
    /// `$HOME/.cache/dflash`); fails, not skips, when missing.
    pub(crate) fn smollm_path() -> PathBuf {
        let cache = std::env::var_os("DFLASH_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").expect("HOME is not set"))
                    .join(".cache/dflash")
            });
        let p = cache.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(p.exists(), "{} is missing: run `make setup`", p.display());
        p
    }

    #[test]
    fn smollm_metadata_and_embedding() {
        let g = GgufFile::open(smollm_path()).unwrap();
        assert_eq!(g.meta_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.meta_u32("llama.block_count").unwrap(), 30);
        assert_eq!(g.meta_u32("llama.embedding_length").unwrap(), 576);
        assert_eq!(g.meta_u32("llama.attention.head_count").unwrap(), 9);
        assert_eq!(g.meta_u32("llama.attention.head_count_kv").unwrap(), 3);
        assert_eq!(g.meta_u32("llama.feed_forward_length").unwrap(), 1536);
        assert_eq!(g.meta_f32("llama.rope.freq_base").unwrap(), 1e5);
        assert_eq!(
            g.meta_str_array("tokenizer.ggml.tokens").unwrap().len(),
            49152
        );

        let t = g.tensor_info("token_embd.weight").unwrap();
        assert_eq!(t.ggml_type.name(), "Q8_0");
        assert_eq!(t.torch_shape(), vec![49152, 576]);
        let (shape, v) = g.dequantize("token_embd.weight").unwrap();
        assert_eq!(shape, vec![49152, 576]);
        assert!(v.iter().all(|x| x.is_finite()));
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(
            mean.abs() < 0.05 && (0.01..1.0).contains(&std),
            "mean {mean}, std {std}"
        );

        // Every tensor dequantises (Q4_1 and F32 besides Q8_0) to finite values.
        for name in g.tensor_names() {
            let (shape, v) = g.dequantize(name).unwrap();
            assert_eq!(shape.iter().product::<usize>(), v.len(), "{name}");
            assert!(v.iter().all(|x| x.is_finite()), "{name}");
        }
    }
}
