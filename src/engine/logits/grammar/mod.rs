//! Structured output: a grammar (a JSON schema, Lark) compiled by llguidance, the grammar engine
//! llama.cpp, vLLM and SGLang use, masks every token that cannot continue a valid output.
//!
//! With speculation the mask of each position of a verify row follows the drafts before it: the
//! matcher is advanced over the drafts to compute the masks, then rolled back, and only the
//! tokens the step accepted are committed. The masks depend only on committed tokens and drafts,
//! both known before the forward, so the engine computes them while the forward runs. A row's
//! first mask needs no drafts: it is computed on the thread pool as soon as the tokens before it
//! are committed (state.rs), while the step ends and the next one starts.
//!
//! A grammar may wait for a token before it applies (`</think>` for a thinking model whose
//! prompt opened its reasoning): what the model thinks is free, its answer is constrained.

mod state;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::backend::sampling::mask_disallowed;
use crate::tokenizer::{TokenBytes, Tokenizer};
pub use state::{Grammar, TokenMask};

/// A grammar as a request gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (OpenAI's `response_format: {"type": "json_schema"}`).
    JsonSchema(serde_json::Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot build the token table for grammars: {0}")]
    Tokenizer(String),
}

/// The vocabulary as llguidance sees it: each token's bytes in a trie, and the tokenizer, with
/// which llguidance splits text that the grammar forces (so the model writes forced text the
/// way it was trained to: `<`, `function`, not the trie's greedy `<f`, `unction`).
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Bytes that are not UTF-8 (part of a character) fall back to the trie.
        self.trie.tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text, false).unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes())))
    }
}

/// Compiles grammars for one model; built once (the token table takes a moment) and shared.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// The tokens that end a generation, which the grammar allows where the output may end.
    end_tokens: Vec<u32>,
    /// The latest grammars compiled, by what they were compiled from, oldest first: clients send
    /// the same schema with request after request, and the clones of one compiled grammar share
    /// the lexer states they build (see [`Grammar`]).
    compiled: Mutex<VecDeque<(String, Grammar)>>,
}

/// How many compiled grammars [`GrammarCompiler`] keeps.
const COMPILED_KEPT: usize = 16;

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("end_tokens", &self.end_tokens).finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// `vocab_size` is the model's (its logits rows may be wider than the tokenizer's
    /// vocabulary); `end_tokens` are the tokens that end a generation.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, end_tokens: &[u32]) -> Result<Self, GrammarError> {
        let first_end = *end_tokens.first().ok_or_else(|| GrammarError::Tokenizer("the model has no end-of-sequence token".into()))?;
        let table = tokenizer.token_bytes_table(vocab_size.max(tokenizer.vocab_size())).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let words: Vec<Vec<u8>> = table
            .into_iter()
            .enumerate()
            .map(|(id, entry)| match entry {
                TokenBytes::Text(bytes) => bytes,
                TokenBytes::Special(name) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], name.as_bytes()].concat(),
                // A placeholder nothing can produce.
                TokenBytes::Missing => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], format!("<[{id}]>").as_bytes()].concat(),
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, first_end);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(end_tokens);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler { factory, end_tokens: end_tokens.to_vec(), compiled: Mutex::new(VecDeque::new()) })
    }

    /// Compiles a grammar for a request that ends at `end_tokens`; a schema or grammar
    /// llguidance cannot use is an error that says why.
    pub fn compile(&self, spec: &GrammarSpec, end_tokens: &[u32]) -> Result<Grammar, GrammarError> {
        let key = format!("{end_tokens:?} {spec:?}");
        let lock = || self.compiled.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, grammar)) = lock().iter().find(|(k, _)| *k == key) {
            return Ok(grammar.clone());
        }
        let grammar = self.compile_new(spec, end_tokens)?;
        let mut compiled = lock();
        if compiled.len() == COMPILED_KEPT {
            compiled.pop_front();
        }
        compiled.push_back((key, grammar.clone()));
        Ok(grammar)
    }

    fn compile_new(&self, spec: &GrammarSpec, end_tokens: &[u32]) -> Result<Grammar, GrammarError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_bounded_whitespace(schema.clone())),
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_bounded_whitespace(serde_json::json!({"type": "object"}))),
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(err) = matcher.get_error() {
            return Err(GrammarError::Invalid(err));
        }
        Ok(Grammar::compiled(matcher, end_tokens.to_vec(), self.end_tokens.clone()))
    }

    /// The id of a token the vocabulary spells as `text` on its own (e.g. `</think>`).
    pub fn single_token(&self, text: &str) -> Option<u32> {
        let trie = self.factory.tok_env().tok_trie();
        let special = [&[TokTrie::SPECIAL_TOKEN_MARKER][..], text.as_bytes()].concat();
        trie.token_id(&special).or_else(|| trie.token_id(text.as_bytes()))
    }
}


/// Whitespace between JSON tokens: one space, or a line break and up to 20 spaces or tabs of
/// indentation (llama.cpp's JSON grammars allow the same). Enough for compact and pretty-printed
/// JSON; a model that would emit whitespace forever cannot fill its token budget with it.
const JSON_WHITESPACE: &str = r"(?: |\n[ \t]{0,20})";

