//! Position-keyed sampling on the device (cuda/sample.cu): greedy and plain-temperature rows are
//! drawn by a kernel and only their token ids are copied back, grammar masks applied on the device
//! (only the masks' bits go up). Rows that filter with top-k, top-p
//! or min-p are copied back and drawn by the host sampler, since the filtered set needs a sort.
//! Both give [`NO_FINITE_LOGIT`] for a row without a finite logit (the kernel writes -1).

use super::{ck, Arg, CudaBackend, CudaTensor};
use crate::backend::RowSampling;
use crate::backend::sampling::{position_key, sample_allowed, NO_FINITE_LOGIT};

/// Threads per block: SAMPLE_THREADS in cuda/sample.cu.
const SAMPLE_THREADS: u32 = 256;
/// Vocabulary tokens per block, at most: a row's vocabulary is split across blocks (about 128
/// for a 248K vocabulary), each thread scoring about 8 tokens.
const TOKENS_PER_BLOCK: usize = 2048;
/// Up to this vocabulary a row is one block: its scan is short, and one block skips the
/// merge of the blocks' winners.
const ONE_BLOCK_VOCAB: usize = 16_384;
/// A row's blocks are counted in 16 bits of a word (FINITE_BLOCK in cuda/sample.cu).
const MAX_SPLITS: usize = 0xffff;
/// The kernel's -1 for a row without a finite logit, read back as an unsigned id.
const _: () = assert!(-1i32 as u32 == NO_FINITE_LOGIT);

/// The sampling kernel's per-block winners and per-row block counts, kept between draws so that
/// a draw allocates nothing but its output and sets no memory (a small model's decode step is
/// bound by the host's calls).
pub(super) struct SamplingScratch {
    scores: cudarc::driver::CudaSlice<f64>,
    tokens: cudarc::driver::CudaSlice<i32>,
    /// Zero between draws: the last block of each row resets its count.
    done: cudarc::driver::CudaSlice<u32>,
}

impl SamplingScratch {
    fn new(be: &CudaBackend, entries: usize, rows: usize) -> Self {
        // SAFETY: every block writes its entry before the last block of its row reads it.
        let scores = ck(unsafe { be.stream.alloc::<f64>(entries.max(1)) }, "alloc");
        SamplingScratch { scores, tokens: be.alloc_i32(entries), done: ck(be.stream.alloc_zeros::<u32>(rows.max(1)), "alloc") }
    }

    /// Room for `entries` winners and `rows` counts (grown, never shrunk).
    fn reserve(&mut self, be: &CudaBackend, entries: usize, rows: usize) {
        if self.scores.len() < entries || self.done.len() < rows {
            *self = SamplingScratch::new(be, entries.max(self.scores.len()), rows.max(self.done.len()));
        }
    }
}

