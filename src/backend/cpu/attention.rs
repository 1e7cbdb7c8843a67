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
    let mut out = vec![0.0f32; t * nq * hd];
    let longest = positions.iter().max().map_or(0, |&p| p as usize + 1);
    pool.rows_mut(&mut out, hd, longest * hd * 2, &|idx, o| {
        let (ti, h) = (idx / nq, idx % nq);
        let (ri, _) = rows[ti];
        let row = &layout.rows[ri];
        let table = &row.block_table;
        let qh = &q[ti * nq * hd + h * hd..][..hd];
        let kvh = h / group;
        let (first, ctx) = (first_visible_position(row), positions[ti] as usize + 1);
        let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
        let mut stored = vec![0.0f32; hd];
        let mut scores = Vec::with_capacity(ctx - first);
        for p in first..ctx {
            kv.read_key(layer, slot(p), kvh, &mut stored);
            scores.push(super::dot::dot(qh, &stored) * scale);
        }
        let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut denom = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            denom += *s;
        }
        for (p, s) in (first..ctx).zip(&scores) {
            kv.read_value(layer, slot(p), kvh, &mut stored);
            let wgt = s / denom;
            for (oj, vj) in o.iter_mut().zip(&stored) {
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
