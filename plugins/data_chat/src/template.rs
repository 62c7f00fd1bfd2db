//! Chat templates: the checkpoint's own Jinja `chat_template`, rendered the way transformers'
//! `apply_chat_template` renders it, and the loss mask computed from that rendering.
//!
//! Rendering goes through `minijinja` with HF's environment: `trim_blocks` and `lstrip_blocks`,
//! `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps` writes
//! (no HTML escaping), loop controls, Python string and dict methods, and `{% generation %}`
//! blocks (rendered as their body). The context is HF's too: `messages`, `tools` and `documents`
//! (none), `add_generation_prompt`, `bos_token` / `eos_token`, plus the config's template kwargs
//! (`enable_thinking = false` for Qwen3).
//!
//! A template is untrusted code (a config's file, or whatever a checkpoint carries), so it runs
//! sandboxed (no file access, no includes) and within limits, each rendering on its own: a fuel
//! budget ([`FUEL`]: one per instruction and per 64 bytes of data made, so it bounds time and
//! memory together; minijinja refuses an allocation such as `"x" * n` before making it when the
//! budget cannot pay for it), an output cap ([`MAX_OUTPUT`]), and functions of our own that charge
//! for what they make (`tojson`) or refuse what no real template asks (`strftime_now` formats past
//! [`MAX_STRFTIME_FORMAT`]). A template past a limit fails with [`TemplateError::Limit`], which
//! says which limit; the caller names the template's source. Under them all, a memory limit
//! ([`MAX_MEMORY`], crate::memory) sees every byte a rendering holds, including the values
//! minijinja builds without charging fuel; past it the process ends with a line naming the
//! template and the limit.
//!
//! The mask: each assistant message's content is rendered once more between two private-use
//! sentinel characters; where they land in the output, with the sentinels removed, is where the
//! content sits in the real rendering, whatever the template adds around it (headers, a default
//! system prompt, `<think>` blocks, trimming). The turn's closing marker (`<|im_end|>`,
//! `<|eot_id|>`: what a probe rendering puts right after an assistant message) is trained too, so
//! the drafter learns to stop. Tokens are then masked by their character offsets in the whole
//! rendering, which is tokenized in one piece, as transformers does.

use std::ops::Range;

use minijinja::{
    value::{Kwargs, Serde},
    Environment, Error as JinjaError, ErrorKind, State, Value,
};
use serde::Serialize;
use tokenizers::Tokenizer;

use crate::records::{Message, Role};

/// Fuel a rendering may spend (minijinja's fuel: one per instruction, one per 64 bytes of data it
/// creates): about 256 MB of data or a few hundred ms at most. Real templates spend a few
/// thousand on a short chat and ~100 per KB of conversation (the test
/// `real_templates_stay_far_below_their_limits` measures them).
pub const FUEL: u64 = 4_000_000;

/// Bytes a rendering may write: a conversation of any trainable length is far shorter.
pub const MAX_OUTPUT: usize = 64 << 20;

/// Memory a rendering may hold (live bytes on its thread beyond what it started with): well above
/// the data the fuel lets it make (~256 MB, held in buffers that grow by doubling) and the output
/// it may write; a value minijinja builds without charging fuel (a list added to itself in a
/// loop) stops here.
pub const MAX_MEMORY: usize = 1 << 30;

/// Bytes of a `strftime_now` format (real templates pass `"%d %b %Y"` and the like).
pub const MAX_STRFTIME_FORMAT: usize = 256;

/// ChatML, for checkpoints that carry no template of their own.
pub const CHATML: &str = include_str!("../templates/chatml.jinja");

/// A template built into the plugin: `[data] chat_template = "NAME"`.
pub struct Builtin {
    pub name: &'static str,
    /// Whose template it is.
    pub what: &'static str,
    pub source: &'static str,
    /// The markers it writes, which the target's tokenizer must have as special tokens (else
    /// they would be tokenized as text and the drafter would learn the wrong format).
    pub markers: &'static [&'static str],
}

const CHATML_MARKERS: &[&str] = &["<|im_start|>", "<|im_end|>"];
const LLAMA3_MARKERS: &[&str] = &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"];

