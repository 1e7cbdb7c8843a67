//! Loading, encoding, decoding and streaming, on the tiny byte-level BPE
//! tokenizer of `tiny_bpe_fixture`, plus the real Qwen3 tokenizer on demand.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::tiny_bpe_fixture::{
    tiny_bpe_tokenizer_json, tiny_config_json, tiny_tokenizer, CHATML_TEMPLATE, SPECIAL_TOKENS,
};
use super::{ChatMessage, Tokenizer, TokenizerError};

const MIXED_TEXT: &str = "héllo 世界 🙂";

fn id_of(tokenizer: &Tokenizer, token: &str) -> u32 {
    tokenizer
        .token_to_id(token)
        .unwrap_or_else(|| panic!("{token:?} is in the vocabulary"))
}

#[test]
fn tokenizer_is_send_sync_and_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    let tokenizer = Arc::new(tiny_tokenizer());
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let tokenizer = Arc::clone(&tokenizer);
            std::thread::spawn(move || tokenizer.encode("hello world", false).expect("encodes"))
        })
        .collect();
    for handle in handles {
        assert_eq!(
            handle.join().expect("thread finishes"),
            tokenizer.encode("hello world", false).expect("encodes")
        );
    }
}

#[test]
fn ascii_round_trips_through_merged_tokens() {
    let tokenizer = tiny_tokenizer();
    let ids = tokenizer.encode("hello world", false).expect("encodes");
    // The merges make "hello" one token and " world" two ("Ġwor" + "ld").
    assert_eq!(
        ids,
        vec![
            id_of(&tokenizer, "hello"),
            id_of(&tokenizer, "Ġwor"),
            id_of(&tokenizer, "ld")
        ]
    );
    assert_eq!(
        tokenizer.decode(&ids, false).expect("decodes"),
        "hello world"
    );
}

#[test]
fn multibyte_utf8_round_trips_although_tokens_split_characters() {
    let tokenizer = tiny_tokenizer();
    let ids = tokenizer.encode(MIXED_TEXT, false).expect("encodes");
    assert_eq!(tokenizer.decode(&ids, false).expect("decodes"), MIXED_TEXT);
    // The fixture is only useful if some tokens hold partial characters.
    let partial = ids
        .iter()
        .filter(|id| {
            tokenizer
                .decode(&[**id], false)
                .map(|text| text.contains('\u{FFFD}'))
                .unwrap_or(false)
        })
        .count();
    assert!(
        partial >= 4,
        "expected several tokens that split characters, got {partial}"
    );
}

#[test]
fn special_tokens_encode_as_one_id_and_decode_kept_or_skipped() {
    let tokenizer = tiny_tokenizer();
    let text = "<|im_start|>user\nhello<|im_end|><|endoftext|>";
    let ids = tokenizer.encode(text, false).expect("encodes");
    assert_eq!(ids.first(), Some(&id_of(&tokenizer, "<|im_start|>")));
    assert_eq!(
        ids[ids.len() - 2..],
        [
            id_of(&tokenizer, "<|im_end|>"),
            id_of(&tokenizer, "<|endoftext|>")
        ]
    );
    assert_eq!(tokenizer.decode(&ids, false).expect("decodes"), text);
    assert_eq!(
        tokenizer.decode(&ids, true).expect("decodes"),
        "user\nhello"
    );
}

#[test]
fn vocabulary_lookups_include_added_tokens() {
    let tokenizer = tiny_tokenizer();
    // 256 byte tokens + 11 merges + 3 special tokens.
    assert_eq!(tokenizer.vocab_size(), 270);
    for token in SPECIAL_TOKENS {
        let id = id_of(&tokenizer, token);
        assert_eq!(tokenizer.id_to_token(id).as_deref(), Some(token));
    }
    assert_eq!(
        tokenizer.id_to_token(id_of(&tokenizer, "Ġwor")).as_deref(),
        Some("Ġwor")
    );
    assert_eq!(tokenizer.token_to_id("<|not_a_token|>"), None);
    assert_eq!(tokenizer.id_to_token(270), None);
}

#[test]
fn eos_token_ids_come_from_the_config_deduplicated() {
    let tokenizer = tiny_tokenizer();
    assert_eq!(
        tokenizer.eos_token_ids(),
        vec![id_of(&tokenizer, "<|im_end|>")]
    );

    let config = r#"{"eos_token": ["<|im_end|>", {"content": "<|im_end|>"}, "<|endoftext|>"]}"#;
    let tokenizer = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("loads");
    assert_eq!(
        tokenizer.eos_token_ids(),
        vec![
            id_of(&tokenizer, "<|im_end|>"),
            id_of(&tokenizer, "<|endoftext|>")
        ]
    );
}

