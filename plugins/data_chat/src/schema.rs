//! A chat record (messages with roles), how a file's fields map onto one ([`Schema`]: the known
//! shapes or `[data.fields]`), and what reading records reports; shared by every container's
//! reader (`records.rs`: JSONL and JSON arrays, `columnar.rs`: Parquet and Arrow).

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The name chat templates see (`message.role`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
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

impl ChatRecord {
    /// Ends with a user message: a prompt awaiting its reply.
    pub fn is_open(&self) -> bool {
        self.messages.last().is_some_and(|m| m.role == Role::User)
    }
}

/// What the readers do with a bad record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Stop at the first bad record with an error naming it.
    #[default]
    Fail,
    /// Leave the record out and list it in [`ReadReport::skipped`].
    Skip,
}

#[derive(Debug, Default)]
pub struct ReadReport {
    pub records: Vec<ChatRecord>,
    /// (place, why) for each record left out under [`OnError::Skip`]: the 1-based line in a text
    /// file, the 0-based row in a Parquet / Arrow file (`by_row`).
    pub skipped: Vec<(usize, String)>,
    pub by_row: bool,
}

/// Errors of this crate's data readers.
///
/// Causes are written into the message rather than exposed as `source()`: the message
/// crosses the plugin ABI as a string, where a source chain would be lost.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: {cause}", path.display())]
    Io { path: PathBuf, cause: io::Error },
    /// A dataset file that cannot be read as one: missing, not a regular file (a FIFO, a
    /// device), too large, a line past [`MAX_LINE_BYTES`]; names the file (and line).
    #[error("{0}")]
    Input(#[from] input_files::InputError),
    /// A bad record of a JSONL or JSON file, by the line it starts on (or where a whole-file JSON
    /// parse failed).
    #[error("{}:{line}: {msg}", path.display())]
    Line { path: PathBuf, line: usize, msg: String },
    /// A bad row of a Parquet / Arrow file (0-based, as `datasets` counts).
    #[error("{}: row {row}: {msg}", path.display())]
    Row { path: PathBuf, row: usize, msg: String },
    /// A file that is not what it claims, or an unsupported layout.
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    /// A bad conversation of a chitchat-dataset file.
    #[error("{}: conversation {id}: {msg}", path.display())]
    Conversation { path: PathBuf, id: String, msg: String },
}

/// The `[data] format` record shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, plugin_api::Describe)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `messages` or `conversations`, turns keyed `role`/`content` or `from`/`value`.
    #[default]
    Auto,
    /// OpenAI `{"messages": [{"role", "content"}]}`.
    Messages,
    /// The earlier name of `messages`.
    Jsonl,
    /// `{"conversations": [{"from", "value"}]}` (also `role`/`content` turns: SpecForge).
    Sharegpt,
    /// The `chitchat-dataset` package's dataset.json.
    Chitchat,
}

/// `[data.fields]`: where a record's parts are, for formats the presets do not cover.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, plugin_api::Describe)]
#[serde(deny_unknown_fields)]
pub struct Fields {
    /// Key of the list of turns.
    pub messages: Option<String>,
    /// Key of a turn's role.
    pub role: Option<String>,
    /// Key of a turn's text.
    pub content: Option<String>,
    /// Key of a top-level system prompt (used when the turns have none).
    pub system: Option<String>,
    /// Single-turn records: key of the user's text ...
    pub prompt: Option<String>,
    /// ... and of the reply (missing or empty: a prompt-only record).
    pub response: Option<String>,
    /// More role names: `{ customer = "user", agent = "assistant" }`.
    #[serde(default)]
    pub roles: BTreeMap<String, Role>,
}

/// How a record's JSON is read: the keys tried, in order, and the role names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    list: Vec<String>,
    role: Vec<String>,
    content: Vec<String>,
    system: Option<String>,
    single_turn: Option<(String, Option<String>)>,
    roles: BTreeMap<String, Role>,
}

impl Schema {
    pub fn new(format: Format, fields: &Fields) -> Schema {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let (mut list, mut role, mut content) = match format {
            Format::Messages | Format::Jsonl => (v(&["messages"]), v(&["role"]), v(&["content"])),
            Format::Sharegpt => (v(&["conversations"]), v(&["from", "role"]), v(&["value", "content"])),
            Format::Auto | Format::Chitchat => {
                (v(&["messages", "conversations"]), v(&["role", "from"]), v(&["content", "value"]))
            }
        };
        if let Some(k) = &fields.messages {
            list = vec![k.clone()];
        }
        if let Some(k) = &fields.role {
            role = vec![k.clone()];
        }
        if let Some(k) = &fields.content {
            content = vec![k.clone()];
        }
        // ShareGPT's names and the other chat UIs SpecForge maps.
        let mut roles: BTreeMap<String, Role> = [
            ("system", Role::System),
            ("user", Role::User),
            ("human", Role::User),
            ("assistant", Role::Assistant),
            ("gpt", Role::Assistant),
            ("chatgpt", Role::Assistant),
            ("bing", Role::Assistant),
            ("bard", Role::Assistant),
            ("model", Role::Assistant),
        ]
        .into_iter()
        .map(|(k, r)| (k.to_string(), r))
        .collect();
        if format == Format::Messages || format == Format::Jsonl {
            roles.retain(|k, _| matches!(k.as_str(), "system" | "user" | "assistant"));
        }
        roles.extend(fields.roles.iter().map(|(k, r)| (k.clone(), *r)));
        Schema {
            list,
            role,
            content,
            system: Some(fields.system.clone().unwrap_or_else(|| "system".into())),
            single_turn: fields.prompt.clone().map(|p| (p, fields.response.clone())),
            roles,
        }
    }

