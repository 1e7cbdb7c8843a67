//! Opening a GPU: the driver and NVRTC probed, the kernels compiled (or read from the disk
//! cache) and loaded, each launch shape's limits read from the device, the stream and the
//! memory pool set up.

use super::kernels::{self, KernelError};
use super::{matmul, moe, profile, wgmma, CudaBackend, Kernels};
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum CudaInitError {
    #[error("no CUDA driver (libcuda.so.1 cannot be loaded)")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so.13) cannot be loaded; it compiles the kernels at run time")]
    NoNvrtc,
    #[error("no CUDA device found")]
    NoDevice,
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error("GPU {name} has compute capability {major}.{minor}; the kernels need 8.0 or newer (bf16 tensor cores)")]
    Unsupported { name: String, major: i32, minor: i32 },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Whether the CUDA driver and NVRTC can be loaded. Call before anything else in this module:
/// cudarc panics on a missing library.
pub fn probe() -> Result<(), CudaInitError> {
    // SAFETY: these only try to dlopen the libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaInitError::NoDriver);
    }
    if !kernels::nvrtc_present() {
        return Err(CudaInitError::NoNvrtc);
    }
    Ok(())
}

/// Activations are allocated from the device's default memory pool (`cuMemAllocAsync`). Its
/// release threshold defaults to zero, which hands every freed byte back to the driver at each
/// synchronization, so each step would map its activation memory afresh; keep it instead (the
/// memory planning leaves room for the activations anyway).
fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), DriverError> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: a valid device handle and out pointer; the attribute takes a u64 by pointer.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, (&mut threshold as *mut u64).cast()).result()?;
    }
    Ok(())
}

