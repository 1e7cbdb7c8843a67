//! MTP proposer: the checkpoint's own multi-token-prediction layer drafts k tokens.
//!
//! After every target step, the MTP layer first catches up on the positions the step
//! committed: at position p it consumes (hidden_p, token_{p+1}) and writes its own KV there,
//! so its attention always sees the committed history. The last caught-up row yields draft 1;
//! drafts 2..k chain on the MTP's own output hidden state at the following positions. Chained
//! KV entries sit beyond the committed length and are overwritten by the next catch-up.
//! Drafts are greedy (argmax); verification decides what is kept. A row without a finite logit
//! drafts nothing, and its sequence's chain stops there.
//!
//! With CUDA graphs on, each of these forwards is padded to a capture size as the step is
//! (the catch-up's rows of 1..k+1 tokens to rows x m tokens, a chained step's one-token rows to
//! a row size) and replayed as a graph captured at start-up. On a backend that replays graphs
//! the chain never waits for the host: each forward's argmax is written on the device into the
//! next forward's ids, and the k drafts of every row are read back once
//! ([`Backend::run_graphed_chain`]); elsewhere (the CPU) each draft is read back before the
//! next forward, as eagerly.

use crate::backend::{Backend, BatchLayout, CaptureWhen, ChainLink, GraphInputs, GraphedForward, PaddedShape, Real, RealShape, RowKind, RowLayout, RowSampling};
use crate::backend::sampling::{SamplingParams, NO_FINITE_LOGIT};
use crate::engine::graphed::GraphPadding;
use crate::engine::padding::{last_tokens, pad_mtp_forward, padded_shape, PaddedStep};
use crate::model::arch::mtp::{Mtp, MtpOutput};
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

impl MtpCatchUp {
    /// Row `r` of chained forward `step` (1 for the draft after the catch-up's): one token at
    /// the position after the previous draft.
    fn chained_draft_row(&self, r: usize, step: usize) -> RowLayout {
        RowLayout {
            kind: RowKind::Prefill,
            token_start: r,
            num_tokens: 1,
            start_position: self.start_position + self.count - 1 + step,
            block_table: self.block_table.clone(),
            state_slot: 0,
            snapshot_base: 0,
        }
    }
}

/// Runs catch-up and chained drafting for a batch of sequences; returns drafts per item.
/// With `graphs`, each forward is padded to a capture size and replayed as a graph where one
/// holds it (the same drafts as eagerly: padded rows are inert and cut off), and on a backend
/// that replays graphs the chain runs without a read-back between its forwards.
pub fn propose_mtp<B: Backend>(model: &Qwen35<B>, b: &B, cache: &mut B::Cache, step_hidden: &B::Tensor, items: &[MtpCatchUp], graphs: Option<&GraphPadding>) -> Vec<Vec<u32>> {
    let mut drafts = vec![Vec::new(); items.len()];
    let Some(mtp) = model.mtp.as_ref() else { return drafts };
    if items.is_empty() {
        return drafts;
    }
    let drafter = Drafter { model, mtp, b, graphs };
    let mut ids = Vec::new();
    let mut hidden_rows = Vec::new();
    let mut layout = BatchLayout::default();
    for it in items {
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
    }
    let wanting: Vec<usize> = (0..items.len()).filter(|&n| items[n].drafts_wanted > 0).collect();
    let replays_graphs = graphs.is_some() && b.replays_graphs();
    if wanting.is_empty() && !replays_graphs {
        // A catch-up only (prompt pieces, whose drafter KV the prefix cache shares, or rows
        // without room for drafts): the layer's cache at the committed positions is all it
        // leaves, so no logits are made.
        // (A backend that replays graphs replays the captured forward instead: one launch.)
        let x = b.gather_rows(step_hidden, &hidden_rows);
        mtp.write_cache(model, b, &ids, &x, &layout, cache);
        return drafts;
    }
    // Every row's last token gets logits; those of rows that want no drafts are not used.
    let mut out = drafter.forward(cache, &ids, step_hidden, &hidden_rows, &layout);
    if wanting.is_empty() {
        return drafts;
    }
    if let Some(padding) = graphs.filter(|_| replays_graphs) {
        return drafter.chain_on_device(cache, &out, items, &wanting, padding);
    }
    let first = argmax_rows(b, &out.logits, items.len());
    for &n in &wanting {
        if first[n] != NO_FINITE_LOGIT {
            drafts[n].push(first[n]);
        }
    }
    // Chained steps: one token per still-drafting sequence. `last_rows[j]`: the row of `out`
    // of `active[j]`.
    let mut last_rows: Vec<u32> = wanting.iter().map(|&n| n as u32).collect();
    let mut active: Vec<usize> = wanting;
    let mut step = 1;
    loop {
        // A sequence goes on while it wants more drafts and its last row gave one.
        let keep: Vec<usize> = (0..active.len()).filter(|&j| items[active[j]].drafts_wanted > step && drafts[active[j]].len() == step).collect();
        if keep.is_empty() {
            break;
        }
        let prev_rows: Vec<u32> = keep.iter().map(|&j| last_rows[j]).collect();
        active = keep.iter().map(|&j| active[j]).collect();
        let mut layout = BatchLayout::default();
        let mut ids = Vec::with_capacity(active.len());
        for (r, &n) in active.iter().enumerate() {
            ids.push(*drafts[n].last().expect("drafted at least once"));
            layout.rows.push(items[n].chained_draft_row(r, step));
        }
        last_rows = (0..active.len() as u32).collect();
        out = drafter.forward(cache, &ids, &out.hidden, &prev_rows, &layout);
        for (&n, token) in active.iter().zip(argmax_rows(b, &out.logits, active.len())) {
            if token != NO_FINITE_LOGIT {
                drafts[n].push(token);
            }
        }
        step += 1;
    }
    drafts
}

