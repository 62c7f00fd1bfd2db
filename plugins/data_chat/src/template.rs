//! The ChatML chat template (SmolLM2 and Qwen use it) and its loss mask.
//!
//! Each message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`; a generation
//! prompt is `<|im_start|>assistant\n`. Pieces are tokenized one by one so that each
//! token's mask is known exactly instead of guessed from character offsets. For the
//! byte-level BPE tokenizers of SmolLM2 and Qwen this gives the same ids as tokenizing
//! the whole rendered string: the markers are special tokens (always split out), and
//! their pre-tokenizers already split after a header's "\n".

use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::records::{DataError, Message, Role};

pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// Which assistant turns are trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssistantMask {
    /// Every assistant turn.
    #[default]
    All,
    /// Only the last assistant turn; earlier ones are context.
    LastOnly,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeOpts {
    /// Inserted first when the record has no system message.
    pub default_system: Option<String>,
    /// Append `<|im_start|>assistant\n` (mask 0), as when prompting for a reply.
    pub add_generation_prompt: bool,
    /// Keep at most this many tokens, cutting at the end; the mask is cut with them.
    pub max_len: usize,
    pub mask_assistant: AssistantMask,
}

impl Default for EncodeOpts {
    fn default() -> Self {
        EncodeOpts {
            default_system: None,
            add_generation_prompt: false,
            max_len: usize::MAX,
            mask_assistant: AssistantMask::All,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodedChat {
    pub ids: Vec<u32>,
    /// 1 where the token is a training target, 0 elsewhere; same length as `ids`.
    pub loss_mask: Vec<u8>,
}

impl EncodedChat {
    fn push(&mut self, ids: &[u32], mask: u8) {
        self.ids.extend_from_slice(ids);
        self.loss_mask.extend(std::iter::repeat_n(mask, ids.len()));
    }
}

/// Renders `messages` with ChatML and tokenizes them.
///
/// The mask is 1 on the content tokens of the trained assistant turns and on their
/// closing `<|im_end|>` (so the model learns to stop), 0 on everything else: role
/// headers, system and user text, the "\n" after `<|im_end|>`, the generation prompt.
pub fn encode_chatml(
    tok: &Tokenizer,
    messages: &[Message],
    opts: &EncodeOpts,
) -> Result<EncodedChat, DataError> {
    // Unless the markers are special added tokens they are split into ordinary pieces
    // ("<", "|", ...) and training would silently learn the wrong template.
    let marker_id = |token: &str| {
        tok.token_to_id(token)
            .filter(|_| tok.get_added_vocabulary().is_special_token(token))
            .ok_or_else(|| DataError::MissingToken {
                token: token.to_string(),
            })
    };
    marker_id(IM_START)?;
    let im_end = marker_id(IM_END)?;
    let encode = |text: &str, what: &str| -> Result<Vec<u32>, DataError> {
        tok.encode(text, false)
            .map(|enc| enc.get_ids().to_vec())
            .map_err(|cause| DataError::Tokenize {
                what: what.to_string(),
                cause,
            })
    };
    let header = |role: Role| encode(&format!("{IM_START}{}\n", role.as_str()), "a role header");
    let newline = encode("\n", "a newline")?;

    let last_assistant = messages.iter().rposition(|m| m.role == Role::Assistant);
    let trained = |i: usize, m: &Message| {
        m.role == Role::Assistant
            && match opts.mask_assistant {
                AssistantMask::All => true,
                AssistantMask::LastOnly => Some(i) == last_assistant,
            }
    };
    let system = match &opts.default_system {
        Some(content) if !messages.iter().any(|m| m.role == Role::System) => Some(Message {
            role: Role::System,
            content: content.clone(),
        }),
        _ => None,
    };
    let turns = system
        .iter()
        .map(|m| (m, false))
        .chain(messages.iter().enumerate().map(|(i, m)| (m, trained(i, m))));

    let mut out = EncodedChat::default();
    for (message, trained) in turns {
        let mask = u8::from(trained);
        out.push(&header(message.role)?, 0);
        out.push(&encode(&message.content, "message content")?, mask);
        out.push(&[im_end], mask);
        out.push(&newline, 0);
    }
    if opts.add_generation_prompt {
        out.push(&header(Role::Assistant)?, 0);
    }
    out.ids.truncate(opts.max_len);
    out.loss_mask.truncate(opts.max_len);
    Ok(out)
}

/// Splits a conversation for self-distillation: everything before the last assistant
/// message (to re-render with `add_generation_prompt`) and that reply.
/// Messages after the last reply are dropped. `None` if there is no assistant message.
pub fn prompt_for_last_reply(messages: &[Message]) -> Option<(Vec<Message>, &Message)> {
    let last = messages.iter().rposition(|m| m.role == Role::Assistant)?;
    Some((messages[..last].to_vec(), &messages[last]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::str::FromStr;

    /// A word-level tokenizer: splits on spaces (dropped) and newlines (kept as a token),
    /// with the ChatML markers as special added tokens.
    fn tiny_tokenizer(with_markers: bool) -> Tokenizer {
        let words = [
            "[UNK]",
            IM_START,
            IM_END,
            "\n",
            "system",
            "user",
            "assistant",
            "be",
            "brief",
            "hi",
            "hello",
            "there",
            "how",
            "are",
            "you",
            "fine",
            "bye",
            "now",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let added = |id: usize, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        let added_tokens = if with_markers {
            vec![added(1, IM_START), added(2, IM_END)]
        } else {
            vec![]
        };
        let spec = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added_tokens,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": false},
                {"type": "Split", "pattern": {"String": "\n"}, "behavior": "Isolated", "invert": false},
            ]},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        Tokenizer::from_str(&spec.to_string()).unwrap()
    }

    fn msg(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.to_string(),
        }
    }

    fn chat() -> Vec<Message> {
        vec![
            msg(Role::System, "be brief"),
            msg(Role::User, "hi"),
            msg(Role::Assistant, "hello there"),
            msg(Role::User, "how are you"),
            msg(Role::Assistant, "fine"),
        ]
    }

    /// The chat rendered as one string, the way a Jinja ChatML template would.
    fn render(messages: &[Message], generation_prompt: bool) -> String {
        let mut text: String = messages
            .iter()
            .map(|m| format!("{IM_START}{}\n{}{IM_END}\n", m.role.as_str(), m.content))
            .collect();
        if generation_prompt {
            text.push_str(&format!("{IM_START}assistant\n"));
        }
        text
    }

    fn tokens(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
    }

    /// The tokens whose mask is 1.
    fn masked(tok: &Tokenizer, enc: &EncodedChat) -> Vec<String> {
        assert_eq!(enc.ids.len(), enc.loss_mask.len());
        let ids: Vec<u32> = enc
            .ids
            .iter()
            .zip(&enc.loss_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&id, _)| id)
            .collect();
        tokens(tok, &ids)
    }

    #[test]
    fn pieces_match_the_whole_rendered_string() {
        let tok = tiny_tokenizer(true);
        let enc = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap();
        let whole = tok.encode(render(&chat(), false), false).unwrap();
        assert_eq!(enc.ids, whole.get_ids());
        assert_eq!(
            tokens(&tok, &enc.ids[..8]),
            vec![IM_START, "system", "\n", "be", "brief", IM_END, "\n", IM_START]
        );
    }

    #[test]
    fn mask_all_covers_every_reply_and_its_im_end() {
        let tok = tiny_tokenizer(true);
        let enc = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap();
        assert_eq!(
            masked(&tok, &enc),
            vec!["hello", "there", IM_END, "fine", IM_END]
        );
        // Exact positions: system is tokens 0..7, user 7..13, the assistant header 13..16,
        // "hello there" + im_end 16..19, its "\n" 19; user 20..28, header 28..31,
        // "fine" + im_end 31..33, the final "\n" 33.
        let ones: Vec<usize> = (0..enc.ids.len())
            .filter(|&i| enc.loss_mask[i] == 1)
            .collect();
        assert_eq!(ones, vec![16, 17, 18, 31, 32]);
        assert_eq!(enc.ids.len(), 34);
        assert_eq!(tokens(&tok, &enc.ids[19..20]), vec!["\n"]);
    }

    #[test]
    fn mask_last_only_covers_just_the_final_reply() {
        let tok = tiny_tokenizer(true);
        let opts = EncodeOpts {
            mask_assistant: AssistantMask::LastOnly,
            ..EncodeOpts::default()
        };
        let enc = encode_chatml(&tok, &chat(), &opts).unwrap();
        assert_eq!(masked(&tok, &enc), vec!["fine", IM_END]);
        let ones: Vec<usize> = (0..enc.ids.len())
            .filter(|&i| enc.loss_mask[i] == 1)
            .collect();
        assert_eq!(ones, vec![31, 32]);
        // Same ids as with AssistantMask::All: only the mask differs.
        let all = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap();
        assert_eq!(enc.ids, all.ids);
    }

    #[test]
    fn default_system_is_inserted_only_when_missing() {
        let tok = tiny_tokenizer(true);
        let opts = EncodeOpts {
            default_system: Some("be brief".to_string()),
            ..EncodeOpts::default()
        };
        let without_system = &chat()[1..];
        let enc = encode_chatml(&tok, without_system, &opts).unwrap();
        let plain = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap();
        assert_eq!(
            enc, plain,
            "inserted system renders like a given one, mask 0"
        );

        let mut own = chat();
        own[0].content = "hi".to_string();
        let enc = encode_chatml(&tok, &own, &opts).unwrap();
        assert_eq!(
            enc.ids,
            tok.encode(render(&own, false), false).unwrap().get_ids()
        );
    }

    #[test]
    fn generation_prompt_is_appended_unmasked() {
        let tok = tiny_tokenizer(true);
        let messages = chat();
        let (prompt, reply) = prompt_for_last_reply(&messages).unwrap();
        assert_eq!(reply, &msg(Role::Assistant, "fine"));
        let opts = EncodeOpts {
            add_generation_prompt: true,
            ..EncodeOpts::default()
        };
        let enc = encode_chatml(&tok, &prompt, &opts).unwrap();
        assert_eq!(
            enc.ids,
            tok.encode(render(&prompt, true), false).unwrap().get_ids()
        );
        assert_eq!(
            tokens(&tok, &enc.ids[enc.ids.len() - 3..]),
            vec![IM_START, "assistant", "\n"]
        );
        assert_eq!(masked(&tok, &enc), vec!["hello", "there", IM_END]);
        assert_eq!(&enc.loss_mask[enc.ids.len() - 3..], &[0, 0, 0]);
    }

    #[test]
    fn truncation_cuts_ids_and_mask_together() {
        let tok = tiny_tokenizer(true);
        let full = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap();
        for max_len in [0, 17, 33, 34, 1000] {
            let opts = EncodeOpts {
                max_len,
                ..EncodeOpts::default()
            };
            let enc = encode_chatml(&tok, &chat(), &opts).unwrap();
            let n = max_len.min(full.ids.len());
            assert_eq!(enc.ids, &full.ids[..n], "max_len {max_len}");
            assert_eq!(enc.loss_mask, &full.loss_mask[..n], "max_len {max_len}");
        }
        // Cut inside the first reply: only "hello" survives as a target.
        let opts = EncodeOpts {
            max_len: 17,
            ..EncodeOpts::default()
        };
        let enc = encode_chatml(&tok, &chat(), &opts).unwrap();
        assert_eq!(masked(&tok, &enc), vec!["hello"]);
    }

    #[test]
    fn markers_must_be_special_added_tokens() {
        // The vocab holds the marker strings, but as plain words they would be merged
        // with the role name ("<|im_start|>user") and never split out.
        let tok = tiny_tokenizer(false);
        let err = encode_chatml(&tok, &chat(), &EncodeOpts::default()).unwrap_err();
        assert!(
            matches!(&err, DataError::MissingToken { token } if token == IM_START),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            r#"tokenizer has no special token "<|im_start|>"; ChatML needs it as a special added token"#
        );
    }

    #[test]
    fn prompt_for_last_reply_splits_at_the_last_assistant() {
        let mut messages = chat();
        messages.push(msg(Role::User, "bye"));
        let (prompt, reply) = prompt_for_last_reply(&messages).unwrap();
        assert_eq!(prompt, chat()[..4].to_vec());
        assert_eq!(reply.content, "fine");
        assert!(prompt_for_last_reply(&chat()[..2]).is_none());
    }
}
