//! Chat records in the OpenAI style, one JSON object per line:
//! `{"messages":[{"role":"system|user|assistant","content":"..."}]}`.
//!
//! Extra keys (top level or inside a message) are ignored; unknown roles are an error.
//! Every bad line is reported as `file:line: why`, or skipped and counted with [`OnError::Skip`].

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The name used both in the JSONL files and in the ChatML role header.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatRecord {
    pub messages: Vec<Message>,
}

/// What [`read_jsonl`] does with a bad line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Stop at the first bad line with an error naming it.
    #[default]
    Fail,
    /// Leave the line out and list it in [`ReadReport::skipped`].
    Skip,
}

#[derive(Debug, Default)]
pub struct ReadReport {
    pub records: Vec<ChatRecord>,
    /// (1-based line, why) for each line left out under [`OnError::Skip`].
    pub skipped: Vec<(usize, String)>,
}

/// Errors of this crate's data readers and the chat template.
///
/// Causes are written into the message rather than exposed as `source()`: the message
/// crosses the plugin ABI as a string, where a source chain would be lost.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: {cause}", path.display())]
    Io { path: PathBuf, cause: io::Error },
    /// A bad line of a JSONL file (or the place a whole-file JSON parse failed).
    #[error("{}:{line}: {msg}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    /// A bad conversation of a chitchat-dataset file.
    #[error("{}: conversation {id}: {msg}", path.display())]
    Conversation {
        path: PathBuf,
        id: String,
        msg: String,
    },
    #[error("tokenizer has no special token {token:?}; ChatML needs it as a special added token")]
    MissingToken { token: String },
    #[error("tokenizing {what}: {cause}")]
    Tokenize {
        what: String,
        cause: tokenizers::Error,
    },
}

/// Reads one chat record per line. Blank lines are ignored.
///
/// Lines are read as raw bytes so that invalid UTF-8 is reported against its line
/// (or skipped) instead of failing the whole read as an I/O error.
pub fn read_jsonl(path: &Path, on_error: OnError) -> Result<ReadReport, DataError> {
    let io_err = |cause| DataError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io_err)?);
    let mut report = ReadReport::default();
    let mut buf = Vec::new();
    let mut line = 0;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io_err)? == 0 {
            break;
        }
        line += 1;
        match parse_record(&buf) {
            Ok(Some(record)) => report.records.push(record),
            Ok(None) => {}
            Err(msg) => match on_error {
                OnError::Fail => {
                    return Err(DataError::Line {
                        path: path.to_path_buf(),
                        line,
                        msg,
                    })
                }
                OnError::Skip => report.skipped.push((line, msg)),
            },
        }
    }
    Ok(report)
}

/// Writes one record per line, in the format [`read_jsonl`] reads.
pub fn write_jsonl(path: &Path, records: &[ChatRecord]) -> Result<(), DataError> {
    let io_err = |cause| DataError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let mut out = BufWriter::new(File::create(path).map_err(io_err)?);
    for record in records {
        serde_json::to_writer(&mut out, record).map_err(|e| io_err(e.into()))?;
        out.write_all(b"\n").map_err(io_err)?;
    }
    out.flush().map_err(io_err)
}

