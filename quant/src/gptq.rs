//! Repacking of int4 checkpoints whose q, zeros and scales are separate tensors (GPTQ, AWQ and
//! AutoRound's exports of them) into rows of [`Dtype::Int4`], one row per output feature.
//!
//! Both layouts describe `W [n, k]` (n = out_features, k = in_features) through three tensors:
//! - GPTQ: `qweight` I32 `[k/8, n]` packed along k (row 8r+i in bits 4i..4i+3), `qzeros` I32
//!   `[k/group, n/8]` packed along n the same way, `scales` `[k/group, n]`.
//! - AWQ: `qweight` I32 `[k, n/8]` and `qzeros` I32 `[k/group, n/8]` packed along n with column
//!   `j` of each 8 in nibble `AWQ_NIBBLE_OF_COLUMN[j]`, `scales` `[k/group, n]`.
//!
//! `W[r, c] = scale[c/group, r] * (q[c, r] - zero[c/group, r])`. All I32 tensors are little
//! endian; scales are F16 (BF16 accepted when every scale has an exact f16 value). Where k is
//! not a multiple of the group (the last group is partial: `ceil(k/group)` groups, as GPTQ and
//! AutoRound quantize such a layer), the rows take groups of [`int4_row_group`] elements, each
//! with the scale and zero of the checkpoint group it lies in.

use half::{bf16, f16};

use crate::int4::HEADER_BYTES;
use crate::{shape_product, Dtype, QuantError};