    /// OpenAI `messages` records (what `dflash-host distill --out` writes).
    pub fn messages() -> Schema {
        Schema::new(Format::Messages, &Fields::default())
    }

    /// One record from its JSON value; `Err(why)` names the field at fault.
    pub fn parse(&self, value: &Value) -> Result<ChatRecord, String> {
        let Some(object) = value.as_object() else {
            return Err(format!("expected a JSON object, got {}", kind(value)));
        };
        let mut messages = Vec::new();
        if let Some(system) = self.system.as_ref().and_then(|k| object.get(k)) {
            match system {
                Value::String(s) if !s.is_empty() => messages.push(Message { role: Role::System, content: s.clone() }),
                Value::String(_) | Value::Null => {}
                other => {
                    return Err(format!(
                        r#"field "{}" must be a string, got {}"#,
                        self.system.as_deref().unwrap_or(""),
                        kind(other)
                    ))
                }
            }
        }
        if let Some((prompt, response)) = &self.single_turn {
            let text = |key: &str, required: bool| -> Result<Option<String>, String> {
                match object.get(key) {
                    None | Some(Value::Null) if !required => Ok(None),
                    None => Err(format!(r#"missing field "{key}""#)),
                    Some(v) => content_text(v).map(Some).map_err(|why| format!(r#"field "{key}" {why}"#)),
                }
            };
            messages.push(Message { role: Role::User, content: text(prompt, true)?.unwrap_or_default() });
            if let Some(reply) =
                response.as_deref().map(|k| text(k, false)).transpose()?.flatten().filter(|r| !r.is_empty())
            {
                messages.push(Message { role: Role::Assistant, content: reply });
            }
            return Ok(ChatRecord { messages });
        }
        let Some((key, turns)) = self.list.iter().find_map(|k| object.get(k).map(|v| (k, v))) else {
            return Err(format!("missing field {}", quoted_or(&self.list)));
        };
        let Some(turns) = turns.as_array() else {
            return Err(format!(r#"field "{key}" must be an array, got {}"#, kind(turns)));
        };
        if turns.is_empty() {
            return Err(format!(r#"field "{key}" is empty"#));
        }
        let from_turns =
            turns.iter().enumerate().map(|(i, t)| self.parse_turn(key, i, t)).collect::<Result<Vec<_>, _>>()?;
        if from_turns.iter().any(|m| m.role == Role::System) {
            messages.clear(); // the turns' own system prompt wins over a top-level one
        }
        messages.extend(from_turns);
        if !messages.iter().any(|m| m.role != Role::System) {
            return Err("no user or assistant message".into());
        }
        Ok(ChatRecord { messages })
    }

    fn parse_turn(&self, list: &str, i: usize, value: &Value) -> Result<Message, String> {
        let Some(object) = value.as_object() else {
            return Err(format!("{list}[{i}] must be an object, got {}", kind(value)));
        };
        fn field<'a>(
            object: &'a serde_json::Map<String, Value>,
            keys: &'a [String],
            list: &str,
            i: usize,
        ) -> Result<(&'a String, &'a Value), String> {
            keys.iter()
                .find_map(|k| object.get(k).map(|v| (k, v)))
                .ok_or_else(|| format!("missing field {} in {list}[{i}]", quoted_or(keys)))
        }
        let (role_key, name) = field(object, &self.role, list, i)?;
        let Some(name) = name.as_str() else {
            return Err(format!(r#"field "{role_key}" in {list}[{i}] must be a string, got {}"#, kind(name)));
        };
        let role = *self.roles.get(name).ok_or_else(|| {
            format!(
                r#"unknown role "{name}" in {list}[{i}] (expected {}; map others in [data.fields] roles)"#,
                self.roles.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
            )
        })?;
        let (content_key, content) = field(object, &self.content, list, i)?;
        let content = content_text(content).map_err(|why| format!(r#"field "{content_key}" in {list}[{i}] {why}"#))?;
        Ok(Message { role, content })
    }
}

/// A message text: a string, or OpenAI content parts whose texts are joined.
fn content_text(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text") | None, Some(t)) => Ok(t),
                (Some(other), _) => Err(format!(r#"has a content part of type "{other}" (only text is read)"#)),
                (None, None) => Err(format!("has a content part that is {}, not text", kind(p))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.concat()),
        other => Err(format!("must be a string, got {}", kind(other))),
    }
}

/// `"a" or "b"`.
fn quoted_or(keys: &[String]) -> String {
    keys.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(" or ")
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
