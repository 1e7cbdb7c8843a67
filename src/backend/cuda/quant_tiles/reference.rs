//! The tiles read back on the host as the kernels read them ([`unpack_row`], the tests'
//! reference), and random valid rows of every stored format ([`random_rows`], tests and
//! benchmarks).

use super::{fragment_element, RowOrder, TileFormat, IQ4_VALUES, NIBBLE_POSITION, TILE_ROWS};
use kestrel_quant::Dtype;

/// Decodes source row `src` of a packed weight back to f32 exactly as the kernels dequantize:
/// `scale * w (+ min)`, each operation rounded on its own (the CPU reference's values).
pub fn unpack_row(fmt: TileFormat, order: RowOrder, packed: &[u8], rows: usize, cols: usize, src: usize) -> Vec<f32> {
    let units = cols / fmt.unit();
    let (t, r) = (0..order.tiles(rows))
        .flat_map(|t| (0..TILE_ROWS).map(move |r| (t, r)))
        .find(|&(t, r)| order.source_row(rows, t, r) == Some(src))
        .expect("unpack_row: the row is in the matrix");
    let (g, upper) = (r % 8, r >= 8);
    let f16 = |s: &[u8], at: usize| half::f16::from_bits(u16::from_le_bytes([s[at], s[at + 1]])).to_f32();
    let mut out = Vec::with_capacity(cols);
    for u in 0..units {
        let tile = &packed[(t * units + u) * fmt.unit_bytes()..(t * units + u + 1) * fmt.unit_bytes()];
        let s = &tile[fmt.code_bytes()..];
        let blocks = fmt.blocks();
        let mut unit = vec![0f32; fmt.unit()];
        for b in 0..blocks {
            for q in 0..4 {
                let lane = 4 * g + q;
                for i in 0..8 {
                    let e = 32 * b + fragment_element(q, i);
                    let p = NIBBLE_POSITION.iter().position(|&x| x == i).expect("a permutation");
                    let code = if fmt.code_bits() == 8 {
                        tile[b * 512 + lane * 16 + if upper { 8 } else { 0 } + i] as u32
                    } else {
                        let at = b * 256 + lane * 8 + if upper { 4 } else { 0 };
                        let word = u32::from_le_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
                        let mut c = (word >> (4 * p)) & 0xF;
                        let plane = blocks * 256;
                        if fmt.code_bits() == 5 {
                            c |= ((tile[plane + b * 64 + lane * 2 + usize::from(upper)] as u32 >> p) & 1) << 4;
                        } else if fmt.code_bits() == 6 {
                            let at = plane + b * 128 + lane * 4 + if upper { 2 } else { 0 };
                            c |= ((u16::from_le_bytes([tile[at], tile[at + 1]]) as u32 >> (2 * p)) & 3) << 4;
                        }
                        c
                    };
                    // (scale, weight, min) as the kernels form them.
                    let (scale, w, min) = match fmt {
                        TileFormat::Q4_0 => (f16(s, 4 * g + 2 * usize::from(upper)), code as f32 - 8.0, None),
                        TileFormat::Q5_0 => (f16(s, 4 * g + 2 * usize::from(upper)), code as f32 - 16.0, None),
                        TileFormat::IQ4NL => (f16(s, 4 * g + 2 * usize::from(upper)), IQ4_VALUES[code as usize] as f32, None),
                        TileFormat::Q8_0 => (f16(s, 4 * g + 2 * usize::from(upper)), code as f32 - 128.0, None),
                        TileFormat::Q4_1 | TileFormat::Q5_1 => {
                            let at = 8 * g + 4 * usize::from(upper);
                            (f16(s, at), code as f32, Some(f16(s, at + 2)))
                        }
                        TileFormat::Int4 { .. } => {
                            let at = 8 * g + 4 * usize::from(upper);
                            (f16(s, at), code as f32 - s[at + 2] as f32, None)
                        }
                        TileFormat::Fp8 { .. } => {
                            let at = 8 * g + 4 * usize::from(upper);
                            (f32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]), kestrel_quant::e4m3_to_f32(code as u8), None)
                        }
                        TileFormat::Q4K | TileFormat::Q5K => {
                            let at = 24 * g + 12 * usize::from(upper);
                            let (d, dmin) = (f16(s, at), f16(s, at + 2));
                            (d * s[at + 4 + b] as f32, code as f32, Some(-(dmin * s[at + 8 + b] as f32)))
                        }
                        TileFormat::Q6K => {
                            let at = 24 * g;
                            let sc = s[at + 8 * usize::from(upper) + 2 * b + usize::from(fragment_element(q, i) >= 16)] as i8 as f32;
                            (f16(s, at + 16 + 2 * usize::from(upper)) * sc, code as f32 - 32.0, None)
                        }
                        TileFormat::IQ4XS => {
                            let at = 16 * g;
                            let ls = s[at + 4 * usize::from(upper) + b] as i8 as f32;
                            (f16(s, at + 8 + 2 * usize::from(upper)) * ls, IQ4_VALUES[code as usize] as f32, None)
                        }
                    };
                    unit[e] = match min {
                        Some(m) => scale * w + m,
                        None => scale * w,
                    };
                }
            }
        }
        out.extend(unit);
    }
    out
}