/// The built-in templates (`templates/`, with where each comes from in its README): ChatML and
/// real models' templates, each rendering as transformers renders it (the renders.json tests).
pub const BUILTINS: &[Builtin] = &[
    Builtin { name: "chatml", what: "ChatML", source: CHATML, markers: CHATML_MARKERS },
    Builtin {
        name: "llama3",
        what: "Llama 3.1 / 3.3 Instruct",
        source: include_str!("../templates/llama-3.3.jinja"),
        markers: LLAMA3_MARKERS,
    },
    Builtin {
        name: "llama3.2",
        what: "Llama 3.2 Instruct",
        source: include_str!("../templates/llama-3.2.jinja"),
        markers: LLAMA3_MARKERS,
    },
    Builtin {
        name: "qwen2.5",
        what: "Qwen2.5 Instruct",
        source: include_str!("../templates/qwen2.5.jinja"),
        markers: CHATML_MARKERS,
    },
    Builtin { name: "qwen3", what: "Qwen3", source: include_str!("../templates/qwen3.jinja"), markers: CHATML_MARKERS },
    Builtin {
        name: "qwen3.5",
        what: "Qwen3.5 / Qwen3.6",
        source: include_str!("../templates/qwen3.5.jinja"),
        markers: CHATML_MARKERS,
    },
    Builtin {
        name: "smollm2",
        what: "SmolLM2 Instruct",
        source: include_str!("../templates/smollm2.jinja"),
        markers: CHATML_MARKERS,
    },
];

/// The built-in template called `name`.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

/// The built-in names, for messages: `chatml, llama3, ...`.
pub fn builtin_names() -> String {
    BUILTINS.iter().map(|b| b.name).collect::<Vec<_>>().join(", ")
}

/// `chat_template` of a parsed `tokenizer_config.json`: the string, or from a list of named
/// templates the one named `default` (as transformers picks).
pub fn in_tokenizer_config(v: &serde_json::Value) -> Option<String> {
    match &v["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()).map(str::to_string)
        }
        _ => None,
    }
}

/// What `chat_template = value` gets when it is no built-in name and nothing is at `resolved`.
pub fn unknown_template(value: &str, resolved: &std::path::Path) -> String {
    format!(
        "`{value}` is not a built-in template ({}) and not a file ({}: no such file)",
        builtin_names(),
        resolved.display()
    )
}

/// Marks the start and end of an assistant message's content in the probe renderings
/// (Unicode private use: no tokenizer or dataset gives them a meaning).
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0:#}")]
    Compile(JinjaError),
    #[error("chat template failed: {0:#}")]
    Render(JinjaError),
    #[error(
        "the chat template rewrites assistant message {index}'s text, so its tokens cannot be found in the rendering"
    )]
    Unlocatable { index: usize },
    #[error("tokenizing the rendered chat: {0}")]
    Tokenize(String),
    /// The rendering went past one of its limits (which one is said).
    #[error("chat template stopped: {0}")]
    Limit(String),
}

/// The error of a rendering that failed: a limit it passed, else minijinja's.
fn render_error(e: JinjaError, output_full: bool) -> TemplateError {
    if output_full {
        return TemplateError::Limit(format!("its output passed {MAX_OUTPUT} bytes"));
    }
    match e.kind() {
        ErrorKind::OutOfFuel => TemplateError::Limit(format!(
            "it used up its fuel ({FUEL}: one per step and per 64 bytes of data; a loop too long, or data too large)"
        )),
        _ => TemplateError::Render(e),
    }
}

