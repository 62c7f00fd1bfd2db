//! Per-block dequantisers: llama.cpp's dequantize_row_* for one block, same arithmetic order
//! (as candle keeps k_quants.rs apart from gguf_file.rs).

use half::{bf16, f16};

pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

pub(super) fn dequant_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

pub(super) fn dequant_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

pub(super) fn dequant_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// Q4_0: d f16, qs[16]; element j is the low nibble of qs[j], element j+16 the high nibble;
/// x = (q - 8) * d.
pub(super) fn dequant_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        out[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: d f16, m f16, qs[16]; x = q * d + m.
pub(super) fn dequant_q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        out[j] = (qs[j] & 0xF) as f32 * d + m;
        out[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Q5_0: d f16, qh u32 (bit i = 5th bit of element i), qs[16] as in Q4_0; x = (q - 16) * d.
pub(super) fn dequant_q5_0(b: &[u8], out: &mut [f32]) {
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
pub(super) fn dequant_q5_1(b: &[u8], out: &mut [f32]) {
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
pub(super) fn dequant_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = (q as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block j (0..8) from the 12 packed bytes of Q4_K / Q5_K:
/// sub-blocks 0-3 sit in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7
/// keep their low 4 bits in bytes 8-11 and their top 2 bits in the spare high bits of 0-7.
pub(super) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// Q4_K: d f16, dmin f16, scales[12], qs[128]; 8 sub-blocks of 32. Each 64 elements share 32
/// bytes of qs: the low nibbles are the first sub-block, the high nibbles the second.
/// x = d * scale * q - dmin * min.
pub(super) fn dequant_q4_k(b: &[u8], out: &mut [f32]) {
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
pub(super) fn dequant_q5_k(b: &[u8], out: &mut [f32]) {
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
pub(super) fn dequant_q6_k(b: &[u8], out: &mut [f32]) {
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
