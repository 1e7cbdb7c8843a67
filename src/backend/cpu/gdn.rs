//! Gated DeltaNet on the CPU: causal conv with its window, gates, the delta rule (chunked for
//! prefill, recurrent with per-token snapshots for generate rows) and the gated output norm.
//!
//! Recurrent state per value head is `S[i][j]`, i over the key dim and j over the value dim
//! (the Hugging Face layout), in f32.

use super::pool::ThreadPool;
use super::{CpuCache, CpuTensor};
use crate::backend::shapes::LinearAttnShape;
use crate::backend::{delta_state_in_place, BatchLayout, RowKind};
use std::sync::Mutex;

use crate::backend::DELTA_RULE_CHUNK as CHUNK;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// PyTorch's softplus with threshold 20.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn l2_normalize(x: &mut [f32], scale: f32) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    for v in x.iter_mut() {
        *v *= inv * scale;
    }
}

pub(super) struct GdnInputs<'a> {
    pub mixed: &'a CpuTensor,
    pub z: &'a CpuTensor,
    pub b: &'a CpuTensor,
    pub a: &'a CpuTensor,
    pub conv_weight: &'a [f32],
    pub neg_a: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm_weight: &'a [f32],
}

/// Output of one (row, value head) delta-rule task.
struct HeadResult {
    out: Vec<f32>,
    /// Final state (prefill) or the state after each token (generate), concatenated.
    states: Vec<f32>,
}

