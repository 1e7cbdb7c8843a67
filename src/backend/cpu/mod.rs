//! The CPU reference backend: f32 maths, every row computed independently of the others, on
//! a persistent pool of threads ([`pool`]) with SIMD kernels chosen at run time ([`dot::Isa`])
//! that give the same bits as the scalar reference on every machine.

mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod dequant;
pub mod dot;
pub mod gdn;
pub mod int8;
pub mod kv_store;
pub mod matmul;
pub mod pool;

use super::{AttentionDims, Backend, BackendError, BatchLayout, CacheSpec, GdnParams, MoeWeights, StateCheckpoint, StateCommit};
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::backend::weight_bytes::MatrixBytes;
use kv_store::KvStore;
pub use dot::Isa;
pub use int8::MatmulMode;
pub use matmul::CpuMatrix;
use matmul::Store;
use pool::{SharedOut, ThreadPool};
use std::sync::Mutex;

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
    /// Per prefix-cache checkpoint: every linear layer's conv window then delta-rule state,
    /// layer after layer. Allocated on first use, so an unused budget costs no memory.
    pub checkpoints: Vec<Vec<f32>>,
}

pub struct CpuBackend {
    pool: ThreadPool,
    isa: Isa,
    /// Exact f32 products (the reference) or the integer path for quantized weights.
    matmul_mode: MatmulMode,
    /// `--load-format dummy`: the seed of the next random matrix, while uploads make them.
    random_weights: Mutex<Option<u64>>,
    /// Whether matmuls round their activations to bf16 first, as the GPU's tensor cores take
    /// them (the default, so that the backends compute the same products); off, the f32
    /// reference that the comparisons with transformers' f32 forward use.
    bf16_activations: bool,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A backend on every core the process may use, with the widest kernels the CPU has.
    pub fn new() -> Self {
        Self::with_threads(default_threads())
    }

    /// The attention part of [`Backend::gated_attention`] alone: every token's query heads
    /// (from the q/gate projection, normed and rotated as there) attend over what `cache`
    /// already holds, the step's own keys and values included; nothing is written. The GPU
    /// tests check a device's reads of its own cache against it.
    pub fn attention_over_cache(&self, q_gate: &CpuTensor, q_norm: &[f32], dims: &AttentionDims, layout: &BatchLayout, cache: &CpuCache, attention_layer: usize) -> CpuTensor {
        attention::attend(&self.pool, q_gate, q_norm, dims, layout, cache, attention_layer)
    }

    /// A backend on `threads` threads (at least one), with the widest kernels the CPU has.
    pub fn with_threads(threads: usize) -> Self {
        Self::with_options(threads, Isa::detect())
    }

    /// A backend on `threads` threads running `isa`'s kernels (the tests compare them; every
    /// choice gives the same bits). `isa` must be one the CPU runs ([`Isa::detect`] or
    /// [`Isa::Scalar`]).
    pub fn with_options(threads: usize, isa: Isa) -> Self {
        CpuBackend { pool: ThreadPool::new(threads), isa, matmul_mode: MatmulMode::Exact, random_weights: Mutex::new(None), bf16_activations: true }
    }

    /// This backend with matmuls over the f32 activations themselves (no bf16 rounding): the
    /// exact reference for comparisons with an f32 forward.
    pub fn with_f32_activations(mut self) -> Self {
        self.bf16_activations = false;
        self
    }