#[test]
fn without_a_config_there_is_no_template_and_no_eos() {
    let tokenizer =
        Tokenizer::from_bytes(tiny_bpe_tokenizer_json().as_bytes(), None).expect("loads");
    assert!(!tokenizer.has_chat_template());
    assert!(tokenizer.eos_token_ids().is_empty());
    let err = tokenizer
        .apply_chat_template(&[ChatMessage::user("x")], true, None)
        .expect_err("no template");
    assert!(matches!(err, TokenizerError::NoChatTemplate), "{err:?}");
}

#[test]
fn added_tokens_decoder_adds_missing_tokens_at_their_declared_ids() {
    let config = r#"{"added_tokens_decoder": {
        "270": {"content": "<think>", "special": false},
        "271": {"content": "<|tool|>", "special": true}}}"#;
    let tokenizer = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("loads");
    assert_eq!(tokenizer.token_to_id("<think>"), Some(270));
    assert_eq!(tokenizer.token_to_id("<|tool|>"), Some(271));
    let ids = tokenizer
        .encode("<think>hello<|tool|>", false)
        .expect("encodes");
    assert_eq!(ids, vec![270, id_of(&tokenizer, "hello"), 271]);
    assert_eq!(
        tokenizer.decode(&ids, true).expect("decodes"),
        "<think>hello",
        "only special tokens are skipped"
    );
}

#[test]
fn added_token_at_a_different_id_is_an_error() {
    let config = r#"{"added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": true}}}"#;
    let err = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect_err("id disagrees with tokenizer.json");
    match err {
        TokenizerError::AddedTokenIdMismatch {
            token,
            declared_id,
            actual_id,
            ..
        } => {
            assert_eq!(
                (token.as_str(), declared_id, actual_id),
                ("<|im_end|>", 5, 269)
            );
        }
        other => panic!("expected AddedTokenIdMismatch, got {other:?}"),
    }
}

#[test]
fn eos_token_missing_from_the_vocabulary_is_an_error() {
    let config = r#"{"eos_token": "</s>"}"#;
    let err = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect_err("</s> is not a token");
    assert!(
        matches!(err, TokenizerError::UnknownSpecialToken { ref token, .. } if token == "</s>"),
        "{err:?}"
    );
    assert!(err.to_string().contains("eos_token is \"</s>\""), "{err}");
}

#[test]
fn ids_outside_the_vocabulary_are_rejected() {
    let tokenizer = tiny_tokenizer();
    let err = tokenizer
        .decode(&[1, 5000], false)
        .expect_err("5000 is not a token");
    assert!(
        matches!(
            err,
            TokenizerError::UnknownTokenId {
                id: 5000,
                vocab_size: 270
            }
        ),
        "{err:?}"
    );
    let mut stream = tokenizer.stream_decoder(false);
    assert!(matches!(
        stream.push(5000),
        Err(TokenizerError::UnknownTokenId { id: 5000, .. })
    ));
}

#[test]
fn ids_of_a_padded_embedding_decode_as_nothing() {
    // The model's embedding has 6000 rows; the tokenizer has 270 tokens.
    let tokenizer = tiny_tokenizer().with_model_vocab_size(6000);
    let known = tokenizer.decode(&[1, 2], false).expect("known ids decode");
    assert_eq!(tokenizer.decode(&[1, 5000, 2], false).expect("padded ids decode as nothing"), known);
    let mut stream = tokenizer.stream_decoder(false);
    let mut text = String::new();
    for id in [1, 5000, 2, 5999] {
        text.push_str(&stream.push(id).expect("stream skips padded ids").unwrap_or_default());
    }
    text.push_str(&stream.flush().expect("flushes").unwrap_or_default());
    assert_eq!(text, known);
    // Past the embedding, an id cannot have come from the model.
    assert!(matches!(tokenizer.decode(&[6000], false), Err(TokenizerError::UnknownTokenId { id: 6000, .. })));
}