pub(super) fn gated_delta_net(pool: &ThreadPool, inp: &GdnInputs, cfg: &LinearAttnShape, eps: f32, layout: &BatchLayout, cache: &mut CpuCache, layer: usize) -> CpuTensor {
    let t = inp.mixed.rows;
    let conv_dim = cfg.conv_dim();
    let kw = cfg.conv_kernel;
    let hist = kw - 1;
    let (nk, nv, dk, dv) = (cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim);
    let r = cfg.heads_per_key_head();
    let key_dim = cfg.key_dim();
    let conv_len = cfg.conv_state_len();
    let rec_len = cfg.recurrent_state_len();
    let head_len = dk * dv;

    // 1. Causal depthwise conv + SiLU per row, over [window (K-1) | the row's inputs].
    let mut conv_out = vec![0.0f32; t * conv_dim];
    for row in &layout.rows {
        let n = row.num_tokens;
        let mut win = vec![0.0f32; (hist + n) * conv_dim];
        win[..conv_len].copy_from_slice(&cache.conv[layer][row.state_slot * conv_len..][..conv_len]);
        win[conv_len..].copy_from_slice(&inp.mixed.data[row.token_start * conv_dim..(row.token_start + n) * conv_dim]);
        let out = &mut conv_out[row.token_start * conv_dim..(row.token_start + n) * conv_dim];
        pool.rows_mut(out, conv_dim, conv_dim * kw, &|i, o| {
            for (c, oc) in o.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for j in 0..kw {
                    acc += inp.conv_weight[c * kw + j] * win[(i + j) * conv_dim + c];
                }
                *oc = silu(acc);
            }
        });
        match row.kind {
            RowKind::Prefill => {
                cache.conv[layer][row.state_slot * conv_len..][..conv_len].copy_from_slice(&win[n * conv_dim..]);
            }
            RowKind::Generate => {
                for i in 0..n {
                    let snap = row.snapshot_base + i;
                    cache.conv_snap[layer][snap * conv_len..][..conv_len].copy_from_slice(&win[(i + 1) * conv_dim..(i + 1 + hist) * conv_dim]);
                }
            }
        }
    }

    // 2. Split q|k|v, l2-normalize q and k per key head (q also scaled by dk^-1/2), gates.
    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut q = vec![0.0f32; t * key_dim];
    let mut k = vec![0.0f32; t * key_dim];
    let mut v = vec![0.0f32; t * cfg.value_dim()];
    let mut g = vec![0.0f32; t * nv];
    let mut beta = vec![0.0f32; t * nv];
    for ti in 0..t {
        let c = &conv_out[ti * conv_dim..(ti + 1) * conv_dim];
        q[ti * key_dim..(ti + 1) * key_dim].copy_from_slice(&c[..key_dim]);
        k[ti * key_dim..(ti + 1) * key_dim].copy_from_slice(&c[key_dim..2 * key_dim]);
        v[ti * cfg.value_dim()..(ti + 1) * cfg.value_dim()].copy_from_slice(&c[2 * key_dim..]);
        for h in 0..nk {
            l2_normalize(&mut q[ti * key_dim + h * dk..][..dk], q_scale);
            l2_normalize(&mut k[ti * key_dim + h * dk..][..dk], 1.0);
        }
        for h in 0..nv {
            g[ti * nv + h] = inp.neg_a[h] * softplus(inp.a.data[ti * nv + h] + inp.dt_bias[h]);
            beta[ti * nv + h] = sigmoid(inp.b.data[ti * nv + h]);
        }
    }

    // 3. Delta rule, one task per (row, value head).
    let tasks: Vec<(usize, usize)> = (0..layout.rows.len()).flat_map(|ri| (0..nv).map(move |h| (ri, h))).collect();
    let rec = &cache.rec[layer];
    let run = |&(ri, h): &(usize, usize)| {
            let row = &layout.rows[ri];
            let kh = h / r;
            let seq = HeadSeq { q: &q, k: &k, v: &v, g: &g, beta: &beta, key_dim, value_dim: cfg.value_dim(), nv, dk, dv, kh, h, token_start: row.token_start, n: row.num_tokens };
            let mut state = rec[row.state_slot * rec_len + h * head_len..][..head_len].to_vec();
            match row.kind {
                RowKind::Prefill => {
                    let out = chunked_delta_rule(&seq, &mut state, row.start_position);
                    HeadResult { out, states: state }
                }
                RowKind::Generate => recurrent_delta_rule(&seq, &mut state),
            }
    };
    // Each task's cost grows with its tokens' count and the state size.
    let work = layout.num_tokens() * nv * head_len * 4;
    let results: Vec<HeadResult> = if work < super::pool::SHARED_WORK || tasks.len() == 1 {
        tasks.iter().map(run).collect()
    } else {
        let slots: Vec<Mutex<Option<HeadResult>>> = tasks.iter().map(|_| Mutex::new(None)).collect();
        pool.split(tasks.len(), 1, &|range| {
            for i in range {
                let r = run(&tasks[i]);
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            }
        });
        slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every task ran")).collect()
    };

    // 4. States back to the cache; outputs through the gated RMSNorm.
    let mut core = vec![0.0f32; t * cfg.value_dim()];
    for (&(ri, h), res) in tasks.iter().zip(&results) {
        let row = &layout.rows[ri];
        match row.kind {
            RowKind::Prefill => cache.rec[layer][row.state_slot * rec_len + h * head_len..][..head_len].copy_from_slice(&res.states),
            RowKind::Generate if delta_state_in_place(row.kind, row.num_tokens) => {
                cache.rec[layer][row.state_slot * rec_len + h * head_len..][..head_len].copy_from_slice(&res.states[..head_len]);
            }
            RowKind::Generate => {
                for i in 0..row.num_tokens {
                    let snap = row.snapshot_base + i;
                    cache.rec_snap[layer][snap * rec_len + h * head_len..][..head_len].copy_from_slice(&res.states[i * head_len..(i + 1) * head_len]);
                }
            }
        }
        for i in 0..row.num_tokens {
            core[(row.token_start + i) * cfg.value_dim() + h * dv..][..dv].copy_from_slice(&res.out[i * dv..(i + 1) * dv]);
        }
    }
    // Output head slot `idx % nv` of each token holds value head `src[idx % nv]`.
    let src: Vec<usize> = {
        let mut s = vec![0; nv];
        for h in 0..nv {
            s[cfg.out_head(h)] = h;
        }
        s
    };
    let mut out = vec![0.0f32; t * cfg.value_dim()];
    pool.rows_mut(&mut out, dv, dv * 8, &|slot, o| {
        let idx = slot - slot % nv + src[slot % nv];
        let x = &core[idx * dv..(idx + 1) * dv];
        let zz = &inp.z.data[idx * dv..(idx + 1) * dv];
        let ms = x.iter().map(|v| v * v).sum::<f32>() / dv as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..dv {
            o[j] = x[j] * inv * inp.norm_weight[j] * silu(zz[j]);
        }
    });
    CpuTensor { data: out, rows: t, cols: cfg.value_dim() }
}

/// `y -= a * x`, element by element.
#[inline(always)]
fn sub_scaled(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi -= a * xi;
    }
}

/// `y += a * x`, element by element.
#[inline(always)]
fn add_scaled(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// One value head's inputs over one row.
struct HeadSeq<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    key_dim: usize,
    value_dim: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    /// Key head serving this value head (repeat-interleave mapping).
    kh: usize,
    h: usize,
    token_start: usize,
    n: usize,
}

