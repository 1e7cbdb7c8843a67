//! MTP proposer: the checkpoint's own multi-token-prediction layer drafts k tokens.
//!
//! After every target step, the MTP layer first catches up on the positions the step
//! committed: at position p it consumes (hidden_p, token_{p+1}) and writes its own KV there,
//! so its attention always sees the committed history. The last caught-up row yields draft 1;
//! drafts 2..k chain on the MTP's own output hidden state at the following positions. Chained
//! KV entries sit beyond the committed length and are overwritten by the next catch-up.
//! Drafts are greedy (argmax); verification decides what is kept. A row without a finite logit
//! drafts nothing, and its sequence's chain stops there.

use crate::backend::{Backend, BatchLayout, RowKind, RowLayout, RowSampling};
use crate::backend::sampling::{SamplingParams, NO_FINITE_LOGIT};
use crate::model::arch::qwen35::Qwen35;

/// One sequence's catch-up work after a target step.
#[derive(Debug, Clone)]
pub struct MtpCatchUp {
    /// First committed position processed by the step.
    pub start_position: usize,
    /// Token index in the step's hidden states of `start_position`.
    pub hidden_start: usize,
    /// Committed positions to catch up on.
    pub count: usize,
    /// `tokens[p + 1]` for each caught-up position p.
    pub next_tokens: Vec<u32>,
    pub block_table: Vec<u32>,
    /// Drafts wanted after catching up (0 while the prompt is still being prefilled).
    pub drafts_wanted: usize,
}

/// Runs catch-up and chained drafting for a batch of sequences; returns drafts per item.
pub fn propose_mtp<B: Backend>(model: &Qwen35<B>, b: &B, cache: &mut B::Cache, step_hidden: &B::Tensor, items: &[MtpCatchUp]) -> Vec<Vec<u32>> {
    let mut drafts = vec![Vec::new(); items.len()];
    let Some(mtp) = model.mtp.as_ref() else { return drafts };
    if items.is_empty() {
        return drafts;
    }
    let mut ids = Vec::new();
    let mut hidden_rows = Vec::new();
    let mut layout = BatchLayout::default();
    let mut logit_rows = Vec::new();
    let mut wanting = Vec::new();
    for (n, it) in items.iter().enumerate() {
        let token_start = ids.len();
        ids.extend_from_slice(&it.next_tokens);
        hidden_rows.extend((it.hidden_start..it.hidden_start + it.count).map(|t| t as u32));
        layout.rows.push(RowLayout {
            kind: RowKind::Prefill,
            token_start,
            num_tokens: it.count,
            start_position: it.start_position,
            block_table: it.block_table.clone(),
            state_slot: 0,
            snapshot_base: 0,
        });
        if it.drafts_wanted > 0 {
            logit_rows.push((token_start + it.count - 1) as u32);
            wanting.push(n);
        }
    }
    let hidden = b.gather_rows(step_hidden, &hidden_rows);
    let mut out = mtp.forward(model, b, &ids, &hidden, &layout, &logit_rows, cache);
    for (&n, token) in wanting.iter().zip(argmax_rows(b, &out.logits, wanting.len())) {
        if token != NO_FINITE_LOGIT {
            drafts[n].push(token);
        }
    }
    // Chained steps: one token per still-drafting sequence.
    let mut last_rows: Vec<u32> = logit_rows.clone();
    let mut active: Vec<usize> = wanting.clone();
    let mut step = 1;
    loop {
        // A sequence goes on while it wants more drafts and its last row gave one.
        let keep: Vec<usize> = (0..active.len()).filter(|&j| items[active[j]].drafts_wanted > step && drafts[active[j]].len() == step).collect();
        if keep.is_empty() {
            break;
        }
        let prev_hidden = b.gather_rows(&out.hidden, &keep.iter().map(|&j| last_rows[j]).collect::<Vec<_>>());
        active = keep.iter().map(|&j| active[j]).collect();
        let mut layout = BatchLayout::default();
        let mut ids = Vec::with_capacity(active.len());
        for (r, &n) in active.iter().enumerate() {
            let it = &items[n];
            ids.push(*drafts[n].last().expect("drafted at least once"));
            layout.rows.push(RowLayout {
                kind: RowKind::Prefill,
                token_start: r,
                num_tokens: 1,
                start_position: it.start_position + it.count - 1 + step,
                block_table: it.block_table.clone(),
                state_slot: 0,
                snapshot_base: 0,
            });
        }
        last_rows = (0..active.len() as u32).collect();
        out = mtp.forward(model, b, &ids, &prev_hidden, &layout, &last_rows, cache);
        for (&n, token) in active.iter().zip(argmax_rows(b, &out.logits, active.len())) {
            if token != NO_FINITE_LOGIT {
                drafts[n].push(token);
            }
        }
        step += 1;
    }
    drafts
}

/// The argmax of each of the `n` logits rows, computed where the logits are.
fn argmax_rows<B: Backend>(b: &B, logits: &B::Tensor, n: usize) -> Vec<u32> {
    let greedy = RowSampling { params: SamplingParams::greedy(), position: 0, allowed: None };
    b.sample_rows(logits, &vec![greedy; n])
}
