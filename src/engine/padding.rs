//! Padding generate-only steps up to fixed capture sizes (DESIGN Invariant 2).
//!
//! A CUDA graph replays one (rows, tokens) shape. Rather than capture every shape a busy engine
//! produces, steps are padded up to a few capture sizes in rows (vLLM's default: 1, 2, 4, 8, 16,
//! 24, 32, then every 16), and a step with drafts up to `rows x m` tokens for a few multiples
//! `m` up to k + 1 (a full verify row per request). Padded rows come after the real ones and
//! are inert: token 0 at position 0 in a scratch KV block, the scratch recurrent-state slot,
//! and snapshot slots past the real rows' (never read). Their results are cut off by the
//! backend before they leave it, so the engine sees only the real rows.

use super::plan::StepPlan;
use crate::backend::{BatchLayout, Padded, PaddedShape, RealShape, RowKind, RowLayout};

/// Capture sizes in rows, ascending, each at least 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSizes(Vec<usize>);

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CaptureSizesError {
    #[error("capture size `{0}` is not a positive whole number")]
    NotASize(String),
    #[error("no capture sizes given")]
    Empty,
}

impl CaptureSizes {
    /// 1, 2, 4, 8, 16, 24, 32, then every 16 up to `max`, and `max` itself, so that every
    /// batch up to `max` has a size.
    pub fn default_up_to(max: usize) -> CaptureSizes {
        let mut sizes: Vec<usize> = [1, 2, 4, 8, 16, 24, 32].into_iter().chain((48..).step_by(16).take_while(|&s| s <= max.max(48))).filter(|&s| s <= max).collect();
        if max > 0 && sizes.last() != Some(&max) {
            sizes.push(max);
        }
        CaptureSizes(sizes)
    }

    /// A comma-separated list, e.g. `1,2,4,8,16`, in any order.
    pub fn parse(list: &str) -> Result<CaptureSizes, CaptureSizesError> {
        let mut sizes = Vec::new();
        for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.parse::<usize>() {
                Ok(n) if n > 0 => sizes.push(n),
                _ => return Err(CaptureSizesError::NotASize(part.to_string())),
            }
        }
        if sizes.is_empty() {
            return Err(CaptureSizesError::Empty);
        }
        Ok(CaptureSizes::from_sizes(sizes))
    }

    fn from_sizes(mut sizes: Vec<usize>) -> CaptureSizes {
        sizes.sort_unstable();
        sizes.dedup();
        CaptureSizes(sizes)
    }

    /// With the size `batch + 1` where `batch`, the largest batch, is a size: the shape a verify
    /// step of a full batch pads to (its padded tokens need a padded row). Decodes, one token
    /// per row, still fit `batch` exactly.
    pub fn with_verify_row(&self, batch: usize) -> CaptureSizes {
        if self.0.last() == Some(&batch) {
            return CaptureSizes::from_sizes(self.0.iter().copied().chain([batch + 1]).collect());
        }
        self.clone()
    }

    /// The sizes up to `max`.
    pub fn capped(&self, max: usize) -> CaptureSizes {
        CaptureSizes(self.0.iter().copied().filter(|&s| s <= max).collect())
    }

    pub fn sizes(&self) -> &[usize] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Token multiples of a row size for steps with up to `k` drafts per row: the capture sizes
    /// up to k + 1 (from the default list, so at most twice the tokens a step needs) and k + 1.
    pub fn token_multiples(k: usize) -> Vec<usize> {
        CaptureSizes::default_up_to(k + 1).0
    }
}

impl std::fmt::Display for CaptureSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list: Vec<String> = self.0.iter().map(|s| s.to_string()).collect();
        write!(f, "{}", list.join(","))
    }
}

/// Bounds on a padded step, from the buffers and the cache the engine allocated.
#[derive(Debug, Clone, Copy)]
pub struct PadLimits {
    /// Tokens one step may run (step input buffers, snapshot slots).
    pub max_tokens: usize,
    /// KV blocks one row's table may list.
    pub max_blocks_per_row: usize,
    pub block_size: usize,
}

