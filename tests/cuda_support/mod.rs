//! Helpers shared by the GPU tests (tests/cuda_*.rs).
#![allow(dead_code)]

use kestrel::backend::cuda::{probe, CudaBackend, CudaInitError};
use kestrel::backend::shapes::LinearAttnShape;
use kestrel::backend::{BatchLayout, CacheSpec, KvDtype, RowKind, RowLayout};
use kestrel::backend::weight_bytes::{MatrixBytes, SharedBytes};
use kestrel::model::weights::Dtype;

/// The GPU backend, or `None` (with the skip message) where no CUDA driver is present.
pub fn gpu() -> Option<CudaBackend> {
    match probe() {
        Err(CudaInitError::NoDriver) => {
            eprintln!("skipped: no CUDA driver");
            return None;
        }
        Err(e) => panic!("CUDA driver present but unusable: {e}"),
        Ok(()) => {}
    }
    match CudaBackend::new(0) {
        Err(CudaInitError::NoDevice) => {
            eprintln!("skipped: no CUDA driver (no device visible)");
            None
        }
        Err(e) => panic!("CUDA backend failed to start: {e}"),
        Ok(b) => Some(b),
    }
}

/// A seeded stream of uniform values.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (self.next_f32() * 2.0 - 1.0) * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_f32() * n as f32) as usize).min(n - 1)
    }
}

/// max |got - want| / max |want|; NaN never passes.
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    if got.iter().any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / max_ref
}

pub fn bitwise_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A `[rows, cols]` matrix of random values stored as `dtype` (F32 or BF16).
pub fn random_matrix(rng: &mut Rng, rows: usize, cols: usize, dtype: Dtype) -> MatrixBytes {
    let scale = 1.0 / (cols as f32).sqrt();
    let values = rng.vec(rows * cols, scale);
    match dtype {
        Dtype::BF16 => {
            let bytes: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect();
            MatrixBytes { data: SharedBytes::from_static(Box::leak(bytes.into_boxed_slice())), start: 0, dtype, rows, cols }
        }
        _ => MatrixBytes::from_f32(values, rows, cols),
    }
}

/// One request of a cache test: its block table, state slot and next position.
#[derive(Clone)]
pub struct CacheSeq {
    pub table: Vec<u32>,
    pub slot: usize,
    pub pos: usize,
}

/// `n` sequences of `blocks_each` shuffled blocks each, sequence i in state slot i.
pub fn cache_sequences(rng: &mut Rng, n: usize, blocks_each: usize) -> Vec<CacheSeq> {
    let mut blocks: Vec<u32> = (0..(n * blocks_each) as u32).collect();
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, rng.below(i + 1));
    }
    (0..n).map(|i| CacheSeq { table: blocks[i * blocks_each..(i + 1) * blocks_each].to_vec(), slot: i, pos: 0 }).collect()
}

/// The layout of one row of `seq`.
pub fn cache_row(kind: RowKind, seq: &CacheSeq, token_start: usize, n: usize, snapshot_base: usize) -> RowLayout {
    RowLayout { kind, token_start, num_tokens: n, start_position: seq.pos, block_table: seq.table.clone(), state_slot: seq.slot, snapshot_base }
}

/// Rows (kind, sequence index, tokens) laid out one after another; snapshot bases in order.
pub fn layout_rows(seqs: &[CacheSeq], rows: &[(RowKind, usize, usize)]) -> BatchLayout {
    let (mut start, mut snap) = (0, 0);
    let mut out = BatchLayout::default();
    for &(kind, s, n) in rows {
        out.rows.push(cache_row(kind, &seqs[s], start, n, snap));
        start += n;
        if kind == RowKind::Generate {
            snap += n;
        }
    }
    out
}

/// Moves each row's sequence past its tokens.
pub fn advance_rows(seqs: &mut [CacheSeq], rows: &[(RowKind, usize, usize)]) {
    for &(_, s, n) in rows {
        seqs[s].pos += n;
    }
}

/// One attention layer's cache of `kv_dtype` (blocks of 16 positions) for `sequences`
/// sequences, and no linear layers.
pub fn attention_spec(kv_dtype: KvDtype, kv_heads: usize, head_dim: usize, num_blocks: usize, sequences: usize) -> CacheSpec {
    CacheSpec {
        attention_layers: 1,
        num_blocks,
        block_size: 16,
        kv_heads,
        head_dim,
        kv_dtype,
        linear_layers: 0,
        linear: LinearAttnShape { num_key_heads: 1, num_value_heads: 1, key_head_dim: 8, value_head_dim: 8, conv_kernel: 4, out_heads_tiled: false },
        state_slots: sequences,
        snapshot_slots: 8,
        checkpoint_slots: 0,
    }
}

/// Steps of a cache test over three sequences: prefill rows from position 0, a prefill
/// continuing at an unaligned position beside a verify row, generate rows of 1 and 2 tokens,
/// then a plain decode step (every row one token).
pub fn cache_steps() -> Vec<Vec<(RowKind, usize, usize)>> {
    use RowKind::*;
    vec![
        vec![(Prefill, 0, 37), (Prefill, 1, 100)],
        vec![(Prefill, 0, 40), (Generate, 1, 3), (Prefill, 2, 5)],
        vec![(Generate, 0, 1), (Generate, 2, 2), (Generate, 1, 1)],
        vec![(Generate, 1, 1), (Generate, 0, 1), (Generate, 2, 1)],
    ]
}
