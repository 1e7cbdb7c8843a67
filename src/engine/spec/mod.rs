//! Speculative decoding: draft proposers and verification.

pub mod backoff;
pub mod mtp;
pub mod ngram;
pub mod shadow;
pub mod verify;
