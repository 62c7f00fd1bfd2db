//! ggml tensor types: ids, names, block sizes, and each one's dequantiser.

use super::dequant::*;

/// Dequantises one block: `block.len()` = block bytes, `out.len()` = block elements.
pub(super) type BlockFn = fn(&[u8], &mut [f32]);

pub(super) struct TypeInfo {
    pub(super) id: u32,
    pub(super) name: &'static str,
    pub(super) block_bytes: usize,
    pub(super) block_elems: usize,
    pub(super) dequant: Option<BlockFn>,
}

pub(super) const QK_K: usize = 256;

/// Every ggml type id in use (ids 4, 5, 31-33, 36-38 were removed from ggml). Sizes are
/// ggml's `sizeof(block_*)`; they let `open` bounds-check tensors we cannot dequantise too.
#[rustfmt::skip]
pub(super) static GGML_TYPES: &[TypeInfo] = &[
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

pub(super) fn supported_names() -> String {
    let names: Vec<&str> = GGML_TYPES.iter().filter(|t| t.dequant.is_some()).map(|t| t.name).collect();
    names.join(", ")
}

/// A ggml tensor type known to this reader (only ids in `GGML_TYPES` can be constructed).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct GgmlType(pub(super) &'static TypeInfo);

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
