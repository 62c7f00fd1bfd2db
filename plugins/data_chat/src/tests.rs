use super::*;

fn chat_data(path: &std::path::Path, on_error: &str) -> Result<ChatData, PluginError> {
    let text = format!("path = \"x\"\nformat = \"jsonl\"\non_error = \"{on_error}\"\ndistill = false");
    let cfg: ChatSection = plugin_api::parse_section(&text).unwrap();
    ChatData::new(cfg, path.to_path_buf(), std::path::PathBuf::new(), 0)
}

#[test]
fn a_dataset_that_is_missing_empty_or_all_bad_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.jsonl");
    let err = chat_data(&path, "fail").err().unwrap().to_string();
    assert!(err.starts_with(&format!("field `path`: {}: ", path.display())), "{err}");
    std::fs::write(&path, "\n  \n").unwrap();
    let err = chat_data(&path, "fail").err().unwrap().to_string();
    assert_eq!(err, format!("{}: no usable records", path.display()));
    std::fs::write(&path, "{\"messages\": []}\nnot json\n").unwrap();
    let err = chat_data(&path, "skip").err().unwrap().to_string();
    assert_eq!(err, format!("{}: no usable records", path.display()));
    let err = chat_data(&path, "fail").err().unwrap().to_string();
    assert_eq!(err, format!("field `path`: {}:1: field \"messages\" is empty", path.display()));
}

#[test]
fn batches_pad_to_a_multiple_capped_at_max_len() {
    assert_eq!(padded_len(100, 64, 192), 128);
    assert_eq!(padded_len(128, 64, 192), 128);
    assert_eq!(padded_len(129, 64, 192), 192);
    assert_eq!(padded_len(181, 64, 192), 192);
    assert_eq!(padded_len(70, 64, 96), 96);
    assert_eq!(padded_len(57, 1, 96), 57);
    assert_eq!(padded_len(200, 64, 192), 200); // longer than max_len: never cut
}

#[test]
fn humaneval_gives_164_code_requests() {
    let cache = std::env::var_os("DFLASH_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/dflash"));
    let path = cache.join("HumanEval.jsonl.gz");
    assert!(path.exists(), "{} is missing: run `make setup`", path.display());
    let records = humaneval_records(&path).unwrap();
    assert_eq!(records.len(), 164);
    let first = &records[0].messages[0].content;
    assert!(first.contains("def has_close_elements("), "{first}");
    assert!(records.iter().all(|r| r.is_open() && r.messages.len() == 1));
}

use template::test_util::byte_tokenizer;

const EOS: u32 = 257; // <|im_end|> in the byte tokenizer

/// A two-record dataset: a conversation with two replies and a prompt without one.
fn dataset(dir: &Path) -> PathBuf {
    let path = dir.join("chat.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"},{"role":"assistant","content":"d"}]}"#,
            "\n",
            r#"{"messages":[{"role":"user","content":"p"}]}"#,
            "\n",
        ),
    )
    .unwrap();
    path
}

/// The plugin on `path` with `extra` config lines, opened with the byte tokenizer and
/// `template` as the checkpoint's.
fn opened(path: &Path, extra: &str, template: &str) -> Result<(ChatData, DataSummary), PluginError> {
    let text = format!("path = \"x\"\nmax_len = 256\npad_to_multiple_of = 1\n{extra}");
    let cfg: ChatSection = plugin_api::parse_section(&text)?;
    let mut data = ChatData::new(cfg, path.to_path_buf(), PathBuf::new(), 0)?
        .with_template(None, template, "")?
        .with_special_ids(None, Some(EOS), None);
    let summary = data.open_impl(&byte_tokenizer().to_string(false).unwrap())?;
    Ok((data, summary))
}

fn text(ids: &[u32]) -> String {
    byte_tokenizer().decode(ids, false).unwrap()
}

fn trained(e: &EncodedChat) -> String {
    let ids: Vec<u32> = e.ids.iter().zip(&e.loss_mask).filter(|(_, &m)| m == 1).map(|(&i, _)| i).collect();
    text(&ids)
}

/// The target's reply: `words` then the stop token.
fn reply(words: &str) -> Vec<u32> {
    let mut ids = byte_tokenizer().encode(words, false).unwrap().get_ids().to_vec();
    ids.push(EOS);
    ids
}

