//! Weight formats and their CPU reference conversions.
//!
//! Every format a weight can be stored in is a [`Dtype`]; [`dequantize_into`] turns the raw
//! little-endian bytes of one run of elements into f32. Every format is a *row format*: a row of
//! `cols` elements is a contiguous run of whole blocks ([`Dtype::row_bytes`]), so a matmul can
//! dequantize one weight row at a time.
//!
//! - Element types: F32, F16, BF16 and FP8 E4M3 (one element per "block").
//! - GGUF block types, byte for byte as llama.cpp writes them ([`gguf`]).
//! - KV cache formats (bf16, scaled e4m3, TurboQuant 3-bit): [`kv`].
//! - Two formats of our own for checkpoints whose scales live in separate tensors; the loader
//!   repacks into them: [`Dtype::Int4`] (GPTQ / AWQ / AutoRound, see [`gptq`]) and
//!   [`Dtype::F8E4M3Scaled`] (block- or channel-scaled FP8, see [`fp8`]).

pub mod fp8;
pub mod gguf;
pub mod gptq;
pub mod int4;
pub mod kv;
pub mod quantize;

pub use fp8::{e4m3_to_f32, fp8_block_rows, fp8_scaled_rows};
pub use gptq::{awq_int4_rows, gptq_int4_rows, int4_row_group};
pub use quantize::{e4m3_from_f32, quantize};

use std::fmt;