#[test]
fn truncation_and_padding_in_tokenizer_json_are_ignored() {
    let mut json: serde_json::Value = serde_json::from_str(&tiny_bpe_tokenizer_json()).expect("fixture is JSON");
    json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0});
    json["padding"] = serde_json::json!({"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    let cut = Tokenizer::from_bytes(json.to_string().as_bytes(), None).expect("loads");
    let plain = tiny_tokenizer();
    let text = "hello world, hello tokenizer, hello kestrel";
    let ids = cut.encode(text, false).expect("encodes");
    assert!(ids.len() > 4, "the prompt was cut to {} tokens", ids.len());
    assert_eq!(ids, plain.encode(text, false).expect("encodes"));
    assert_eq!(cut.encode("hi", false).expect("encodes"), plain.encode("hi", false).expect("encodes"), "a short prompt was padded");
}

/// Feeds `ids` one at a time and checks the stream against one-shot decoding.
fn assert_stream_matches_decode(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) {
    let mut stream = tokenizer.stream_decoder(skip_special_tokens);
    let mut concatenated = String::new();
    for &id in ids {
        if let Some(delta) = stream.push(id).expect("pushes") {
            assert!(
                !delta.contains('\u{FFFD}'),
                "delta {delta:?} holds a broken character"
            );
            assert!(!delta.is_empty(), "empty deltas are reported as None");
            concatenated.push_str(&delta);
        }
        assert_eq!(stream.text_so_far(), concatenated);
    }
    assert_eq!(
        stream.flush().expect("flushes"),
        None,
        "complete text leaves nothing held back"
    );
    assert_eq!(
        concatenated,
        tokenizer.decode(ids, skip_special_tokens).expect("decodes")
    );
}

#[test]
fn stream_deltas_concatenate_to_the_full_decode_without_broken_characters() {
    let tokenizer = tiny_tokenizer();
    for text in [
        MIXED_TEXT,
        "hello world",
        "🙂🙂 世界世界 héllo",
        "<|im_start|>assistant\n世界 🙂<|im_end|>",
    ] {
        let ids = tokenizer.encode(text, false).expect("encodes");
        assert_stream_matches_decode(&tokenizer, &ids, false);
        assert_stream_matches_decode(&tokenizer, &ids, true);
    }
}

#[test]
fn stream_holds_partial_characters_until_they_complete() {
    let tokenizer = tiny_tokenizer();
    let ids = tokenizer.encode("世界", false).expect("encodes");
    // "世界" is E4B8 | 96E7 | 95 | 8C: no character is whole before the last token.
    assert_eq!(ids.len(), 4);
    let mut stream = tokenizer.stream_decoder(false);
    let deltas: Vec<Option<String>> = ids
        .iter()
        .map(|id| stream.push(*id).expect("pushes"))
        .collect();
    assert_eq!(deltas, vec![None, None, None, Some("世界".to_string())]);
}

#[test]
fn flush_emits_bytes_that_never_completed() {
    let tokenizer = tiny_tokenizer();
    let emoji_ids = tokenizer.encode("a🙂", false).expect("encodes");
    // Generation stops after "a" and half of the emoji.
    let cut = &emoji_ids[..3];
    let mut stream = tokenizer.stream_decoder(false);
    let deltas: Vec<Option<String>> = cut
        .iter()
        .map(|id| stream.push(*id).expect("pushes"))
        .collect();
    assert_eq!(deltas, vec![Some("a".to_string()), None, None]);
    let held = stream
        .flush()
        .expect("flushes")
        .expect("held bytes come out");
    assert!(held.contains('\u{FFFD}'));
    assert_eq!(
        stream.text_so_far(),
        tokenizer.decode(cut, false).expect("decodes")
    );
    assert_eq!(
        stream.flush().expect("flushes"),
        None,
        "nothing is emitted twice"
    );
}

#[test]
fn from_dir_reads_all_three_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tokenizer.json"), tiny_bpe_tokenizer_json()).expect("write");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        tiny_config_json(CHATML_TEMPLATE),
    )
    .expect("write");
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("loads");
    assert!(tokenizer.has_chat_template());
    assert_eq!(
        tokenizer.eos_token_ids(),
        vec![id_of(&tokenizer, "<|im_end|>")]
    );
    let rendered = tokenizer
        .apply_chat_template(&[ChatMessage::user("hi")], false, None)
        .expect("renders");
    assert_eq!(rendered, "<|im_start|>user\nhi<|im_end|>\n");

    // chat_template.jinja, as newer transformers saves it, takes precedence.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ messages[0].content | upper }}",
    )
    .expect("write");
    let tokenizer = Tokenizer::from_dir(dir.path()).expect("loads");
    let rendered = tokenizer
        .apply_chat_template(&[ChatMessage::user("hi")], false, None)
        .expect("renders");
    assert_eq!(rendered, "HI");
}

