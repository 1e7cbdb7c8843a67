//! How quantized weights sit on the GPU: in their own bits, regrouped into tiles that the
//! kernels of cuda/qmatmul.cu read with whole-warp loads.
//!
//! A weight `[N, K]` is cut into tiles of 16 rows (the m16 side of the tensor-core mma, whose A
//! operand the weights are) and each tile's rows into *units* of `U` elements (32, 64 or 128;
//! always whole scale blocks). A unit tile holds the codes of its 16 rows, then their scales:
//!
//! - Codes, per 32-element block `b` of the unit, per lane `L = 4g + q` of a warp: the eight
//!   elements of rows `g` and `g + 8` that lane `L` feeds the mma. Lane `q` of a quad takes the
//!   block's elements `4q..4q+4` for the first k16 step and `16+4q..16+4q+4` for the second
//!   ([`fragment_element`]), so that each k16 step covers 16 consecutive elements (Q6_K's
//!   scale blocks) and the activations, stored in the same order, load as 16 bytes.
//!   4-bit codes: one u32 per row, nibble `p` holding fragment position `NIBBLE_POSITION[p]`,
//!   so that masking `0x000F000F` after a shift of `4k` yields the bf16 pair of positions
//!   `(2k, 2k+1)`. The fifth bit (Q5_*) and the top two bits (Q6_K) follow in planes of their own,
//!   bit `p` (bit pair `p`) for nibble `p`. 8-bit codes: eight bytes per row in position order.
//! - Scales, per format, read by the lanes of quad `g` for rows `g` and `g + 8`.
//!
//! Every code is an exact small number in bf16 (an integer, an IQ4 codebook entry, an e4m3
//! value), so a kernel multiplies it exactly and applies the block's scale (and min) to the
//! sums in f32. [`unpack_row`] decodes a row back from the tiles as the kernels do; the tests
//! compare it with kestrel-quant's dequantization bit for bit.

use kestrel_quant::Dtype;
use rayon::prelude::*;

mod reference;
pub use reference::{random_rows, unpack_row};

/// Rows per tile: the m16 side of the mma.
pub const TILE_ROWS: usize = 16;

/// Fragment position of nibble `p` of a 4-bit code word.
const NIBBLE_POSITION: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// IQ4_NL / IQ4_XS codebook (`kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The element of a 32-element block at fragment position `8q + i` (lane quad position q).
pub fn fragment_element(q: usize, i: usize) -> usize {
    if i < 4 {
        4 * q + i
    } else {
        16 + 4 * q + i - 4
    }
}

/// A format the GPU keeps in tiles. Int4 and FP8 carry their unit (one scale per unit).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileFormat {
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
    Int4 { unit: u32 },
    Fp8 { unit: u32 },
}

/// Every format with tiles (for tests and the kernel table).
pub const ALL_FORMATS: [TileFormat; 16] = [
    TileFormat::Q4_0,
    TileFormat::Q4_1,
    TileFormat::Q5_0,
    TileFormat::Q5_1,
    TileFormat::Q8_0,
    TileFormat::Q4K,
    TileFormat::Q5K,
    TileFormat::Q6K,
    TileFormat::IQ4NL,
    TileFormat::IQ4XS,
    TileFormat::Int4 { unit: 32 },
    TileFormat::Int4 { unit: 64 },
    TileFormat::Int4 { unit: 128 },
    TileFormat::Fp8 { unit: 32 },
    TileFormat::Fp8 { unit: 64 },
    TileFormat::Fp8 { unit: 128 },
];

/// Which source row lands in each row of a tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// Tile `t` holds rows `16t..16t+16`.
    Plain,
    /// Gate rows `0..half` stacked over up rows `half..2*half`: tile `t` holds gate rows
    /// `8t..8t+8` in its rows 0..8 and the matching up rows in 8..16, so that one lane holds a
    /// gate row's sum and its up row's (the SwiGLU store).
    GateUp { half: usize },
}

impl RowOrder {
    /// Tiles of a matrix of `rows` rows.
    pub fn tiles(self, rows: usize) -> usize {
        match self {
            RowOrder::Plain => rows.div_ceil(TILE_ROWS),
            RowOrder::GateUp { half } => half.div_ceil(TILE_ROWS / 2),
        }
    }

    /// The source row of row `r` (0..16) of tile `t`, if any.
    pub fn source_row(self, rows: usize, t: usize, r: usize) -> Option<usize> {
        let (row, limit) = match self {
            RowOrder::Plain => (t * TILE_ROWS + r, rows),
            RowOrder::GateUp { half } => {
                let i = t * (TILE_ROWS / 2) + r % 8;
                if i >= half {
                    return None;
                }
                (i + if r >= 8 { half } else { 0 }, rows)
            }
        };
        (row < limit).then_some(row)
    }
}