use half::{bf16, f16};

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{len} bytes is not a whole number of {dtype} blocks")]
    RaggedBytes { dtype: Dtype, len: usize },
    #[error("output holds {have} elements but the input has {want}")]
    OutputSize { have: usize, want: usize },
    #[error("a row of {cols} elements is not a whole number of {dtype} blocks ({} elements each)", dtype.block_elems())]
    PartialBlock { dtype: Dtype, cols: usize },
    #[error("a row of {cols} {dtype} elements does not fit in memory")]
    TooLarge { dtype: Dtype, cols: usize },
    #[error("int4 group size {group} is invalid: it must be even, at least 2 and below 2^32")]
    InvalidGroup { group: usize },
    #[error("FP8 scale block of {block} elements is invalid: it must be at least 1 and below 2^32")]
    InvalidBlock { block: usize },
    #[error("{what} = {value} is not a multiple of {of}")]
    NotMultiple { what: &'static str, value: usize, of: usize },
    #[error("a {rows}x{cols} weight does not fit in memory")]
    ShapeOverflow { rows: usize, cols: usize },
    #[error("`{tensor}` holds {have} bytes, expected {want}")]
    InputLength { tensor: &'static str, have: usize, want: usize },
    #[error("`{tensor}` holds {have} values, expected {want}")]
    ValueCount { tensor: &'static str, have: usize, want: String },
    #[error("int4 scales must be F16 or BF16, not {dtype}")]
    ScalesDtype { dtype: Dtype },
    #[error("scale {value:e} has no exact f16 value (the int4 row format stores f16 scales)")]
    ScaleNotRepresentable { value: f32 },
    #[error("zero point {zero} of output row {row}, group {group} is outside 0..=15")]
    ZeroOutOfRange { zero: u32, row: usize, group: usize },
    #[error("there is no quantizer into {dtype} (Int4, F8_E4M3 blocks, Q8_0, Q5_0, Q4_K and Q6_K have one)")]
    NoQuantizer { dtype: Dtype },
}

/// The storage type of a weight.
///
/// GGUF variants keep llama.cpp's spelling (`Q4_0`, `Q4K`), hence the allowed lint.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    /// float8_e4m3fn: no infinities, NaN = 0x7F / 0xFF, max ±448, subnormals.
    F8E4M3,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
    /// Per `group` elements: f16 scale (LE, may be negative), u8 zero (0..=15), u8 reserved,
    /// then `group / 2` bytes of nibbles (element 2i low, 2i+1 high). Value = scale * (q - zero).
    Int4 { group: u32 },
    /// Per `block` elements: f32 scale (LE), then `block` e4m3 bytes. Value = e4m3 * scale.
    F8E4M3Scaled { block: u32 },
}

/// ggml type ids of the supported GGUF types (ggml.h `enum ggml_type`).
const GGML_TYPES: [(u32, Dtype); 13] = [
    (0, Dtype::F32),
    (1, Dtype::F16),
    (2, Dtype::Q4_0),
    (3, Dtype::Q4_1),
    (6, Dtype::Q5_0),
    (7, Dtype::Q5_1),
    (8, Dtype::Q8_0),
    (12, Dtype::Q4K),
    (13, Dtype::Q5K),
    (14, Dtype::Q6K),
    (20, Dtype::IQ4NL),
    (23, Dtype::IQ4XS),
    (30, Dtype::BF16),
];

impl Dtype {
    /// Elements per block (1 for element types).
    pub fn block_elems(self) -> usize {
        match self {
            Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F8E4M3 => 1,
            Dtype::Q4_0 | Dtype::Q4_1 | Dtype::Q5_0 | Dtype::Q5_1 | Dtype::Q8_0 | Dtype::IQ4NL => 32,
            Dtype::Q4K | Dtype::Q5K | Dtype::Q6K | Dtype::IQ4XS => 256,
            Dtype::Int4 { group } => group as usize,
            Dtype::F8E4M3Scaled { block } => block as usize,
        }
    }

    /// Bytes per block (the element size for element types).
    pub fn block_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F8E4M3 => 1,
            Dtype::Q4_0 | Dtype::IQ4NL => 18,
            Dtype::Q4_1 => 20,
            Dtype::Q5_0 => 22,
            Dtype::Q5_1 => 24,
            Dtype::Q8_0 => 34,
            Dtype::Q4K => 144,
            Dtype::Q5K => 176,
            Dtype::Q6K => 210,
            Dtype::IQ4XS => 136,
            Dtype::Int4 { group } => 4 + group as usize / 2,
            Dtype::F8E4M3Scaled { block } => 4 + block as usize,
        }
    }

    /// Bytes of a row of `cols` elements (any contiguous run of whole blocks).
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        self.check()?;
        if !cols.is_multiple_of(self.block_elems()) {
            return Err(QuantError::PartialBlock { dtype: self, cols });
        }
        (cols / self.block_elems()).checked_mul(self.block_bytes()).ok_or(QuantError::TooLarge { dtype: self, cols })
    }

    /// False for the plain float types (F32, F16, BF16).
    pub fn is_quantized(self) -> bool {
        !matches!(self, Dtype::F32 | Dtype::F16 | Dtype::BF16)
    }

    /// The dtype of a GGUF tensor's ggml type id, if supported.
    pub fn from_ggml_type(id: u32) -> Option<Dtype> {
        GGML_TYPES.iter().find(|(i, _)| *i == id).map(|(_, d)| *d)
    }

    /// The ggml type id, for dtypes GGUF has.
    pub fn ggml_type(self) -> Option<u32> {
        GGML_TYPES.iter().find(|(_, d)| *d == self).map(|(i, _)| *i)
    }

    /// GGUF / safetensors spelling where one exists ("Q4_K", "F8_E4M3"), else ours ("int4/g128").
    pub fn name(self) -> String {
        let fixed = match self {
            Dtype::Int4 { group } => return format!("int4/g{group}"),
            Dtype::F8E4M3Scaled { block } => return format!("F8_E4M3/b{block}"),
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::Q4_0 => "Q4_0",
            Dtype::Q4_1 => "Q4_1",
            Dtype::Q5_0 => "Q5_0",
            Dtype::Q5_1 => "Q5_1",
            Dtype::Q8_0 => "Q8_0",
            Dtype::Q4K => "Q4_K",
            Dtype::Q5K => "Q5_K",
            Dtype::Q6K => "Q6_K",
            Dtype::IQ4NL => "IQ4_NL",
            Dtype::IQ4XS => "IQ4_XS",
        };
        fixed.to_string()
    }

    /// Rejects parameterised formats whose geometry is meaningless (a zero-sized or odd group).
    fn check(self) -> Result<(), QuantError> {
        match self {
            Dtype::Int4 { group } if group < 2 || group % 2 != 0 => Err(QuantError::InvalidGroup { group: group as usize }),
            Dtype::F8E4M3Scaled { block: 0 } => Err(QuantError::InvalidBlock { block: 0 }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Number of elements held by `bytes` of `dtype` (whole blocks only).
pub fn element_count(dtype: Dtype, bytes: &[u8]) -> Result<usize, QuantError> {
    dtype.check()?;
    let size = dtype.block_bytes();
    if !bytes.len().is_multiple_of(size) {
        return Err(QuantError::RaggedBytes { dtype, len: bytes.len() });
    }
    // Cannot overflow: every format holds fewer than two elements per byte, and a slice is at
    // most isize::MAX bytes long.
    Ok(bytes.len() / size * dtype.block_elems())
}

/// Converts raw little-endian `bytes` of `dtype` into `out` (exactly as many elements).
///
/// Reads bytes rather than casting the slice, because an mmapped tensor need not be aligned to
/// its element size (safetensors only promises byte alignment). Runs once per weight row in the
/// CPU matmul, so it allocates nothing and dispatches on the dtype once, not per element.
pub fn dequantize_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let n = element_count(dtype, bytes)?;
    if n != out.len() {
        return Err(QuantError::OutputSize { have: out.len(), want: n });
    }
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                *o = f32::from_le_bytes(*c);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = f16::from_le_bytes(*c).to_f32();
            }
        }
        Dtype::BF16 => {
            // The widening by hand (a shift, which vectorizes) rather than `half`'s, which
            // also quiets signalling NaNs and so branches per element: a NaN weight stays NaN.
            for (o, c) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes(*c)) << 16);
            }
        }
        Dtype::F8E4M3 => fp8::dequantize_e4m3(bytes, out),
        Dtype::F8E4M3Scaled { block } => fp8::dequantize_scaled(block as usize, bytes, out),
        Dtype::Int4 { group } => int4::dequantize(group as usize, bytes, out),
        Dtype::Q4_0 => gguf::blocks(bytes, out, gguf::q4_0),
        Dtype::Q4_1 => gguf::blocks(bytes, out, gguf::q4_1),
        Dtype::Q5_0 => gguf::blocks(bytes, out, gguf::q5_0),
        Dtype::Q5_1 => gguf::blocks(bytes, out, gguf::q5_1),
        Dtype::Q8_0 => gguf::blocks(bytes, out, gguf::q8_0),
        Dtype::Q4K => gguf::blocks(bytes, out, gguf::q4_k),
        Dtype::Q5K => gguf::blocks(bytes, out, gguf::q5_k),
        Dtype::Q6K => gguf::blocks(bytes, out, gguf::q6_k),
        Dtype::IQ4NL => gguf::blocks(bytes, out, gguf::iq4_nl),
        Dtype::IQ4XS => gguf::blocks(bytes, out, gguf::iq4_xs),
    }
    Ok(())
}

