//! The CUDA backend: cudarc with dynamic loading (a binary built without CUDA runs wherever the
//! driver is), kernels from cuda/*.cu compiled by NVRTC for the detected GPU and cached on
//! disk, one non-default stream, f32 activations and recurrent state, bf16 weights.
//!
//! Every op is batch-invariant (DESIGN Invariant 3): the arithmetic of a row never depends on
//! the other rows or on how many there are (see cuda/matmul.cu for the matmul argument,
//! cuda/attention.cu and cuda/gdn.cu for tiles and chunks aligned to absolute positions).
//!
//! The [`Backend`] ops are infallible; a device failure inside one (a fault, an exhausted
//! device) panics with the driver's message, since no result could be produced.

mod attention;
mod cache;
pub mod collectives;
mod gdn;
mod graphs;
mod init;
pub mod kernels;
mod layout;
mod matmul;
mod moe;
mod moe_stream;
mod ops;
mod profile;
mod qmatmul;
pub mod quant_tiles;
mod sample;
mod step_inputs;
mod tensor;
mod wgmma;

pub use cache::CudaCache;
pub use init::{probe, CudaInitError};
use init::trim_pool_memory;
pub use profile::{HostTiming, TracedKernel};
pub use tensor::{CudaMatrix, CudaTensor, CudaVector};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError};
use kernels::KernelError;
use layout::DeviceLayout;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Panics with the driver's message: an op of the infallible [`Backend`] interface failed on
/// the device.
#[track_caller]
pub(super) fn ck<T>(r: Result<T, DriverError>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("CUDA error in {what}: {e:?}"),
    }
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    U64(u64),
    I64(i64),
    /// What a matmul stores (matmul::Epilogue, `struct Epilogue` in cuda/matmul.cu).
    Epilogue(matmul::Epilogue),
    /// A streaming matmul's MoE input (matmul::MoeCombine, `struct MoeCombine` in cuda/routing.cuh).
    MoeCombine(matmul::MoeCombine),
    /// Weights the streaming router pulls into L2 (moe::L2Ahead, `struct L2Ahead` in
    /// cuda/matmul_stream.cu).
    L2Ahead(moe::L2Ahead),
    /// One attention layer's cache (attention::KvCacheArg, `struct KvCache` in
    /// cuda/kv_formats.cuh).
    Kv(attention::KvCacheArg),
}

