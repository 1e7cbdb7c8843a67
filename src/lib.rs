//! Kestrel: terminal-first local inference for hybrid Gated-DeltaNet models.
//!
//! The library holds everything the `kestrel` binary runs; `src/cli/` is the thin edge.

pub mod backend;
pub mod chat_format;
pub mod engine;
pub mod model;
pub mod tokenizer;
pub mod server;
pub mod tui;
