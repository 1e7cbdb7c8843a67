//! The ggml tensor type table: block geometry of every type id a GGUF file can name.


/// Block geometry of one ggml tensor type: `block_elems` values take `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlTypeInfo {
    pub id: u32,
    pub name: &'static str,
    pub block_elems: u64,
    pub block_bytes: u64,
}

/// Every type id ggml writes into files, with sizes from ggml's `static_assert`s. Ids 4/5
/// (Q4_2/Q4_3) and 31-33/36-38 (repacked in-memory layouts) were removed upstream and are
/// unknown here. Q8_1 and Q8_K are activation formats that files do not normally hold; they
/// are listed so such a file still opens (gguf-py 0.19.0 says 40 bytes for Q8_1, a leftover
/// from its f32 scales; ggml's block is two f16 and 32 bytes).
const GGML_TYPES: &[GgmlTypeInfo] = &[
    ty(0, "F32", 1, 4),
    ty(1, "F16", 1, 2),
    ty(2, "Q4_0", 32, 18),
    ty(3, "Q4_1", 32, 20),
    ty(6, "Q5_0", 32, 22),
    ty(7, "Q5_1", 32, 24),
    ty(8, "Q8_0", 32, 34),
    ty(9, "Q8_1", 32, 36),
    ty(10, "Q2_K", 256, 84),
    ty(11, "Q3_K", 256, 110),
    ty(12, "Q4_K", 256, 144),
    ty(13, "Q5_K", 256, 176),
    ty(14, "Q6_K", 256, 210),
    ty(15, "Q8_K", 256, 292),
    ty(16, "IQ2_XXS", 256, 66),
    ty(17, "IQ2_XS", 256, 74),
    ty(18, "IQ3_XXS", 256, 98),
    ty(19, "IQ1_S", 256, 50),
    ty(20, "IQ4_NL", 32, 18),
    ty(21, "IQ3_S", 256, 110),
    ty(22, "IQ2_S", 256, 82),
    ty(23, "IQ4_XS", 256, 136),
    ty(24, "I8", 1, 1),
    ty(25, "I16", 1, 2),
    ty(26, "I32", 1, 4),
    ty(27, "I64", 1, 8),
    ty(28, "F64", 1, 8),
    ty(29, "IQ1_M", 256, 56),
    ty(30, "BF16", 1, 2),
    ty(34, "TQ1_0", 256, 54),
    ty(35, "TQ2_0", 256, 66),
    ty(39, "MXFP4", 32, 17),
    ty(40, "NVFP4", 64, 36),
    ty(41, "Q1_0", 128, 18),
];

const fn ty(id: u32, name: &'static str, block_elems: u64, block_bytes: u64) -> GgmlTypeInfo {
    GgmlTypeInfo { id, name, block_elems, block_bytes }
}

/// Geometry of a ggml type id, or `None` for an id this reader does not know.
pub fn ggml_type_info(id: u32) -> Option<GgmlTypeInfo> {
    GGML_TYPES.iter().find(|t| t.id == id).copied()
}

/// All known ggml types, by id.
pub fn ggml_types() -> &'static [GgmlTypeInfo] {
    GGML_TYPES
}