/// Parses one line; `Ok(None)` for a blank line, `Err(why)` for a bad one.
fn parse_record(line: &[u8]) -> Result<Option<ChatRecord>, String> {
    let text = std::str::from_utf8(line)
        .map_err(|e| format!("invalid UTF-8 at byte {}", e.valid_up_to()))?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    // Going through `Value` (rather than a serde derive) lets each error name the
    // exact field, e.g. `missing field "content" in messages[2]`.
    let value: Value = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
    let Some(object) = value.as_object() else {
        return Err(format!("expected a JSON object, got {}", kind(&value)));
    };
    let Some(messages) = object.get("messages") else {
        return Err(r#"missing field "messages""#.to_string());
    };
    let Some(messages) = messages.as_array() else {
        return Err(format!(
            r#"field "messages" must be an array, got {}"#,
            kind(messages)
        ));
    };
    if messages.is_empty() {
        return Err(r#"field "messages" is empty"#.to_string());
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    // A record without a reply has nothing to train on.
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err("no assistant message".to_string());
    }
    Ok(Some(ChatRecord { messages }))
}

fn parse_message(i: usize, value: &Value) -> Result<Message, String> {
    let Some(object) = value.as_object() else {
        return Err(format!(
            "messages[{i}] must be an object, got {}",
            kind(value)
        ));
    };
    let field = |name: &str| -> Result<&str, String> {
        let v = object
            .get(name)
            .ok_or_else(|| format!(r#"missing field "{name}" in messages[{i}]"#))?;
        v.as_str().ok_or_else(|| {
            format!(
                r#"field "{name}" in messages[{i}] must be a string, got {}"#,
                kind(v)
            )
        })
    };
    let name = field("role")?;
    let role = Role::parse(name).ok_or_else(|| {
        format!(r#"unknown role "{name}" in messages[{i}] (expected system, user or assistant)"#)
    })?;
    let content = field("content")?.to_string();
    Ok(Message { role, content })
}

/// The JSON type of a value, for error messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.to_string(),
        }
    }

    /// Writes `bytes` to `chat.jsonl` in a fresh temp dir (kept alive by the returned guard).
    fn jsonl(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.jsonl");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    const GOOD: &str =
        r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}"#;

    /// A file whose line 2 is `bad`, between two good lines; returns the Fail-mode error text.
    fn fail_message(bad: &[u8]) -> String {
        let mut bytes = format!("{GOOD}\n").into_bytes();
        bytes.extend_from_slice(bad);
        bytes.extend_from_slice(format!("\n{GOOD}\n").as_bytes());
        let (_dir, path) = jsonl(&bytes);
        let err = read_jsonl(&path, OnError::Fail).unwrap_err();
        match &err {
            DataError::Line { line, .. } => assert_eq!(*line, 2, "{err}"),
            other => panic!("expected a Line error, got {other:?}"),
        }
        let text = err.to_string();
        let prefix = format!("{}:2: ", path.display());
        assert!(
            text.starts_with(&prefix),
            "{text:?} should start with {prefix:?}"
        );
        text[prefix.len()..].to_string()
    }

    #[test]
    fn reads_records_ignoring_blank_lines_and_extra_keys() {
        let text = format!(
            "{GOOD}\n\n   \n{}\r\n",
            r#"{"id":7,"messages":[{"role":"system","content":"be brief","name":"x"},{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#
        );
        let (_dir, path) = jsonl(text.as_bytes());
        let report = read_jsonl(&path, OnError::Fail).unwrap();
        assert!(report.skipped.is_empty());
        assert_eq!(
            report.records,
            vec![
                ChatRecord {
                    messages: vec![msg(Role::User, "hi"), msg(Role::Assistant, "hello")]
                },
                ChatRecord {
                    messages: vec![
                        msg(Role::System, "be brief"),
                        msg(Role::User, "a"),
                        msg(Role::Assistant, "b")
                    ]
                },
            ]
        );
    }

    #[test]
    fn malformed_json_names_file_and_line() {
        let why = fail_message(br#"{"messages":[{"role":"user""#);
        assert!(why.starts_with("malformed JSON: "), "{why}");
    }

    #[test]
    fn missing_fields_name_file_line_and_message_index() {
        let why = fail_message(
            br#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user"}]}"#,
        );
        assert_eq!(why, r#"missing field "content" in messages[2]"#);
        let why = fail_message(br#"{"messages":[{"content":"a"}]}"#);
        assert_eq!(why, r#"missing field "role" in messages[0]"#);
        let why = fail_message(br#"{"conversation":[]}"#);
        assert_eq!(why, r#"missing field "messages""#);
    }

    #[test]
    fn wrong_types_are_errors() {
        assert_eq!(
            fail_message(b"[1,2]"),
            "expected a JSON object, got an array"
        );
        assert_eq!(
            fail_message(br#"{"messages":"hi"}"#),
            r#"field "messages" must be an array, got a string"#
        );
        assert_eq!(
            fail_message(br#"{"messages":[{"role":"user","content":null}]}"#),
            r#"field "content" in messages[0] must be a string, got null"#
        );
        assert_eq!(
            fail_message(br#"{"messages":[["user","hi"]]}"#),
            "messages[0] must be an object, got an array"
        );
    }

    #[test]
    fn empty_conversation_and_no_reply_are_errors() {
        assert_eq!(
            fail_message(br#"{"messages":[]}"#),
            r#"field "messages" is empty"#
        );
        assert_eq!(
            fail_message(br#"{"messages":[{"role":"user","content":"anyone?"}]}"#),
            "no assistant message"
        );
    }

    #[test]
    fn unknown_role_is_an_error() {
        assert_eq!(
            fail_message(
                br#"{"messages":[{"role":"user","content":"a"},{"role":"tool","content":"b"}]}"#
            ),
            r#"unknown role "tool" in messages[1] (expected system, user or assistant)"#
        );
    }

    #[test]
    fn non_utf8_is_reported_per_line() {
        // 0xFF can never appear in UTF-8; it sits at byte 28 of the line.
        let why = fail_message(b"{\"messages\":[{\"content\":\"caf\xff\"}]}");
        assert_eq!(why, "invalid UTF-8 at byte 28");
    }

    #[test]
    fn skip_mode_keeps_good_lines_and_counts_bad_ones() {
        let mut bytes = Vec::new();
        for line in [
            GOOD.as_bytes(),
            br#"{"messages":[]}"#,
            b"not json",
            GOOD.as_bytes(),
            b"",
            b"\xfe\xfe",
            br#"{"messages":[{"role":"bot","content":"x"}]}"#,
            GOOD.as_bytes(),
        ] {
            bytes.extend_from_slice(line);
            bytes.push(b'\n');
        }
        let (_dir, path) = jsonl(&bytes);
        let report = read_jsonl(&path, OnError::Skip).unwrap();
        assert_eq!(report.records.len(), 3);
        let lines: Vec<usize> = report.skipped.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, vec![2, 3, 6, 7]);
        assert_eq!(report.skipped[0].1, r#"field "messages" is empty"#);
        assert_eq!(report.skipped[2].1, "invalid UTF-8 at byte 0");
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.jsonl");
        let err = read_jsonl(&path, OnError::Skip).unwrap_err();
        assert!(matches!(err, DataError::Io { .. }), "{err:?}");
        assert!(
            err.to_string()
                .starts_with(&format!("{}: ", path.display())),
            "{err}"
        );
    }

    #[test]
    fn write_then_read_round_trips() {
        let records = vec![
            ChatRecord {
                messages: vec![
                    msg(Role::System, "sys"),
                    msg(Role::User, "line one\nline two \"quoted\" ünïcode"),
                    msg(Role::Assistant, "ok"),
                ],
            },
            ChatRecord {
                messages: vec![msg(Role::User, ""), msg(Role::Assistant, "  spaces kept  ")],
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        write_jsonl(&path, &records).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "one record per line:\n{text}");
        let report = read_jsonl(&path, OnError::Fail).unwrap();
        assert_eq!(report.records, records);
    }

    /// Fuzzing the JSONL record reader: random bytes, mutated records and random JSON values,
    /// one line at a time and as whole files in both modes. Never a panic; every refusal names
    /// its line.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};

        const SEEDS: &[&str] = &[
            GOOD,
            r#"{"id":7,"messages":[{"role":"system","content":"be brief","name":"x"},{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#,
            r#"{"messages":[{"role":"user","content":"caf\u00e9 \"q\" \n\t\\"},{"role":"assistant","content":"ünï 😀"}]}"#,
            r#"{"messages":[{"role":"user","content":""},{"role":"assistant","content":"","extra":[1,{"a":null}]}]}"#,
        ];

        /// Byte strings that break JSON or UTF-8 in interesting ways.
        const SPLICES: &[&[u8]] = &[
            b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\0", b"\r", b"\n", b"\"",
            b"\\", b"\\ud800", b"\\u00", b"{", b"}", b"[", b"]", b",", b":", b"null", b"1e999", b"-",
            b"\"messages\"", b"\"role\"", b"\"content\"", b"\"assistant\"", b"\"tool\"",
        ];

        #[derive(Debug, Clone)]
        enum Edit {
            Flip(f64, u8),
            Truncate(f64),
            Splice(f64, usize),
            Delete(f64, usize),
        }

        fn edit() -> impl Strategy<Value = Edit> {
            prop_oneof![
                (0.0..1.0f64, 1..=255u8).prop_map(|(at, x)| Edit::Flip(at, x)),
                (0.0..1.0f64).prop_map(Edit::Truncate),
                (0.0..1.0f64, 0..SPLICES.len()).prop_map(|(at, s)| Edit::Splice(at, s)),
                (0.0..1.0f64, 1..8usize).prop_map(|(at, n)| Edit::Delete(at, n)),
            ]
        }

        fn mutate(mut b: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
            let at = |share: f64, len: usize| ((share * len as f64) as usize).min(len);
            for e in edits {
                match *e {
                    Edit::Flip(s, x) if !b.is_empty() => {
                        let i = at(s, b.len() - 1);
                        b[i] ^= x;
                    }
                    Edit::Flip(..) => {}
                    Edit::Truncate(s) => b.truncate(at(s, b.len())),
                    Edit::Splice(s, k) => {
                        let i = at(s, b.len());
                        b.splice(i..i, SPLICES[k].iter().copied());
                    }
                    Edit::Delete(s, n) => {
                        let i = at(s, b.len());
                        b.drain(i..(i + n).min(b.len()));
                    }
                }
            }
            b
        }

        /// JSON values shaped like records: the reader's keys and roles, nested, of any type.
        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>().prop_map(Value::from),
                prop::sample::select(vec!["user", "assistant", "system", "tool", "", "Assistant"]).prop_map(Value::from),
                ".{0,8}".prop_map(Value::from),
            ];
            leaf.prop_recursive(4, 24, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                    prop::collection::vec(
                        (prop::sample::select(vec!["messages", "role", "content", "name", "x"]), inner),
                        0..4
                    )
                    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
                ]
            })
        }

        fn line() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                (prop::sample::select(SEEDS.to_vec()), prop::collection::vec(edit(), 1..4))
                    .prop_map(|(s, e)| mutate(s.as_bytes().to_vec(), &e)),
                json().prop_map(|v| v.to_string().into_bytes()),
                json().prop_map(|v| serde_json::json!({ "messages": v }).to_string().into_bytes()),
                (1..200usize).prop_map(|n| "[".repeat(n).into_bytes()),
                Just(Vec::new()),
                Just(b" \t\r".to_vec()),
            ]
        }

        fn cases(default: u32) -> u32 {
            std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
        }

        #[test]
        fn hostile_lines_and_files_never_panic_and_name_the_line() {
            for s in SEEDS {
                assert!(matches!(parse_record(s.as_bytes()), Ok(Some(_))), "{s}");
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("fuzz.jsonl");
            let n = cases(2000);
            let mut runner = TestRunner::new(Config { cases: n, failure_persistence: None, ..Config::default() });
            let lines_run = std::cell::Cell::new(0usize);
            let files = std::cell::Cell::new((0usize, 0usize)); // (read whole, refused at a line)
            runner
                .run(&prop::collection::vec(line(), 1..6), |lines| {
                    let mut bytes = lines.join(&b'\n');
                    bytes.push(b'\n');
                    // What the reader sees as lines: the file split at '\n'.
                    let split: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
                    let split = &split[..split.len() - 1];
                    let mut good = Vec::new();
                    let mut bad = Vec::new();
                    for (i, l) in split.iter().enumerate() {
                        let mut l = l.to_vec();
                        l.push(b'\n');
                        match parse_record(&l) {
                            Ok(Some(r)) => good.push(r),
                            Ok(None) => {}
                            Err(why) => bad.push((i + 1, why)),
                        }
                    }
                    lines_run.set(lines_run.get() + split.len());
                    std::fs::write(&path, &bytes).unwrap();
                    let skip = read_jsonl(&path, OnError::Skip).unwrap();
                    prop_assert_eq!(&skip.records, &good);
                    prop_assert_eq!(&skip.skipped, &bad);
                    let (whole, refused) = files.get();
                    match (read_jsonl(&path, OnError::Fail), bad.first()) {
                        (Ok(r), None) => {
                            prop_assert_eq!(r.records, good);
                            files.set((whole + 1, refused));
                        }
                        (Err(e), Some((line, why))) => {
                            prop_assert_eq!(e.to_string(), format!("{}:{line}: {why}", path.display()));
                            files.set((whole, refused + 1));
                        }
                        (got, want) => prop_assert!(false, "fail mode gave {:?}, skip mode's first bad line {:?}", got.map(|r| r.records.len()), want),
                    }
                    Ok(())
                })
                .unwrap();
            let (whole, refused) = files.get();
            eprintln!(
                "dataset fuzz: {} files ({} lines) ran through the record parser, no panic ({whole} read whole, {refused} refused naming file:line)",
                whole + refused,
                lines_run.get()
            );
            assert_eq!((whole + refused) as u32, n);
        }
    }
}
