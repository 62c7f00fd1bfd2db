//! Hostile GGUF files through the whole loader (header, metadata, tensor infos, dequantisation,
//! config, tokenizer, decoder): each bad file gives one error naming the file (and the tensor
//! where one is at fault), never a panic, never an allocation out of proportion to the file.
//! The fuzz test mutates a tiny but complete Llama GGUF written here.

use plugin_api::tch::{Device, Kind};
use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    path::Path,
};
use target_hf::{
    config::DecoderConfig,
    gguf::GgufFile,
    gguf_tokenizer::{tokenizer_from_gguf, SpecialIds},
    load::load_gguf,
    model::Decoder,
};
use test_support::gguf::{write_temp as write, Gguf, WTensor as T, V};

// ---------------------------------------------------------------------------------------------
// An allocator that refuses to let a parse allocate out of proportion to its input
// ---------------------------------------------------------------------------------------------

/// While armed on a thread, no single allocation there may exceed the cap: a bigger request
/// means a length or count from the file was trusted. Over the cap the process stops with a
/// message (an allocator must not unwind), naming the file the input was written to.
struct CappedAlloc;

thread_local! {
    static CAP: Cell<usize> = const { Cell::new(usize::MAX) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let over = CAP
        .try_with(|cap| {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
            size > cap.get()
        })
        .unwrap_or(false);
    if over {
        // Formatting would allocate: write the digits into a stack buffer.
        let (mut digits, mut i, mut n) = ([0u8; 20], 20, size);
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        use std::io::Write;
        let mut err = std::io::stderr();
        let _ = err.write_all(b"hostile_gguf: an allocation of ");
        let _ = err.write_all(&digits[i..]);
        let _ = err.write_all(b" bytes, out of proportion to the GGUF being loaded (the fuzz test leaves its input as fuzz.gguf in its temp folder)\n");
        std::process::abort();
    }
}

unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// Run `f` with allocations on this thread capped at `cap` bytes; returns the largest one.
fn capped<R>(cap: usize, f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.with(|l| l.set(0));
    CAP.with(|c| c.set(cap));
    let r = f();
    CAP.with(|c| c.set(usize::MAX));
    (r, LARGEST.with(Cell::get))
}

const ALIGN: usize = 32;

fn gguf(kvs: &[(&str, V)], tensors: &[T]) -> Gguf {
    test_support::gguf::gguf(kvs, tensors, ALIGN)
}

/// Deterministic bytes (LCG), masked so that no f32 / f16 / bf16 pattern is Inf or NaN.
fn data(n: usize, seed: u32) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 24) as u8 & 0x3b // keeps f16/bf16/f32 bit patterns finite
        })
        .collect()
}