macro_rules! kernel_table {
    ($($module:literal => [$($name:ident),* $(,)?]),* $(,)?) => {
        /// Every kernel, loaded once.
        pub(super) struct Kernels { $($(pub $name: CudaFunction,)*)* }

        impl Kernels {
            fn load(ctx: &Arc<CudaContext>, arch: &str, trace: bool) -> Result<(Self, Vec<Arc<CudaModule>>), CudaInitError> {
                // Every module's CUBIN, the ones not in the disk cache compiled side by side (NVRTC
                // compiles one program on one thread).
                let names = [$($module),*];
                let cubins: Vec<Result<Vec<u8>, KernelError>> = std::thread::scope(|s| {
                    let compiles: Vec<_> = names
                        .iter()
                        .map(|&m| {
                            let body = kernels::SOURCES.iter().find(|s| s.0 == m).map(|s| s.1).unwrap_or("");
                            s.spawn(move || kernels::cached_cubin(m, body, arch, trace))
                        })
                        .collect();
                    compiles.into_iter().map(|c| c.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
                });
                let mut cubins = cubins.into_iter();
                let mut modules = Vec::new();
                $(
                    let cubin = cubins.next().expect("a CUBIN per module")?;
                    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(|e| CudaInitError::Driver(format!("loading {}.cu: {e:?}", $module)))?;
                    $(let $name = module.load_function(stringify!($name)).map_err(|e| CudaInitError::Driver(format!("kernel {}: {e:?}", stringify!($name))))?;)*
                    modules.push(module);
                )*
                Ok((Kernels { $($($name,)*)* }, modules))
            }

            /// Each kernel's driver handle and name (for the start-time trace).
            fn names(&self) -> Vec<(usize, &'static str)> {
                vec![$($((self.$name.cu_function() as usize, stringify!($name)),)*)*]
            }
        }
    };
}

kernel_table! {
    "elementwise" => [embed_rows, rms_norm_rows, add_assign, silu_mul, gather_cols, gather_rows, concat_cols, fill_random_bf16, copy_bandwidth, read_bandwidth],
    "matmul" => [matmul_small_nt1, matmul_small_nt2, matmul_small_nt4, matmul_small2_nt1, matmul_small2_nt2, matmul_small4_nt1, matmul_small4_nt2, matmul_stream_nt1, matmul_stream_nt2, matmul_stream_nt4, matmul_stream_norm_nt1, matmul_stream_norm_nt2, matmul_stream_norm_nt4, matmul_stream_combine_nt1, matmul_stream_combine_nt2, matmul_stream_combine_nt4, matmul_router, matmul_router_stream, moe_down_combine, moe_route_gate_up, matmul_tiled, matmul_pipelined, matmul_large, matmul_sliced, round_activations],
    "attention_f32" => [attn_prep_f32, attn_core_f32, attn_decode_f32, attn_combine_f32],
    "attention_bf16" => [attn_prep_bf16, attn_core_bf16, attn_decode_bf16, attn_combine_bf16, attn_flash_bf16, attn_flash_decode_bf16, attn_flash_combine_bf16],
    "attention_fp8" => [attn_prep_fp8, attn_core_fp8, attn_decode_fp8, attn_combine_fp8, attn_flash_fp8, attn_flash_decode_fp8, attn_flash_combine_fp8],
    "attention_tq3" => [attn_prep_tq3, attn_core_tq3, attn_decode_tq3, attn_combine_tq3, attn_flash_tq3, attn_flash_decode_tq3, attn_flash_combine_tq3],
    "gdn" => [gdn_conv_gates, gdn_conv_state, gdn_recurrent, gdn_recurrent_128, gdn_chunk_prep, gdn_chunk_state_32, gdn_chunk_state_16, gdn_out_norm, commit_states, reset_states],
    "moe" => [moe_route, moe_group, moe_active, moe_group_few, moe_combine, moe_combine_norm],
    "sample" => [sample_rows, draft_ids],
}

/// RoPE inverse-frequency tables are keyed by (theta bits, rotary dim).
type RopeKey = (u64, usize);

/// Per-expert weight pointer tables of one MoE block: (gate, up, down), each `[E][hi, lo]`.
pub(super) type ExpertTables = Arc<[CudaSlice<u64>; 2]>;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) k: Kernels,
    _modules: Vec<Arc<CudaModule>>,
    name: String,
    arch: String,
    /// Seed of device-generated random weights (`--load-format dummy`), while loading one.
    random_weights: Mutex<Option<u64>>,
    uploaded_bytes: AtomicUsize,
    step_inputs: Mutex<step_inputs::StepInputs>,
    /// Device copies of the column lists of `gather_cols` (fixed per layer), by content.
    column_lists: Mutex<HashMap<Vec<u32>, Arc<CudaSlice<i32>>>>,
    /// Captured forwards by key, and whether a capture is in progress.
    graphs: Mutex<graphs::Graphs>,
    capturing: AtomicBool,
    rope_tables: Mutex<HashMap<RopeKey, Arc<CudaSlice<f32>>>>,
    sampling_scratch: Mutex<Option<sample::SamplingScratch>>,
    pub(super) max_dynamic_smem: usize,
    /// Whether `matmul_large` fits this GPU's shared memory ([`matmul::LARGE_SMEM`]).
    pub(super) large_matmul: bool,
    /// The wgmma matmul for many rows (sm_90; see [`wgmma`]).
    wgmma: Option<wgmma::WgmmaMatmul>,
    /// Whether `matmul_sliced` runs launches of 17 to 128 rows ([`matmul::SLICED_SMEM`]; Hopper;
    /// `KESTREL_CUDA_SLICED=0` turns it off for A/B runs, as `KESTREL_CUDA_LARGE=0` does the
    /// large-tile kernel).
    pub(super) sliced_matmul: bool,
    /// Resident blocks of each small-row matmul variant (matmul::SMALL_VARIANTS) across the GPU.
    pub(super) small_matmul_slots: [usize; matmul::SMALL_VARIANTS.len()],
    /// The weight-streaming matmuls for up to 16 rows (sm_90 and later; `KESTREL_CUDA_STREAM=0`
    /// turns them off).
    stream_kernels: Option<matmul::StreamKernels>,
    pub(super) sm_count: usize,
    profiler: profile::Profiler,
    host_timer: profile::HostTimer,
    /// Whether kernels launch with programmatic dependent launch (sm_90 and later): each may
    /// start while the previous one finishes and waits for its inputs itself (wait_for_inputs
    /// in cuda/common.cuh). `KESTREL_CUDA_PDL=0` turns it off.
    dependent_launch: bool,
    launches: AtomicUsize,
    /// The function of the most recent launch (its `CUfunction` as an address).
    last_launch: AtomicUsize,
    /// Finished blocks of the running `matmul_router` launch (zero between launches).
    pub(super) router_done: CudaSlice<u32>,
    /// Resident clusters by (function, dynamic shared memory, blocks per cluster); see
    /// [`CudaBackend::active_clusters`].
    active_clusters: Mutex<HashMap<(usize, usize, usize), Option<usize>>>,
    /// Kernel start times (`KESTREL_CUDA_TRACE=1`, profile.rs).
    tracer: Option<profile::Tracer>,
    /// Whether the streaming router pulls the shared expert's weights into L2 while its chain
    /// runs (`KESTREL_CUDA_L2_AHEAD=0` turns it off for A/B runs).
    pub(super) l2_ahead: bool,
    /// Bytes of the next input projection's last weight rows that the one-token MoE launch
    /// pulls into L2 in its routing window (moe::L2Ahead::projection_tail;
    /// `KESTREL_CUDA_L2_TAIL_MB` sets it in MiB for A/B runs, 0 turns it off).
    pub(super) l2_tail_bytes: usize,
    /// Whether a step whose rows are all one token runs its attention in one launch
    /// (`attn_decode`, or `attn_flash_decode` on tensor cores; `KESTREL_CUDA_ATTN_DECODE=0` keeps
    /// attn_prep and the attention launch apart for A/B runs).
    pub(super) attn_decode: bool,
    /// Whether bf16, fp8 and tq3 caches run attention on tensor cores (`attn_flash`;
    /// `KESTREL_CUDA_FLASH_ATTN=0` keeps the per-(token, head) kernels for A/B runs).
    pub(super) flash_attention: bool,
    /// Whether attn_flash launches get, where they fit, the shared memory of its shared weights
    /// and tq3's staged codes (attention.rs, `set_flash_attention_extras`).
    pub(super) flash_extras: AtomicBool,
    /// Shared memory a block may opt in to (bytes).
    pub(super) optin_smem: usize,
    /// The quantized matmul kernels of each tile format met so far (qmatmul.rs).
    quant_kernels: Mutex<HashMap<quant_tiles::TileFormat, Arc<qmatmul::QuantKernels>>>,
}

