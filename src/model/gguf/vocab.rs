//! The tokenizer of a GGUF file: `tokenizer.ggml.*` as llama.cpp's converter writes it for a
//! byte-level BPE model (`TextModel._set_vocab_gpt2`: model `gpt2`, the pre-tokenizer name, the
//! tokens with their types, and gguf-py's `SpecialVocab` for the merges, special token ids,
//! `add_bos_token` and the chat template).

use super::GgufModelError;
use crate::model::weights::gguf::{GgufError, GgufFile, OptionalKey};
use crate::tokenizer::bpe_vocab::token_type;
use crate::tokenizer::BpeVocab;

/// Control tokens llama.cpp ends generation at besides the declared EOS / EOT / EOM ids (its
/// vocabulary loader recognizes them by text); these are the ones Qwen vocabularies use.
const END_OF_GENERATION_TEXTS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

pub(super) fn read(file: &GgufFile) -> Result<BpeVocab, GgufModelError> {
    let model = file.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufModelError::Metadata { path: file.path().to_path_buf(), key: "tokenizer.ggml.model".into(), reason: format!("tokenizer model `{model}` is not supported (supported: gpt2, byte-level BPE)") });
    }
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?.to_vec();
    let token_types = match file.get_array("tokenizer.ggml.token_type").optional()? {
        None => Vec::new(),
        Some(a) => a
            .to_integers()
            .and_then(|v| v.into_iter().map(|x| i32::try_from(x).ok()).collect::<Option<Vec<i32>>>())
            .ok_or_else(|| GgufModelError::Metadata { path: file.path().to_path_buf(), key: "tokenizer.ggml.token_type".into(), reason: format!("expected integers, found an array of {}", a.elem_type()) })?,
    };
    let id = |key: &str| -> Result<Option<u32>, GgufError> { file.get_u32(key).optional() };
    let mut eos_token_ids: Vec<u32> = [id("tokenizer.ggml.eos_token_id")?, id("tokenizer.ggml.eot_token_id")?, id("tokenizer.ggml.eom_token_id")?].into_iter().flatten().collect();
    for (i, text) in tokens.iter().enumerate() {
        let control = token_types.get(i) == Some(&token_type::CONTROL);
        if control && END_OF_GENERATION_TEXTS.contains(&text.as_str()) && !eos_token_ids.contains(&(i as u32)) {
            eos_token_ids.push(i as u32);
        }
    }
    Ok(BpeVocab {
        pre: file.get_str("tokenizer.ggml.pre")?.to_string(),
        merges: file.get_str_array("tokenizer.ggml.merges")?.to_vec(),
        tokens,
        token_types,
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        add_bos_token: file.get_bool("tokenizer.ggml.add_bos_token").optional()?.unwrap_or(false),
        eos_token_ids,
        chat_template: file.get_str("tokenizer.chat_template").optional()?.map(str::to_string),
    })
}