/// A complete Llama: 1 layer, hidden 32, 2 heads of 16 (1 KV head), MLP 32, 8 tokens; its
/// tensors use every dequantisable type whose block fits a row of 32 (F32, F16, BF16, Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0), plus `rope_freqs`, which the loader skips.
fn tiny_llama() -> Gguf {
    let s = |x: &str| V::Str(x.to_string());
    let toks = ["<|end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab"];
    let kvs = [
        ("general.architecture", s("llama")),
        ("general.alignment", V::U32(ALIGN as u32)),
        ("general.file_type", V::U32(3)),
        ("general.quantized", V::Bool(true)),
        ("general.size", V::U64(1 << 20)),
        ("general.offset", V::I64(-1)),
        ("general.ratio", V::F64(0.5)),
        ("general.small", V::U8(7)),
        ("general.short", V::I16(-7)),
        ("llama.block_count", V::U32(1)),
        ("llama.context_length", V::U32(128)),
        ("llama.embedding_length", V::U32(32)),
        ("llama.feed_forward_length", V::U32(32)),
        ("llama.attention.head_count", V::U32(2)),
        ("llama.attention.head_count_kv", V::U32(1)),
        ("llama.rope.freq_base", V::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("smollm")),
        ("tokenizer.ggml.tokens", V::Arr(8, toks.iter().map(|t| s(t)).collect())),
        ("tokenizer.ggml.token_type", V::Arr(5, [3, 1, 1, 1, 1, 1, 1, 1].iter().map(|&t| V::I32(t)).collect())),
        ("tokenizer.ggml.merges", V::Arr(8, vec![s("a b"), s("Ġ ab")])),
        ("tokenizer.ggml.bos_token_id", V::U32(0)),
        ("tokenizer.ggml.eos_token_id", V::U32(0)),
        ("tokenizer.chat_template", s("{{ messages }}")),
        ("nested", V::Arr(9, vec![V::Arr(5, vec![V::I32(1)]), V::Arr(8, vec![s("x")])])),
    ];
    // Quantised data: blocks x bytes per block.
    let q = |blocks: usize, bytes: usize| blocks * bytes;
    let tensors = vec![
        T { name: "token_embd.weight", dims: vec![32, 8], ty: 8, data: data(q(8, 34), 1) },
        T { name: "output_norm.weight", dims: vec![32], ty: 0, data: data(128, 2) },
        T { name: "rope_freqs.weight", dims: vec![8], ty: 0, data: data(32, 3) },
        T { name: "blk.0.attn_norm.weight", dims: vec![32], ty: 0, data: data(128, 4) },
        T { name: "blk.0.ffn_norm.weight", dims: vec![32], ty: 1, data: data(64, 5) },
        T { name: "blk.0.attn_q.weight", dims: vec![32, 32], ty: 2, data: data(q(32, 18), 6) },
        T { name: "blk.0.attn_k.weight", dims: vec![32, 16], ty: 3, data: data(q(16, 20), 7) },
        T { name: "blk.0.attn_v.weight", dims: vec![32, 16], ty: 6, data: data(q(16, 22), 8) },
        T { name: "blk.0.attn_output.weight", dims: vec![32, 32], ty: 7, data: data(q(32, 24), 9) },
        T { name: "blk.0.ffn_gate.weight", dims: vec![32, 32], ty: 30, data: data(2048, 10) },
        T { name: "blk.0.ffn_up.weight", dims: vec![32, 32], ty: 1, data: data(2048, 11) },
        T { name: "blk.0.ffn_down.weight", dims: vec![32, 32], ty: 8, data: data(q(32, 34), 12) },
    ];
    gguf(&kvs, &tensors)
}

