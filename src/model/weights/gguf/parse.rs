//! Decoding the header, the metadata and the tensor table, with every range checked.

use super::{ggml_type_info, GgufArray, GgufError, GgufTensor, GgufValue, GgufValueType, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_NAME_BYTES};
use std::collections::HashMap;
use std::path::Path;

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

pub(super) struct Header {
    pub version: u32,
    pub alignment: u32,
    pub data_offset: usize,
    pub metadata: Vec<(String, GgufValue)>,
    pub key_index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensor>,
    pub tensor_index: HashMap<String, usize>,
}

/// A tensor info as read, before its size and range are worked out.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    offset: u64,
}

pub(super) fn parse_header(buf: &[u8], path: &Path) -> Result<Header, GgufError> {
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
