//! A tiny byte-level BPE tokenizer, built in code, for the tests.
//!
//! Its merges are chosen so that tokens cut characters apart: `h` + the first
//! byte of `é`, the first two bytes of `世`, and the last byte of `世` with the
//! first byte of `界`. Emoji stay one token per byte. That is what makes naive
//! per-token decoding print U+FFFD, so the streaming tests have teeth.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

pub(crate) const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// GPT-2's map from bytes to printable characters: printable Latin-1 bytes
/// stand for themselves, the rest are moved to U+0100 and up.
fn byte_level_char(byte: u8) -> char {
    let stands_for_itself = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if stands_for_itself(byte) {
        return char::from(byte);
    }
    let moved_index = (0..byte).filter(|b| !stands_for_itself(*b)).count() as u32;
    char::from_u32(256 + moved_index).unwrap_or('?')
}

fn byte_level_string(bytes: &[u8]) -> String {
    bytes.iter().map(|b| byte_level_char(*b)).collect()
}

/// The merges, as byte sequences: left part, right part.
fn merges_as_bytes() -> Vec<(Vec<u8>, Vec<u8>)> {
    let split = |left: &[u8], right: &[u8]| (left.to_vec(), right.to_vec());
    vec![
        split(b"h", b"e"),
        split(b"l", b"l"),
        split(b"ll", b"o"),
        split(b"he", b"llo"),
        split(b" ", b"w"),
        split(b"o", b"r"),
        split(b" w", b"or"),
        split(b"l", b"d"),
        // h + first byte of é (C3 A9): a token that ends inside a character.
        split(b"h", &[0xC3]),
        // 世 = E4 B8 96, 界 = E7 95 8C: one token ends mid-character, the
        // next completes 世 and starts 界.
        split(&[0xE4], &[0xB8]),
        split(&[0x96], &[0xE7]),
    ]
}

/// The tokenizer as `tokenizer.json` text, with the three ChatML special tokens.
pub(crate) fn tiny_bpe_tokenizer_json() -> String {
    let mut vocab = Vocab::new();
    for byte in 0..=255u8 {
        vocab.insert(byte_level_string(&[byte]), u32::from(byte));
    }
    let mut merges = Vec::new();
    for (left, right) in merges_as_bytes() {
        let merged: Vec<u8> = left.iter().chain(right.iter()).copied().collect();
        let next_id = vocab.len() as u32;
        vocab.entry(byte_level_string(&merged)).or_insert(next_id);
        merges.push((byte_level_string(&left), byte_level_string(&right)));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .expect("fixture BPE builds");

    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let special: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|content| AddedToken::from(*content, true))
        .collect();
    tokenizer.add_special_tokens(&special);
    tokenizer
        .to_string(false)
        .expect("fixture tokenizer serializes")
}

/// ChatML, as Qwen2 and many fine-tunes ship it.
pub(crate) const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A `tokenizer_config.json` for the tiny tokenizer with `template` as its chat template.
pub(crate) fn tiny_config_json(template: &str) -> String {
    serde_json::json!({
        "bos_token": null,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": true},
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    })
    .to_string()
}

pub(crate) fn tiny_tokenizer() -> super::Tokenizer {
    let config = tiny_config_json(CHATML_TEMPLATE);
    super::Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("tiny tokenizer loads")
}

pub(crate) fn tiny_tokenizer_with_template(template: &str) -> super::Tokenizer {
    let config = tiny_config_json(template);
    super::Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("tiny tokenizer loads")
}