/// The smallest capture shape that holds `real`: rows from `sizes`, tokens `rows x m` for a
/// multiple `m` of [`CaptureSizes::token_multiples`] (only m = 1 for a step of decodes), with a
/// padded row for every padded token beyond the real ones. `None` when no capture size holds it
/// (the step then runs at its exact shape).
pub fn padded_shape(sizes: &CaptureSizes, real: RealShape, k: usize, limits: PadLimits) -> Option<PaddedShape> {
    let multiples = if real.tokens.0 == real.rows.0 { vec![1] } else { CaptureSizes::token_multiples(k) };
    for &rows in sizes.sizes().iter().filter(|&&s| s >= real.rows.0) {
        for &m in &multiples {
            let shape = PaddedShape { rows: Padded(rows), tokens: Padded(rows * m) };
            if shape.tokens.0 > limits.max_tokens {
                break;
            }
            if fits(shape, real, limits) {
                return Some(shape);
            }
        }
    }
    None
}

/// Whether the padded rows of `shape` can carry its padded tokens: each padded row takes one
/// token and the last the rest, within a row's block table.
pub fn fits(shape: PaddedShape, real: RealShape, limits: PadLimits) -> bool {
    if !shape.holds(real) {
        return false;
    }
    let extra_rows = shape.rows.extra_over(real.rows);
    let extra_tokens = shape.tokens.extra_over(real.tokens);
    if extra_rows == 0 {
        return extra_tokens == 0;
    }
    if extra_tokens < extra_rows {
        return false;
    }
    let last_row = extra_tokens - (extra_rows - 1);
    last_row.div_ceil(limits.block_size.max(1)) <= limits.max_blocks_per_row
}

/// Where padded rows write: cache memory no live sequence owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scratch {
    /// A KV block outside the block pool.
    pub block: u32,
    /// A recurrent-state slot outside the slot allocator.
    pub state_slot: usize,
}

impl Scratch {
    /// KV blocks and state slots the cache holds past those the allocators hand out.
    pub const BLOCKS: usize = 1;
    pub const STATE_SLOTS: usize = 1;

    /// The scratch of a cache whose allocators hand out `num_blocks` blocks and
    /// `max_num_seqs` state slots: the first ones past them.
    pub fn after(num_blocks: usize, max_num_seqs: usize) -> Scratch {
        Scratch { block: num_blocks as u32, state_slot: max_num_seqs }
    }
}

/// A step's forward inputs padded to a capture shape: the real rows' ids, rows and logits
/// rows first, unchanged, then the padded rows'.
#[derive(Debug, Clone)]
pub struct PaddedStep {
    pub ids: Vec<u32>,
    pub layout: BatchLayout,
    pub logit_rows: Vec<u32>,
    pub real: RealShape,
    pub shape: PaddedShape,
}

/// The rows and tokens of a plan (before padding).
pub fn real_shape(plan: &StepPlan) -> RealShape {
    use crate::backend::Real;
    RealShape { rows: Real(plan.rows.len()), tokens: Real(plan.num_tokens()) }
}

/// Pads a generate-only step (every token with a logits row, in order) to `shape`.
pub fn pad_step(plan: &StepPlan, shape: PaddedShape, scratch: Scratch, block_size: usize) -> PaddedStep {
    let real = real_shape(plan);
    assert!(fits(shape, real, PadLimits { max_tokens: usize::MAX, max_blocks_per_row: usize::MAX, block_size }), "{shape:?} cannot hold {real:?}");
    let mut ids = plan.ids.0.clone();
    let mut layout = plan.layout.clone();
    // Snapshot slots are handed out in token order; the padded rows' follow the real rows'.
    let snapshot = layout.rows.iter().filter(|r| r.kind == RowKind::Generate).map(|r| r.snapshot_base + r.num_tokens).max().unwrap_or(0);
    push_padded_rows(&mut ids, &mut layout, real, shape, scratch, block_size, RowKind::Generate, Some(snapshot));
    let logit_rows = (0..shape.tokens.0 as u32).collect();
    PaddedStep { ids, layout, logit_rows, real, shape }
}