/// A schema with llguidance's whitespace option set (unless the schema sets its own); also for
/// schemas written inline in a Lark grammar (`%json {...}`).
pub fn with_bounded_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        if !object.contains_key("x-guidance") {
            object.insert("x-guidance".into(), serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
        }
    }
    schema
}

/// Sets every logit the mask does not allow to negative infinity (the backends' rule for a
/// row's allowed tokens, so a row masked on the host draws what the device draws).
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    mask_disallowed(mask.as_slice(), logits);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tiny_bpe_fixture::tiny_tokenizer;

    pub(super) const SCHEMA: &str = r#"{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"], "additionalProperties": false}"#;

    pub(super) fn setup() -> (Tokenizer, GrammarCompiler, u32) {
        let tokenizer = tiny_tokenizer();
        let end = tokenizer.token_to_id("<|im_end|>").expect("end token");
        let compiler = GrammarCompiler::new(&tokenizer, tokenizer.vocab_size(), &[end]).expect("token table builds");
        (tokenizer, compiler, end)
    }

    /// The masks along `text`, one position at a time.

    pub(super) fn stepped_masks(grammar: &mut Grammar, tokenizer: &Tokenizer, text: &str) -> Vec<Vec<u32>> {
        let tokens = tokenizer.encode(text, false).expect("encodes");
        tokens.iter().map(|&t| (grammar.masks(&[]).remove(0).expect("a mask").to_list(), grammar.commit(&[t])).0).collect()
    }

    pub(super) fn allowed(mask: &TokenMask, token: u32) -> bool {
        mask.as_ref().is_none_or(|m| m.is_allowed(token))
    }

    #[test]
    fn masks_follow_a_json_schema_and_end_where_the_value_ends() {
        let (tokenizer, compiler, end) = setup();
        let mut grammar = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &[end]).expect("compiles");
        let tokens = tokenizer.encode(r#"{"a": 12, "b": "y"}"#, false).expect("encodes");
        for &token in &tokens {
            let mask = grammar.masks(&[]).remove(0);
            assert!(allowed(&mask, token), "token {token} ({:?}) masked", tokenizer.decode(&[token], false));
            assert!(!allowed(&mask, end), "the output cannot end inside the object");
            grammar.commit(&[token]);
        }
        let last = grammar.masks(&[]).remove(0).expect("a mask");
        assert!(last.is_allowed(end));
        assert_eq!(last.num_set(), 1, "only the end is left");
        let wrong = tokenizer.encode("[", false).expect("encodes")[0];
        let first = compiler.compile(&GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema")), &[end]).expect("compiles").masks(&[]).remove(0).expect("a mask");
        assert!(!first.is_allowed(wrong), "a JSON object starts with a brace");
    }


    #[test]
    fn grammars_compiled_again_share_the_first_ones_states() {
        let (tokenizer, compiler, end) = setup();
        let spec = GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).expect("schema"));
        let a = compiler.compile(&spec, &[end]).expect("compiles");
        let b = compiler.compile(&spec, &[end]).expect("compiles");
        assert!(Arc::ptr_eq(&a.origin, &b.origin));
        let other_end = tokenizer.token_to_id("<|im_start|>").expect("token");
        assert!(!Arc::ptr_eq(&a.origin, &compiler.compile(&spec, &[other_end]).expect("compiles").origin));
        assert!(!Arc::ptr_eq(&a.origin, &compiler.compile(&GrammarSpec::JsonObject, &[end]).expect("compiles").origin));
        let mut again = compiler.compile(&spec, &[end]).expect("compiles");
        let mut fresh = compiler.compile_new(&spec, &[end]).expect("compiles");
        let text = r#"{"a": 3, "b": "x"}"#;
        assert_eq!(stepped_masks(&mut again, &tokenizer, text), stepped_masks(&mut fresh, &tokenizer, text));
        for n in 0..COMPILED_KEPT {
            compiler.compile(&GrammarSpec::Lark(format!("start: \"{n}\"")), &[end]).expect("compiles");
        }
        assert!(!Arc::ptr_eq(&a.origin, &compiler.compile(&spec, &[end]).expect("compiles").origin), "the oldest was let go");
    }


    #[test]
    fn schemas_and_grammars_that_cannot_compile_say_why() {
        let (tokenizer, compiler, end) = setup();
        let no_end = GrammarCompiler::new(&tokenizer, tokenizer.vocab_size(), &[]).expect_err("refused");
        assert!(no_end.to_string().contains("no end-of-sequence token"), "{no_end}");
        for spec in [
            GrammarSpec::JsonSchema(serde_json::json!({"type": "strng"})),
            GrammarSpec::JsonSchema(serde_json::json!({"$ref": "#/$defs/missing"})),
            GrammarSpec::Lark("start: undefined_rule".into()),
        ] {
            let err = compiler.compile(&spec, &[end]).expect_err("refused");
            assert!(!err.to_string().is_empty());
        }
    }
}
