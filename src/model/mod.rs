//! Model configuration, weights and forward definitions.

pub mod arch;
pub mod config;
pub mod weights;