/// Appends the rows that pad `real` up to `shape`: one token each, the last taking the rest, at
/// position 0 in the scratch KV block and state slot, of `kind`. Their snapshot slots follow on
/// from `snapshot` where the rows keep snapshots (generate rows), else 0.
#[allow(clippy::too_many_arguments)]
fn push_padded_rows(ids: &mut Vec<u32>, layout: &mut BatchLayout, real: RealShape, shape: PaddedShape, scratch: Scratch, block_size: usize, kind: RowKind, snapshot: Option<usize>) {
    let extra_rows = shape.rows.extra_over(real.rows);
    let extra_tokens = shape.tokens.extra_over(real.tokens);
    let mut token = real.tokens.0;
    let mut snapshot = snapshot;
    for i in 0..extra_rows {
        let n = if i + 1 == extra_rows { extra_tokens - (extra_rows - 1) } else { 1 };
        ids.extend(std::iter::repeat_n(0, n));
        layout.rows.push(RowLayout {
            kind,
            token_start: token,
            num_tokens: n,
            start_position: 0,
            block_table: vec![scratch.block; n.div_ceil(block_size.max(1))],
            state_slot: scratch.state_slot,
            snapshot_base: snapshot.unwrap_or(0),
        });
        token += n;
        snapshot = snapshot.map(|s| s + n);
    }
}

/// Every row's last token, in order: the logits rows of an MTP drafter forward.
pub fn last_tokens(layout: &BatchLayout) -> Vec<u32> {
    layout.rows.iter().map(|r| (r.token_start + r.num_tokens - 1) as u32).collect()
}

/// Pads an MTP drafter forward (rows of the drafter's layer, `ids` a token per position) to
/// `shape` as [`pad_step`] pads a step: padded rows of one token each after the real ones, the
/// last taking the rest, at position 0 in the scratch KV block, with the real rows' kind
/// (prefill: the drafter's layer keeps no recurrent state). Every row, padded ones included,
/// gets a logits row at its last token.
pub fn pad_mtp_forward(ids: &[u32], layout: &BatchLayout, shape: PaddedShape, scratch: Scratch, block_size: usize) -> PaddedStep {
    use crate::backend::Real;
    let real = RealShape { rows: Real(layout.rows.len()), tokens: Real(ids.len()) };
    assert_eq!(layout.num_tokens(), ids.len(), "an id per token of the layout");
    assert!(fits(shape, real, PadLimits { max_tokens: usize::MAX, max_blocks_per_row: usize::MAX, block_size }), "{shape:?} cannot hold {real:?}");
    let mut ids = ids.to_vec();
    let mut layout = layout.clone();
    push_padded_rows(&mut ids, &mut layout, real, shape, scratch, block_size, RowKind::Prefill, None);
    let logit_rows = last_tokens(&layout);
    PaddedStep { ids, layout, logit_rows, real, shape }
}

/// Real and padded rows over the steps run at a capture size.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PaddingStats {
    pub steps: u64,
    pub real_rows: u64,
    pub padded_rows: u64,
    pub real_tokens: u64,
    pub padded_tokens: u64,
}

impl PaddingStats {
    pub fn record(&mut self, real: RealShape, shape: PaddedShape) {
        self.steps += 1;
        self.real_rows += real.rows.0 as u64;
        self.padded_rows += shape.rows.0 as u64;
        self.real_tokens += real.tokens.0 as u64;
        self.padded_tokens += shape.tokens.0 as u64;
    }

    /// Padded rows per real row (1.0: no padding); `None` before any padded step.
    pub fn row_overhead(&self) -> Option<f64> {
        (self.real_rows > 0).then(|| self.padded_rows as f64 / self.real_rows as f64)
    }

