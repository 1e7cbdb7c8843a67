//! The bytes each token stands for, for those that work below the text: grammar engines that
//! mask tokens by the bytes they would add, and log probabilities that report a token's bytes.
//!
//! Byte-level BPE (the GPT-2 scheme Qwen uses) spells every byte as one printable character;
//! this undoes that spelling. Added tokens are their content; those written `<...>` (control
//! tokens and markers such as `<think>` or `<tool_call>`) are reported apart, since a grammar
//! names them as tokens rather than matching their text.

use std::collections::HashMap;

use super::{Tokenizer, TokenizerError};

/// What a token id stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenBytes {
    Text(Vec<u8>),
    /// An added token written `<...>`, with its content.
    Special(String),
    /// Not a token of the vocabulary (padding of a larger embedding table).
    Missing,
}

/// Printable bytes stand for themselves; the others were moved to U+0100 and up, in order.
fn byte_level_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|byte| {
            if printable(byte) {
                (char::from(byte), byte)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
                next += 1;
                (c, byte)
            }
        })
        .collect()
}

impl Tokenizer {
    /// What every id below `count` stands for (ids past the vocabulary are [`TokenBytes::Missing`]).
    pub fn token_bytes_table(&self, count: usize) -> Result<Vec<TokenBytes>, TokenizerError> {
        if !matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            return Err(TokenizerError::Decode { message: "token bytes need a byte-level BPE tokenizer".into() });
        }
        let added = self.inner.get_added_tokens_decoder();
        let decoder = byte_level_decoder();
        Ok((0..count as u32)
            .map(|id| {
                if let Some(token) = added.get(&id) {
                    let content = token.content.clone();
                    return if token.special || (content.starts_with('<') && content.ends_with('>')) { TokenBytes::Special(content) } else { TokenBytes::Text(content.into_bytes()) };
                }
                match self.inner.id_to_token(id) {
                    Some(spelling) => spelling.chars().map(|c| decoder.get(&c).copied()).collect::<Option<Vec<u8>>>().map_or(TokenBytes::Missing, TokenBytes::Text),
                    None => TokenBytes::Missing,
                }
            })
            .collect())
    }

    /// The bytes of one token: its text for a special token, nothing for an id outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(spelling) = self.inner.id_to_token(id) else { return Vec::new() };
        if self.inner.get_added_tokens_decoder().contains_key(&id) || !matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            return spelling.into_bytes();
        }
        let decoder = byte_level_decoder();
        spelling.chars().map(|c| decoder.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_else(|| spelling.into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tiny_bpe_fixture::tiny_tokenizer;

    #[test]
    fn byte_level_spelling_is_undone() {
        let decoder = byte_level_decoder();
        assert_eq!(decoder[&'Ġ'], b' ');
        assert_eq!(decoder[&'Ċ'], b'\n');
        assert_eq!(decoder[&'a'], b'a');
        assert_eq!(decoder.len(), 256);
    }

    #[test]
    fn every_token_has_the_bytes_it_decodes_to() {
        let tokenizer = tiny_tokenizer();
        let count = tokenizer.vocab_size();
        let table = tokenizer.token_bytes_table(count + 2).expect("byte-level");
        for (id, entry) in table.iter().enumerate().take(count) {
            match entry {
                TokenBytes::Text(bytes) => {
                    if let Ok(text) = std::str::from_utf8(bytes) {
                        assert_eq!(tokenizer.decode(&[id as u32], false).expect("decodes"), text, "id {id}");
                    }
                    assert_eq!(&tokenizer.token_bytes(id as u32), bytes);
                }
                TokenBytes::Special(content) => assert!(content.starts_with('<'), "{content}"),
                TokenBytes::Missing => panic!("id {id} is in the vocabulary"),
            }
        }
        assert_eq!(table[count], TokenBytes::Missing);
    }
}