/// The launch attribute for thread block clusters of `blocks` blocks along x.
fn cluster_attribute(blocks: u32) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    // SAFETY: an all-zero launch attribute is a valid (empty) value of the C union.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = blocks;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

/// Most arguments a kernel of cuda/*.cu takes.
const MAX_KERNEL_ARGS: usize = 32;

impl CudaBackend {
    /// GPU name and architecture, e.g. "NVIDIA H100 80GB HBM3 (sm_90)".
    pub fn device_description(&self) -> String {
        format!("{} ({})", self.name, self.arch)
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), DriverError> {
        self.ctx.mem_get_info()
    }

    /// Bytes the caches may take: `utilization` of the device's memory, less what is in use now
    /// (weights, kernels, the context) and `workspace` bytes kept free for activations.
    pub fn cache_budget(&self, utilization: f32, workspace: usize) -> Result<usize, crate::backend::BackendError> {
        use crate::backend::BackendError;
        if !(utilization > 0.0 && utilization <= 1.0) {
            return Err(BackendError::Invalid(format!("--gpu-memory-utilization must be in (0, 1], got {utilization}")));
        }
        // Freed activations return to the pool only once the stream has passed their frees.
        self.synchronize();
        trim_pool_memory(&self.ctx).map_err(|e| BackendError::Device(format!("{e:?}")))?;
        let (free, total) = self.memory_info().map_err(|e| BackendError::Device(format!("{e:?}")))?;
        let allowed = (total as f64 * f64::from(utilization)) as usize;
        let used = total.saturating_sub(free);
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        allowed.checked_sub(used + workspace).ok_or_else(|| {
            BackendError::OutOfMemory(format!(
                "{:.2} GiB in use plus {:.2} GiB needed exceed --gpu-memory-utilization {utilization} of the {:.1} GiB {}",
                gib(used),
                gib(workspace),
                gib(total),
                self.name
            ))
        })
    }

    /// Bytes of weights uploaded so far.
    pub fn uploaded_bytes(&self) -> usize {
        self.uploaded_bytes.load(Ordering::Relaxed)
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) {
        ck(self.stream.synchronize(), "synchronize");
    }

    pub(super) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    pub(super) fn launch(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, smem: usize, args: &[Arg]) {
        self.launch_in_clusters(f, grid, block, smem, 1, args);
    }

