//! The [`Backend`] implementation: uploads, element-wise and row-wise ops here; matmul,
//! attention, Gated DeltaNet and MoE in their own files.

use super::cache::{self, CudaCache};
use super::quant_tiles::RowOrder;
use super::tensor::{StackedPart, WeightStorage};
use super::{ck, Arg, CudaBackend, CudaMatrix, CudaTensor, CudaVector};
use crate::backend::{AttentionDims, Backend, BackendError, BatchLayout, CacheSpec, GdnParams, MoeWeights, RowSampling, StateCheckpoint, StateCommit, StepLimits, ChainLink, GraphInputs, Real};
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::backend::weight_bytes::MatrixBytes;
use kestrel_quant::Dtype;
use std::sync::atomic::Ordering;

const THREADS: u32 = 256;

impl CudaBackend {
    /// Rows `rows` of `x` written to the first rows of `out` (as wide as `x`).
    pub(super) fn gather_rows_into(&self, out: &CudaTensor, x: &CudaTensor, rows: &[u32]) {
        assert!(out.cols == x.cols && out.rows >= rows.len(), "gather_rows: {} rows of {} columns into [{}, {}]", rows.len(), x.cols, out.rows, out.cols);
        if rows.is_empty() {
            return;
        }
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let didx = self.step_inputs().gather.write(self, &idx);
        let n = rows.len() * x.cols;
        self.launch(
            &self.k.gather_rows,
            (blocks(n), 1, 1),
            THREADS,
            0,
            &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(&x.data)), Arg::Ptr(didx), Arg::I32(rows.len() as i32), Arg::I32(x.cols as i32)],
        );
    }
}

fn blocks(n: usize) -> u32 {
    n.div_ceil(THREADS as usize) as u32
}

/// bf16 bit patterns of `v` and of its rounding remainder (`v ~= hi + lo`).
fn split_bf16(v: &[f32]) -> (Vec<u16>, Vec<u16>) {
    let hi: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let lo: Vec<u16> = v.iter().zip(&hi).map(|(&x, h)| half::bf16::from_f32(x - h.to_f32()).to_bits()).collect();
    (hi.iter().map(|h| h.to_bits()).collect(), lo)
}

fn upload_u16(be: &CudaBackend, v: &[u16]) -> Result<cudarc::driver::CudaSlice<u8>, BackendError> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    be.stream.clone_htod(&bytes).map_err(|e| BackendError::OutOfMemory(format!("{} MiB of weights: {e:?}", bytes.len() >> 20)))
}

pub(super) fn silu_mul(be: &CudaBackend, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
    assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "silu_mul: shapes differ");
    let out = be.tensor(gate.rows, gate.cols);
    let n = gate.rows * gate.cols;
    be.launch(&be.k.silu_mul, (blocks(n), 1, 1), THREADS, 0, &[Arg::Ptr(be.ptr(&out.data)), Arg::Ptr(be.ptr(&gate.data)), Arg::Ptr(be.ptr(&up.data)), Arg::I64(n as i64)]);
    out
}

impl CudaBackend {
    fn random_matrix(&self, rows: usize, cols: usize, seed: u64) -> Result<CudaMatrix, BackendError> {
        let n = rows * cols;
        // SAFETY: filled completely by the kernel below.
        let hi = unsafe { self.stream.alloc::<u8>((2 * n).max(2)) }.map_err(|e| BackendError::OutOfMemory(format!("{} MiB of weights: {e:?}", (2 * n) >> 20)))?;
        // Uniform with standard deviation 1/sqrt(cols): activations keep their scale layer to layer.
        let scale = (3.0 / cols.max(1) as f32).sqrt();
        self.launch(&self.k.fill_random_bf16, (blocks(n).min(65536), 1, 1), THREADS, 0, &[Arg::Ptr(self.ptr(&hi)), Arg::I64(n as i64), Arg::U64(seed), Arg::F32(scale)]);
        Ok(CudaMatrix::new(WeightStorage::Dense { hi, lo: None }, rows, cols))
    }

