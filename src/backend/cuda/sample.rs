//! Position-keyed sampling on the device (cuda/sample.cu): greedy and plain-temperature rows are
//! drawn by a kernel and only their token ids are copied back. Rows that filter with top-k or
//! top-p are copied back and drawn by the host sampler, since the filtered set needs a sort.

use super::{ck, Arg, CudaBackend, CudaTensor};
use crate::backend::RowSampling;
use crate::engine::sampler::{position_key, sample_at_position};

/// Threads per block: SAMPLE_THREADS in cuda/sample.cu.
const SAMPLE_THREADS: u32 = 256;
/// Vocabulary tokens per block, at most: a row's vocabulary is split across blocks (about 128
/// for a 248K vocabulary), each thread scoring about 8 tokens.
const TOKENS_PER_BLOCK: usize = 2048;

pub(super) fn sample_rows(be: &CudaBackend, logits: &CudaTensor, rows: &[RowSampling]) -> Vec<u32> {
    assert_eq!(logits.rows, rows.len(), "sample_rows: {} logits rows, {} sampling specs", logits.rows, rows.len());
    let vocab = logits.cols;
    let mut tokens = vec![0u32; rows.len()];
    let (mut device_rows, mut keys, mut inverse_temperatures, mut host_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, r) in rows.iter().enumerate() {
        if r.params.is_greedy() {
            device_rows.push(i as i32);
            keys.push(0u64);
            inverse_temperatures.push(0.0f64);
        } else if r.params.filters(vocab) {
            host_rows.push(i);
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
        let out = be.alloc_i32(n);
        let splits = vocab.div_ceil(TOKENS_PER_BLOCK).max(1);
        // SAFETY: each block writes its partial before the last block of its row reads them.
        let part_scores = ck(unsafe { be.stream.alloc::<f64>(n * splits) }, "alloc");
        let part_tokens = be.alloc_i32(n * splits);
        let done = ck(be.stream.alloc_zeros::<u32>(n), "alloc");
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
                Arg::Ptr(be.ptr(&part_scores)),
                Arg::Ptr(be.ptr(&part_tokens)),
                Arg::Ptr(be.ptr(&done)),
            ],
        );
        let drawn = ck(be.stream.clone_dtoh(&out), "sampled tokens copy");
        for (&row, &token) in device_rows.iter().zip(&drawn) {
            tokens[row as usize] = token as u32;
        }
    }
    for i in host_rows {
        let row = ck(be.stream.clone_dtoh(&logits.data.slice(i * vocab..(i + 1) * vocab)), "logits row copy");
        tokens[i] = sample_at_position(&row, &rows[i].params, rows[i].position);
    }
    tokens
}
