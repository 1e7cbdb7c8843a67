//! Gated DeltaNet launches (cuda/gdn.cu).

use super::cache::CudaCache;
use super::{Arg, CudaBackend, CudaTensor, CudaVector};
use crate::backend::{BatchLayout, RowKind};
use crate::backend::shapes::LinearAttnShape;

/// Chunk of the chunked delta rule; must match CHUNK in cuda/gdn.cu and the CPU backend.
const CHUNK: usize = crate::backend::DELTA_RULE_CHUNK;
/// Threads per block of the chunked kernels (GC_THREADS in cuda/gdn_chunk.cu).
const CHUNK_THREADS: u32 = 256;
/// Threads per block of gdn_conv_gates: the value channels it convolves per block.
const CONV_GATES_THREADS: usize = 128;

pub(super) struct GdnArgs<'a> {
    pub mixed: &'a CudaTensor,
    pub z: &'a CudaTensor,
    pub b: &'a CudaTensor,
    pub a: &'a CudaTensor,
    pub conv_weight: &'a CudaVector,
    pub neg_a: &'a CudaVector,
    pub dt_bias: &'a CudaVector,
    pub norm_weight: &'a CudaVector,
}

pub(super) fn gated_delta_net(be: &CudaBackend, x: &GdnArgs, cfg: &LinearAttnShape, eps: f32, layout: &BatchLayout, cache: &mut CudaCache, layer: usize) -> CudaTensor {
    let t = x.mixed.rows;
    let (nk, nv, dk, dv, kw) = (cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim, cfg.conv_kernel);
    let (conv_dim, key_dim, value_dim) = (cfg.conv_dim(), cfg.key_dim(), cfg.value_dim());
    assert_eq!(x.mixed.cols, conv_dim, "gated_delta_net: mixed width");
    assert_eq!((x.z.rows, x.z.cols), (t, value_dim), "gated_delta_net: z shape");
    assert_eq!((x.b.rows, x.b.cols, x.a.rows, x.a.cols), (t, nv, t, nv), "gated_delta_net: a/b shapes");
    assert_eq!((x.conv_weight.len, x.neg_a.len, x.dt_bias.len, x.norm_weight.len), (conv_dim * kw, nv, nv, dv), "gated_delta_net: parameter lengths");
    assert!(layer < cache.conv.len(), "gated_delta_net: linear layer {layer} outside the cache");
    assert_eq!(&cache.spec.linear, cfg, "gated_delta_net: cache built for another linear-attention shape");
    let dl = be.device_layout(layout, cache.spec.block_size);
    assert_eq!(dl.num_tokens, t, "gated_delta_net: layout covers {} tokens, activations have {t}", dl.num_tokens);
    if let Some(s) = dl.max_state_slot {
        assert!(s < cache.spec.state_slots, "gated_delta_net: state slot {s} outside the cache");
    }
    if let Some(s) = dl.max_snapshot {
        assert!(s < cache.spec.snapshot_slots, "gated_delta_net: snapshot slot {s} outside the cache");
    }
    let base = dl.base;
    let at = |off: usize| base + 4 * off as u64;
    let (conv_state, conv_snap) = (be.ptr(&cache.conv[layer]), be.ptr(&cache.conv_snap[layer]));
    let (rec, rec_snap) = (be.ptr(&cache.rec[layer]), be.ptr(&cache.rec_snap[layer]));

    let out = be.tensor(t, value_dim);
    // What the conv and the gates read, in both kernels' argument order.
    let conv_gate_inputs = [be.ptr(&x.mixed.data), conv_state, be.ptr(&x.conv_weight.data), be.ptr(&x.a.data), be.ptr(&x.b.data), be.ptr(&x.neg_a.data), be.ptr(&x.dt_bias.data)].map(Arg::Ptr);
    let tail = |row_ids: u64| [Arg::Ptr(base), Arg::Ptr(row_ids), Arg::I32(nk as i32), Arg::I32(nv as i32), Arg::I32(dk as i32), Arg::I32(dv as i32), Arg::I32(conv_dim as i32)];
    // 1. Generate rows: conv, gates, delta rule and gated RMSNorm in one launch, right after the
    //    projections (before any prefill launch of this layer), so that it may read its state
    //    before its inputs are ready.
    if dl.num_generate > 0 {
        // REC_GROUPS (4) threads per value column, at most 512 (the kernel's launch bound).
        assert!(dv <= 128 && dk <= 128, "gated_delta_net: head dims dk {dk} / dv {dv} above 128");
        let threads = (4 * dv).div_ceil(32) as u32 * 32;
        // The models' head dims and conv width have an instantiation with them built in.
        let kernel = if (dk, dv, kw) == (128, 128, 4) { &be.k.gdn_recurrent_128 } else { &be.k.gdn_recurrent };
        // The state and windows may be read early unless the launch just before wrote them.
        let writers = [&be.k.commit_states, &be.k.reset_states, &be.k.gdn_chunk_state_32, &be.k.gdn_chunk_state_16, &be.k.gdn_conv_state, &be.k.gdn_recurrent, &be.k.gdn_recurrent_128];
        let state_early = !writers.iter().any(|f| be.last_launch_was(f));
        let mut args = vec![
            Arg::Ptr(be.ptr(&out.data)),
            Arg::Ptr(be.ptr(&x.z.data)),
            Arg::Ptr(be.ptr(&x.norm_weight.data)),
            Arg::F32(eps),
            Arg::Ptr(conv_snap),
        ];
        args.extend(conv_gate_inputs);
        args.extend([Arg::Ptr(rec), Arg::Ptr(rec_snap)]);
        args.extend(tail(at(dl.generate_off)));
        args.extend([Arg::I32(kw as i32), Arg::I32(i32::from(state_early)), Arg::I32(i32::from(cfg.out_heads_tiled))]);
        be.launch(kernel, (dl.num_generate as u32, nv as u32, 1), threads, 0, &args);
    }

    // 2. Prefill tokens: conv + SiLU, the normalized q/k and the gates in one launch, then the
    //    canonical windows of prefill rows are advanced. (Generate tokens get all of this inside
    //    the recurrent kernel, which also writes their window snapshots.)
    let prefill = (dl.num_prefill > 0).then(|| {
        let conv_out = be.tensor(t, conv_dim);
        let qn = be.tensor(t, key_dim);
        let kn = be.tensor(t, key_dim);
        let g = be.tensor(t, nv);
        let beta = be.tensor(t, nv);
        let value_blocks = value_dim.div_ceil(CONV_GATES_THREADS);
        let mut args = vec![Arg::Ptr(be.ptr(&conv_out.data)), Arg::Ptr(conv_snap), Arg::Ptr(be.ptr(&qn.data)), Arg::Ptr(be.ptr(&kn.data)), Arg::Ptr(be.ptr(&g.data)), Arg::Ptr(be.ptr(&beta.data))];
        args.extend(conv_gate_inputs);
        args.extend([Arg::Ptr(at(dl.tok_row_off)), Arg::Ptr(base), Arg::I32(nk as i32), Arg::I32(nv as i32), Arg::I32(dk as i32), Arg::I32(conv_dim as i32), Arg::I32(kw as i32)]);
        be.launch(&be.k.gdn_conv_gates, (t as u32, (nk + 1 + value_blocks) as u32, 1), CONV_GATES_THREADS as u32, 0, &args);
        let n = dl.num_prefill * conv_dim;
        be.launch(
            &be.k.gdn_conv_state,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(conv_state), Arg::Ptr(be.ptr(&x.mixed.data)), Arg::Ptr(base), Arg::Ptr(at(dl.prefill_off)), Arg::I32(dl.num_prefill as i32), Arg::I32(conv_dim as i32), Arg::I32(kw as i32)],
        );
        (conv_out, qn, kn, g, beta)
    });

    // 3. Prefill rows: delta rule chunked, then the gated RMSNorm.
    if let Some((conv_out, qn, kn, g, beta)) = &prefill {
        let (qn_p, kn_p, conv_p, g_p, beta_p) = (be.ptr(&qn.data), be.ptr(&kn.data), be.ptr(&conv_out.data), be.ptr(&g.data), be.ptr(&beta.data));
        let core = be.tensor(t, value_dim);
        chunked_delta_rule(be, layout, &dl, cfg, rec, [qn_p, kn_p, conv_p, g_p, beta_p], be.ptr(&core.data));
        be.launch(
            &be.k.gdn_out_norm,
            (t as u32, nv as u32, 1),
            128,
            0,
            &[
                Arg::Ptr(be.ptr(&out.data)),
                Arg::Ptr(be.ptr(&core.data)),
                Arg::Ptr(be.ptr(&x.z.data)),
                Arg::Ptr(be.ptr(&x.norm_weight.data)),
                Arg::Ptr(at(dl.tok_row_off)),
                Arg::Ptr(base),
                Arg::I32(nv as i32),
                Arg::I32(dv as i32),
                Arg::F32(eps),
                Arg::I32(nk as i32),
                Arg::I32(i32::from(cfg.out_heads_tiled)),
            ],
        );
    }
    out
}