impl HeadSeq<'_> {
    fn q(&self, i: usize) -> &[f32] {
        &self.q[(self.token_start + i) * self.key_dim + self.kh * self.dk..][..self.dk]
    }
    fn k(&self, i: usize) -> &[f32] {
        &self.k[(self.token_start + i) * self.key_dim + self.kh * self.dk..][..self.dk]
    }
    fn v(&self, i: usize) -> &[f32] {
        &self.v[(self.token_start + i) * self.value_dim + self.h * self.dv..][..self.dv]
    }
    fn g(&self, i: usize) -> f32 {
        self.g[(self.token_start + i) * self.nv + self.h]
    }
    fn beta(&self, i: usize) -> f32 {
        self.beta[(self.token_start + i) * self.nv + self.h]
    }
}

/// Token-by-token form; the state after every token is kept as a snapshot.
fn recurrent_delta_rule(s: &HeadSeq, state: &mut [f32]) -> HeadResult {
    #[cfg(target_arch = "x86_64")]
    if super::dot::avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { recurrent_delta_rule_avx2(s, state) };
    }
    recurrent_delta_rule_body(s, state)
}

/// The same code compiled for AVX2: its loops are element-wise or accumulate in a fixed order,
/// never reassociated nor fused, so the wider build gives the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn recurrent_delta_rule_avx2(s: &HeadSeq, state: &mut [f32]) -> HeadResult {
    recurrent_delta_rule_body(s, state)
}

#[inline(always)]
fn recurrent_delta_rule_body(s: &HeadSeq, state: &mut [f32]) -> HeadResult {
    let (dk, dv) = (s.dk, s.dv);
    let mut out = vec![0.0f32; s.n * dv];
    let mut states = Vec::with_capacity(s.n * dk * dv);
    let mut kv = vec![0.0f32; dv];
    for i in 0..s.n {
        let (q, k, v) = (s.q(i), s.k(i), s.v(i));
        let decay = s.g(i).exp();
        for x in state.iter_mut() {
            *x *= decay;
        }
        kv.iter_mut().for_each(|x| *x = 0.0);
        for a in 0..dk {
            let row = &state[a * dv..(a + 1) * dv];
            for j in 0..dv {
                kv[j] += row[j] * k[a];
            }
        }
        let b = s.beta(i);
        for j in 0..dv {
            kv[j] = b * (v[j] - kv[j]);
        }
        for a in 0..dk {
            let row = &mut state[a * dv..(a + 1) * dv];
            for j in 0..dv {
                row[j] += k[a] * kv[j];
            }
        }
        let o = &mut out[i * dv..(i + 1) * dv];
        for a in 0..dk {
            let row = &state[a * dv..(a + 1) * dv];
            for j in 0..dv {
                o[j] += row[j] * q[a];
            }
        }
        states.extend_from_slice(state);
    }
    HeadResult { out, states }
}

/// Chunked (WY) form over chunks aligned to absolute positions; updates `state` in place.
fn chunked_delta_rule(s: &HeadSeq, state: &mut [f32], start_position: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if super::dot::avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { chunked_delta_rule_avx2(s, state, start_position) };
    }
    chunked_delta_rule_body(s, state, start_position)
}

/// The same code compiled for AVX2 (same bits, as for the recurrent form).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunked_delta_rule_avx2(s: &HeadSeq, state: &mut [f32], start_position: usize) -> Vec<f32> {
    chunked_delta_rule_body(s, state, start_position)
}

