//! Kernel sources (cuda/*.cu, embedded in the binary) compiled by NVRTC into a CUBIN for the
//! GPU's exact architecture, and cached on disk so later runs skip the compiler.

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// Helpers prepended to every source.
pub const COMMON_SOURCE: &str = include_str!("../../../cuda/common.cuh");

/// Every kernel source: (module name, text). The MoE routing (cuda/routing.cuh) goes in front
/// of both modules that route: moe.cu, and matmul.cu, whose router matmul routes in its last
/// block. Attention is one module per KV cache format: the formats (cuda/kv_formats.cuh), the
/// kernels' code (cuda/attention.cu; the tensor-core kernels' tile loads and body in
/// cuda/attention_flash_tiles.cuh and cuda/attention_flash.cu), and their instantiation for the
/// format.
pub const SOURCES: [(&str, &str); 9] = [
    ("elementwise", include_str!("../../../cuda/elementwise.cu")),
    ("matmul", concat!(include_str!("../../../cuda/routing.cuh"), include_str!("../../../cuda/matmul_common.cuh"), include_str!("../../../cuda/matmul.cu"), include_str!("../../../cuda/matmul_stream.cu"), include_str!("../../../cuda/moe_stream.cu"), include_str!("../../../cuda/matmul_tiles.cu"))),
    ("attention_f32", concat!(include_str!("../../../cuda/kv_formats.cuh"), include_str!("../../../cuda/attention.cu"), "ATTN_KERNELS(f32, KvF32)\n")),
    ("attention_bf16", concat!(include_str!("../../../cuda/kv_formats.cuh"), include_str!("../../../cuda/attention.cu"), include_str!("../../../cuda/attention_flash_tiles.cuh"), include_str!("../../../cuda/attention_flash.cu"), "ATTN_KERNELS(bf16, KvBf16)\nFLASH_KERNELS(bf16, KvBf16)\n")),
    ("attention_fp8", concat!(include_str!("../../../cuda/kv_formats.cuh"), include_str!("../../../cuda/attention.cu"), include_str!("../../../cuda/attention_flash_tiles.cuh"), include_str!("../../../cuda/attention_flash.cu"), "ATTN_KERNELS(fp8, KvFp8)\nFLASH_KERNELS(fp8, KvFp8)\n")),
    ("attention_tq3", concat!(include_str!("../../../cuda/kv_formats.cuh"), include_str!("../../../cuda/attention.cu"), include_str!("../../../cuda/attention_flash_tiles.cuh"), include_str!("../../../cuda/attention_flash.cu"), "ATTN_KERNELS(tq3, KvTq3)\nFLASH_KERNELS(tq3, KvTq3)\n")),
    ("gdn", concat!(include_str!("../../../cuda/gdn.cu"), include_str!("../../../cuda/gdn_chunk.cu"))),
    ("moe", concat!(include_str!("../../../cuda/routing.cuh"), include_str!("../../../cuda/moe.cu"))),
    ("sample", include_str!("../../../cuda/sample.cu")),
];

/// The many-row bf16 matmul on Hopper's warpgroup instructions (cuda/matmul_wgmma.cu): its own
/// module, compiled for [`WGMMA_ARCH`] only.
pub const WGMMA_SOURCE: (&str, &str) = ("matmul_wgmma", concat!(include_str!("../../../cuda/matmul_common.cuh"), include_str!("../../../cuda/matmul_wgmma.cu")));

/// The architecture-specific Hopper target wgmma needs (a plain sm_90 build rejects it).
pub const WGMMA_ARCH: &str = "sm_90a";

/// The quantized matmul kernels (cuda/qformats.cuh, qmatmul.cu, qtiles.cu), one module per tile
/// format.
pub const QUANT_SOURCE: &str = concat!(
    include_str!("../../../cuda/matmul_common.cuh"),
    include_str!("../../../cuda/qformats.cuh"),
    include_str!("../../../cuda/qmatmul.cu"),
    include_str!("../../../cuda/qtiles.cu")
);

/// The body of the quantized kernel module of tile format `id` (`TileFormat::kernel_id`).
pub fn quant_module_body(id: u32) -> String {
    format!("#define QFMT {id}\n{QUANT_SOURCE}")
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("NVRTC library (libnvrtc.so.13) not found")]
    NoNvrtc,
    #[error("NVRTC failed on {module} for {arch}: {reason}\n{log}")]
    Compile { module: String, arch: String, reason: String, log: String },
    #[error("NVRTC error on {module}: {reason}")]
    Nvrtc { module: String, reason: String },
}

/// `sm_XY` for a compute capability.
pub fn arch_name(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// The full translation unit NVRTC compiles for one module.
pub fn module_source(body: &str) -> String {
    format!("{COMMON_SOURCE}\n{body}")
}

fn options(arch: &str, trace: bool) -> Vec<String> {
    // Precise division, square root and denormals (NVRTC's defaults): results stay close to
    // the f32 CPU reference.
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string(), "--fmad=true".to_string()];
    if trace {
        // Kernels record their start times (profile.rs, KESTREL_CUDA_TRACE=1).
        o.push("-DKESTREL_TRACE".to_string());
    }
    if cfg!(feature = "plant-verify-skips-cache") {
        // The deliberate bug the verify-row tests must catch (Cargo.toml).
        o.push("-DPLANT_VERIFY_SKIPS_CACHE=1".to_string());
    }
    // Kernel tuning constants overridden for an experiment (`KESTREL_CUDA_DEFINES="A=1 B=2"`),
    // so that variants can be timed against each other without rebuilding; part of the cache key.
    if let Ok(defines) = std::env::var("KESTREL_CUDA_DEFINES") {
        o.extend(defines.split_whitespace().map(|d| format!("-D{d}")));
    }
    o
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| KernelError::Nvrtc { module: "-".into(), reason: format!("{e:?}") })?;
    Ok((major, minor))
}