#[test]
fn from_dir_without_tokenizer_json_names_the_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = Tokenizer::from_dir(dir.path()).expect_err("nothing to load");
    match &err {
        TokenizerError::MissingTokenizerJson { dir: reported } => assert_eq!(reported, dir.path()),
        other => panic!("expected MissingTokenizerJson, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!("no tokenizer.json in {}", dir.path().display())
    );
}

#[test]
fn malformed_files_name_the_file_that_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokenizer_path = dir.path().join("tokenizer.json");
    let config_path = dir.path().join("tokenizer_config.json");

    std::fs::write(&tokenizer_path, "{\"model\": ").expect("write");
    let err = Tokenizer::from_dir(dir.path()).expect_err("truncated tokenizer.json");
    match &err {
        TokenizerError::InvalidTokenizerJson { file, .. } => assert_eq!(file, &tokenizer_path),
        other => panic!("expected InvalidTokenizerJson, got {other:?}"),
    }
    assert!(
        err.to_string()
            .contains(&tokenizer_path.display().to_string()),
        "{err}"
    );

    std::fs::write(&tokenizer_path, tiny_bpe_tokenizer_json()).expect("write");
    std::fs::write(&config_path, "{\"eos_token\": \"<|im_end|>\",}").expect("write");
    let err = Tokenizer::from_dir(dir.path()).expect_err("trailing comma in tokenizer_config.json");
    match &err {
        TokenizerError::InvalidTokenizerConfig { file, message } => {
            assert_eq!(file, &config_path);
            assert!(
                message.contains("line 1"),
                "serde's position is kept: {message}"
            );
        }
        other => panic!("expected InvalidTokenizerConfig, got {other:?}"),
    }

    let err = Tokenizer::from_bytes(b"not json", None).expect_err("garbage");
    assert!(
        err.to_string()
            .starts_with("<embedded tokenizer.json> is not a valid tokenizer"),
        "{err}"
    );
}

fn qwen3_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen3")
}

/// The whole Qwen3 tokenizer (11 MB) is not committed. Fetch it with
/// `scripts/fetch_qwen3_tokenizer.sh DIR` and run
/// The test command (`.ci/run`) fetches it and sets `KESTREL_QWEN3_TOKENIZER_DIR`.
/// Expected ids come from the Python `tokenizers` package on the same file.
#[test]
fn real_qwen3_tokenizer_matches_python_tokenizers() {
    let dir = std::env::var_os("KESTREL_QWEN3_TOKENIZER_DIR")
        .map(PathBuf::from)
        .expect("set KESTREL_QWEN3_TOKENIZER_DIR to a folder filled by scripts/fetch_qwen3_tokenizer.sh (bash .ci/run does both)");
    let tokenizer = Tokenizer::from_dir(&dir).expect("Qwen3 tokenizer loads");
    assert_eq!(tokenizer.vocab_size(), 151_669);
    assert_eq!(tokenizer.eos_token_ids(), vec![151_645]);

    let text = "Hello, world! héllo 世界 🙂";
    let ids = tokenizer.encode(text, false).expect("encodes");
    assert_eq!(
        ids,
        vec![9707, 11, 1879, 0, 305, 18503, 385, 220, 99489, 27484]
    );
    assert_eq!(tokenizer.decode(&ids, false).expect("decodes"), text);
    assert_stream_matches_decode(&tokenizer, &ids, false);

    let prompt = "<|im_start|>user\nQuel temps fait-il à Zürich?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let ids = tokenizer.encode(prompt, false).expect("encodes");
    assert_eq!(
        ids,
        vec![
            151644, 872, 198, 2183, 301, 26046, 19694, 56275, 3784, 1863, 5186, 713, 30, 151645,
            198, 151644, 77091, 198, 151667, 271, 151668, 271
        ]
    );
    // <think> is an added token but not a special one, so skipping keeps it.
    assert_eq!(
        tokenizer.decode(&ids, true).expect("decodes"),
        "user\nQuel temps fait-il à Zürich?\nassistant\n<think>\n\n</think>\n\n"
    );

    let conversation: serde_json::Value = serde_json::from_slice(
        &std::fs::read(qwen3_fixture_dir().join("conversation_with_tools.json")).expect("fixture"),
    )
    .expect("fixture is JSON");
    let messages: Vec<ChatMessage> =
        serde_json::from_value(conversation["messages"].clone()).expect("messages");
    let expected =
        std::fs::read_to_string(qwen3_fixture_dir().join("conversation_with_tools.expected.txt"))
            .expect("expected render");
    let rendered = tokenizer
        .apply_chat_template(&messages, true, conversation.get("tools"))
        .expect("renders");
    assert_eq!(rendered, expected);
}