impl TileFormat {
    /// The tile format of weights stored as `dtype`, or None where the GPU has no kernel for it
    /// (plain floats, and Int4 / FP8 blocks that are not 32, 64 or a multiple of 128 wide:
    /// those are dequantized to bf16 instead).
    pub fn of(dtype: Dtype) -> Option<TileFormat> {
        let unit = |block: u32| match block {
            32 | 64 => Some(block),
            b if b % 128 == 0 && b > 0 => Some(128),
            _ => None,
        };
        Some(match dtype {
            Dtype::Q4_0 => TileFormat::Q4_0,
            Dtype::Q4_1 => TileFormat::Q4_1,
            Dtype::Q5_0 => TileFormat::Q5_0,
            Dtype::Q5_1 => TileFormat::Q5_1,
            Dtype::Q8_0 => TileFormat::Q8_0,
            Dtype::Q4K => TileFormat::Q4K,
            Dtype::Q5K => TileFormat::Q5K,
            Dtype::Q6K => TileFormat::Q6K,
            Dtype::IQ4NL => TileFormat::IQ4NL,
            Dtype::IQ4XS => TileFormat::IQ4XS,
            Dtype::Int4 { group } => TileFormat::Int4 { unit: unit(group)? },
            Dtype::F8E4M3Scaled { block } => TileFormat::Fp8 { unit: unit(block)? },
            Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F8E4M3 => return None,
        })
    }

    /// Elements per unit.
    pub fn unit(self) -> usize {
        match self {
            TileFormat::Q4_0 | TileFormat::Q4_1 | TileFormat::Q5_0 | TileFormat::Q5_1 | TileFormat::Q8_0 | TileFormat::IQ4NL => 32,
            TileFormat::Q4K | TileFormat::Q5K | TileFormat::Q6K | TileFormat::IQ4XS => 128,
            TileFormat::Int4 { unit } | TileFormat::Fp8 { unit } => unit as usize,
        }
    }

    fn blocks(self) -> usize {
        self.unit() / 32
    }

    /// Bits of a code beyond its low nibble held in extra planes (1 or 2), or 0; 8 for byte codes.
    fn code_bits(self) -> usize {
        match self {
            TileFormat::Q5_0 | TileFormat::Q5_1 | TileFormat::Q5K => 5,
            TileFormat::Q6K => 6,
            TileFormat::Q8_0 | TileFormat::Fp8 { .. } => 8,
            _ => 4,
        }
    }

    /// Bytes of a unit's codes (16 rows).
    pub fn code_bytes(self) -> usize {
        self.blocks() * TILE_ROWS * 32 * self.code_bits() / 8
    }

    /// Bytes of a unit's scales (16 rows).
    pub fn scale_bytes(self) -> usize {
        match self {
            TileFormat::Q4_0 | TileFormat::IQ4NL | TileFormat::Q5_0 | TileFormat::Q8_0 => 32,
            TileFormat::Q4_1 | TileFormat::Q5_1 | TileFormat::Int4 { .. } | TileFormat::Fp8 { .. } => 64,
            TileFormat::Q4K | TileFormat::Q5K | TileFormat::Q6K => 192,
            TileFormat::IQ4XS => 128,
        }
    }

    /// Bytes of a unit tile (16 rows by `unit()` elements).
    pub fn unit_bytes(self) -> usize {
        self.code_bytes() + self.scale_bytes()
    }

    /// Whether a row of `cols` elements is whole units.
    pub fn fits(self, cols: usize) -> bool {
        cols.is_multiple_of(self.unit())
    }

    /// Device bytes of a `rows x cols` weight in this format.
    pub fn matrix_bytes(self, order: RowOrder, rows: usize, cols: usize) -> usize {
        order.tiles(rows) * (cols / self.unit()) * self.unit_bytes()
    }

    /// The format's number in cuda/qmatmul.cu (`QFMT`), which picks its kernel module.
    pub fn kernel_id(self) -> u32 {
        match self {
            TileFormat::Q4_0 => 0,
            TileFormat::Q4_1 => 1,
            TileFormat::Q5_0 => 2,
            TileFormat::Q5_1 => 3,
            TileFormat::Q8_0 => 4,
            TileFormat::Q4K => 5,
            TileFormat::Q5K => 6,
            TileFormat::Q6K => 7,
            TileFormat::IQ4NL => 8,
            TileFormat::IQ4XS => 9,
            TileFormat::Int4 { unit } => 10 + unit.trailing_zeros() - 5,
            TileFormat::Fp8 { unit } => 13 + unit.trailing_zeros() - 5,
        }
    }

