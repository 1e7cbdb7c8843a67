use super::*;

const PATH: &str = "test.gguf";

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::parse(SharedBytes::from_vec(bytes), PATH)
}

fn parse_err(bytes: Vec<u8>) -> GgufError {
    match parse(bytes) {
        Ok(file) => panic!("expected an error, parsed {file:?}"),
        Err(e) => {
            assert!(e.to_string().contains(PATH), "error does not name the file: {e}");
            e
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Position of the first occurrence of `needle`.
fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{needle:?} not in file"))
}

fn patch(bytes: &mut [u8], at: usize, with: &[u8]) {
    bytes[at..at + with.len()].copy_from_slice(with);
}

/// Where the tensor info of `name` keeps its n_dims, its dims, its type and its offset.
struct InfoFields {
    n_dims: usize,
    ggml_type: usize,
    offset: usize,
}

fn info_fields(bytes: &[u8], name: &str, n_dims: usize) -> InfoFields {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = find(bytes, &needle) + needle.len();
    InfoFields { n_dims: at, ggml_type: at + 4 + 8 * n_dims, offset: at + 8 + 8 * n_dims }
}

fn basic() -> GgufWriter {
    GgufWriter::new()
        .metadata("general.architecture", "qwen35")
        .metadata("qwen35.block_count", 2u32)
        .metadata("general.name", "tiny")
        .tensor("a.weight", &[4, 2], 0, f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]))
        .tensor("b.weight", &[3], 0, f32_bytes(&[9., 10., 11.]))
}

fn nested(depth: usize) -> GgufArray {
    (0..depth).fold(GgufArray::I32(vec![1, 2]), |inner, _| GgufArray::Array(vec![inner]))
}

// ----------------------------------------------------------------------------------------------
// Round trips and accessors

#[test]
fn round_trips_every_value_type() {
    let values: Vec<(&str, GgufValue)> = vec![
        ("t.u8", 200u8.into()),
        ("t.i8", (-100i8).into()),
        ("t.u16", 60000u16.into()),
        ("t.i16", (-30000i16).into()),
        ("t.u32", 4_000_000_000u32.into()),
        ("t.i32", (-7i32).into()),
        ("t.f32", 0.25f32.into()),
        ("t.bool", true.into()),
        ("t.string", "héllo 🦅".into()),
        ("t.empty", "".into()),
        ("t.u64", u64::MAX.into()),
        ("t.i64", i64::MIN.into()),
        ("t.f64", 0.1f64.into()),
        ("a.u8", vec![0u8, 255].into()),
        ("a.i8", vec![-1i8, 1].into()),
        ("a.u16", vec![1u16, 65535].into()),
        ("a.i16", vec![-2i16].into()),
        ("a.u32", vec![1u32, 2, 3].into()),
        ("a.i32", vec![-1i32, 0, 1].into()),
        ("a.f32", vec![0.5f32, -1.5].into()),
        ("a.bool", vec![true, false, true].into()),
        ("a.string", vec!["<s>", "", "日本"].into()),
        ("a.u64", vec![u64::MAX].into()),
        ("a.i64", vec![i64::MIN, 5].into()),
        ("a.f64", vec![1e300f64].into()),
        ("a.empty", GgufArray::F32(vec![]).into()),
        ("a.nested", vec![GgufArray::I32(vec![1, 2, 3]), GgufArray::String(vec!["x".into()]), nested(2)].into()),
    ];
    let writer = values.iter().fold(GgufWriter::new(), |w, (k, v)| w.metadata(k, v.clone()));
    let file = parse(writer.to_bytes()).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.tensor_count(), 0);
    let read: Vec<(&str, &GgufValue)> = file.metadata().collect();
    assert_eq!(read.len(), values.len());
    for ((key, want), (got_key, got)) in values.iter().zip(read) {
        assert_eq!(*key, got_key, "metadata order");
        assert_eq!(want, got, "{key}");
        assert_eq!(file.get(key), Some(want));
    }
    assert_eq!(file.get("t.missing"), None);
    assert!(file.contains_key("t.u8") && !file.contains_key("t.missing"));
}