/// Everything the target plugin does with a GGUF: open, dequantise each tensor, read the config
/// and tokenizer, then the loader end to end and the decoder over its weights. `Ok` if all of
/// it worked; otherwise the first error, which must name the file.
fn load_everything(path: &Path) -> Result<(), String> {
    let name = path.file_name().unwrap().to_str().unwrap();
    let named = |e: String| if e.contains(name) { Ok(e) } else { Err(format!("error does not name {name}: {e}")) };
    let mut first: Option<String> = None;
    let mut fail = |e: String| -> Result<(), String> {
        let e = named(e)?;
        first.get_or_insert(e);
        Ok(())
    };
    match GgufFile::open(path) {
        Ok(g) => {
            for t in g.tensors() {
                if let Err(e) = g.dequantize(&t.name) {
                    fail(e.to_string())?;
                }
            }
            match DecoderConfig::from_gguf(&g) {
                Ok(cfg) => {
                    let _ = cfg.validate();
                }
                Err(e) => fail(e.to_string())?,
            }
            if let Err(e) = tokenizer_from_gguf(&g) {
                fail(e.to_string())?;
            }
            if let Err(e) = SpecialIds::from_gguf(&g) {
                fail(e.to_string())?;
            }
        }
        Err(e) => fail(e.to_string())?,
    }
    match load_gguf(path) {
        Ok(l) => {
            if let Err(e) = Decoder::new(&l.cfg, l.weights, Device::Cpu, Kind::Float) {
                fail(e)?;
            }
        }
        Err(e) => fail(e)?,
    }
    match first {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// What one loader error says, for the assertions below.
fn load_error(path: &Path) -> String {
    match load_gguf(path) {
        Ok(l) => match Decoder::new(&l.cfg, l.weights, Device::Cpu, Kind::Float) {
            Ok(_) => panic!("{} loaded", path.display()),
            Err(e) => e,
        },
        Err(e) => e,
    }
}

fn set(bytes: &mut [u8], at: usize, value: &[u8]) {
    bytes[at..at + value.len()].copy_from_slice(value);
}

// ---------------------------------------------------------------------------------------------
// Named cases
// ---------------------------------------------------------------------------------------------

#[test]
fn the_tiny_llama_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(&dir, "tiny.gguf", &tiny_llama().bytes);
    load_everything(&p).unwrap();
    let l = load_gguf(&p).unwrap();
    let model = Decoder::new(&l.cfg, l.weights, Device::Cpu, Kind::Float).unwrap();
    let out = target_hf::generate::greedy(&model, &[vec![1, 2, 3]], 4, &[], 1);
    assert_eq!(out[0].len(), 4);
    assert_eq!(l.tokenizer.encode("ab ab", false).unwrap().get_ids(), &[6, 7]);
}

#[test]
fn truncation_in_header_infos_or_data_names_the_file_and_tensor() {
    let g = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    // In the fixed header, in the metadata, in the second tensor's info, in the last tensor's data.
    let in_info = g.infos_at[1] + 8 + "output_norm.weight".len() + 6;
    let cases = [
        (6, "header: unexpected end of file"),
        (value_at(&g.bytes, "nested", 9) + 14, "metadata key nested: array length 2 at byte"),
        (in_info, "tensor output_norm.weight: unexpected end of file"),
        (g.bytes.len() - 1, "tensor blk.0.ffn_down.weight: data ["),
    ];
    for (cut, want) in cases {
        let p = write(&dir, "cut.gguf", &g.bytes[..cut]);
        let e = load_error(&p);
        assert!(e.starts_with(&format!("{}: ", p.display())) && e.contains(want), "cut at {cut}: {e}\nwant {want}");
    }
    // Every cut fails the same way, naming the file.
    for cut in (0..g.bytes.len()).step_by(7) {
        let p = write(&dir, "cut.gguf", &g.bytes[..cut]);
        assert!(load_everything(&p).is_err(), "a file cut to {cut} bytes loaded");
    }
}

#[test]
fn a_patched_quant_type_names_the_tensor_and_the_type() {
    let g = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    let (name, at) = g.type_ids.iter().find(|(n, _)| *n == "blk.0.attn_norm.weight").copied().unwrap();
    // I8 (24): a real ggml type, 1 byte an element, that the reader cannot dequantise.
    let mut bytes = g.bytes.clone();
    set(&mut bytes, at, &24u32.to_le_bytes());
    let p = write(&dir, "i8.gguf", &bytes);
    let e = load_error(&p);
    assert!(e.contains("i8.gguf") && e.contains(&format!("tensor {name}: cannot dequantise ggml type I8")), "{e}");
    // 99: no such type.
    set(&mut bytes, at, &99u32.to_le_bytes());
    let p = write(&dir, "t99.gguf", &bytes);
    let e = load_error(&p);
    assert!(e.contains("t99.gguf") && e.contains(&format!("tensor {name}: unknown ggml type id 99")), "{e}");
    // Q4_K (12) on a row of 32: its blocks are 256 wide.
    set(&mut bytes, at, &12u32.to_le_bytes());
    let p = write(&dir, "q4k.gguf", &bytes);
    let e = load_error(&p);
    assert!(
        e.contains(&format!("tensor {name}: dims [32]: ne[0] = 32 is not a multiple of the Q4_K block size 256")),
        "{e}"
    );
}

/// Where the value of metadata `key` (of GGUF type `ty`) starts.
fn value_at(bytes: &[u8], key: &str, ty: u32) -> usize {
    let needle: Vec<u8> = [(key.len() as u64).to_le_bytes().as_slice(), key.as_bytes(), &ty.to_le_bytes()].concat();
    bytes.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len()
}

/// The tiny Llama with its `u32` metadata value `key` set to `v`.
fn with_u32(key: &str, v: u32) -> Vec<u8> {
    let mut bytes = tiny_llama().bytes;
    let at = value_at(&bytes, key, 4);
    set(&mut bytes, at, &v.to_le_bytes());
    bytes
}

#[test]
fn zero_heads_and_absurd_layer_counts_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    // Regression (fuzz): 0 heads divided by zero deriving head_dim; 0 KV heads took a remainder by zero.
    let p = write(&dir, "h0.gguf", &with_u32("llama.attention.head_count", 0));
    let e = load_error(&p);
    assert!(e.contains("h0.gguf") && e.contains("num_attention_heads 0"), "{e}");
    let p = write(&dir, "kv0.gguf", &with_u32("llama.attention.head_count_kv", 0));
    let e = load_error(&p);
    assert!(e.contains("kv0.gguf") && e.contains("num_key_value_heads 0"), "{e}");
    // Regression: 2^32-1 layers reserved room for every layer before finding layer 1 missing.
    let p = write(&dir, "layers.gguf", &with_u32("llama.block_count", u32::MAX));
    let (e, largest) = capped(1 << 20, || load_error(&p));
    assert!(e.contains("layers.gguf") && e.contains("missing tensor `model.layers.1.self_attn.q_proj.weight`"), "{e}");
    assert!(largest < 1 << 20, "{largest}");
}

