//! Log probabilities in the two shapes of the OpenAI API: chat's `logprobs.content` entries
//! (`token`, `logprob`, `bytes`, `top_logprobs`) and the legacy completions object (`tokens`,
//! `token_logprobs`, `top_logprobs`, `text_offset`). A token's text is its bytes read as UTF-8
//! (a token that holds part of a character shows U+FFFD; its `bytes` are exact), or with vLLM's
//! `return_tokens_as_token_ids`, `token_id:ID`.

use crate::engine::logits::logprobs::TokenLogprob;
use crate::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

/// JSON has no infinity: a token the model gives no probability reports this, as vLLM does.
const LOWEST_LOGPROB: f32 = -9999.0;

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        LOWEST_LOGPROB
    }
}

/// How tokens are named in log probabilities.
#[derive(Clone, Copy)]
pub struct TokenNames<'t> {
    pub tokenizer: &'t Tokenizer,
    /// `token_id:ID` instead of the token's text.
    pub as_ids: bool,
}

fn token_text(names: TokenNames, token: u32) -> (String, Vec<u8>) {
    let bytes = names.tokenizer.token_bytes(token);
    let text = if names.as_ids { format!("token_id:{token}") } else { String::from_utf8_lossy(&bytes).into_owned() };
    (text, bytes)
}

/// One entry of chat's `logprobs.content`.
fn chat_entry(names: TokenNames, token: u32, logprob: f32) -> Value {
    let (text, bytes) = token_text(names, token);
    json!({"token": text, "logprob": finite(logprob), "bytes": bytes})
}

/// Chat's `logprobs.content` for `entries`.
pub fn chat_content(names: TokenNames, entries: &[TokenLogprob]) -> Value {
    Value::Array(
        entries
            .iter()
            .map(|entry| {
                let mut value = chat_entry(names, entry.token, entry.logprob);
                value["top_logprobs"] = Value::Array(entry.top.iter().map(|&(t, l)| chat_entry(names, t, l)).collect());
                value
            })
            .collect(),
    )
}

/// The completions `logprobs` object for `entries`, whose first token starts at character
/// `offset` of the choice's text.
pub fn completion(names: TokenNames, entries: &[TokenLogprob], mut offset: usize) -> Value {
    let (mut tokens, mut token_logprobs, mut top_logprobs, mut text_offset) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for entry in entries {
        let (text, bytes) = token_text(names, entry.token);
        text_offset.push(offset);
        offset += String::from_utf8_lossy(&bytes).chars().count();
        tokens.push(Value::String(text));
        token_logprobs.push(json!(finite(entry.logprob)));
        let top: Map<String, Value> = entry.top.iter().map(|&(t, l)| (token_text(names, t).0, json!(finite(l)))).collect();
        top_logprobs.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset})
}