/// Chunks of a prefill row: the first runs from its start to the next multiple of CHUNK
/// (row_chunks in cuda/gdn_chunk.cu).
fn row_chunks(start_position: usize, num_tokens: usize) -> usize {
    if num_tokens == 0 {
        0
    } else {
        (start_position % CHUNK + num_tokens).div_ceil(CHUNK)
    }
}

/// The delta rule of the step's prefill rows into `core` (cuda/gdn_chunk.cu): every chunk's W,
/// U, P and cumulative decay at once, then each row's chunks in order per block of value
/// columns. `inputs`: qn, kn, the conv output, g and beta.
fn chunked_delta_rule(be: &CudaBackend, layout: &BatchLayout, dl: &super::layout::DeviceLayout, cfg: &LinearAttnShape, rec: u64, inputs: [u64; 5], core: u64) {
    let (nk, nv, dk, dv) = (cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim);
    assert!(dk <= 128, "gated_delta_net: key head dim {dk} above 128");
    let [qn, kn, conv_out, g, beta] = inputs;
    let slots: usize = layout.rows.iter().filter(|r| r.kind == RowKind::Prefill).map(|r| row_chunks(r.start_position, r.num_tokens)).sum();
    if slots == 0 {
        return;
    }
    let (dkp, dvp) = (dk.next_multiple_of(16), dv.next_multiple_of(8));
    // 64-wide shared arrays are padded by 4 floats a row (GC_LDC).
    let ldc = CHUNK + 4;
    let prep_smem = (CHUNK * (dkp + 4) + CHUNK * (dkp.max(dvp) + 4) + 2 * CHUNK * ldc + 2 * CHUNK) * 4;
    let w = be.alloc_f32(slots * nv * CHUNK * dk);
    let u = be.alloc_f32(slots * nv * CHUNK * dv);
    let p = be.alloc_f32(slots * nv * CHUNK * CHUNK);
    let gam = be.alloc_f32(slots * nv * CHUNK);
    let (w, u, p, gam) = (be.ptr(&w), be.ptr(&u), be.ptr(&p), be.ptr(&gam));
    let (rows, row_ids) = (dl.base, dl.base + 4 * dl.prefill_off as u64);
    assert!(prep_smem <= be.max_dynamic_smem, "gated_delta_net: dk {dk} / dv {dv} need {prep_smem} bytes of shared memory");
    be.launch(
        &be.k.gdn_chunk_prep,
        (slots as u32, nv as u32, 1),
        CHUNK_THREADS,
        prep_smem,
        &[
            Arg::Ptr(w),
            Arg::Ptr(u),
            Arg::Ptr(p),
            Arg::Ptr(gam),
            Arg::Ptr(qn),
            Arg::Ptr(kn),
            Arg::Ptr(conv_out),
            Arg::Ptr(g),
            Arg::Ptr(beta),
            Arg::Ptr(rows),
            Arg::Ptr(row_ids),
            Arg::I32(dl.num_prefill as i32),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
            Arg::I32(cfg.conv_dim() as i32),
        ],
    );
    // 32 value columns a block, or 16 where twice the blocks still fit the GPU at once (one
    // block per SM): the sequential pass then takes half as long.
    let blocks_32 = dl.num_prefill * nv * dv.div_ceil(32);
    let cols = if 2 * blocks_32 <= be.sm_count { 16 } else { 32 };
    let kernel = if cols == 16 { &be.k.gdn_chunk_state_16 } else { &be.k.gdn_chunk_state_32 };
    let state_smem = (2 * CHUNK * (dkp + 4) + CHUNK * (dkp + 8) + CHUNK * ldc + (2 * CHUNK + dkp) * (cols + 8) + 2 * CHUNK) * 4;
    assert!(state_smem <= be.max_dynamic_smem, "gated_delta_net: dk {dk} needs {state_smem} bytes of shared memory");
    be.launch(
        kernel,
        (dl.num_prefill as u32, nv as u32, dv.div_ceil(cols) as u32),
        CHUNK_THREADS,
        state_smem,
        &[
            Arg::Ptr(core),
            Arg::Ptr(rec),
            Arg::Ptr(w),
            Arg::Ptr(u),
            Arg::Ptr(p),
            Arg::Ptr(gam),
            Arg::Ptr(qn),
            Arg::Ptr(kn),
            Arg::Ptr(rows),
            Arg::Ptr(row_ids),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
        ],
    );
}