    /// A short name for messages and module names ("q4_k", "int4_u128").
    pub fn name(self) -> String {
        match self {
            TileFormat::Q4_0 => "q4_0".into(),
            TileFormat::Q4_1 => "q4_1".into(),
            TileFormat::Q5_0 => "q5_0".into(),
            TileFormat::Q5_1 => "q5_1".into(),
            TileFormat::Q8_0 => "q8_0".into(),
            TileFormat::Q4K => "q4_k".into(),
            TileFormat::Q5K => "q5_k".into(),
            TileFormat::Q6K => "q6_k".into(),
            TileFormat::IQ4NL => "iq4_nl".into(),
            TileFormat::IQ4XS => "iq4_xs".into(),
            TileFormat::Int4 { unit } => format!("int4_u{unit}"),
            TileFormat::Fp8 { unit } => format!("fp8_u{unit}"),
        }
    }
}

/// One row's unit, decoded from its stored format: a code per element and the unit's scales.
#[derive(Clone, Debug, Default)]
struct UnitRow {
    codes: Vec<u8>,
    /// Per format: see [`write_scales`].
    d: Vec<u16>,
    /// Second f16 per scale (Q4_1 / Q5_1 min, K-quant dmin).
    m: Vec<u16>,
    /// Small integers per scale block: K-quant 6-bit scales, Q6_K int8 scales, IQ4_XS ls - 32,
    /// Int4 zero.
    sc: Vec<i32>,
    /// K-quant 6-bit mins.
    mins: Vec<i32>,
    /// FP8 f32 scale.
    f: f32,
}

