//! Quantized weights on the device (cuda/qmatmul.cu): each format's kernel module, compiled
//! the first time a weight of that format is uploaded; uploads of tiles packed from the stored
//! bytes (quant_tiles.rs) or filled at random; the matmul and embedding launches.

use super::matmul::{Epilogue, Grouped};
use super::quant_tiles::{pack_tiles, RowOrder, TileFormat};
use super::tensor::QuantTiles;
use super::{kernels, Arg, CudaBackend};
use crate::backend::weight_bytes::MatrixBytes;
use crate::backend::BackendError;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice};
use kestrel_quant::Dtype;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Up to this many tokens take the few-row kernels in plain launches (grouped launches up to
/// [`FEW_MAX_GROUPED_ROWS`] per group); more take qmm_many, whose 128 weight rows per block
/// read each activation row once for 8 tiles where the few-row kernels read it once per tile.
const FEW_MAX_ROWS: usize = 16;
const FEW_MAX_GROUPED_ROWS: usize = 64;
/// Threads of every quantized matmul: one warp per k-slice (KSLICES in cuda/matmul_common.cuh).
const THREADS: u32 = 256;
/// Most shared memory the few-row kernels may take for their split rows (qmm_few1s, qmm_few2s):
/// more would leave too few resident blocks to keep the weights streaming; beyond it the rows
/// are split by qsplit first.
const FEW_SPLIT_ROWS_BYTES: usize = 64 * 1024;
/// Fewest column blocks per group of a grouped few-row launch.
const GROUP_MIN_COL_BLOCKS: usize = 8;
/// Host bytes of tiles packed per copy to the device.
const UPLOAD_CHUNK_BYTES: usize = 64 << 20;

/// qmm_many's tiles (QM_TOKENS tokens by QM_TILES weight tiles, QM_STAGES stages of QM_SK
/// elements; cuda/qmatmul.cu).
const MANY_TOKENS: usize = 64;
const MANY_TILES: usize = 8;
const MANY_STAGES: usize = 3;
const MANY_SK: usize = 128;

/// Dynamic shared memory of qmm_many for `fmt`: QM_STAGES * QM_STAGE_BYTES.
fn many_smem(fmt: TileFormat) -> usize {
    let weights = MANY_TILES * (MANY_SK / fmt.unit()) * fmt.unit_bytes();
    let rows = MANY_TOKENS * (MANY_SK + 32) * 2;
    MANY_STAGES * (weights + 2 * rows + MANY_TOKENS * 16)
}

/// Row stride (floats) of the block sums (sums_stride in cuda/qmatmul.cu).
fn sums_stride(k: usize) -> usize {
    (k / 32).div_ceil(4) * 4
}

/// Shared memory of the few-row kernels that split `rows` rows of `k` themselves.
fn few_split_bytes(rows: usize, k: usize) -> usize {
    4 * rows * (k + 32) + 4 * rows * sums_stride(k)
}

/// One format's kernels.
pub(crate) struct QuantKernels {
    _module: Arc<CudaModule>,
    /// 1, 2, 4, 8 token tiles, rows split by qsplit.
    few: [CudaFunction; 4],
    /// 1, 2 token tiles, rows split in shared memory.
    few_split: [CudaFunction; 2],
    many: CudaFunction,
    /// qmm_many's k-slices in blocks of their own, and their sum.
    many_split: CudaFunction,
    reduce: CudaFunction,
    split: CudaFunction,
    embed: CudaFunction,
    fill: CudaFunction,
    /// Resident blocks per SM by (function, dynamic shared memory).
    occupancy: Mutex<HashMap<(usize, usize), usize>>,
}

impl QuantKernels {
    fn load(be: &CudaBackend, fmt: TileFormat) -> Result<Self, BackendError> {
        let name = format!("qmatmul_{}", fmt.name());
        let body = kernels::quant_module_body(fmt.kernel_id());
        let device = |what: &str, e: String| BackendError::Device(format!("{what} of {name}: {e}"));
        let cubin = kernels::cached_cubin(&name, &body, &be.arch, false).map_err(|e| device("compiling", e.to_string()))?;
        let module = be.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(|e| device("loading", format!("{e:?}")))?;
        let f = |n: &str| module.load_function(n).map_err(|e| device(&format!("kernel {n}"), format!("{e:?}")));
        let k = QuantKernels {
            few: [f("qmm_few1")?, f("qmm_few2")?, f("qmm_few4")?, f("qmm_few8")?],
            few_split: [f("qmm_few1s")?, f("qmm_few2s")?],
            many: f("qmm_many")?,
            many_split: f("qmm_many_split")?,
            reduce: f("qreduce")?,
            split: f("qsplit")?,
            embed: f("qembed")?,
            fill: f("qfill")?,
            _module: module,
            occupancy: Mutex::new(HashMap::new()),
        };
        use cudarc::driver::sys::CUfunction_attribute as Attr;
        for func in k.few.iter().chain(&k.few_split).chain([&k.many, &k.many_split]) {
            // SAFETY: a loaded function handle and a valid attribute.
            let fixed = unsafe { cudarc::driver::result::function::get_function_attribute(func.cu_function(), Attr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }.map_err(|e| device("attributes", format!("{e:?}")))?;
            func.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, be.optin_smem as i32 - fixed).map_err(|e| device("attributes", format!("{e:?}")))?;
        }
        Ok(k)
    }

    /// Blocks of `f` resident at once on the GPU with `smem` bytes of dynamic shared memory.
    fn slots(&self, be: &CudaBackend, f: &CudaFunction, smem: usize) -> usize {
        let key = (f.cu_function() as usize, smem);
        let mut cache = self.occupancy.lock().unwrap_or_else(|p| p.into_inner());
        let per_sm = *cache.entry(key).or_insert_with(|| f.occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None).map_or(1, |n| (n as usize).max(1)));
        per_sm * be.sm_count
    }
}

