//! Writing GGUF files in memory, for tests and fixtures.

use super::{GgufArray, GgufValue, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};

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
