//! The `chitchat-dataset` format: one JSON object mapping conversation id to
//! `{"messages": [[{"text","timestamp","sender"}, ...], ...], "prompt", "ratings", "start"}`,
//! where each inner list is one turn of consecutive messages by one sender.
//!
//! Conversion to chat records:
//! - texts are trimmed; empty texts are dropped;
//! - messages are regrouped into turns at each change of sender, so a turn that was
//!   empty after trimming merges its neighbours (same sender on both sides);
//! - turns alternate `user`, `assistant`, `user`, ... starting with the first sender.
//!   With two senders this is exactly "first sender is the user, the other the
//!   assistant"; with three or more (none in the real file) roles simply flip at every
//!   sender change, which keeps the strict alternation the chat template expects;
//! - a turn's messages are joined with "\n";
//! - conversations with fewer than 2 turns (hence no assistant turn) are dropped;
//! - the result is sorted by conversation id, so runs are deterministic.
//!
//! `timestamp`, `prompt`, `ratings` and `start` are ignored.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::records::{ChatRecord, DataError, Message, Role};

#[derive(Deserialize)]
struct Conversation {
    messages: Vec<Vec<ChitchatMessage>>,
}

#[derive(Deserialize)]
struct ChitchatMessage {
    text: String,
    sender: String,
}

/// Loads a chitchat-dataset file as `(conversation id, record)` pairs sorted by id.
pub fn load_chitchat(path: &Path) -> Result<Vec<(String, ChatRecord)>, DataError> {
    let bytes = input_files::read_capped(path, crate::records::MAX_JSON_ARRAY_BYTES)?;
    // Parse in two steps so that a bad conversation is reported by its id:
    // first the id -> raw value map (a BTreeMap, which also sorts by id), then each value.
    let conversations: BTreeMap<String, Value> = serde_json::from_slice(&bytes).map_err(|e| DataError::Line {
        path: path.to_path_buf(),
        line: e.line(),
        msg: format!("malformed chitchat JSON: {e}"),
    })?;
    let mut records = Vec::new();
    for (id, value) in conversations {
        let conversation: Conversation = serde_json::from_value(value).map_err(|e| DataError::Conversation {
            path: path.to_path_buf(),
            id: id.clone(),
            msg: e.to_string(),
        })?;
        if let Some(record) = to_record(conversation) {
            records.push((id, record));
        }
    }
    Ok(records)
}