#[test]
fn without_distillation_every_reply_is_trained_and_prompts_are_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let (data, summary) = opened(&dataset(dir.path()), "distill = false", "").unwrap();
    assert_eq!(data.examples.len(), 1);
    let e = &data.examples[0].encoded;
    assert_eq!(text(&e.ids), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\nd<|im_end|>\n");
    assert_eq!(trained(e), "b<|im_end|>d<|im_end|>");
    assert!(data.distill_request().prompts.is_empty());
    let d = summary.description.as_str();
    assert!(d.contains("template: ChatML (the checkpoint has no chat template)"), "{d}");
    assert!(d.contains("1 prompt-only record left out"), "{d}");
    assert!(!d.contains("self-distillation"), "{d}");
}

#[test]
fn distill_last_regenerates_one_reply_per_record_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (mut data, summary) = opened(&dataset(dir.path()), "distill = \"last\"", "").unwrap();
    let d = summary.description.as_str();
    assert!(
        d.contains("self-distillation (distill = \"last\"): the target regenerates 1 of the dataset's 2 replies and answers 1 prompt (greedy, at most 64 tokens each); to train on the dataset's own replies instead, set distill = false in [data]"),
        "{d}"
    );
    let req = data.distill_request();
    assert_eq!(req.prompts.len(), 2);
    assert_eq!(req.stop_tokens.as_slice(), &[EOS]);
    assert_eq!(data.distill_options().replies_total, 2);
    for p in req.prompts.iter() {
        assert!(text(p).ends_with("<|im_start|>assistant\n"), "{}", text(p));
    }
    assert_eq!(text(&req.prompts[1]), "<|im_start|>user\np<|im_end|>\n<|im_start|>assistant\n");
    assert!(data.next_batch().is_err(), "no batch before the replies");
    data.set_distilled_impl(vec![reply("X"), reply("Y")]).unwrap();
    assert!(data.distill_request().prompts.is_empty());
    for (e, r) in data.examples.iter().zip(["X", "Y"]) {
        assert_eq!(trained(&e.encoded), format!("{r}<|im_end|>"));
    }
    let out = data.distilled_records().unwrap();
    assert_eq!(
        out[1].messages,
        vec![Message { role: Role::User, content: "p".into() }, Message { role: Role::Assistant, content: "Y".into() }]
    );
    assert_eq!(out[0].messages.last().unwrap().content, "X");
}

#[test]
fn special_tokens_inside_a_distilled_reply_are_kept() {
    // A target writes special-flagged tokens mid-reply (Qwen3's `<think>` / `</think>`): they are
    // trained on as the same tokens, not dropped from the text.
    let dir = tempfile::tempdir().unwrap();
    let (mut data, _) = opened(&dataset(dir.path()), "distill = \"last\"", "").unwrap();
    let think = byte_tokenizer().token_to_id("<|begin_of_text|>").unwrap();
    let mut with_special = byte_tokenizer().encode("XQ", false).unwrap().get_ids().to_vec();
    with_special.extend([think, EOS]);
    data.set_distilled_impl(vec![with_special, reply("Y")]).unwrap();
    assert_eq!(trained(&data.examples[0].encoded), "XQ<|begin_of_text|><|im_end|>");
    let trained_ids: Vec<u32> = data.examples[0]
        .encoded
        .ids
        .iter()
        .zip(&data.examples[0].encoded.loss_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&i, _)| i)
        .collect();
    assert!(trained_ids.contains(&think), "the special token is one token again: {trained_ids:?}");
    assert_eq!(data.distilled_records().unwrap()[0].messages.last().unwrap().content, "XQ<|begin_of_text|>");
}