/// Where a rendering writes: fails past [`MAX_OUTPUT`] bytes, and remembers that it did.
struct CappedOutput {
    bytes: Vec<u8>,
    full: bool,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_OUTPUT {
            self.full = true;
            return Err(std::io::Error::other("chat template output cap"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template with its context.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// bos_token, eos_token, ... and the config's template kwargs.
    extra: Vec<(String, Value)>,
    /// Text that closes an assistant turn (`<|im_end|>`), if the template writes one.
    closing: Option<String>,
    /// What the template is (its source), for the memory limit's line.
    name: String,
}

/// One message as templates see it (`message.role`, `message.content`).
#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: &'a str,
}

/// A rendering with, per message, the byte range of what is trained for it (assistant messages
/// only: content and closing marker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub text: String,
    pub spans: Vec<Option<Range<usize>>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedChat {
    pub ids: Vec<u32>,
    /// 1 where the token is a training target, 0 elsewhere; same length as `ids`.
    pub loss_mask: Vec<u8>,
}

impl ChatTemplate {
    /// Compile `source`. `special` are the special-token strings the template may use
    /// (`bos_token`, `eos_token`); `kwargs` the config's extra template variables.
    pub fn new(
        source: &str,
        special: &[(&str, String)],
        kwargs: &[(String, serde_json::Value)],
    ) -> Result<Self, TemplateError> {
        Self::named("the chat template", source, special, kwargs)
    }

    /// [`new`](Self::new), `name` saying what the template is (its source) where the memory
    /// limit stops it.
    pub fn named(
        name: &str,
        source: &str,
        special: &[(&str, String)],
        kwargs: &[(String, serde_json::Value)],
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(TemplateError::Compile)?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> Result<String, JinjaError> {
            if fmt.len() > MAX_STRFTIME_FORMAT {
                let why = format!("strftime_now: a format of {} bytes (at most {MAX_STRFTIME_FORMAT})", fmt.len());
                return Err(JinjaError::new(ErrorKind::InvalidOperation, why));
            }
            Ok(strftime(&fmt, unix_now()))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", strip_generation_tags(source)).map_err(TemplateError::Compile)?;
        let mut extra: Vec<(String, Value)> =
            special.iter().map(|(k, v)| (k.to_string(), Value::from(v.as_str()))).collect();
        for (k, v) in kwargs {
            extra.retain(|(name, _)| name != k);
            extra.push((k.clone(), Value::from(Serde(v))));
        }
        let mut t = ChatTemplate { env, extra, closing: None, name: name.to_string() };
        t.closing = t.probe_closing();
        Ok(t)
    }

    /// The text that closes an assistant turn, e.g. `<|im_end|>` (None if the template writes
    /// nothing after the content).
    pub fn closing(&self) -> Option<&str> {
        self.closing.as_deref()
    }

    /// The template's output for `messages`, exactly as transformers renders it.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_metered(messages, add_generation_prompt).map(|(text, _)| text)
    }

    /// [`render`](Self::render), and the fuel the rendering spent.
    fn render_metered(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<(String, u64), TemplateError> {
        let tmpl = self.env.get_template("chat").map_err(TemplateError::Render)?;
        let msgs: Vec<TemplateMessage> =
            messages.iter().map(|m| TemplateMessage { role: m.role.as_str(), content: &m.content }).collect();
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(Serde(&msgs))),
            ("add_generation_prompt".into(), Value::from(add_generation_prompt)),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
        ];
        ctx.extend(self.extra.iter().cloned());
        let ctx = Value::from(ctx.into_iter().collect::<std::collections::BTreeMap<String, Value>>());
        let mut out = CappedOutput { bytes: Vec::new(), full: false };
        let rendered = crate::memory::limited(&self.name, MAX_MEMORY, || tmpl.render_captured_to(ctx, &mut out));
        let fuel = match rendered {
            Ok(done) => done.state().fuel_levels().map_or(0, |(used, _)| used),
            Err(e) => return Err(render_error(e, out.full)),
        };
        Ok((String::from_utf8(out.bytes).expect("minijinja writes text"), fuel))
    }

    /// Render and find, for each assistant message, the bytes it is trained on.
    pub fn render_with_spans(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<Rendered, TemplateError> {
        let text = self.render(messages, add_generation_prompt)?;
        let assistants: Vec<usize> =
            messages.iter().enumerate().filter(|(_, m)| m.role == Role::Assistant).map(|(i, _)| i).collect();
        let mut spans = vec![None; messages.len()];
        if assistants.is_empty() {
            return Ok(Rendered { text, spans });
        }
        let located = match self.locate_by_sentinels(messages, add_generation_prompt, &text, &assistants) {
            Some(found) => found,
            None => locate_by_search(messages, &text, &assistants)?,
        };
        for (&i, content) in assistants.iter().zip(located) {
            let mut end = content.end;
            if let Some(closing) = &self.closing {
                // Whitespace the template kept between the content and its closing marker
                // belongs to the turn.
                let rest = &text[end..];
                let ws = rest.len() - rest.trim_start().len();
                if rest[ws..].starts_with(closing.as_str()) {
                    end += ws + closing.len();
                }
            }
            spans[i] = Some(content.start..end);
        }
        Ok(Rendered { text, spans })
    }

    /// Render and tokenize in one piece; the mask is 1 on tokens that overlap a span of a
    /// message for which `trained(i)` holds.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[Message],
        add_generation_prompt: bool,
        trained: impl Fn(usize) -> bool,
    ) -> Result<EncodedChat, TemplateError> {
        let rendered = self.render_with_spans(messages, add_generation_prompt)?;
        let spans: Vec<Range<usize>> =
            rendered.spans.iter().enumerate().filter(|(i, _)| trained(*i)).filter_map(|(_, s)| s.clone()).collect();
        encode_spans(tok, &rendered.text, &spans)
    }

    /// Where the content of each assistant message lies in `text`: rendered again with the
    /// content between sentinels. None when the template does not carry them through (it then
    /// depends on the content in ways a marker disturbs).
    fn locate_by_sentinels(
        &self,
        messages: &[Message],
        gen: bool,
        text: &str,
        assistants: &[usize],
    ) -> Option<Vec<Range<usize>>> {
        let marked: Vec<Message> = messages
            .iter()
            .map(|m| {
                if m.role == Role::Assistant {
                    Message { role: m.role, content: mark(&m.content) }
                } else {
                    m.clone()
                }
            })
            .collect();
        let with_marks = self.render(&marked, gen).ok()?;
        // Positions in the unmarked text, and which sentinel stood there.
        let mut plain = String::with_capacity(with_marks.len());
        let mut marks: Vec<(char, usize)> = Vec::new();
        for c in with_marks.chars() {
            if c == OPEN || c == CLOSE {
                marks.push((c, plain.len()));
            } else {
                plain.push(c);
            }
        }
        if plain != text {
            return None;
        }
        // The k-th CLOSE ends the k-th assistant message; its OPEN, when the template kept it,
        // comes after the previous CLOSE.
        let closes: Vec<usize> = marks.iter().enumerate().filter(|(_, (c, _))| *c == CLOSE).map(|(j, _)| j).collect();
        if closes.len() != assistants.len() {
            return None;
        }
        let mut out = Vec::with_capacity(assistants.len());
        let mut prev = 0;
        for (k, &j) in closes.iter().enumerate() {
            let end = marks[j].1;
            let open = marks[prev..j].iter().rev().find(|(c, _)| *c == OPEN).map(|&(_, at)| at);
            let start = match open {
                Some(at) => at,
                // The template cut the start off (Qwen3 moves reasoning out of the content):
                // the content's longest suffix that ends here.
                None => end - common_suffix(&text[..end], messages[assistants[k]].content.trim()),
            };
            out.push(start..end);
            prev = j + 1;
        }
        Some(out)
    }

    /// What a template writes right after an assistant message, up to the next whitespace.
    fn probe_closing(&self) -> Option<String> {
        let probe = [
            Message { role: Role::User, content: "Hi".into() },
            Message { role: Role::Assistant, content: format!("{OPEN}Hello{CLOSE}") },
        ];
        let text = self.render(&probe, false).ok()?;
        let after = &text[text.find(CLOSE)? + CLOSE.len_utf8()..];
        let closing = after.trim_start().split(char::is_whitespace).next().unwrap_or("");
        (!closing.is_empty()).then(|| closing.to_string())
    }
}

/// `content` with the sentinels around its non-whitespace part, so templates that trim keep
/// both markers.
fn mark(content: &str) -> String {
    let core = content.trim();
    let lead = content.len() - content.trim_start().len();
    let start = if core.is_empty() { content.len() } else { lead };
    format!("{}{OPEN}{core}{CLOSE}{}", &content[..start], &content[start + core.len()..])
}

/// The fallback when sentinels do not survive: each assistant message's trimmed content,
/// searched in order.
fn locate_by_search(
    messages: &[Message],
    text: &str,
    assistants: &[usize],
) -> Result<Vec<Range<usize>>, TemplateError> {
    let mut cursor = 0;
    let mut out = Vec::new();
    for &i in assistants {
        let core = messages[i].content.trim();
        let at = text[cursor..].find(core).ok_or(TemplateError::Unlocatable { index: i })? + cursor;
        out.push(at..at + core.len());
        cursor = at + core.len();
    }
    Ok(out)
}

/// Byte length of the longest common suffix of `a` and `b`, on char boundaries.
fn common_suffix(a: &str, b: &str) -> usize {
    a.chars().rev().zip(b.chars().rev()).take_while(|(x, y)| x == y).map(|(x, _)| x.len_utf8()).sum()
}

/// Tokenize `text` whole (no special tokens added: the template wrote them) and mask tokens that
/// overlap one of `spans`.
pub fn encode_spans(tok: &Tokenizer, text: &str, spans: &[Range<usize>]) -> Result<EncodedChat, TemplateError> {
    let enc = tok.encode(text, false).map_err(|e| TemplateError::Tokenize(e.to_string()))?;
    let loss_mask = enc
        .get_offsets()
        .iter()
        .map(|&(s, e)| u8::from(spans.iter().any(|r| s < r.end && r.start < e.max(s + 1))))
        .collect();
    Ok(EncodedChat { ids: enc.get_ids().to_vec(), loss_mask })
}

/// `{% generation %}` ... `{% endgeneration %}` (HF's assistant-mask extension) become an
/// always-true `if`, keeping their whitespace control.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let Some(len) = rest[at..].find("%}") else { break };
        let tag = &rest[at + 2..at + len];
        let inner = tag.trim_matches(|c: char| c == '-' || c == '+').trim();
        out.push_str(&rest[..at]);
        let lead = &tag[..tag.len() - tag.trim_start_matches(['-', '+']).len()];
        let trail = &tag[tag.trim_end_matches(['-', '+']).len()..];
        match inner {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&rest[at..at + len + 2]),
        }
        rest = &rest[at + len + 2..];
    }
    out.push_str(rest);
    out
}

