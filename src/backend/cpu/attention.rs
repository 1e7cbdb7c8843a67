//! Gated full attention on the CPU: q/gate split, per-head q/k RMSNorm, partial NeoX RoPE,
//! paged KV writes in the cache's format and causal attention over each row's context, read
//! back from the cache (every position, the step's own included, so a query sees the same
//! stored keys and values whichever step wrote them).

use super::pool::ThreadPool;
use super::{CpuCache, CpuTensor};
use crate::backend::{AttentionDims, BatchLayout, RowLayout};

/// Token -> (row, offset in row) for a layout.
pub(super) fn token_rows(layout: &BatchLayout) -> Vec<(usize, usize)> {
    let mut map = vec![(0usize, 0usize); layout.num_tokens()];
    for (ri, r) in layout.rows.iter().enumerate() {
        for i in 0..r.num_tokens {
            map[r.token_start + i] = (ri, i);
        }
    }
    map
}

fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (v, wi) in x.iter_mut().zip(w) {
        *v = *v * inv * wi;
    }
}

/// NeoX-style rotation of the first `rotary_dim` values: pairs (j, j + rotary_dim/2).
fn rope_in_place(x: &mut [f32], position: u32, rotary_dim: usize, theta: f64) {
    let half = rotary_dim / 2;
    for j in 0..half {
        // Same f32 steps as the reference: inv_freq = 1 / theta^(2j/d), angle = pos * inv_freq.
        let inv_freq = 1.0f32 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32);
        let angle = position as f32 * inv_freq;
        let (s, c) = angle.sin_cos();
        let (a, b) = (x[j], x[j + half]);
        x[j] = a * c - b * s;
        x[j + half] = b * c + a * s;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn gated_attention(
    pool: &ThreadPool,
    q_gate: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    q_norm: &[f32],
    k_norm: &[f32],
    d: &AttentionDims,
    layout: &BatchLayout,
    cache: &mut CpuCache,
    layer: usize,
) -> CpuTensor {
    assert_eq!(k.cols, d.num_kv_heads * d.head_dim);
    write_keys_and_values(k, v, k_norm, d, layout, cache, layer);
    attend(pool, q_gate, q_norm, d, layout, cache, layer)
}

/// Keys normed and rotated, then K and V written at each token's cache slot.
fn write_keys_and_values(k: &CpuTensor, v: &CpuTensor, k_norm: &[f32], d: &AttentionDims, layout: &BatchLayout, cache: &mut CpuCache, layer: usize) {
    let (nkv, hd) = (d.num_kv_heads, d.head_dim);
    let positions = layout.positions();
    let rows = token_rows(layout);
    let kv_width = nkv * hd;
    let bs = cache.spec.block_size;
    for ti in 0..k.rows {
        let (ri, _) = rows[ti];
        let pos = positions[ti] as usize;
        let block = layout.rows[ri].block_table[pos / bs] as usize;
        let slot = block * bs + pos % bs;
        let mut krow = k.data[ti * kv_width..(ti + 1) * kv_width].to_vec();
        for h in 0..nkv {
            let kh = &mut krow[h * hd..(h + 1) * hd];
            rms_norm_in_place(kh, k_norm, d.eps);
            rope_in_place(kh, positions[ti], d.rotary_dim, d.rope_theta);
            cache.kv.write_key(layer, slot, h, kh);
            cache.kv.write_value(layer, slot, h, &v.data[ti * kv_width + h * hd..][..hd]);
        }
    }
}

/// The first position a row's tokens attend to: 0, every cached key of the sequence.
#[cfg(not(feature = "plant-verify-skips-cache"))]
fn first_visible_position(_row: &RowLayout) -> usize {
    0
}

/// A deliberate bug for checking the tests (vLLM issue 40880): verify rows see only their own
/// new tokens, never the cached ones. Never enabled in a build that serves.
#[cfg(feature = "plant-verify-skips-cache")]
fn first_visible_position(row: &RowLayout) -> usize {
    if row.kind == crate::backend::RowKind::Generate && row.num_tokens > 1 {
        row.start_position
    } else {
        0
    }
}

/// Causal attention of every token's query heads over what the cache holds for its row (its
/// own key and value included), gated: queries normed and rotated by RoPE (and by the cache's
/// rotation when keys are stored rotated), one (token, head) per task, keys visited in
/// position order. A rotated value format sums values in the rotated space and un-rotates the
/// sum once.
pub(super) fn attend(pool: &ThreadPool, q_gate: &CpuTensor, q_norm: &[f32], d: &AttentionDims, layout: &BatchLayout, cache: &CpuCache, layer: usize) -> CpuTensor {
    attend_within(pool, q_gate, q_norm, d, layout, cache, layer, DECODED_VALUES)
}

/// [`attend`], decoding the rows' keys and values ahead where they take at most `budget` f32
/// values (the bits are the same either way).
#[allow(clippy::too_many_arguments)]
fn attend_within(pool: &ThreadPool, q_gate: &CpuTensor, q_norm: &[f32], d: &AttentionDims, layout: &BatchLayout, cache: &CpuCache, layer: usize, budget: usize) -> CpuTensor {
    let t = q_gate.rows;
    let (nq, nkv, hd) = (d.num_heads, d.num_kv_heads, d.head_dim);
    assert_eq!(q_gate.cols, nq * 2 * hd);
    let positions = layout.positions();
    let rows = token_rows(layout);
    let kv = &cache.kv;
    let key_rotation = kv.key.rotation();
    let value_rotation = kv.value.rotation();

    // Queries: per head the projection holds [query (D) | gate (D)].
    let mut q = vec![0.0f32; t * nq * hd];
    pool.rows_mut(&mut q, nq * hd, nq * (hd + d.rotary_dim * 8), &|ti, qrow| {
        for h in 0..nq {
            let qh = &mut qrow[h * hd..(h + 1) * hd];
            qh.copy_from_slice(&q_gate.data[ti * nq * 2 * hd + h * 2 * hd..][..hd]);
            rms_norm_in_place(qh, q_norm, d.eps);
            rope_in_place(qh, positions[ti], d.rotary_dim, d.rope_theta);
            if let Some(r) = key_rotation {
                r.rotate(qh);
            }
        }
    });
    let gate_of = |ti: usize, h: usize| &q_gate.data[ti * nq * 2 * hd + h * 2 * hd + hd..][..hd];

    let bs = cache.spec.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let group = nq / nkv;
    // The stored key (or value) of kv head `kvh` at position `p` of row `ri`, decoded.
    let read = |ri: usize, p: usize, kvh: usize, key: bool, out: &mut [f32]| {
        let table = &layout.rows[ri].block_table;
        let slot = table[p / bs] as usize * bs + p % bs;
        if key {
            kv.read_key(layer, slot, kvh, out)
        } else {
            kv.read_value(layer, slot, kvh, out)
        }
    };
    let stored = StoredRows::decode(pool, layout, &positions, &rows, nkv, hd, budget, &read);
    let mut out = vec![0.0f32; t * nq * hd];
    let longest = positions.iter().max().map_or(0, |&p| p as usize + 1);
    pool.rows_mut(&mut out, hd, longest * hd * 2, &|idx, o| {
        let (ti, h) = (idx / nq, idx % nq);
        let (ri, _) = rows[ti];
        let row = &layout.rows[ri];
        let qh = &q[ti * nq * hd + h * hd..][..hd];
        let kvh = h / group;
        let (first, ctx) = (first_visible_position(row), positions[ti] as usize + 1);
        // Where nothing was decoded ahead, each vector is decoded into `buf` as it is read.
        let mut buf = vec![0.0f32; hd];
        let mut scores = Vec::with_capacity(ctx - first);
        for p in first..ctx {
            let key = fetch(&stored, &mut buf, ri, kvh, p, true, &read);
            scores.push(super::dot::dot(qh, key) * scale);
        }
        let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut denom = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            denom += *s;
        }
        for (p, s) in (first..ctx).zip(&scores) {
            let wgt = s / denom;
            let value = fetch(&stored, &mut buf, ri, kvh, p, false, &read);
            for (oj, vj) in o.iter_mut().zip(value) {
                *oj += wgt * vj;
            }
        }
        if let Some(r) = value_rotation {
            r.unrotate(o);
        }
        for (oj, gj) in o.iter_mut().zip(gate_of(ti, h)) {
            *oj *= sigmoid(*gj);
        }
    });
    CpuTensor { data: out, rows: t, cols: nq * hd }
}

