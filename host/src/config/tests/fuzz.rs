//! Fuzzing `RunConfig::from_toml` (and each plugin's parse of its section): mutated
//! configs must give `Ok` or an error naming the file, never a panic.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Every host field and a few plugin fields set, so mutations reach each of them.
const FULL: &str = r#"name = "fuzz"
seed = 7
device = "cpu"
dtype = "f32"

[train]
steps = 10
grad_accum = 2
anchors_per_seq = 8
loss_gamma = 4.0
loss_normalization = "per_micro_batch"
anchors = "before_response"
warmup_frac = 0.1
min_lr_frac = 0.1
grad_clip = 1.0
log_every = 1
checkpoint_every = 5
keep_checkpoints = 2
max_nonfinite_steps = 3
hidden_cache_mb = 16

[pipeline]
targets = ["cpu", "cuda:1"]
drafter = "cpu"
buffer_mb = 64
deterministic = true
capture = "cap"

[target]
plugin = "hf"
path = "model.gguf"
generate_batch_size = 4

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
target_layer_ids = [1, 2]
mask_token_id = 0

[optimizer]
plugin = "adamw"
lr = 1e-3
weight_decay = 0.0

[data]
plugin = "chat"
path = "chat.jsonl"
format = "jsonl"
batch_size = 2
max_len = 64
on_error = "skip"
"#;

const KEYS: &[&str] = &[
    "name",
    "seed",
    "device",
    "dtype",
    "steps",
    "grad_accum",
    "anchors_per_seq",
    "loss_gamma",
    "loss_normalization",
    "anchors",
    "warmup_frac",
    "min_lr_frac",
    "grad_clip",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "max_nonfinite_steps",
    "hidden_cache_mb",
    "targets",
    "drafter",
    "buffer_mb",
    "deterministic",
    "capture",
    "plugin",
    "path",
    "generate_batch_size",
    "num_hidden_layers",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "lr",
    "weight_decay",
    "format",
    "batch_size",
    "max_len",
    "on_error",
];

#[derive(Debug, Clone)]
enum Mutation {
    /// XOR one byte (position as a share of the length).
    Flip(f64, u8),
    Truncate(f64),
    /// Insert a line before line `i % lines`.
    InsertLine(usize, String),
    DeleteLine(usize),
    DuplicateLine(usize),
    /// Every `KEYS[k] = ...` line gets this value instead.
    SetKey(usize, String),
}

/// TOML values, well-formed or not, of every type and none.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<u64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| format!("{v:?}")),
        prop::sample::select(vec!["nan", "inf", "-inf", "-0", "1e999", "0", "0.0", "-1.0", "1.5"])
            .prop_map(str::to_string),
        "[ -~]{0,12}".prop_map(|s| toml::Value::from(s).to_string()),
        prop::sample::select(vec!["\"../x\"", "\"a/b\"", "\"cuda:\"", "\"cuda:99999999999\"", "\"bf16\"", "\"\""])
            .prop_map(str::to_string),
        any::<bool>().prop_map(|v| v.to_string()),
        prop::collection::vec(any::<i32>(), 0..4).prop_map(|v| format!("{v:?}")),
        Just("[\"cpu\", 1, [2]]".to_string()),
        Just("{ a = 1, b = { c = \"d\" } }".to_string()),
        Just("1979-05-27T07:32:00Z".to_string()),
        "[^\n]{0,16}",
    ]
}

fn junk_line() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "[train]",
            "[[train]]",
            "[pipeline.x]",
            "[data.extra]",
            "[]",
            "[",
            "= 1",
            "x =",
            "\"k\" = 1",
            "name = \"dup\"",
            "a.b.c = 1",
            "[target]",
            "plugin = 3",
            "plugin = \"nope\"",
            "'''",
            "\"\"\"",
            "# comment",
            "\u{feff}",
            "\t",
            "steps = 1\r",
        ])
        .prop_map(str::to_string),
        (prop::sample::select(KEYS.to_vec()), value()).prop_map(|(k, v)| format!("{k} = {v}")),
        "[^\n]{0,24}",
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0f64, 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
        (0.0..1.0f64).prop_map(Mutation::Truncate),
        (any::<usize>(), junk_line()).prop_map(|(i, l)| Mutation::InsertLine(i, l)),
        any::<usize>().prop_map(Mutation::DeleteLine),
        any::<usize>().prop_map(Mutation::DuplicateLine),
        (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
        (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
    ]
}

