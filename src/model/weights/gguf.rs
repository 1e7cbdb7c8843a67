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
// ggml tensor types

/// Block geometry of one ggml tensor type: `block_elems` values take `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlTypeInfo {
    pub id: u32,
    pub name: &'static str,
    pub block_elems: u64,
    pub block_bytes: u64,
}

/// Every type id ggml writes into files, with sizes from ggml's `static_assert`s. Ids 4/5
/// (Q4_2/Q4_3) and 31-33/36-38 (repacked in-memory layouts) were removed upstream and are
/// unknown here. Q8_1 and Q8_K are activation formats that files do not normally hold; they
/// are listed so such a file still opens (gguf-py 0.19.0 says 40 bytes for Q8_1, a leftover
/// from its f32 scales; ggml's block is two f16 and 32 bytes).
const GGML_TYPES: &[GgmlTypeInfo] = &[
    ty(0, "F32", 1, 4),
    ty(1, "F16", 1, 2),
    ty(2, "Q4_0", 32, 18),
    ty(3, "Q4_1", 32, 20),
    ty(6, "Q5_0", 32, 22),
    ty(7, "Q5_1", 32, 24),
    ty(8, "Q8_0", 32, 34),
    ty(9, "Q8_1", 32, 36),
    ty(10, "Q2_K", 256, 84),
    ty(11, "Q3_K", 256, 110),
    ty(12, "Q4_K", 256, 144),
    ty(13, "Q5_K", 256, 176),
    ty(14, "Q6_K", 256, 210),
    ty(15, "Q8_K", 256, 292),
    ty(16, "IQ2_XXS", 256, 66),
    ty(17, "IQ2_XS", 256, 74),
    ty(18, "IQ3_XXS", 256, 98),
    ty(19, "IQ1_S", 256, 50),
    ty(20, "IQ4_NL", 32, 18),
    ty(21, "IQ3_S", 256, 110),
    ty(22, "IQ2_S", 256, 82),
    ty(23, "IQ4_XS", 256, 136),
    ty(24, "I8", 1, 1),
    ty(25, "I16", 1, 2),
    ty(26, "I32", 1, 4),
    ty(27, "I64", 1, 8),
    ty(28, "F64", 1, 8),
    ty(29, "IQ1_M", 256, 56),
    ty(30, "BF16", 1, 2),
    ty(34, "TQ1_0", 256, 54),
    ty(35, "TQ2_0", 256, 66),
    ty(39, "MXFP4", 32, 17),
    ty(40, "NVFP4", 64, 36),
    ty(41, "Q1_0", 128, 18),
];

const fn ty(id: u32, name: &'static str, block_elems: u64, block_bytes: u64) -> GgmlTypeInfo {
    GgmlTypeInfo { id, name, block_elems, block_bytes }
}

/// Geometry of a ggml type id, or `None` for an id this reader does not know.
pub fn ggml_type_info(id: u32) -> Option<GgmlTypeInfo> {
    GGML_TYPES.iter().find(|t| t.id == id).copied()
}

/// All known ggml types, by id.
pub fn ggml_types() -> &'static [GgmlTypeInfo] {
    GGML_TYPES
}

// ---------------------------------------------------------------------------------------------
// Metadata values