#[test]
fn integer_accessors_accept_any_width_that_fits() {
    let file = parse(
        GgufWriter::new()
            .metadata("u8", 7u8)
            .metadata("u16", 700u16)
            .metadata("i32", 70i32)
            .metadata("neg", -1i32)
            .metadata("u64small", 7u64)
            .metadata("u64big", u64::MAX)
            .metadata("i64big", i64::MAX)
            .metadata("f32", 1.5f32)
            .to_bytes(),
    )
    .unwrap();
    assert_eq!(file.get_u32("u8").unwrap(), 7);
    assert_eq!(file.get_u32("u16").unwrap(), 700);
    assert_eq!(file.get_u32("i32").unwrap(), 70);
    assert_eq!(file.get_u32("u64small").unwrap(), 7);
    assert_eq!(file.get_u64("u64big").unwrap(), u64::MAX);
    assert_eq!(file.get_u64("i64big").unwrap(), i64::MAX as u64);
    assert_eq!(file.get_i64("neg").unwrap(), -1);
    for (key, getter) in [("neg", 0), ("u64big", 0), ("neg", 1), ("u64big", 2), ("f32", 0)] {
        let err = match getter {
            0 => file.get_u32(key).map(|_| ()),
            1 => file.get_u64(key).map(|_| ()),
            _ => file.get_i64(key).map(|_| ()),
        }
        .unwrap_err();
        assert!(matches!(&err, GgufError::Metadata { key: k, .. } if k == key), "{err}");
    }
    let msg = file.get_u32("neg").unwrap_err().to_string();
    assert!(msg.contains("`neg`") && msg.contains("i32 -1") && msg.contains(PATH), "{msg}");
}

#[test]
fn typed_accessors_name_the_wrong_type() {
    let file = parse(
        GgufWriter::new()
            .metadata("general.architecture", "qwen35")
            .metadata("f32", 0.5f32)
            .metadata("f64", 0.25f64)
            .metadata("flag", true)
            .metadata("tokens", vec!["a", "b"])
            .metadata("scores", vec![0.5f32])
            .metadata("types", vec![1i32, -2])
            .metadata("ids", vec![3u32, 4])
            .metadata("big", vec![u64::MAX])
            .metadata("n", 7u32)
            .to_bytes(),
    )
    .unwrap();
    assert_eq!(file.architecture().unwrap(), "qwen35");
    assert_eq!(file.get_str("general.architecture").unwrap(), "qwen35");
    assert_eq!(file.get_f32("f32").unwrap(), 0.5);
    assert_eq!(file.get_f32("f64").unwrap(), 0.25);
    assert!(file.get_bool("flag").unwrap());
    assert_eq!(file.get_str_array("tokens").unwrap(), ["a", "b"]);
    assert_eq!(file.get_f32_array("scores").unwrap(), [0.5]);
    assert_eq!(file.get_i32_array("types").unwrap(), [1, -2]);
    assert_eq!(file.get_u32_array("ids").unwrap(), [3, 4]);
    assert_eq!(file.get_int_array("types").unwrap(), [1, -2]);
    assert_eq!(file.get_int_array("ids").unwrap(), [3, 4]);
    assert_eq!(file.get_array("ids").unwrap().len(), 2);

    let wrong: Vec<(&str, GgufError)> = vec![
        ("n", file.get_str("n").unwrap_err()),
        ("n", file.get_f32("n").unwrap_err()),
        ("n", file.get_bool("n").unwrap_err()),
        ("n", file.get_array("n").unwrap_err()),
        ("tokens", file.get_u32("tokens").unwrap_err()),
        ("types", file.get_str_array("types").unwrap_err()),
        ("types", file.get_u32_array("types").unwrap_err()),
        ("ids", file.get_i32_array("ids").unwrap_err()),
        ("types", file.get_f32_array("types").unwrap_err()),
        ("tokens", file.get_int_array("tokens").unwrap_err()),
        ("big", file.get_int_array("big").unwrap_err()),
    ];
    for (key, err) in wrong {
        assert!(matches!(&err, GgufError::Metadata { key: k, .. } if k == key), "{err}");
    }
    let msg = file.get_str("n").unwrap_err().to_string();
    assert!(msg.contains("expected a string, found u32 7"), "{msg}");
    let msg = file.get_u32("tokens").unwrap_err().to_string();
    assert!(msg.contains("array of 2 string"), "{msg}");
}

