//! Weight formats and their CPU reference conversions.
//!
//! Every format a weight can be stored in is a [`Dtype`]; [`dequantize_into`] turns the raw
//! little-endian bytes of one run of elements into f32. Quantized block formats (GGUF k-quants,
//! int4 AutoRound, FP8 block scales) join this crate as they are supported by the loaders.

use half::{bf16, f16};

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("{len} bytes is not a whole number of {dtype:?} elements")]
    RaggedBytes { dtype: Dtype, len: usize },
    #[error("output holds {have} elements but the input has {want}")]
    OutputSize { have: usize, want: usize },
}

/// The storage type of a dense tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    pub fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }
}

/// Number of elements held by `bytes` of `dtype`.
pub fn element_count(dtype: Dtype, bytes: &[u8]) -> Result<usize, QuantError> {
    let size = dtype.size_bytes();
    if bytes.len() % size != 0 {
        return Err(QuantError::RaggedBytes { dtype, len: bytes.len() });
    }
    Ok(bytes.len() / size)
}

/// Converts raw little-endian `bytes` of `dtype` into `out` (exactly as many elements).
///
/// Reads byte pairs rather than casting the slice, because an mmapped tensor need not be aligned
/// to its element size (safetensors only promises byte alignment).
pub fn dequantize_into(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let n = element_count(dtype, bytes)?;
    if n != out.len() {
        return Err(QuantError::OutputSize { have: out.len(), want: n });
    }
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_each_dtype() {
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
        let mut out = [0.0f32; 2];
        assert!(matches!(dequantize_into(Dtype::BF16, &[0u8; 2], &mut out), Err(QuantError::OutputSize { .. })));
    }
}
