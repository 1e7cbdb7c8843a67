//! Quantized linear layers of Hugging Face checkpoints: AutoRound / GPTQ / AWQ int4 and block
//! FP8 (Qwen's `*-FP8` releases).
//!
//! Which linears are quantized is read from the tensors themselves (a module with `qweight` is
//! int4, a `weight` stored as F8_E4M3 beside a `weight_scale_inv` is block FP8); the
//! `quantization_config` of config.json only says how (packing, bit width, group or block
//! size). Each quantized linear is repacked at load into a row format of kestrel-quant whose
//! rows carry their own scales, because the backends read a weight one row at a time: the CPU
//! dequantizes each row as its matmul reaches it, and the GPU takes the rows as it takes other
//! weights that are not bf16.

use super::{Dtype, MatrixBytes, SharedBytes, WeightError, WeightStore};
use serde_json::Value;

/// How int4 values, zero points and scales are laid out in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int4Packing {
    /// GPTQ layout with the v1 zero convention (stored zero = zero - 1): AutoRound's
    /// `auto_round:auto_gptq` and plain GPTQ checkpoints.
    GptqV1,
    /// GPTQ layout, zero stored as is (`auto_round`, `auto_round:gptqmodel`, GPTQ `gptq_v2`).
    GptqV2,
    /// AWQ layout (packed along the output dimension), zero stored as is.
    Awq,
}

/// What `quantization_config` says about the checkpoint's quantized linears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantizationConfig {
    /// 4-bit integer weights in groups of `group_size` inputs (`None`: one group per row).
    Int4 { packing: Int4Packing, group_size: Option<usize> },
    /// FP8 E4M3 weights with one scale per `[rows, cols]` block of the weight.
    Fp8Block { block: [usize; 2] },
}

impl QuantizationConfig {
    /// Reads config.json's `quantization_config` (None when the checkpoint has none). Methods and
    /// options this build cannot load are errors that say which.
    pub fn from_json(v: Option<&Value>) -> Result<Option<Self>, String> {
        let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
        let text = |key: &str| v.get(key).and_then(Value::as_str);
        let method = text("quant_method").ok_or("no `quant_method`")?;
        let int4 = |packing: Int4Packing| -> Result<Option<Self>, String> {
            let bits = v.get("bits").and_then(Value::as_u64).ok_or("no `bits`")?;
            if bits != 4 {
                return Err(format!("{bits}-bit weights are not supported (4-bit only)"));
            }
            if let Some(data_type) = text("data_type").filter(|t| *t != "int") {
                return Err(format!("data_type `{data_type}` is not supported (int only)"));
            }
            let group_size = match v.get("group_size").and_then(Value::as_i64) {
                Some(-1) => None,
                Some(g) if g >= 8 && g % 8 == 0 => Some(g as usize),
                Some(g) => return Err(format!("group_size {g} is not supported (a positive multiple of 8, or -1)")),
                None => return Err("no `group_size`".into()),
            };
            Ok(Some(QuantizationConfig::Int4 { packing, group_size }))
        };
        match method {
            "auto-round" | "intel/auto-round" => {
                // Older exports name the packing `backend`.
                let packing = text("packing_format").or_else(|| text("backend")).ok_or("an auto-round config without `packing_format`")?;
                match packing {
                    "auto_round:auto_gptq" | "auto_round:gptq" => int4(Int4Packing::GptqV1),
                    "auto_round" | "auto_round:gptqmodel" => int4(Int4Packing::GptqV2),
                    "auto_round:auto_awq" => int4(Int4Packing::Awq),
                    other => Err(format!("auto-round packing_format `{other}` is not supported (auto_round:auto_gptq, auto_round, auto_round:auto_awq)")),
                }
            }
            "gptq" => {
                if v.get("desc_act").and_then(Value::as_bool) == Some(true) {
                    return Err("GPTQ with desc_act (activation order) is not supported".into());
                }
                match text("checkpoint_format").unwrap_or("gptq") {
                    "gptq" => int4(Int4Packing::GptqV1),
                    "gptq_v2" => int4(Int4Packing::GptqV2),
                    other => Err(format!("GPTQ checkpoint_format `{other}` is not supported")),
                }
            }
            "awq" => match text("version").unwrap_or("gemm") {
                "gemm" => int4(Int4Packing::Awq),
                other => Err(format!("AWQ version `{other}` is not supported (gemm only)")),
            },
            "fp8" => {
                if let Some(fmt) = text("fmt").filter(|f| *f != "e4m3") {
                    return Err(format!("FP8 format `{fmt}` is not supported (e4m3 only)"));
                }
                let block = v.get("weight_block_size").and_then(Value::as_array).ok_or("an fp8 config without `weight_block_size` (per-tensor FP8 is not supported)")?;
                match block.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>().as_deref() {
                    Some(&[r, c]) if r > 0 && c > 0 => Ok(Some(QuantizationConfig::Fp8Block { block: [r as usize, c as usize] })),
                    _ => Err(format!("weight_block_size {block:?} is not two positive integers")),
                }
            }
            other => Err(format!("quant_method `{other}` is not supported (auto-round, gptq, awq, fp8)")),
        }
    }
}

