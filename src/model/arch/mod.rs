//! Forward definitions, one file per model family.

pub mod mtp;
pub mod qwen35;