    /// Parts that all read as plain floats (none quantized), stacked as one dense weight: bf16
    /// as stored, F32/F16 as a bf16 pair (existing weights keep their layout).
    fn upload_dense(&self, parts: &[MatrixBytes], rows: usize, cols: usize) -> Result<CudaMatrix, BackendError> {
        let oom = |bytes: usize, e: cudarc::driver::DriverError| BackendError::OutOfMemory(format!("{} MiB of weights: {e:?}", bytes >> 20));
        if parts.iter().all(|p| p.dtype == Dtype::BF16) {
            // Stored bf16 goes up as is, each part straight into its rows.
            let total: usize = parts.iter().map(|p| p.bytes().len()).sum();
            // SAFETY: every byte is written by the part copies below.
            let mut hi = unsafe { self.stream.alloc::<u8>(total.max(2)) }.map_err(|e| oom(total, e))?;
            let mut offset = 0;
            for p in parts {
                let bytes = p.bytes();
                self.stream.memcpy_htod(bytes, &mut hi.slice_mut(offset..offset + bytes.len())).map_err(|e| oom(total, e))?;
                offset += bytes.len();
            }
            return Ok(CudaMatrix::new(WeightStorage::Dense { hi, lo: None }, rows, cols));
        }
        // F32/F16 weights keep ~16 bits as bf16 hi + lo matrices.
        let mut values = Vec::with_capacity(rows * cols);
        for p in parts {
            values.extend(kestrel_quant::dequantize(p.dtype, p.bytes()).map_err(|e| BackendError::Invalid(e.to_string()))?);
        }
        let (hi, lo) = split_bf16(&values);
        Ok(CudaMatrix::new(WeightStorage::Dense { hi: upload_u16(self, &hi)?, lo: Some(upload_u16(self, &lo)?) }, rows, cols))
    }

    /// Quantized parts without tiles (a type or width the kernels do not take), dequantized to
    /// bf16 (2 bytes a weight), beside bf16 parts as stored.
    fn upload_bf16_values(&self, parts: &[MatrixBytes], rows: usize, cols: usize) -> Result<CudaMatrix, BackendError> {
        let mut bits: Vec<u16> = Vec::with_capacity(rows * cols);
        for p in parts {
            let values = kestrel_quant::dequantize(p.dtype, p.bytes()).map_err(|e| BackendError::Invalid(e.to_string()))?;
            bits.extend(values.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
        }
        Ok(CudaMatrix::new(WeightStorage::Dense { hi: upload_u16(self, &bits)?, lo: None }, rows, cols))
    }

    /// One run of parts stored alike (see [`PartKind`]) as one weight.
    fn upload_run(&self, kind: PartKind, parts: &[MatrixBytes], order: RowOrder, seed: Option<u64>) -> Result<CudaMatrix, BackendError> {
        let (rows, cols) = MatrixBytes::stacked_shape(parts).map_err(BackendError::Invalid)?;
        match (kind, seed) {
            (PartKind::Tiles(dtype), Some(seed)) => Ok(CudaMatrix::new(WeightStorage::Tiles(super::qmatmul::random_tiles(self, dtype, order, rows, cols, seed)?), rows, cols)),
            (PartKind::Tiles(_), None) => Ok(CudaMatrix::new(WeightStorage::Tiles(super::qmatmul::upload_tiles(self, parts, order)?), rows, cols)),
            (_, Some(seed)) => self.random_matrix(rows, cols, seed),
            (PartKind::Bf16, None) => self.upload_dense(parts, rows, cols),
            (PartKind::Pair, None) => self.upload_dense(parts, rows, cols),
            (PartKind::Bf16Values, None) => self.upload_bf16_values(parts, rows, cols),
        }
    }
}

/// How a part of a weight goes to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartKind {
    /// Stored bf16.
    Bf16,
    /// Stored F32 or F16: a bf16 pair.
    Pair,
    /// Quantized with tiles of its own (the dtype: parts of one dtype share tiles).
    Tiles(Dtype),
    /// Quantized without tiles: dequantized to bf16.
    Bf16Values,
}