impl std::fmt::Display for QuantizationConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantizationConfig::Int4 { packing, group_size } => {
                let packing = match packing {
                    Int4Packing::GptqV1 => "GPTQ packing, v1 zero points",
                    Int4Packing::GptqV2 => "GPTQ packing",
                    Int4Packing::Awq => "AWQ packing",
                };
                match group_size {
                    Some(g) => write!(f, "int4 in groups of {g} ({packing})"),
                    None => write!(f, "int4 per output channel ({packing})"),
                }
            }
            QuantizationConfig::Fp8Block { block: [r, c] } => write!(f, "FP8 E4M3 with {r}x{c} block scales"),
        }
    }
}

impl WeightStore {
    /// Whether the linear `name` (its `.weight` name) exists, quantized or not.
    pub fn contains_linear(&self, name: &str) -> bool {
        self.contains(name) || name.strip_suffix(".weight").is_some_and(|m| self.ints.contains_key(&format!("{m}.qweight")))
    }

    /// The linear `name` (its `.weight` name) as a `[rows, cols]` matrix: the stored bytes for
    /// a dense weight, repacked rows for a quantized one.
    pub fn linear(&self, name: &str, rows: usize, cols: usize, quant: Option<&QuantizationConfig>) -> Result<MatrixBytes, WeightError> {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let quant_error = |reason: String| WeightError::Quantized { tensor: name.to_string(), reason };
        if self.ints.contains_key(&format!("{module}.qweight")) {
            let Some(QuantizationConfig::Int4 { packing, group_size }) = quant else {
                return Err(quant_error("it is stored as int4 (`qweight`) but config.json has no int4 `quantization_config`".into()));
            };
            // Per-channel checkpoints (group_size -1) are one group per row.
            let group = group_size.unwrap_or(cols);
            let rows_bytes = self.int4_rows(module, rows, cols, *packing, group)?;
            // A partial last group (cols not a multiple of the group) makes the rows' groups
            // narrower; see kestrel_quant::int4_row_group.
            let row_group = kestrel_quant::int4_row_group(cols, group);
            return Ok(MatrixBytes { data: SharedBytes::from_vec(rows_bytes), start: 0, dtype: Dtype::Int4 { group: row_group as u32 }, rows, cols });
        }
        let view = self.get(name)?;
        view.expect_shape(&[rows, cols])?;
        if view.dtype != Dtype::F8E4M3 {
            return view.matrix(rows, cols);
        }
        let Some(QuantizationConfig::Fp8Block { block: [block_rows, block_cols] }) = quant else {
            return Err(quant_error("it is stored as F8_E4M3 but config.json has no block-FP8 `quantization_config`".into()));
        };
        let (block_rows, block_cols) = (*block_rows, *block_cols);
        let scale_view = self.get(&format!("{module}.weight_scale_inv"))?;
        scale_view.expect_shape(&[rows.div_ceil(block_rows), cols.div_ceil(block_cols)])?;
        let scales = scale_view.to_f32()?;
        // Rows of the kestrel-quant format hold whole scale blocks; where the width is not a
        // multiple of the checkpoint's block (its last block is partial), the row blocks
        // shrink to a width that divides both, each taking the scale of the block it lies in.
        let row_block = gcd(cols, block_cols);
        let per_row = cols / row_block;
        let fine: Vec<f32> = (0..rows.div_ceil(block_rows)).flat_map(|i| (0..per_row).map(move |j| (i, j * row_block / block_cols))).map(|(i, j)| scales[i * cols.div_ceil(block_cols) + j]).collect();
        let bytes = kestrel_quant::fp8_block_rows(view.bytes, &fine, rows, cols, block_rows, row_block).map_err(|e| quant_error(e.to_string()))?;
        Ok(MatrixBytes { data: SharedBytes::from_vec(bytes), start: 0, dtype: Dtype::F8E4M3Scaled { block: row_block as u32 }, rows, cols })
    }

