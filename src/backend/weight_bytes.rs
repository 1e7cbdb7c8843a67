//! Weights as the backends take them: a row-major matrix of some stored dtype inside a shared
//! byte buffer (a memory map, embedded bytes or an owned vector). The model's loaders fill these;
//! the backends read, dequantize or upload them.

use kestrel_quant::Dtype;
use std::sync::Arc;

/// A shared, immutable byte buffer: a memory map or a `'static` slice.
#[derive(Clone)]
pub struct SharedBytes(Arc<dyn AsRef<[u8]> + Send + Sync>);

impl SharedBytes {
    pub fn from_mmap(map: memmap2::Mmap) -> Self {
        SharedBytes(Arc::new(map))
    }
    pub fn from_static(bytes: &'static [u8]) -> Self {
        SharedBytes(Arc::new(bytes))
    }
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        SharedBytes(Arc::new(bytes))
    }
    pub fn as_slice(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

/// A row-major matrix `[rows, cols]` inside a shared buffer; cheap to clone and to slice by
/// rows, so stacked tensors (e.g. all experts in one) need no copy.
#[derive(Clone)]
pub struct MatrixBytes {
    pub data: SharedBytes,
    pub start: usize,
    pub dtype: Dtype,
    pub rows: usize,
    pub cols: usize,
}

impl MatrixBytes {
    /// Rows and columns of `parts` stacked by rows; they must share the column count.
    pub fn stacked_shape(parts: &[MatrixBytes]) -> Result<(usize, usize), String> {
        let cols = parts.first().map_or(0, |p| p.cols);
        match parts.iter().find(|p| p.cols != cols) {
            Some(p) => Err(format!("cannot stack a {}x{} matrix under {cols} columns", p.rows, p.cols)),
            None => Ok((parts.iter().map(|p| p.rows).sum(), cols)),
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_elems() * self.dtype.block_bytes()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data.as_slice()[self.start..self.start + self.rows * self.row_bytes()]
    }

    /// Rows `r0..r1` as their own matrix.
    pub fn rows(&self, r0: usize, r1: usize) -> MatrixBytes {
        assert!(r0 <= r1 && r1 <= self.rows, "row range {r0}..{r1} outside {} rows", self.rows);
        MatrixBytes { data: self.data.clone(), start: self.start + r0 * self.row_bytes(), dtype: self.dtype, rows: r1 - r0, cols: self.cols }
    }

    /// Builds a matrix over owned f32 values (random weights, tests).
    pub fn from_f32(values: Vec<f32>, rows: usize, cols: usize) -> MatrixBytes {
        assert_eq!(values.len(), rows * cols);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        MatrixBytes { data: SharedBytes::from_vec(bytes), start: 0, dtype: Dtype::F32, rows, cols }
    }
}