#[test]
fn distill_all_regenerates_every_reply_turn_by_turn() {
    let dir = tempfile::tempdir().unwrap();
    let (mut data, summary) = opened(&dataset(dir.path()), "distill = \"all\"", "").unwrap();
    assert!(
        summary.description.contains("regenerates 2 of the dataset's 2 replies and answers 1 prompt"),
        "{}",
        summary.description
    );
    assert_eq!(data.distill_options().replies_total, 3);
    let req = data.distill_request();
    assert_eq!(
        text(&req.prompts[0]),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    );
    data.set_distilled_impl(vec![reply("X"), reply("Z")]).unwrap();
    // Round two: the first conversation's next prompt carries the target's first reply.
    let req = data.distill_request();
    assert_eq!(req.prompts.len(), 1);
    assert_eq!(
        text(&req.prompts[0]),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nX<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    );
    data.set_distilled_impl(vec![reply("Y")]).unwrap();
    assert!(data.distill_request().prompts.is_empty());
    assert_eq!(trained(&data.examples[0].encoded), "X<|im_end|>Y<|im_end|>");
    assert_eq!(trained(&data.examples[1].encoded), "Z<|im_end|>");
    // Exported as a text dataset, read back as one.
    let out = dir.path().join("distilled.jsonl");
    assert_eq!(data.export_distilled(out.to_str().unwrap()).unwrap(), 2);
    let back = records::read_jsonl(&out, OnError::Fail).unwrap().records;
    let m = |role, c: &str| Message { role, content: c.into() };
    assert_eq!(
        back[0].messages,
        vec![
            m(Role::System, "S"),
            m(Role::User, "a"),
            m(Role::Assistant, "X"),
            m(Role::User, "c"),
            m(Role::Assistant, "Y")
        ]
    );
    assert_eq!(back[1].messages, vec![m(Role::User, "p"), m(Role::Assistant, "Z")]);
}

#[test]
fn the_checkpoint_template_and_its_kwargs_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let qwen3 =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("templates/qwen3.jinja")).unwrap();
    let (data, summary) =
        opened(&dataset(dir.path()), "template_kwargs = { enable_thinking = false }", &qwen3).unwrap();
    assert!(summary.description.contains("template: the checkpoint's chat template"), "{}", summary.description);
    let req = data.distill_request();
    assert_eq!(text(&req.prompts[1]), "<|im_start|>user\np<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    // `chat_template = "chatml"` overrides the checkpoint's.
    let (data, _) = opened(&dataset(dir.path()), "chat_template = \"chatml\"", &qwen3).unwrap();
    assert_eq!(text(&data.distill_request().prompts[1]), "<|im_start|>user\np<|im_end|>\n<|im_start|>assistant\n");
    // A template file given in the config.
    let file = dir.path().join("llama.jinja");
    std::fs::write(&file, "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}").unwrap();
    let text_cfg = "path = \"x\"\nmax_len = 256\ndistill = false\nchat_template = \"llama.jinja\"";
    let cfg: ChatSection = plugin_api::parse_section(text_cfg).unwrap();
    let mut data = ChatData::new(cfg, dataset(dir.path()), PathBuf::new(), 0)
        .unwrap()
        .with_template(Some(file), &qwen3, "")
        .unwrap();
    let s = data.open_impl(&byte_tokenizer().to_string(false).unwrap()).unwrap();
    assert!(s.description.contains("llama.jinja"), "{}", s.description);
    assert_eq!(trained(&data.examples[0].encoded), "b<|eot_id|>d<|eot_id|>");
    assert_eq!(data.stop_tokens, vec![261]); // <|eot_id|>: the closing marker, one token
}

#[test]
fn built_in_templates_are_chosen_by_name_and_unknown_names_listed() {
    let dir = tempfile::tempdir().unwrap();
    // `llama3`: the Llama 3.1 / 3.3 template, built in, overriding the checkpoint's.
    let (data, summary) = opened(&dataset(dir.path()), "chat_template = \"llama3\"", "{{ 'x' }}").unwrap();
    assert!(summary.description.contains("the built-in `llama3` template"), "{}", summary.description);
    let prompt = text(&data.distill_request().prompts[1]);
    assert!(prompt.contains("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date"), "{prompt}");
    assert!(
        prompt.ends_with(
            "<|start_header_id|>user<|end_header_id|>\n\np<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        "{prompt}"
    );
    // A name that is neither built in nor a file: the error lists the names.
    let cfg: ChatSection = plugin_api::parse_section("path = \"x\"\nchat_template = \"llama4\"").unwrap();
    let file = dir.path().join("llama4");
    let err = ChatData::new(cfg, dataset(dir.path()), PathBuf::new(), 0)
        .unwrap()
        .with_template(Some(file.clone()), "", "")
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        err,
        format!("field `chat_template`: `llama4` is not a built-in template (chatml, llama3, llama3.2, qwen2.5, qwen3, qwen3.5, smollm2) and not a file ({}: no such file)", file.display())
    );
    // A built-in whose markers the tokenizer lacks is refused, naming them.
    let cfg: ChatSection =
        plugin_api::parse_section("path = \"x\"\ndistill = false\nchat_template = \"llama3\"").unwrap();
    let mut data =
        ChatData::new(cfg, dataset(dir.path()), PathBuf::new(), 0).unwrap().with_template(None, "", "").unwrap();
    let plain = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;
    let err = data.open_impl(plain).unwrap_err().to_string();
    assert!(err.starts_with("the tokenizer has no <|start_header_id|> / <|end_header_id|> / <|eot_id|> special tokens for the built-in `llama3` template"), "{err}");
}

