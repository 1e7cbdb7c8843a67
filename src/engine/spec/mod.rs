//! Speculative decoding: draft proposers and verification.

pub mod mtp;
pub mod ngram;
pub mod verify;