/// A metadata value type id as stored in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    pub fn from_u32(id: u32) -> Option<Self> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, kept as one typed vector (a 250K-entry vocabulary is one `Vec<String>`,
/// not 250K enum values). Arrays of arrays hold each inner array with its own element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// Any integer value, signed or not, as `i128` (wide enough for both `u64` and `i64`).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Type and value in a few words, for error messages.
    pub fn describe(&self) -> String {
        match self {
            GgufValue::String(s) => {
                let head: String = s.chars().take(32).collect();
                let more = if head.len() < s.len() { "…" } else { "" };
                format!("string {head:?}{more}")
            }
            GgufValue::Array(a) => format!("array of {} {}", a.len(), a.elem_type()),
            GgufValue::F32(v) => format!("f32 {v}"),
            GgufValue::F64(v) => format!("f64 {v}"),
            GgufValue::Bool(v) => format!("bool {v}"),
            other => match other.as_integer() {
                Some(v) => format!("{} {v}", other.value_type()),
                None => other.value_type().to_string(),
            },
        }
    }
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F64(_) => GgufValueType::F64,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements of any integer array widened to `i128`; `None` for other element types.
    pub fn to_integers(&self) -> Option<Vec<i128>> {
        fn widen<T: Copy + Into<i128>>(v: &[T]) -> Vec<i128> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            GgufArray::U8(v) => widen(v),
            GgufArray::I8(v) => widen(v),
            GgufArray::U16(v) => widen(v),
            GgufArray::I16(v) => widen(v),
            GgufArray::U32(v) => widen(v),
            GgufArray::I32(v) => widen(v),
            GgufArray::U64(v) => widen(v),
            GgufArray::I64(v) => widen(v),
            _ => return None,
        })
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for GgufValue {
            fn from(v: $t) -> Self { GgufValue::$variant(v) }
        }
        impl From<Vec<$t>> for GgufArray {
            fn from(v: Vec<$t>) -> Self { GgufArray::$variant(v) }
        }
        impl From<Vec<$t>> for GgufValue {
            fn from(v: Vec<$t>) -> Self { GgufValue::Array(GgufArray::$variant(v)) }
        }
    )*};
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for GgufValue {
    fn from(v: &str) -> Self {
        GgufValue::String(v.to_string())
    }
}

impl From<Vec<&str>> for GgufValue {
    fn from(v: Vec<&str>) -> Self {
        GgufValue::Array(GgufArray::String(v.into_iter().map(str::to_string).collect()))
    }
}

impl From<GgufArray> for GgufValue {
    fn from(v: GgufArray) -> Self {
        GgufValue::Array(v)
    }
}

