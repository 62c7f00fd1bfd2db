//! The reader's tests, on files written by test_support's GGUF writer.

use super::parse::*;
use super::types::*;
use super::*;
use half::f16;

// The GGUF writer (also used by gguf_tokenizer's and config's tests) is test_support's.
pub(crate) use test_support::gguf::{gguf_bytes, write_temp, WTensor, V as W};

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
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{what}[{i}]: got {g}, want {w}");
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
    let want: Vec<f32> = (0..256).map(|e| d * K_SC[e / 32] as f32 * q[e] as f32 - dmin * K_MN[e / 32] as f32).collect();
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
    let want: Vec<f32> = (0..256).map(|e| d * K_SC[e / 32] as f32 * q[e] as f32 - dmin * K_MN[e / 32] as f32).collect();
    assert_close(&run(13, &block), &want, "q5_k");
}

#[test]
fn q6_k() {
    let mut r = lcg(7);
    let q: Vec<u8> = (0..256).map(|_| (r() % 64) as u8).collect();
    let sc: [i8; 16] = [1, -2, 3, -4, 127, -128, 7, 8, -9, 10, 11, -12, 13, 14, -15, 16];
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
    let want: Vec<f32> = (0..256).map(|e| d * sc[e / 16] as f32 * (q[e] as f32 - 32.0)).collect();
    assert_close(&run(14, &block), &want, "q6_k");
}

#[test]
fn type_table_is_consistent() {
    for (i, t) in GGML_TYPES.iter().enumerate() {
        assert!(GGML_TYPES[i + 1..].iter().all(|u| u.id != t.id && u.name != t.name), "{}", t.name);
        assert!(t.block_bytes > 0 && t.block_elems > 0);
    }
    assert_eq!(supported_names(), "F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16");
}

// --- a small file written here ---

fn small_file() -> Vec<u8> {
    let a: Vec<u8> = [1.0f32, -2.0, 3.5, 0.0, 0.25, -8.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    // Q8_0, two blocks (dims [32, 2]): d = 0.5 and d = 2, quants -16..16 / 15..-17.
    let mut b = Vec::new();
    for (d, first) in [(0.5f32, -16i32), (2.0, 15)] {
        b.extend(f16_bytes(d));
        let step = if first < 0 { 1 } else { -1 };
        b.extend((0..32).map(|i| (first + step * i) as i8 as u8));
    }
    gguf_bytes(
        &[
            ("general.architecture", W::str("llama")),
            ("general.alignment", W::U32(64)),
            ("llama.block_count", W::U32(30)),
            ("llama.rope.freq_base", W::F32(100000.0)),
            ("neg", W::I32(-3)),
            ("flag", W::Bool(true)),
            ("names", W::Arr(8, vec![W::str("a"), W::str("bé")])),
            ("nested", W::Arr(9, vec![W::Arr(5, vec![W::I32(1), W::I32(-2)]), W::Arr(5, vec![])])),
        ],
        &[
            WTensor { name: "a", dims: vec![3, 2], ty: 0, data: a },
            WTensor { name: "b", dims: vec![32, 2], ty: 8, data: b },
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
    assert_eq!(nested[0], GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2)]));
    assert_eq!(nested[1], GgufValue::Array(vec![]));
    assert_eq!(g.metadata().count(), 8);

    // Errors name the file and the key.
    let e = g.meta_u32("neg").unwrap_err().to_string();
    assert!(e.contains("small.gguf") && e.contains("neg") && e.contains("i32 -3"), "{e}");
    let e = g.meta_str("llama.block_count").unwrap_err().to_string();
    assert!(e.contains("llama.block_count") && e.contains("expected string, found u32"), "{e}");
    let e = g.meta_u32("nope").unwrap_err().to_string();
    assert!(e.contains("small.gguf") && e.contains("nope: missing"), "{e}");
    assert!(g.meta_i32_array("names").is_err());

    assert_eq!(g.tensor_names().collect::<Vec<_>>(), vec!["a", "b"]);
    let ta = g.tensor_info("a").unwrap();
    assert_eq!((ta.ggml_type, ta.n_elements, ta.n_bytes), (GgmlType::from_id(0).unwrap(), 6, 24));
    let (shape, v) = g.dequantize("a").unwrap();
    assert_eq!(shape, vec![2, 3]);
    assert_eq!(v, vec![1.0, -2.0, 3.5, 0.0, 0.25, -8.0]);
    let (shape, v) = g.dequantize("b").unwrap();
    assert_eq!(shape, vec![2, 32]);
    let want: Vec<f32> = (0..32).map(|i| (i - 16) as f32 * 0.5).chain((0..32).map(|i| (15 - i) as f32 * 2.0)).collect();
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
    assert!(e.contains("short.gguf") && e.contains("tensor b: data [") && e.contains("beyond end of file"), "{e}");
}

