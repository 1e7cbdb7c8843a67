//! The batch engine: requests, scheduling, speculation, sampling and metrics.

pub mod cache;
pub mod config;
#[allow(clippy::module_inception)]
pub mod engine;
pub mod graphed;
pub mod padding;
pub mod logits;
pub mod metrics;
pub mod plan;
pub mod request;
pub mod scheduler;
pub mod spec;
pub mod step_trace;
pub mod worker;

pub use engine::{Engine, EngineConfig, EngineError};
