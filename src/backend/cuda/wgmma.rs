//! The many-row bf16 matmul on Hopper's warpgroup tensor instructions (cuda/matmul_wgmma.cu).
//! Its per-element arithmetic is that of every other bf16 matmul kernel (the same k16 products
//! in the same order, the same k-slice sums), so taking it past [`matmul::LARGE_MIN_ROWS`] rows
//! changes speed, never bits. It needs the sm_90a target, so it is a module of its own, built
//! only on sm_90 GPUs; `KESTREL_CUDA_WGMMA=0` leaves every many-row launch to the large-tile
//! kernel, for A/B runs.

use super::{kernels, matmul, Arg, CudaBackend, CudaInitError};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Output columns (weight rows) per block: two warpgroups of 64.
const BLOCK_COLS: usize = 128;
/// Output rows (activation rows) per block: wgmma's N (WG_BM in cuda/matmul_wgmma.cu).
const BLOCK_ROWS: usize = 192;
/// Stages of the cp.async ring (WG_STAGES).
const STAGES: usize = 10;
/// Dynamic shared memory of `matmul_wgmma`: the ring of 32-wide k blocks of both tiles.
pub(super) const WGMMA_SMEM: usize = STAGES * (BLOCK_ROWS + BLOCK_COLS) * 64;
/// Threads per block: two warpgroups.
const THREADS: u32 = 256;

/// The loaded kernels, and whether launches take them (on by default).
pub(super) struct WgmmaMatmul {
    matmul: CudaFunction,
    round: CudaFunction,
    enabled: AtomicBool,
}

impl WgmmaMatmul {
    /// Compiles (or loads cached) the module where it can run: an sm_90 GPU whose blocks may
    /// take [`WGMMA_SMEM`] of shared memory, unless `KESTREL_CUDA_WGMMA=0`.
    pub(super) fn load(ctx: &Arc<CudaContext>, arch: &str, trace: bool, optin_smem: i32) -> Result<Option<(Self, Arc<CudaModule>)>, CudaInitError> {
        if arch != "sm_90" || std::env::var("KESTREL_CUDA_WGMMA").is_ok_and(|v| v == "0") || (optin_smem.max(0) as usize) < WGMMA_SMEM {
            return Ok(None);
        }
        let (name, body) = kernels::WGMMA_SOURCE;
        let cubin = kernels::cached_cubin(name, body, kernels::WGMMA_ARCH, trace)?;
        let driver = |e: cudarc::driver::DriverError| CudaInitError::Driver(format!("{name}.cu: {e:?}"));
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(driver)?;
        let matmul = module.load_function("matmul_wgmma").map_err(driver)?;
        let round = module.load_function("round_activations_wgmma").map_err(driver)?;
        use cudarc::driver::sys::CUfunction_attribute as FuncAttr;
        matmul.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, WGMMA_SMEM as i32).map_err(driver)?;
        Ok(Some((WgmmaMatmul { matmul, round, enabled: AtomicBool::new(true) }, module)))
    }

    /// Each kernel's driver handle and name (for the start-time trace).
    pub(super) fn names(&self) -> Vec<(usize, &'static str)> {
        vec![(self.matmul.cu_function() as usize, "matmul_wgmma"), (self.round.cu_function() as usize, "round_activations_wgmma")]
    }
}

impl CudaBackend {
    /// Whether many-row bf16 matmuls run on the wgmma kernel (an sm_90 GPU, not turned off).
    pub fn wgmma_matmul(&self) -> bool {
        self.wgmma.as_ref().is_some_and(|w| w.enabled.load(Ordering::Relaxed))
    }

    /// Turns the wgmma kernel off (or back on, where it loaded) for the launches that follow:
    /// the large-tile kernel then takes them, with the same bits (tests and A/B timings).
    pub fn set_wgmma_matmul(&self, on: bool) {
        if let Some(w) = &self.wgmma {
            w.enabled.store(on, Ordering::Relaxed);
        }
    }
}

/// `out[rows, n] = x[rows, k] @ W^T` for a plain (ungrouped) launch of bf16 weights with `k` a
/// multiple of 32, on the wgmma kernel when it is loaded and on; false (nothing launched)
/// otherwise.
#[allow(clippy::too_many_arguments)]
pub(super) fn try_launch(be: &CudaBackend, out: u64, x: u64, rows: usize, w: u64, n: usize, k: usize, epi: matmul::Epilogue) -> bool {
    let Some(wg) = be.wgmma.as_ref().filter(|w| w.enabled.load(Ordering::Relaxed)) else { return false };
    debug_assert!(k.is_multiple_of(32));
    let chunks = rows * k / 32;
    // SAFETY: fully written by round_activations_wgmma before the matmul reads it.
    let xp = super::ck(be.host_timer.time(true, || unsafe { be.stream.alloc::<u16>(rows * k) }), "alloc");
    be.launch(&wg.round, (chunks.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(be.ptr(&xp)), Arg::Ptr(x), Arg::I64(chunks as i64)]);
    let args = [Arg::Ptr(out), Arg::Ptr(be.ptr(&xp)), Arg::Ptr(w), Arg::I32(rows as i32), Arg::I32(n as i32), Arg::I32(k as i32), Arg::Epilogue(epi)];
    be.launch(&wg.matmul, (n.div_ceil(BLOCK_COLS) as u32, rows.div_ceil(BLOCK_ROWS) as u32, 1), THREADS, WGMMA_SMEM, &args);
    true
}