/// The drafter's layer and where its forwards run.
struct Drafter<'a, B: Backend> {
    model: &'a Qwen35<B>,
    mtp: &'a Mtp<B>,
    b: &'a B,
    graphs: Option<&'a GraphPadding>,
}

impl<B: Backend> Drafter<'_, B> {
    /// One forward of the drafter's layer over `layout`'s rows, reading rows `hidden_rows` of
    /// `hidden`: each row's logits and hidden state at its last token. Padded and replayed as
    /// a graph where a capture size holds the shape.
    fn forward(&self, cache: &mut B::Cache, ids: &[u32], hidden: &B::Tensor, hidden_rows: &[u32], layout: &BatchLayout) -> MtpOutput<B> {
        let (model, mtp, b) = (self.model, self.mtp, self.b);
        let real = RealShape { rows: Real(layout.rows.len()), tokens: Real(ids.len()) };
        let Some((padding, shape)) = self.graphs.and_then(|g| padded_shape(&g.sizes, real, g.k, g.limits).map(|s| (g, s))) else {
            let x = b.gather_rows(hidden, hidden_rows);
            return mtp.forward(model, b, ids, &x, layout, &last_tokens(layout), cache);
        };
        let step = pad_mtp_forward(ids, layout, shape, padding.scratch, padding.limits.block_size);
        let inputs = mtp_graph_inputs(&step, padding.limits.block_size);
        let mut outputs = b.run_graphed_on_rows(&inputs, hidden, hidden_rows, &mut |x| {
            let out = mtp.forward(model, b, inputs.ids, x, inputs.layout, inputs.logit_rows, cache);
            vec![out.hidden, out.logits]
        });
        let logits = outputs.pop().expect("a drafter forward returns hidden states and logits");
        let hidden = outputs.pop().expect("a drafter forward returns hidden states and logits");
        MtpOutput { logits, hidden }
    }
}