impl CudaBackend {
    /// The kernels of `fmt`, compiled (or read from the disk cache) on first use.
    pub(super) fn quant_kernels(&self, fmt: TileFormat) -> Result<Arc<QuantKernels>, BackendError> {
        let mut all = self.quant_kernels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = all.get(&fmt) {
            return Ok(k.clone());
        }
        let k = Arc::new(QuantKernels::load(self, fmt)?);
        all.insert(fmt, k.clone());
        Ok(k)
    }
}

/// The tile format a part of a weight goes to the device in, if it has one: a quantized dtype
/// with a kernel whose units divide the row.
pub(super) fn tile_format(m: &MatrixBytes) -> Option<TileFormat> {
    TileFormat::of(m.dtype).filter(|f| f.fits(m.cols))
}

fn oom(bytes: usize, e: cudarc::driver::DriverError) -> BackendError {
    BackendError::OutOfMemory(format!("{} MiB of weights: {e:?}", bytes >> 20))
}

/// `parts` (all of `dtype`, which has tiles) stacked by rows as one tiled weight in `order`:
/// packed on the host a chunk of tiles at a time and copied up.
pub(super) fn upload_tiles(be: &CudaBackend, parts: &[MatrixBytes], order: RowOrder) -> Result<QuantTiles, BackendError> {
    let (rows, cols) = MatrixBytes::stacked_shape(parts).map_err(BackendError::Invalid)?;
    let dtype = parts[0].dtype;
    let fmt = TileFormat::of(dtype).filter(|f| f.fits(cols)).ok_or_else(|| BackendError::Invalid(format!("{dtype} rows of {cols} have no GPU tiles")))?;
    let kernels = be.quant_kernels(fmt)?;
    let total = fmt.matrix_bytes(order, rows, cols);
    // SAFETY: every byte is written by the chunk copies below.
    let mut data = unsafe { be.stream.alloc::<u8>(total.max(16)) }.map_err(|e| oom(total, e))?;
    let row_bytes = dtype.row_bytes(cols).map_err(|e| BackendError::Invalid(e.to_string()))?;
    // Source row i: the part holding it.
    let starts: Vec<usize> = parts.iter().scan(0, |s, p| {
        let at = *s;
        *s += p.rows;
        Some(at)
    }).collect();
    let row = |i: usize| -> &[u8] {
        let p = starts.partition_point(|&s| s <= i) - 1;
        let local = i - starts[p];
        &parts[p].bytes()[local * row_bytes..(local + 1) * row_bytes]
    };
    let tiles = order.tiles(rows);
    let tile_bytes = total / tiles.max(1);
    let per_chunk = (UPLOAD_CHUNK_BYTES / tile_bytes.max(1)).max(1);
    let mut host = vec![0u8; per_chunk.min(tiles) * tile_bytes];
    let mut t0 = 0;
    while t0 < tiles {
        let t1 = (t0 + per_chunk).min(tiles);
        let bytes = (t1 - t0) * tile_bytes;
        pack_tiles(fmt, dtype, order, &row, rows, cols, t0..t1, &mut host[..bytes]);
        be.stream.memcpy_htod(&host[..bytes], &mut data.slice_mut(t0 * tile_bytes..t1 * tile_bytes)).map_err(|e| oom(total, e))?;
        t0 = t1;
    }
    Ok(QuantTiles { fmt, order, data, kernels })
}