#[test]
fn missing_keys_are_errors_unless_optional() {
    let file = parse(GgufWriter::new().metadata("n", 7u32).metadata("s", "x").to_bytes()).unwrap();
    let err = file.get_u32("absent").unwrap_err();
    assert!(matches!(&err, GgufError::MissingKey { key, .. } if key == "absent"), "{err}");
    assert!(matches!(file.architecture(), Err(GgufError::MissingKey { .. })));
    assert_eq!(file.get_u32("absent").optional().unwrap(), None);
    assert_eq!(file.get_u32("n").optional().unwrap(), Some(7));
    assert!(matches!(file.get_u32("s").optional(), Err(GgufError::Metadata { .. })));
}

#[test]
fn architecture_must_be_a_string() {
    let file = parse(GgufWriter::new().metadata("general.architecture", 3u32).to_bytes()).unwrap();
    assert!(matches!(file.architecture(), Err(GgufError::Metadata { .. })));
}

#[test]
fn tensors_are_zero_copy_slices_with_row_major_shapes() {
    let q8 = vec![0x5au8; 2 * 34];
    let bytes = basic()
        .tensor("half", &[2, 1, 1, 1], 1, vec![0, 0x3c, 0, 0xc0])
        .tensor("bf", &[2], 30, vec![0x80, 0x3f, 0, 0])
        .tensor("q8", &[32, 2], 8, q8.clone())
        .to_bytes();
    let file = parse(bytes).unwrap();
    assert_eq!(file.tensor_count(), 5);
    let names: Vec<&str> = file.tensors().map(GgufTensor::name).collect();
    assert_eq!(names, ["a.weight", "b.weight", "half", "bf", "q8"]);

    let (a, a_bytes) = file.tensor("a.weight").unwrap();
    assert_eq!(a.dims(), [4, 2]);
    assert_eq!(a.shape(), [2, 4]);
    assert_eq!(a.n_elements(), 8);
    assert_eq!(a.ggml_type(), 0);
    assert_eq!(a.type_name(), "F32");
    assert_eq!(a.dtype(), Some(Dtype::F32));
    assert_eq!(a_bytes, f32_bytes(&[1., 2., 3., 4., 5., 6., 7., 8.]));
    assert_eq!(a.offset(), 0);
    assert_eq!(a.byte_range().unwrap().start, file.data_offset());

    // The slice points into the file's own buffer: no copy was made.
    let whole = file.shared_bytes().as_slice().as_ptr_range();
    for t in file.tensors() {
        let slice = file.tensor_bytes(t).unwrap();
        assert!(whole.contains(&slice.as_ptr()), "{} was copied", t.name());
        assert_eq!(slice.as_ptr(), file.shared_bytes().as_slice()[t.byte_range().unwrap()].as_ptr());
        assert_eq!(t.offset() % u64::from(file.alignment()), 0);
    }

    let (b, _) = file.tensor("b.weight").unwrap();
    assert_eq!(b.offset(), 32, "a.weight's 32 bytes end on the alignment");
    let (h, h_bytes) = file.tensor("half").unwrap();
    assert_eq!(h.shape(), [1, 1, 1, 2]);
    assert_eq!(h.dtype(), Some(Dtype::F16));
    assert_eq!(h_bytes, [0, 0x3c, 0, 0xc0]);
    assert_eq!(file.tensor_info("bf").unwrap().dtype(), Some(Dtype::BF16));
    let (q, q_bytes) = file.tensor("q8").unwrap();
    assert_eq!((q.type_name().as_str(), q.n_bytes(), q.shape()), ("Q8_0", Some(68), &[2usize, 32][..]));
    assert_eq!(q.dtype(), Dtype::from_ggml_type(8));
    assert_eq!(q_bytes, q8);
}

