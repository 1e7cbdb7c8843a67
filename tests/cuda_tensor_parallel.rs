//! The bitwise reduction of a row-parallel layer over two GPUs (backend/tensor_parallel.rs):
//! - the production matmul kernels reduce K in 8 fixed slices added in order: the slice sums,
//!   each computed on the GPU that holds that slice's columns, add up from zero in slice order to
//!   bitwise the one-GPU product, for the few-row, tiled and many-row (cluster) kernels;
//! - gathered through NCCL, those slice sums give every GPU bitwise the one-GPU result, where an
//!   all-reduce of each GPU's own total does not;
//! - what the gather (and the chain alternative) cost against `ncclAllReduce` at decode and
//!   prefill sizes (printed, not asserted).
//!
//! Needs two GPUs and NCCL; skips where no GPU is present or only one is.

mod cuda_support;

use cuda_support::{random_matrix, Rng};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nccl::{result::group_end, result::group_start, Comm, ReduceOp};
use kestrel::backend::cuda::collectives::probe_nccl;
use kestrel::backend::cuda::{probe, CudaBackend};
use kestrel::backend::tensor_parallel::{add_slices_in_order, K_SLICES};
use kestrel::backend::Backend;
use kestrel::model::weights::Dtype;
use std::sync::Arc;
use std::time::Instant;

const GPUS: usize = 2;

/// The two GPUs' backends, or `None` (with the skip message) where fewer are present.
fn two_gpus() -> Option<[CudaBackend; GPUS]> {
    if probe().is_err() {
        eprintln!("skipped: no CUDA driver");
        return None;
    }
    let count = CudaContext::device_count().unwrap_or(0);
    if count < GPUS as i32 {
        eprintln!("skipped: {count} GPU(s), the split needs {GPUS}");
        return None;
    }
    probe_nccl().unwrap_or_else(|e| panic!("two GPUs but no NCCL: {e}"));
    Some([CudaBackend::new(0).expect("GPU 0"), CudaBackend::new(1).expect("GPU 1")])
}

/// `x` with every column outside `cols` zeroed.
fn masked(x: &[f32], k: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    x.iter().enumerate().map(|(i, &v)| if cols.contains(&(i % k)) { v } else { 0.0 }).collect()
}

fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

struct Comms {
    streams: Vec<Arc<CudaStream>>,
    comms: Vec<Comm>,
}

fn comms() -> Comms {
    let streams: Vec<Arc<CudaStream>> = (0..GPUS).map(|g| CudaContext::new(g).expect("context").new_stream().expect("stream")).collect();
    let comms = Comm::from_devices(streams.clone()).expect("NCCL communicators");
    Comms { streams, comms }
}

impl Comms {
    fn sync(&self) {
        for s in &self.streams {
            s.synchronize().expect("sync");
        }
    }
}

/// Slice sums of `x @ w^T` (rows x k by n x k): slice s computed on the GPU that holds it
/// (GPU s / (8 / GPUS)), each as the production kernel computes it, with the other columns of
/// the activations zeroed (their slices then add exact zeros).
fn slice_sums(gpus: &[CudaBackend; GPUS], x: &[f32], rows: usize, k: usize, w: &kestrel::backend::weight_bytes::MatrixBytes) -> Vec<Vec<f32>> {
    let weights: Vec<_> = gpus.iter().map(|g| g.upload_matrix(w).expect("upload")).collect();
    let slice = k / K_SLICES;
    (0..K_SLICES)
        .map(|s| {
            let rank = s / (K_SLICES / GPUS);
            let g = &gpus[rank];
            g.to_host(&g.matmul(&g.from_host(&masked(x, k, s * slice..(s + 1) * slice), rows, k), &weights[rank]))
        })
        .collect()
}