/// Header + one KV whose value bytes are given raw.
fn one_kv(ty: u32, value: &[u8]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend(1u64.to_le_bytes());
    out.extend(1u64.to_le_bytes()); // the key "k": length, bytes
    out.extend(b"k");
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
    let t = |dims: Vec<u64>, ty: u32| gguf_bytes(&[], &[WTensor { name: "blk.0.w", dims, ty, data: vec![0; 68] }], 32);
    let e = err("ty.gguf", t(vec![32, 2], 4));
    assert!(e.contains("tensor blk.0.w") && e.contains("unknown ggml type id 4"), "{e}");
    let e = err("blk.gguf", t(vec![16, 2], 8));
    assert!(e.contains("tensor blk.0.w") && e.contains("not a multiple of the Q8_0 block size 32"), "{e}");
    let e = err("dims.gguf", t(vec![1, 1, 1, 1, 1], 0));
    assert!(e.contains("5 dims"), "{e}");
    let e = err("ovf.gguf", t(vec![1 << 40, 1 << 40], 0));
    assert!(e.contains("overflows"), "{e}");
    let e = err("big.gguf", t(vec![32, 1 << 20], 8));
    assert!(e.contains("tensor blk.0.w: data [") && e.contains("beyond end of file"), "{e}");
}

#[test]
fn unsupported_type_names_tensor_and_type() {
    let dir = tempfile::tempdir().unwrap();
    // Q2_K, one block of zeros.
    let bytes = gguf_bytes(&[], &[WTensor { name: "w", dims: vec![256], ty: 10, data: vec![0; 84] }], 32);
    let g = GgufFile::open(write_temp(&dir, "q2k.gguf", &bytes)).unwrap();
    let e = g.dequantize("w").unwrap_err().to_string();
    assert!(e.contains("q2k.gguf") && e.contains("tensor w") && e.contains("Q2_K"), "{e}");
}

/// Bytes from the LCG, masked so that every f16 scale they make is finite.
fn finite_bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut next = lcg(seed);
    (0..n).map(|_| next() as u8 & 0x3b).collect()
}

/// A selection dequantises only its rows and the blocks its columns touch, and equals the whole
/// tensor dequantised and then sliced: columns that cut inside Q4_0's 32-wide and Q4_K's 256-wide
/// blocks, several ranges a dimension, a 3-dim tensor, rows read through a permutation.
#[test]
#[allow(clippy::single_range_in_vec_init)] // selections: one range a dimension
fn a_selection_equals_the_whole_tensor_sliced() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = gguf_bytes(
        &[],
        &[
            // 6 rows of 64 (2 blocks a row), 2 rows of 512 (2 blocks), 2 x 3 rows of 4.
            WTensor { name: "q4_0", dims: vec![64, 6], ty: 2, data: finite_bytes(12 * 18, 1) },
            WTensor { name: "q4_k", dims: vec![512, 2], ty: 12, data: finite_bytes(4 * 144, 2) },
            WTensor { name: "f16", dims: vec![4, 3, 2], ty: 1, data: finite_bytes(24 * 2, 3) },
        ],
        32,
    );
    let g = GgufFile::open(write_temp(&dir, "sel.gguf", &bytes)).unwrap();
    let tensor = |(shape, v): (Vec<usize>, Vec<f32>)| {
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        plugin_api::tch::Tensor::from_slice(&v).reshape(&shape)
    };
    let cases: [(&str, Vec<Vec<std::ops::Range<i64>>>); 6] = [
        ("q4_0", vec![vec![2..5]]),
        ("q4_0", vec![vec![], vec![16..48]]),
        ("q4_0", vec![vec![0..1, 4..6], vec![0..8, 40..64]]),
        ("q4_k", vec![vec![1..2], vec![100..300]]),
        ("f16", vec![vec![1..2], vec![], vec![1..3]]),
        ("f16", vec![vec![], vec![0..1, 2..3]]),
    ];
    for (name, sel) in cases {
        let whole = tensor(g.dequantize(name).unwrap());
        assert_eq!(whole.isfinite().all().int64_value(&[]), 1, "{name}");
        let got = tensor(g.dequantize_selected(name, &sel, &|r| r).unwrap());
        assert!(got.equal(&crate::tp::select(&whole, &sel)), "{name} {sel:?}");
    }
    // Rows read through a map: the file's rows in reverse.
    let whole = tensor(g.dequantize("q4_0").unwrap());
    let got = tensor(g.dequantize_selected("q4_0", &[vec![1..4]], &|r| 5 - r).unwrap());
    assert!(got.equal(&whole.flip([0]).narrow(0, 1, 3)));
    // Out of range, and a map that leaves the tensor: errors naming the file and the tensor.
    let e = g.dequantize_selected("q4_0", &[vec![], vec![60..70]], &|r| r).unwrap_err().to_string();
    assert!(e.contains("sel.gguf") && e.contains("tensor q4_0: rows 60..70 of dimension 1 (size 64)"), "{e}");
    let e = g.dequantize_selected("q4_0", &[], &|r| r + 1).unwrap_err().to_string();
    assert!(e.contains("tensor q4_0: row 5 is read from row 6 of 6"), "{e}");
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
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache/dflash"));
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
    assert_eq!(g.meta_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);

    let t = g.tensor_info("token_embd.weight").unwrap();
    assert_eq!(t.ggml_type.name(), "Q8_0");
    assert_eq!(t.torch_shape(), vec![49152, 576]);
    let (shape, v) = g.dequantize("token_embd.weight").unwrap();
    assert_eq!(shape, vec![49152, 576]);
    assert!(v.iter().all(|x| x.is_finite()));
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(mean.abs() < 0.05 && (0.01..1.0).contains(&std), "mean {mean}, std {std}");

    // Every tensor dequantises (Q4_1 and F32 besides Q8_0) to finite values.
    for name in g.tensor_names() {
        let (shape, v) = g.dequantize(name).unwrap();
        assert_eq!(shape.iter().product::<usize>(), v.len(), "{name}");
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
    }
}