#[test]
fn open_maps_a_file_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, basic().to_bytes()).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.path(), path);
    assert_eq!(file.get_u32("qwen35.block_count").unwrap(), 2);
    assert_eq!(file.tensor("b.weight").unwrap().1, f32_bytes(&[9., 10., 11.]));

    let missing = dir.path().join("absent.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    assert!(matches!(err, GgufError::Open { .. }) && err.to_string().contains("absent.gguf"), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let file = parse(basic().to_bytes()).unwrap();
    let err = file.tensor("nope").unwrap_err();
    assert!(matches!(&err, GgufError::MissingTensor { tensor, .. } if tensor == "nope"), "{err}");
    assert!(file.tensor_info("nope").is_none());
}

// ----------------------------------------------------------------------------------------------
// Alignment and layout

#[test]
fn alignment_defaults_to_32_and_follows_the_metadata() {
    let file = parse(basic().to_bytes()).unwrap();
    assert_eq!(file.alignment(), DEFAULT_ALIGNMENT);
    assert_eq!(file.data_offset() % 32, 0);

    for alignment in [64u32, 24, 8] {
        let file = parse(basic().metadata(ALIGNMENT_KEY, alignment).to_bytes()).unwrap();
        assert_eq!(file.alignment(), alignment);
        assert_eq!(file.data_offset() % alignment as usize, 0);
        let b = file.tensor_info("b.weight").unwrap();
        assert_eq!(b.offset(), 32u64.next_multiple_of(alignment.into()));
        assert_eq!(file.tensor("b.weight").unwrap().1, f32_bytes(&[9., 10., 11.]));
    }
}

#[test]
fn data_section_starts_at_the_aligned_end_of_the_header() {
    let bytes = basic().to_bytes();
    let file = parse(bytes.clone()).unwrap();
    // The last tensor info ends with b.weight's offset field.
    let header_end = info_fields(&bytes, "b.weight", 1).offset + 8;
    assert_eq!(file.data_offset(), header_end.next_multiple_of(32));
}

#[test]
fn bad_alignment_is_rejected() {
    for value in [GgufValue::U32(0), GgufValue::U32(12), GgufValue::U32(33), GgufValue::U64(32), GgufValue::I32(32)] {
        let err = parse_err(basic().metadata(ALIGNMENT_KEY, value.clone()).to_bytes());
        assert!(matches!(err, GgufError::BadAlignment { .. }), "{value:?}: {err}");
    }
}

#[test]
fn misaligned_tensor_offset_is_rejected() {
    let mut bytes = basic().to_bytes();
    let at = info_fields(&bytes, "b.weight", 1).offset;
    patch(&mut bytes, at, &40u64.to_le_bytes());
    let err = parse_err(bytes);
    assert!(matches!(&err, GgufError::MisalignedTensor { tensor, offset: 40, alignment: 32, .. } if tensor == "b.weight"), "{err}");
}

#[test]
fn tensor_past_the_end_is_rejected() {
    // Declares 16 elements (64 bytes) but holds 3, padded to 32 bytes: the range runs past the file.
    let err = parse_err(basic().tensor("short", &[16], 0, f32_bytes(&[1., 2., 3.])).to_bytes());
    assert!(matches!(&err, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "short"), "{err}");

    let mut bytes = basic().to_bytes();
    let at = info_fields(&bytes, "a.weight", 2).offset;
    patch(&mut bytes, at, &(1u64 << 40).to_le_bytes());
    let err = parse_err(bytes);
    assert!(matches!(&err, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "a.weight"), "{err}");
}