/// How attention reads the cache: `read(row, position, kv head, key?, out)` decodes one stored
/// vector.
type ReadVector<'a> = dyn Fn(usize, usize, usize, bool, &mut [f32]) + Sync + 'a;

/// The stored key or value of (row, kv head, position): decoded ahead, or decoded now by
/// `read` into `buf`.
#[allow(clippy::too_many_arguments)]
fn fetch<'a>(stored: &'a Option<StoredRows>, buf: &'a mut [f32], row: usize, kv_head: usize, position: usize, key: bool, read: &ReadVector) -> &'a [f32] {
    match stored {
        Some(s) => s.vector(row, kv_head, position, key),
        None => {
            read(row, position, kv_head, key, buf);
            buf
        }
    }
}

/// Values decoded ahead for one attention call at most (64 MiB of f32): beyond it, each task
/// decodes what it reads.
const DECODED_VALUES: usize = 16 << 20;

/// Every row's stored keys and values as f32, decoded once before the (token, head) tasks read
/// them: the query heads of a group and the tokens of a row share them, where decoding per read
/// repeated the work once per head and token. The values are the cache's decoding either way.
struct StoredRows {
    keys: Vec<f32>,
    values: Vec<f32>,
    /// Per row: where its vectors start (in vectors) and how many positions it holds.
    rows: Vec<(usize, usize)>,
    head_dim: usize,
}