fn f16_bits(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The 6-bit (scale, min) of K-quant sub-block j (`get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (i32, i32) {
    let (sc, m) = if j < 4 { (s[j] & 63, s[j + 4] & 63) } else { ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)) };
    (sc as i32, m as i32)
}

/// Unit `u` of a row stored as `dtype` (`row` is the whole row's bytes).
fn decode_unit(fmt: TileFormat, dtype: Dtype, row: &[u8], u: usize) -> UnitRow {
    let unit = fmt.unit();
    let mut r = UnitRow { codes: vec![0; unit], ..Default::default() };
    match fmt {
        TileFormat::Q4_0 | TileFormat::IQ4NL | TileFormat::Q4_1 => {
            let bb = dtype.block_bytes();
            let b = &row[u * bb..(u + 1) * bb];
            let qs_at = if fmt == TileFormat::Q4_1 { 4 } else { 2 };
            r.d.push(f16_bits(b, 0));
            if fmt == TileFormat::Q4_1 {
                r.m.push(f16_bits(b, 2));
            }
            for j in 0..16 {
                r.codes[j] = b[qs_at + j] & 0xF;
                r.codes[j + 16] = b[qs_at + j] >> 4;
            }
        }
        TileFormat::Q5_0 | TileFormat::Q5_1 => {
            let bb = dtype.block_bytes();
            let b = &row[u * bb..(u + 1) * bb];
            let one = fmt == TileFormat::Q5_1;
            r.d.push(f16_bits(b, 0));
            if one {
                r.m.push(f16_bits(b, 2));
            }
            let at = if one { 4 } else { 2 };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for j in 0..16 {
                let q = b[at + 4 + j] as u32;
                r.codes[j] = ((q & 0xF) | ((qh >> j) & 1) << 4) as u8;
                r.codes[j + 16] = ((q >> 4) | ((qh >> (j + 16)) & 1) << 4) as u8;
            }
        }
        TileFormat::Q8_0 => {
            let b = &row[u * 34..(u + 1) * 34];
            r.d.push(f16_bits(b, 0));
            r.codes.copy_from_slice(&b[2..34]);
        }
        TileFormat::Q4K | TileFormat::Q5K => {
            let bb = dtype.block_bytes();
            let (s, h) = (u / 2, u % 2);
            let b = &row[s * bb..(s + 1) * bb];
            r.d.push(f16_bits(b, 0));
            r.m.push(f16_bits(b, 2));
            let scales = &b[4..16];
            let five = fmt == TileFormat::Q5K;
            let qs = if five { &b[48..176] } else { &b[16..144] };
            for j in 0..4 {
                let (sc, m) = scale_min_k4(4 * h + j, scales);
                r.sc.push(sc);
                r.mins.push(m);
            }
            for cc in 0..2 {
                let c = 2 * h + cc;
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = (q & 0xF, q >> 4);
                    if five {
                        let hb = b[16 + l] >> (2 * c);
                        lo |= (hb & 1) << 4;
                        hi |= ((hb >> 1) & 1) << 4;
                    }
                    r.codes[64 * cc + l] = lo;
                    r.codes[64 * cc + 32 + l] = hi;
                }
            }
        }
        TileFormat::Q6K => {
            let (s, h) = (u / 2, u % 2);
            let b = &row[s * 210..(s + 1) * 210];
            r.d.push(f16_bits(b, 208));
            for i in 0..8 {
                r.sc.push(b[192 + 8 * h + i] as i8 as i32);
            }
            let (ql, qh) = (&b[64 * h..64 * h + 64], &b[128 + 32 * h..128 + 32 * h + 32]);
            for l in 0..32 {
                r.codes[l] = (ql[l] & 0xF) | (qh[l] & 3) << 4;
                r.codes[l + 32] = (ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4;
                r.codes[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                r.codes[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
            }
        }
        TileFormat::IQ4XS => {
            let (s, h) = (u / 2, u % 2);
            let b = &row[s * 136..(s + 1) * 136];
            r.d.push(f16_bits(b, 0));
            let scales_h = u16::from_le_bytes([b[2], b[3]]) as u32;
            for j in 0..4 {
                let ib = 4 * h + j;
                let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) as u32 & 0xF;
                let ls = lo | ((scales_h >> (2 * ib)) & 3) << 4;
                r.sc.push(ls as i32 - 32);
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                for jj in 0..16 {
                    r.codes[32 * j + jj] = qs[jj] & 0xF;
                    r.codes[32 * j + 16 + jj] = qs[jj] >> 4;
                }
            }
        }
        TileFormat::Int4 { .. } => {
            let Dtype::Int4 { group } = dtype else { unreachable!("an Int4 tile from {dtype}") };
            let group = group as usize;
            let gb = dtype.block_bytes();
            let e0 = u * unit;
            let b = &row[(e0 / group) * gb..(e0 / group + 1) * gb];
            r.d.push(f16_bits(b, 0));
            r.sc.push(b[2] as i32);
            for i in 0..unit {
                let e = e0 % group + i;
                let byte = b[4 + e / 2];
                r.codes[i] = if e % 2 == 0 { byte & 0xF } else { byte >> 4 };
            }
        }
        TileFormat::Fp8 { .. } => {
            let Dtype::F8E4M3Scaled { block } = dtype else { unreachable!("an FP8 tile from {dtype}") };
            let block = block as usize;
            let bb = dtype.block_bytes();
            let e0 = u * unit;
            let b = &row[(e0 / block) * bb..(e0 / block + 1) * bb];
            r.f = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            r.codes.copy_from_slice(&b[4 + e0 % block..4 + e0 % block + unit]);
        }
    }
    r
}

/// Writes row `row` (0..16) of a unit tile from its decoded unit.
fn write_row(fmt: TileFormat, tile: &mut [u8], row: usize, r: &UnitRow) {
    let (g, upper) = (row % 8, row >= 8);
    let blocks = fmt.blocks();
    let bits = fmt.code_bits();
    for b in 0..blocks {
        for q in 0..4 {
            let lane = 4 * g + q;
            let code = |i: usize| r.codes[32 * b + fragment_element(q, i)];
            if bits == 8 {
                let at = b * 512 + lane * 16 + if upper { 8 } else { 0 };
                for i in 0..8 {
                    // Q8_0 codes are stored offset by 128 (unsigned); FP8 bytes as they are.
                    tile[at + i] = if fmt == TileFormat::Q8_0 { code(i).wrapping_add(128) } else { code(i) };
                }
                continue;
            }
            let word: u32 = (0..8).map(|p| ((code(NIBBLE_POSITION[p]) & 0xF) as u32) << (4 * p)).sum();
            let at = b * 256 + lane * 8 + if upper { 4 } else { 0 };
            tile[at..at + 4].copy_from_slice(&word.to_le_bytes());
            let plane = blocks * 256;
            if bits == 5 {
                let byte: u8 = (0..8).map(|p| ((code(NIBBLE_POSITION[p]) >> 4) & 1) << p).sum();
                tile[plane + b * 64 + lane * 2 + usize::from(upper)] = byte;
            } else if bits == 6 {
                let half: u16 = (0..8).map(|p| (((code(NIBBLE_POSITION[p]) >> 4) & 3) as u16) << (2 * p)).sum();
                let at = plane + b * 128 + lane * 4 + if upper { 2 } else { 0 };
                tile[at..at + 2].copy_from_slice(&half.to_le_bytes());
            }
        }
    }
    write_scales(fmt, &mut tile[fmt.code_bytes()..], g, upper, r);
}

/// The scales section of a unit tile: quad `g` finds rows `g` and `g + 8` at `g * stride`.
fn write_scales(fmt: TileFormat, s: &mut [u8], g: usize, upper: bool, r: &UnitRow) {
    let put16 = |s: &mut [u8], at: usize, v: u16| s[at..at + 2].copy_from_slice(&v.to_le_bytes());
    match fmt {
        // [g]: d(g) f16, d(g+8) f16.
        TileFormat::Q4_0 | TileFormat::IQ4NL | TileFormat::Q5_0 | TileFormat::Q8_0 => put16(s, 4 * g + 2 * usize::from(upper), r.d[0]),
        // [g]: (d | m << 16) of row g, then of row g+8.
        TileFormat::Q4_1 | TileFormat::Q5_1 => {
            let at = 8 * g + 4 * usize::from(upper);
            put16(s, at, r.d[0]);
            put16(s, at + 2, r.m[0]);
        }
        // [g]: (scale | zero << 16) of row g, then of row g+8.
        TileFormat::Int4 { .. } => {
            let at = 8 * g + 4 * usize::from(upper);
            put16(s, at, r.d[0]);
            s[at + 2] = r.sc[0] as u8;
            s[at + 3] = 0;
        }
        // [g]: f32 scale of row g, then of row g+8.
        TileFormat::Fp8 { .. } => {
            let at = 8 * g + 4 * usize::from(upper);
            s[at..at + 4].copy_from_slice(&r.f.to_le_bytes());
        }
        // [g]: per row (d | dmin << 16), sc[4] bytes, m[4] bytes; row g then row g+8.
        TileFormat::Q4K | TileFormat::Q5K => {
            let at = 24 * g + 12 * usize::from(upper);
            put16(s, at, r.d[0]);
            put16(s, at + 2, r.m[0]);
            for j in 0..4 {
                s[at + 4 + j] = r.sc[j] as u8;
                s[at + 8 + j] = r.mins[j] as u8;
            }
        }
        // [g]: sc[8] of row g, sc[8] of row g+8, d(g) | d(g+8) << 16, 4 bytes unused.
        TileFormat::Q6K => {
            let at = 24 * g;
            for i in 0..8 {
                s[at + 8 * usize::from(upper) + i] = r.sc[i] as i8 as u8;
            }
            put16(s, at + 16 + 2 * usize::from(upper), r.d[0]);
        }
        // [g]: (ls - 32)[4] of row g, of row g+8, d(g) | d(g+8) << 16, 4 bytes unused.
        TileFormat::IQ4XS => {
            let at = 16 * g;
            for j in 0..4 {
                s[at + 4 * usize::from(upper) + j] = r.sc[j] as i8 as u8;
            }
            put16(s, at + 8 + 2 * usize::from(upper), r.d[0]);
        }
    }
}

/// Packs tiles `tiles` (a range of the matrix's tiles) of a `rows x cols` weight stored as
/// `dtype` into `out` (exactly those tiles' bytes); `row(i)` is source row i's bytes
/// (`dtype.row_bytes(cols)` long). Rows past the weight's end are zero.
#[allow(clippy::too_many_arguments)]
pub fn pack_tiles<'a>(fmt: TileFormat, dtype: Dtype, order: RowOrder, row: &(dyn Fn(usize) -> &'a [u8] + Sync), rows: usize, cols: usize, tiles: std::ops::Range<usize>, out: &mut [u8]) {
    let units = cols / fmt.unit();
    let tile_bytes = units * fmt.unit_bytes();
    assert_eq!(out.len(), tiles.len() * tile_bytes, "pack_tiles: output size");
    out.par_chunks_mut(tile_bytes.max(1)).zip(tiles).for_each(|(tile, t)| {
        tile.fill(0);
        for r in 0..TILE_ROWS {
            let Some(src) = order.source_row(rows, t, r) else { continue };
            let row = row(src);
            for u in 0..units {
                let unit = decode_unit(fmt, dtype, row, u);
                write_row(fmt, &mut tile[u * fmt.unit_bytes()..(u + 1) * fmt.unit_bytes()], r, &unit);
            }
        }
    });
}