#[test]
fn cutting_into_tensor_data_names_the_cut_tensor() {
    let bytes = basic().to_bytes();
    let file = parse(bytes.clone()).unwrap();
    let b_end = file.tensor_info("b.weight").unwrap().byte_range().unwrap().end;
    // Padding after the last tensor is not needed.
    assert!(parse(bytes[..b_end].to_vec()).is_ok());
    for cut in file.data_offset()..b_end {
        let err = parse_err(bytes[..cut].to_vec());
        assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "cut at {cut}: {err}");
    }
}

// ----------------------------------------------------------------------------------------------
// Header errors

#[test]
fn bad_magic_is_rejected() {
    let mut bytes = basic().to_bytes();
    bytes[0] = b'X';
    let err = parse_err(bytes);
    assert!(matches!(&err, GgufError::BadMagic { found, .. } if found == b"XGUF"), "{err}");
    let err = parse_err(b"PK\x03\x04 not a gguf".to_vec());
    assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
}

#[test]
fn big_endian_files_are_recognized() {
    // Byte-swapped version after the "GGUF" bytes (what gguf-py writes).
    let mut bytes = basic().to_bytes();
    patch(&mut bytes, 4, &3u32.to_be_bytes());
    assert!(matches!(parse_err(bytes), GgufError::BigEndian { .. }));
    // Magic stored as a big-endian u32.
    let mut bytes = basic().to_bytes();
    patch(&mut bytes, 0, &GGUF_MAGIC.to_be_bytes());
    assert!(matches!(parse_err(bytes), GgufError::BigEndian { .. }));
}

#[test]
fn versions_other_than_2_and_3_are_rejected() {
    let v2 = parse(basic().version(2).to_bytes()).unwrap();
    assert_eq!(v2.version(), 2);
    assert_eq!(v2.tensor("b.weight").unwrap().1, f32_bytes(&[9., 10., 11.]));
    for version in [0u32, 1, 4, 0xFFFF_FFFF] {
        let err = parse_err(basic().version(version).to_bytes());
        assert!(matches!(err, GgufError::UnsupportedVersion { version: v, .. } if v == version), "{version}: {err}");
    }
}

#[test]
fn every_truncation_of_the_header_is_reported() {
    let bytes = basic().metadata("list", vec!["a", "bc"]).metadata("nums", vec![1u32, 2]).to_bytes();
    let file = parse(bytes.clone()).unwrap();
    let header_end = info_fields(&bytes, "b.weight", 1).offset + 8;
    for cut in 0..header_end {
        let err = parse_err(bytes[..cut].to_vec());
        assert!(matches!(err, GgufError::Truncated { .. }), "cut at {cut}: {err}");
    }
    // Into the padding before the data section: the tensors no longer fit.
    for cut in header_end..file.data_offset() {
        assert!(matches!(parse_err(bytes[..cut].to_vec()), GgufError::TensorOutOfBounds { .. }), "cut at {cut}");
    }
}

#[test]
fn truncation_names_the_part() {
    let bytes = basic().to_bytes();
    let part_at = |cut: usize| match parse_err(bytes[..cut].to_vec()) {
        GgufError::Truncated { part, .. } => part,
        other => panic!("cut at {cut}: {other}"),
    };
    assert_eq!(part_at(2), "the magic");
    assert_eq!(part_at(6), "the version");
    assert_eq!(part_at(10), "the tensor count");
    assert_eq!(part_at(20), "the metadata count");
    assert_eq!(part_at(26), "metadata key #0");
    let value_at = find(&bytes, b"general.architecture") + "general.architecture".len() + 4;
    assert_eq!(part_at(value_at + 9), "metadata `general.architecture`");
    assert_eq!(part_at(value_at - 2), "the type of metadata `general.architecture`");
    let fields = info_fields(&bytes, "a.weight", 2);
    assert_eq!(part_at(fields.n_dims - 1), "the name of tensor #0");
    assert_eq!(part_at(fields.ggml_type), "the info of tensor `a.weight`");
    let msg = parse_err(bytes[..fields.offset].to_vec()).to_string();
    assert!(msg.contains("truncated in the info of tensor `a.weight`") && msg.contains(PATH), "{msg}");
}