#[test]
fn misshapen_tensors_are_named_with_both_shapes() {
    let g = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    // attn_q's rows 32 -> 16: still 2 heads of row pairs, so un-permuted, then refused by shape.
    let (_, at) = g.type_ids.iter().find(|(n, _)| *n == "blk.0.attn_q.weight").copied().unwrap();
    let mut bytes = g.bytes.clone();
    set(&mut bytes, at - 8, &16u64.to_le_bytes());
    let p = write(&dir, "q16.gguf", &bytes);
    let e = load_error(&p);
    assert!(
        e.contains("q16.gguf")
            && e.contains("`model.layers.0.self_attn.q_proj.weight` has shape [16, 32], expected [32, 32]"),
        "{e}"
    );
    // 3 rows cannot be split into 2 heads of pairs: refused before the un-permutation.
    set(&mut bytes, at - 8, &3u64.to_le_bytes());
    let p = write(&dir, "q3.gguf", &bytes);
    let e = load_error(&p);
    assert!(e.contains("q3.gguf") && e.contains("tensor blk.0.attn_q.weight: shape [3, 32]"), "{e}");
    // A renamed tensor leaves the decoder without one: named by its HF name.
    let needle = b"blk.0.ffn_up.weight";
    let mut bytes = g.bytes.clone();
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap();
    set(&mut bytes, at, b"blk.0.ffn_uq.weight");
    let p = write(&dir, "renamed.gguf", &bytes);
    let e = load_error(&p);
    assert!(e.contains("renamed.gguf") && e.contains("missing tensor `model.layers.0.mlp.up_proj.weight`"), "{e}");
}