/// Hands the default memory pool's unused memory back to the driver. The pool keeps what was
/// freed (see keep_pool_memory), so before sizing a cache from the driver's free memory the
/// activations of earlier work (an engine dropped in the same process, as a bench sweep does)
/// must be returned, or they count as used and the next cache finds no room.
pub(super) fn trim_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), DriverError> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid device handle and out pointer; trimming only releases unused memory.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolTrimTo(pool, 0).result()?;
    }
    Ok(())
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads cached) kernels for its architecture.
    pub fn new(ordinal: usize) -> Result<Self, CudaInitError> {
        probe()?;
        let driver = |e: DriverError| CudaInitError::Driver(format!("{e:?}"));
        if CudaContext::device_count().map_err(driver)? <= ordinal as i32 {
            return Err(CudaInitError::NoDevice);
        }
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        // Per-slice event tracking breaks graph capture; this backend orders all work on one stream.
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx).map_err(driver)?;
        let (major, minor) = ctx.compute_capability().map_err(driver)?;
        let name = ctx.name().map_err(driver)?;
        if major < 8 {
            return Err(CudaInitError::Unsupported { name, major, minor });
        }
        let arch = kernels::arch_name(major, minor);
        let trace = std::env::var("KESTREL_CUDA_TRACE").is_ok_and(|v| v == "1");
        let (k, mut modules) = Kernels::load(&ctx, &arch, trace)?;
        let optin = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).map_err(driver)?;
        let wgmma = wgmma::WgmmaMatmul::load(&ctx, &arch, trace, optin)?.map(|(w, module)| {
            modules.push(module);
            w
        });
        use cudarc::driver::sys::CUfunction_attribute as FuncAttr;
        // Kernels with large dynamic shared memory may use all of it beside their static part;
        // returns the kernel's static shared memory (bytes).
        let open_dynamic_smem = |f: &CudaFunction| -> Result<i32, CudaInitError> {
            // SAFETY: a loaded function handle and a valid attribute.
            let fixed = unsafe { cudarc::driver::result::function::get_function_attribute(f.cu_function(), FuncAttr::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }.map_err(driver)?;
            f.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - fixed).map_err(driver)?;
            Ok(fixed)
        };
        let mut max_dynamic_smem = optin;
        let attention_kernels = [&k.attn_core_f32, &k.attn_core_bf16, &k.attn_core_fp8, &k.attn_core_tq3, &k.attn_decode_f32, &k.attn_decode_bf16, &k.attn_decode_fp8, &k.attn_decode_tq3, &k.attn_flash_bf16, &k.attn_flash_fp8, &k.attn_flash_tq3, &k.attn_flash_decode_bf16, &k.attn_flash_decode_fp8, &k.attn_flash_decode_tq3];
        for f in [&k.gdn_chunk_prep, &k.gdn_chunk_state_32, &k.gdn_chunk_state_16, &k.moe_group_few, &k.matmul_pipelined].into_iter().chain(attention_kernels) {
            max_dynamic_smem = max_dynamic_smem.min(optin - open_dynamic_smem(f)?);
        }
        // The large-tile matmul takes nearly all of an SM's shared memory (Hopper's 227 KB);
        // elsewhere the pipelined kernel runs every many-row launch.
        let large_matmul = (optin - open_dynamic_smem(&k.matmul_large)?).max(0) as usize >= matmul::LARGE_SMEM && std::env::var("KESTREL_CUDA_LARGE").map_or(true, |v| v != "0");
        // The k-sliced matmul runs in thread block clusters (sm_90).
        let sliced_matmul = major >= 9 && (optin - open_dynamic_smem(&k.matmul_sliced)?).max(0) as usize >= matmul::SLICED_SMEM && std::env::var("KESTREL_CUDA_SLICED").map_or(true, |v| v != "0");
        let sm_count = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(driver)?.max(1) as usize;
        let mut small_matmul_slots = [0; matmul::SMALL_VARIANTS.len()];
        for (slots, v) in small_matmul_slots.iter_mut().zip(&matmul::SMALL_VARIANTS) {
            let f = (v.kernel)(&k);
            *slots = sm_count * f.occupancy_max_active_blocks_per_multiprocessor(matmul::SMALL_THREADS, 0, None).map_err(driver)?.max(1) as usize;
        }
        // The weight-streaming matmuls use sm_90 bulk copies.
        let stream_kernels = if major >= 9 && std::env::var("KESTREL_CUDA_STREAM").map_or(true, |v| v != "0") {
            let smem_per_sm = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR).map_err(driver)?.max(0) as usize;
            let mut sk = matmul::StreamKernels {
                ring_bytes: std::env::var("KESTREL_CUDA_STREAM_RING").ok().and_then(|v| v.parse().ok()).unwrap_or(matmul::RING_BYTES),
                grouped_ring_bytes: std::env::var("KESTREL_CUDA_GROUPED_RING").ok().and_then(|v| v.parse().ok()).unwrap_or(matmul::GROUPED_RING_BYTES),
                static_smem: [0; 3],
                blocks_per_sm: [0; 3],
                norm_blocks_per_sm: [0; 3],
                norm_in_matmul: std::env::var("KESTREL_CUDA_STREAM_NORM").map_or(true, |v| v != "0"),
                max_dynamic: [0; 3],
                smem_per_sm,
                fused_down_max_dynamic: 0,
                route_gate_up_cluster: 0,
                route_gate_up_max_dynamic: 0,
                min_variant: match std::env::var("KESTREL_CUDA_STREAM_NT").as_deref() {
                    Ok("4") => 2,
                    Ok("2") => 1,
                    _ => 0,
                },
            };
            // A variant's shapes fit its plain kernel and its normalizing twins (which one a
            // launch takes is decided after the shape); the plain kernel keeps its own
            // occupancy, the twins share the lower of theirs.
            let variants = [
                [&k.matmul_stream_nt1, &k.matmul_stream_norm_nt1, &k.matmul_stream_combine_nt1],
                [&k.matmul_stream_nt2, &k.matmul_stream_norm_nt2, &k.matmul_stream_combine_nt2],
                [&k.matmul_stream_nt4, &k.matmul_stream_norm_nt4, &k.matmul_stream_combine_nt4],
            ];
            for (i, fs) in variants.into_iter().enumerate() {
                sk.max_dynamic[i] = usize::MAX;
                sk.norm_blocks_per_sm[i] = usize::MAX;
                for (j, f) in fs.into_iter().enumerate() {
                    let fixed = open_dynamic_smem(f)?;
                    sk.static_smem[i] = sk.static_smem[i].max(fixed.max(0) as usize);
                    sk.max_dynamic[i] = sk.max_dynamic[i].min((optin - fixed).max(0) as usize);
                    let blocks = f.occupancy_max_active_blocks_per_multiprocessor(matmul::STREAM_THREADS, 0, None).map_err(driver)?.max(1) as usize;
                    if j == 0 {
                        sk.blocks_per_sm[i] = blocks;
                    } else {
                        sk.norm_blocks_per_sm[i] = sk.norm_blocks_per_sm[i].min(blocks);
                    }
                }
            }
            // The streaming router takes the one-n-tile shapes, beside its routing's static memory.
            let fixed = open_dynamic_smem(&k.matmul_router_stream)?;
            sk.max_dynamic[0] = sk.max_dynamic[0].min((optin - fixed).max(0) as usize);
            if std::env::var("KESTREL_CUDA_FUSED_DOWN").map_or(true, |v| v != "0") {
                sk.fused_down_max_dynamic = (optin - open_dynamic_smem(&k.moe_down_combine)?).max(0) as usize;
            }
            // Clusters of 16 blocks: a block's share of 35B-A3B's router is then three column
            // blocks (clusters of 8, with five each, were slower on the H100). More than 8
            // blocks per cluster is not portable: the kernel must allow it.
            sk.route_gate_up_cluster = std::env::var("KESTREL_CUDA_ROUTE_GATE_UP").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
            if sk.route_gate_up_cluster > 0 {
                sk.route_gate_up_max_dynamic = (optin - open_dynamic_smem(&k.moe_route_gate_up)?).max(0) as usize;
                if sk.route_gate_up_cluster > 8 {
                    k.moe_route_gate_up.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1).map_err(driver)?;
                }
            }
            Some(sk)
        } else {
            None
        };
        let stream = ctx.new_stream().map_err(driver)?;
        let router_done = stream.alloc_zeros::<u32>(1).map_err(driver)?;
        let tracer = if trace { Some(profile::Tracer::new(&stream, &modules, k.names().into_iter().chain(wgmma.iter().flat_map(|w| w.names())).collect()).map_err(driver)?) } else { None };
        Ok(CudaBackend {
            ctx,
            stream,
            k,
            _modules: modules,
            name,
            arch,
            random_weights: Mutex::new(None),
            uploaded_bytes: AtomicUsize::new(0),
            step_inputs: Mutex::new(Default::default()),
            column_lists: Mutex::new(HashMap::new()),
            graphs: Mutex::new(Default::default()),
            capturing: AtomicBool::new(false),
            rope_tables: Mutex::new(HashMap::new()),
            sampling_scratch: Mutex::new(None),
            max_dynamic_smem: max_dynamic_smem.max(0) as usize,
            large_matmul,
            wgmma,
            sliced_matmul,
            profiler: profile::Profiler::from_env(),
            host_timer: profile::HostTimer::from_env(),
            small_matmul_slots,
            stream_kernels,
            sm_count,
            dependent_launch: major >= 9 && std::env::var("KESTREL_CUDA_PDL").map_or(true, |v| v != "0"),
            launches: AtomicUsize::new(0),
            last_launch: AtomicUsize::new(0),
            router_done,
            active_clusters: Mutex::new(HashMap::new()),
            tracer,
            l2_ahead: std::env::var("KESTREL_CUDA_L2_AHEAD").map_or(true, |v| v != "0"),
            attn_decode: std::env::var("KESTREL_CUDA_ATTN_DECODE").map_or(true, |v| v != "0"),
            flash_attention: std::env::var("KESTREL_CUDA_FLASH_ATTN").map_or(true, |v| v != "0"),
            flash_extras: AtomicBool::new(true),
            l2_tail_bytes: std::env::var("KESTREL_CUDA_L2_TAIL_MB").ok().and_then(|v| v.parse::<usize>().ok()).map_or(moe::PROJECTION_TAIL_BYTES, |mb| mb << 20),
            optin_smem: optin.max(0) as usize,
            quant_kernels: Mutex::new(HashMap::new()),
        })
    }
}
