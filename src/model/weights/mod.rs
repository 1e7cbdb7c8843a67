//! Zero-copy weight access over memory-mapped files (or bytes embedded in the binary).
//!
//! A [`WeightStore`] maps tensor names to byte ranges of a backing buffer; nothing is read or
//! copied until a backend asks for a tensor's bytes.

pub mod gguf;
pub mod online;
pub mod quantized;
pub mod safetensors;

pub use kestrel_quant::Dtype;
pub use crate::backend::weight_bytes::{MatrixBytes, SharedBytes};
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("cannot open {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a valid safetensors file: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path} is truncated: tensor `{tensor}` ends at byte {end} but the file holds {len} data bytes")]
    Truncated { path: PathBuf, tensor: String, end: usize, len: usize },
    #[error("{path}: tensor `{tensor}` has unsupported dtype {dtype}")]
    UnsupportedDtype { path: PathBuf, tensor: String, dtype: String },
    #[error("missing tensor `{tensor}` (looked in {source_desc})")]
    Missing { tensor: String, source_desc: String },
    #[error("tensor `{tensor}` in {path} has shape {got:?}, expected {want:?}")]
    Shape { path: PathBuf, tensor: String, got: Vec<usize>, want: Vec<usize> },
    #[error("{path}: index file is invalid: {reason}")]
    Index { path: PathBuf, reason: String },
    #[error("no weights found in {path} (expected model.safetensors or model.safetensors.index.json)")]
    NoWeights { path: PathBuf },
    #[error("tensor `{tensor}`: {source}")]
    Convert { tensor: String, source: kestrel_quant::QuantError },
    #[error("quantized linear `{tensor}`: {reason}")]
    Quantized { tensor: String, reason: String },
}

/// Where one tensor lives.
#[derive(Clone)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub file: usize,
    pub start: usize,
    pub end: usize,
}

/// Where one integer (I32) tensor lives: the packed values and zero points of int4 checkpoints.
#[derive(Clone)]
pub struct IntEntry {
    pub shape: Vec<usize>,
    pub file: usize,
    pub start: usize,
    pub end: usize,
}

/// An I32 tensor's little-endian bytes, borrowed from the store.
pub struct IntView<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub path: &'a std::path::Path,
}

impl IntView<'_> {
    pub fn expect_shape(&self, want: &[usize]) -> Result<&Self, WeightError> {
        if self.shape != want {
            return Err(WeightError::Shape { path: self.path.to_path_buf(), tensor: self.name.to_string(), got: self.shape.to_vec(), want: want.to_vec() });
        }
        Ok(self)
    }
}

/// A tensor's bytes, borrowed from the store.
#[derive(Clone)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub path: &'a std::path::Path,
    source: &'a SharedBytes,
    start: usize,
}

impl TensorView<'_> {
    /// This tensor as a `[rows, cols]` matrix (the shape must hold exactly rows*cols elements,
    /// e.g. `[E, R, C]` viewed as `[E*R, C]`).
    pub fn matrix(&self, rows: usize, cols: usize) -> Result<MatrixBytes, WeightError> {
        // FP8 weights mean nothing without their block scales, which only a linear's loader
        // (WeightStore::linear) applies.
        if self.dtype == Dtype::F8E4M3 {
            return Err(WeightError::Quantized { tensor: self.name.to_string(), reason: "an F8_E4M3 tensor can only be read as a linear weight with its `weight_scale_inv`".into() });
        }
        if self.numel() != rows * cols || self.shape.last().copied().unwrap_or(0) != cols {
            return Err(WeightError::Shape { path: self.path.to_path_buf(), tensor: self.name.to_string(), got: self.shape.to_vec(), want: vec![rows, cols] });
        }
        Ok(MatrixBytes { data: self.source.clone(), start: self.start, dtype: self.dtype, rows, cols })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        if self.dtype == Dtype::F8E4M3 {
            return Err(WeightError::Quantized { tensor: self.name.to_string(), reason: "an F8_E4M3 tensor can only be read as a linear weight with its `weight_scale_inv`".into() });
        }
        kestrel_quant::dequantize(self.dtype, self.bytes).map_err(|source| WeightError::Convert { tensor: self.name.to_string(), source })
    }

    /// Checks the shape against what the model expects.
    pub fn expect_shape(&self, want: &[usize]) -> Result<&Self, WeightError> {
        if self.shape != want {
            return Err(WeightError::Shape { path: self.path.to_path_buf(), tensor: self.name.to_string(), got: self.shape.to_vec(), want: want.to_vec() });
        }
        Ok(self)
    }
}

/// All tensors of one model, across its files.
pub struct WeightStore {
    files: Vec<(PathBuf, SharedBytes)>,
    tensors: HashMap<String, TensorEntry>,
    /// Integer tensors, kept apart from the weights: only quantized linears read them.
    ints: HashMap<String, IntEntry>,
    /// Prefix of the text-model tensors: `model.` or `model.language_model.`.
    text_prefix: String,
    description: String,
}

impl WeightStore {
    pub(crate) fn new(files: Vec<(PathBuf, SharedBytes)>, tensors: HashMap<String, TensorEntry>, description: String) -> Self {
        Self::with_ints(files, tensors, HashMap::new(), description)
    }

    pub(crate) fn with_ints(files: Vec<(PathBuf, SharedBytes)>, tensors: HashMap<String, TensorEntry>, ints: HashMap<String, IntEntry>, description: String) -> Self {
        let text_prefix = if tensors.keys().chain(ints.keys()).any(|k| k.starts_with("model.language_model.")) { "model.language_model." } else { "model." };
        WeightStore { files, tensors, ints, text_prefix: text_prefix.to_string(), description }
    }

