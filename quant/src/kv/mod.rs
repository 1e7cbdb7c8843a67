//! KV cache formats: how the attention cache stores one key or value vector of a head
//! (`head_dim` f32 values) and how attention reads it back.
//!
//! A stored vector is `data_bytes` bytes and `params` 16-bit parameters. A cache keeps them in
//! two planes per layer and per K / V: data `[slot][kv_head][data_bytes]` and parameters
//! `[slot][kv_head][params]`, so every device reads the same layout. Quantizing a vector reads
//! only that vector: a token's cached keys and values never depend on other tokens, the batch or
//! the step that wrote them.
//!
//! - [`KvDtype::F32`]: full precision (the reference).
//! - [`KvDtype::Bf16`]: bf16, round to nearest even (the default).
//! - [`KvDtype::Fp8`]: e4m3 with one bf16 scale per vector (`amax / 448`).
//! - [`KvDtype::Tq3`]: TurboQuant 3-bit for keys and values ([`turbo`]): the vector rotated by a
//!   fixed randomized Hadamard transform ([`hadamard`]), each rotated coordinate of the unit
//!   vector a 3-bit index into the Lloyd-Max codebook of its distribution ([`codebook`]), and
//!   one bf16 norm with the codebook vector's length divided out (norm correction). It reads
//!   back in the rotated space: attention rotates the query and un-rotates its output.
//! - [`KvDtype::Tq3UniformValues`]: vLLM's `turboquant_3bit_nc` recipe for comparison: keys as
//!   in `Tq3`, values unrotated with a uniform 3-bit quantizer per vector ([`uniform`]).

pub mod codebook;
pub mod hadamard;
pub mod turbo;
pub mod uniform;

use codebook::Codebook;
use half::bf16;
use hadamard::RandomizedHadamard;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvFormatError {
    #[error("head dimension {dim} cannot be stored in this KV cache format: it must be {need}")]
    HeadDim { dim: usize, need: &'static str },
}

/// The element type of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    F32,
    #[default]
    Bf16,
    Fp8,
    Tq3,
    /// Keys as [`KvDtype::Tq3`], values unrotated and uniformly quantized (vLLM's recipe).
    Tq3UniformValues,
}

/// How one key or value vector is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VectorFormat {
    F32,
    Bf16,
    /// e4m3 bytes and a bf16 scale.
    E4m3,
    /// Rotated, 3-bit Lloyd-Max codes (8 per 3 bytes) and a bf16 corrected norm.
    Codebook3,
    /// Unrotated, 3-bit uniform codes and f16 scale and minimum.
    Uniform3,
}

impl VectorFormat {
    /// Data bytes of a vector of `dim` elements.
    pub fn data_bytes(self, dim: usize) -> usize {
        match self {
            VectorFormat::F32 => 4 * dim,
            VectorFormat::Bf16 => 2 * dim,
            VectorFormat::E4m3 => dim,
            VectorFormat::Codebook3 | VectorFormat::Uniform3 => 3 * dim / 8,
        }
    }

    /// 16-bit parameters per vector.
    pub fn params(self) -> usize {
        match self {
            VectorFormat::F32 | VectorFormat::Bf16 => 0,
            VectorFormat::E4m3 | VectorFormat::Codebook3 => 1,
            VectorFormat::Uniform3 => 2,
        }
    }

    /// Bytes of one stored vector, parameters included.
    pub fn vector_bytes(self, dim: usize) -> usize {
        self.data_bytes(dim) + 2 * self.params()
    }

    /// Whether the vector reads back in the rotated space.
    pub fn rotated(self) -> bool {
        self == VectorFormat::Codebook3
    }

    /// Refuses a head dimension the format cannot store.
    pub fn check_dim(self, dim: usize) -> Result<(), KvFormatError> {
        match self {
            VectorFormat::Codebook3 if !dim.is_power_of_two() || dim < 8 => Err(KvFormatError::HeadDim { dim, need: "a power of two, at least 8 (the Hadamard rotation)" }),
            VectorFormat::Uniform3 if dim == 0 || !dim.is_multiple_of(8) => Err(KvFormatError::HeadDim { dim, need: "a multiple of 8 (3-bit codes pack 8 to 3 bytes)" }),
            _ if dim == 0 => Err(KvFormatError::HeadDim { dim, need: "at least 1" }),
            _ => Ok(()),
        }
    }
}