#[test]
fn huge_counts_fail_without_allocating() {
    // Tensor and metadata counts: parsing runs on into the following bytes and fails there
    // (which error depends on what it finds), without reserving room for 2^64 entries first.
    for at in [8, 16] {
        let mut bytes = basic().to_bytes();
        patch(&mut bytes, at, &u64::MAX.to_le_bytes());
        parse_err(bytes);
    }

    for value in [GgufValue::from(vec!["a", "b"]), vec![1u32, 2].into(), vec![true].into(), vec![GgufArray::U8(vec![1])].into(), "text".into()] {
        let mut bytes = GgufWriter::new().metadata("k", value.clone()).to_bytes();
        // The count (or string length) follows the key, the value type and (for arrays) the element type.
        let at = 24 + 8 + 1 + 4 + if matches!(value, GgufValue::Array(_)) { 4 } else { 0 };
        for count in [u64::MAX, u64::MAX / 4 + 1, 1 << 40] {
            patch(&mut bytes, at, &count.to_le_bytes());
            let err = parse_err(bytes.clone());
            assert!(matches!(&err, GgufError::Truncated { part, .. } if part == "metadata `k`"), "{value:?} count {count}: {err}");
        }
    }
}

#[test]
fn invalid_utf8_is_reported_where_it_is() {
    let cases: [(GgufWriter, &[u8], &str); 4] = [
        (GgufWriter::new().metadata("key\u{7f}", 1u8), b"key\x7f", "metadata key #0"),
        (GgufWriter::new().metadata("k", "val\u{7f}"), b"val\x7f", "metadata `k`"),
        (GgufWriter::new().metadata("k", vec!["ok", "bad\u{7f}"]), b"bad\x7f", "metadata `k`"),
        (basic().tensor("name\u{7f}", &[1], 0, vec![0; 4]), b"name\x7f", "the name of tensor #2"),
    ];
    for (writer, marker, want_part) in cases {
        let mut bytes = writer.to_bytes();
        let at = find(&bytes, marker) + marker.len() - 1;
        bytes[at] = 0xFF;
        let err = parse_err(bytes);
        assert!(matches!(&err, GgufError::BadString { part, .. } if part == want_part), "{err}");
    }
}

#[test]
fn unknown_value_types_are_rejected() {
    let mut bytes = GgufWriter::new().metadata("k", 5u32).to_bytes();
    patch(&mut bytes, 24 + 8 + 1, &13u32.to_le_bytes());
    let err = parse_err(bytes);
    assert!(matches!(&err, GgufError::UnknownValueType { value_type: 13, part, .. } if part == "metadata `k`"), "{err}");

    let mut bytes = GgufWriter::new().metadata("k", vec![1u32]).to_bytes();
    patch(&mut bytes, 24 + 8 + 1 + 4, &99u32.to_le_bytes());
    assert!(matches!(parse_err(bytes), GgufError::UnknownValueType { value_type: 99, .. }));
}

#[test]
fn bools_other_than_0_and_1_are_rejected() {
    for value in [GgufValue::Bool(true), vec![false, true].into()] {
        let mut bytes = GgufWriter::new().metadata("k", value).to_bytes();
        let last = bytes.iter().rposition(|&b| b == 1).unwrap();
        bytes[last] = 2;
        let err = parse_err(bytes);
        assert!(matches!(&err, GgufError::BadValue { part, reason, .. } if part == "metadata `k`" && reason.contains("bool")), "{err}");
    }
}