impl From<Vec<GgufArray>> for GgufValue {
    fn from(v: Vec<GgufArray>) -> Self {
        GgufValue::Array(GgufArray::Array(v))
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
        let header = parse_header(bytes.as_slice(), &path)?;
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

// ---------------------------------------------------------------------------------------------
// Parsing

/// A low-level read failure, before the caller says which part of the file it was reading.
#[derive(Debug)]
enum Fault {
    Truncated { offset: usize, needed: u64 },
    BadUtf8,
    UnknownValueType(u32),
    BadBool(u8),
    TooDeep,
}

impl Fault {
    fn at(self, path: &Path, len: usize, part: impl FnOnce() -> String) -> GgufError {
        let path = path.to_path_buf();
        match self {
            Fault::Truncated { offset, needed } => GgufError::Truncated { path, part: part(), offset, needed, len },
            Fault::BadUtf8 => GgufError::BadString { path, part: part() },
            Fault::UnknownValueType(value_type) => GgufError::UnknownValueType { path, part: part(), value_type },
            Fault::BadBool(b) => GgufError::BadValue { path, part: part(), reason: format!("bool byte is {b}, not 0 or 1") },
            Fault::TooDeep => GgufError::BadValue { path, part: part(), reason: format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels") },
        }
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], Fault> {
        let short = Fault::Truncated { offset: self.pos, needed: n };
        let end = usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).ok_or(short)?;
        let bytes = self.buf.get(self.pos..end).ok_or(Fault::Truncated { offset: self.pos, needed: n })?;
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Fault> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, Fault> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, Fault> {
        self.array().map(u64::from_le_bytes)
    }

    fn str(&mut self) -> Result<&'a str, Fault> {
        let len = self.u64()?;
        std::str::from_utf8(self.take(len)?).map_err(|_| Fault::BadUtf8)
    }

    fn bool(&mut self) -> Result<bool, Fault> {
        decode_bool(self.array::<1>()?[0])
    }

    fn value(&mut self, value_type: u32) -> Result<GgufValue, Fault> {
        let ty = GgufValueType::from_u32(value_type).ok_or(Fault::UnknownValueType(value_type))?;
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array()?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool()?),
            GgufValueType::String => GgufValue::String(self.str()?.to_string()),
            GgufValueType::Array => GgufValue::Array(self.gguf_array(0)?),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array()?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
        })
    }

    /// `count` fixed-size elements, bounds-checked once and decoded in one pass.
    fn fixed<const N: usize, T>(&mut self, count: u64, decode: impl Fn([u8; N]) -> T) -> Result<Vec<T>, Fault> {
        let needed = count.checked_mul(N as u64).ok_or(Fault::Truncated { offset: self.pos, needed: u64::MAX })?;
        let (chunks, _) = self.take(needed)?.as_chunks::<N>();
        Ok(chunks.iter().map(|c| decode(*c)).collect())
    }

    /// Room for `count` elements of at least `min_bytes` each, capped by what the file can
    /// still hold, so a corrupt count cannot make us allocate gigabytes up front.
    fn capacity(&self, count: u64, min_bytes: usize) -> usize {
        usize::try_from(count).unwrap_or(usize::MAX).min(self.remaining() / min_bytes)
    }

    /// The element type, count and elements of an array value.
    fn gguf_array(&mut self, depth: usize) -> Result<GgufArray, Fault> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(Fault::TooDeep);
        }
        let elem_type = self.u32()?;
        let ty = GgufValueType::from_u32(elem_type).ok_or(Fault::UnknownValueType(elem_type))?;
        let count = self.u64()?;
        Ok(match ty {
            GgufValueType::U8 => GgufArray::U8(self.fixed(count, u8::from_le_bytes)?),
            GgufValueType::I8 => GgufArray::I8(self.fixed(count, i8::from_le_bytes)?),
            GgufValueType::U16 => GgufArray::U16(self.fixed(count, u16::from_le_bytes)?),
            GgufValueType::I16 => GgufArray::I16(self.fixed(count, i16::from_le_bytes)?),
            GgufValueType::U32 => GgufArray::U32(self.fixed(count, u32::from_le_bytes)?),
            GgufValueType::I32 => GgufArray::I32(self.fixed(count, i32::from_le_bytes)?),
            GgufValueType::F32 => GgufArray::F32(self.fixed(count, f32::from_le_bytes)?),
            GgufValueType::U64 => GgufArray::U64(self.fixed(count, u64::from_le_bytes)?),
            GgufValueType::I64 => GgufArray::I64(self.fixed(count, i64::from_le_bytes)?),
            GgufValueType::F64 => GgufArray::F64(self.fixed(count, f64::from_le_bytes)?),
            GgufValueType::Bool => GgufArray::Bool(self.fixed(count, |[b]: [u8; 1]| b)?.into_iter().map(decode_bool).collect::<Result<_, _>>()?),
            GgufValueType::String => {
                let mut v = Vec::with_capacity(self.capacity(count, 8));
                for _ in 0..count {
                    v.push(self.str()?.to_string());
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(self.capacity(count, 12));
                for _ in 0..count {
                    v.push(self.gguf_array(depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

fn decode_bool(b: u8) -> Result<bool, Fault> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Fault::BadBool(other)),
    }
}

struct Header {
    version: u32,
    alignment: u32,
    data_offset: usize,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensor>,
    tensor_index: HashMap<String, usize>,
}

/// A tensor info as read, before its size and range are worked out.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

fn parse_header(buf: &[u8], path: &Path) -> Result<Header, GgufError> {
    let len = buf.len();
    let mut cur = Cursor { buf, pos: 0 };

    let magic: [u8; 4] = cur.array().map_err(|f| f.at(path, len, || "the magic".into()))?;
    if u32::from_le_bytes(magic) != GGUF_MAGIC {
        // A writer that stored the magic as a native big-endian u32 produces "FUGG".
        if u32::from_be_bytes(magic) == GGUF_MAGIC {
            return Err(GgufError::BigEndian { path: path.into() });
        }
        return Err(GgufError::BadMagic { path: path.into(), found: magic.to_vec() });
    }
    let version = cur.u32().map_err(|f| f.at(path, len, || "the version".into()))?;
    // Big-endian files keep the magic bytes but byte-swap the version: 3 reads as 0x03000000.
    // No real version has its low 16 bits clear, which is how gguf-py tells them apart too.
    if version != 0 && version & 0xFFFF == 0 {
        return Err(GgufError::BigEndian { path: path.into() });
    }
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { path: path.into(), version });
    }
    let tensor_count = cur.u64().map_err(|f| f.at(path, len, || "the tensor count".into()))?;
    let kv_count = cur.u64().map_err(|f| f.at(path, len, || "the metadata count".into()))?;

    // The smallest key/value is an empty key (8) plus a type (4) plus a one-byte value.
    let mut metadata = Vec::with_capacity(cur.capacity(kv_count, 13));
    let mut key_index = HashMap::with_capacity(metadata.capacity());
    for i in 0..kv_count {
        let key = cur.str().map_err(|f| f.at(path, len, || format!("metadata key #{i}")))?;
        let value_type = cur.u32().map_err(|f| f.at(path, len, || format!("the type of metadata `{key}`")))?;
        let value = cur.value(value_type).map_err(|f| f.at(path, len, || format!("metadata `{key}`")))?;
        if key_index.insert(key.to_string(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { path: path.into(), key: key.to_string() });
        }
        metadata.push((key.to_string(), value));
    }
    let alignment = alignment_of(metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY).map(|(_, v)| v), path)?;

    // The smallest tensor info: empty name (8), n_dims (4), one dim (8), type (4), offset (8).
    let mut raw = Vec::with_capacity(cur.capacity(tensor_count, 32));
    for i in 0..tensor_count {
        let name = cur.str().map_err(|f| f.at(path, len, || format!("the name of tensor #{i}")))?;
        if name.len() > MAX_NAME_BYTES {
            return Err(GgufError::BadTensorName { path: path.into(), index: i, reason: format!("{} bytes, more than {MAX_NAME_BYTES}", name.len()) });
        }
        let part = || format!("the info of tensor `{name}`");
        let n_dims = cur.u32().map_err(|f| f.at(path, len, part))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadDims { path: path.into(), tensor: name.into(), reason: format!("{n_dims} dimensions, expected 1 to {MAX_DIMS}") });
        }
        let dims = (0..n_dims).map(|_| cur.u64()).collect::<Result<Vec<u64>, _>>().map_err(|f| f.at(path, len, part))?;
        let ggml_type = cur.u32().map_err(|f| f.at(path, len, part))?;
        let offset = cur.u64().map_err(|f| f.at(path, len, part))?;
        raw.push(RawTensor { name: name.to_string(), dims, ggml_type, offset });
    }

    // Only reachable with a header within `alignment` bytes of usize::MAX, but checked anyway.
    let data_offset = cur.pos.checked_next_multiple_of(alignment as usize).ok_or_else(|| GgufError::SizeOverflow { path: path.into(), tensor: "(none: the header)".into(), what: "the data section offset" })?;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut tensor_index = HashMap::with_capacity(raw.len());
    for t in raw {
        if tensor_index.contains_key(&t.name) {
            return Err(GgufError::DuplicateTensor { path: path.into(), tensor: t.name });
        }
        let tensor = locate_tensor(t, data_offset, alignment, len, path)?;
        tensor_index.insert(tensor.name.clone(), tensors.len());
        tensors.push(tensor);
    }
    Ok(Header { version, alignment, data_offset, metadata, key_index, tensors, tensor_index })
}