pub(super) fn sample_rows(be: &CudaBackend, logits: &CudaTensor, rows: &[RowSampling]) -> Vec<u32> {
    assert_eq!(logits.rows, rows.len(), "sample_rows: {} logits rows, {} sampling specs", logits.rows, rows.len());
    let vocab = logits.cols;
    let mut tokens = vec![0u32; rows.len()];
    let (mut device_rows, mut keys, mut inverse_temperatures, mut host_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The device rows' masks, one after another, each `mask_words` long (a shorter mask is
    // padded with zero words: the tokens past it stay disallowed).
    let mask_words = rows.iter().filter_map(|r| r.allowed.as_ref().map(|a| a.len().max(1))).max().unwrap_or(0);
    let (mut mask_rows, mut masks) = (Vec::new(), Vec::new());
    for (i, r) in rows.iter().enumerate() {
        if !r.params.is_greedy() && r.params.filters(vocab) {
            host_rows.push(i);
            continue;
        }
        match &r.allowed {
            Some(allowed) => {
                mask_rows.push((masks.len() / mask_words.max(1)) as i32);
                masks.extend_from_slice(allowed);
                masks.resize(masks.len() + mask_words - allowed.len(), 0);
            }
            None => mask_rows.push(-1),
        }
        if r.params.is_greedy() {
            device_rows.push(i as i32);
            keys.push(0u64);
            inverse_temperatures.push(0.0f64);
        } else {
            device_rows.push(i as i32);
            keys.push(position_key(r.params.seed, r.position));
            // The host sampler's scale, computed the same way.
            inverse_temperatures.push(1.0 / f64::from(r.params.temperature));
        }
    }
    if !device_rows.is_empty() {
        let n = device_rows.len();
        let d_rows = ck(be.stream.clone_htod(&device_rows), "sampling rows copy");
        let d_keys = ck(be.stream.clone_htod(&keys), "sampling keys copy");
        let d_inv = ck(be.stream.clone_htod(&inverse_temperatures), "sampling temperatures copy");
        let masked = !masks.is_empty();
        let d_masks = masked.then(|| ck(be.stream.clone_htod(&masks), "sampling masks copy"));
        let d_mask_rows = masked.then(|| ck(be.stream.clone_htod(&mask_rows), "sampling mask rows copy"));
        let out = be.alloc_i32(n);
        let splits = if vocab <= ONE_BLOCK_VOCAB { 1 } else { vocab.div_ceil(TOKENS_PER_BLOCK) };
        assert!(splits <= MAX_SPLITS, "a vocabulary of {vocab} tokens needs more sampling blocks than a row can count");
        let mut scratch = be.sampling_scratch.lock().unwrap_or_else(|p| p.into_inner());
        let scratch = scratch.get_or_insert_with(|| SamplingScratch::new(be, n * splits, n));
        scratch.reserve(be, n * splits, n);
        let (part_scores, part_tokens, done) = (&scratch.scores, &scratch.tokens, &scratch.done);
        be.launch(
            &be.k.sample_rows,
            (splits as u32, n as u32, 1),
            SAMPLE_THREADS,
            0,
            &[
                Arg::Ptr(be.ptr(&out)),
                Arg::Ptr(be.ptr(&logits.data)),
                Arg::Ptr(be.ptr(&d_rows)),
                Arg::Ptr(be.ptr(&d_keys)),
                Arg::Ptr(be.ptr(&d_inv)),
                Arg::I32(vocab as i32),
                Arg::Ptr(be.ptr(part_scores)),
                Arg::Ptr(be.ptr(part_tokens)),
                Arg::Ptr(be.ptr(done)),
                Arg::Ptr(d_masks.as_ref().map_or(0, |m| be.ptr(m))),
                Arg::Ptr(d_mask_rows.as_ref().map_or(0, |m| be.ptr(m))),
                Arg::I32(mask_words as i32),
            ],
        );
        let drawn = ck(be.stream.clone_dtoh(&out), "sampled tokens copy");
        for (&row, &token) in device_rows.iter().zip(&drawn) {
            tokens[row as usize] = token as u32;
        }
    }
    for i in host_rows {
        let row = ck(be.stream.clone_dtoh(&logits.data.slice(i * vocab..(i + 1) * vocab)), "logits row copy");
        tokens[i] = sample_allowed(&row, rows[i].allowed.as_deref(), &rows[i].params, rows[i].position);
    }
    tokens
}

/// Rows of `logits` copied to the host one by one (only the rows asked for cross the bus).
pub(super) fn logits_rows_to_host(be: &CudaBackend, logits: &CudaTensor, rows: &[usize]) -> Vec<f32> {
    let vocab = logits.cols;
    let mut out = Vec::with_capacity(rows.len() * vocab);
    for &i in rows {
        out.extend(ck(be.stream.clone_dtoh(&logits.data.slice(i * vocab..(i + 1) * vocab)), "logits row copy"));
    }
    out
}

/// The greedy draw of every row of `logits` (the argmax; -1 for a row without a finite logit)
/// written as i32 at device address `out`, nothing read back: the same kernel and rule as a
/// greedy row of [`sample_rows`], so the same tokens.
pub(super) fn greedy_rows_into(be: &CudaBackend, logits: &CudaTensor, out: u64) {
    let n = logits.rows;
    if n == 0 {
        return;
    }
    let vocab = logits.cols;
    let rows: Vec<i32> = (0..n as i32).collect();
    let d_rows = ck(be.stream.clone_htod(&rows), "sampling rows copy");
    let d_keys = ck(be.stream.clone_htod(&vec![0u64; n]), "sampling keys copy");
    let d_inv = ck(be.stream.clone_htod(&vec![0.0f64; n]), "sampling temperatures copy");
    let splits = if vocab <= ONE_BLOCK_VOCAB { 1 } else { vocab.div_ceil(TOKENS_PER_BLOCK) };
    assert!(splits <= MAX_SPLITS, "a vocabulary of {vocab} tokens needs more sampling blocks than a row can count");
    let mut scratch = be.sampling_scratch.lock().unwrap_or_else(|p| p.into_inner());
    let scratch = scratch.get_or_insert_with(|| SamplingScratch::new(be, n * splits, n));
    scratch.reserve(be, n * splits, n);
    be.launch(
        &be.k.sample_rows,
        (splits as u32, n as u32, 1),
        SAMPLE_THREADS,
        0,
        &[
            Arg::Ptr(out),
            Arg::Ptr(be.ptr(&logits.data)),
            Arg::Ptr(be.ptr(&d_rows)),
            Arg::Ptr(be.ptr(&d_keys)),
            Arg::Ptr(be.ptr(&d_inv)),
            Arg::I32(vocab as i32),
            Arg::Ptr(be.ptr(&scratch.scores)),
            Arg::Ptr(be.ptr(&scratch.tokens)),
            Arg::Ptr(be.ptr(&scratch.done)),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(0),
        ],
    );
}

/// `ids[r] = drafts[rows[r]]` (0 where that is -1) on the device: a chained drafter forward's
/// token ids from the argmax of the forward before it (cuda/sample.cu, draft_ids).
pub(super) fn write_draft_ids(be: &CudaBackend, ids: u64, drafts: u64, rows: &[u32]) {
    if rows.is_empty() {
        return;
    }
    let rows: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
    let d_rows = ck(be.stream.clone_htod(&rows), "draft rows copy");
    let threads = 128u32;
    be.launch(&be.k.draft_ids, ((rows.len() as u32).div_ceil(threads), 1, 1), threads, 0, &[Arg::Ptr(ids), Arg::Ptr(drafts), Arg::Ptr(be.ptr(&d_rows)), Arg::I32(rows.len() as i32)]);
}