#[test]
fn a_dim_past_i64_max_is_refused_by_the_reader() {
    let g = tiny_llama();
    let dir = tempfile::tempdir().unwrap();
    // attn_k [32, 16] -> [0, 2^64 - 1]: no elements, so no bytes, yet not a shape torch can hold.
    let (_, at) = g.type_ids.iter().find(|(n, _)| *n == "blk.0.attn_k.weight").copied().unwrap();
    let mut bytes = g.bytes.clone();
    set(&mut bytes, at - 16, &0u64.to_le_bytes());
    set(&mut bytes, at - 8, &u64::MAX.to_le_bytes());
    let p = write(&dir, "neg.gguf", &bytes);
    let e = load_error(&p);
    assert!(
        e.contains("neg.gguf") && e.contains("tensor blk.0.attn_k.weight: dims [0, 18446744073709551615]: ne[1]"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Fuzzing
// ---------------------------------------------------------------------------------------------

mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    /// Values a corrupt count, length, dim, type or offset might take.
    fn interesting(len: usize) -> impl Strategy<Value = u64> {
        prop_oneof![
            prop::sample::select(vec![
                0,
                1,
                2,
                3,
                4,
                7,
                8,
                9,
                12,
                13,
                24,
                31,
                32,
                33,
                255,
                256,
                0x7fff_ffff,
                0x8000_0000,
                0xffff_ffff,
                1 << 32,
                1 << 40,
                1 << 60,
                i64::MAX as u64,
                i64::MAX as u64 + 1,
                u64::MAX - 1,
                u64::MAX,
            ]),
            Just(len as u64),
            Just(len as u64 + 1),
            Just(len as u64 / 2),
            any::<u64>(),
            0..64u64,
        ]
    }

    #[derive(Debug, Clone)]
    enum Mutation {
        /// Overwrite field `i % fields` with a value (its low bytes for narrow fields).
        SetField(usize, u64),
        /// XOR a byte: mostly before the data section, where the parser reads.
        Flip(f64, bool, u8),
        Truncate(f64),
        /// Insert or remove bytes in the header (shifting everything after).
        Insert(f64, Vec<u8>),
        Remove(f64, usize),
    }

    fn mutation(len: usize) -> impl Strategy<Value = Mutation> {
        prop_oneof![
            3 => (any::<usize>(), interesting(len)).prop_map(|(i, v)| Mutation::SetField(i, v)),
            3 => (0.0..1.0f64, prop::bool::weighted(0.8), 1..=255u8).prop_map(|(s, h, x)| Mutation::Flip(s, h, x)),
            1 => (0.0..1.0f64).prop_map(Mutation::Truncate),
            1 => (0.0..1.0f64, prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(s, b)| Mutation::Insert(s, b)),
            1 => (0.0..1.0f64, 1..32usize).prop_map(|(s, n)| Mutation::Remove(s, n)),
        ]
    }

    fn apply(g: &Gguf, mutations: &[Mutation]) -> Vec<u8> {
        let mut b = g.bytes.clone();
        let pick = |share: f64, n: usize| ((share * n as f64) as usize).min(n.saturating_sub(1));
        for m in mutations {
            let header = g.data_offset.min(b.len());
            match m {
                Mutation::SetField(i, v) => {
                    let f = g.fields[i % g.fields.len()];
                    if f.at + f.width <= b.len() {
                        b[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
                    }
                }
                Mutation::Flip(s, in_header, x) => {
                    let n = if *in_header { header } else { b.len() };
                    if n > 0 {
                        let i = pick(*s, n);
                        b[i] ^= x;
                    }
                }
                Mutation::Truncate(s) => b.truncate(pick(*s, b.len())),
                Mutation::Insert(s, bytes) => {
                    let i = pick(*s, header + 1);
                    b.splice(i..i, bytes.iter().copied());
                }
                Mutation::Remove(s, n) => {
                    let i = pick(*s, header);
                    b.drain(i..(i + n).min(b.len()));
                }
            }
        }
        b
    }

    fn cases(default: u32) -> u32 {
        std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    /// No allocation may exceed this many bytes per byte of input (plus a fixed allowance for the
    /// tokenizer's tables): the dequantised f32s of the densest type are 256 * 4 / 84 ~ 12x its
    /// bytes, and nothing else grows with what the file claims.
    const PER_BYTE: usize = 16;
    const FIXED: usize = 4 << 20;

    #[test]
    fn mutated_ggufs_load_or_fail_naming_the_file_within_bounded_memory() {
        let g = tiny_llama();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fuzz.gguf");
        std::fs::write(&path, &g.bytes).unwrap();
        let (base, base_largest) = capped(FIXED + PER_BYTE * g.bytes.len(), || load_everything(&path));
        base.unwrap();

        let n = cases(3000);
        let mut runner = TestRunner::new(Config { cases: n, failure_persistence: None, ..Config::default() });
        let counts = Cell::new((0u32, 0u32));
        let largest = Cell::new(base_largest);
        let strategy = prop::collection::vec(mutation(g.bytes.len()), 1..4);
        runner
            .run(&strategy, |mutations| {
                let bytes = apply(&g, &mutations);
                std::fs::write(&path, &bytes).unwrap();
                let (result, big) = capped(FIXED + PER_BYTE * bytes.len(), || load_everything(&path));
                largest.set(largest.get().max(big));
                let (ok, err) = counts.get();
                match result {
                    Ok(()) => counts.set((ok + 1, err)),
                    Err(e) => {
                        prop_assert!(e.contains("fuzz.gguf"), "{}", e);
                        counts.set((ok, err + 1));
                    }
                }
                Ok(())
            })
            .unwrap();
        let (ok, err) = counts.get();
        eprintln!(
            "GGUF fuzz: {} inputs ran, no panic ({ok} loaded, {err} refused naming the file); largest allocation {} bytes for a {}-byte file",
            ok + err,
            largest.get(),
            g.bytes.len()
        );
        assert_eq!(ok + err, n);
    }
}