fn alignment_of(value: Option<&GgufValue>, path: &Path) -> Result<u32, GgufError> {
    let bad = |reason: String| GgufError::BadAlignment { path: path.into(), reason };
    match value {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(GgufValue::U32(a)) if *a != 0 && a.is_multiple_of(8) => Ok(*a),
        Some(GgufValue::U32(a)) => Err(bad(format!("{a} is not a non-zero multiple of 8"))),
        Some(other) => Err(bad(format!("expected u32, found {}", other.describe()))),
    }
}

/// Checks a tensor info against its type's geometry and the file, and works out its range.
fn locate_tensor(t: RawTensor, data_offset: usize, alignment: u32, len: usize, path: &Path) -> Result<GgufTensor, GgufError> {
    let bad_dims = |reason: String| GgufError::BadDims { path: path.into(), tensor: t.name.clone(), reason };
    let overflow = |what| GgufError::SizeOverflow { path: path.into(), tensor: t.name.clone(), what };

    // ggml keeps dims as i64, so larger values cannot come from a real writer.
    if let Some(d) = t.dims.iter().find(|&&d| d > i64::MAX as u64) {
        return Err(bad_dims(format!("dimension {d} exceeds i64::MAX")));
    }
    let n_elements = t.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(|| overflow("the element count"))?;
    let shape = t.dims.iter().rev().map(|&d| usize::try_from(d)).collect::<Result<Vec<usize>, _>>().map_err(|_| overflow("a dimension"))?;
    if !t.offset.is_multiple_of(u64::from(alignment)) {
        return Err(GgufError::MisalignedTensor { path: path.into(), tensor: t.name, offset: t.offset, alignment });
    }
    let start = usize::try_from(t.offset).ok().and_then(|o| data_offset.checked_add(o)).ok_or_else(|| overflow("the start offset"))?;

    let n_bytes = match ggml_type_info(t.ggml_type) {
        Some(info) => {
            if !t.dims[0].is_multiple_of(info.block_elems) {
                return Err(bad_dims(format!("ne[0] = {} is not a multiple of the {} block size {}", t.dims[0], info.name, info.block_elems)));
            }
            let bytes = (n_elements / info.block_elems).checked_mul(info.block_bytes).ok_or_else(|| overflow("the byte size"))?;
            Some(usize::try_from(bytes).map_err(|_| overflow("the byte size"))?)
        }
        None => None,
    };
    let end = start.checked_add(n_bytes.unwrap_or(0)).ok_or_else(|| overflow("the end offset"))?;
    if end > len {
        return Err(GgufError::TensorOutOfBounds { path: path.into(), tensor: t.name, start, end, len });
    }
    Ok(GgufTensor { name: t.name, dims: t.dims, shape, ggml_type: t.ggml_type, offset: t.offset, n_elements, start, n_bytes })
}

