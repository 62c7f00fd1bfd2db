//! Chat records and the dataset formats they are read from.
//!
//! Record shapes (one JSON object per record):
//! - OpenAI `messages`: `{"messages": [{"role": "system|user|assistant", "content": "..."}]}`;
//! - ShareGPT: `{"conversations": [{"from": "human|gpt|system", "value": "..."}], "system": "..."}`;
//! - SpecForge: `{"id": .., "conversations": [{"role": .., "content": ..}]}`, and speculators'
//!   `conversations` whose turns use either pair of keys;
//! - anything else through a field mapping (`[data.fields]`): the keys of the turn list, role and
//!   content, role names, a top-level system prompt, or single-turn prompt/response columns.
//!
//! Containers: JSONL (one record per line), a JSON array of records, and Parquet / Arrow files as
//! HF `datasets` writes them (`to_parquet`, `save_to_disk`; see [`crate::columnar`]).
//!
//! A record may end with a user message (a prompt without a reply): self-distillation and
//! evaluation answer it. Content may be a string or OpenAI content parts
//! (`[{"type": "text", "text": ..}]`, texts joined). Extra keys are ignored; unknown roles are an
//! error. Every bad record is reported as `file:line: why` (`file: row N: why` in Parquet / Arrow,
//! N counted from 0 as `datasets` does), or skipped and counted with [`OnError::Skip`].

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

use serde_json::Value;

pub use crate::schema::{ChatRecord, DataError, Fields, Format, Message, OnError, ReadReport, Role, Schema};

/// The longest JSONL line read (a record past it fails with its line, even with `on_error =
/// "skip"`: skipping would still have to read it): long-context conversations fit.
pub const MAX_LINE_BYTES: usize = 256 << 20;
/// The largest JSON array file (parsed whole): beyond it, JSONL reads line by line.
pub const MAX_JSON_ARRAY_BYTES: u64 = 4 << 30;

/// Reads any supported file: a `save_to_disk` folder or `.arrow` file, `.parquet`, a JSON array
/// (the first non-blank character is `[`), else JSONL; either of the last two may be gzipped
/// (`.gz`, as HF datasets often ship JSONL).
pub fn read_records(path: &Path, schema: &Schema, on_error: OnError) -> Result<ReadReport, DataError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if path.is_dir() || ext == "arrow" || ext == "parquet" {
        return crate::columnar::read(path, schema, on_error);
    }
    let io_err = |cause| DataError::Io { path: path.to_path_buf(), cause };
    let mut file = open_text(path)?;
    let first = loop {
        let buf = file.fill_buf().map_err(io_err)?;
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => break Some(buf[i]),
            None if buf.is_empty() => break None,
            None => {
                let n = buf.len();
                file.consume(n);
            }
        }
    };
    if first == Some(b'[') {
        let mut bytes = Vec::new();
        // Capped like a plain file's size, here on the decompressed bytes.
        file.take(MAX_JSON_ARRAY_BYTES + 1).read_to_end(&mut bytes).map_err(io_err)?;
        if bytes.len() as u64 > MAX_JSON_ARRAY_BYTES {
            let size = bytes.len() as u64;
            return Err(input_files::InputError::TooLarge {
                path: path.to_path_buf(),
                size,
                max: MAX_JSON_ARRAY_BYTES,
            }
            .into());
        }
        return read_json_array(path, &bytes, schema, on_error);
    }
    read_jsonl_with(path, schema, on_error)
}

fn is_gzip(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gz"))
}

/// The file's text, decompressed if it is gzipped.
fn open_text(path: &Path) -> Result<Box<dyn BufRead>, DataError> {
    let file = input_files::open_regular(path)?;
    Ok(match is_gzip(path) {
        true => Box::new(BufReader::new(flate2::read::GzDecoder::new(file))),
        false => Box::new(BufReader::new(file)),
    })
}

/// Reads one OpenAI-messages record per line. Blank lines are ignored.
pub fn read_jsonl(path: &Path, on_error: OnError) -> Result<ReadReport, DataError> {
    read_jsonl_with(path, &Schema::messages(), on_error)
}

/// Reads one record per line. Lines are read as raw bytes so that invalid UTF-8 is reported
/// against its line (or skipped) instead of failing the whole read as an I/O error.
pub fn read_jsonl_with(path: &Path, schema: &Schema, on_error: OnError) -> Result<ReadReport, DataError> {
    read_jsonl_capped(path, schema, on_error, MAX_LINE_BYTES)
}

