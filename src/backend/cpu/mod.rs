//! The CPU reference backend: f32 maths, multithreaded with rayon, every row computed
//! independently of the others.

mod attention;
pub mod gdn;
pub mod kv_store;
pub mod matmul;

use super::{AttentionDims, Backend, BackendError, BatchLayout, CacheSpec, GdnParams, MoeWeights, StateCommit};
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::backend::weight_bytes::MatrixBytes;
use kv_store::KvStore;
pub use matmul::CpuMatrix;
use rayon::prelude::*;

/// A `[rows, cols]` f32 activation.
#[derive(Clone, Debug)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// Attention KV blocks in the cache's KV format, and recurrent-state slots, each a flat f32
/// array per layer.
pub struct CpuCache {
    pub spec: CacheSpec,
    /// Per attention layer, `num_blocks * block_size` slots of `kv_heads` keys and values.
    pub kv: KvStore,
    /// Per linear layer: `[state_slots, (K-1) * conv_dim]`, oldest input first.
    pub conv: Vec<Vec<f32>>,
    /// Per linear layer: `[state_slots, nv, dk, dv]`.
    pub rec: Vec<Vec<f32>>,
    pub conv_snap: Vec<Vec<f32>>,
    pub rec_snap: Vec<Vec<f32>>,
}