/// Applies the rules in the module doc; `None` for a conversation that is dropped.
fn to_record(conversation: Conversation) -> Option<ChatRecord> {
    // (sender, texts) per turn.
    let mut turns: Vec<(String, Vec<String>)> = Vec::new();
    for message in conversation.messages.into_iter().flatten() {
        let text = message.text.trim();
        if text.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((sender, texts)) if *sender == message.sender => texts.push(text.to_string()),
            _ => turns.push((message.sender, vec![text.to_string()])),
        }
    }
    if turns.len() < 2 {
        return None;
    }
    let messages = turns
        .into_iter()
        .enumerate()
        .map(|(i, (_, texts))| Message {
            role: if i % 2 == 0 { Role::User } else { Role::Assistant },
            content: texts.join("\n"),
        })
        .collect();
    Some(ChatRecord { messages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load_json(value: &Value) -> Result<Vec<(String, ChatRecord)>, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chitchat.json");
        std::fs::write(&path, value.to_string()).unwrap();
        load_chitchat(&path)
    }

    fn m(text: &str, sender: &str) -> Value {
        json!({"text": text, "timestamp": "2018-05-05T21:01:14Z", "sender": sender})
    }

    fn roles_and_texts(record: &ChatRecord) -> Vec<(Role, &str)> {
        record.messages.iter().map(|m| (m.role, m.content.as_str())).collect()
    }

    #[test]
    fn turns_alternate_from_the_first_sender_and_join_with_newline() {
        let file = json!({
            "b-conv": {"messages": [[m(" hi ", "x")], [m("hello", "y"), m("how are you?", "y")], [m("fine", "x")]],
                       "prompt": "p", "ratings": {}, "start": "s"},
            "a-conv": {"messages": [[m("first", "q")], [m("second", "p")]]},
        });
        let records = load_json(&file).unwrap();
        let ids: Vec<&str> = records.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, vec!["a-conv", "b-conv"], "sorted by id");
        assert_eq!(
            roles_and_texts(&records[1].1),
            vec![(Role::User, "hi"), (Role::Assistant, "hello\nhow are you?"), (Role::User, "fine")]
        );
    }

    #[test]
    fn short_and_one_sided_conversations_are_dropped() {
        let file = json!({
            "one-turn": {"messages": [[m("hello?", "x"), m("anyone?", "x")]]},
            "no-turns": {"messages": []},
            "blank-reply": {"messages": [[m("hello?", "x")], [m("   ", "y")]]},
            "kept": {"messages": [[m("a", "x")], [m("b", "y")]]},
        });
        let records = load_json(&file).unwrap();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].0, "kept");
    }

    #[test]
    fn an_empty_turn_merges_its_neighbours() {
        let file =
            json!({"c": {"messages": [[m("a", "x")], [m("b", "y")], [m("", "x")], [m("c", "y")], [m("d", "x")]]}});
        let records = load_json(&file).unwrap();
        assert_eq!(
            roles_and_texts(&records[0].1),
            vec![(Role::User, "a"), (Role::Assistant, "b\nc"), (Role::User, "d")]
        );
    }

    #[test]
    fn three_senders_alternate_at_each_sender_change() {
        let file = json!({"c": {"messages": [[m("a", "x")], [m("b", "y")], [m("c", "z")], [m("d", "x")]]}});
        let records = load_json(&file).unwrap();
        assert_eq!(
            roles_and_texts(&records[0].1),
            vec![(Role::User, "a"), (Role::Assistant, "b"), (Role::User, "c"), (Role::Assistant, "d")]
        );
    }

    #[test]
    fn errors_name_the_file_and_conversation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chitchat.json");
        let file = json!({
            "good": {"messages": [[m("a", "x")], [m("b", "y")]]},
            "bad-id": {"messages": [[{"text": 5, "sender": "x"}]]},
        });
        std::fs::write(&path, file.to_string()).unwrap();
        let err = load_chitchat(&path).unwrap_err().to_string();
        let prefix = format!("{}: conversation bad-id: invalid type: integer `5`", path.display());
        assert!(err.starts_with(&prefix), "{err}");

        std::fs::write(&path, r#"{"c": {"prompt": "p"}}"#).unwrap();
        let err = load_chitchat(&path).unwrap_err().to_string();
        assert_eq!(err, format!("{}: conversation c: missing field `messages`", path.display()));

        std::fs::write(&path, "{\n\"c\": {\"messages\": [[\n").unwrap();
        let err = load_chitchat(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:3: malformed chitchat JSON", path.display())), "{err}");
    }

    #[test]
    fn non_utf8_and_non_object_files_name_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chitchat.json");
        std::fs::write(&path, b"{\n\"c\": {\"messages\": [[{\"text\": \"caf\xe9\", \"sender\": \"x\"}]]}}").unwrap();
        let err = load_chitchat(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:2: malformed chitchat JSON", path.display())), "{err}");

        std::fs::write(&path, "[1, 2]").unwrap();
        let err = load_chitchat(&path).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}:1: malformed chitchat JSON: invalid type: sequence", path.display())),
            "{err}"
        );
    }

    /// The real dataset, fetched by `make setup`.
    #[test]
    fn loads_the_real_chitchat_file() {
        let home = std::env::var("HOME").expect("HOME is set");
        let path = Path::new(&home).join(".cache/dflash/chitchat.json");
        assert!(path.exists(), "{} is missing: run `make setup` to download the chitchat dataset", path.display());
        let records = load_chitchat(&path).unwrap();
        // 7,168 conversations in the file: 3,150 have a single turn, and one more
        // (1f48d55a-...) has only one non-blank turn; all are dropped.
        assert_eq!(records.len(), 4017);
        assert!(records.iter().all(|(id, _)| !id.starts_with("1f48d55a")));
        let (id, first) = &records[0];
        assert_eq!(id, "0004441d-0390-4033-a321-6fef32ed7ddb");
        let head: Vec<(Role, &str)> = roles_and_texts(first).into_iter().take(5).collect();
        assert_eq!(
            head,
            vec![
                (Role::User, "I would binge watch just about about every tv show"),
                (
                    Role::Assistant,
                    "After high confusion and probably a mental breakdown, since that would be wild, \
                     I would definitely drive over to Banzai Bowls and make a sick acai bowl for free"
                ),
                (Role::User, "Goals"),
                (Role::Assistant, "Banzai is such a good time no joke"),
                (Role::User, "Truth\nI changed my mind I would definitely just raid like cafe rio and stuff"),
            ]
        );
        // Every kept record alternates strictly and has a reply to train on.
        for (id, record) in &records {
            assert!(record.messages.len() >= 2, "{id}");
            for (i, message) in record.messages.iter().enumerate() {
                let expected = if i % 2 == 0 { Role::User } else { Role::Assistant };
                assert_eq!(message.role, expected, "{id} messages[{i}]");
                assert!(!message.content.is_empty(), "{id} messages[{i}]");
            }
        }
    }
}