/// A `rows x cols` weight of random tiles in `dtype`'s format (`--load-format dummy`): random
/// codes and scales giving weights of standard deviation about 1/sqrt(cols), as the bf16
/// random weights have.
pub(super) fn random_tiles(be: &CudaBackend, dtype: Dtype, order: RowOrder, rows: usize, cols: usize, seed: u64) -> Result<QuantTiles, BackendError> {
    let fmt = TileFormat::of(dtype).filter(|f| f.fits(cols)).ok_or_else(|| BackendError::Invalid(format!("{dtype} rows of {cols} have no GPU tiles")))?;
    let kernels = be.quant_kernels(fmt)?;
    let total = fmt.matrix_bytes(order, rows, cols);
    // SAFETY: qfill writes every byte of every unit tile.
    let data = unsafe { be.stream.alloc::<u8>(total.max(16)) }.map_err(|e| oom(total, e))?;
    let units = order.tiles(rows) * (cols / fmt.unit());
    let threads = units * (fmt.code_bytes() / 16 + 8);
    let sigma = 1.0 / (cols.max(1) as f32).sqrt();
    be.launch(&kernels.fill, (threads.div_ceil(THREADS as usize) as u32, 1, 1), THREADS, 0, &[Arg::Ptr(be.ptr(&data)), Arg::I64(units as i64), Arg::U64(seed), Arg::F32(sigma)]);
    Ok(QuantTiles { fmt, order, data, kernels })
}

/// `x` (`x_rows` rows of `k`) rounded once to bf16, with block sums, for the kernels that read
/// them from memory (qsplit): (buffer, bf16 pointer, lo offset in elements, sums pointer). The
/// buffer keeps the room of the former lo halves at the offset, unused.
fn split_rows(be: &CudaBackend, t: &QuantTiles, x: u64, x_rows: usize, k: usize) -> (CudaSlice<u8>, u64, i64, u64) {
    let halves = 4 * x_rows * k;
    let bytes = halves + 4 * x_rows * sums_stride(k);
    // SAFETY: qsplit writes every half and every block sum the kernels read.
    let buf = super::ck(be.host_timer.time(true, || unsafe { be.stream.alloc::<u8>(bytes.max(16)) }), "alloc");
    let base = be.ptr(&buf);
    let sums = base + halves as u64;
    let blocks = x_rows * (k / 32);
    be.launch(&t.kernels.split, (blocks.div_ceil(THREADS as usize) as u32, 1, 1), THREADS, 0, &[Arg::Ptr(base), Arg::I64((x_rows * k) as i64), Arg::Ptr(sums), Arg::Ptr(x), Arg::I32(x_rows as i32), Arg::I32(k as i32)]);
    (buf, base, (x_rows * k) as i64, sums)
}

/// Whether the few-row kernel that splits its rows in shared memory takes `rows` rows of `k`:
/// it is the one that can normalize them too ([`launch_tiles`]' `norm`).
fn splits_rows_itself(rows: usize, k: usize) -> bool {
    let tt = rows.div_ceil(8).next_power_of_two();
    rows >= 1 && tt <= 2 && few_split_bytes(rows.min(8 * tt), k) <= FEW_SPLIT_ROWS_BYTES
}

/// Whether a plain launch of `rows` rows of `k` through tiles can apply an RMSNorm to its rows
/// itself (the caller checks that the norm takes rms_norm_rows' register path).
pub(super) fn norm_fits(rows: usize, k: usize) -> bool {
    splits_rows_itself(rows, k)
}