impl StoredRows {
    /// Decodes positions `0..end` of each row (its last token's position + 1) for every kv head
    /// through `read`; None where that exceeds `budget` values.
    #[allow(clippy::too_many_arguments)]
    fn decode(pool: &ThreadPool, layout: &BatchLayout, positions: &[u32], token_rows: &[(usize, usize)], kv_heads: usize, head_dim: usize, budget: usize, read: &ReadVector) -> Option<Self> {
        let mut ends = vec![0usize; layout.rows.len()];
        for (&(ri, _), &p) in token_rows.iter().zip(positions) {
            ends[ri] = ends[ri].max(p as usize + 1);
        }
        let mut rows = Vec::with_capacity(ends.len());
        let mut vectors = 0usize;
        for &end in &ends {
            rows.push((vectors, end));
            vectors += kv_heads * end;
        }
        if vectors * head_dim * 2 > budget {
            return None;
        }
        // Vector v belongs to the last row starting at or before it (rows without tokens hold
        // none), as (kv head, position) = ((v - start) / end, (v - start) % end).
        let place = |v: usize| {
            let ri = rows.partition_point(|&(start, _)| start <= v) - 1;
            let (start, end) = rows[ri];
            (ri, (v - start) / end, (v - start) % end)
        };
        let plane = |key: bool| {
            let mut data = vec![0.0f32; vectors * head_dim];
            pool.rows_mut(&mut data, head_dim, head_dim * 4, &|v, out| {
                let (ri, kvh, p) = place(v);
                read(ri, p, kvh, key, out)
            });
            data
        };
        let (keys, values) = (plane(true), plane(false));
        Some(StoredRows { keys, values, rows, head_dim })
    }

    fn vector(&self, row: usize, kv_head: usize, position: usize, key: bool) -> &[f32] {
        let (start, end) = self.rows[row];
        let at = (start + kv_head * end + position) * self.head_dim;
        let plane = if key { &self.keys } else { &self.values };
        &plane[at..at + self.head_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, CacheSpec, KvDtype, LinearAttnShape, RowKind};

    /// Keys and values decoded ahead give the bits of decoding each one as it is read, for every
    /// KV format, over rows of different lengths in one batch (a prefill beside decode and
    /// verify rows, on blocks out of order).
    #[test]
    fn decoding_ahead_keeps_the_bits_of_decoding_per_read() {
        let cpu = CpuBackend::with_threads(2);
        let (nq, nkv, hd) = (4, 2, 32);
        let d = AttentionDims { num_heads: nq, num_kv_heads: nkv, head_dim: hd, rotary_dim: 16, rope_theta: 1e4, eps: 1e-6 };
        let values = |n: usize, seed: u32| -> Vec<f32> { (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2000) as f32 / 1000.0 - 1.0).collect() };
        let linear = LinearAttnShape { num_key_heads: 1, num_value_heads: 1, key_head_dim: 8, value_head_dim: 8, conv_kernel: 4, out_heads_tiled: false };
        for kv_dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Tq3] {
            let spec = CacheSpec { attention_layers: 1, num_blocks: 12, block_size: 8, kv_heads: nkv, head_dim: hd, kv_dtype, linear_layers: 0, linear: linear.clone(), state_slots: 3, snapshot_slots: 0, checkpoint_slots: 0 };
            let mut cache = cpu.alloc_cache(&spec).unwrap();
            let row = |kind, token_start, num_tokens, start_position, blocks: &[u32], slot| RowLayout { kind, token_start, num_tokens, start_position, block_table: blocks.to_vec(), state_slot: slot, snapshot_base: 0 };
            // Fill the three sequences' caches, then one step with a row of each kind.
            let fill = BatchLayout { rows: vec![row(RowKind::Prefill, 0, 19, 0, &[3, 0, 7], 0), row(RowKind::Prefill, 19, 9, 0, &[5, 1], 1), row(RowKind::Prefill, 28, 2, 0, &[9], 2)] };
            let step = BatchLayout { rows: vec![row(RowKind::Prefill, 0, 5, 19, &[3, 0, 7, 11], 0), row(RowKind::Generate, 5, 1, 9, &[5, 1], 1), row(RowKind::Generate, 6, 3, 2, &[9], 2)] };
            for (i, layout) in [fill, step].iter().enumerate() {
                let n = layout.num_tokens();
                let (qn, kn) = (vec![1.0f32; hd], vec![1.0f32; hd]);
                let qg = cpu.from_host(&values(n * nq * 2 * hd, 3 + i as u32), n, nq * 2 * hd);
                let (k, v) = (cpu.from_host(&values(n * nkv * hd, 7 + i as u32), n, nkv * hd), cpu.from_host(&values(n * nkv * hd, 11 + i as u32), n, nkv * hd));
                write_keys_and_values(&k, &v, &kn, &d, layout, &mut cache, 0);
                let ahead = attend_within(&cpu.pool, &qg, &qn, &d, layout, &cache, 0, DECODED_VALUES);
                let per_read = attend_within(&cpu.pool, &qg, &qn, &d, layout, &cache, 0, 0);
                assert_eq!(ahead.data.len(), n * nq * hd);
                for (j, (a, b)) in ahead.data.iter().zip(&per_read.data).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{kv_dtype:?} layout {i} value {j}: {a} against {b}");
                }
            }
        }
    }
}
