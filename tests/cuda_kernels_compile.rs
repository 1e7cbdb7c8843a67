//! Every kernel source compiles with NVRTC, on machines without a GPU (CI).
//!
//! `.ci/run` installs NVRTC from the PyPI wheel `nvidia-cuda-nvrtc==13.0.88` and sets
//! `KESTREL_NVRTC_LIB` to its `libnvrtc.so.13`. With the variable set, any compile error fails
//! the test; under `CI=true` a missing variable fails it too. Elsewhere, the system NVRTC is
//! used when present.

use kestrel::backend::cuda::kernels;

/// Architectures compiled for: Ampere (the oldest the kernels support), Ada, Hopper.
const ARCHES: [&str; 3] = ["sm_80", "sm_89", "sm_90"];

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    // Keeps the library loaded for the whole test.
    let _preloaded = match std::env::var_os("KESTREL_NVRTC_LIB") {
        Some(path) => {
            // Loaded by full path first (with its builtins library beside it): the lookups by
            // soname that follow then find these copies.
            let path = std::path::PathBuf::from(path);
            let builtins = path.parent().map(|d| d.join("libnvrtc-builtins.so.13.0")).filter(|p| p.exists());
            let mut libs = Vec::new();
            for p in builtins.iter().chain(std::iter::once(&path)) {
                // SAFETY: loading NVRTC runs no initialisation code with preconditions.
                let lib = unsafe { libloading::Library::new(p) };
                libs.push(lib.unwrap_or_else(|e| panic!("{} (from KESTREL_NVRTC_LIB) cannot be loaded: {e}", p.display())));
            }
            Some(libs)
        }
        None if in_ci => panic!("KESTREL_NVRTC_LIB is not set: .ci/run installs nvidia-cuda-nvrtc==13.0.88 and sets it to the wheel's libnvrtc.so.13"),
        None if !kernels::nvrtc_present() => {
            eprintln!("skipped: no NVRTC (set KESTREL_NVRTC_LIB to a libnvrtc.so.13, as .ci/run does)");
            return;
        }
        None => None,
    };
    assert!(kernels::nvrtc_present(), "NVRTC did not load");
    let (major, minor) = kernels::nvrtc_version().expect("NVRTC version");
    eprintln!("NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    // Every architecture plain, and Hopper with start-time tracing (KESTREL_CUDA_TRACE=1).
    let builds = ARCHES.iter().map(|&a| (a, false)).chain([("sm_90", true)]);
    for (arch, trace) in builds {
        for (module, body) in kernels::SOURCES {
            match kernels::compile_cubin(module, body, arch, trace) {
                Ok(cubin) => assert!(!cubin.is_empty(), "{module}.cu for {arch} (trace {trace}): empty CUBIN"),
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    // The wgmma matmul, for the Hopper-specific target it needs, plain and traced.
    let (module, body) = kernels::WGMMA_SOURCE;
    for trace in [false, true] {
        match kernels::compile_cubin(module, body, kernels::WGMMA_ARCH, trace) {
            Ok(cubin) => assert!(!cubin.is_empty(), "{module}.cu for {} (trace {trace}): empty CUBIN", kernels::WGMMA_ARCH),
            Err(e) => failures.push(e.to_string()),
        }
    }
    // For any other target its source refuses to compile rather than build an empty kernel.
    assert!(kernels::compile_cubin(module, body, "sm_90", false).is_err(), "{module}.cu compiled for plain sm_90");
    assert!(failures.is_empty(), "{} kernel compilations failed:\n{}", failures.len(), failures.join("\n\n"));
}

/// Every tile format's quantized matmul module (cuda/qmatmul.cu with its `QFMT`) for Hopper, and
/// for Ampere (the oldest architecture the kernels support) the formats that between them take
/// every decoding path (4-bit with a min, 6-bit, codebook, e4m3 and int8 bytes).
#[test]
fn every_quantized_kernel_module_compiles_with_nvrtc() {
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    let _preloaded = match std::env::var_os("KESTREL_NVRTC_LIB") {
        Some(path) => {
            let path = std::path::PathBuf::from(path);
            let builtins = path.parent().map(|d| d.join("libnvrtc-builtins.so.13.0")).filter(|p| p.exists());
            let mut libs = Vec::new();
            for p in builtins.iter().chain(std::iter::once(&path)) {
                // SAFETY: loading NVRTC runs no initialisation code with preconditions.
                let lib = unsafe { libloading::Library::new(p) };
                libs.push(lib.unwrap_or_else(|e| panic!("{} (from KESTREL_NVRTC_LIB) cannot be loaded: {e}", p.display())));
            }
            Some(libs)
        }
        None if in_ci => panic!("KESTREL_NVRTC_LIB is not set: .ci/run installs nvidia-cuda-nvrtc==13.0.88 and sets it to the wheel's libnvrtc.so.13"),
        None if !kernels::nvrtc_present() => {
            eprintln!("skipped: no NVRTC (set KESTREL_NVRTC_LIB to a libnvrtc.so.13, as .ci/run does)");
            return;
        }
        None => None,
    };
    let mut failures = Vec::new();
    use kestrel::backend::cuda::quant_tiles::{TileFormat, ALL_FORMATS};
    let ampere = [TileFormat::Q4K, TileFormat::Q6K, TileFormat::IQ4XS, TileFormat::Fp8 { unit: 128 }, TileFormat::Q8_0];
    for (arch, formats) in [("sm_90", &ALL_FORMATS[..]), ("sm_80", &ampere[..])] {
        for &fmt in formats {
            let body = kernels::quant_module_body(fmt.kernel_id());
            match kernels::compile_cubin(&format!("qmatmul_{}", fmt.name()), &body, arch, false) {
                Ok(cubin) => assert!(!cubin.is_empty(), "{fmt:?} for {arch}: empty CUBIN"),
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{} quantized module compilations failed:\n{}", failures.len(), failures.join("\n\n"));
}