impl<B: Backend> Drafter<'_, B> {
    /// The chained drafts after the catch-up `caught_up` (of `items`, of which `wanting` want
    /// drafts), on a backend that replays graphs: every chained forward is planned ahead (its
    /// rows are the sequences that want more drafts than its index, in item order, so nothing
    /// depends on the drafts themselves) and handed to [`Backend::run_graphed_chain`], which
    /// feeds each forward the argmax of the one before on the device and reads the drafts back
    /// once. A sequence's drafts stop at its first row without a finite logit, as eagerly.
    fn chain_on_device(&self, cache: &mut B::Cache, caught_up: &MtpOutput<B>, items: &[MtpCatchUp], wanting: &[usize], padding: &GraphPadding) -> Vec<Vec<u32>> {
        let (model, mtp, b) = (self.model, self.mtp, self.b);
        let block_size = padding.limits.block_size;
        let longest = wanting.iter().map(|&n| items[n].drafts_wanted).max().unwrap_or(0);
        // Per chained forward: its padded step, how it is captured, its rows' items and the
        // rows of the forward before that they continue.
        let mut forwards: Vec<(PaddedStep, CaptureWhen, Vec<usize>, Vec<u32>)> = Vec::new();
        let mut previous: Vec<usize> = (0..items.len()).collect();
        for step in 1..longest {
            let rows: Vec<usize> = wanting.iter().copied().filter(|&n| items[n].drafts_wanted > step).collect();
            let prev_rows: Vec<u32> = rows.iter().map(|n| previous.iter().position(|p| p == n).expect("a chained row continues a row of the forward before") as u32).collect();
            let mut layout = BatchLayout::default();
            for (r, &n) in rows.iter().enumerate() {
                layout.rows.push(items[n].chained_draft_row(r, step));
            }
            // Placeholders: the ids are the previous forward's argmax, written on the device.
            let ids = vec![0u32; rows.len()];
            let real = RealShape { rows: Real(rows.len()), tokens: Real(rows.len()) };
            let (padded, capture) = match padded_shape(&padding.sizes, real, padding.k, padding.limits) {
                Some(shape) => (pad_mtp_forward(&ids, &layout, shape, padding.scratch, block_size), CaptureWhen::Now),
                None => (PaddedStep { logit_rows: last_tokens(&layout), ids, layout, real, shape: PaddedShape::exact(real) }, CaptureWhen::AfterRepeats),
            };
            previous = rows.clone();
            forwards.push((padded, capture, rows, prev_rows));
        }
        let links: Vec<ChainLink<'_>> = forwards
            .iter()
            .map(|(step, capture, _, prev_rows)| {
                let mut inputs = mtp_graph_inputs(step, block_size);
                inputs.capture = *capture;
                ChainLink { inputs, prev_rows: prev_rows.clone() }
            })
            .collect();
        let argmax = b.run_graphed_chain(&caught_up.logits, &caught_up.hidden, &links, &mut |inputs, x| {
            let out = mtp.forward(model, b, inputs.ids, x, inputs.layout, inputs.logit_rows, cache);
            vec![out.hidden, out.logits]
        });
        let mut drafts = vec![Vec::new(); items.len()];
        for &n in wanting {
            let mut token = argmax[0][n];
            let mut next = forwards.iter().zip(&argmax[1..]);
            while token != NO_FINITE_LOGIT {
                drafts[n].push(token);
                let Some(row) = next.next().and_then(|((_, _, rows, _), ids)| rows.iter().position(|&m| m == n).map(|r| ids[r])) else { break };
                token = row;
            }
        }
        drafts
    }
}

fn mtp_graph_inputs(step: &PaddedStep, block_size: usize) -> GraphInputs<'_> {
    GraphInputs { forward: GraphedForward::Mtp, ids: &step.ids, layout: &step.layout, logit_rows: &step.logit_rows, block_size, real: step.real, padded: step.shape, capture: CaptureWhen::Now }
}

/// Captures the drafter's graph of every start-up shape (steps of padded rows only, which
/// touch nothing but scratch memory); returns how many were captured.
pub fn capture_mtp_at_startup<B: Backend>(model: &Qwen35<B>, b: &B, cache: &mut B::Cache, padding: &GraphPadding, shapes: &[PaddedShape], progress: &indicatif::ProgressBar) -> usize {
    let Some(mtp) = model.mtp.as_ref() else { return 0 };
    let width = model.config.hidden_size;
    let mut graphs = 0;
    for &shape in shapes {
        let step = pad_mtp_forward(&[], &BatchLayout::default(), shape, padding.scratch, padding.limits.block_size);
        let inputs = mtp_graph_inputs(&step, padding.limits.block_size);
        // One eager run first, as for the step's graphs (what a forward makes on first use).
        let zeros = b.from_host(&vec![0.0; shape.tokens.0 * width], shape.tokens.0, width);
        let _ = mtp.forward(model, b, inputs.ids, &zeros, inputs.layout, inputs.logit_rows, cache);
        let captured = b.prepare_graph_on_rows(&inputs, width, &mut |x| {
            let out = mtp.forward(model, b, inputs.ids, x, inputs.layout, inputs.logit_rows, cache);
            vec![out.hidden, out.logits]
        });
        match captured {
            Ok(true) => graphs += 1,
            Ok(false) => {}
            Err(e) => progress.println(format!("kestrel: drafter graph of {} rows, {} tokens not captured: {e}", shape.rows.0, shape.tokens.0)),
        }
        progress.inc(1);
    }
    graphs
}

/// The argmax of each of the `n` logits rows, computed where the logits are.
fn argmax_rows<B: Backend>(b: &B, logits: &B::Tensor, n: usize) -> Vec<u32> {
    let greedy = RowSampling { params: SamplingParams::greedy(), position: 0, allowed: None };
    b.sample_rows(logits, &vec![greedy; n])
}