/// `out[rows, n] = x[x_rows, k] @ W^T` for tiled weights, stored by `epi`. Plain launches read
/// rows `0..rows` of `x`; grouped launches the rows listed per group (at most `rows` per group;
/// `t` is then any of the groups' weights, for its format's kernels). With `epi` SwiGLU the
/// weight is gate/up tiles ([`RowOrder::GateUp`]) of `n / 2` outputs each. With `norm` (its
/// weight's device pointer and epsilon; plain launches where [`norm_fits`]) the rows are first
/// normalized as rms_norm_rows does, bit for bit.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_tiles(be: &CudaBackend, out: u64, x: u64, x_rows: usize, t: &QuantTiles, rows: usize, n: usize, k: usize, grouped: Option<&Grouped>, epi: Epilogue, norm: Option<(u64, f32)>) {
    if rows == 0 || n == 0 {
        return;
    }
    assert_eq!(epi.is_swiglu(), matches!(t.order, RowOrder::GateUp { .. }), "quantized matmul: SwiGLU stores need gate/up tiles and only those");
    let (table, counts, lists, stride, a_div, active, groups) = match grouped {
        Some(g) => (g.table, g.counts, g.lists, g.list_stride, g.a_div, g.active, g.groups),
        None => (0, 0, 0, 0, 1, 0, 1),
    };
    let w = if grouped.is_some() { 0 } else { be.ptr(&t.data) };
    let tiles = if epi.is_swiglu() { (n / 2).div_ceil(8) } else { n.div_ceil(16) };
    assert!(norm.is_none() || (grouped.is_none() && norm_fits(rows, k)), "quantized matmul: a norm in a launch that does not split its rows itself");
    let group_args = [Arg::Ptr(table), Arg::Ptr(counts), Arg::Ptr(lists), Arg::I32(stride as i32), Arg::I32(a_div as i32), Arg::Ptr(active)];
    if rows <= if grouped.is_some() { FEW_MAX_GROUPED_ROWS } else { FEW_MAX_ROWS } {
        let tt = rows.div_ceil(8).next_power_of_two().min(8);
        let variant = tt.trailing_zeros() as usize;
        let split_smem = few_split_bytes(rows.min(8 * tt), k);
        let in_kernel = splits_rows_itself(rows, k);
        let (kernel, smem) = if in_kernel { (&t.kernels.few_split[variant], split_smem) } else { (&t.kernels.few[variant], 0) };
        let split = (!in_kernel).then(|| split_rows(be, t, x, x_rows, k));
        let (xs, lo_off, sums) = split.as_ref().map_or((0, 0, 0), |s| (s.1, s.2, s.3));
        let slots = t.kernels.slots(be, kernel, smem);
        let wave = if grouped.is_some() { (slots / groups).max(GROUP_MIN_COL_BLOCKS) } else { slots };
        let (norm_w, eps) = norm.unwrap_or((0, 0.0));
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(x), Arg::Ptr(w), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32)];
        args.extend(group_args);
        args.extend([Arg::Ptr(xs), Arg::I64(lo_off), Arg::Ptr(sums), Arg::Epilogue(epi), Arg::Ptr(norm_w), Arg::F32(eps)]);
        be.launch(kernel, (tiles.min(wave) as u32, rows.div_ceil(8 * tt) as u32, groups as u32), THREADS, smem, &args);
    } else {
        let (_buf, xs, lo_off, sums) = split_rows(be, t, x, x_rows, k);
        let blocks = tiles.div_ceil(MANY_TILES) * rows.div_ceil(MANY_TOKENS);
        if grouped.is_none() && blocks < be.sm_count {
            // Too few blocks to fill the GPU: one per k-slice, then their sum (the same bits).
            let slices = 8;
            let part = be.alloc_f32(slices * rows * tiles * 16);
            let args = [Arg::Ptr(be.ptr(&part)), Arg::Ptr(xs), Arg::I64(lo_off), Arg::Ptr(sums), Arg::Ptr(w), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32), Arg::Epilogue(epi)];
            be.launch(&t.kernels.many_split, ((tiles.div_ceil(MANY_TILES) * slices) as u32, rows.div_ceil(MANY_TOKENS) as u32, 1), THREADS, many_smem(t.fmt), &args);
            let threads = rows * tiles * 8;
            be.launch(&t.kernels.reduce, (threads.div_ceil(THREADS as usize) as u32, 1, 1), THREADS, 0, &[Arg::Ptr(out), Arg::Ptr(be.ptr(&part)), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::Epilogue(epi)]);
            return;
        }
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(xs), Arg::I64(lo_off), Arg::Ptr(sums), Arg::Ptr(w), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32)];
        args.extend(group_args);
        args.push(Arg::Epilogue(epi));
        be.launch(&t.kernels.many, (tiles.div_ceil(MANY_TILES) as u32, rows.div_ceil(MANY_TOKENS) as u32, groups as u32), THREADS, many_smem(t.fmt), &args);
    }
}

/// Rows `ids` (on the device) of a tiled table in plain row order, dequantized to f32.
pub(super) fn embed_tiles(be: &CudaBackend, out: u64, t: &QuantTiles, ids: u64, n: usize, cols: usize) {
    assert_eq!(t.order, RowOrder::Plain, "embedding rows of gate/up tiles");
    be.launch(&t.kernels.embed, (n as u32, 1, 1), THREADS, 0, &[Arg::Ptr(out), Arg::Ptr(be.ptr(&t.data)), Arg::Ptr(ids), Arg::I32(n as i32), Arg::I32(cols as i32)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_row_kernel_fits_shared_memory_for_every_format() {
        // An H100 or H200 lets a block take 227 KB.
        for fmt in super::super::quant_tiles::ALL_FORMATS {
            assert!(many_smem(fmt) <= 227 * 1024, "{fmt:?}: {} bytes", many_smem(fmt));
        }
        // One token at K = 12288 splits in the kernel; eight at 4096 go through qsplit.
        assert!(few_split_bytes(1, 12288) <= FEW_SPLIT_ROWS_BYTES);
        assert!(few_split_bytes(8, 4096) > FEW_SPLIT_ROWS_BYTES);
        assert_eq!(sums_stride(448), 16);
        assert_eq!(sums_stride(4096), 128);
    }
}