impl KvDtype {
    pub const ALL: [KvDtype; 5] = [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Tq3, KvDtype::Tq3UniformValues];

    pub fn key_format(self) -> VectorFormat {
        match self {
            KvDtype::F32 => VectorFormat::F32,
            KvDtype::Bf16 => VectorFormat::Bf16,
            KvDtype::Fp8 => VectorFormat::E4m3,
            KvDtype::Tq3 | KvDtype::Tq3UniformValues => VectorFormat::Codebook3,
        }
    }

    pub fn value_format(self) -> VectorFormat {
        match self {
            KvDtype::Tq3UniformValues => VectorFormat::Uniform3,
            other => other.key_format(),
        }
    }

    /// The name on the command line and in messages.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Tq3 => "tq3",
            KvDtype::Tq3UniformValues => "turboquant_3bit_nc",
        }
    }

    /// Bytes one token takes in one attention layer per kv head: its key and its value.
    pub fn bytes_per_token_head(self, head_dim: usize) -> usize {
        self.key_format().vector_bytes(head_dim) + self.value_format().vector_bytes(head_dim)
    }

    /// Refuses a head dimension the format cannot store.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), KvFormatError> {
        self.key_format().check_dim(head_dim)?;
        self.value_format().check_dim(head_dim)
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The stored form of `x` in one format: its data bytes and 16-bit parameters.
#[derive(Debug, Clone)]
pub struct KvCodec {
    format: VectorFormat,
    dim: usize,
    rotation: Option<RandomizedHadamard>,
    codebook: Option<Codebook>,
}

impl KvCodec {
    pub fn new(format: VectorFormat, dim: usize) -> Result<KvCodec, KvFormatError> {
        format.check_dim(dim)?;
        let (rotation, codebook) = match format {
            VectorFormat::Codebook3 => (Some(RandomizedHadamard::new(dim)?), Some(Codebook::lloyd_max(dim))),
            _ => (None, None),
        };
        Ok(KvCodec { format, dim, rotation, codebook })
    }