    /// `x` as this backend's matmuls take it.
    fn matmul_input<'a>(&self, x: &'a [f32]) -> std::borrow::Cow<'a, [f32]> {
        if self.bf16_activations {
            std::borrow::Cow::Owned(matmul::bf16_activations(x))
        } else {
            std::borrow::Cow::Borrowed(x)
        }
    }

    /// Threads each op runs on.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The same backend multiplying quantized weights as `mode` says.
    pub fn with_matmul_mode(mut self, mode: MatmulMode) -> Self {
        self.matmul_mode = mode;
        self
    }

    pub fn matmul_mode(&self) -> MatmulMode {
        self.matmul_mode
    }

    /// `y (store) x @ w^T` in the backend's matmul mode, on the activations as the matmuls
    /// take them (int8 mode quantizes those, so it differs from exact mode only where it
    /// multiplies in integers).
    fn matmul_into(&self, x: &[f32], t: usize, w: &CpuMatrix, y: &mut [f32], store: Store) {
        let x = self.matmul_input(x);
        match self.matmul_mode {
            MatmulMode::Exact => matmul::matmul_into(&self.pool, self.isa, &x, t, w, y, store),
            MatmulMode::Int8 | MatmulMode::Auto => int8::matmul_into(&self.pool, self.isa, self.matmul_mode, &x, t, w, y, store),
        }
    }
}

impl CpuBackend {
    /// The seed of the next random matrix, if uploads make random ones; each matrix gets its
    /// own stream (as on the GPU, so both backends build the same dummy model).
    fn random_seed(&self) -> Option<u64> {
        let mut s = self.random_weights.lock().unwrap_or_else(|p| p.into_inner());
        let seed = *s;
        *s = seed.map(|v| v.wrapping_add(0x9E37_79B9_7F4A_7C15));
        seed
    }

    /// A `[rows, cols]` bf16 matrix of uniform values in `[-scale, scale)` with `scale =
    /// sqrt(3 / cols)` (standard deviation 1/sqrt(cols), so activations keep their size layer
    /// to layer), each a hash of `(seed, index)`: the values of the CUDA backend's
    /// `fill_random_bf16`.
    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<CpuMatrix, BackendError> {
        let n = rows.checked_mul(cols).ok_or_else(|| BackendError::Invalid(format!("a {rows}x{cols} matrix")))?;
        let mut bytes: Vec<u8> = Vec::new();
        bytes.try_reserve_exact(2 * n).map_err(|_| BackendError::OutOfMemory(format!("{} MiB of random weights", (2 * n) >> 20)))?;
        bytes.resize(2 * n, 0);
        let scale = (3.0 / cols.max(1) as f32).sqrt();
        let out = SharedOut::new(&mut bytes);
        let per_chunk = 1 << 16;
        self.pool.split(n.div_ceil(per_chunk), 1, &|chunks| {
            let (a, b) = (chunks.start * per_chunk, (chunks.end * per_chunk).min(n));
            // SAFETY: the chunk ranges are disjoint.
            let dst = unsafe { out.slice(2 * a, 2 * (b - a)) };
            for (i, d) in (a..b).zip(dst.chunks_exact_mut(2)) {
                let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
                d.copy_from_slice(&half::bf16::from_f32((2.0 * u - 1.0) * scale).to_le_bytes());
            }
        });
        let m = MatrixBytes { data: crate::backend::weight_bytes::SharedBytes::from_vec(bytes), start: 0, dtype: kestrel_quant::Dtype::BF16, rows, cols };
        Ok(CpuMatrix::from(m))
    }
}

