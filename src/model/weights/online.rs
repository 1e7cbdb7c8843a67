//! Quantization at load (`--quantization fp8|int4|q4_k`): a checkpoint's float linears are
//! quantized into a row format as they are read, and `--load-format dummy` makes its random
//! weights in the same formats, so every format has a benchmark at real sizes.
//!
//! Which linears and into what, per mode:
//! - `fp8`: E4M3 with one f32 scale per 128 inputs of each row (1x128 blocks, finer than Qwen's
//!   128x128 checkpoints; vLLM's online fp8 scales per tensor or per channel).
//! - `int4`: asymmetric int4 in groups of 128 inputs (64 or 32 where 128 does not divide the
//!   row), as AutoRound's and GPTQ's group quantization.
//! - `q4_k`: llama.cpp's Q4_K_M choice: Q4_K, with Q6_K for the value projections (full
//!   attention's `v_proj`, the delta rule's `in_proj_qkv`) and the MLP's down projections in the
//!   first and last eighth of the layers and every third between (`use_more_bits`), Q4_K for
//!   the token embedding and Q6_K for the output head; rows not a multiple of 256 fall back to
//!   Q5_0 (for Q4_K) and Q8_0 (for Q6_K), as llama-quantize does.
//!
//! Kept as stored in every mode: the small gate projections of the delta rule (`in_proj_a`,
//! `in_proj_b`, `in_proj_ba`), MoE routers and shared-expert gates, and (fp8, int4) the token
//! embedding and output head, as the published checkpoints of those formats keep them.

use super::{Dtype, MatrixBytes, SharedBytes};
use rayon::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnlineQuantization {
    Fp8,
    Int4,
    Q4K,
}

impl std::fmt::Display for OnlineQuantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnlineQuantization::Fp8 => "fp8 (E4M3, 1x128 block scales)",
            OnlineQuantization::Int4 => "int4 (asymmetric, groups of 128)",
            OnlineQuantization::Q4K => "q4_k (Q4_K with Q6_K where llama.cpp's Q4_K_M puts it)",
        })
    }
}

/// llama.cpp's `use_more_bits(i_layer, n_layers)`.
fn more_bits(layer: usize, layers: usize) -> bool {
    let eighth = layers / 8;
    layer < eighth || layer >= 7 * layers / 8 || (layer >= eighth && (layer - eighth) % 3 == 2)
}

/// The decoder layer index in a full tensor name (`...layers.12.mlp...`), None for the MTP
/// block and the tensors outside layers.
fn layer_of(name: &str) -> Option<usize> {
    if name.starts_with("mtp.") {
        return None;
    }
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest[..rest.find('.')?].parse().ok()
}

impl OnlineQuantization {
    /// The dtype linear `name` (full stored name) of `[rows, cols]` is quantized into, or None
    /// where it stays as stored. `layers`: the model's decoder layers.
    pub fn target(self, name: &str, cols: usize, layers: usize) -> Option<Dtype> {
        let kept = ["in_proj_a.", "in_proj_b.", "in_proj_ba.", "mlp.gate.weight", "shared_expert_gate", "conv1d"];
        if kept.iter().any(|k| name.contains(k)) {
            return None;
        }
        let embedding = name.ends_with("embed_tokens.weight");
        let head = name.ends_with("lm_head.weight");
        match self {
            OnlineQuantization::Fp8 | OnlineQuantization::Int4 if embedding || head => None,
            OnlineQuantization::Fp8 => [128u32, 64, 32].into_iter().find(|&b| cols % b as usize == 0).map(|b| Dtype::F8E4M3Scaled { block: b }),
            OnlineQuantization::Int4 => [128u32, 64, 32].into_iter().find(|&g| cols % g as usize == 0).map(|g| Dtype::Int4 { group: g }),
            OnlineQuantization::Q4K => {
                let value_like = name.contains("v_proj") || name.contains("in_proj_qkv.") || name.contains("down_proj");
                let six = head || (value_like && layer_of(name).is_some_and(|l| more_bits(l, layers)));
                match (six, cols % 256 == 0, cols % 32 == 0) {
                    (true, true, _) => Some(Dtype::Q6K),
                    (false, true, _) => Some(Dtype::Q4K),
                    (true, false, true) => Some(Dtype::Q8_0),
                    (false, false, true) => Some(Dtype::Q5_0),
                    (_, false, false) => None,
                }
            }
        }
    }

