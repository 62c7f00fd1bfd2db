//! What a GGUF header holds: metadata values and tensor infos, as the parser reads them and the
//! file hands them out.

use super::types::GgmlType;

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