    /// The int4 linear `module` repacked into `Dtype::Int4` rows (n = rows outputs, k = cols inputs).
    fn int4_rows(&self, module: &str, n: usize, k: usize, packing: Int4Packing, group: usize) -> Result<Vec<u8>, WeightError> {
        let quant_error = |reason: String| WeightError::Quantized { tensor: format!("{module}.qweight"), reason };
        if group == 0 {
            return Err(quant_error("its group size is 0".into()));
        }
        // GPTQ and AutoRound quantize a layer whose width is not a multiple of the group with a
        // partial last group.
        let groups = k.div_ceil(group);
        let qweight = self.int32(&format!("{module}.qweight"))?;
        let qzeros = self.int32(&format!("{module}.qzeros"))?;
        let scales = self.get(&format!("{module}.scales"))?;
        let (qweight_shape, qzeros_shape) = match packing {
            Int4Packing::GptqV1 | Int4Packing::GptqV2 => ([k / 8, n], [groups, n / 8]),
            Int4Packing::Awq => ([k, n / 8], [groups, n / 8]),
        };
        qweight.expect_shape(&qweight_shape)?;
        qzeros.expect_shape(&qzeros_shape)?;
        scales.expect_shape(&[groups, n])?;
        if !matches!(scales.dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32) {
            return Err(quant_error(format!("scales are {}, expected F16, BF16 or F32", scales.dtype)));
        }
        // Activation-order checkpoints permute the inputs' groups; the row format keeps groups
        // contiguous, so only the identity order (g_idx[i] == i / group) loads.
        if let Ok(g_idx) = self.int32(&format!("{module}.g_idx")) {
            let trivial = g_idx.bytes.chunks_exact(4).enumerate().all(|(i, b)| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize == i / group);
            if g_idx.bytes.len() != 4 * k || !trivial {
                return Err(quant_error("its g_idx reorders the input groups (activation order), which is not supported".into()));
            }
        }
        let converted = match packing {
            Int4Packing::GptqV1 => kestrel_quant::gptq_int4_rows(qweight.bytes, qzeros.bytes, scales.bytes, scales.dtype, k, n, group, 1),
            Int4Packing::GptqV2 => kestrel_quant::gptq_int4_rows(qweight.bytes, qzeros.bytes, scales.bytes, scales.dtype, k, n, group, 0),
            Int4Packing::Awq => kestrel_quant::awq_int4_rows(qweight.bytes, qzeros.bytes, scales.bytes, scales.dtype, k, n, group),
        };
        converted.map_err(|e| quant_error(e.to_string()))
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<QuantizationConfig>, String> {
        QuantizationConfig::from_json(Some(&v))
    }

    #[test]
    fn reads_each_supported_method() {
        assert_eq!(QuantizationConfig::from_json(None), Ok(None));
        let autoround = json!({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128, "sym": true, "data_type": "int"});
        assert_eq!(parse(autoround), Ok(Some(QuantizationConfig::Int4 { packing: Int4Packing::GptqV1, group_size: Some(128) })));
        let v2 = json!({"quant_method": "auto-round", "packing_format": "auto_round", "bits": 4, "group_size": -1});
        assert_eq!(parse(v2), Ok(Some(QuantizationConfig::Int4 { packing: Int4Packing::GptqV2, group_size: None })));
        let awq = json!({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"});
        assert_eq!(parse(awq), Ok(Some(QuantizationConfig::Int4 { packing: Int4Packing::Awq, group_size: Some(64) })));
        let gptq = json!({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": false});
        assert_eq!(parse(gptq), Ok(Some(QuantizationConfig::Int4 { packing: Int4Packing::GptqV1, group_size: Some(32) })));
        let fp8 = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        assert_eq!(parse(fp8), Ok(Some(QuantizationConfig::Fp8Block { block: [128, 128] })));
    }

    #[test]
    fn refuses_what_it_cannot_load_and_says_why() {
        for (config, says) in [
            (json!({"bits": 4}), "quant_method"),
            (json!({"quant_method": "bitsandbytes"}), "bitsandbytes"),
            (json!({"quant_method": "auto-round", "bits": 4, "group_size": 128}), "packing_format"),
            (json!({"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 4, "group_size": 128}), "llm_compressor"),
            (json!({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 3, "group_size": 128}), "3-bit"),
            (json!({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 100}), "group_size 100"),
            (json!({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128, "data_type": "nv_fp"}), "nv_fp"),
            (json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true}), "desc_act"),
            (json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}), "gemv"),
            (json!({"quant_method": "fp8", "activation_scheme": "dynamic"}), "weight_block_size"),
            (json!({"quant_method": "fp8", "weight_block_size": [128]}), "two positive"),
            (json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}), "e5m2"),
        ] {
            let err = parse(config.clone()).expect_err(&config.to_string());
            assert!(err.contains(says), "{config}: {err}");
        }
    }

    #[test]
    fn gcd_of_widths_and_blocks() {
        assert_eq!(gcd(64, 128), 64);
        assert_eq!(gcd(200, 128), 8);
        assert_eq!(gcd(256, 128), 128);
    }
}