    /// `m` quantized into `dtype`, a row block at a time on every core.
    pub fn quantize(m: &MatrixBytes, dtype: Dtype) -> Result<MatrixBytes, kestrel_quant::QuantError> {
        let row_bytes = dtype.row_bytes(m.cols)?;
        let src_row = m.row_bytes();
        let mut out = vec![0u8; m.rows * row_bytes];
        const ROWS: usize = 64;
        out.par_chunks_mut((ROWS * row_bytes).max(1)).enumerate().try_for_each(|(i, chunk)| -> Result<(), kestrel_quant::QuantError> {
            let rows = chunk.len() / row_bytes.max(1);
            let src = &m.bytes()[i * ROWS * src_row..(i * ROWS + rows) * src_row];
            let values = kestrel_quant::dequantize(m.dtype, src)?;
            chunk.copy_from_slice(&kestrel_quant::quantize(dtype, &values, rows, m.cols)?);
            Ok(())
        })?;
        Ok(MatrixBytes { data: SharedBytes::from_vec(out), start: 0, dtype, rows: m.rows, cols: m.cols })
    }

    /// The `--quantization` value's name.
    pub fn parse(name: &str) -> Option<Option<OnlineQuantization>> {
        match name {
            "none" => Some(None),
            "fp8" => Some(Some(OnlineQuantization::Fp8)),
            "int4" => Some(Some(OnlineQuantization::Int4)),
            "q4_k" => Some(Some(OnlineQuantization::Q4K)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_follows_llama_cpps_q4_k_m() {
        let q = OnlineQuantization::Q4K;
        // 32 layers: more bits in 0..4, 28..32 and every third from layer 6.
        let more: Vec<usize> = (0..32).filter(|&l| more_bits(l, 32)).collect();
        assert_eq!(more, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
        assert_eq!(q.target("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", 4096, 32), Some(Dtype::Q6K));
        assert_eq!(q.target("model.language_model.layers.4.linear_attn.in_proj_qkv.weight", 4096, 32), Some(Dtype::Q4K));
        assert_eq!(q.target("model.layers.6.mlp.down_proj.weight", 12288, 32), Some(Dtype::Q6K));
        assert_eq!(q.target("model.layers.7.mlp.gate_proj.weight", 4096, 32), Some(Dtype::Q4K));
        assert_eq!(q.target("model.layers.3.self_attn.v_proj.weight", 4096, 32), Some(Dtype::Q6K));
        assert_eq!(q.target("lm_head.weight", 4096, 32), Some(Dtype::Q6K));
        assert_eq!(q.target("model.embed_tokens.weight", 4096, 32), Some(Dtype::Q4K));
        // Rows that are not whole super-blocks fall back as llama-quantize does.
        assert_eq!(q.target("model.layers.6.mlp.down_proj.weight", 448, 8), Some(Dtype::Q8_0));
        assert_eq!(q.target("model.layers.4.mlp.down_proj.weight", 448, 8), Some(Dtype::Q5_0));
        assert_eq!(q.target("model.layers.4.mlp.up_proj.weight", 100, 8), None);
        // The MTP block has no layer index: Q4_K.
        assert_eq!(q.target("mtp.layers.0.mlp.down_proj.weight", 4096, 32), Some(Dtype::Q4K));
    }

    #[test]
    fn kept_tensors_and_fallback_widths() {
        for q in [OnlineQuantization::Fp8, OnlineQuantization::Int4, OnlineQuantization::Q4K] {
            for name in ["model.layers.0.linear_attn.in_proj_a.weight", "model.layers.0.linear_attn.in_proj_b.weight", "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"] {
                assert_eq!(q.target(name, 4096, 32), None, "{q:?} {name}");
            }
        }
        let fp8 = OnlineQuantization::Fp8;
        assert_eq!(fp8.target("lm_head.weight", 4096, 32), None);
        assert_eq!(fp8.target("model.layers.0.self_attn.o_proj.weight", 4096, 32), Some(Dtype::F8E4M3Scaled { block: 128 }));
        assert_eq!(fp8.target("model.layers.0.mlp.down_proj.weight", 448, 32), Some(Dtype::F8E4M3Scaled { block: 64 }));
        let int4 = OnlineQuantization::Int4;
        assert_eq!(int4.target("model.layers.0.mlp.down_proj.weight", 448, 32), Some(Dtype::Int4 { group: 64 }));
        assert_eq!(int4.target("model.layers.0.mlp.down_proj.weight", 100, 32), None);
        assert_eq!(OnlineQuantization::parse("q4_k"), Some(Some(OnlineQuantization::Q4K)));
        assert_eq!(OnlineQuantization::parse("none"), Some(None));
        assert_eq!(OnlineQuantization::parse("q2_k"), None);
    }

    #[test]
    fn quantizes_rows_in_blocks_like_the_whole() {
        let (rows, cols) = (130, 256);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let m = MatrixBytes::from_f32(values.clone(), rows, cols);
        for dtype in [Dtype::Q4K, Dtype::Int4 { group: 128 }, Dtype::F8E4M3Scaled { block: 128 }] {
            let q = OnlineQuantization::quantize(&m, dtype).unwrap();
            assert_eq!(q.bytes(), kestrel_quant::quantize(dtype, &values, rows, cols).unwrap(), "{dtype}");
        }
    }
}