#[test]
fn gathered_slice_sums_added_in_order_are_the_one_gpu_matmul() {
    let Some(gpus) = two_gpus() else { return };
    let nccl = comms();
    let mut rng = Rng::new(41);
    // Rows that pick the few-row, tiled and many-row kernels; widths of the 9b's o_proj and
    // down_proj and the 27b's o_proj.
    for (rows, k, n) in [(1, 4096, 4096), (8, 12288, 4096), (64, 6144, 5120), (300, 4096, 4096), (2048, 4096, 4096)] {
        let what = format!("{rows} rows, K {k} -> {n}");
        let w = random_matrix(&mut rng, n, k, Dtype::BF16);
        let x = rng.vec(rows * k, 1.0);
        let one_gpu = gpus[0].to_host(&gpus[0].matmul(&gpus[0].from_host(&x, rows, k), &gpus[0].upload_matrix(&w).unwrap()));
        let sums = slice_sums(&gpus, &x, rows, k, &w);
        let refs: Vec<&[f32]> = sums.iter().map(Vec::as_slice).collect();
        assert_eq!(differing(&add_slices_in_order(&refs), &one_gpu), 0, "{what}: the kernels' slices added in order are not the one-GPU product");

        // Each GPU sends its slices' sums; every GPU receives all 8 in slice order.
        let per_rank = K_SLICES / GPUS;
        let len = rows * n;
        let sends: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| nccl.streams[r].clone_htod(&sums[r * per_rank..(r + 1) * per_rank].concat()).unwrap()).collect();
        let mut gathered: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| nccl.streams[r].alloc_zeros::<f32>(K_SLICES * len).unwrap()).collect();
        // Each GPU's own total, for the all-reduce that one GPU would not match.
        let totals: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| nccl.streams[r].clone_htod(&add_slices_in_order(&refs[r * per_rank..(r + 1) * per_rank])).unwrap()).collect();
        let mut reduced: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| nccl.streams[r].alloc_zeros::<f32>(len).unwrap()).collect();
        group_start().unwrap();
        for (r, (send, recv)) in sends.iter().zip(gathered.iter_mut()).enumerate() {
            nccl.comms[r].all_gather(send, recv).unwrap();
        }
        group_end().unwrap();
        group_start().unwrap();
        for (r, (send, recv)) in totals.iter().zip(reduced.iter_mut()).enumerate() {
            nccl.comms[r].all_reduce(send, recv, &ReduceOp::Sum).unwrap();
        }
        group_end().unwrap();
        nccl.sync();
        for r in 0..GPUS {
            let all = nccl.streams[r].clone_dtoh(&gathered[r]).unwrap();
            let parts: Vec<&[f32]> = all.chunks(len).collect();
            assert_eq!(differing(&add_slices_in_order(&parts), &one_gpu), 0, "{what}: GPU {r}'s gathered sum differs from one GPU");
            let all_reduced = nccl.streams[r].clone_dtoh(&reduced[r]).unwrap();
            eprintln!("{what}: GPU {r}: gathered slices bitwise equal; all-reduce of per-GPU totals differs in {} of {len} elements", differing(&all_reduced, &one_gpu));
        }
    }
}

/// Adds `slices` partials of `n` elements (`parts`, slice-major) to `init` (or zero) in order.
const ORDERED_SUM: &str = r#"
extern "C" __global__ void add_slices_in_order(float* out, const float* init, const float* parts, int slices, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = init ? init[i] : 0.0f;
    for (int k = 0; k < slices; ++k) s = s + parts[(long long)k * n + i];
    out[i] = s;
}
"#;

/// Microseconds per call of `step` (after warm-up), the streams synchronized around the timing.
fn time_us(nccl: &Comms, iters: usize, mut step: impl FnMut()) -> f64 {
    for _ in 0..5 {
        step();
    }
    nccl.sync();
    let start = Instant::now();
    for _ in 0..iters {
        step();
    }
    nccl.sync();
    start.elapsed().as_secs_f64() * 1e6 / iters as f64
}