#[test]
fn array_nesting_is_capped() {
    let ok = parse(GgufWriter::new().metadata("k", nested(MAX_ARRAY_DEPTH - 1)).to_bytes()).unwrap();
    assert_eq!(ok.get("k"), Some(&GgufValue::Array(nested(MAX_ARRAY_DEPTH - 1))));
    let err = parse_err(GgufWriter::new().metadata("k", nested(MAX_ARRAY_DEPTH)).to_bytes());
    assert!(matches!(&err, GgufError::BadValue { reason, .. } if reason.contains("nested")), "{err}");
}

#[test]
fn duplicate_keys_are_rejected() {
    let err = parse_err(basic().metadata("qwen35.block_count", 3u32).to_bytes());
    assert!(matches!(&err, GgufError::DuplicateKey { key, .. } if key == "qwen35.block_count"), "{err}");
}

// ----------------------------------------------------------------------------------------------
// Tensor info errors

#[test]
fn duplicate_tensors_are_rejected() {
    let err = parse_err(basic().tensor("a.weight", &[1], 0, vec![0; 4]).to_bytes());
    assert!(matches!(&err, GgufError::DuplicateTensor { tensor, .. } if tensor == "a.weight"), "{err}");
}

#[test]
fn tensor_names_longer_than_64_bytes_are_rejected() {
    let longest = "n".repeat(MAX_NAME_BYTES);
    assert!(parse(basic().tensor(&longest, &[1], 0, vec![0; 4]).to_bytes()).is_ok());
    let err = parse_err(basic().tensor(&format!("{longest}x"), &[1], 0, vec![0; 4]).to_bytes());
    assert!(matches!(err, GgufError::BadTensorName { index: 2, .. }), "{err}");
}

#[test]
fn bad_dims_are_rejected() {
    let cases: Vec<(&[u64], u32, usize, &str)> = vec![
        (&[], 0, 0, "0 dimensions"),
        (&[1, 1, 1, 1, 1], 0, 4, "5 dimensions"),
        (&[16, 2], 8, 68, "multiple of the Q8_0 block size 32"),
        (&[100], 12, 144, "multiple of the Q4_K block size 256"),
        (&[1 << 63], 0, 0, "exceeds i64::MAX"),
    ];
    for (dims, ggml_type, len, want) in cases {
        let err = parse_err(basic().tensor("t", dims, ggml_type, vec![0; len]).to_bytes());
        assert!(matches!(&err, GgufError::BadDims { tensor, reason, .. } if tensor == "t" && reason.contains(want)), "{dims:?}: {err}");
    }
    // Zero-sized dimensions are legal (ggml allows empty tensors).
    let file = parse(basic().tensor("empty", &[0, 4], 0, vec![]).to_bytes()).unwrap();
    assert_eq!(file.tensor("empty").unwrap().1, &[] as &[u8]);
}

#[test]
fn size_overflows_are_caught() {
    let cases: Vec<(&[u64], &str)> = vec![(&[1 << 40, 1 << 40], "element count"), (&[1 << 62], "byte size")];
    for (dims, what) in cases {
        let err = parse_err(basic().tensor("t", dims, 0, vec![]).to_bytes());
        assert!(matches!(&err, GgufError::SizeOverflow { tensor, what: w, .. } if tensor == "t" && w.contains(what)), "{dims:?}: {err}");
    }

    let bytes = basic().to_bytes();
    let data_offset = parse(bytes.clone()).unwrap().data_offset() as u64;
    let at = info_fields(&bytes, "a.weight", 2).offset;
    let mut start_overflow = bytes.clone();
    patch(&mut start_overflow, at, &(u64::MAX / 32 * 32).to_le_bytes());
    let err = parse_err(start_overflow);
    assert!(matches!(&err, GgufError::SizeOverflow { what: "the start offset", .. }), "{err}");
    // The start still fits, the end (32 bytes later) does not.
    let mut end_overflow = bytes;
    patch(&mut end_overflow, at, &((u64::MAX - data_offset) / 32 * 32).to_le_bytes());
    let err = parse_err(end_overflow);
    assert!(matches!(&err, GgufError::SizeOverflow { what: "the end offset", .. }), "{err}");
}