fn read_jsonl_capped(
    path: &Path,
    schema: &Schema,
    on_error: OnError,
    max_line: usize,
) -> Result<ReadReport, DataError> {
    let io_err = |cause| DataError::Io { path: path.to_path_buf(), cause };
    let mut reader = open_text(path)?;
    let mut report = ReadReport::default();
    let mut buf = Vec::new();
    let mut line = 0;
    loop {
        buf.clear();
        // At most one byte past the cap (and its newline) is buffered before the line fails.
        if (&mut reader).take(max_line as u64 + 2).read_until(b'\n', &mut buf).map_err(io_err)? == 0 {
            break;
        }
        line += 1;
        let body = buf.strip_suffix(b"\n").unwrap_or(&buf);
        if body.strip_suffix(b"\r").unwrap_or(body).len() > max_line {
            return Err(input_files::InputError::LineTooLong { path: path.to_path_buf(), line, max: max_line }.into());
        }
        match parse_line(&buf, schema) {
            Ok(Some(record)) => report.records.push(record),
            Ok(None) => {}
            Err(msg) => match on_error {
                OnError::Fail => return Err(DataError::Line { path: path.to_path_buf(), line, msg }),
                OnError::Skip => report.skipped.push((line, msg)),
            },
        }
    }
    Ok(report)
}

/// A JSON array of records; each is reported by the line its value starts on.
fn read_json_array(path: &Path, bytes: &[u8], schema: &Schema, on_error: OnError) -> Result<ReadReport, DataError> {
    let line_at = |offset: usize| bytes[..offset].iter().filter(|&&b| b == b'\n').count() + 1;
    let text = std::str::from_utf8(bytes).map_err(|e| DataError::Line {
        path: path.to_path_buf(),
        line: line_at(e.valid_up_to()),
        msg: format!("invalid UTF-8 at byte {} of the file", e.valid_up_to()),
    })?;
    let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(text).map_err(|e| DataError::Line {
        path: path.to_path_buf(),
        line: e.line(),
        msg: format!("malformed JSON array: {e}"),
    })?;
    let mut report = ReadReport::default();
    for (i, raw) in items.into_iter().enumerate() {
        // The raw value borrows from `text`: its address gives its line.
        let line = line_at(raw.get().as_ptr() as usize - text.as_ptr() as usize);
        let parsed = serde_json::from_str::<Value>(raw.get())
            .map_err(|e| format!("malformed JSON: {e}"))
            .and_then(|v| schema.parse(&v))
            .map_err(|why| format!("record {i}: {why}"));
        match parsed {
            Ok(record) => report.records.push(record),
            Err(msg) => match on_error {
                OnError::Fail => return Err(DataError::Line { path: path.to_path_buf(), line, msg }),
                OnError::Skip => report.skipped.push((line, msg)),
            },
        }
    }
    Ok(report)
}

/// Writes one OpenAI-messages record per line, in the format [`read_jsonl`] reads; gzipped when
/// the name ends in `.gz`.
pub fn write_jsonl(path: &Path, records: &[ChatRecord]) -> Result<(), DataError> {
    let io_err = |cause| DataError::Io { path: path.to_path_buf(), cause };
    let out = BufWriter::new(File::create(path).map_err(io_err)?);
    let lines = |mut w: &mut dyn Write| -> io::Result<()> {
        for record in records {
            serde_json::to_writer(&mut w, record)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    };
    let written = match is_gzip(path) {
        true => {
            let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::best());
            // finish() writes the gzip trailer; a plain flush would leave the stream cut short.
            lines(&mut gz).and_then(|_| gz.finish()).and_then(|mut out| out.flush())
        }
        false => {
            let mut out = out;
            lines(&mut out).and_then(|_| out.flush())
        }
    };
    written.map_err(io_err)
}

/// Parses one OpenAI-messages line; `Ok(None)` for a blank line, `Err(why)` for a bad one.
pub fn parse_record(line: &[u8]) -> Result<Option<ChatRecord>, String> {
    parse_line(line, &Schema::messages())
}