#[inline(always)]
fn chunked_delta_rule_body(s: &HeadSeq, state: &mut [f32], start_position: usize) -> Vec<f32> {
    let (dk, dv) = (s.dk, s.dv);
    let mut out = vec![0.0f32; s.n * dv];
    let mut i0 = 0;
    while i0 < s.n {
        let pos = start_position + i0;
        let len = (CHUNK - pos % CHUNK).min(s.n - i0);
        // Cumulative log-decay inside the chunk.
        let mut gam = vec![0.0f32; len];
        let mut acc = 0.0f32;
        for l in 0..len {
            acc += s.g(i0 + l);
            gam[l] = acc;
        }
        // exp(gam_l - gam_m) for m <= l, used twice below.
        let mut decay = vec![0.0f32; len * len];
        for l in 0..len {
            for m in 0..=l {
                decay[l * len + m] = (gam[l] - gam[m]).exp();
            }
        }
        // Forward substitution for U = (I+A)^-1 (beta v) and W = (I+A)^-1 (beta exp(gam) k),
        // A[l][m] = beta_l (k_l . k_m) exp(gam_l - gam_m) for m < l.
        let mut u = vec![0.0f32; len * dv];
        let mut w = vec![0.0f32; len * dk];
        for l in 0..len {
            let (kl, bl) = (s.k(i0 + l), s.beta(i0 + l));
            let (vl, el) = (s.v(i0 + l), gam[l].exp());
            for j in 0..dv {
                u[l * dv + j] = bl * vl[j];
            }
            for a in 0..dk {
                w[l * dk + a] = bl * el * kl[a];
            }
            let (u_prev, u_l) = u.split_at_mut(l * dv);
            let (w_prev, w_l) = w.split_at_mut(l * dk);
            for m in 0..l {
                let coeff = bl * super::dot::dot(kl, s.k(i0 + m)) * decay[l * len + m];
                sub_scaled(&mut u_l[..dv], coeff, &u_prev[m * dv..(m + 1) * dv]);
                sub_scaled(&mut w_l[..dk], coeff, &w_prev[m * dk..(m + 1) * dk]);
            }
        }
        // V' = U - W S
        let mut vp = u;
        for l in 0..len {
            for a in 0..dk {
                sub_scaled(&mut vp[l * dv..(l + 1) * dv], w[l * dk + a], &state[a * dv..(a + 1) * dv]);
            }
        }
        // O_l = exp(gam_l) q_l^T S + sum_{m<=l} (q_l . k_m) exp(gam_l - gam_m) V'_m
        for l in 0..len {
            let ql = s.q(i0 + l);
            let o = &mut out[(i0 + l) * dv..(i0 + l + 1) * dv];
            let el = gam[l].exp();
            for a in 0..dk {
                add_scaled(o, ql[a] * el, &state[a * dv..(a + 1) * dv]);
            }
            for m in 0..=l {
                let coeff = super::dot::dot(ql, s.k(i0 + m)) * decay[l * len + m];
                add_scaled(o, coeff, &vp[m * dv..(m + 1) * dv]);
            }
        }
        // S = exp(gam_last) S + sum_m exp(gam_last - gam_m) k_m (x) V'_m
        let last = gam[len - 1];
        let el = last.exp();
        for x in state.iter_mut() {
            *x *= el;
        }
        for m in 0..len {
            let km = s.k(i0 + m);
            let f = decay[(len - 1) * len + m];
            for a in 0..dk {
                add_scaled(&mut state[a * dv..(a + 1) * dv], km[a] * f, &vp[m * dv..(m + 1) * dv]);
            }
        }
        i0 += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunked form equals the recurrent form (up to rounding) for any start alignment.
    #[test]
    fn chunked_matches_recurrent() {
        let (n, dk, dv) = (150, 8, 12);
        let mut rng = 12345u64;
        let mut rnd = || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((rng >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let mut q: Vec<f32> = (0..n * dk).map(|_| rnd()).collect();
        let mut k: Vec<f32> = (0..n * dk).map(|_| rnd()).collect();
        for i in 0..n {
            l2_normalize(&mut q[i * dk..(i + 1) * dk], 1.0 / (dk as f32).sqrt());
            l2_normalize(&mut k[i * dk..(i + 1) * dk], 1.0);
        }
        let v: Vec<f32> = (0..n * dv).map(|_| rnd()).collect();
        let g: Vec<f32> = (0..n).map(|_| -(rnd() + 0.5) * 0.3).collect();
        let beta: Vec<f32> = (0..n).map(|_| rnd() + 0.5).collect();
        let seq = HeadSeq { q: &q, k: &k, v: &v, g: &g, beta: &beta, key_dim: dk, value_dim: dv, nv: 1, dk, dv, kh: 0, h: 0, token_start: 0, n };
        let init: Vec<f32> = (0..dk * dv).map(|_| rnd()).collect();
        let mut s_rec = init.clone();
        let rec = recurrent_delta_rule(&seq, &mut s_rec);
        for start in [0usize, 5, 63, 64] {
            let mut s_chunk = init.clone();
            let out = chunked_delta_rule(&seq, &mut s_chunk, start);
            let max_err = out.iter().zip(&rec.out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(max_err < 1e-4, "start {start}: output error {max_err}");
            let serr = s_chunk.iter().zip(&s_rec).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(serr < 1e-4, "start {start}: state error {serr}");
        }
    }
}
