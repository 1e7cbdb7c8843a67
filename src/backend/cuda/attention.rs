//! Gated attention launches (cuda/attention.cu).

use super::cache::CudaCache;
use super::{Arg, CudaBackend, CudaTensor, CudaVector};
use crate::backend::{AttentionDims, BackendError, BatchLayout, CacheSpec, KvDtype};
use kestrel_quant::kv::KvCodec;
use cudarc::driver::{CudaFunction, CudaSlice};

/// Keys per tile of the attention kernel (fixed: tiles are aligned to absolute positions).
const KEY_TILE: usize = 64;
/// Largest head dim (8 values per lane of a warp).
const MAX_HEAD_DIM: usize = 256;
/// Query-head elements one attention block keeps in registers (256 threads x 8).
const MAX_BLOCK_ELEMS: usize = 2048;
/// From this many tokens, a block serves every query head of a kv group (sharing key/value
/// reads); below it, one head per block spreads a short step over more SMs. The per-(query,
/// head) arithmetic is identical either way.
const GROUPED_HEADS_MIN_TOKENS: usize = 64;
/// Context ranges per query (ATTN_SPLITS in cuda/attention.cu).
const ATTN_SPLITS: usize = 32;
/// Query rows (token, query head) of one attn_flash block at most: 4 tiles of 16.
const FLASH_ROWS: usize = 64;
/// Context ranges per query of attn_flash at most (FLASH_SPLITS in cuda/attention_flash.cu).
const FLASH_SPLITS: usize = 32;
/// Steps of at most this many tokens may give each range of each token a block of its own.
const FLASH_SPLIT_MAX_TOKENS: usize = 64;

/// The kernels of one KV format (cuda/attention.cu, a module per format).
struct AttnKernels<'a> {
    prep: &'a CudaFunction,
    core: &'a CudaFunction,
    decode: &'a CudaFunction,
    /// The merge of a split step's ranges (rotating the output back for a rotated format).
    combine: &'a CudaFunction,
    /// Tensor-core attention (bf16, fp8 and tq3 caches).
    flash: Option<FlashKernels<'a>>,
    rotated: bool,
}

/// attn_flash, its plain-decode form that prepares its own heads (attn_flash_decode), and their
/// range merge (cuda/attention_flash.cu).
#[derive(Clone, Copy)]
struct FlashKernels<'a> {
    flash: &'a CudaFunction,
    decode: &'a CudaFunction,
    combine: &'a CudaFunction,
}

fn kernels(be: &CudaBackend, dtype: KvDtype) -> AttnKernels<'_> {
    let k = &be.k;
    let (prep, core, decode, combine, flash) = match dtype {
        // f32 stays the exact reference on the per-(token, head) kernels; tq3 keeps them for
        // `KESTREL_CUDA_FLASH_ATTN=0` A/B runs, and its attn_prep prepares the flash launches'
        // rotated queries.
        KvDtype::F32 => (&k.attn_prep_f32, &k.attn_core_f32, &k.attn_decode_f32, &k.attn_combine_f32, None),
        KvDtype::Bf16 => (&k.attn_prep_bf16, &k.attn_core_bf16, &k.attn_decode_bf16, &k.attn_combine_bf16, Some(FlashKernels { flash: &k.attn_flash_bf16, decode: &k.attn_flash_decode_bf16, combine: &k.attn_flash_combine_bf16 })),
        KvDtype::Fp8 => (&k.attn_prep_fp8, &k.attn_core_fp8, &k.attn_decode_fp8, &k.attn_combine_fp8, Some(FlashKernels { flash: &k.attn_flash_fp8, decode: &k.attn_flash_decode_fp8, combine: &k.attn_flash_combine_fp8 })),
        KvDtype::Tq3 => (&k.attn_prep_tq3, &k.attn_core_tq3, &k.attn_decode_tq3, &k.attn_combine_tq3, Some(FlashKernels { flash: &k.attn_flash_tq3, decode: &k.attn_flash_decode_tq3, combine: &k.attn_flash_combine_tq3 })),
        KvDtype::Tq3UniformValues => unreachable!("refused when the cache was allocated (kv_tables)"),
    };
    AttnKernels { prep, core, decode, combine, flash: flash.filter(|_| be.flash_attention), rotated: dtype.value_format().rotated() }
}