fn parse_line(line: &[u8], schema: &Schema) -> Result<Option<ChatRecord>, String> {
    let text = std::str::from_utf8(line).map_err(|e| format!("invalid UTF-8 at byte {}", e.valid_up_to()))?;
    if text.trim().is_empty() {
        return Ok(None);
    }
    // Going through `Value` (rather than a serde derive) lets each error name the exact field,
    // e.g. `missing field "content" in messages[2]`.
    let value: Value = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
    schema.parse(&value).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn msg(role: Role, content: &str) -> Message {
        Message { role, content: content.to_string() }
    }

    /// Writes `bytes` to `chat.jsonl` in a fresh temp dir (kept alive by the returned guard).
    fn jsonl(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.jsonl");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    const GOOD: &str = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"}]}"#;

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
        assert!(text.starts_with(&prefix), "{text:?} should start with {prefix:?}");
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
                ChatRecord { messages: vec![msg(Role::User, "hi"), msg(Role::Assistant, "hello")] },
                ChatRecord {
                    messages: vec![msg(Role::System, "be brief"), msg(Role::User, "a"), msg(Role::Assistant, "b")]
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
        assert_eq!(fail_message(b"[1,2]"), "expected a JSON object, got an array");
        assert_eq!(fail_message(br#"{"messages":"hi"}"#), r#"field "messages" must be an array, got a string"#);
        assert_eq!(
            fail_message(br#"{"messages":[{"role":"user","content":null}]}"#),
            r#"field "content" in messages[0] must be a string, got null"#
        );
        assert_eq!(fail_message(br#"{"messages":[["user","hi"]]}"#), "messages[0] must be an object, got an array");
    }

    #[test]
    fn empty_conversations_are_errors_and_prompts_without_a_reply_are_records() {
        assert_eq!(fail_message(br#"{"messages":[]}"#), r#"field "messages" is empty"#);
        assert_eq!(
            fail_message(br#"{"messages":[{"role":"system","content":"be brief"}]}"#),
            "no user or assistant message"
        );
        let record = parse_record(br#"{"messages":[{"role":"user","content":"anyone?"}]}"#).unwrap().unwrap();
        assert!(record.is_open());
        assert_eq!(record.messages, vec![msg(Role::User, "anyone?")]);
    }

    #[test]
    fn unknown_role_is_an_error() {
        assert_eq!(
            fail_message(br#"{"messages":[{"role":"user","content":"a"},{"role":"tool","content":"b"}]}"#),
            r#"unknown role "tool" in messages[1] (expected assistant, system, user; map others in [data.fields] roles)"#
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
    fn missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.jsonl");
        let err = read_jsonl(&path, OnError::Skip).unwrap_err();
        assert_eq!(err.to_string(), format!("{}: no such file", path.display()));
    }

    /// A FIFO, a device or a directory where a dataset file belongs is refused naming it (a FIFO
    /// without blocking on it), in every container; a line past the cap names its line.
    #[test]
    fn special_files_and_huge_lines_are_refused_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("chats.jsonl");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let schema = Schema::messages();
        for path in [fifo.as_path(), Path::new("/dev/zero")] {
            type Read = fn(&Path, &Schema, OnError) -> Result<ReadReport, DataError>;
            for read in [read_records as Read, read_jsonl_with] {
                let err = read(path, &schema, OnError::Skip).unwrap_err().to_string();
                assert!(err.starts_with(&format!("{}: not a regular file (a ", path.display())), "{err}");
            }
        }
        let parquet = dir.path().join("x.parquet");
        std::os::unix::fs::symlink("/dev/zero", &parquet).unwrap();
        let err = read_records(&parquet, &schema, OnError::Fail).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: not a regular file (a character device", parquet.display())), "{err}");
        let good = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
        let (_d, path) = jsonl(format!("{good}\n{}\n{good}\r\n", "x".repeat(100)).as_bytes());
        let err = read_jsonl_capped(&path, &schema, OnError::Skip, 64).unwrap_err().to_string();
        assert_eq!(err, format!("{}:2: line longer than 64 bytes", path.display()));
        let (_d, path) = jsonl(format!("{good}\r\n{good}").as_bytes());
        assert_eq!(
            read_jsonl_capped(&path, &schema, OnError::Fail, good.len()).unwrap().records.len(),
            2,
            "the cap is on the line itself"
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
            ChatRecord { messages: vec![msg(Role::User, ""), msg(Role::Assistant, "  spaces kept  ")] },
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        write_jsonl(&path, &records).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "one record per line:\n{text}");
        let report = read_jsonl(&path, OnError::Fail).unwrap();
        assert_eq!(report.records, records);
    }

    #[test]
    fn gzipped_jsonl_and_json_arrays_read_like_plain_ones() {
        let records = fixture_records();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl.gz");
        write_jsonl(&path, &records).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..2], &[0x1f, 0x8b], "written gzipped");
        assert_eq!(read_records(&path, &Schema::messages(), OnError::Fail).unwrap().records, records);
        // A JSON array, gzipped; a bad record is still named by its line.
        let array = format!("[\n{GOOD},\n{{\"messages\": 3}}\n]");
        let gz_path = dir.path().join("array.json.gz");
        let mut gz = flate2::write::GzEncoder::new(File::create(&gz_path).unwrap(), flate2::Compression::fast());
        gz.write_all(array.as_bytes()).unwrap();
        gz.finish().unwrap();
        let report = read_records(&gz_path, &Schema::messages(), OnError::Skip).unwrap();
        assert_eq!((report.records.len(), report.skipped.len(), report.skipped[0].0), (1, 1, 3));
        // A file named .gz that is not gzip fails with its name.
        let fake = dir.path().join("fake.jsonl.gz");
        std::fs::write(&fake, GOOD).unwrap();
        let err = read_records(&fake, &Schema::messages(), OnError::Fail).unwrap_err().to_string();
        assert!(err.contains("fake.jsonl.gz"), "{err}");
    }

    /// The conversations of tests/fixtures/datasets (scripts/fixtures/make_data_fixtures.py).
    fn fixture_records() -> Vec<ChatRecord> {
        vec![
            ChatRecord {
                messages: vec![msg(Role::System, "Be brief."), msg(Role::User, "Hi!"), msg(Role::Assistant, "Hello.")],
            },
            ChatRecord {
                messages: vec![
                    msg(Role::User, "2+2?"),
                    msg(Role::Assistant, "4"),
                    msg(Role::User, "And 3+3?"),
                    msg(Role::Assistant, "6, with \"quotes\" and ünïcode."),
                ],
            },
            ChatRecord { messages: vec![msg(Role::User, "Name a colour.")] },
        ]
    }

    fn datasets_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/datasets")
    }

    fn read(path: &Path, format: Format, fields: &Fields) -> Result<ReadReport, DataError> {
        read_records(path, &Schema::new(format, fields), OnError::Fail)
    }

    #[test]
    fn every_format_reads_to_the_same_records() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let openai = write(
            "openai.jsonl",
            concat!(
                r#"{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi!"},{"role":"assistant","content":"Hello."}]}"#,
                "\n",
                r#"{"id":"c1","messages":[{"role":"user","content":"2+2?"},{"role":"assistant","content":[{"type":"text","text":"4"}]},{"role":"user","content":"And 3+3?"},{"role":"assistant","content":"6, with \"quotes\" and ünïcode."}]}"#,
                "\n",
                r#"{"messages":[{"role":"user","content":"Name a colour."}]}"#,
                "\n",
            ),
        );
        // ShareGPT as a pretty-printed JSON array, the system prompt as a top-level field.
        let sharegpt = write(
            "sharegpt.json",
            r#"[
  {"id": "c0", "system": "Be brief.",
   "conversations": [{"from": "human", "value": "Hi!"}, {"from": "gpt", "value": "Hello."}]},
  {"id": "c1", "system": "",
   "conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                     {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6, with \"quotes\" and ünïcode."}]},
  {"id": "c2", "conversations": [{"from": "human", "value": "Name a colour."}]}
]
"#,
        );
        // SpecForge: `conversations` of role/content; speculators mixes both key pairs.
        let specforge = write(
            "specforge.jsonl",
            concat!(
                r#"{"id":"0","conversations":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi!"},{"role":"assistant","content":"Hello."}]}"#,
                "\n",
                r#"{"id":"1","conversations":[{"from":"human","value":"2+2?"},{"role":"assistant","content":"4"},{"from":"user","value":"And 3+3?"},{"from":"gpt","value":"6, with \"quotes\" and ünïcode."}]}"#,
                "\n",
                r#"{"id":"2","conversations":[{"role":"user","content":"Name a colour."}]}"#,
                "\n",
            ),
        );
        // Anything else, through [data.fields].
        let custom = write(
            "custom.jsonl",
            concat!(
                r#"{"sys":"Be brief.","dialog":[{"who":"customer","says":"Hi!"},{"who":"agent","says":"Hello."}]}"#,
                "\n",
                r#"{"dialog":[{"who":"customer","says":"2+2?"},{"who":"agent","says":"4"},{"who":"customer","says":"And 3+3?"},{"who":"agent","says":"6, with \"quotes\" and ünïcode."}]}"#,
                "\n",
                r#"{"dialog":[{"who":"customer","says":"Name a colour."}]}"#,
                "\n",
            ),
        );
        let fields = Fields {
            messages: Some("dialog".into()),
            role: Some("who".into()),
            content: Some("says".into()),
            system: Some("sys".into()),
            roles: [("customer".to_string(), Role::User), ("agent".to_string(), Role::Assistant)].into(),
            ..Fields::default()
        };
        let want = fixture_records();
        let none = Fields::default();
        for (path, format, fields) in [
            (&openai, Format::Auto, &none),
            (&openai, Format::Messages, &none),
            (&openai, Format::Jsonl, &none),
            (&sharegpt, Format::Auto, &none),
            (&sharegpt, Format::Sharegpt, &none),
            (&specforge, Format::Auto, &none),
            (&specforge, Format::Sharegpt, &none),
            (&custom, Format::Auto, &fields),
            (&datasets_dir().join("sharegpt.parquet"), Format::Auto, &none),
            (&datasets_dir().join("messages_arrow"), Format::Auto, &none),
            (&datasets_dir().join("messages_arrow/data-00000-of-00001.arrow"), Format::Messages, &none),
        ] {
            let got = read(path, format, fields).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            assert_eq!(got.records, want, "{} as {format:?}", path.display());
        }
        // Single-turn columns (Alpaca-like): prompt and reply, an empty reply = a prompt.
        let alpaca = write(
            "alpaca.json",
            r#"[{"instruction":"Hi!","output":"Hello.","sys":"Be brief."},{"instruction":"Name a colour.","output":""}]"#,
        );
        let fields = Fields {
            prompt: Some("instruction".into()),
            response: Some("output".into()),
            system: Some("sys".into()),
            ..Fields::default()
        };
        let got = read(&alpaca, Format::Auto, &fields).unwrap().records;
        assert_eq!(got, vec![want[0].clone(), want[2].clone()]);
    }

    #[test]
    fn a_bad_record_names_file_and_line_or_row_in_every_format() {
        let dir = tempfile::tempdir().unwrap();
        let bad_turn = r#"{"from":"tool","value":"x"}"#;
        let jsonl = dir.path().join("bad.jsonl");
        std::fs::write(&jsonl, format!("{GOOD}\n{{\"conversations\":[{bad_turn}]}}\n")).unwrap();
        let json = dir.path().join("bad.json");
        std::fs::write(&json, format!("[\n  {GOOD},\n\n  {{\"conversations\":\n    [{bad_turn}]}}\n]\n")).unwrap();
        let why = r#"unknown role "tool" in conversations[0] (expected assistant, bard, bing, chatgpt, gpt, human, model, system, user; map others in [data.fields] roles)"#;
        let none = Fields::default();
        let expect = |path: &Path, place: &str, why: &str| {
            let err = read(path, Format::Auto, &none).unwrap_err().to_string();
            assert_eq!(err, format!("{}{place}: {why}", path.display()));
            let skip = read_records(path, &Schema::new(Format::Auto, &none), OnError::Skip).unwrap();
            assert_eq!(skip.skipped.len(), 1, "{}", path.display());
            skip.records.len()
        };
        assert_eq!(expect(&jsonl, ":2", why), 1);
        assert_eq!(expect(&json, ":4", &format!("record 1: {why}")), 1);
        let why = why.replace("conversations[0]", "conversations[1]");
        assert_eq!(expect(&datasets_dir().join("bad_role.parquet"), ": row 1", &why), 2);
        // A save_to_disk folder: the error names its data file.
        let arrow = datasets_dir().join("bad_role_arrow");
        let err = read(&arrow, Format::Auto, &none).unwrap_err().to_string();
        assert_eq!(err, format!("{}: row 1: {why}", arrow.join("data-00000-of-00001.arrow").display()));
        // A truncated Parquet file and a JSON array cut short name the file.
        let cut = dir.path().join("cut.parquet");
        let bytes = std::fs::read(datasets_dir().join("sharegpt.parquet")).unwrap();
        std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let err = read(&cut, Format::Auto, &none).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: not a readable Parquet file: ", cut.display())), "{err}");
        std::fs::write(&json, format!("[\n  {GOOD},\n")).unwrap();
        let err = read(&json, Format::Auto, &none).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:3: malformed JSON array: ", json.display())), "{err}");
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
            b"\xff",
            b"\xc3",
            b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80",
            b"\xc0\xaf",
            b"\0",
            b"\r",
            b"\n",
            b"\"",
            b"\\",
            b"\\ud800",
            b"\\u00",
            b"{",
            b"}",
            b"[",
            b"]",
            b",",
            b":",
            b"null",
            b"1e999",
            b"-",
            b"\"messages\"",
            b"\"role\"",
            b"\"content\"",
            b"\"assistant\"",
            b"\"tool\"",
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
                prop::sample::select(vec!["user", "assistant", "system", "tool", "", "Assistant"])
                    .prop_map(Value::from),
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
                        (got, want) => prop_assert!(
                            false,
                            "fail mode gave {:?}, skip mode's first bad line {:?}",
                            got.map(|r| r.records.len()),
                            want
                        ),
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