/// Random valid bytes of `rows` rows of a quantized `dtype` (tests and benchmarks): random codes,
/// small finite scales (weights of magnitude about 0.01 to 0.1), no NaN.
pub fn random_rows(dtype: Dtype, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut bytes: Vec<u8> = (0..rows * dtype.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
    let f16_small = |v: u64| half::f16::from_f32(((v % 2000) as f32 / 1000.0 - 1.0) * 0.01).to_le_bytes();
    let bb = dtype.block_bytes();
    for b in bytes.chunks_exact_mut(bb) {
        match dtype {
            Dtype::Q4_0 | Dtype::Q5_0 | Dtype::Q8_0 | Dtype::IQ4NL => b[0..2].copy_from_slice(&f16_small(next())),
            Dtype::Q4_1 | Dtype::Q5_1 | Dtype::Q4K | Dtype::Q5K => {
                b[0..2].copy_from_slice(&f16_small(next()));
                b[2..4].copy_from_slice(&f16_small(next()));
            }
            Dtype::Q6K => b[208..210].copy_from_slice(&f16_small(next())),
            Dtype::IQ4XS => b[0..2].copy_from_slice(&f16_small(next())),
            Dtype::Int4 { .. } => {
                b[0..2].copy_from_slice(&f16_small(next()));
                b[2] %= 16;
            }
            Dtype::F8E4M3Scaled { .. } => {
                b[0..4].copy_from_slice(&(((next() % 1000) as f32 + 1.0) * 1e-5).to_le_bytes());
                // No NaN codes.
                for c in &mut b[4..] {
                    if *c & 0x7F == 0x7F {
                        *c &= 0xFE;
                    }
                }
            }
            _ => {}
        }
    }
    bytes
}


#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    fn dtype_of(fmt: TileFormat) -> Vec<Dtype> {
        match fmt {
            TileFormat::Q4_0 => vec![Dtype::Q4_0],
            TileFormat::Q4_1 => vec![Dtype::Q4_1],
            TileFormat::Q5_0 => vec![Dtype::Q5_0],
            TileFormat::Q5_1 => vec![Dtype::Q5_1],
            TileFormat::Q8_0 => vec![Dtype::Q8_0],
            TileFormat::Q4K => vec![Dtype::Q4K],
            TileFormat::Q5K => vec![Dtype::Q5K],
            TileFormat::Q6K => vec![Dtype::Q6K],
            TileFormat::IQ4NL => vec![Dtype::IQ4NL],
            TileFormat::IQ4XS => vec![Dtype::IQ4XS],
            TileFormat::Int4 { unit: 128 } => vec![Dtype::Int4 { group: 128 }, Dtype::Int4 { group: 256 }],
            TileFormat::Int4 { unit } => vec![Dtype::Int4 { group: unit }],
            TileFormat::Fp8 { unit: 128 } => vec![Dtype::F8E4M3Scaled { block: 128 }, Dtype::F8E4M3Scaled { block: 512 }],
            TileFormat::Fp8 { unit } => vec![Dtype::F8E4M3Scaled { block: unit }],
        }
    }

    /// Every format's tiles decode to kestrel-quant's values, bit for bit, for every row, in
    /// both row orders, with rows that do not fill the last tile.
    #[test]
    fn tiles_decode_to_the_cpu_dequantization() {
        for fmt in ALL_FORMATS {
            for dtype in dtype_of(fmt) {
                assert_eq!(TileFormat::of(dtype), Some(fmt), "{dtype}");
                let cols = 512;
                for (rows, order) in [(37, RowOrder::Plain), (16, RowOrder::Plain), (2 * 13, RowOrder::GateUp { half: 13 })] {
                    let bytes = random_rows(dtype, rows, cols, 7 + rows as u64);
                    let tiles = order.tiles(rows);
                    let mut packed = vec![0xAB; fmt.matrix_bytes(order, rows, cols)];
                    let row_bytes = dtype.row_bytes(cols).unwrap();
                    pack_tiles(fmt, dtype, order, &|i| &bytes[i * row_bytes..(i + 1) * row_bytes], rows, cols, 0..tiles, &mut packed);
                    for r in 0..rows {
                        let want = kestrel_quant::dequantize(dtype, &bytes[r * row_bytes..(r + 1) * row_bytes]).unwrap();
                        let got = unpack_row(fmt, order, &packed, rows, cols, r);
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(a.to_bits(), b.to_bits(), "{fmt:?} from {dtype}, {order:?}, row {r}, element {i}: {a} against {b}");
                        }
                    }
                }
            }
        }
    }

    /// Packing a range of tiles gives those tiles' bytes of the whole packing.
    #[test]
    fn tile_ranges_pack_like_the_whole() {
        let (dtype, fmt, rows, cols) = (Dtype::Q6K, TileFormat::Q6K, 70, 256);
        let bytes = random_rows(dtype, rows, cols, 3);
        let order = RowOrder::Plain;
        let mut whole = vec![0; fmt.matrix_bytes(order, rows, cols)];
        let rb = dtype.row_bytes(cols).unwrap();
        let row = |i: usize| &bytes[i * rb..(i + 1) * rb];
        pack_tiles(fmt, dtype, order, &row, rows, cols, 0..order.tiles(rows), &mut whole);
        let tile_bytes = cols / fmt.unit() * fmt.unit_bytes();
        let mut part = vec![0; 2 * tile_bytes];
        pack_tiles(fmt, dtype, order, &row, rows, cols, 2..4, &mut part);
        assert_eq!(part, whole[2 * tile_bytes..4 * tile_bytes]);
    }

    #[test]
    fn geometry_of_every_format() {
        // (format, unit, unit bytes): within 6% of the stored bytes for the K-quants.
        let table = [
            (TileFormat::Q4_0, 32, 288),
            (TileFormat::IQ4NL, 32, 288),
            (TileFormat::Q4_1, 32, 320),
            (TileFormat::Q5_0, 32, 352),
            (TileFormat::Q5_1, 32, 384),
            (TileFormat::Q8_0, 32, 544),
            (TileFormat::Q4K, 128, 1216),
            (TileFormat::Q5K, 128, 1472),
            (TileFormat::Q6K, 128, 1728),
            (TileFormat::IQ4XS, 128, 1152),
            (TileFormat::Int4 { unit: 128 }, 128, 1088),
            (TileFormat::Fp8 { unit: 128 }, 128, 2112),
        ];
        for (fmt, unit, bytes) in table {
            assert_eq!((fmt.unit(), fmt.unit_bytes()), (unit, bytes), "{fmt:?}");
            assert!(bytes % 16 == 0, "{fmt:?}: unit tiles must stay 16-byte aligned");
        }
        for (dtype, limit) in [(Dtype::Q4K, 1.06), (Dtype::Q6K, 1.03), (Dtype::Q8_0, 1.0), (Dtype::Int4 { group: 128 }, 1.03), (Dtype::F8E4M3Scaled { block: 128 }, 1.0)] {
            let fmt = TileFormat::of(dtype).unwrap();
            let stored = 16 * dtype.row_bytes(4096).unwrap();
            let device = fmt.matrix_bytes(RowOrder::Plain, 16, 4096);
            assert!(device as f64 <= stored as f64 * limit, "{dtype}: {device} device bytes for {stored} stored");
        }
        let ids: std::collections::HashSet<u32> = ALL_FORMATS.iter().map(|f| f.kernel_id()).collect();
        assert_eq!(ids.len(), ALL_FORMATS.len(), "kernel ids are distinct");
        assert!(ALL_FORMATS.iter().all(|f| f.kernel_id() < 16));
        assert_eq!(TileFormat::of(Dtype::Int4 { group: 96 }), None, "no tiles for 96-wide groups");
        assert_eq!(TileFormat::of(Dtype::BF16), None);
        assert!(!TileFormat::Q4K.fits(300) && TileFormat::Q4K.fits(384));
        assert_eq!(RowOrder::GateUp { half: 13 }.tiles(26), 2);
        assert_eq!(RowOrder::GateUp { half: 13 }.source_row(26, 1, 9), Some(13 + 9));
        assert_eq!(RowOrder::GateUp { half: 13 }.source_row(26, 1, 6), None);
    }
}
