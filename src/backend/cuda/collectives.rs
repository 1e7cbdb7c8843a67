//! NCCL, the collectives between GPUs of tensor parallelism: found at run time like the rest of
//! CUDA (cudarc's `nccl` feature, dynamic loading), with a clear error where it is missing.

/// Why NCCL cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error("NCCL is not installed: tensor parallelism over several GPUs needs libnccl (install libnccl2 and libnccl-dev, or put the folder of libnccl.so on LD_LIBRARY_PATH)")]
    Missing,
    #[error("found {found}, but NCCL is loaded as libnccl.so: install libnccl-dev, or make a libnccl.so link to it in a folder on LD_LIBRARY_PATH")]
    OnlyVersioned { found: String },
}

/// Whether libnccl can be loaded. Call before any NCCL call: cudarc panics on a missing library.
pub fn probe_nccl() -> Result<(), NcclError> {
    // SAFETY: this only tries to dlopen the library under the names cudarc loads.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    // The runtime package installs only the versioned name, which cudarc does not look for.
    // SAFETY: loading NCCL runs no code of ours; the handle is dropped at once.
    if unsafe { libloading::Library::new("libnccl.so.2") }.is_ok() {
        return Err(NcclError::OnlyVersioned { found: "libnccl.so.2".into() });
    }
    Err(NcclError::Missing)
}