    /// Padded tokens per real token.
    pub fn token_overhead(&self) -> Option<f64> {
        (self.real_tokens > 0).then(|| self.padded_tokens as f64 / self.real_tokens as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Real;

    const LIMITS: PadLimits = PadLimits { max_tokens: 4096, max_blocks_per_row: 64, block_size: 16 };

    #[test]
    fn a_full_batch_of_verify_rows_pads_into_the_verify_row() {
        let sizes = CaptureSizes::default_up_to(32);
        let real = RealShape { rows: Real(32), tokens: Real(143) };
        // Without a padded row, 32 rows can only hold exactly 32 x m tokens.
        assert_eq!(padded_shape(&sizes, real, 4, LIMITS), None);
        let with_row = sizes.with_verify_row(32);
        assert_eq!(with_row.sizes(), &[1, 2, 4, 8, 16, 24, 32, 33]);
        assert_eq!(padded_shape(&with_row, real, 4, LIMITS), Some(PaddedShape { rows: Padded(33), tokens: Padded(165) }));
        // Decodes still fit the batch exactly; a batch that is not a size gets no extra one.
        let decodes = RealShape { rows: Real(32), tokens: Real(32) };
        assert_eq!(padded_shape(&with_row, decodes, 4, LIMITS), Some(PaddedShape { rows: Padded(32), tokens: Padded(32) }));
        assert_eq!(CaptureSizes::default_up_to(8).with_verify_row(20).sizes(), &[1, 2, 4, 8]);
    }

    fn real(rows: usize, tokens: usize) -> RealShape {
        RealShape { rows: Real(rows), tokens: Real(tokens) }
    }

    fn shape(rows: usize, tokens: usize) -> Option<PaddedShape> {
        Some(PaddedShape { rows: Padded(rows), tokens: Padded(tokens) })
    }

    #[test]
    fn default_sizes_follow_vllm_up_to_the_largest_batch() {
        assert_eq!(CaptureSizes::default_up_to(64).sizes(), &[1, 2, 4, 8, 16, 24, 32, 48, 64]);
        assert_eq!(CaptureSizes::default_up_to(100).sizes(), &[1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]);
        assert_eq!(CaptureSizes::default_up_to(20).sizes(), &[1, 2, 4, 8, 16, 20]);
        assert_eq!(CaptureSizes::default_up_to(1).sizes(), &[1]);
        assert!(CaptureSizes::default_up_to(0).is_empty());
        assert_eq!(CaptureSizes::token_multiples(3), vec![1, 2, 4]);
        assert_eq!(CaptureSizes::token_multiples(8), vec![1, 2, 4, 8, 9]);
    }

    #[test]
    fn capture_size_lists_parse_sorted_and_refuse_bad_entries() {
        assert_eq!(CaptureSizes::parse("8, 1,4,4").unwrap().sizes(), &[1, 4, 8]);
        assert_eq!(CaptureSizes::parse("1,0"), Err(CaptureSizesError::NotASize("0".into())));
        assert_eq!(CaptureSizes::parse("1,two"), Err(CaptureSizesError::NotASize("two".into())));
        assert_eq!(CaptureSizes::parse(" , "), Err(CaptureSizesError::Empty));
        assert_eq!(CaptureSizes::parse("1,8,32").unwrap().capped(16).sizes(), &[1, 8]);
        assert_eq!(CaptureSizes::parse("1,8,32").unwrap().to_string(), "1,8,32");
    }

    #[test]
    fn decode_steps_pad_rows_to_the_smallest_capture_size() {
        let sizes = CaptureSizes::default_up_to(64);
        assert_eq!(padded_shape(&sizes, real(17, 17), 3, LIMITS), shape(24, 24));
        assert_eq!(padded_shape(&sizes, real(24, 24), 3, LIMITS), shape(24, 24));
        assert_eq!(padded_shape(&sizes, real(3, 3), 3, LIMITS), shape(4, 4));
        assert_eq!(padded_shape(&sizes, real(45, 45), 3, LIMITS), shape(48, 48));
        // Beyond the largest size: the exact shape.
        assert_eq!(padded_shape(&CaptureSizes::parse("1,2,4").unwrap(), real(5, 5), 3, LIMITS), None);
    }

    #[test]
    fn verify_steps_pad_tokens_to_rows_times_a_multiple_with_padded_rows_to_hold_them() {
        let sizes = CaptureSizes::default_up_to(64);
        // 17 rows, 10 drafts: 24 rows x 2 tokens.
        assert_eq!(padded_shape(&sizes, real(17, 27), 3, LIMITS), shape(24, 48));
        // Every row full (k = 3): 24 x 4 = 96 holds 17 x 4 = 68.
        assert_eq!(padded_shape(&sizes, real(17, 68), 3, LIMITS), shape(24, 96));
        // A full batch of 16 with drafts has no padded row to take the padded tokens: 24 rows.
        assert_eq!(padded_shape(&sizes, real(16, 30), 3, LIMITS), shape(24, 48));
        // Exactly a capture shape.
        assert_eq!(padded_shape(&sizes, real(16, 64), 3, LIMITS), shape(16, 64));
        // k = 8: multiples 1, 2, 4, 8, 9.
        assert_eq!(padded_shape(&sizes, real(29, 29 * 9), 8, LIMITS), shape(32, 288));
        // Too many tokens for the limits: the exact shape.
        assert_eq!(padded_shape(&sizes, real(29, 29 * 9), 8, PadLimits { max_tokens: 256, ..LIMITS }), None);
        // The last padded row takes the padded tokens; its table must fit a row's.
        let two = CaptureSizes::parse("2").unwrap();
        assert_eq!(padded_shape(&two, real(1, 40), 64, PadLimits { max_blocks_per_row: 1, block_size: 1, ..LIMITS }), None);
        assert_eq!(padded_shape(&two, real(1, 40), 64, LIMITS), shape(2, 48));
    }

    fn plan_of(rows: &[(usize, usize)]) -> StepPlan {
        // (tokens, state slot) per generate row; snapshot slots in token order.
        let mut plan = StepPlan::default();
        let mut token = 0;
        for (i, &(n, slot)) in rows.iter().enumerate() {
            plan.ids.0.extend((0..n).map(|j| (100 + 10 * i + j) as u32));
            plan.logit_rows.extend((token..token + n).map(|t| t as u32));
            plan.layout.rows.push(RowLayout { kind: RowKind::Generate, token_start: token, num_tokens: n, start_position: 40 + i, block_table: vec![i as u32, 7], state_slot: slot, snapshot_base: token });
            plan.rows.0.push(super::super::plan::PlannedRow { seq: i as u64, kind: RowKind::Generate, committed: 1, drafts: vec![1; n - 1], logits_start: Some(token) });
            token += n;
        }
        plan
    }

    #[test]
    fn padded_rows_write_only_scratch_memory_after_the_real_rows() {
        let plan = plan_of(&[(1, 0), (4, 1), (2, 2)]);
        let scratch = Scratch { block: 999, state_slot: 9 };
        let shape = padded_shape(&CaptureSizes::default_up_to(8), real_shape(&plan), 3, LIMITS).expect("a capture size holds it");
        assert_eq!(shape, PaddedShape { rows: Padded(4), tokens: Padded(8) });
        let step = pad_step(&plan, shape, scratch, 16);
        assert_eq!(step.real, real(3, 7));
        // The real rows first, unchanged.
        assert_eq!(&step.ids[..7], &plan.ids.0[..]);
        assert_eq!(step.layout.rows.len(), 4);
        for (got, want) in step.layout.rows.iter().zip(&plan.layout.rows) {
            assert_eq!((got.token_start, got.num_tokens, got.state_slot, got.snapshot_base, &got.block_table), (want.token_start, want.num_tokens, want.state_slot, want.snapshot_base, &want.block_table));
        }
        let pad = &step.layout.rows[3];
        assert_eq!((pad.token_start, pad.num_tokens, pad.start_position), (7, 1, 0));
        assert_eq!(pad.state_slot, scratch.state_slot, "a padded row must not write a live state slot");
        assert!(pad.block_table.iter().all(|&b| b == scratch.block), "a padded row must not write a live KV block");
        assert!(pad.snapshot_base >= 7, "a padded row's snapshots must follow the real rows'");
        assert_eq!(step.logit_rows, (0..8).collect::<Vec<u32>>());
        assert_eq!(step.layout.num_tokens(), 8);
    }

    #[test]
    fn the_last_padded_row_carries_the_padded_tokens_in_scratch_blocks() {
        let plan = plan_of(&[(4, 0), (4, 1), (4, 2)]);
        let scratch = Scratch { block: 50, state_slot: 3 };
        let step = pad_step(&plan, PaddedShape { rows: Padded(8), tokens: Padded(64) }, scratch, 16);
        let pads = &step.layout.rows[3..];
        assert_eq!(pads.len(), 5);
        assert_eq!(pads.iter().map(|r| r.num_tokens).collect::<Vec<_>>(), vec![1, 1, 1, 1, 48]);
        assert_eq!(pads[4].block_table, vec![50; 3]);
        assert!(pads.iter().all(|r| r.state_slot == 3 && r.kind == RowKind::Generate));
        let snapshots: Vec<usize> = pads.iter().map(|r| r.snapshot_base).collect();
        assert_eq!(snapshots, vec![12, 13, 14, 15, 16]);
        assert_eq!(step.ids.len(), 64);
        // A step of padded rows only (start-up capture).
        let only = pad_step(&StepPlan::default(), PaddedShape { rows: Padded(2), tokens: Padded(8) }, scratch, 16);
        assert_eq!(only.layout.rows.iter().map(|r| (r.token_start, r.num_tokens)).collect::<Vec<_>>(), vec![(0, 1), (1, 7)]);
    }

    /// An MTP catch-up: rows of 1..k+1 committed tokens at their sequences' positions.
    fn mtp_rows(counts: &[usize]) -> (Vec<u32>, BatchLayout) {
        let (mut ids, mut layout) = (Vec::new(), BatchLayout::default());
        for (i, &n) in counts.iter().enumerate() {
            layout.rows.push(RowLayout { kind: RowKind::Prefill, token_start: ids.len(), num_tokens: n, start_position: 30 + 7 * i, block_table: vec![3 * i as u32, 3 * i as u32 + 1, 3 * i as u32 + 2], state_slot: 0, snapshot_base: 0 });
            ids.extend((0..n).map(|j| (500 + 10 * i + j) as u32));
        }
        (ids, layout)
    }

    #[test]
    fn mtp_forwards_pad_to_rows_times_a_multiple_with_inert_rows_and_a_logits_row_per_row() {
        let sizes = CaptureSizes::default_up_to(64);
        let scratch = Scratch { block: 999, state_slot: 9 };
        // A catch-up of 3 rows (1, 4 and 2 committed tokens, k = 3): 4 rows x 2 tokens.
        let (ids, layout) = mtp_rows(&[1, 4, 2]);
        let shape = padded_shape(&sizes, real(3, 7), 3, LIMITS).expect("a capture size holds it");
        assert_eq!(shape, PaddedShape { rows: Padded(4), tokens: Padded(8) });
        let step = pad_mtp_forward(&ids, &layout, shape, scratch, 16);
        assert_eq!(step.real, real(3, 7));
        assert_eq!(&step.ids[..7], &ids[..]);
        assert_eq!(&step.layout.rows[..3], &layout.rows[..], "the real rows run unchanged");
        let pad = &step.layout.rows[3];
        assert_eq!((pad.kind, pad.token_start, pad.num_tokens, pad.start_position), (RowKind::Prefill, 7, 1, 0));
        assert!(pad.block_table.iter().all(|&b| b == scratch.block), "a padded MTP row must not write a live KV block");
        assert_eq!(pad.state_slot, scratch.state_slot);
        // A logits row at every row's last token, padded rows' too (their results are cut off).
        assert_eq!(step.logit_rows, vec![0, 4, 6, 7]);
        assert_eq!(step.layout.num_tokens(), 8);
        // A chained draft (one token per row): 17 rows run as 24, one token each.
        let (ids, layout) = mtp_rows(&[1; 17]);
        let shape = padded_shape(&sizes, real(17, 17), 3, LIMITS).expect("a capture size holds it");
        let step = pad_mtp_forward(&ids, &layout, shape, scratch, 16);
        assert_eq!(step.logit_rows, (0..24).collect::<Vec<u32>>());
        assert!(step.layout.rows[17..].iter().all(|r| r.num_tokens == 1 && r.block_table == vec![scratch.block] && r.start_position == 0));
        // The last padded row carries the padded tokens, in as many scratch blocks as they need.
        let (ids, layout) = mtp_rows(&[4, 4, 4]);
        let step = pad_mtp_forward(&ids, &layout, PaddedShape { rows: Padded(4), tokens: Padded(40) }, scratch, 16);
        assert_eq!(step.layout.rows[3].num_tokens, 28);
        assert_eq!(step.layout.rows[3].block_table, vec![scratch.block; 2]);
        assert_eq!(step.logit_rows, vec![3, 7, 11, 39]);
        assert_eq!(last_tokens(&layout), vec![3, 7, 11]);
    }

    #[test]
    fn padding_stats_report_rows_and_tokens_run_per_real_one() {
        let mut stats = PaddingStats::default();
        assert_eq!(stats.row_overhead(), None);
        stats.record(real(17, 17), PaddedShape { rows: Padded(24), tokens: Padded(24) });
        stats.record(real(3, 3), PaddedShape { rows: Padded(4), tokens: Padded(4) });
        assert_eq!(stats.row_overhead(), Some(28.0 / 20.0));
        assert_eq!(stats.token_overhead(), Some(28.0 / 20.0));
        assert_eq!(stats.steps, 2);
    }
}
