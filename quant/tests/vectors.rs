//! Every format against vectors from independent oracles (gguf-py, ml_dtypes, numpy from the
//! published formulas), written by scripts/make_quant_vectors.py under tests/fixtures/quant/.
//! Expected values are compared bit for bit: each oracle performs the same f32 operations in the
//! same order as llama.cpp's reference code, so no rounding difference is legitimate.

use std::path::PathBuf;

use kestrel_quant::fp8::{e4m3_to_f32, fp8_block_rows, fp8_scaled_rows};
use kestrel_quant::gptq::{awq_int4_rows, gptq_int4_rows};
use kestrel_quant::{dequantize, dequantize_into, element_count, Dtype};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run scripts/make_quant_vectors.py)", path.display()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.as_chunks::<4>().0.iter().map(|b| f32::from_le_bytes(*b)).collect()
}

/// Bit-exact comparison that names the first differing element.
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i} is {g:e}, expected {w:e}");
    }
}

#[test]
fn gguf_blocks_match_gguf_py() {
    let types = [
        (Dtype::Q4_0, "q4_0"),
        (Dtype::Q4_1, "q4_1"),
        (Dtype::Q5_0, "q5_0"),
        (Dtype::Q5_1, "q5_1"),
        (Dtype::Q8_0, "q8_0"),
        (Dtype::Q4K, "q4_k"),
        (Dtype::Q5K, "q5_k"),
        (Dtype::Q6K, "q6_k"),
        (Dtype::IQ4NL, "iq4_nl"),
        (Dtype::IQ4XS, "iq4_xs"),
    ];
    for (dtype, stem) in types {
        let bytes = fixture(&format!("{stem}.bin"));
        let want = f32s(&fixture(&format!("{stem}.f32")));
        assert_eq!(element_count(dtype, &bytes).unwrap(), want.len(), "{dtype}");
        assert_bits(stem, &dequantize(dtype, &bytes).unwrap(), &want);
        // Row by row, as the CPU matmul calls it: rows of two blocks into a reused buffer.
        let cols = 2 * dtype.block_elems();
        let row_bytes = dtype.row_bytes(cols).unwrap();
        let mut row = vec![f32::NAN; cols];
        for (r, chunk) in bytes.chunks(row_bytes).enumerate() {
            dequantize_into(dtype, chunk, &mut row).unwrap();
            assert_bits(&format!("{stem} row {r}"), &row, &want[r * cols..(r + 1) * cols]);
        }
    }
}

#[test]
fn every_e4m3_byte_matches_ml_dtypes() {
    let want = f32s(&fixture("e4m3_all.f32"));
    let bytes: Vec<u8> = (0..=255).collect();
    // ml_dtypes turns the NaN codes into the default quiet NaN with the code's sign, as we do.
    assert_bits("e4m3", &dequantize(Dtype::F8E4M3, &bytes).unwrap(), &want);
    let each: Vec<f32> = bytes.iter().map(|&b| e4m3_to_f32(b)).collect();
    assert_bits("e4m3_to_f32", &each, &want);
}

/// Repacks one int4 case, checks the row geometry and compares the dequantized `[n, k]` matrix.
fn check_int4(stem: &str, group: usize, repack: impl Fn(&[u8], &[u8], &[u8]) -> Vec<u8>) {
    let (k, n) = (256, 16);
    let rows = repack(&fixture(&format!("{stem}.qweight")), &fixture(&format!("{stem}.qzeros")), &fixture(&format!("{stem}.scales")));
    let dtype = Dtype::Int4 { group: group as u32 };
    let row_bytes = dtype.row_bytes(k).unwrap();
    assert_eq!(rows.len(), n * row_bytes, "{stem}");
    let want = f32s(&fixture(&format!("{stem}.f32")));
    assert_bits(stem, &dequantize(dtype, &rows).unwrap(), &want);
    let mut row = vec![0.0; k];
    dequantize_into(dtype, &rows[3 * row_bytes..4 * row_bytes], &mut row).unwrap();
    assert_bits(&format!("{stem} row 3"), &row, &want[3 * k..4 * k]);
}

#[test]
fn gptq_rows_match_numpy() {
    let (k, n) = (256, 16);
    for (stem, group, offset, scales) in [("gptq_v1_g32", 32, 1, Dtype::F16), ("gptq_v1_g128_sym", 128, 1, Dtype::F16), ("gptq_v2_g32_bf16", 32, 0, Dtype::BF16), ("gptq_v2_g128", 128, 0, Dtype::F16)] {
        check_int4(stem, group, |qw, qz, sc| gptq_int4_rows(qw, qz, sc, scales, k, n, group, offset).unwrap());
    }
}

#[test]
fn symmetric_gptq_v1_stores_zero_seven() {
    assert!(fixture("gptq_v1_g128_sym.qzeros").as_chunks::<4>().0.iter().all(|w| u32::from_le_bytes(*w) == 0x7777_7777));
}

#[test]
fn awq_rows_match_numpy() {
    let (k, n) = (256, 16);
    for (stem, group) in [("awq_g32", 32), ("awq_g128", 128)] {
        check_int4(stem, group, |qw, qz, sc| awq_int4_rows(qw, qz, sc, Dtype::F16, k, n, group).unwrap());
    }
}

#[test]
fn awq_and_gptq_layouts_differ() {
    // The same bytes read as the other layout must not match: guards against a test that would
    // pass with either nibble order.
    let (k, n) = (256, 16);
    let (qw, qz, sc) = (fixture("awq_g32.qweight"), fixture("awq_g32.qzeros"), fixture("awq_g32.scales"));
    let as_gptq = gptq_int4_rows(&qw, &qz, &sc, Dtype::F16, k, n, 32, 0);
    let as_awq = awq_int4_rows(&qw, &qz, &sc, Dtype::F16, k, n, 32).unwrap();
    assert!(as_gptq.is_err() || as_gptq.unwrap() != as_awq);
}

#[test]
fn fp8_block_rows_match_numpy() {
    let (n, k, block_n, block_k) = (40, 64, 16, 32);
    let weight = fixture("fp8_block.weight");
    let scale = f32s(&fixture("fp8_block.scale.f32"));
    let rows = fp8_block_rows(&weight, &scale, n, k, block_n, block_k).unwrap();
    let dtype = Dtype::F8E4M3Scaled { block: block_k as u32 };
    assert_eq!(rows.len(), n * dtype.row_bytes(k).unwrap());
    assert_bits("fp8_block", &dequantize(dtype, &rows).unwrap(), &f32s(&fixture("fp8_block.f32")));
}

#[test]
fn fp8_channel_rows_match_numpy() {
    let (n, k) = (8, 64);
    let weight = fixture("fp8_channel.weight");
    let scale = f32s(&fixture("fp8_channel.scale.f32"));
    let want = f32s(&fixture("fp8_channel.f32"));
    for block in [16, 64] {
        let rows = fp8_scaled_rows(&weight, &scale, n, k, block).unwrap();
        assert_bits(&format!("fp8_channel/b{block}"), &dequantize(Dtype::F8E4M3Scaled { block: block as u32 }, &rows).unwrap(), &want);
    }
}
