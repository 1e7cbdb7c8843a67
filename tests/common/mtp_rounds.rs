//! Rounds of the MTP drafter outside the engine: the main model over each sequence's next
//! tokens, then the drafter's catch-up over them and its chained drafts.

use kestrel::backend::{Backend, BatchLayout, RowKind, RowLayout};
use kestrel::engine::graphed::GraphPadding;
use kestrel::engine::spec::mtp::{propose_mtp, MtpCatchUp};
use kestrel::model::arch::qwen35::Qwen35;

/// One sequence of a drafting test: its text, how much of it is committed, its cache rows.
pub struct DraftSeq {
    pub text: Vec<u32>,
    pub len: usize,
    pub table: Vec<u32>,
    pub slot: usize,
}

/// Runs the main model over `pieces` (sequence, tokens) as prefill rows continuing each
/// sequence, then the drafter's catch-up over them, each row asking for `drafts_wanted`
/// chained drafts; returns the drafts.
pub fn draft_round<B: Backend>(b: &B, model: &Qwen35<B>, cache: &mut B::Cache, seqs: &[DraftSeq], pieces: &[(usize, usize)], drafts_wanted: usize, graphs: Option<&GraphPadding>) -> Vec<Vec<u32>> {
    let (mut ids, mut layout, mut items) = (Vec::new(), BatchLayout::default(), Vec::new());
    for &(s, n) in pieces {
        let seq = &seqs[s];
        let token_start = ids.len();
        ids.extend_from_slice(&seq.text[seq.len..seq.len + n]);
        layout.rows.push(RowLayout { kind: RowKind::Prefill, token_start, num_tokens: n, start_position: seq.len, block_table: seq.table.clone(), state_slot: seq.slot, snapshot_base: 0 });
        items.push(MtpCatchUp {
            start_position: seq.len,
            hidden_start: token_start,
            count: n,
            next_tokens: seq.text[seq.len + 1..seq.len + n + 1].to_vec(),
            block_table: seq.table.clone(),
            drafts_wanted,
        });
    }
    let out = model.forward(b, &ids, &layout, &[ids.len() as u32 - 1], cache);
    propose_mtp(model, b, cache, &out.hidden, &items, graphs)
}