    /// An I32 tensor by its full stored name.
    pub fn int32(&self, name: &str) -> Result<IntView<'_>, WeightError> {
        let (key, entry) = self.ints.get_key_value(name).ok_or_else(|| WeightError::Missing { tensor: name.to_string(), source_desc: self.description.clone() })?;
        let (path, bytes) = &self.files[entry.file];
        Ok(IntView { name: key, shape: &entry.shape, bytes: &bytes.as_slice()[entry.start..entry.end], path })
    }

    /// The full stored name of a text-model tensor (`layers.0.mlp.down_proj.weight`).
    pub fn text_name(&self, name: &str) -> String {
        format!("{}{}", self.text_prefix, name)
    }

    pub fn len(&self) -> usize {
        self.tensors.len() + self.ints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Names of every stored tensor, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Names of every stored integer tensor (quantized linears' packed weights, zero points and
    /// group indices), sorted.
    pub fn int_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.ints.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor by its full stored name.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>, WeightError> {
        let (key, entry) = self.tensors.get_key_value(name).ok_or_else(|| WeightError::Missing { tensor: name.to_string(), source_desc: self.description.clone() })?;
        let (path, bytes) = &self.files[entry.file];
        Ok(TensorView { name: key, dtype: entry.dtype, shape: &entry.shape, bytes: &bytes.as_slice()[entry.start..entry.end], path, source: bytes, start: entry.start })
    }

    /// A text-model tensor, e.g. `layers.0.input_layernorm.weight`, under whichever prefix this
    /// checkpoint uses.
    pub fn text(&self, name: &str) -> Result<TensorView<'_>, WeightError> {
        self.get(&self.text_name(name))
    }

    pub fn has_text(&self, name: &str) -> bool {
        self.contains(&self.text_name(name))
    }

    /// Device bytes of all tensors as the GPU backend keeps them (the memory planner's figure):
    /// quantized linears as tiles in their own bits (backend/cuda/quant_tiles.rs; after
    /// `online` quantization where it applies), bf16 as is, F32/F16 matrices as a bf16 value and
    /// remainder pair (4 bytes), quantized types without tiles as bf16, vectors as f32.
    pub fn device_bytes(&self, online: Option<(online::OnlineQuantization, usize)>) -> usize {
        self.device_bytes_per_tensor(online).values().sum()
    }

    /// [`Self::device_bytes`] per tensor, by stored name; a GPTQ module's packed weights count
    /// under `MODULE.weight`, the name of the matrix they stand for.
    pub fn device_bytes_per_tensor(&self, online: Option<(online::OnlineQuantization, usize)>) -> HashMap<String, usize> {
        use crate::backend::cuda::quant_tiles::{RowOrder, TileFormat};
        let matrix = |dtype: Dtype, rows: usize, cols: usize| -> usize {
            match TileFormat::of(dtype).filter(|f| f.fits(cols)) {
                Some(f) => f.matrix_bytes(RowOrder::Plain, rows, cols),
                None if matches!(dtype, Dtype::F32 | Dtype::F16) => 4 * rows * cols,
                None => 2 * rows * cols,
            }
        };
        let mut total = HashMap::new();
        for (name, e) in &self.tensors {
            let elems = e.shape.iter().product::<usize>();
            let cols = e.shape.last().copied().unwrap_or(1).max(1);
            if e.shape.len() < 2 || name.ends_with("conv1d.weight") {
                total.insert(name.clone(), 4 * elems);
                continue;
            }
            if name.ends_with(".weight_scale_inv") {
                // Folded into the FP8 weight's tiles.
                continue;
            }
            let dtype = match e.dtype {
                // Block FP8 goes up in rows of its scale blocks (quantized.rs).
                Dtype::F8E4M3 => Dtype::F8E4M3Scaled { block: if cols % 128 == 0 { 128 } else { 32 } },
                d if !d.is_quantized() => online.and_then(|(q, layers)| q.target(name, cols, layers)).unwrap_or(d),
                d => d,
            };
            total.insert(name.clone(), matrix(dtype, elems / cols, cols));
        }
        for (name, e) in &self.ints {
            let Some(module) = name.strip_suffix(".qweight") else { continue };
            // GPTQ qweight [K/8, N]; AWQ [K, N/8]: either way 8 values per stored I32.
            let values = 8 * e.shape.iter().product::<usize>();
            let groups = self.tensors.get(&format!("{module}.scales")).and_then(|s| s.shape.first().copied()).unwrap_or(1).max(1);
            let n = self.tensors.get(&format!("{module}.scales")).and_then(|s| s.shape.get(1).copied()).unwrap_or(1).max(1);
            let k = values / n;
            total.insert(format!("{module}.weight"), matrix(Dtype::Int4 { group: (k / groups).max(2) as u32 }, n, k));
        }
        total
    }

    /// Weights of all matrices (the parameters a forward multiplies; vectors left out).
    pub fn matrix_parameters(&self) -> usize {
        let dense: usize = self.tensors.iter().filter(|(n, e)| e.shape.len() >= 2 && !n.ends_with(".weight_scale_inv") && !n.ends_with("conv1d.weight")).map(|(_, e)| e.shape.iter().product::<usize>()).sum();
        let int4: usize = self.ints.iter().filter(|(n, _)| n.ends_with(".qweight")).map(|(_, e)| 8 * e.shape.iter().product::<usize>()).sum();
        dense + int4
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.end - e.start).chain(self.ints.values().map(|e| e.end - e.start)).sum()
    }
}