#[test]
fn chatml_needs_its_markers_and_broken_templates_name_their_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dataset(dir.path());
    let cfg: ChatSection = plugin_api::parse_section("path = \"x\"\ndistill = false").unwrap();
    let mut data = ChatData::new(cfg.clone(), path.clone(), PathBuf::new(), 0).unwrap();
    let plain = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<unk>":0},"unk_token":"<unk>"}}"#;
    let err = data.open_impl(plain).unwrap_err().to_string();
    assert_eq!(err, "the checkpoint has no chat template, and its tokenizer has no <|im_start|> / <|im_end|> special tokens for ChatML: give the model's template with [data] chat_template = \"FILE.jinja\" (or a built-in one: chatml, llama3, llama3.2, qwen2.5, qwen3, qwen3.5, smollm2)");
    let err = ChatData::new(cfg, path, PathBuf::new(), 0)
        .unwrap()
        .with_template(None, "{% if %}", "")
        .err()
        .unwrap()
        .to_string();
    assert!(err.starts_with("the checkpoint's chat template: chat template does not compile: "), "{err}");
}

#[test]
fn distill_accepts_a_flag_or_a_mode() {
    let parse =
        |v: &str| plugin_api::parse_section::<ChatSection>(&format!("path = \"x\"\ndistill = {v}")).map(|c| c.distill);
    assert_eq!(parse("true").unwrap(), Distill::Last);
    assert_eq!(parse("false").unwrap(), Distill::Off);
    assert_eq!(parse("\"all\"").unwrap(), Distill::All);
    let err = parse("\"every\"").unwrap_err().to_string();
    assert!(err.contains(r#"unknown value "every": expected false, "last" or "all""#), "{err}");
    let d = plugin_api::parse_section::<ChatSection>("path = \"x\"").unwrap();
    assert_eq!((d.distill, d.distill_temperature, d.format), (Distill::Last, 0.0, Format::Auto));
}

/// `n` one-exchange records, record i asking `qi` and answered `ai`.
fn numbered(dir: &Path, n: usize) -> PathBuf {
    let path = dir.join("numbered.jsonl");
    let lines: String = (0..n)
        .map(|i| format!("{{\"messages\":[{{\"role\":\"user\",\"content\":\"q{i}\"}},{{\"role\":\"assistant\",\"content\":\"a{i}\"}}]}}\n"))
        .collect();
    std::fs::write(&path, lines).unwrap();
    path
}

/// The replies a set of batches trains on, in order (`a3`, ...).
fn replies_in(batches: &[TrainBatch]) -> Vec<String> {
    let mut out = Vec::new();
    for b in batches {
        let (ids, mask) = (
            Vec::<i64>::try_from(b.input_ids.flatten(0, -1)).unwrap(),
            Vec::<i64>::try_from(b.loss_mask.flatten(0, -1)).unwrap(),
        );
        let s = b.input_ids.size()[1] as usize;
        for r in 0..b.lengths.len() {
            let kept: Vec<u32> = (r * s..(r + 1) * s).filter(|&i| mask[i] == 1).map(|i| ids[i] as u32).collect();
            out.push(text(&kept).trim_end_matches("<|im_end|>").to_string());
        }
    }
    out
}

#[test]
fn the_validation_split_sits_before_the_test_records_and_is_never_trained_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = numbered(dir.path(), 10);
    let split = "distill = false\nbatch_size = 2\neval_holdout = 2";
    // Without a validation split the test prompts are records 8 and 9; with one, still.
    let (mut plain, _) = opened(&path, split, "").unwrap();
    assert!(plain.validation_batches().unwrap().is_empty());
    let test_prompts = plain.eval_prompts_impl("holdout", 10).unwrap();
    let (mut data, summary) = opened(&path, &format!("{split}\nvalidation = 3"), "").unwrap();
    assert_eq!(data.eval_prompts_impl("holdout", 10).unwrap(), test_prompts);
    assert!(text(&test_prompts[0]).contains("q8") && text(&test_prompts[1]).contains("q9"));
    assert!(summary.description.contains("5 sequences (+ 3 sequences for validation)"), "{}", summary.description);
    assert_eq!(summary.sequences, 5);

    // Validation: records 5..8 in order, the same batches at every call, ids after training's.
    let val = data.validation_batches().unwrap();
    assert_eq!(replies_in(&val), ["a5", "a6", "a7"]);
    assert_eq!(val.iter().map(|b| b.lengths.len()).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(val[0].sequence_ids, [5, 6]);
    assert_eq!(replies_in(&data.validation_batches().unwrap()), ["a5", "a6", "a7"]);
    let prompts: Vec<String> = data.eval_prompts_impl("validation", 10).unwrap().iter().map(|p| text(p)).collect();
    assert_eq!(prompts.len(), 3);
    assert!(
        prompts.iter().zip(["q5", "q6", "q7"]).all(|(p, q)| p.contains(q) && p.ends_with("<|im_start|>assistant\n")),
        "{prompts:?}"
    );

    // Two epochs of training see records 0..5 only.
    let mut trained_on = Vec::new();
    for _ in 0..2 {
        while let Some(b) = data.next_batch().unwrap() {
            trained_on.extend(replies_in(&[b]));
        }
    }
    trained_on.sort();
    assert_eq!(trained_on, ["a0", "a0", "a1", "a1", "a2", "a2", "a3", "a3", "a4", "a4"]);

    // Too few records for the split: named.
    let err = opened(&path, "distill = false\neval_holdout = 2\nvalidation = 8", "").err().unwrap().to_string();
    assert!(err.starts_with("field `validation`: 8 records asked for"), "{err}");
}

#[test]
fn validation_records_are_self_distilled_with_the_training_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = numbered(dir.path(), 4);
    let (mut data, _) = opened(&path, "distill = \"last\"\nvalidation = 1", "").unwrap();
    let req = data.distill_request();
    assert_eq!(req.prompts.len(), 4, "the validation record's prompt is asked for too");
    assert!(text(&req.prompts[3]).contains("q3"));
    assert!(data.validation_batches().is_err(), "no validation batch before the replies");
    data.set_distilled_impl(vec![reply("X0"), reply("X1"), reply("X2"), reply("X3")]).unwrap();
    assert_eq!(replies_in(&data.validation_batches().unwrap()), ["X3"]);
    // Its prompt is the one the target answered; the exported dataset is the training split.
    assert_eq!(data.eval_prompts_impl("validation", 1).unwrap(), vec![req.prompts[3].clone().into_vec()]);
    assert_eq!(data.distilled_records().unwrap().len(), 3);
}

/// The reply budget leaves a prompt room in `max_len` whatever `distill` says (eval's prompts
/// leave room for a reply of that length too): no wrap-around below the budget, both fields
/// named.
#[test]
fn the_reply_budget_must_leave_a_prompt_room_with_distillation_off_too() {
    let section = |extra: &str| {
        let cfg: ChatSection = plugin_api::parse_section(&format!("path = \"x\"\n{extra}")).unwrap();
        cfg.validate().map_err(|e| e.to_string())
    };
    for max_len in [64, 32] {
        for distill in ["false", "\"last\""] {
            let e =
                section(&format!("max_len = {max_len}\ndistill = {distill}\ndistill_max_new_tokens = 64")).unwrap_err();
            assert!(
                e.contains("field `distill_max_new_tokens`") && e.contains(&format!("got 64 with max_len {max_len}")),
                "{e}"
            );
            assert_eq!(e.contains("with distill = false it still sets"), distill == "false", "{e}");
        }
    }
    section("max_len = 72\ndistill = false\ndistill_max_new_tokens = 64").unwrap();
    section("max_len = 16\ndistill = false\ndistill_max_new_tokens = 8").unwrap();
}
