//! A row's logits alone and among other rows (DESIGN Invariant 3), on any backend and KV cache
//! format: request 0 runs a prompt of 150 tokens, then decode rows and a 3-token verify row,
//! beside `others` requests that prefill and decode in the same steps.

use kestrel::backend::{delta_state_in_place, Backend, BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout, StateCommit};
use kestrel::model::arch::qwen35::Qwen35;

/// How request 0's prompt is prefilled.
#[derive(Clone, Copy, Debug)]
pub enum Prefill {
    OneChunk,
    /// Pieces ending at multiples of 64 (the last at the prompt's end).
    Pieces(usize),
}

/// The tokens request 0 feeds after its prompt.
pub const STEP_TOKENS: [u32; 5] = [7, 11, 13, 17, 19];

/// One request: prompt, next position, blocks, slot.
struct Req {
    prompt: Vec<u32>,
    prefilled: usize,
    generated: usize,
    table: Vec<u32>,
    slot: usize,
}

/// Runs request 0 with `others` other requests in every step over a cache of `kv_dtype`;
/// returns request 0's logits at the end of its prefill and at every generated token (decode
/// rows and a 3-token verify row).
pub fn run_invariance<B: Backend>(backend: &B, model: &Qwen35<B>, kv_dtype: KvDtype, others: usize, prefill: Prefill) -> Vec<Vec<f32>> {
    let vocab = model.config.vocab_size as u32;
    let n = others + 1;
    let blocks_each = 16;
    let spec = CacheSpec { kv_dtype, ..model.cache_spec(n * blocks_each, 16, n, 3 * n) };
    let mut cache = backend.alloc_cache(&spec).expect("cache");
    let mut reqs: Vec<Req> = (0..n)
        .map(|i| {
            let len = if i == 0 { 150 } else { 20 + (i * 37) % 120 };
            Req { prompt: (0..len).map(|j| ((i * 131 + j * 17 + 3) as u32) % vocab).collect(), prefilled: 0, generated: 0, table: (0..blocks_each as u32).map(|b| (i * blocks_each) as u32 + b).collect(), slot: i }
        })
        .collect();
    for i in 0..n {
        backend.reset_states(&mut cache, &[i]);
    }
    let mut out = Vec::new();
    let mut step = 0;
    while reqs[0].generated < STEP_TOKENS.len() {
        let mut ids = Vec::new();
        let mut layout = BatchLayout::default();
        let mut logit_rows = Vec::new();
        let mut snap = 0;
        let mut req0_rows = (0, 0);
        for (i, r) in reqs.iter().enumerate() {
            let (kind, tokens): (RowKind, Vec<u32>) = if r.prefilled < r.prompt.len() {
                let limit = match (i, prefill) {
                    (0, Prefill::OneChunk) => r.prompt.len(),
                    (0, Prefill::Pieces(p)) => (r.prefilled / p + 1) * p,
                    _ => (r.prefilled / 64 + 1) * 64,
                };
                (RowKind::Prefill, r.prompt[r.prefilled..limit.min(r.prompt.len())].to_vec())
            } else {
                // Request 0's third generate step is a verify row of 3 tokens.
                let k = if i == 0 && r.generated == 2 { 3 } else { 1 };
                (RowKind::Generate, (0..k).map(|j| STEP_TOKENS[(r.generated + j) % STEP_TOKENS.len()]).collect())
            };
            let start = ids.len();
            let pos = r.prefilled + r.generated;
            layout.rows.push(RowLayout { kind, token_start: start, num_tokens: tokens.len(), start_position: pos, block_table: r.table.clone(), state_slot: r.slot, snapshot_base: snap });
            if kind == RowKind::Generate {
                snap += tokens.len();
            }
            if i == 0 {
                req0_rows = (logit_rows.len(), tokens.len());
            }
            let first_logit = if kind == RowKind::Prefill { start + tokens.len() - 1 } else { start };
            for t in first_logit..start + tokens.len() {
                logit_rows.push(t as u32);
            }
            ids.extend(tokens);
        }
        let fw = model.forward(backend, &ids, &layout, &logit_rows, &mut cache);
        let logits = backend.to_host(&fw.logits);
        let v = vocab as usize;
        let r0 = &layout.rows[0];
        let r0_logits = if r0.kind == RowKind::Prefill { 1 } else { req0_rows.1 };
        if r0.kind == RowKind::Generate || reqs[0].prefilled + r0.num_tokens == reqs[0].prompt.len() {
            for j in 0..r0_logits {
                out.push(logits[(req0_rows.0 + j) * v..(req0_rows.0 + j + 1) * v].to_vec());
            }
        }
        for (i, row) in layout.rows.iter().enumerate() {
            let r = &mut reqs[i];
            match row.kind {
                RowKind::Prefill => r.prefilled += row.num_tokens,
                RowKind::Generate => {
                    backend.commit_states(&mut cache, &[StateCommit { slot: row.state_slot, snapshot: row.snapshot_base + row.num_tokens - 1, conv_only: delta_state_in_place(row.kind, row.num_tokens) }]);
                    r.generated += row.num_tokens;
                }
            }
        }
        step += 1;
        assert!(step < 100, "invariance run did not finish");
    }
    out
}