// ---------------------------------------------------------------------------------------------
// Writing (test fixtures)

/// Builds little-endian GGUF v3 files in memory, for tests and fixtures.
///
/// Nothing is validated, so tests can write deliberately broken files: tensors are laid out in
/// the order added, each padded to the alignment (`general.alignment` when it is a non-zero u32
/// in the metadata, else 32), with whatever bytes and dims they are given.
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    version: Option<u32>,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// The version number written to the header (default 3).
    pub fn version(mut self, version: u32) -> Self {
        self.version = Some(version);
        self
    }

    pub fn metadata(mut self, key: &str, value: impl Into<GgufValue>) -> Self {
        self.metadata.push((key.to_string(), value.into()));
        self
    }

    /// A tensor with dims as stored (`ne[0]` innermost), a raw ggml type id and its bytes.
    pub fn tensor(mut self, name: &str, dims: &[u64], ggml_type: u32, data: impl Into<Vec<u8>>) -> Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ggml_type, data.into()));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, GgufValue::U32(a))) if *a != 0 => *a as usize,
            _ => DEFAULT_ALIGNMENT as usize,
        };
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        out.extend_from_slice(&self.version.unwrap_or(3).to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_str(&mut out, key);
            out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, ggml_type, data) in &self.tensors {
            write_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ggml_type.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).next_multiple_of(alignment);
        }
        out.resize(out.len().next_multiple_of(alignment), 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().next_multiple_of(alignment), 0);
        }
        out
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(v) => write_str(out, v),
        GgufValue::Array(a) => write_array(out, a),
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

fn write_array(out: &mut Vec<u8>, array: &GgufArray) {
    out.extend_from_slice(&(array.elem_type() as u32).to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    macro_rules! each_le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match array {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => each_le!(v),
        GgufArray::U16(v) => each_le!(v),
        GgufArray::I16(v) => each_le!(v),
        GgufArray::U32(v) => each_le!(v),
        GgufArray::I32(v) => each_le!(v),
        GgufArray::F32(v) => each_le!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| write_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| write_array(out, a)),
        GgufArray::U64(v) => each_le!(v),
        GgufArray::I64(v) => each_le!(v),
        GgufArray::F64(v) => each_le!(v),
    }
}

#[cfg(test)]
#[path = "gguf_tests.rs"]
mod tests;
