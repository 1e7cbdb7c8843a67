//! Device-resident tensors of the CUDA backend.

use cudarc::driver::CudaSlice;

/// A `[rows, cols]` f32 activation in device memory.
pub struct CudaTensor {
    pub(super) data: CudaSlice<f32>,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// A `[rows, cols]` weight stored as bf16. F32 and F16 sources keep the rounding remainder in
/// `lo` (value = hi + lo, about 16 mantissa bits), so their products stay close to f32.
pub struct CudaMatrix {
    pub(super) hi: CudaSlice<u8>,
    pub(super) lo: Option<CudaSlice<u8>>,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Set on a MoE router weight: the pointer tables of its block's experts.
    pub(super) expert_tables: std::sync::OnceLock<super::ExpertTables>,
}

impl CudaMatrix {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held on the device.
    pub fn device_bytes(&self) -> usize {
        self.hi.len() + self.lo.as_ref().map_or(0, |l| l.len())
    }
}

/// A small f32 parameter vector (norm weights, conv kernels, gate constants).
pub struct CudaVector {
    pub(super) data: CudaSlice<f32>,
    pub(super) len: usize,
}

impl CudaVector {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
