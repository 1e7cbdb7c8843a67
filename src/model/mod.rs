//! Model configuration, weights and forward definitions.
