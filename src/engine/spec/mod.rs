//! Speculative decoding: draft proposers and verification.

pub mod ngram;
pub mod verify;
