//! The [`Backend`] implementation: uploads, element-wise and row-wise ops here; matmul,
//! attention, Gated DeltaNet and MoE in their own files.

use super::cache::{self, CudaCache};
use super::{ck, Arg, CudaBackend, CudaMatrix, CudaTensor, CudaVector};
use crate::backend::{AttentionDims, Backend, BackendError, BatchLayout, CacheSpec, GdnParams, MoeWeights, RowSampling, StateCommit, StepLimits, GraphInputs, GraphKey};
use crate::backend::shapes::{LinearAttnShape, MoeShape};
use crate::backend::weight_bytes::MatrixBytes;
use kestrel_quant::Dtype;
use std::sync::atomic::Ordering;

const THREADS: u32 = 256;

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
        Ok(CudaMatrix { hi, lo: None, rows, cols, expert_tables: Default::default() })
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
        let oom = |bytes: usize, e: cudarc::driver::DriverError| BackendError::OutOfMemory(format!("{} MiB of weights: {e:?}", bytes >> 20));
        let matrix = if let Some(seed) = self.random_seed() {
            self.random_matrix(rows, cols, seed)?
        } else if parts.iter().all(|p| p.dtype == Dtype::BF16) {
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
            CudaMatrix { hi, lo: None, rows, cols, expert_tables: Default::default() }
        } else {
            // F32/F16 weights keep ~16 bits as bf16 hi + lo matrices.
            let mut values = Vec::with_capacity(rows * cols);
            for p in parts {
                values.extend(kestrel_quant::dequantize(p.dtype, p.bytes()).map_err(|e| BackendError::Invalid(e.to_string()))?);
            }
            let (hi, lo) = split_bf16(&values);
            CudaMatrix { hi: upload_u16(self, &hi)?, lo: Some(upload_u16(self, &lo)?), rows, cols, expert_tables: Default::default() }
        };
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
        let lo = table.lo.as_ref().map_or(0, |l| self.ptr(l));
        self.launch(
            &self.k.embed_rows,
            (ids.len() as u32, 1, 1),
            THREADS,
            0,
            &[Arg::Ptr(self.ptr(&out.data)), Arg::Ptr(self.ptr(&table.hi)), Arg::Ptr(lo), Arg::Ptr(dids), Arg::I32(ids.len() as i32), Arg::I32(table.cols as i32)],
        );
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

    fn run_graphed(&self, key: GraphKey, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        self.run_graphed_forward(key, inputs, forward)
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
}
