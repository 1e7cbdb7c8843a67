//! The type table and the reader against files written by gguf-py, llama.cpp's own Python package.

use super::*;
use serde_json::{json, Value as Json};

// ----------------------------------------------------------------------------------------------
// Type table

#[test]
fn type_table_covers_the_reference_ids() {
    let known: Vec<u32> = (0..=3).chain(6..=30).chain([34, 35, 39, 40, 41]).collect();
    assert_eq!(ggml_types().iter().map(|t| t.id).collect::<Vec<_>>(), known);
    for id in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
        assert_eq!(ggml_type_info(id), None, "id {id}");
    }
    let q4k = ggml_type_info(12).unwrap();
    assert_eq!((q4k.name, q4k.block_elems, q4k.block_bytes), ("Q4_K", 256, 144));
}

#[test]
fn type_table_agrees_with_the_quant_crate() {
    for t in ggml_types() {
        if let Some(dtype) = Dtype::from_ggml_type(t.id) {
            assert_eq!((dtype.block_elems() as u64, dtype.block_bytes() as u64), (t.block_elems, t.block_bytes), "{}", t.name);
            assert_eq!(dtype.name(), t.name);
        }
    }
    assert_eq!(Dtype::from_ggml_type(0), Some(Dtype::F32));
    assert_eq!(Dtype::from_ggml_type(1), Some(Dtype::F16));
    assert_eq!(Dtype::from_ggml_type(30), Some(Dtype::BF16));
}

// ----------------------------------------------------------------------------------------------
// Cross-check against gguf-py (scripts/make_gguf_fixture.py)

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

/// A value in the fixture JSON's notation: `{"type", "value"}`, arrays with `elem_type` and
/// their elements (arrays of arrays: one such object per inner array).
fn to_json(value: &GgufValue) -> Json {
    match value {
        GgufValue::Array(a) => array_json(a),
        GgufValue::String(s) => json!({"type": "string", "value": s}),
        GgufValue::Bool(b) => json!({"type": "bool", "value": b}),
        GgufValue::F32(v) => json!({"type": "f32", "value": f64::from(*v)}),
        GgufValue::F64(v) => json!({"type": "f64", "value": v}),
        GgufValue::U64(v) => json!({"type": "u64", "value": v}),
        GgufValue::I64(v) => json!({"type": "i64", "value": v}),
        other => json!({"type": other.value_type().name(), "value": other.as_integer().map(|v| v as i64)}),
    }
}

fn array_json(array: &GgufArray) -> Json {
    let values: Vec<Json> = match array {
        GgufArray::Array(inner) => inner.iter().map(array_json).collect(),
        GgufArray::String(v) => v.iter().map(|s| json!(s)).collect(),
        GgufArray::Bool(v) => v.iter().map(|b| json!(b)).collect(),
        GgufArray::F32(v) => v.iter().map(|&x| json!(f64::from(x))).collect(),
        GgufArray::F64(v) => v.iter().map(|x| json!(x)).collect(),
        GgufArray::U64(v) => v.iter().map(|x| json!(x)).collect(),
        other => other.to_integers().unwrap_or_default().into_iter().map(|x| json!(x as i64)).collect(),
    };
    json!({"type": "array", "elem_type": array.elem_type().name(), "value": values})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn gguf_py_fixture_matches_its_description() {
    let dir = fixture_dir();
    let want: Json = serde_json::from_str(&std::fs::read_to_string(dir.join("tiny.json")).unwrap()).unwrap();
    let file = GgufFile::open(dir.join("tiny.gguf")).unwrap();

    assert_eq!(json!(file.version()), want["version"]);
    assert_eq!(json!(file.alignment()), want["alignment"]);
    assert_eq!(json!(file.data_offset()), want["data_offset"]);
    assert_eq!(json!(file.shared_bytes().as_slice().len()), want["file_size"]);
    assert_eq!(file.architecture().unwrap(), "qwen35");

    let want_meta = want["metadata"].as_array().unwrap();
    assert_eq!(file.metadata().count(), want_meta.len());
    for m in want_meta {
        let key = m["key"].as_str().unwrap();
        let got = file.get(key).unwrap_or_else(|| panic!("missing {key}"));
        let mut want_value = m.clone();
        want_value.as_object_mut().unwrap().remove("key");
        assert_eq!(to_json(got), want_value, "{key}");
    }
    assert_eq!(file.get_str_array("tokenizer.ggml.tokens").unwrap()[4], "日本");
    assert_eq!(file.get_int_array("qwen35.rope.dimension_sections").unwrap(), [11, 11, 10, 0]);
    assert_eq!(file.get_u64("kestrel.test.u64").unwrap(), (1 << 63) + 5);
    assert_eq!(file.get_f32("qwen35.attention.layer_norm_rms_epsilon").unwrap(), 2f32.powi(-20));
    assert_eq!(file.get_str("kestrel.test.empty_string").unwrap(), "");

    let want_tensors = want["tensors"].as_array().unwrap();
    assert_eq!(file.tensor_count(), want_tensors.len());
    for (got, t) in file.tensors().zip(want_tensors) {
        let name = t["name"].as_str().unwrap();
        assert_eq!(got.name(), name);
        assert_eq!(json!(got.ggml_type()), t["ggml_type"], "{name}");
        assert_eq!(got.type_name(), t["type_name"].as_str().unwrap(), "{name}");
        assert_eq!(json!(got.dims()), t["ne"], "{name}");
        assert_eq!(json!(got.n_elements()), t["n_elements"], "{name}");
        assert_eq!(json!(got.offset()), t["offset"], "{name}");
        let range = got.byte_range().unwrap();
        assert_eq!(json!(range.start), t["data_offset"], "{name}");
        assert_eq!(json!(range.len()), t["n_bytes"], "{name}");
        let (_, bytes) = file.tensor(name).unwrap();
        assert_eq!(hex(bytes), t["hex"].as_str().unwrap(), "{name}");
    }
    let (embd, _) = file.tensor("token_embd.weight").unwrap();
    assert_eq!((embd.shape(), embd.dtype()), (&[10usize, 8][..], Some(Dtype::F32)));
}

#[test]
fn type_table_matches_gguf_py() {
    let want: Json = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("tiny.json")).unwrap()).unwrap();
    let sizes = want["ggml_quant_sizes"].as_object().unwrap();
    assert_eq!(sizes.len(), ggml_types().len());
    for t in ggml_types() {
        let (elems, bytes) = (&sizes[&t.id.to_string()][0], &sizes[&t.id.to_string()][1]);
        assert_eq!(*elems, json!(t.block_elems), "{}", t.name);
        if t.name == "Q8_1" {
            // gguf-py still says 40 (f32 scales); ggml's block_q8_1 is two f16 and 32 bytes.
            assert_eq!((bytes.clone(), t.block_bytes), (json!(40), 36));
        } else {
            assert_eq!(*bytes, json!(t.block_bytes), "{}", t.name);
        }
    }
}

#[test]
fn gguf_py_big_endian_fixture_is_refused() {
    let err = GgufFile::open(fixture_dir().join("tiny-be.gguf")).unwrap_err();
    assert!(matches!(err, GgufError::BigEndian { .. }), "{err}");
    assert!(err.to_string().contains("tiny-be.gguf"));
}