#[derive(Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }

    /// The attention part of [`Backend::gated_attention`] alone: every token's query heads
    /// (from the q/gate projection, normed and rotated as there) attend over what `cache`
    /// already holds, the step's own keys and values included; nothing is written. The GPU
    /// tests check a device's reads of its own cache against it.
    pub fn attention_over_cache(&self, q_gate: &CpuTensor, q_norm: &[f32], dims: &AttentionDims, layout: &BatchLayout, cache: &CpuCache, attention_layer: usize) -> CpuTensor {
        attention::attend(q_gate, q_norm, dims, layout, cache, attention_layer)
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Cache = CpuCache;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload_matrix(&self, m: &MatrixBytes) -> Result<CpuMatrix, BackendError> {
        // Zero-copy: the CPU reads weights straight from the memory map.
        Ok(CpuMatrix::from(m.clone()))
    }

    fn upload_stacked(&self, parts: &[MatrixBytes]) -> Result<CpuMatrix, BackendError> {
        CpuMatrix::stacked(parts).map_err(BackendError::Invalid)
    }

    fn matrix_rows(&self, w: &CpuMatrix) -> usize {
        w.rows
    }

    fn upload_vector(&self, v: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(v.to_vec())
    }

    fn alloc_cache(&self, spec: &CacheSpec) -> Result<CpuCache, BackendError> {
        let conv_len = spec.linear.conv_state_len();
        let rec_len = spec.linear.recurrent_state_len();
        let alloc = |n: usize, layers: usize| -> Result<Vec<Vec<f32>>, BackendError> {
            let mut out = Vec::with_capacity(layers);
            for _ in 0..layers {
                let mut v = Vec::new();
                v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory(format!("{} MiB for the cache", (n * 4) >> 20)))?;
                v.resize(n, 0.0);
                out.push(v);
            }
            Ok(out)
        };
        Ok(CpuCache {
            kv: KvStore::new(spec)?,
            conv: alloc(spec.state_slots * conv_len, spec.linear_layers)?,
            rec: alloc(spec.state_slots * rec_len, spec.linear_layers)?,
            conv_snap: alloc(spec.snapshot_slots * conv_len, spec.linear_layers)?,
            rec_snap: alloc(spec.snapshot_slots * rec_len, spec.linear_layers)?,
            spec: spec.clone(),
        })
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> CpuTensor {
        assert_eq!(data.len(), rows * cols);
        CpuTensor { data: data.to_vec(), rows, cols }
    }

    fn to_host(&self, x: &CpuTensor) -> Vec<f32> {
        x.data.clone()
    }

    fn shape(&self, x: &CpuTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &CpuMatrix, ids: &[u32]) -> CpuTensor {
        let h = table.cols;
        let mut data = vec![0.0f32; ids.len() * h];
        data.par_chunks_mut(h).zip(ids.par_iter()).for_each(|(row, &id)| matmul::weight_row(table, id as usize, row));
        CpuTensor { data, rows: ids.len(), cols: h }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> CpuTensor {
        assert_eq!(w.len(), x.cols);
        let mut data = x.data.clone();
        data.par_chunks_mut(x.cols).for_each(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, wi) in row.iter_mut().zip(w) {
                *v = *v * inv * wi;
            }
        });
        CpuTensor { data, rows: x.rows, cols: x.cols }
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuMatrix) -> CpuTensor {
        CpuTensor { data: matmul::matmul(&x.data, x.rows, w), rows: x.rows, cols: w.rows }
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols));
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols));
        let data = gate.data.iter().zip(&up.data).map(|(g, u)| silu(*g) * u).collect();
        CpuTensor { data, rows: gate.rows, cols: gate.cols }
    }

    fn gather_cols(&self, x: &CpuTensor, cols: &[u32]) -> CpuTensor {
        let mut data = Vec::with_capacity(x.rows * cols.len());
        for r in 0..x.rows {
            let row = &x.data[r * x.cols..(r + 1) * x.cols];
            data.extend(cols.iter().map(|&c| row[c as usize]));
        }
        CpuTensor { data, rows: x.rows, cols: cols.len() }
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[u32]) -> CpuTensor {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(&x.data[r as usize * x.cols..(r as usize + 1) * x.cols]);
        }
        CpuTensor { data, rows: rows.len(), cols: x.cols }
    }

    fn concat_cols(&self, a: &CpuTensor, b: &CpuTensor) -> CpuTensor {
        assert_eq!(a.rows, b.rows);
        let mut data = Vec::with_capacity(a.rows * (a.cols + b.cols));
        for r in 0..a.rows {
            data.extend_from_slice(&a.data[r * a.cols..(r + 1) * a.cols]);
            data.extend_from_slice(&b.data[r * b.cols..(r + 1) * b.cols]);
        }
        CpuTensor { data, rows: a.rows, cols: a.cols + b.cols }
    }

    fn gated_attention(
        &self,
        q_gate: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        q_norm: &Vec<f32>,
        k_norm: &Vec<f32>,
        dims: &AttentionDims,
        layout: &BatchLayout,
        cache: &mut CpuCache,
        attention_layer: usize,
    ) -> CpuTensor {
        attention::gated_attention(q_gate, k, v, q_norm, k_norm, dims, layout, cache, attention_layer)
    }

    fn gated_delta_net(
        &self,
        mixed: &CpuTensor,
        z: &CpuTensor,
        b: &CpuTensor,
        a: &CpuTensor,
        params: &GdnParams<Self>,
        cfg: &LinearAttnShape,
        eps: f32,
        layout: &BatchLayout,
        cache: &mut CpuCache,
        linear_layer: usize,
    ) -> CpuTensor {
        let inputs = gdn::GdnInputs {
            mixed,
            z,
            b,
            a,
            conv_weight: &params.conv_weight,
            neg_a: &params.neg_a,
            dt_bias: &params.dt_bias,
            norm_weight: &params.norm_weight,
        };
        gdn::gated_delta_net(&inputs, cfg, eps, layout, cache, linear_layer)
    }

    fn moe_add(&self, acc: &mut CpuTensor, x: &CpuTensor, w: &MoeWeights<Self>, cfg: &MoeShape) {
        let (t, h) = (x.rows, x.cols);
        let e = cfg.num_experts;
        let mut parts = self.matmul_parts(x, &w.router, &w.router_widths(e)).into_iter();
        let logits = parts.next().expect("router logits");
        let gates = parts.next();
        // Routing per token: softmax over all experts, top-k (ties to the lower index).
        let routes: Vec<Vec<(usize, f32)>> = (0..t)
            .map(|ti| {
                let l = &logits.data[ti * e..(ti + 1) * e];
                let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let ex: Vec<f32> = l.iter().map(|v| (v - m).exp()).collect();
                let sum: f32 = ex.iter().sum();
                let mut idx: Vec<usize> = (0..e).collect();
                idx.sort_by(|&a, &b| ex[b].partial_cmp(&ex[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
                let mut top: Vec<(usize, f32)> = idx[..cfg.top_k].iter().map(|&i| (i, ex[i] / sum)).collect();
                if cfg.norm_topk_prob {
                    let s: f32 = top.iter().map(|p| p.1).sum();
                    top.iter_mut().for_each(|p| p.1 /= s);
                }
                top
            })
            .collect();
        // Each expert runs once over the tokens routed to it; results are summed per token in
        // that token's top-k order, so the sum never depends on other tokens.
        let mut per_slot = vec![0.0f32; t * cfg.top_k * h];
        for (ei, [gate_up, down]) in w.experts.iter().enumerate() {
            let mut toks = Vec::new();
            let mut slots = Vec::new();
            for (ti, route) in routes.iter().enumerate() {
                if let Some(s) = route.iter().position(|p| p.0 == ei) {
                    toks.push(ti as u32);
                    slots.push(s);
                }
            }
            if toks.is_empty() {
                continue;
            }
            let xe = self.gather_rows(x, &toks);
            let act = self.matmul_swiglu(&xe, gate_up);
            let y = self.matmul(&act, down);
            for (j, (&ti, &s)) in toks.iter().zip(&slots).enumerate() {
                let wgt = routes[ti as usize][s].1;
                let dst = &mut per_slot[(ti as usize * cfg.top_k + s) * h..][..h];
                for (d, v) in dst.iter_mut().zip(&y.data[j * h..(j + 1) * h]) {
                    *d = wgt * v;
                }
            }
        }
        let mut out = vec![0.0f32; t * h];
        for ti in 0..t {
            let o = &mut out[ti * h..(ti + 1) * h];
            for s in 0..cfg.top_k {
                for (a, b) in o.iter_mut().zip(&per_slot[(ti * cfg.top_k + s) * h..][..h]) {
                    *a += b;
                }
            }
        }
        if let Some([gate_up, down]) = &w.shared {
            let act = self.matmul_swiglu(x, gate_up);
            let y = self.matmul(&act, down);
            for ti in 0..t {
                let scale = gates.as_ref().map(|g| 1.0 / (1.0 + (-g.data[ti]).exp())).unwrap_or(1.0);
                for (a, b) in out[ti * h..(ti + 1) * h].iter_mut().zip(&y.data[ti * h..(ti + 1) * h]) {
                    *a += scale * b;
                }
            }
        }
        self.add_assign(acc, &CpuTensor { data: out, rows: t, cols: h });
    }

    fn commit_states(&self, cache: &mut CpuCache, commits: &[StateCommit]) {
        let conv_len = cache.spec.linear.conv_state_len();
        let rec_len = cache.spec.linear.recurrent_state_len();
        for (&StateCommit { slot, snapshot, conv_only }, layer) in commits.iter().flat_map(|c| std::iter::repeat(c).zip(0..cache.spec.linear_layers)) {
            let (src, dst) = (&cache.conv_snap[layer][snapshot * conv_len..][..conv_len], &mut cache.conv[layer][slot * conv_len..][..conv_len]);
            dst.copy_from_slice(src);
            if !conv_only {
                let (src, dst) = (&cache.rec_snap[layer][snapshot * rec_len..][..rec_len], &mut cache.rec[layer][slot * rec_len..][..rec_len]);
                dst.copy_from_slice(src);
            }
        }
    }

    fn reset_states(&self, cache: &mut CpuCache, slots: &[usize]) {
        let conv_len = cache.spec.linear.conv_state_len();
        let rec_len = cache.spec.linear.recurrent_state_len();
        for (&slot, layer) in slots.iter().flat_map(|s| std::iter::repeat(s).zip(0..cache.spec.linear_layers)) {
            cache.conv[layer][slot * conv_len..][..conv_len].fill(0.0);
            cache.rec[layer][slot * rec_len..][..rec_len].fill(0.0);
        }
    }
}