/// True when libnvrtc can be loaded (checked before any NVRTC call, which would panic).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Compiles one module to a CUBIN for `arch` (e.g. "sm_90"), with start-time tracing if `trace`.
pub fn compile_cubin(module: &str, body: &str, arch: &str, trace: bool) -> Result<Vec<u8>, KernelError> {
    if !nvrtc_present() {
        return Err(KernelError::NoNvrtc);
    }
    let err = |reason: String| KernelError::Nvrtc { module: module.to_string(), reason };
    let src = CString::new(module_source(body)).map_err(|_| err("source holds a NUL byte".into()))?;
    let name = CString::new(format!("{module}.cu")).map_err(|_| err("bad module name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| err(format!("{e:?}")))?;
    // SAFETY: `prog` was just created and is destroyed exactly once below.
    let result = unsafe { nvrtc::compile_program(prog, &options(arch, trace)) };
    let out = match result {
        Err(e) => {
            // SAFETY: valid program handle.
            let log = unsafe { nvrtc::get_program_log(prog) }.map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned()).unwrap_or_default();
            Err(KernelError::Compile { module: module.to_string(), arch: arch.to_string(), reason: format!("{e:?}"), log })
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: valid compiled program; the buffer has the size NVRTC reported.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| err(format!("{e:?}")))?;
            let mut cubin = vec![0u8; size];
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }.result().map_err(|e| err(format!("{e:?}")))?;
            Ok(cubin)
        }
    };
    // SAFETY: destroyed once; a failure here only leaks the program.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

/// `$XDG_CACHE_HOME/kestrel/kernels` or `~/.cache/kestrel/kernels`.
fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).filter(|p| p.is_absolute()).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kestrel").join("kernels"))
}

/// FNV-1a: a stable 64-bit key for the cache file name.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// The CUBIN of one module: from the disk cache when the source, options, architecture and
/// NVRTC version match, else compiled and stored (a cache that cannot be written is skipped).
pub fn cached_cubin(module: &str, body: &str, arch: &str, trace: bool) -> Result<Vec<u8>, KernelError> {
    let (major, minor) = nvrtc_version()?;
    let version = format!("{major}.{minor}");
    let opts = options(arch, trace).join(" ");
    let key = fnv1a(&[COMMON_SOURCE.as_bytes(), body.as_bytes(), opts.as_bytes(), version.as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{module}-{arch}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_cubin(module, body, arch, trace)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::SOURCES;

    /// The body of every `__global__` function in `src` (from its opening brace), by name.
    fn kernel_bodies(src: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(at) = rest.find("__global__") {
            let after = &rest[at..];
            let open = after.find('{').expect("a kernel has a body");
            let name = after[..after.find('(').expect("a kernel has parameters")].split_whitespace().last().unwrap_or("").to_string();
            // Macro-defined kernels continue their lines with backslashes.
            let body: String = after[open + 1..].chars().filter(|&c| c != '\\').collect();
            out.push((name, body));
            rest = &after[open..];
        }
        out
    }

    /// Kernels launch before the previous kernel ends (programmatic dependent launch), so each
    /// must wait for its inputs before anything else; only weight loads may come first.
    #[test]
    fn every_kernel_waits_for_its_inputs_first() {
        let mut kernels = 0;
        for (module, src) in SOURCES.into_iter().chain([("qmatmul", super::QUANT_SOURCE)]) {
            for (name, body) in kernel_bodies(src) {
                kernels += 1;
                let first: Vec<&str> = body.split(';').map(str::trim).take(2).collect();
                // wait_for_inputs_holding_dependents: a kernel that lets the next one launch
                // only once it has written what that one reads before its own wait.
                let is_wait = |s: Option<&&str>| s == Some(&"wait_for_inputs()") || s == Some(&"wait_for_inputs_holding_dependents()");
                let waits_first = is_wait(first.first());
                // Work that may come first: the L2 prefetch of the small-row kernels, the
                // streaming kernels' ring set-up and first weight copies (weights only), and
                // the recurrent delta rule's loads of its state (written two or more launches
                // back, or it waits first; gdn.rs tells it which); attention's L2 prefetch of its
                // key and value rows, its reads of its weights and of the step's layout (written
                // before the step's first launch) and attn_decode's copies of cached values
                // (written by earlier steps); the fused down
                // projection's look-up of its experts (routed two launches back, or by the
                // launch before, which lets it start only once the routing is written; it checks
                // them after its wait) and its first weight copies; the clustered router's ring,
                // its share of the router's weights, the experts' weight table and its warm-up
                // run of the routing code (on the norm weight, into shared scratch).
                let weight_work = |s: &&str| {
                    s.starts_with("prefetch_small(")
                        || s.starts_with("StreamRing ring = stream_start<")
                        || s.starts_with("RecurrentStart st = recurrent_start<")
                        || s.starts_with("AttnStart st = attn_start<")
                        || s.starts_with("AttnPrepStart st = attn_prep_start(")
                        || s.starts_with("int ctx = positions[")
                        || s.starts_with("FusedDownStart st = fused_down_start(")
                        || s.starts_with("RouteGateUpStart st = route_gate_up_start(")
                        || s.starts_with("QFewStart st = qmm_few_start(")
                };
                let prefetch_then_wait = first.first().is_some_and(weight_work) && is_wait(first.get(1));
                assert!(waits_first || prefetch_then_wait, "{module}.cu: kernel {name} does not start with wait_for_inputs(): {:?}", first);
            }
        }
        assert!(kernels >= 30, "found only {kernels} kernels");
    }
}