/// Whether attn_flash takes heads of `head_dim` in kv groups of `group` query heads (16-element
/// MMA steps, at most 64 rows a block).
fn flash_shape(head_dim: usize, group: usize) -> bool {
    head_dim % 16 == 0 && group <= FLASH_ROWS
}

impl CudaBackend {
    /// Whether attention over a `dtype` cache with heads of `head_dim` and kv groups of `group`
    /// query heads runs on tensor cores (attn_flash) rather than the per-(token, head) kernels.
    pub fn attention_on_tensor_cores(&self, dtype: KvDtype, head_dim: usize, group: usize) -> bool {
        DEVICE_KV_DTYPES.contains(&dtype) && kernels(self, dtype).flash.is_some() && flash_shape(head_dim, group)
    }

    /// Gives attn_flash's launches that follow only the shared memory of its plain path (off:
    /// each warp computes all of its rows' weights, every format loads a tile after the last
    /// one's barrier, as on a GPU with less shared memory) or, where it fits, that of the shared
    /// weights and tq3's staged codes (on, the default): the same bits either way (tests).
    pub fn set_flash_attention_extras(&self, on: bool) {
        self.flash_extras.store(on, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `struct KvCache` of cuda/kv_formats.cuh: one attention layer's planes and the format's
/// tables, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvCacheArg {
    k: u64,
    kp: u64,
    v: u64,
    vp: u64,
    tables: u64,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn gated_attention(
    be: &CudaBackend,
    q_gate: &CudaTensor,
    k: &CudaTensor,
    v: &CudaTensor,
    q_norm: &CudaVector,
    k_norm: &CudaVector,
    d: &AttentionDims,
    layout: &BatchLayout,
    cache: &mut CudaCache,
    layer: usize,
) -> CudaTensor {
    let t = q_gate.rows;
    let (nq, nkv, hd) = (d.num_heads, d.num_kv_heads, d.head_dim);
    assert_eq!(q_gate.cols, nq * 2 * hd, "gated_attention: q projection width");
    assert_eq!((k.rows, k.cols, v.rows, v.cols), (t, nkv * hd, t, nkv * hd), "gated_attention: k/v shapes");
    assert_eq!((q_norm.len, k_norm.len), (hd, hd), "gated_attention: q/k norm length");
    assert!(nkv > 0 && nq % nkv == 0 && hd <= MAX_HEAD_DIM, "gated_attention: unsupported head layout {nq}/{nkv}x{hd} (head_dim at most {MAX_HEAD_DIM})");
    assert!(layer < cache.k.len(), "gated_attention: attention layer {layer} outside the cache");
    assert_eq!((cache.spec.kv_heads, cache.spec.head_dim), (nkv, hd), "gated_attention: cache geometry");
    let bs = cache.spec.block_size;
    let dl = be.device_layout(layout, bs);
    assert_eq!(dl.num_tokens, t, "gated_attention: layout covers {} tokens, activations have {t}", dl.num_tokens);
    if let Some(b) = dl.max_block {
        assert!((b as usize) < cache.spec.num_blocks, "gated_attention: block {b} outside the cache");
    }
    let base = dl.base;
    let at = |off: usize| base + 4 * off as u64;
    let inv_freq = be.rope_table(d.rope_theta, d.rotary_dim);
    let kernels = kernels(be, cache.spec.kv_dtype);
    let tables = be.ptr(&cache.kv_tables);
    let kv = KvCacheArg {
        k: be.ptr(&cache.k[layer].data),
        kp: be.ptr(&cache.k[layer].params),
        v: be.ptr(&cache.v[layer].data),
        vp: be.ptr(&cache.v[layer].params),
        tables,
    };
    let group = nq / nkv;
    let heads_per_block = if t >= GROUPED_HEADS_MIN_TOKENS && group * hd <= MAX_BLOCK_ELEMS { group } else { 1 };
    let out = be.tensor(t, nq * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    // What attn_prep, attn_decode and attn_flash_decode read to prepare the step's heads: their
    // arguments after the first two, in the same order.
    let head_inputs = [
        Arg::Kv(kv),
        Arg::Ptr(be.ptr(&q_gate.data)),
        Arg::Ptr(be.ptr(&k.data)),
        Arg::Ptr(be.ptr(&v.data)),
        Arg::Ptr(be.ptr(&q_norm.data)),
        Arg::Ptr(be.ptr(&k_norm.data)),
        Arg::Ptr(be.ptr(&*inv_freq)),
        Arg::Ptr(at(dl.tok_row_off)),
        Arg::Ptr(at(dl.pos_off)),
        Arg::Ptr(base),
        Arg::Ptr(base),
        Arg::I32(nq as i32),
        Arg::I32(nkv as i32),
        Arg::I32(hd as i32),
        Arg::I32(d.rotary_dim as i32),
        Arg::I32(bs as i32),
        Arg::F32(d.eps),
    ];
    // The same queries and keys as attn_prep's, for the launches after it.
    let prepare = || {
        let q = be.tensor(t, nq * hd);
        let gate = be.tensor(t, nq * hd);
        let args = [&[Arg::Ptr(be.ptr(&q.data)), Arg::Ptr(be.ptr(&gate.data))][..], &head_inputs].concat();
        be.launch(kernels.prep, (t as u32, (nq + nkv) as u32, 1), 64, (4 * hd + d.rotary_dim / 2) * 4, &args);
        (q, gate)
    };
    // The merge of a split step's ranges; a rotated format's merged row is rotated back through
    // hd floats of shared memory.
    let combine = |kernel: &CudaFunction, gate: u64, gate_stride: usize, partial: &CudaSlice<f32>| {
        let args = [Arg::Ptr(be.ptr(&out.data)), Arg::Ptr(gate), Arg::Ptr(be.ptr(partial)), Arg::Ptr(at(dl.pos_off)), Arg::I32(nq as i32), Arg::I32(hd as i32), Arg::I32(gate_stride as i32), Arg::Ptr(tables)];
        let smem = if kernels.rotated { hd * 4 } else { 0 };
        be.launch(kernel, (t as u32, nq as u32, 1), hd.div_ceil(32) as u32 * 32, smem, &args);
    };
    // Tensor cores: every step, decode included, so that a row's bits are the same on every path.
    if let Some(fk) = kernels.flash.filter(|_| flash_shape(hd, group)) {
        // A block takes 64 / group tokens of one sequence; a decode step's tokens are each a
        // sequence of their own, so one each.
        let single = layout.rows.iter().all(|r| r.num_tokens == 1);
        let mut tokens_per_block = if single { 1 } else { FLASH_ROWS / group };
        // A step whose blocks cannot fill the GPU gives each range of each token its own block.
        let split = t <= FLASH_SPLIT_MAX_TOKENS && t.div_ceil(tokens_per_block) * nkv < be.sm_count;
        if split {
            tokens_per_block = 1;
        }
        // Query rows (16-bit parts and remainders), then the key and value tiles, 16-bit rows
        // of hd + 8, then a tile's f32 scores per query row, rows of KEY_TILE + 8
        // (cuda/attention_flash.cu); attn_flash_decode's preparation scratch (16 rows of hd
        // floats) and a rotated format's finished rows (64 rows of hd floats) fit in the tiles.
        // Where the device has room, the shared weights (f32 and 16-bit parts and remainders,
        // rows of KEY_TILE + 8) and then for tq3 the next tile's stored keys and values; the
        // kernel uses what it is given, with the same bits.
        let tiles = (2 * FLASH_ROWS + 2 * KEY_TILE) * (hd + 8) * 2 + FLASH_ROWS * (KEY_TILE + 8) * 4;
        let weights = FLASH_ROWS * (KEY_TILE + 8) * (4 + 2 + 2);
        let staged = if cache.spec.kv_dtype == KvDtype::Tq3 { 2 * KEY_TILE * (3 * hd / 8) } else { 0 };
        let extras = be.flash_extras.load(std::sync::atomic::Ordering::Relaxed);
        let smem = [tiles + weights + staged, tiles + weights].into_iter().find(|&s| extras && s <= be.max_dynamic_smem).unwrap_or(tiles);
        assert!(smem <= be.max_dynamic_smem, "gated_attention: head dim {hd} needs {smem} bytes of shared memory");
        let partial = split.then(|| be.alloc_f32(t * nq * FLASH_SPLITS * (hd + 2)));
        let partial_ptr = partial.as_ref().map_or(0, |p| be.ptr(p));
        let grid = (t.div_ceil(tokens_per_block) as u32, nkv as u32, if split { FLASH_SPLITS as u32 } else { 1 });
        // Plain decode prepares its heads in the attention launch; the gates are then the q/gate
        // projection's second halves.
        let prepared = (!(single && be.attn_decode)).then(prepare);
        let (gate, gate_stride) = if let Some((q, gate)) = &prepared {
            be.launch(
                fk.flash,
                grid,
                256,
                smem,
                &[
                    Arg::Ptr(be.ptr(&out.data)),
                    Arg::Ptr(be.ptr(&q.data)),
                    Arg::Ptr(be.ptr(&gate.data)),
                    Arg::Kv(kv),
                    Arg::Ptr(at(dl.tok_row_off)),
                    Arg::Ptr(at(dl.pos_off)),
                    Arg::Ptr(base),
                    Arg::Ptr(base),
                    Arg::I32(t as i32),
                    Arg::I32(nq as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(bs as i32),
                    Arg::I32(tokens_per_block as i32),
                    Arg::F32(scale),
                    Arg::Ptr(partial_ptr),
                ],
            );
            (be.ptr(&gate.data), hd)
        } else {
            let args = [&[Arg::Ptr(be.ptr(&out.data)), Arg::Ptr(partial_ptr)][..], &head_inputs, &[Arg::F32(scale)]].concat();
            be.launch(fk.decode, grid, 256, smem, &args);
            (be.ptr(&q_gate.data) + 4 * hd as u64, 2 * hd)
        };
        if let Some(partial) = &partial {
            combine(fk.combine, gate, gate_stride, partial);
        }
        return out;
    }
    // A step whose (token, head) blocks cannot fill the GPU gives each context range a block of
    // its own and merges the ranges in a second launch (the same arithmetic as one block
    // walking them all), so a decode step reads its keys on ATTN_SPLITS times more SMs.
    let split = t * (nq / heads_per_block) < be.sm_count;
    let splits = if split { ATTN_SPLITS as u32 } else { 1 };
    let partial = split.then(|| be.alloc_f32(t * nq * ATTN_SPLITS * (hd + 2)));
    let partial_ptr = partial.as_ref().map_or(0, |p| be.ptr(p));
    // Every row one token (plain decode): no token's context holds another of the step, so the
    // attention launch prepares each query and its kv head's new key and value itself.
    if be.attn_decode && heads_per_block == 1 && layout.rows.iter().all(|r| r.num_tokens == 1) {
        // attn_body's part from a 16-byte boundary, then DecodeSmem's (cuda/attention.cu).
        let smem = ((hd + KEY_TILE + 5).next_multiple_of(4) + (KEY_TILE + 6) * hd + d.rotary_dim / 2) * 4;
        assert!(smem <= be.max_dynamic_smem, "gated_attention: head dim {hd} needs {smem} bytes of shared memory");
        let args = [&[Arg::Ptr(be.ptr(&out.data)), Arg::Ptr(partial_ptr)][..], &head_inputs, &[Arg::F32(scale)]].concat();
        be.launch(kernels.decode, (t as u32, nq as u32, splits), 256, smem, &args);
        if let Some(partial) = &partial {
            // The gates are the q/gate projection's second halves.
            combine(kernels.combine, be.ptr(&q_gate.data) + 4 * hd as u64, 2 * hd, partial);
        }
        return out;
    }
    let (q, gate) = prepare();
    let smem = heads_per_block * (hd + KEY_TILE + 5) * 4;
    assert!(smem <= be.max_dynamic_smem, "gated_attention: head dim {hd} needs {smem} bytes of shared memory");
    be.launch(
        kernels.core,
        (t as u32, (nq / heads_per_block) as u32, splits),
        256,
        smem,
        &[
            Arg::Ptr(be.ptr(&out.data)),
            Arg::Ptr(be.ptr(&q.data)),
            Arg::Ptr(be.ptr(&gate.data)),
            Arg::Kv(kv),
            Arg::Ptr(at(dl.tok_row_off)),
            Arg::Ptr(at(dl.pos_off)),
            Arg::Ptr(base),
            Arg::Ptr(base),
            Arg::I32(nq as i32),
            Arg::I32(nkv as i32),
            Arg::I32(hd as i32),
            Arg::I32(bs as i32),
            Arg::I32(heads_per_block as i32),
            Arg::F32(scale),
            Arg::Ptr(partial_ptr),
        ],
    );
    if let Some(partial) = &partial {
        combine(kernels.combine, be.ptr(&gate.data), hd, partial);
    }
    out
}

/// The KV formats the attention kernels read and write (vLLM's uniform values, kept on the CPU
/// for comparison, have none).
const DEVICE_KV_DTYPES: [KvDtype; 4] = [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Tq3];

/// The constant tables a cache's attention kernels read: for a rotated format (TurboQuant), the
/// 8 codebook levels, the 7 cell boundaries, the rotation's scale `1/√d` and its `d` signs, in
/// the order of `struct KvTables` in cuda/attention.cu; a placeholder otherwise. Refuses a
/// format the kernels do not have.
pub(super) fn kv_tables(be: &CudaBackend, spec: &CacheSpec) -> Result<CudaSlice<f32>, BackendError> {
    let dtype = spec.kv_dtype;
    if !DEVICE_KV_DTYPES.contains(&dtype) {
        let names: Vec<&str> = DEVICE_KV_DTYPES.iter().map(|d| d.name()).collect();
        return Err(BackendError::Invalid(format!("--kv-cache-dtype {dtype} is not available on the CUDA backend (it has {}); use --device cpu or one of those", names.join(", "))));
    }
    dtype.check_head_dim(spec.head_dim).map_err(|e| BackendError::Invalid(format!("--kv-cache-dtype {dtype}: {e}")))?;
    if spec.head_dim > MAX_HEAD_DIM {
        return Err(BackendError::Invalid(format!("head dimension {} exceeds the attention kernels' limit of {MAX_HEAD_DIM}", spec.head_dim)));
    }
    let mut tables = vec![0.0f32];
    if dtype.value_format().rotated() || dtype.key_format().rotated() {
        let codec = KvCodec::new(dtype.key_format(), spec.head_dim).map_err(|e| BackendError::Invalid(format!("--kv-cache-dtype {dtype}: {e}")))?;
        let (codebook, rotation) = (codec.codebook().expect("a rotated format has a codebook"), codec.rotation().expect("and a rotation"));
        tables = codebook.centroids.to_vec();
        tables.extend(codebook.boundaries);
        tables.push(rotation.scale());
        tables.extend(rotation.signs());
        // `signs` holds MAX_HEAD_DIM floats.
        tables.resize(16 + MAX_HEAD_DIM, 0.0);
    }
    be.stream.clone_htod(&tables).map_err(|e| BackendError::Device(format!("{e:?}")))
}
