//! The batch engine: requests, scheduling, speculation, sampling and metrics.

pub mod metrics;
pub mod sampler;
pub mod spec;