#[test]
fn unknown_ggml_types_open_but_cannot_be_read() {
    let file = parse(basic().tensor("future", &[7, 3], 99, vec![1, 2, 3]).tensor("repacked", &[64], 31, vec![0; 8]).to_bytes()).unwrap();
    let future = file.tensor_info("future").unwrap();
    assert_eq!((future.ggml_type(), future.type_name().as_str(), future.type_info()), (99, "type 99", None));
    assert_eq!((future.n_bytes(), future.byte_range(), future.dtype()), (None, None, None));
    assert_eq!(future.shape(), [3, 7]);
    assert_eq!(future.n_elements(), 21);
    for name in ["future", "repacked"] {
        let err = file.tensor(name).unwrap_err();
        assert!(matches!(&err, GgufError::UnknownGgmlType { tensor, .. } if tensor == name), "{err}");
    }
    assert_eq!(file.tensor("b.weight").unwrap().1, f32_bytes(&[9., 10., 11.]));

    // Alignment and the start position are still checked.
    let mut bytes = basic().tensor("future", &[7], 99, vec![1, 2, 3]).to_bytes();
    let at = info_fields(&bytes, "future", 1).offset;
    patch(&mut bytes, at, &8u64.to_le_bytes());
    assert!(matches!(parse_err(bytes.clone()), GgufError::MisalignedTensor { .. }));
    patch(&mut bytes, at, &(1u64 << 40).to_le_bytes());
    assert!(matches!(parse_err(bytes), GgufError::TensorOutOfBounds { .. }));
}

#[test]
fn tensor_bytes_guards_against_a_foreign_tensor() {
    let big = parse(basic().tensor("far", &[1024], 0, vec![0; 4096]).to_bytes()).unwrap();
    let small = parse(basic().to_bytes()).unwrap();
    let far = big.tensor_info("far").unwrap();
    assert!(matches!(small.tensor_bytes(far), Err(GgufError::TensorOutOfBounds { .. })));
}

// ----------------------------------------------------------------------------------------------
// Robustness

#[test]
fn corrupting_any_header_byte_never_panics() {
    let bytes = basic()
        .metadata("list", vec!["a", "bc"])
        .metadata("nest", vec![GgufArray::U16(vec![1, 2]), GgufArray::Bool(vec![true])])
        .metadata(ALIGNMENT_KEY, 64u32)
        .tensor("q", &[32], 8, vec![7; 34])
        .to_bytes();
    let data_offset = parse(bytes.clone()).unwrap().data_offset();
    let (mut ok, mut failed) = (0, 0);
    for at in 0..data_offset {
        for flip in [0x01u8, 0x10, 0x80, 0xFF] {
            let mut corrupt = bytes.clone();
            corrupt[at] ^= flip;
            match parse(corrupt) {
                Ok(file) => {
                    ok += 1;
                    for t in file.tensors() {
                        if let Ok(slice) = file.tensor_bytes(t) {
                            assert_eq!(Some(slice.len()), t.n_bytes());
                        }
                    }
                }
                Err(e) => {
                    failed += 1;
                    assert!(e.to_string().contains(PATH));
                }
            }
        }
    }
    assert!(ok > 0 && failed > 0, "{ok} parsed, {failed} failed");
}

#[test]
fn large_vocabulary_parses() {
    let tokens: Vec<String> = (0..248_320).map(|i| format!("tok{i}")).collect();
    let types: Vec<i32> = (0..248_320).map(|i| i % 7).collect();
    let file = parse(GgufWriter::new().metadata("tokenizer.ggml.tokens", GgufArray::String(tokens)).metadata("tokenizer.ggml.token_type", types).to_bytes()).unwrap();
    let tokens = file.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!((tokens.len(), tokens[248_319].as_str()), (248_320, "tok248319"));
    assert_eq!(file.get_i32_array("tokenizer.ggml.token_type").unwrap()[13], 6);
}