fn apply(text: &str, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = text.as_bytes().to_vec();
    let at = |share: f64, len: usize| ((share * len as f64) as usize).min(len.saturating_sub(1));
    for m in mutations {
        match m {
            Mutation::Flip(share, x) => {
                if !bytes.is_empty() {
                    let i = at(*share, bytes.len());
                    bytes[i] ^= x;
                }
                continue;
            }
            Mutation::Truncate(share) => {
                bytes.truncate(at(*share, bytes.len()));
                continue;
            }
            _ => {}
        }
        let mut lines: Vec<Vec<u8>> = bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
        let n = lines.len();
        match m {
            Mutation::InsertLine(i, l) => lines.insert(i % (n + 1), l.clone().into_bytes()),
            Mutation::DeleteLine(i) => {
                lines.remove(i % n);
            }
            Mutation::DuplicateLine(i) => {
                let l = lines[i % n].clone();
                lines.insert(i % n, l);
            }
            Mutation::SetKey(k, v) => {
                let prefix = format!("{} =", KEYS[*k]);
                for l in lines.iter_mut().filter(|l| l.starts_with(prefix.as_bytes())) {
                    *l = format!("{prefix} {v}").into_bytes();
                }
            }
            Mutation::Flip(..) | Mutation::Truncate(_) => unreachable!("handled above"),
        }
        bytes = lines.join(&b'\n');
    }
    bytes
}

/// The number of cases: `DFLASH_FUZZ_CASES` or `default`.
fn cases(default: u32) -> u32 {
    std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn mutated_configs_parse_or_fail_naming_the_file_never_panic() {
    let path = Path::new("fuzz.toml");
    // The unmutated config is valid: mutations start from a config that parses.
    let cfg = RunConfig::from_toml(path, FULL).unwrap();
    assert_eq!((cfg.train.steps, cfg.target_devices().len(), cfg.dtype()), (10, 2, "f32"));
    let n = cases(10_000);
    let mut runner = TestRunner::new(Config { cases: n, failure_persistence: None, ..Config::default() });
    let counts = std::cell::Cell::new((0u32, 0u32));
    let registry = crate::plugins::Registry::new(&[]).unwrap();
    let ctx = plugin_api::HostContext::cpu();
    let strategy = prop::collection::vec(mutation(), 1..5);
    runner
        .run(&strategy, |mutations| {
            let bytes = apply(FULL, &mutations);
            let text = String::from_utf8_lossy(&bytes);
            let (ok, err) = counts.get();
            match RunConfig::from_toml(path, &text) {
                Ok(cfg) => {
                    counts.set((ok + 1, err));
                    let _ = (cfg.dtype(), cfg.target_devices(), cfg.drafter_device(), cfg.pipeline.buffer_bytes());
                    toml::to_string(&cfg).unwrap();
                    // Each plugin checks its own section through the ABI; its errors are
                    // located in the text.
                    for kind in ["target", "drafter", "optimizer", "data"] {
                        let sec = cfg.section(kind);
                        let Ok(plugin) = registry.find(crate::plugins::kind_of_section(kind), &sec.plugin) else {
                            continue;
                        };
                        let res = plugin.check(&sec, &ctx);
                        if let Err(e) = res {
                            let _ = locate_plugin_error(&text, &format!("{e:#}"));
                        }
                    }
                }
                Err(e) => {
                    counts.set((ok, err + 1));
                    let msg = e.to_string();
                    prop_assert!(msg.starts_with("fuzz.toml"), "error does not name the file: {msg}");
                }
            }
            Ok(())
        })
        .unwrap();
    let (ok, err) = counts.get();
    eprintln!(
        "config fuzz: {} inputs ran, no panic ({ok} parsed, {err} refused with an error naming the file)",
        ok + err
    );
    assert_eq!(ok + err, n);
}