/// HF's `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, no HTML escaping.
fn tojson(state: &State, value: &Value, kwargs: Kwargs) -> Result<String, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair")),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let opts = JsonOpts {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        item,
        key,
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out, state)?;
    Ok(out)
}

/// Pays fuel for `bytes` about to be written (minijinja's rate: one per 64 bytes), so a large
/// `indent` or a long escaped string is refused before it is made.
fn charge(state: &State, bytes: usize) -> Result<(), JinjaError> {
    state.consume_fuel(bytes as u64 / 64)
}

struct JsonOpts {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
    item: String,
    key: String,
}

fn write_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String, state: &State) -> Result<(), JinjaError> {
    use minijinja::value::ValueKind as K;
    let newline = |out: &mut String, depth: usize| -> Result<(), JinjaError> {
        if let Some(n) = o.indent {
            let width = n.saturating_mul(depth);
            charge(state, width)?;
            out.push('\n');
            out.push_str(&" ".repeat(width));
        }
        Ok(())
    };
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number if v.is_integer() => out.push_str(&v.to_string()),
        K::Number => out.push_str(&python_float(f64::try_from(v.clone())?)),
        K::Seq | K::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1)?;
                write_json(item, o, depth + 1, out, state)?;
            }
            newline(out, depth)?;
            out.push(']');
        }
        K::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1)?;
                write_json_str(&k.to_string(), o.ensure_ascii, out, state)?;
                out.push_str(&o.key);
                write_json(&v.get_item(k)?, o, depth + 1, out, state)?;
            }
            newline(out, depth)?;
            out.push('}');
        }
        // Strings, and whatever else prints as text.
        _ => write_json_str(&v.to_string(), o.ensure_ascii, out, state)?,
    }
    Ok(())
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String, state: &State) -> Result<(), JinjaError> {
    // Escaping writes at most 6 bytes a byte (`\u001f` for one control byte).
    charge(state, s.len().saturating_mul(6))?;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    Ok(())
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let a = x.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{x:e}"); // "1.5e20", "1e-5"
        let (mant, exp) = s.split_once('e').expect("exponent form");
        let exp: i32 = exp.parse().expect("exponent");
        return format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let s = format!("{x:?}"); // shortest round-trip: "1.0", "0.1", "123.5"
    if s.contains('e') {
        format!("{x}")
    } else {
        s
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// The subset of `strftime` chat templates use (`%d %b %Y` and friends), in UTC.
fn strftime(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{:03}", doy_of_year(year, month, day))),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn doy_of_year(year: i64, month: i64, day: i64) -> i64 {
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    before + day + i64::from(leap && month > 2)
}

/// A tokenizer for tests: one token per byte, the chat markers as special tokens, so every
/// character's mask is visible.
#[cfg(test)]
pub(crate) mod test_util {
    use serde_json::json;
    use std::str::FromStr;
    use tokenizers::Tokenizer;

    /// GPT-2's byte-to-character table (what the ByteLevel pre-tokenizer maps bytes to).
    fn byte_chars() -> Vec<char> {
        let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
        let mut chars: Vec<u32> = printable.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !printable.contains(&b) {
                printable.push(b);
                chars.push(256 + n);
                n += 1;
            }
        }
        let mut table = vec!['\0'; 256];
        for (b, c) in printable.iter().zip(chars) {
            table[*b as usize] = char::from_u32(c).unwrap();
        }
        table
    }

    /// One token per byte, plus the templates' markers as special tokens: every character's
    /// mask is visible.
    pub(crate) fn byte_tokenizer() -> Tokenizer {
        let table = byte_chars();
        let vocab: serde_json::Map<String, serde_json::Value> =
            table.iter().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
        let markers = [
            "<|im_start|>",
            "<|im_end|>",
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ];
        let added: Vec<serde_json::Value> = markers
            .iter()
            .enumerate()
            .map(|(i, m)| json!({"id": 256 + i, "content": m, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let byte_level =
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
        });
        Tokenizer::from_str(&spec.to_string()).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::byte_tokenizer;
    use super::*;
    use serde_json::json;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates")
    }

    /// The template files (the built-ins).
    fn templates() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("templates")
    }

    /// renders.json (made by scripts/fixtures/make_template_fixtures.py with transformers).
    fn renders() -> serde_json::Value {
        let path = fixtures().join("renders.json");
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap()
    }

    fn messages(v: &serde_json::Value) -> Vec<Message> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|m| Message {
                role: serde_json::from_value(m["role"].clone()).unwrap(),
                content: m["content"].as_str().unwrap().to_string(),
            })
            .collect()
    }

    /// The fixture's template `name` with its special tokens and `kwargs`.
    fn fixture_template(doc: &serde_json::Value, name: &str, kwargs: &serde_json::Value) -> ChatTemplate {
        let source = std::fs::read_to_string(templates().join(format!("{name}.jinja"))).unwrap();
        let special: Vec<(&str, String)> = doc["special_tokens"][name]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap().to_string()))
            .collect();
        let kwargs: Vec<(String, serde_json::Value)> =
            kwargs.as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        ChatTemplate::new(&source, &special, &kwargs).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    #[test]
    fn every_template_renders_exactly_as_transformers() {
        let doc = renders();
        let cases = doc["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 39);
        let mut wrong = Vec::new();
        for case in cases {
            let name = case["template"].as_str().unwrap();
            let conv = case["conversation"].as_str().unwrap();
            let t = fixture_template(&doc, name, &case["kwargs"]);
            let msgs = messages(&doc["conversations"][conv]);
            let got = t.render(&msgs, case["add_generation_prompt"].as_bool().unwrap()).unwrap();
            if got != case["rendered"].as_str().unwrap() {
                wrong.push(format!(
                    "{name} / {conv} / {}:\n  want {:?}\n  got  {:?}",
                    case["kwargs"], case["rendered"], got
                ));
            }
        }
        assert!(wrong.is_empty(), "{} of {} renders differ:\n{}", wrong.len(), cases.len(), wrong.join("\n"));
    }

    #[test]
    fn masks_cover_each_reply_and_its_closing_marker_and_nothing_else() {
        let doc = renders();
        let tok = byte_tokenizer();
        for case in doc["cases"].as_array().unwrap() {
            let name = case["template"].as_str().unwrap();
            let conv = case["conversation"].as_str().unwrap();
            let t = fixture_template(&doc, name, &case["kwargs"]);
            let closing = if name.starts_with("llama") { "<|eot_id|>" } else { "<|im_end|>" };
            assert_eq!(t.closing(), Some(closing), "{name}");
            let msgs = messages(&doc["conversations"][conv]);
            let gen = case["add_generation_prompt"].as_bool().unwrap();
            let r = t.render_with_spans(&msgs, gen).unwrap();
            let mut expected = String::new();
            for (i, m) in msgs.iter().enumerate() {
                let Some(span) = &r.spans[i] else {
                    assert_ne!(m.role, Role::Assistant, "{name} / {conv}: no span for message {i}");
                    continue;
                };
                let trained = &r.text[span.clone()];
                let body = trained
                    .strip_suffix(closing)
                    .unwrap_or_else(|| panic!("{name} / {conv}: {trained:?} lacks {closing}"));
                assert_eq!(body.trim(), m.content.trim(), "{name} / {conv}: message {i}");
                expected.push_str(trained);
            }
            // Token level: what the mask selects decodes to exactly those spans.
            let enc = t.encode(&tok, &msgs, gen, |_| true).unwrap();
            let ids: Vec<u32> =
                enc.ids.iter().zip(&enc.loss_mask).filter(|(_, &m)| m == 1).map(|(&id, _)| id).collect();
            assert_eq!(tok.decode(&ids, false).unwrap(), expected, "{name} / {conv}");
            assert_eq!(tok.decode(&enc.ids, false).unwrap(), r.text, "{name} / {conv}: tokenized in one piece");
        }
    }

    #[test]
    fn only_the_chosen_replies_are_trained() {
        let doc = renders();
        let t = fixture_template(&doc, "qwen2.5", &json!({}));
        let tok = byte_tokenizer();
        let msgs = messages(&doc["conversations"]["multi_turn"]);
        let enc = t.encode(&tok, &msgs, false, |i| i == 3).unwrap();
        let ids: Vec<u32> = enc.ids.iter().zip(&enc.loss_mask).filter(|(_, &m)| m == 1).map(|(&id, _)| id).collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "Sure: \"{{ nothing }}\" — done. 😀  <|im_end|>");
        // The generation prompt is never trained.
        let enc = t.encode(&tok, &msgs[..3], true, |_| true).unwrap();
        assert!(tok.decode(&enc.ids, false).unwrap().ends_with("<|im_start|>assistant\n"));
        assert_eq!(enc.loss_mask.iter().rev().take(21).sum::<u8>(), 0);
    }

    #[test]
    fn a_template_that_rewrites_replies_is_refused_naming_the_message() {
        // Renders the reply's length, not its text: nothing to mask.
        let t =
            ChatTemplate::new("{% for m in messages %}{{ m.role }}:{{ m.content | length }};{% endfor %}", &[], &[])
                .unwrap();
        let msgs = vec![
            Message { role: Role::User, content: "hi".into() },
            Message { role: Role::Assistant, content: "hello".into() },
        ];
        assert_eq!(t.render(&msgs, false).unwrap(), "user:2;assistant:5;");
        let err = t.render_with_spans(&msgs, false).unwrap_err();
        assert!(matches!(err, TemplateError::Unlocatable { index: 1 }), "{err}");
        assert_eq!(t.closing(), None, "the probe's reply is not in the rendering either");
    }

    #[test]
    fn a_reply_cut_at_its_start_is_found_by_its_end() {
        // Keeps what follows the last "|" (as Qwen3 keeps what follows </think>).
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content.split('|')[-1] }}</s>{% endfor %}",
            &[],
            &[],
        )
        .unwrap();
        let msgs = vec![
            Message { role: Role::User, content: "q".into() },
            Message { role: Role::Assistant, content: "hidden|shown".into() },
        ];
        let r = t.render_with_spans(&msgs, false).unwrap();
        assert_eq!(r.text, "<user>q</s><assistant>shown</s>");
        assert_eq!(&r.text[r.spans[1].clone().unwrap()], "shown</s>");
    }

    #[test]
    fn broken_templates_fail_with_the_jinja_error() {
        let err = ChatTemplate::new("{% for m in messages %}", &[], &[]).err().unwrap();
        assert!(err.to_string().starts_with("chat template does not compile: "), "{err}");
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", &[], &[]).unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    /// Renders `source` (no messages) on this thread with at most 1 GiB allocated: the error,
    /// the seconds it took and the most memory it held at once.
    fn render_hostile(source: &str) -> (String, f64, usize) {
        let t0 = std::time::Instant::now();
        let (err, peak) = crate::memory::measure(1 << 30, || {
            let t = ChatTemplate::new(source, &[], &[]).unwrap_or_else(|e| panic!("{source}: {e}"));
            match t.render(&[], false) {
                Ok(text) => panic!("{source}: rendered {} bytes", text.len()),
                Err(e) => e.to_string(),
            }
        });
        (err, t0.elapsed().as_secs_f64(), peak)
    }

    #[test]
    fn templates_stop_at_their_limits_fast_and_small() {
        // Each ran for minutes or took gigabytes before templates had limits.
        let fuel = "it used up its fuel";
        let output = "its output passed 67108864 bytes";
        let cases = [
            // Nested loops (minutes).
            ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", fuel),
            // A large string written in a loop (10.7 GB).
            ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", output),
            // Growing a variable, never written.
            ("{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s ~ ('x' * 100000) %}{% endfor %}", fuel),
            // One huge repetition, refused before it is made.
            ("{{ ('x' * 100000000000) | length }}", fuel),
            // strftime_now with a huge format (2.2 GB), and with a modest one past its cap.
            ("{{ strftime_now('%A' * 1000000000) }}", fuel),
            ("{{ strftime_now('%A' * 1000) }}", "strftime_now: a format of 2000 bytes (at most 256)"),
            // tojson with a huge indent, and over a huge list.
            ("{{ [[1]] | tojson(indent=10000000000) }}", fuel),
            ("{{ range(100000) | list | tojson(indent=1000) }}", "stopped"),
            // Python string methods that multiply their input, and joins.
            ("{{ ('y' * 100000).replace('', 'z' * 100000) | length }}", fuel),
            ("{{ ('z' * 1000000).join(range(100000) | map('string')) | length }}", fuel),
            ("{{ range(100000) | join('w' * 1000000) | length }}", fuel),
            ("{{ ('a\n' * 100000) | indent(100000) | length }}", fuel),
            // Recursion.
            ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
        ];
        for (source, want) in cases {
            let (err, secs, peak) = render_hostile(source);
            assert!(err.contains(want), "{source}: {err}");
            assert!(secs < 5.0, "{source}: {secs:.1} s");
            assert!(peak < 512 << 20, "{source}: {} MiB", peak >> 20);
        }
    }

    #[test]
    fn real_templates_stay_far_below_their_limits() {
        let doc = renders();
        let mut most = 0;
        for case in doc["cases"].as_array().unwrap() {
            let name = case["template"].as_str().unwrap();
            let t = fixture_template(&doc, name, &case["kwargs"]);
            let msgs = messages(&doc["conversations"][case["conversation"].as_str().unwrap()]);
            let (_, fuel) = t.render_metered(&msgs, case["add_generation_prompt"].as_bool().unwrap()).unwrap();
            most = most.max(fuel);
        }
        assert!(most < FUEL / 200, "a short chat spent {most} fuel");
        // A long conversation (60 turns, 180 KB) in each template: well within the budget.
        let long: Vec<Message> = (0..60)
            .map(|i| Message {
                role: if i % 2 == 0 { Role::User } else { Role::Assistant },
                content: format!("turn {i}: {}", "words and more words, ".repeat(140)),
            })
            .collect();
        for name in ["qwen3", "qwen3.5", "llama-3.3", "qwen2.5", "smollm2"] {
            let t = fixture_template(&doc, name, &json!({}));
            let (text, fuel) = t.render_metered(&long, false).unwrap();
            assert!(text.len() > 180_000 && fuel < FUEL / 20, "{name}: {fuel} fuel for {} bytes", text.len());
        }
    }

    #[test]
    fn hf_extensions_behave_as_in_transformers() {
        let render = |src: &str, kwargs: serde_json::Value| {
            let kw: Vec<(String, serde_json::Value)> =
                kwargs.as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            ChatTemplate::new(src, &[("bos_token", "<s>".to_string())], &kw).unwrap().render(&[], false).unwrap()
        };
        // Python's json.dumps (outputs copied from Python 3); keys keep their order.
        assert_eq!(
            render(
                r#"{{ {"name": "f", "args": [1, 2.5, v, none, true, 1e20, 1e-5, 0.1], "é": {}, "l": []} | tojson }}"#,
                json!({"v": "x\"y\\n"})
            ),
            r#"{"name": "f", "args": [1, 2.5, "x\"y\\n", null, true, 1e+20, 1e-05, 0.1], "é": {}, "l": []}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", json!({"v": {"a": [1, null], "b": {}}})),
            "{\n  \"a\": [\n    1,\n    null\n  ],\n  \"b\": {}\n}"
        );
        assert_eq!(render("{{ v | tojson(ensure_ascii=true) }}", json!({"v": "é"})), r#""\u00e9""#);
        assert_eq!(render("{{ v | tojson(sort_keys=true) }}", json!({"v": {"b": 1, "a": 2}})), r#"{"a": 2, "b": 1}"#);
        // Generation blocks render their body; whitespace control is kept.
        assert_eq!(render("a {%- generation %} b {% endgeneration -%} c", json!({})), "a b c");
        // Loop controls, namespace, Python methods, the bos_token variable, `is false`.
        assert_eq!(
            render(
                "{%- set ns = namespace(n=0) %}{%- for x in [1,2,3,4] %}{%- if x == 3 %}{% break %}{% endif %}{%- set ns.n = ns.n + x %}{%- endfor %}{{ ns.n }} {{ ' A b '.strip().lower() }} {{ bos_token }} {{ flag is false }}",
                json!({"flag": false})
            ),
            "3 a b <s> True" // Python prints booleans capitalised, so does minijinja
        );
        assert_eq!(
            strftime("%d %b %Y|%A %a %B %m %y %H:%M:%S %j %%", 1_796_216_709),
            "02 Dec 2026|Wednesday Wed December 12 26 13:05:09 336 %"
        );
        assert_eq!(strftime("%d %b %Y %j %a", 1_709_164_800), "29 Feb 2024 060 Thu");
    }
}