#[test]
fn reduction_cost_against_all_reduce() {
    let Some(_gpus) = two_gpus() else { return };
    let nccl = comms();
    let ptx = cudarc::nvrtc::compile_ptx(ORDERED_SUM).expect("NVRTC");
    let adders: Vec<_> = nccl.streams.iter().map(|s| s.context().load_module(ptx.clone()).unwrap().load_function("add_slices_in_order").unwrap()).collect();
    let per_rank = K_SLICES / GPUS;
    eprintln!("rows x hidden | all-reduce us | all-gather of slice sums + ordered add us | chain (send, add, broadcast) us");
    for hidden in [4096usize, 5120] {
        for rows in [1usize, 8, 32, 64, 512, 4096] {
            let len = rows * hidden;
            let iters = if rows >= 512 { 20 } else { 200 };
            let alloc = |r: usize, n: usize| nccl.streams[r].alloc_zeros::<f32>(n).unwrap();
            let sends: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| alloc(r, per_rank * len)).collect();
            let mut gathered: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| alloc(r, K_SLICES * len)).collect();
            let mut out: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| alloc(r, len)).collect();
            let mut total: Vec<CudaSlice<f32>> = (0..GPUS).map(|r| alloc(r, len)).collect();
            let cfg = LaunchConfig::for_num_elems(len as u32);
            let (slices_all, slices_rank, n) = (K_SLICES as i32, per_rank as i32, len as i32);
            let null: u64 = 0;

            let all_reduce = time_us(&nccl, iters, || {
                group_start().unwrap();
                for r in 0..GPUS {
                    let (src, dst) = (&sends[r], &mut out[r]);
                    // The first `len` values of each GPU's send buffer stand for its total.
                    nccl.comms[r].all_reduce(&src.slice(0..len), dst, &ReduceOp::Sum).unwrap();
                }
                group_end().unwrap();
            });
            let gather = time_us(&nccl, iters, || {
                group_start().unwrap();
                for r in 0..GPUS {
                    nccl.comms[r].all_gather(&sends[r], &mut gathered[r]).unwrap();
                }
                group_end().unwrap();
                for r in 0..GPUS {
                    let mut launch = nccl.streams[r].launch_builder(&adders[r]);
                    launch.arg(&mut out[r]).arg(&null).arg(&gathered[r]).arg(&slices_all).arg(&n);
                    unsafe { launch.launch(cfg) }.unwrap();
                }
            });
            let chain = time_us(&nccl, iters, || {
                // GPU 0 adds its slices from zero and sends the running sum; GPU 1 adds its own
                // in order and broadcasts the total.
                let mut launch = nccl.streams[0].launch_builder(&adders[0]);
                launch.arg(&mut total[0]).arg(&null).arg(&sends[0]).arg(&slices_rank).arg(&n);
                unsafe { launch.launch(cfg) }.unwrap();
                group_start().unwrap();
                nccl.comms[0].send(&total[0], 1).unwrap();
                nccl.comms[1].recv(&mut out[1], 0).unwrap();
                group_end().unwrap();
                let mut launch = nccl.streams[1].launch_builder(&adders[1]);
                launch.arg(&mut total[1]).arg(&out[1]).arg(&sends[1]).arg(&slices_rank).arg(&n);
                unsafe { launch.launch(cfg) }.unwrap();
                group_start().unwrap();
                let (first, second) = out.split_at_mut(1);
                nccl.comms[0].broadcast(None::<&CudaSlice<f32>>, &mut first[0], 1).unwrap();
                nccl.comms[1].broadcast(Some(&total[1]), &mut second[0], 1).unwrap();
                group_end().unwrap();
            });
            eprintln!("{rows:>5} x {hidden} | {all_reduce:>8.1} | {gather:>8.1} | {chain:>8.1}");
            assert!(all_reduce > 0.0 && gather > 0.0 && chain > 0.0);
        }
    }
}