    pub fn format(&self) -> VectorFormat {
        self.format
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The rotation a rotated format reads back in.
    pub fn rotation(&self) -> Option<&RandomizedHadamard> {
        self.rotation.as_ref()
    }

    pub fn codebook(&self) -> Option<&Codebook> {
        self.codebook.as_ref()
    }

    /// Stores `x` into `data` (`data_bytes`) and `params` (`params` values).
    pub fn encode(&self, x: &[f32], data: &mut [u8], params: &mut [u16]) {
        assert_eq!(x.len(), self.dim, "a vector of another dimension");
        assert_eq!((data.len(), params.len()), (self.format.data_bytes(self.dim), self.format.params()), "storage of another format");
        match self.format {
            VectorFormat::F32 => {
                for (d, v) in data.chunks_exact_mut(4).zip(x) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            VectorFormat::Bf16 => {
                for (d, v) in data.chunks_exact_mut(2).zip(x) {
                    d.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
            VectorFormat::E4m3 => params[0] = crate::fp8::encode_e4m3_scaled(x, data),
            VectorFormat::Codebook3 => params[0] = turbo::encode(x, self.rotation.as_ref().expect("rotation"), self.codebook.as_ref().expect("codebook"), data),
            VectorFormat::Uniform3 => uniform::encode(x, data, params),
        }
    }

    /// Reads a stored vector back into `out`: in the rotated space for a rotated format
    /// ([`VectorFormat::rotated`]), which attention uses as it is.
    pub fn decode(&self, data: &[u8], params: &[u16], out: &mut [f32]) {
        assert_eq!(out.len(), self.dim, "a vector of another dimension");
        match self.format {
            VectorFormat::F32 => {
                for (o, d) in out.iter_mut().zip(data.chunks_exact(4)) {
                    *o = f32::from_le_bytes([d[0], d[1], d[2], d[3]]);
                }
            }
            VectorFormat::Bf16 => {
                for (o, d) in out.iter_mut().zip(data.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([d[0], d[1]]).to_f32();
                }
            }
            VectorFormat::E4m3 => {
                let scale = bf16::from_bits(params[0]).to_f32();
                for (o, &b) in out.iter_mut().zip(data) {
                    *o = crate::fp8::e4m3_to_f32(b) * scale;
                }
            }
            VectorFormat::Codebook3 => turbo::decode(self.codebook.as_ref().expect("codebook"), data, params[0], out),
            VectorFormat::Uniform3 => uniform::decode(data, params, out),
        }
    }

    /// Reads a stored vector back in the original space.
    pub fn decode_unrotated(&self, data: &[u8], params: &[u16], out: &mut [f32]) {
        self.decode(data, params, out);
        if let Some(r) = &self.rotation {
            r.unrotate(out);
        }
    }
}

/// Packs 3-bit codes, 8 to 3 bytes: code `i` in bits `3i .. 3i + 2` of the little-endian
/// stream. `codes.len()` is a multiple of 8.
pub fn pack3(codes: &[u8], out: &mut [u8]) {
    for (c, o) in codes.chunks_exact(8).zip(out.chunks_exact_mut(3)) {
        let bits = c.iter().enumerate().fold(0u32, |acc, (i, &v)| acc | u32::from(v & 7) << (3 * i));
        o.copy_from_slice(&bits.to_le_bytes()[..3]);
    }
}

/// The codes [`pack3`] packed.
pub fn unpack3(bytes: &[u8], out: &mut [u8]) {
    for (b, o) in bytes.chunks_exact(3).zip(out.chunks_exact_mut(8)) {
        let bits = u32::from_le_bytes([b[0], b[1], b[2], 0]);
        for (i, v) in o.iter_mut().enumerate() {
            *v = (bits >> (3 * i) & 7) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_per_format() {
        // Qwen3.5/3.6 attention heads: 256 dimensions.
        let d = 256;
        assert_eq!(KvDtype::F32.bytes_per_token_head(d), 2048);
        assert_eq!(KvDtype::Bf16.bytes_per_token_head(d), 1024);
        assert_eq!(KvDtype::Fp8.bytes_per_token_head(d), 2 * (256 + 2));
        assert_eq!(KvDtype::Tq3.bytes_per_token_head(d), 2 * (96 + 2));
        assert_eq!(KvDtype::Tq3UniformValues.bytes_per_token_head(d), 96 + 2 + 96 + 4);
        // About 3.06 bits per element for tq3.
        let bits = 8.0 * KvDtype::Tq3.bytes_per_token_head(d) as f64 / (2 * d) as f64;
        assert!((bits - 3.0625).abs() < 1e-9, "{bits} bits per element");
    }

    #[test]
    fn pack3_round_trips_and_keeps_the_stream_order() {
        let codes: Vec<u8> = (0..64).map(|i| (i * 5 % 8) as u8).collect();
        let mut bytes = vec![0u8; 24];
        pack3(&codes, &mut bytes);
        let mut back = vec![0u8; 64];
        unpack3(&bytes, &mut back);
        assert_eq!(back, codes);
        // Code 0 in the lowest bits of byte 0, code 2 straddling bytes 0 and 1.
        let mut one = vec![0u8; 8];
        one[2] = 7;
        let mut b = [0u8; 3];
        pack3(&one, &mut b);
        assert_eq!(b, [0b1100_0000, 0b0000_0001, 0]);
    }

    #[test]
    fn head_dims_each_format_cannot_store_are_refused() {
        assert!(KvDtype::Tq3.check_head_dim(256).is_ok() && KvDtype::Tq3.check_head_dim(64).is_ok());
        for (dtype, dim) in [(KvDtype::Tq3, 96), (KvDtype::Tq3, 4), (KvDtype::Tq3UniformValues, 100), (KvDtype::Bf16, 0)] {
            let err = dtype.check_head_dim(dim).unwrap_err().to_string();
            assert!(err.contains(&format!("head dimension {dim}")), "{err}");
        }
        assert!(KvCodec::new(VectorFormat::Codebook3, 48).is_err());
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8] {
            assert!(dtype.check_head_dim(96).is_ok(), "{dtype}");
        }
    }
}
