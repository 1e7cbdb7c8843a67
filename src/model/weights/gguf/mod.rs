//! GGUF files (llama.cpp's single-file checkpoints), read in place from a memory map.
//!
//! [`GgufFile::parse`] decodes the header, the metadata and the tensor table and validates every
//! tensor's byte range once; afterwards [`GgufFile::tensor`] hands out `&[u8]` slices of the map,
//! so tensor data is never copied or even touched until a backend reads it.
//!
//! Layout (little-endian, versions 2 and 3): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` metadata count, the metadata key/value pairs, the tensor infos, zero padding up to the
//! alignment, then the data section. Each tensor lives at `data_offset + offset`.
//!
//! Tensor types stay raw `u32` ids. A type missing from [`ggml_type_info`] does not stop the
//! file from opening (a checkpoint that mixes in a newer quant type should still list its
//! tensors); since its byte size is unknown its range is not checked and
//! [`GgufFile::tensor_bytes`] reports [`GgufError::UnknownGgmlType`] when it is used.
//! The layout llama.cpp insists on (tensors packed back to back in table order) is not
//! required here: every range is checked on its own, and overlaps are harmless for a
//! read-only map.

mod parse;
mod types;
mod value;
mod writer;

pub use types::{ggml_type_info, ggml_types, GgmlTypeInfo};
pub use value::{GgufArray, GgufValue, GgufValueType};
#[doc(hidden)]
pub use writer::GgufWriter;

use super::{Dtype, SharedBytes};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The first four bytes of every GGUF file (`GGUF`) read as a little-endian `u32`.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u32 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// Longest tensor name accepted (ggml's `GGML_MAX_NAME`).
pub const MAX_NAME_BYTES: usize = 64;
/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays are legal but nothing real nests deeper than two levels; the cap keeps a
/// corrupt file from recursing the parser off the stack.
const MAX_ARRAY_DEPTH: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {}: {source}", path.display())]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{} is not a GGUF file (starts with {found:02x?}, expected \"GGUF\")", path.display())]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{} is a big-endian GGUF file; only little-endian files are supported", path.display())]
    BigEndian { path: PathBuf },
    #[error("{}: unsupported GGUF version {version} (supported: 2 and 3)", path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{} is truncated in {part}: needs {needed} bytes at offset {offset} but the file is {len} bytes", path.display())]
    Truncated { path: PathBuf, part: String, offset: usize, needed: u64, len: usize },
    #[error("{}: {part} is not valid UTF-8", path.display())]
    BadString { path: PathBuf, part: String },
    #[error("{}: {part} has unknown value type {value_type}", path.display())]
    UnknownValueType { path: PathBuf, part: String, value_type: u32 },
    #[error("{}: {part}: {reason}", path.display())]
    BadValue { path: PathBuf, part: String, reason: String },
    #[error("{}: metadata key `{key}` appears twice", path.display())]
    DuplicateKey { path: PathBuf, key: String },
    #[error("{}: missing metadata key `{key}`", path.display())]
    MissingKey { path: PathBuf, key: String },
    #[error("{}: metadata `{key}`: {reason}", path.display())]
    Metadata { path: PathBuf, key: String, reason: String },
    #[error("{}: bad {ALIGNMENT_KEY}: {reason}", path.display())]
    BadAlignment { path: PathBuf, reason: String },
    #[error("{}: tensor #{index} has a bad name: {reason}", path.display())]
    BadTensorName { path: PathBuf, index: u64, reason: String },
    #[error("{}: tensor `{tensor}` appears twice", path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },
    #[error("{}: tensor `{tensor}` has bad dimensions: {reason}", path.display())]
    BadDims { path: PathBuf, tensor: String, reason: String },
    #[error("{}: tensor `{tensor}`: {what} overflows", path.display())]
    SizeOverflow { path: PathBuf, tensor: String, what: &'static str },
    #[error("{}: tensor `{tensor}` starts at data offset {offset}, not a multiple of the alignment {alignment}", path.display())]
    MisalignedTensor { path: PathBuf, tensor: String, offset: u64, alignment: u32 },
    #[error("{}: tensor `{tensor}` spans bytes {start}..{end} but the file is {len} bytes", path.display())]
    TensorOutOfBounds { path: PathBuf, tensor: String, start: usize, end: usize, len: usize },
    #[error("{}: tensor `{tensor}` has unknown ggml type {ggml_type}", path.display())]
    UnknownGgmlType { path: PathBuf, tensor: String, ggml_type: u32 },
    #[error("missing tensor `{tensor}` in {}", path.display())]
    MissingTensor { path: PathBuf, tensor: String },
}

/// Turns a missing key into `None`, for metadata that is optional:
/// `file.get_u32("qwen35.expert_count").optional()?`.
pub trait OptionalKey<T> {
    fn optional(self) -> Result<Option<T>, GgufError>;
}