    /// Clusters of `f` that can be resident at once with `threads` threads and `smem` bytes of
    /// dynamic shared memory per block in clusters of `cluster` blocks (None: none, or the
    /// driver cannot say), asked of the driver once per shape.
    pub(super) fn active_clusters(&self, f: &CudaFunction, threads: u32, smem: usize, cluster: usize) -> Option<usize> {
        use cudarc::driver::sys;
        let key = (f.cu_function() as usize, smem, cluster);
        let mut cache = self.active_clusters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = cache.get(&key) {
            return n;
        }
        let mut attr = cluster_attribute(cluster as u32);
        let cfg = sys::CUlaunchConfig {
            gridDimX: cluster as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        let _ = self.ctx.bind_to_thread();
        // SAFETY: a loaded function, a valid configuration and out pointer.
        let ok = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) }.result().is_ok();
        let n = (ok && n > 0).then_some(n as usize);
        cache.insert(key, n);
        n
    }

    /// [`CudaBackend::launch`] in thread block clusters of `cluster` blocks along x (1: none).
    pub(super) fn launch_in_clusters(&self, f: &CudaFunction, grid: (u32, u32, u32), block: u32, smem: usize, cluster: u32, args: &[Arg]) {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return;
        }
        assert!(args.len() <= MAX_KERNEL_ARGS, "{} kernel arguments (at most {MAX_KERNEL_ARGS})", args.len());
        // cuLaunchKernelEx takes a pointer to each argument's value.
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
        for (p, a) in params.iter_mut().zip(args) {
            *p = match a {
                Arg::Ptr(v) | Arg::U64(v) => (v as *const u64).cast_mut().cast(),
                Arg::I32(v) => (v as *const i32).cast_mut().cast(),
                Arg::F32(v) => (v as *const f32).cast_mut().cast(),
                Arg::I64(v) => (v as *const i64).cast_mut().cast(),
                Arg::Epilogue(v) => (v as *const matmul::Epilogue).cast_mut().cast(),
                Arg::MoeCombine(v) => (v as *const matmul::MoeCombine).cast_mut().cast(),
                Arg::L2Ahead(v) => (v as *const moe::L2Ahead).cast_mut().cast(),
                Arg::Kv(v) => (v as *const attention::KvCacheArg).cast_mut().cast(),
            };
        }
        // SAFETY: an all-zero launch attribute is a valid (empty) value of the C union.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n_attrs = 0;
        if self.dependent_launch {
            attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if cluster > 1 {
            attrs[n_attrs] = cluster_attribute(cluster);
            n_attrs += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem as u32,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n_attrs as u32,
        };
        ck(self.ctx.bind_to_thread(), "bind context");
        self.launches.fetch_add(1, Ordering::Relaxed);
        self.last_launch.store(f.cu_function() as usize, Ordering::Relaxed);
        if let Some(t) = &self.tracer {
            t.launched(f, grid);
        }
        // SAFETY: the argument lists match the kernel signatures in cuda/*.cu; every pointer is a
        // live allocation of the size the kernel indexes (checked by the op wrappers); `params`
        // points into `args`, which outlives the call. Every kernel waits for its inputs
        // (wait_for_inputs) before reading them, as the dependent-launch attribute requires.
        ck(self.host_timer.time(false, || unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()), "kernel launch");
    }

    /// Whether the most recent launch ran `f` (a kernel may read what older launches wrote
    /// before it waits for its inputs, but not what the launch just before it writes).
    pub(super) fn last_launch_was(&self, f: &CudaFunction) -> bool {
        self.last_launch.load(Ordering::Relaxed) == f.cu_function() as usize
    }

    /// Kernel launches queued so far (a benchmark divides by steps).
    pub fn launch_count(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// Uninitialized f32 buffer (at least one element, so every pointer is valid).
    pub(super) fn alloc_f32(&self, n: usize) -> CudaSlice<f32> {
        // SAFETY: every op writes all elements it later reads.
        ck(self.host_timer.time(true, || unsafe { self.stream.alloc::<f32>(n.max(1)) }), "alloc")
    }

    pub(super) fn alloc_i32(&self, n: usize) -> CudaSlice<i32> {
        // SAFETY: as above.
        ck(self.host_timer.time(true, || unsafe { self.stream.alloc::<i32>(n.max(1)) }), "alloc")
    }

    /// Whether a norm of rows `h` wide by `norm` takes the row norm's register path, which the
    /// fused norms reproduce (16-byte aligned rows and weight: rms_row_in_registers in
    /// cuda/common.cuh; at most RMS_VECS = 8 float4s per thread at 256 threads per row).
    pub(super) fn norm_in_registers(&self, norm: &CudaVector, h: usize) -> bool {
        norm.len == h && h.is_multiple_of(4) && h <= 8 * 256 * 4 && self.ptr(&norm.data).is_multiple_of(16)
    }

    pub(super) fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        CudaTensor { data: self.alloc_f32(rows * cols), rows, cols }
    }

    /// The step layout in the persistent layout buffer.
    pub(super) fn device_layout(&self, layout: &crate::backend::BatchLayout, block_size: usize) -> DeviceLayout {
        self.step_inputs().layout(self, layout, block_size)
    }

    fn step_inputs(&self) -> std::sync::MutexGuard<'_, step_inputs::StepInputs> {
        self.step_inputs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the stream is capturing a graph (no host-to-device copies may be queued).
    pub(super) fn capturing(&self) -> bool {
        self.capturing.load(Ordering::Relaxed)
    }

    /// The device copy of a `gather_cols` column list, uploaded on first use.
    pub(super) fn column_list(&self, cols: &[u32]) -> Arc<CudaSlice<i32>> {
        let mut lists = self.column_lists.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = lists.get(cols) {
            return l.clone();
        }
        assert!(!self.capturing(), "a new gather_cols column list inside a graph capture");
        let idx: Vec<i32> = cols.iter().map(|&c| c as i32).collect();
        let idx = if idx.is_empty() { vec![0] } else { idx };
        let list = Arc::new(ck(self.stream.clone_htod(&idx), "column list copy"));
        lists.insert(cols.to_vec(), list.clone());
        list
    }

    /// RoPE inverse frequencies, computed exactly as the CPU backend does.
    pub(super) fn rope_table(&self, theta: f64, rotary_dim: usize) -> Arc<CudaSlice<f32>> {
        let mut tables = self.rope_tables.lock().unwrap_or_else(|p| p.into_inner());
        tables
            .entry((theta.to_bits(), rotary_dim))
            .or_insert_with(|| {
                // Inside a capture the upload would be recorded, not run, into graph memory.
                assert!(!self.capturing(), "a new rope table inside a graph capture");
                let inv: Vec<f32> = (0..rotary_dim / 2).map(|j| 1.0f32 / (theta as f32).powf((2 * j) as f32 / rotary_dim as f32)).collect();
                let inv = if inv.is_empty() { vec![0.0] } else { inv };
                Arc::new(ck(self.stream.clone_htod(&inv), "host to device copy"))
            })
            .clone()
    }

    fn random_seed(&self) -> Option<u64> {
        let mut s = self.random_weights.lock().unwrap_or_else(|p| p.into_inner());
        let seed = *s;
        // Each matrix gets its own stream of random numbers.
        *s = seed.map(|v| v.wrapping_add(0x9E37_79B9_7F4A_7C15));
        seed
    }

    /// Measures device memory bandwidth with a copy kernel: (bytes read + written) / time,
    /// median of `repeats`, over `bytes`-sized buffers.
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64, DriverError> {
        let n16 = bytes / 16;
        let src = self.stream.alloc_zeros::<u8>(n16 * 16)?;
        let dst = self.stream.alloc_zeros::<u8>(n16 * 16)?;
        let args = [Arg::Ptr(self.ptr(&dst)), Arg::Ptr(self.ptr(&src)), Arg::I64(n16 as i64)];
        let seconds = self.median_kernel_seconds(&self.k.copy_bandwidth, &args, repeats)?;
        Ok(2.0 * (n16 * 16) as f64 / seconds)
    }

    /// Measures the device memory's read bandwidth: bytes read / time, median of `repeats`,
    /// over a `bytes`-sized buffer (what a weight stream can reach at best).
    pub fn read_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64, DriverError> {
        let n16 = bytes / 16;
        let src = self.stream.alloc_zeros::<u8>(n16 * 16)?;
        let sink = self.stream.alloc_zeros::<u32>(1)?;
        // The buffer is zeros, so the folded value is 0 and never equals this.
        let args = [Arg::Ptr(self.ptr(&sink)), Arg::Ptr(self.ptr(&src)), Arg::I64(n16 as i64), Arg::I32(1)];
        let seconds = self.median_kernel_seconds(&self.k.read_bandwidth, &args, repeats)?;
        Ok((n16 * 16) as f64 / seconds)
    }

    /// Median wall time of one launch of `f` (8 blocks of 256 threads per SM), over `repeats`
    /// runs after two warm-ups.
    fn median_kernel_seconds(&self, f: &CudaFunction, args: &[Arg], repeats: usize) -> Result<f64, DriverError> {
        let sms = self.ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
        let mut times = Vec::with_capacity(repeats);
        for i in 0..repeats + 2 {
            self.stream.synchronize()?;
            let t0 = std::time::Instant::now();
            self.launch(f, (sms * 8, 1, 1), 256, 0, args);
            self.stream.synchronize()?;
            if i >= 2 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
    }
}
