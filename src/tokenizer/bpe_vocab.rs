//! A byte-level BPE vocabulary as llama.cpp keeps it in a GGUF file (`tokenizer.ggml.*`), turned
//! into the same [`Tokenizer`] a Hugging Face directory gives.
//!
//! llama.cpp stores the token strings (byte-level spelling, `Ġ` for a leading space), a type per
//! token, the merges as `"left right"` strings and a pre-tokenizer *name*; the split regex
//! itself lives in llama.cpp's code (`llm_tokenizer_bpe` in llama-vocab.cpp). The tokenizer is
//! rebuilt as the `tokenizers` crate's JSON so it goes through the same loading path as a
//! `tokenizer.json`.

use std::collections::HashSet;
use std::path::Path;

use serde_json::{json, Map, Value as Json};

use super::chat_template::{ChatTemplateSources, DEFAULT_TEMPLATE_NAME};
use super::config::TokenizerConfig;
use super::{Tokenizer, TokenizerError};

/// llama.cpp's token types (`llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// The split regexes of the pre-tokenizer names llama.cpp gives Qwen vocabularies, as the
/// models' own tokenizer.json spell them (llama-vocab.cpp quotes them as "original regex from
/// tokenizer.json" before rewriting the case-insensitive group for its own regex engine).
/// `qwen35` differs from `qwen2` by keeping combining marks (`\p{M}`) inside words.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex for a `tokenizer.ggml.pre` name. The names are the ones llama.cpp's
/// `llama_vocab::impl::load` maps to its QWEN2 and QWEN35 pre-tokenizer types.
fn split_regex(pre: &str) -> Option<&'static str> {
    match pre {
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => Some(QWEN2_REGEX),
        "qwen35" => Some(QWEN35_REGEX),
        _ => None,
    }
}

/// The normalizer of the Hugging Face tokenizer a pre-tokenizer name stands for.
fn normalizer(pre: &str) -> Json {
    match pre {
        "qwen35" => Json::Null,
        _ => json!({"type": "NFC"}),
    }
}