/// AWQ's packing order: column j of an 8-column group sits in nibble `[0, 4, 1, 5, 2, 6, 3, 7][j]`
/// of its int32 (AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..8).
const AWQ_NIBBLE_OF_COLUMN: [u32; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Output rows repacked together, so reads of the packed tensors and writes of the rows both
/// stay within a few cache lines and pages.
const ROW_TILE: usize = 64;

/// The group of the `Int4` rows an int4 checkpoint of `k` inputs in groups of `group` is
/// repacked into: the group itself where it divides k, else the largest width dividing both.
pub fn int4_row_group(k: usize, group: usize) -> usize {
    let (mut a, mut b) = (k, group);
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Repacks a GPTQ-layout int4 linear into `n` rows of `Int4 { int4_row_group(k, group) }`, each
/// of `k` elements.
///
/// `zero_offset` is added to every stored zero: 1 for GPTQ v1 packing (AutoRound
/// `auto_round:auto_gptq`, which stores zero - 1), 0 for v2 (`auto_round`, gptqmodel).
#[allow(clippy::too_many_arguments)]
pub fn gptq_int4_rows(qweight: &[u8], qzeros: &[u8], scales: &[u8], scales_dtype: Dtype, k: usize, n: usize, group: usize, zero_offset: u8) -> Result<Vec<u8>, QuantError> {
    let layout = Layout::new(k, n, group, scales_dtype)?;
    check_multiple("k", k, 8)?;
    layout.check_inputs(qweight, shape_product(k / 8, n)?, qzeros, scales)?;
    let qzeros = qzeros.as_chunks::<4>().0;
    let mut out = layout.headers(scales, scales_dtype, |g, r| {
        let stored = (u32::from_le_bytes(qzeros[g * (n / 8) + r / 8]) >> (4 * (r % 8))) & 0xF;
        stored + zero_offset as u32
    })?;
    // A GPTQ word holds elements 8kr..8kr+8 of one row with element 2j in the low nibble of its
    // little-endian byte j and 2j+1 in the high one: byte j is already an Int4 nibble pair.
    let qweight = qweight.as_chunks::<4>().0;
    for r0 in (0..n).step_by(ROW_TILE) {
        for kr in 0..k / 8 {
            for r in r0..(r0 + ROW_TILE).min(n) {
                for (j, &byte) in qweight[kr * n + r].iter().enumerate() {
                    out[layout.pair_index(r, 8 * kr + 2 * j)] = byte;
                }
            }
        }
    }
    Ok(out)
}

/// Repacks an AWQ-layout int4 linear (AutoAWQ, AutoRound `auto_round:auto_awq`; zeros stored as
/// is) into `n` rows of `Int4 { int4_row_group(k, group) }`, each of `k` elements.
pub fn awq_int4_rows(qweight: &[u8], qzeros: &[u8], scales: &[u8], scales_dtype: Dtype, k: usize, n: usize, group: usize) -> Result<Vec<u8>, QuantError> {
    let layout = Layout::new(k, n, group, scales_dtype)?;
    let words_per_row = n / 8;
    layout.check_inputs(qweight, shape_product(k, words_per_row)?, qzeros, scales)?;
    let nibble = |word: [u8; 4], r: usize| (u32::from_le_bytes(word) >> (4 * AWQ_NIBBLE_OF_COLUMN[r % 8])) & 0xF;
    let qzeros = qzeros.as_chunks::<4>().0;
    let mut out = layout.headers(scales, scales_dtype, |g, r| nibble(qzeros[g * words_per_row + r / 8], r))?;
    let qweight = qweight.as_chunks::<4>().0;
    for r0 in (0..n).step_by(ROW_TILE) {
        // k is even (a multiple of the even row group), so input rows pair up into Int4 bytes.
        for c in (0..k).step_by(2) {
            for r in r0..(r0 + ROW_TILE).min(n) {
                let lo = nibble(qweight[c * words_per_row + r / 8], r);
                let hi = nibble(qweight[(c + 1) * words_per_row + r / 8], r);
                out[layout.pair_index(r, c)] = (lo | hi << 4) as u8;
            }
        }
    }
    Ok(out)
}

/// Where the rows of an `n x k` `Int4 { group }` weight put each group.
struct Layout {
    k: usize,
    n: usize,
    /// The checkpoint's group and its number of groups (the last one may be partial).
    stored_group: usize,
    stored_groups: usize,
    /// The rows' group (dividing k) and their groups per row.
    group: usize,
    groups: usize,
    block_bytes: usize,
    row_bytes: usize,
}

impl Layout {
    /// Checks what both layouts share: an even group below 2^32 whose width shared with k (the
    /// rows' group) is even, n a multiple of 8 (zeros pack 8 columns per int32), F16 or BF16
    /// scales.
    fn new(k: usize, n: usize, stored_group: usize, scales_dtype: Dtype) -> Result<Layout, QuantError> {
        if stored_group < 2 || stored_group % 2 != 0 || u32::try_from(stored_group).is_err() {
            return Err(QuantError::InvalidGroup { group: stored_group });
        }
        let group = int4_row_group(k, stored_group);
        check_multiple("k", k, 2)?;
        if group % 2 != 0 {
            return Err(QuantError::InvalidGroup { group });
        }
        let dtype = Dtype::Int4 { group: group as u32 };
        check_multiple("n", n, 8)?;
        if !matches!(scales_dtype, Dtype::F16 | Dtype::BF16) {
            return Err(QuantError::ScalesDtype { dtype: scales_dtype });
        }
        Ok(Layout { k, n, stored_group, stored_groups: k.div_ceil(stored_group), group, groups: k / group, block_bytes: dtype.block_bytes(), row_bytes: dtype.row_bytes(k)? })
    }

    /// Checks exact byte lengths: `qweight` of `qweight_words` int32s, zeros and scales per group.
    fn check_inputs(&self, qweight: &[u8], qweight_words: usize, qzeros: &[u8], scales: &[u8]) -> Result<(), QuantError> {
        let bytes = |elems: usize, size: usize| elems.checked_mul(size).ok_or(QuantError::ShapeOverflow { rows: self.k, cols: self.n });
        check_len("qweight", qweight, bytes(qweight_words, 4)?)?;
        check_len("qzeros", qzeros, bytes(shape_product(self.stored_groups, self.n / 8)?, 4)?)?;
        check_len("scales", scales, bytes(shape_product(self.stored_groups, self.n)?, 2)?)
    }

    /// A zeroed output with every group's header written; `zero(g, r)` is the true zero point
    /// of the checkpoint's group g of output row r.
    fn headers(&self, scales: &[u8], scales_dtype: Dtype, zero: impl Fn(usize, usize) -> u32) -> Result<Vec<u8>, QuantError> {
        let mut out = vec![0u8; shape_product(self.n, self.row_bytes)?];
        let scales = scales.as_chunks::<2>().0;
        for row_group in 0..self.groups {
            let g = row_group * self.group / self.stored_group;
            for r in 0..self.n {
                let scale = f16_scale(scales[g * self.n + r], scales_dtype)?;
                let z = zero(g, r);
                if z > 15 {
                    return Err(QuantError::ZeroOutOfRange { zero: z, row: r, group: g });
                }
                let at = r * self.row_bytes + row_group * self.block_bytes;
                out[at..at + 2].copy_from_slice(&scale.to_le_bytes());
                out[at + 2] = z as u8;
            }
        }
        Ok(out)
    }

    /// Byte holding elements `c` and `c + 1` (c even) of output row `r`.
    #[inline(always)]
    fn pair_index(&self, r: usize, c: usize) -> usize {
        r * self.row_bytes + (c / self.group) * self.block_bytes + HEADER_BYTES + (c % self.group) / 2
    }
}

/// A scale as the f16 the Int4 header stores, refusing BF16 values that f16 cannot hold exactly
/// rather than rounding the weights silently.
fn f16_scale(bytes: [u8; 2], dtype: Dtype) -> Result<f16, QuantError> {
    if dtype == Dtype::F16 {
        return Ok(f16::from_le_bytes(bytes));
    }
    let value = bf16::from_le_bytes(bytes).to_f32();
    let scale = f16::from_f32(value);
    if scale.to_f32() != value {
        return Err(QuantError::ScaleNotRepresentable { value });
    }
    Ok(scale)
}

fn check_multiple(what: &'static str, value: usize, of: usize) -> Result<(), QuantError> {
    if !value.is_multiple_of(of) {
        return Err(QuantError::NotMultiple { what, value, of });
    }
    Ok(())
}

fn check_len(tensor: &'static str, bytes: &[u8], want: usize) -> Result<(), QuantError> {
    if bytes.len() != want {
        return Err(QuantError::InputLength { tensor, have: bytes.len(), want });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int4;

    /// GPTQ tensors for `q [k, n]`, one zero and scale per (group, column).
    fn gptq_tensors(q: &[Vec<u8>], zeros: &[Vec<u8>], scales: &[Vec<f32>]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let n = q[0].len();
        let mut qweight = Vec::new();
        for rows in q.chunks(8) {
            for c in 0..n {
                let w = rows.iter().enumerate().fold(0u32, |w, (i, row)| w | (row[c] as u32) << (4 * i));
                qweight.extend_from_slice(&w.to_le_bytes());
            }
        }
        let mut qzeros = Vec::new();
        for z in zeros {
            for c in (0..n).step_by(8) {
                let w = (0..8).fold(0u32, |w, i| w | (z[c + i] as u32) << (4 * i));
                qzeros.extend_from_slice(&w.to_le_bytes());
            }
        }
        let scales = scales.iter().flatten().flat_map(|s| f16::from_f32(*s).to_le_bytes()).collect();
        (qweight, qzeros, scales)
    }

    /// q `[k, n]`, zeros and scales `[ceil(k/group), n]`.
    type Example = (Vec<Vec<u8>>, Vec<Vec<u8>>, Vec<Vec<f32>>);

    fn example(k: usize, n: usize, group: usize) -> Example {
        let q = (0..k).map(|c| (0..n).map(|r| ((c * 7 + r * 3) % 16) as u8).collect()).collect();
        let zeros = (0..k.div_ceil(group)).map(|g| (0..n).map(|r| ((g + r) % 15 + 1) as u8).collect()).collect();
        let scales = (0..k.div_ceil(group)).map(|g| (0..n).map(|r| (r as f32 - 3.5) * 0.25 + g as f32).collect()).collect();
        (q, zeros, scales)
    }

    /// The in-place repackers must write what the plain per-group writer does; where the last
    /// group is partial (k = 96 in groups of 64, as AutoRound stores a 96-wide layer), the rows
    /// take groups of gcd(k, group), each with its checkpoint group's scale and zero.
    #[test]
    fn gptq_rows_match_the_group_writer() {
        for (k, n, group) in [(16, 8, 2), (24, 16, 6), (32, 72, 16), (128, 136, 32), (96, 8, 64), (40, 16, 16), (200, 8, 128)] {
            let (q, zeros, scales) = example(k, n, group);
            let (qweight, qzeros, sc) = gptq_tensors(&q, &zeros, &scales);
            let rows = gptq_int4_rows(&qweight, &qzeros, &sc, Dtype::F16, k, n, group, 0).unwrap();
            let row_group = int4_row_group(k, group);
            assert_eq!(row_group, if k % group == 0 { group } else { [32, 8, 8][[96, 40, 200].iter().position(|&x| x == k).unwrap()] });
            let mut want = Vec::new();
            for r in 0..n {
                for g in 0..k / row_group {
                    let stored = g * row_group / group;
                    int4::push_group(&mut want, f16::from_f32(scales[stored][r]), zeros[stored][r], (g * row_group..(g + 1) * row_group).map(|c| q[c][r]));
                }
            }
            assert_eq!(rows, want, "k {k} n {n} group {group}");
        }
    }

    #[test]
    fn rejects_bad_inputs() {
        let (k, n, g) = (32, 8, 16);
        let (q, zeros, scales) = example(k, n, g);
        let (qw, qz, sc) = gptq_tensors(&q, &zeros, &scales);
        let run = |qw: &[u8], qz: &[u8], sc: &[u8], dt, k, n, g, off| gptq_int4_rows(qw, qz, sc, dt, k, n, g, off);
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, k, n, 0, 0), Err(QuantError::InvalidGroup { group: 0 })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, k, n, 3, 0), Err(QuantError::InvalidGroup { group: 3 })));
        // Groups of 12 over 32 inputs are 3 (the last partial): these tensors hold 2.
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, k, n, 12, 0), Err(QuantError::InputLength { tensor: "qzeros", .. })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, 12, n, 2, 0), Err(QuantError::NotMultiple { what: "k", value: 12, of: 8 })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, k, 12, g, 0), Err(QuantError::NotMultiple { what: "n", value: 12, of: 8 })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F32, k, n, g, 0), Err(QuantError::ScalesDtype { dtype: Dtype::F32 })));
        assert!(matches!(run(&qw[4..], &qz, &sc, Dtype::F16, k, n, g, 0), Err(QuantError::InputLength { tensor: "qweight", have: 124, want: 128 })));
        assert!(matches!(run(&qw, &qz[..4], &sc, Dtype::F16, k, n, g, 0), Err(QuantError::InputLength { tensor: "qzeros", .. })));
        assert!(matches!(run(&qw, &qz, &sc[1..], Dtype::F16, k, n, g, 0), Err(QuantError::InputLength { tensor: "scales", .. })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, usize::MAX - 15, n, g, 0), Err(QuantError::ShapeOverflow { .. })));
        assert!(matches!(run(&qw, &qz, &sc, Dtype::F16, k, usize::MAX - 7, g, 0), Err(QuantError::ShapeOverflow { .. })));
        // A stored 15 with the v1 offset of 1 is a zero of 16.
        let all_15 = vec![0xFF; qz.len()];
        assert!(matches!(run(&qw, &all_15, &sc, Dtype::F16, k, n, g, 1), Err(QuantError::ZeroOutOfRange { zero: 16, row: 0, group: 0 })));
        assert!(run(&qw, &all_15, &sc, Dtype::F16, k, n, g, 0).is_ok());
        let awq = awq_int4_rows(&qw, &qz, &sc, Dtype::F16, k, n, 5);
        assert!(matches!(awq, Err(QuantError::InvalidGroup { group: 5 })));
        assert!(matches!(awq_int4_rows(&qw[..64], &qz, &sc, Dtype::F16, k, n, g), Err(QuantError::InputLength { tensor: "qweight", have: 64, want: 128 })));
    }

    #[test]
    fn bf16_scales_must_be_exact_in_f16() {
        let (k, n, g) = (8, 8, 8);
        let (q, zeros, scales) = example(k, n, g);
        let (qw, qz, _) = gptq_tensors(&q, &zeros, &scales);
        let exact: Vec<u8> = scales.iter().flatten().flat_map(|s| bf16::from_f32(*s).to_le_bytes()).collect();
        let from_bf16 = gptq_int4_rows(&qw, &qz, &exact, Dtype::BF16, k, n, g, 0).unwrap();
        let (_, _, f16_scales) = gptq_tensors(&q, &zeros, &scales);
        assert_eq!(from_bf16, gptq_int4_rows(&qw, &qz, &f16_scales, Dtype::F16, k, n, g, 0).unwrap());
        for bad in [1e-9f32, 1e6, f32::NAN] {
            let mut sc = exact.clone();
            sc[..2].copy_from_slice(&bf16::from_f32(bad).to_le_bytes());
            assert!(matches!(gptq_int4_rows(&qw, &qz, &sc, Dtype::BF16, k, n, g, 0), Err(QuantError::ScaleNotRepresentable { .. })), "{bad}");
        }
    }
}