impl<T> OptionalKey<T> for Result<T, GgufError> {
    fn optional(self) -> Result<Option<T>, GgufError> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(GgufError::MissingKey { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    name: String,
    dims: Vec<u64>,
    shape: Vec<usize>,
    ggml_type: u32,
    offset: u64,
    n_elements: u64,
    start: usize,
    /// `None` when the ggml type is unknown, so the size cannot be computed.
    n_bytes: Option<usize>,
}

impl GgufTensor {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions as stored: `ne[0]` is the innermost (contiguous) one.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// Row-major shape, outermost first (`[.., ne[1], ne[0]]`): an HF `[N, K]` weight reads
    /// back as `[N, K]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn ggml_type(&self) -> u32 {
        self.ggml_type
    }

    pub fn type_info(&self) -> Option<GgmlTypeInfo> {
        ggml_type_info(self.ggml_type)
    }

    /// The ggml type's name, or `type <id>` for an unknown one.
    pub fn type_name(&self) -> String {
        self.type_info().map_or_else(|| format!("type {}", self.ggml_type), |t| t.name.to_string())
    }

    /// The storage dtype when `kestrel_quant` supports the ggml type.
    pub fn dtype(&self) -> Option<Dtype> {
        Dtype::from_ggml_type(self.ggml_type)
    }

    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Offset from the start of the data section, as stored.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Size in bytes; `None` for an unknown ggml type.
    pub fn n_bytes(&self) -> Option<usize> {
        self.n_bytes
    }

    /// Absolute byte range in the file; `None` for an unknown ggml type.
    pub fn byte_range(&self) -> Option<Range<usize>> {
        self.n_bytes.map(|n| self.start..self.start + n)
    }
}

// ---------------------------------------------------------------------------------------------
// The file

/// A parsed GGUF file over its (memory-mapped) bytes.
pub struct GgufFile {
    path: PathBuf,
    bytes: SharedBytes,
    version: u32,
    alignment: u32,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensor>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps `path` and parses it.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|source| GgufError::Open { path: path.into(), source })?;
        // SAFETY: the map is read-only; a file modified while mapped is the user's error (as
        // with every mmap-based loader), not memory unsafety in our code paths.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| GgufError::Open { path: path.into(), source })?;
        GgufFile::parse(SharedBytes::from_mmap(map), path)
    }

    /// Parses a whole GGUF file held in `bytes`; `path` only names it in errors.
    pub fn parse(bytes: SharedBytes, path: impl Into<PathBuf>) -> Result<GgufFile, GgufError> {
        let path = path.into();
        let header = parse::parse_header(bytes.as_slice(), &path)?;
        Ok(GgufFile {
            path,
            bytes,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata: header.metadata,
            key_index: header.key_index,
            tensors: header.tensors,
            tensor_index: header.tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The whole file, for handing tensor ranges to code that keeps its own reference.
    pub fn shared_bytes(&self) -> &SharedBytes {
        &self.bytes
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.key_index.contains_key(key)
    }

    /// The value under `key` converted by `convert`, which names what it wanted in `want`.
    fn typed<'a, T>(&'a self, key: &str, want: &str, convert: impl FnOnce(&'a GgufValue) -> Option<T>) -> Result<T, GgufError> {
        let value = self.get(key).ok_or_else(|| GgufError::MissingKey { path: self.path.clone(), key: key.to_string() })?;
        convert(value).ok_or_else(|| GgufError::Metadata { path: self.path.clone(), key: key.to_string(), reason: format!("expected {want}, found {}", value.describe()) })
    }

    /// Any integer type whose value fits: writers disagree on u32/u64/i32 for counts.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "an integer in u32 range", |v| v.as_integer().and_then(|x| u32::try_from(x).ok()))
    }

    /// Any integer type whose value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "an integer in u64 range", |v| v.as_integer().and_then(|x| u64::try_from(x).ok()))
    }

    /// Any integer type whose value fits.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.typed(key, "an integer in i64 range", |v| v.as_integer().and_then(|x| i64::try_from(x).ok()))
    }

    /// An f32, or an f64 narrowed to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "a float", |v| match *v {
            GgufValue::F32(x) => Some(x),
            GgufValue::F64(x) => Some(x as f32),
            _ => None,
        })
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "a bool", |v| match *v {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray, GgufError> {
        self.typed(key, "an array", GgufValue::as_array)
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        self.typed(key, "an array of string", |v| match v {
            GgufValue::Array(GgufArray::String(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        self.typed(key, "an array of f32", |v| match v {
            GgufValue::Array(GgufArray::F32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// Exactly an i32 array, borrowed.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        self.typed(key, "an array of i32", |v| match v {
            GgufValue::Array(GgufArray::I32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// Exactly a u32 array, borrowed.
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32], GgufError> {
        self.typed(key, "an array of u32", |v| match v {
            GgufValue::Array(GgufArray::U32(s)) => Some(s.as_slice()),
            _ => None,
        })
    }

    /// An array of any integer type whose values all fit in i64 (e.g. `rope.dimension_sections`,
    /// which writers store as i32 or u32).
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        self.typed(key, "an array of integers in i64 range", |v| {
            v.as_array()?.to_integers()?.into_iter().map(|x| i64::try_from(x).ok()).collect()
        })
    }

    /// `general.architecture`, which every GGUF file must have.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str(ARCHITECTURE_KEY)
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &GgufTensor> {
        self.tensors.iter()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensor> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's info and its bytes, borrowed from the map.
    pub fn tensor(&self, name: &str) -> Result<(&GgufTensor, &[u8]), GgufError> {
        let info = self.tensor_info(name).ok_or_else(|| GgufError::MissingTensor { path: self.path.clone(), tensor: name.to_string() })?;
        Ok((info, self.tensor_bytes(info)?))
    }

    /// The bytes of a tensor of this file.
    pub fn tensor_bytes(&self, tensor: &GgufTensor) -> Result<&[u8], GgufError> {
        let range = tensor.byte_range().ok_or_else(|| GgufError::UnknownGgmlType { path: self.path.clone(), tensor: tensor.name.clone(), ggml_type: tensor.ggml_type })?;
        let len = self.bytes.as_slice().len();
        // Ranges were checked at parse time; `get` only guards against a tensor of another file.
        self.bytes.as_slice().get(range.clone()).ok_or_else(|| GgufError::TensorOutOfBounds { path: self.path.clone(), tensor: tensor.name.clone(), start: range.start, end: range.end, len })
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod gguf_py_tests;
