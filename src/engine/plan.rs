//! The rows of one engine step, laid out for the forward.
//!
//! Token-indexed data (one entry per input token) and request-indexed data (one entry per row)
//! have distinct types so that one can never be indexed with the other's counts.

use super::request::{RequestId, Sequence};
use crate::backend::{BatchLayout, RowKind, RowLayout};

/// One entry per input token of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenIndexed<T>(pub Vec<T>);

/// One entry per request row of the step.
#[derive(Debug, Clone)]
pub struct RowIndexed<T>(pub Vec<T>);

impl<T> Default for TokenIndexed<T> {
    fn default() -> Self {
        TokenIndexed(Vec::new())
    }
}

impl<T> Default for RowIndexed<T> {
    fn default() -> Self {
        RowIndexed(Vec::new())
    }
}

impl<T> TokenIndexed<T> {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<T> RowIndexed<T> {
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }
}

/// What the engine must do with one row's results.
#[derive(Debug, Clone)]
pub struct PlannedRow {
    pub seq: RequestId,
    pub kind: RowKind,
    /// Tokens of the row that are already committed (prompt tokens, or generated tokens not
    /// yet fed); the rest of the row are drafts.
    pub committed: usize,
    pub drafts: Vec<u32>,
    /// First row of this request's logits in the step's logits, if it samples.
    pub logits_start: Option<usize>,
}

impl PlannedRow {
    pub fn num_tokens(&self) -> usize {
        self.committed + self.drafts.len()
    }
}

/// One step: the forward's inputs and, per row, how to consume its outputs.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    pub ids: TokenIndexed<u32>,
    pub layout: BatchLayout,
    /// Token indices whose logits are computed, in row order.
    pub logit_rows: Vec<u32>,
    pub rows: RowIndexed<PlannedRow>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.ids.len()
    }

    /// Appends a row of `seq`: its next `committed` tokens, then `drafts`. A sampling row gets
    /// logits from its last committed token on (one per draft plus the bonus position).
    pub fn push_row(&mut self, seq: &Sequence, kind: RowKind, committed: usize, drafts: Vec<u32>, samples: bool, snapshot_base: usize) {
        let token_start = self.ids.len();
        let n = committed + drafts.len();
        self.ids.0.extend_from_slice(&seq.tokens[seq.num_computed..seq.num_computed + committed]);
        self.ids.0.extend_from_slice(&drafts);
        let logits_start = samples.then_some(self.logit_rows.len());
        if samples {
            self.logit_rows.extend((token_start + committed - 1..token_start + n).map(|t| t as u32));
        }
        self.layout.rows.push(RowLayout {
            kind,
            token_start,
            num_tokens: n,
            start_position: seq.num_computed,
            block_table: seq.block_table.clone(),
            state_slot: seq.state_slot.expect("a scheduled sequence has a state slot"),
            snapshot_base,
        });
        self.rows.0.push(PlannedRow { seq: seq.id, kind, committed, drafts, logits_start });
    }
}