fn part_kind(m: &MatrixBytes) -> PartKind {
    match m.dtype {
        Dtype::BF16 => PartKind::Bf16,
        Dtype::F32 | Dtype::F16 => PartKind::Pair,
        d if super::qmatmul::tile_format(m).is_some() => PartKind::Tiles(d),
        _ => PartKind::Bf16Values,
    }
}

/// Which run a part of a stack with quantized parts joins: bf16 values of either origin share one.
fn run_key(kind: PartKind) -> PartKind {
    if kind == PartKind::Bf16 {
        PartKind::Bf16Values
    } else {
        kind
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type Cache = CudaCache;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload_matrix(&self, m: &MatrixBytes) -> Result<CudaMatrix, BackendError> {
        self.upload_stacked(std::slice::from_ref(m))
    }

    fn upload_stacked(&self, parts: &[MatrixBytes]) -> Result<CudaMatrix, BackendError> {
        let (rows, cols) = MatrixBytes::stacked_shape(parts).map_err(BackendError::Invalid)?;
        let seed = self.random_seed();
        let kinds: Vec<PartKind> = parts.iter().map(part_kind).collect();
        let matrix = if kinds.iter().all(|k| matches!(k, PartKind::Bf16 | PartKind::Pair)) {
            // No quantized part: one dense weight as before.
            match seed {
                Some(seed) => self.random_matrix(rows, cols, seed)?,
                None => self.upload_dense(parts, rows, cols)?,
            }
        } else {
            // Runs of parts stored alike, each one weight; more than one run makes a stack.
            let mut runs: Vec<(PartKind, usize, usize)> = Vec::new();
            for (i, k) in kinds.iter().enumerate() {
                match runs.last_mut() {
                    Some(run) if run_key(run.0) == run_key(*k) => run.2 = i + 1,
                    _ => runs.push((run_key(*k), i, i + 1)),
                }
            }
            let mut uploaded = Vec::with_capacity(runs.len());
            let mut row0 = 0;
            for (i, (kind, a, b)) in runs.into_iter().enumerate() {
                // Random runs each get their own stream of numbers.
                let run_seed = seed.map(|s| s ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
                let m = self.upload_run(kind, &parts[a..b], RowOrder::Plain, run_seed)?;
                let next = row0 + m.rows;
                uploaded.push(StackedPart { row0, matrix: m });
                row0 = next;
            }
            if uploaded.len() == 1 {
                uploaded.pop().expect("one run").matrix
            } else {
                CudaMatrix::new(WeightStorage::Stacked(uploaded), rows, cols)
            }
        };
        self.uploaded_bytes.fetch_add(matrix.device_bytes(), Ordering::Relaxed);
        Ok(matrix)
    }

    fn upload_gate_up(&self, gate: &MatrixBytes, up: &MatrixBytes) -> Result<CudaMatrix, BackendError> {
        let kind = part_kind(gate);
        if !matches!(kind, PartKind::Tiles(_)) || part_kind(up) != kind || (gate.rows, gate.cols) != (up.rows, up.cols) {
            return self.upload_stacked(&[gate.clone(), up.clone()]);
        }
        // Gate and up rows interleaved by tile, for the SwiGLU store (quant_tiles::RowOrder).
        let parts = [gate.clone(), up.clone()];
        let matrix = self.upload_run(kind, &parts, RowOrder::GateUp { half: gate.rows }, self.random_seed())?;
        self.uploaded_bytes.fetch_add(matrix.device_bytes(), Ordering::Relaxed);
        Ok(matrix)
    }

    fn matrix_rows(&self, w: &CudaMatrix) -> usize {
        w.rows
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CudaVector, BackendError> {
        let data = if v.is_empty() { self.alloc_f32(1) } else { self.stream.clone_htod(v).map_err(|e| BackendError::Device(format!("{e:?}")))? };
        Ok(CudaVector { data, len: v.len() })
    }

    fn alloc_cache(&self, spec: &CacheSpec) -> Result<CudaCache, BackendError> {
        // Captured graphs hold the addresses of the cache they were captured with.
        self.drop_graphs();
        cache::alloc(self, spec)
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        assert_eq!(data.len(), rows * cols, "from_host: {} values for a {rows}x{cols} tensor", data.len());
        let data = if data.is_empty() { self.alloc_f32(1) } else { ck(self.stream.clone_htod(data), "host to device copy") };
        CudaTensor { data, rows, cols }
    }

    fn to_host(&self, x: &CudaTensor) -> Vec<f32> {
        let mut v = ck(self.stream.clone_dtoh(&x.data), "device to host copy");
        v.truncate(x.rows * x.cols);
        v
    }

    fn shape(&self, x: &CudaTensor) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32]) -> CudaTensor {
        let _span = self.span("embed");
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            panic!("embed: token id {bad} outside the table of {} rows", table.rows);
        }
        let out = self.tensor(ids.len(), table.cols);
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let dids = self.step_inputs().ids.write(self, &ids);
        match &table.store {
            WeightStorage::Dense { hi, lo } => {
                let lo = lo.as_ref().map_or(0, |l| self.ptr(l));
                self.launch(
                    &self.k.embed_rows,
                    (ids.len() as u32, 1, 1),
                    THREADS,
                    0,
                    &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(hi)), Arg::Ptr(lo), Arg::Ptr(dids), Arg::I32(ids.len() as i32), Arg::I32(table.cols as i32)],
                );
            }
            WeightStorage::Tiles(t) => super::qmatmul::embed_tiles(self, self.ptr(&out.data), t, dids, ids.len(), table.cols),
            WeightStorage::Stacked(_) => panic!("embed: an embedding table stacked from differently stored parts ({})", table.storage_name()),
        }
        out
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaVector, eps: f32) -> CudaTensor {
        let _span = self.span("rms_norm");
        assert_eq!(w.len, x.cols, "rms_norm: weight length {} for {} columns", w.len, x.cols);
        let out = self.tensor(x.rows, x.cols);
        self.launch(
            &self.k.rms_norm_rows,
            (x.rows as u32, 1, 1),
            THREADS,
            0,
            &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(&x.data)), Arg::Ptr(self.ptr(&w.data)), Arg::I32(x.rows as i32), Arg::I32(x.cols as i32), Arg::F32(eps)],
        );
        out
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
        let _span = self.span("matmul");
        super::matmul::matmul(self, x, w)
    }

    fn matmul_add(&self, acc: &mut CudaTensor, x: &CudaTensor, w: &CudaMatrix) {
        let _span = self.span("matmul");
        super::matmul::matmul_add(self, acc, x, w)
    }

    fn matmul_parts(&self, x: &CudaTensor, w: &CudaMatrix, widths: &[usize]) -> Vec<CudaTensor> {
        let _span = self.span("matmul");
        super::matmul::matmul_parts(self, x, w, widths)
    }

    fn matmul_swiglu(&self, x: &CudaTensor, w: &CudaMatrix) -> CudaTensor {
        let _span = self.span("matmul");
        super::matmul::matmul_swiglu(self, x, w)
    }

    fn rms_norm_matmul_parts(&self, x: &CudaTensor, norm: &CudaVector, eps: f32, w: &CudaMatrix, widths: &[usize]) -> Vec<CudaTensor> {
        let _span = self.span("rms_norm_matmul");
        super::matmul::rms_norm_matmul_parts(self, x, norm, eps, w, widths)
    }

    fn rms_norm_matmul_swiglu(&self, x: &CudaTensor, norm: &CudaVector, eps: f32, w: &CudaMatrix) -> CudaTensor {
        let _span = self.span("rms_norm_matmul");
        super::matmul::rms_norm_matmul_swiglu(self, x, norm, eps, w)
    }

    fn add_assign(&self, x: &mut CudaTensor, y: &CudaTensor) {
        let _span = self.span("add_assign");
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add_assign: shapes differ");
        let n = x.rows * x.cols;
        self.launch(&self.k.add_assign, (blocks(n), 1, 1), THREADS, 0, &[Arg::Ptr(self.ptr(&x.data)), Arg::Ptr(self.ptr(&y.data)), Arg::I64(n as i64)]);
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> CudaTensor {
        let _span = self.span("silu_mul");
        silu_mul(self, gate, up)
    }

    fn gather_cols(&self, x: &CudaTensor, cols: &[u32]) -> CudaTensor {
        let _span = self.span("gather");
        if let Some(&bad) = cols.iter().find(|&&c| c as usize >= x.cols) {
            panic!("gather_cols: column {bad} outside {} columns", x.cols);
        }
        let out = self.tensor(x.rows, cols.len());
        let didx = self.ptr(&*self.column_list(cols));
        let n = x.rows * cols.len();
        self.launch(
            &self.k.gather_cols,
            (blocks(n), 1, 1),
            THREADS,
            0,
            &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(&x.data)), Arg::Ptr(didx), Arg::I32(x.rows as i32), Arg::I32(x.cols as i32), Arg::I32(cols.len() as i32)],
        );
        out
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[u32]) -> CudaTensor {
        let _span = self.span("gather");
        if let Some(&bad) = rows.iter().find(|&&r| r as usize >= x.rows) {
            panic!("gather_rows: row {bad} outside {} rows", x.rows);
        }
        let out = self.tensor(rows.len(), x.cols);
        self.gather_rows_into(&out, x, rows);
        out
    }

    fn concat_cols(&self, a: &CudaTensor, b: &CudaTensor) -> CudaTensor {
        let _span = self.span("concat_cols");
        assert_eq!(a.rows, b.rows, "concat_cols: row counts differ");
        let out = self.tensor(a.rows, a.cols + b.cols);
        let n = a.rows * (a.cols + b.cols);
        self.launch(
            &self.k.concat_cols,
            (blocks(n), 1, 1),
            THREADS,
            0,
            &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(&a.data)), Arg::Ptr(self.ptr(&b.data)), Arg::I32(a.rows as i32), Arg::I32(a.cols as i32), Arg::I32(b.cols as i32)],
        );
        out
    }

    fn gated_attention(
        &self,
        q_gate: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        q_norm: &CudaVector,
        k_norm: &CudaVector,
        dims: &AttentionDims,
        layout: &BatchLayout,
        cache: &mut CudaCache,
        attention_layer: usize,
    ) -> CudaTensor {
        let _span = self.span("attention");
        super::attention::gated_attention(self, q_gate, k, v, q_norm, k_norm, dims, layout, cache, attention_layer)
    }

    fn gated_delta_net(
        &self,
        mixed: &CudaTensor,
        z: &CudaTensor,
        b: &CudaTensor,
        a: &CudaTensor,
        params: &GdnParams<Self>,
        cfg: &LinearAttnShape,
        eps: f32,
        layout: &BatchLayout,
        cache: &mut CudaCache,
        linear_layer: usize,
    ) -> CudaTensor {
        let _span = self.span("gated_delta_net");
        let args = super::gdn::GdnArgs { mixed, z, b, a, conv_weight: &params.conv_weight, neg_a: &params.neg_a, dt_bias: &params.dt_bias, norm_weight: &params.norm_weight };
        super::gdn::gated_delta_net(self, &args, cfg, eps, layout, cache, linear_layer)
    }

    fn moe_add(&self, acc: &mut CudaTensor, x: &CudaTensor, w: &MoeWeights<Self>, cfg: &MoeShape) {
        let _span = self.span("moe");
        super::moe::moe_add(self, acc, x, w, cfg)
    }

    fn moe_residual(&self, acc: &mut CudaTensor, pre_norm: &CudaVector, w: &MoeWeights<Self>, cfg: &MoeShape, next_norm: &CudaVector, eps: f32) -> CudaTensor {
        let _span = self.span("moe");
        super::moe::moe_residual(self, acc, pre_norm, w, cfg, next_norm, eps)
    }

    fn moe_residual_project(
        &self,
        acc: &mut CudaTensor,
        pre_norm: &CudaVector,
        w: &MoeWeights<Self>,
        cfg: &MoeShape,
        next_norm: &CudaVector,
        eps: f32,
        proj: &CudaMatrix,
        widths: &[usize],
    ) -> Vec<CudaTensor> {
        let _span = self.span("moe");
        super::moe::moe_residual_project(self, acc, pre_norm, w, cfg, next_norm, eps, proj, widths)
    }

    fn set_random_weights(&self, seed: Option<u64>) -> Result<(), BackendError> {
        *self.random_weights.lock().unwrap_or_else(|p| p.into_inner()) = seed;
        Ok(())
    }

    fn sample_rows(&self, logits: &CudaTensor, rows: &[RowSampling]) -> Vec<u32> {
        let _span = self.span("sample");
        super::sample::sample_rows(self, logits, rows)
    }

    fn logits_rows_to_host(&self, logits: &CudaTensor, rows: &[usize]) -> Vec<f32> {
        super::sample::logits_rows_to_host(self, logits, rows)
    }

    fn run_graphed(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        self.run_graphed_forward(inputs, forward)
    }

    fn prepare_graph(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        self.prepare_graphed_forward(inputs, forward)
    }

    fn run_graphed_on_rows(&self, inputs: &GraphInputs<'_>, x: &CudaTensor, rows: &[u32], forward: &mut dyn FnMut(&CudaTensor) -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        self.run_graphed_forward_on_rows(inputs, x, rows, forward)
    }

    fn run_graphed_chain(&self, logits: &CudaTensor, hidden: &CudaTensor, links: &[ChainLink<'_>], forward: &mut dyn FnMut(&GraphInputs<'_>, &CudaTensor) -> Vec<CudaTensor>) -> Vec<Vec<u32>> {
        self.run_graphed_chain_on_device(logits, hidden, links, forward)
    }

    fn prepare_graph_on_rows(&self, inputs: &GraphInputs<'_>, cols: usize, forward: &mut dyn FnMut(&CudaTensor) -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        self.prepare_graphed_forward_on_rows(inputs, cols, forward)
    }

    fn replays_graphs(&self) -> bool {
        true
    }

    fn device_memory_used(&self) -> Option<usize> {
        self.memory_info().ok().map(|(free, total)| total - free)
    }

    fn first_rows(&self, x: &CudaTensor, rows: Real) -> CudaTensor {
        assert!(rows.0 <= x.rows, "first_rows: {} of {} rows", rows.0, x.rows);
        let mut out = self.tensor(rows.0, x.cols);
        if rows.0 > 0 {
            ck(self.stream.memcpy_dtod(&x.data.slice(0..rows.0 * x.cols), &mut out.data), "row cut");
        }
        out
    }

    fn reserve_step_inputs(&self, limits: StepLimits) -> Result<(), BackendError> {
        self.step_inputs().reserve(self, limits)
    }

    fn cache_memory_budget(&self, utilization: f32, workspace: usize) -> Option<Result<usize, BackendError>> {
        Some(self.cache_budget(utilization, workspace))
    }

    fn commit_states(&self, cache: &mut CudaCache, commits: &[StateCommit]) {
        let _span = self.span("commit_states");
        cache::commit(self, cache, commits)
    }

    fn reset_states(&self, cache: &mut CudaCache, slots: &[usize]) {
        let _span = self.span("reset_states");
        cache::reset(self, cache, slots)
    }

    fn save_checkpoints(&self, cache: &mut CudaCache, copies: &[StateCheckpoint]) {
        let _span = self.span("save_checkpoints");
        cache::save_checkpoints(self, cache, copies)
    }

    fn restore_checkpoints(&self, cache: &mut CudaCache, copies: &[StateCheckpoint]) {
        let _span = self.span("restore_checkpoints");
        cache::restore_checkpoints(self, cache, copies)
    }
}
