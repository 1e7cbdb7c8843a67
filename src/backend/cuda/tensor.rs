//! Device-resident tensors of the CUDA backend.

use super::qmatmul::QuantKernels;
use super::quant_tiles::{RowOrder, TileFormat};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// A `[rows, cols]` f32 activation in device memory.
pub struct CudaTensor {
    pub(super) data: CudaSlice<f32>,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// A `[rows, cols]` weight on the device: bf16 (F32 and F16 sources with their rounding
/// remainder beside), quantized tiles in the stored bits (quant_tiles.rs), or, for a stack of
/// parts stored differently, each run of parts on its own.
pub struct CudaMatrix {
    pub(super) store: WeightStorage,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Set on a MoE router weight: the pointer tables of its block's experts.
    pub(super) expert_tables: std::sync::OnceLock<super::ExpertTables>,
}

pub(super) enum WeightStorage {
    /// bf16 values; F32 and F16 sources keep the rounding remainder in `lo` (value = hi + lo,
    /// about 16 mantissa bits), so their products stay close to f32.
    Dense { hi: CudaSlice<u8>, lo: Option<CudaSlice<u8>> },
    /// Quantized tiles of one format.
    Tiles(QuantTiles),
    /// Row ranges stored differently (a row-stacked weight whose parts differ), in order.
    Stacked(Vec<StackedPart>),
}

/// A quantized weight's tiles and the kernels of its format.
pub(super) struct QuantTiles {
    pub fmt: TileFormat,
    pub order: RowOrder,
    pub data: CudaSlice<u8>,
    pub kernels: Arc<QuantKernels>,
}

/// Rows `row0..row0 + matrix.rows` of a stacked weight.
pub(super) struct StackedPart {
    pub row0: usize,
    pub matrix: CudaMatrix,
}

impl CudaMatrix {
    pub(super) fn new(store: WeightStorage, rows: usize, cols: usize) -> Self {
        CudaMatrix { store, rows, cols, expert_tables: Default::default() }
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The bf16 halves of a dense weight (None for quantized or stacked ones).
    pub(super) fn dense(&self) -> Option<(&CudaSlice<u8>, Option<&CudaSlice<u8>>)> {
        match &self.store {
            WeightStorage::Dense { hi, lo } => Some((hi, lo.as_ref())),
            _ => None,
        }
    }
    /// The bf16 values of a dense weight without a remainder (what the streaming kernels take).
    pub(super) fn bf16(&self) -> Option<&CudaSlice<u8>> {
        match self.dense() {
            Some((hi, None)) => Some(hi),
            _ => None,
        }
    }
    /// Bytes held on the device.
    pub fn device_bytes(&self) -> usize {
        match &self.store {
            WeightStorage::Dense { hi, lo } => hi.len() + lo.as_ref().map_or(0, |l| l.len()),
            WeightStorage::Tiles(t) => t.data.len(),
            WeightStorage::Stacked(parts) => parts.iter().map(|p| p.matrix.device_bytes()).sum(),
        }
    }
    /// How the weight is stored, for `kestrel info` and benchmarks ("bf16", "q4_k", "q6_k+q4_k").
    pub fn storage_name(&self) -> String {
        match &self.store {
            WeightStorage::Dense { lo: None, .. } => "bf16".into(),
            WeightStorage::Dense { .. } => "bf16 pair".into(),
            WeightStorage::Tiles(t) => t.fmt.name(),
            WeightStorage::Stacked(parts) => parts.iter().map(|p| p.matrix.storage_name()).collect::<Vec<_>>().join("+"),
        }
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