/// The cores this process may run on.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The columns of `y` cut into consecutive parts of `widths`.
fn split_cols(y: &CpuTensor, widths: &[usize]) -> Vec<CpuTensor> {
    let mut start = 0;
    widths
        .iter()
        .map(|&n| {
            let mut data = Vec::with_capacity(y.rows * n);
            for row in y.data.chunks(y.cols) {
                data.extend_from_slice(&row[start..start + n]);
            }
            start += n;
            CpuTensor { data, rows: y.rows, cols: n }
        })
        .collect()
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
        self.upload_stacked(std::slice::from_ref(m))
    }

    fn upload_stacked(&self, parts: &[MatrixBytes]) -> Result<CpuMatrix, BackendError> {
        let matrix = CpuMatrix::stacked(parts).map_err(BackendError::Invalid)?;
        match self.random_seed() {
            Some(seed) => self.random_matrix(matrix.rows, matrix.cols, seed),
            // Zero-copy: the CPU reads weights straight from the memory map.
            None => Ok(matrix),
        }
    }

    fn set_random_weights(&self, seed: Option<u64>) -> Result<(), BackendError> {
        *self.random_weights.lock().unwrap_or_else(|p| p.into_inner()) = seed;
        Ok(())
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
            checkpoints: vec![Vec::new(); spec.checkpoint_slots],
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
        for (row, &id) in data.chunks_mut(h).zip(ids) {
            matmul::weight_row(table, id as usize, row);
        }
        CpuTensor { data, rows: ids.len(), cols: h }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &Vec<f32>, eps: f32) -> CpuTensor {
        assert_eq!(w.len(), x.cols);
        let mut data = x.data.clone();
        for row in data.chunks_mut(x.cols) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, wi) in row.iter_mut().zip(w) {
                *v = *v * inv * wi;
            }
        }
        CpuTensor { data, rows: x.rows, cols: x.cols }
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuMatrix) -> CpuTensor {
        let mut data = vec![0.0f32; x.rows * w.rows];
        self.matmul_into(&x.data, x.rows, w, &mut data, Store::Set);
        CpuTensor { data, rows: x.rows, cols: w.rows }
    }

    fn matmul_add(&self, acc: &mut CpuTensor, x: &CpuTensor, w: &CpuMatrix) {
        assert_eq!((acc.rows, acc.cols), (x.rows, w.rows), "matmul_add: accumulator shape");
        self.matmul_into(&x.data, x.rows, w, &mut acc.data, Store::Add);
    }

    fn matmul_parts(&self, x: &CpuTensor, w: &CpuMatrix, widths: &[usize]) -> Vec<CpuTensor> {
        let y = self.matmul(x, w);
        split_cols(&y, widths)
    }

    fn matmul_swiglu(&self, x: &CpuTensor, w: &CpuMatrix) -> CpuTensor {
        let y = self.matmul(x, w);
        let half = y.cols / 2;
        let mut data = Vec::with_capacity(y.rows * half);
        for row in y.data.chunks(y.cols) {
            let (gate, up) = row.split_at(half);
            data.extend(gate.iter().zip(up).map(|(g, u)| silu(*g) * u));
        }
        CpuTensor { data, rows: y.rows, cols: half }
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols));
        x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> CpuTensor {
        // The same expression as `matmul_swiglu`'s, so both give the same bits.
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
        attention::gated_attention(&self.pool, q_gate, k, v, q_norm, k_norm, dims, layout, cache, attention_layer)
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
        gdn::gated_delta_net(&self.pool, &inputs, cfg, eps, layout, cache, linear_layer)
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

    fn save_checkpoints(&self, cache: &mut CpuCache, copies: &[StateCheckpoint]) {
        if cache.spec.linear_layers == 0 {
            return;
        }
        let (conv_len, rec_len) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
        for &StateCheckpoint { slot, checkpoint } in copies {
            let mut saved = std::mem::take(&mut cache.checkpoints[checkpoint]);
            saved.clear();
            for layer in 0..cache.spec.linear_layers {
                saved.extend_from_slice(&cache.conv[layer][slot * conv_len..][..conv_len]);
                saved.extend_from_slice(&cache.rec[layer][slot * rec_len..][..rec_len]);
            }
            cache.checkpoints[checkpoint] = saved;
        }
    }

    fn restore_checkpoints(&self, cache: &mut CpuCache, copies: &[StateCheckpoint]) {
        if cache.spec.linear_layers == 0 {
            return;
        }
        let (conv_len, rec_len) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
        for &StateCheckpoint { slot, checkpoint } in copies {
            let saved = &cache.checkpoints[checkpoint];
            assert_eq!(saved.len(), cache.spec.linear_layers * (conv_len + rec_len), "restore_checkpoints: checkpoint {checkpoint} was never saved");
            for (layer, state) in saved.chunks_exact(conv_len + rec_len).enumerate() {
                cache.conv[layer][slot * conv_len..][..conv_len].copy_from_slice(&state[..conv_len]);
                cache.rec[layer][slot * rec_len..][..rec_len].copy_from_slice(&state[conv_len..]);
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