/// A byte-level BPE vocabulary in llama.cpp's terms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BpeVocab {
    /// The pre-tokenizer name (`tokenizer.ggml.pre`), e.g. `qwen2` or `qwen35`.
    pub pre: String,
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// A [`token_type`] per token; empty means every token is normal.
    pub token_types: Vec<i32>,
    /// `"left right"` pairs in priority order.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    /// Prepend the BOS token when encoding with special tokens.
    pub add_bos_token: bool,
    /// Tokens that end generation; the first is the template's `eos_token`.
    pub eos_token_ids: Vec<u32>,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds a tokenizer from a GGUF-style vocabulary; `origin` names it in errors.
    ///
    /// Normal tokens form the BPE vocabulary; control tokens become special added tokens and
    /// user-defined ones (e.g. `<think>`) plain added tokens, as in the Hugging Face tokenizer
    /// llama.cpp's converter read them from. Unused tokens (the converter's `[PAD{id}]` fillers
    /// for ids past the real vocabulary) are left out, so those ids decode as unknown, as they do
    /// with the original tokenizer. Qwen2 / Qwen3 text is NFC-normalized first, as their
    /// tokenizer.json does (llama.cpp itself does not normalize; the two agree on NFC input);
    /// Qwen3.5's tokenizer.json has no normalizer (its split regex keeps combining marks in
    /// words instead), and llama.cpp's `qwen35` test vectors tokenize decomposed text as it is.
    pub fn from_bpe_vocab(vocab: &BpeVocab, origin: &Path) -> Result<Self, TokenizerError> {
        let invalid = |message: String| TokenizerError::InvalidVocab { origin: origin.to_path_buf(), message };
        let regex = split_regex(&vocab.pre).ok_or_else(|| invalid(format!("pre-tokenizer `{}` is not supported (supported: qwen2, qwen35)", vocab.pre)))?;
        if !vocab.token_types.is_empty() && vocab.token_types.len() != vocab.tokens.len() {
            return Err(invalid(format!("{} token types for {} tokens", vocab.token_types.len(), vocab.tokens.len())));
        }
        let id_of = |i: usize| u32::try_from(i).map_err(|_| invalid(format!("{} tokens do not fit 32-bit ids", vocab.tokens.len())));

        let mut bpe_vocab = Map::new();
        let mut added = Vec::new();
        for (i, token) in vocab.tokens.iter().enumerate() {
            let id = id_of(i)?;
            match vocab.token_types.get(i).copied().unwrap_or(token_type::NORMAL) {
                token_type::UNUSED => continue,
                kind @ (token_type::CONTROL | token_type::USER_DEFINED) => added.push(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                    // The converter stores added tokens already normalized.
                    "normalized": false, "special": kind == token_type::CONTROL,
                })),
                token_type::NORMAL | token_type::UNKNOWN | token_type::BYTE => {}
                other => return Err(invalid(format!("token {id} ({token:?}) has unknown type {other}"))),
            }
            // Added tokens go into the BPE vocabulary too: `tokenizers` gives an added token
            // the model's id for its text, and otherwise the next id after the model's, which
            // is only right when added tokens follow the vocabulary without gaps. A repeated
            // spelling keeps its first id.
            bpe_vocab.entry(token.clone()).or_insert(json!(id));
        }
        let merges = vocab
            .merges
            .iter()
            .enumerate()
            .map(|(i, m)| m.split_once(' ').map(|(a, b)| json!([a, b])).ok_or_else(|| invalid(format!("merge #{i} ({m:?}) is not two tokens separated by a space"))))
            .collect::<Result<Vec<_>, _>>()?;

        let token_text = |id: u32, what: &str| -> Result<String, TokenizerError> {
            vocab.tokens.get(id as usize).cloned().ok_or_else(|| invalid(format!("{what} id {id} is outside the {} tokens", vocab.tokens.len())))
        };
        let bos = vocab.bos_token_id.map(|id| token_text(id, "BOS")).transpose()?;
        let post_processor = match (&bos, vocab.bos_token_id) {
            (Some(text), Some(id)) if vocab.add_bos_token => json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {text: {"id": text, "ids": [id], "tokens": [text]}},
            }),
            _ => Json::Null,
        };
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
        let tokenizer_json = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer(&vocab.pre),
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                byte_level,
            ]},
            "post_processor": post_processor,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": bpe_vocab, "merges": merges,
            },
        });
        let bytes = serde_json::to_vec(&tokenizer_json).map_err(|e| invalid(e.to_string()))?;

        let mut seen = HashSet::new();
        let eos_tokens = vocab.eos_token_ids.iter().filter(|id| seen.insert(**id)).map(|&id| token_text(id, "EOS")).collect::<Result<Vec<_>, _>>()?;
        let config = TokenizerConfig {
            chat_template: vocab.chat_template.as_ref().map(|source| ChatTemplateSources { templates: vec![(DEFAULT_TEMPLATE_NAME.to_string(), source.clone())], origin: origin.to_path_buf() }),
            bos_token: bos,
            eos_tokens,
            added_tokens: Vec::new(),
        };
        Self::build_with_config(&bytes, origin, config, origin, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte-level spellings of "ab", " a", and the merges that build them.
    fn tiny() -> BpeVocab {
        let mut tokens: Vec<String> = ["a", "b", "Ġ", "ab", "Ġa", "<|endoftext|>", "<|im_end|>", "<think>", "[PAD8]"].map(String::from).to_vec();
        tokens.extend(["c", "d"].map(String::from));
        BpeVocab {
            pre: "qwen2".into(),
            token_types: vec![1, 1, 1, 1, 1, 3, 3, 4, 5, 1, 1],
            tokens,
            merges: vec!["a b".into(), "Ġ a".into()],
            eos_token_ids: vec![6, 5, 6],
            chat_template: Some("{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}".into()),
            ..BpeVocab::default()
        }
    }

    #[test]
    fn encodes_with_merges_and_added_tokens() {
        let t = Tokenizer::from_bpe_vocab(&tiny(), Path::new("x.gguf")).unwrap();
        assert_eq!(t.encode("ab a<think>c<|im_end|>", false).unwrap(), vec![3, 4, 7, 9, 6]);
        assert_eq!(t.decode(&[3, 4, 7, 6], false).unwrap(), "ab a<think><|im_end|>");
        assert_eq!(t.decode(&[3, 4, 7, 6], true).unwrap(), "ab a<think>");
        assert_eq!(t.eos_token_ids(), vec![6, 5]);
        assert!(t.decode(&[8], false).is_err(), "unused ids are not tokens");
        let msg = crate::tokenizer::ChatMessage::new("user", "hi");
        assert_eq!(t.apply_chat_template(&[msg], false, None).unwrap(), "hi<|im_end|>");
    }

    #[test]
    fn bos_is_prepended_when_asked() {
        let vocab = BpeVocab { bos_token_id: Some(5), add_bos_token: true, ..tiny() };
        let t = Tokenizer::from_bpe_vocab(&vocab, Path::new("x.gguf")).unwrap();
        assert_eq!(t.encode("ab", true).unwrap(), vec![5, 3]);
        assert_eq!(t.encode("ab", false).unwrap(), vec![3]);
    }

    #[test]
    fn problems_are_named() {
        let err = |v: BpeVocab| Tokenizer::from_bpe_vocab(&v, Path::new("m.gguf")).unwrap_err().to_string();
        let msg = err(BpeVocab { pre: "llama-bpe".into(), ..tiny() });
        assert!(msg.contains("m.gguf") && msg.contains("`llama-bpe`"), "{msg}");
        let msg = err(BpeVocab { merges: vec!["ab".into()], ..tiny() });
        assert!(msg.contains("merge #0"), "{msg}");
        let msg = err(BpeVocab { eos_token_ids: vec![99], ..tiny() });
        assert!(msg.contains("EOS id 99"), "{msg}");
        let msg = err(BpeVocab { token_types: vec![1], ..tiny() });
        assert!(msg.contains("1 token types for 11 tokens"), "{msg}");
    }

    #[test]
    fn qwen35_keeps_combining_marks_in_words() {
        // A combining mark inside a word (one with no composed form, so NFC keeps it): qwen2
        // starts a new piece at the mark, qwen35 keeps the word whole.
        use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior};
        let pieces = |regex: &str| {
            let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false).unwrap();
            let mut s = PreTokenizedString::from("x\u{0334}y");
            split.pre_tokenize(&mut s).unwrap();
            s.get_splits(OffsetReferential::Original, OffsetType::Char).len()
        };
        assert_eq!((pieces(QWEN2_REGEX), pieces(QWEN35_REGEX)), (2, 1));
    }
}