/// Convenience wrapper of [`dequantize_into`] that allocates.
pub fn dequantize(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0.0; element_count(dtype, bytes)?];
    dequantize_into(dtype, bytes, &mut out)?;
    Ok(out)
}

/// Rounds an f32 to the nearest bf16 and back (round-to-nearest-even), as a checkpoint stored in
/// bf16 would hold it.
pub fn round_to_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Reads a little-endian f16 at `at` as f32.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// `a * b` for sizes taken from a caller, as an error instead of a wrap-around.
fn shape_product(rows: usize, cols: usize) -> Result<usize, QuantError> {
    rows.checked_mul(cols).ok_or(QuantError::ShapeOverflow { rows, cols })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_each_float_dtype() {
        let vals = [1.5f32, -2.25, 0.0, 65504.0];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(dequantize(Dtype::F32, &f32b).unwrap(), vals);
        let f16b: Vec<u8> = vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect();
        assert_eq!(dequantize(Dtype::F16, &f16b).unwrap(), vals);
        let bf: Vec<u8> = [1.5f32, -2.25, 0.0].iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect();
        assert_eq!(dequantize(Dtype::BF16, &bf).unwrap(), [1.5, -2.25, 0.0]);
    }

    #[test]
    fn rejects_ragged_input() {
        assert!(matches!(dequantize(Dtype::F32, &[0u8; 6]), Err(QuantError::RaggedBytes { .. })));
        assert!(matches!(dequantize(Dtype::Q4K, &[0u8; 145]), Err(QuantError::RaggedBytes { len: 145, .. })));
        assert!(matches!(element_count(Dtype::Int4 { group: 32 }, &[0u8; 21]), Err(QuantError::RaggedBytes { .. })));
        let mut out = [0.0f32; 2];
        assert!(matches!(dequantize_into(Dtype::BF16, &[0u8; 2], &mut out), Err(QuantError::OutputSize { have: 2, want: 1 })));
        let mut out = [0.0f32; 31];
        assert!(matches!(dequantize_into(Dtype::Q8_0, &[0u8; 34], &mut out), Err(QuantError::OutputSize { have: 31, want: 32 })));
    }

    #[test]
    fn block_geometry_matches_gguf() {
        // (dtype, elements, bytes) from ggml-common.h's static_asserts.
        let table = [
            (Dtype::Q4_0, 32, 18),
            (Dtype::Q4_1, 32, 20),
            (Dtype::Q5_0, 32, 22),
            (Dtype::Q5_1, 32, 24),
            (Dtype::Q8_0, 32, 34),
            (Dtype::Q4K, 256, 144),
            (Dtype::Q5K, 256, 176),
            (Dtype::Q6K, 256, 210),
            (Dtype::IQ4NL, 32, 18),
            (Dtype::IQ4XS, 256, 136),
            (Dtype::F8E4M3, 1, 1),
            (Dtype::Int4 { group: 128 }, 128, 68),
            (Dtype::F8E4M3Scaled { block: 128 }, 128, 132),
        ];
        for (dtype, elems, bytes) in table {
            assert_eq!((dtype.block_elems(), dtype.block_bytes()), (elems, bytes), "{dtype}");
            assert_eq!(dtype.row_bytes(elems * 3).unwrap(), bytes * 3, "{dtype}");
        }
        assert_eq!(Dtype::BF16.row_bytes(7).unwrap(), 14);
    }

    #[test]
    fn row_bytes_rejects_partial_blocks_and_bad_parameters() {
        assert!(matches!(Dtype::Q4K.row_bytes(300), Err(QuantError::PartialBlock { dtype: Dtype::Q4K, cols: 300 })));
        assert!(matches!(Dtype::Q8_0.row_bytes(33), Err(QuantError::PartialBlock { .. })));
        assert!(matches!(Dtype::Int4 { group: 32 }.row_bytes(48), Err(QuantError::PartialBlock { .. })));
        assert!(matches!(Dtype::Int4 { group: 0 }.row_bytes(0), Err(QuantError::InvalidGroup { group: 0 })));
        assert!(matches!(Dtype::Int4 { group: 7 }.row_bytes(14), Err(QuantError::InvalidGroup { group: 7 })));
        assert!(matches!(Dtype::F8E4M3Scaled { block: 0 }.row_bytes(0), Err(QuantError::InvalidBlock { block: 0 })));
        assert!(matches!(dequantize(Dtype::Int4 { group: 0 }, &[]), Err(QuantError::InvalidGroup { .. })));
        assert!(matches!(Dtype::F32.row_bytes(usize::MAX / 2), Err(QuantError::TooLarge { .. })));
        assert_eq!(Dtype::Q4K.row_bytes(0).unwrap(), 0);
    }

    #[test]
    fn ggml_ids_round_trip() {
        let ids = [(0, "F32"), (1, "F16"), (2, "Q4_0"), (3, "Q4_1"), (6, "Q5_0"), (7, "Q5_1"), (8, "Q8_0"), (12, "Q4_K"), (13, "Q5_K"), (14, "Q6_K"), (20, "IQ4_NL"), (23, "IQ4_XS"), (30, "BF16")];
        for (id, name) in ids {
            let dtype = Dtype::from_ggml_type(id).unwrap();
            assert_eq!(dtype.name(), name);
            assert_eq!(dtype.ggml_type(), Some(id));
        }
        // Q2_K, Q3_K, IQ2_XXS, MXFP4, unknown ids: unsupported.
        for id in [4, 5, 9, 10, 11, 15, 16, 21, 24, 39, 41, 1000, u32::MAX] {
            assert_eq!(Dtype::from_ggml_type(id), None, "id {id}");
        }
        for dtype in [Dtype::F8E4M3, Dtype::Int4 { group: 32 }, Dtype::F8E4M3Scaled { block: 128 }] {
            assert_eq!(dtype.ggml_type(), None);
        }
    }

    #[test]
    fn names_and_kinds() {
        assert_eq!(Dtype::Int4 { group: 128 }.to_string(), "int4/g128");
        assert_eq!(Dtype::F8E4M3Scaled { block: 128 }.to_string(), "F8_E4M3/b128");
        assert_eq!(Dtype::F8E4M3.to_string(), "F8_E4M3");
        assert_eq!(format!("{}", Dtype::Q6K), "Q6_K");
        assert!(!Dtype::BF16.is_quantized() && !Dtype::F32.is_quantized() && !Dtype::F16.is_quantized());
        assert!(Dtype::F8E4M3.is_quantized() && Dtype::Q4_0.is_quantized() && Dtype::Int4 { group: 32 }.is_quantized());
    }
}
