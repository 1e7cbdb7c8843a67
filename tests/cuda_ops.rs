//! Every CUDA op against the CPU reference on fresh random inputs of several sizes, and the
//! row invariance of the matmul and MoE kernels. Runs where a GPU is present.

mod cuda_support;

use cuda_support::*;
use kestrel::backend::cpu::{CpuBackend, CpuCache};
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::{AttentionDims, Backend, CacheSpec, GdnParams, KvDtype, MoeWeights, RowKind, StateCommit};
use kestrel::backend::shapes::{LinearAttnShape, MoeShape};
use kestrel::backend::weight_bytes::MatrixBytes;
use kestrel::model::weights::Dtype;

fn seed() -> u64 {
    // Fresh inputs each run; the seed is printed so a failure can be replayed.
    let s = std::env::var("KESTREL_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    eprintln!("seed {s}");
    s
}

#[test]
fn matmul_matches_cpu_and_rows_are_independent() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    // Output widths past 2048 and 8192 take the wider n tiles of the small-row kernels.
    for (inputs, outputs) in [(19, 37), (128, 64), (96, 100), (264, 257), (1024, 512), (64, 3001), (96, 9000)] {
        for dtype in [Dtype::F32, Dtype::BF16] {
            let w = random_matrix(&mut rng, outputs, inputs, dtype);
            let gw = gpu.upload_matrix(&w).unwrap();
            let w = cpu.upload_matrix(&w).unwrap();
            let max_rows = 200;
            let x = rng.vec(max_rows * inputs, 1.0);
            let full = gpu.to_host(&gpu.matmul(&gpu.from_host(&x, max_rows, inputs), &gw));
            // 1..16, 17..32 and 33..64 rows run the small-row kernels with 1, 2 and 4 m tiles.
            for rows in [1, 8, 16, 17, 32, 33, 40, 64, 65, 200] {
                let xs = &x[..rows * inputs];
                let got = gpu.to_host(&gpu.matmul(&gpu.from_host(xs, rows, inputs), &gw));
                let want = cpu.to_host(&cpu.matmul(&cpu.from_host(xs, rows, inputs), &w));
                let err = relative_error(&got, &want);
                assert!(err < 1e-4, "matmul {rows}x{inputs} @ {outputs} ({dtype:?}): relative error {err}");
                assert!(bitwise_equal(&got, &full[..rows * outputs]), "matmul {inputs}->{outputs} ({dtype:?}): rows differ between {rows} and {max_rows} rows");
            }
        }
    }
}

/// Past 128 rows a bf16 matmul takes the wgmma kernel on sm_90 (the large-tile kernel
/// elsewhere): close to the CPU, and bitwise what the streaming (1 and 7 rows), k-sliced (63
/// rows) and large-tile kernels give the same rows. K of 17 and 131 blocks of 32 (k slices of
/// unequal length), odd output widths, and 4095 rows: none a multiple of a tile.
#[test]
fn many_row_matmul_gives_each_row_the_bits_of_the_few_row_kernels() {
    let Some(gpu) = gpu() else { return };
    if sm_version(&gpu) == 90 && std::env::var("KESTREL_CUDA_WGMMA").map_or(true, |v| v != "0") {
        assert!(gpu.wgmma_matmul(), "an sm_90 GPU without the wgmma matmul");
    }
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    let rows = 4095;
    for (inputs, outputs) in [(544, 1001), (4192, 389)] {
        let w = random_matrix(&mut rng, outputs, inputs, Dtype::BF16);
        let (gw, cw) = (gpu.upload_matrix(&w).unwrap(), cpu.upload_matrix(&w).unwrap());
        let x = rng.vec(rows * inputs, 1.0);
        let gx = gpu.from_host(&x, rows, inputs);
        let full = gpu.to_host(&gpu.matmul(&gx, &gw));
        let what = format!("{rows}x{inputs} @ {outputs}");
        let cpu_rows = 300;
        let want = cpu.to_host(&cpu.matmul(&cpu.from_host(&x[..cpu_rows * inputs], cpu_rows, inputs), &cw));
        let err = relative_error(&full[..cpu_rows * outputs], &want);
        assert!(err < 1e-4, "{what}: relative error {err} against the CPU");
        for (start, count) in [(0, 1), (2000, 1), (7, 7), (100, 63), (0, 300), (3000, 1095)] {
            let xs = &x[start * inputs..(start + count) * inputs];
            let got = gpu.to_host(&gpu.matmul(&gpu.from_host(xs, count, inputs), &gw));
            assert!(bitwise_equal(&got, &full[start * outputs..(start + count) * outputs]), "{what}: rows {start}..{} alone differ from the same rows among {rows}", start + count);
        }
        // The large-tile kernel on all rows: the same bits.
        gpu.set_wgmma_matmul(false);
        let large = gpu.to_host(&gpu.matmul(&gx, &gw));
        gpu.set_wgmma_matmul(true);
        assert!(bitwise_equal(&large, &full), "{what}: the wgmma and large-tile kernels differ");
    }
}

/// Kernels launch before the previous kernel ends (programmatic dependent launch) and wait for
/// their inputs themselves. In a long chain each launch reads what the one before wrote and
/// writes what it read, over several waves of blocks: any kernel that ran ahead would break
/// the exact sums.
#[test]
fn chained_launches_see_each_others_results() {
    let Some(gpu) = gpu() else { return };
    let n = 1 << 22;
    let one = gpu.from_host(&vec![1.0f32; n], 1, n);
    let mut a = gpu.from_host(&vec![0.0f32; n], 1, n);
    let mut b = gpu.from_host(&vec![0.0f32; n], 1, n);
    let steps = 1000;
    for _ in 0..steps {
        gpu.add_assign(&mut a, &one);
        gpu.add_assign(&mut b, &a);
    }
    // a = steps, b = 1 + 2 + ... + steps (exact in f32).
    let want_b = (steps * (steps + 1) / 2) as f32;
    let (a, b) = (gpu.to_host(&a), gpu.to_host(&b));
    assert!(a.iter().all(|&v| v == steps as f32), "a chained add read a stale input");
    assert!(b.iter().all(|&v| v == want_b), "a chained add read a stale input: {:?} (want {want_b})", b.iter().find(|&&v| v != want_b));
}

/// The roofline's bandwidth probes read (and write) the whole buffer: a kernel whose loads were
/// dropped would finish in microseconds and report an impossible bandwidth.
#[test]
fn bandwidth_probes_measure_device_memory() {
    let Some(gpu) = gpu() else { return };
    let (copy, read) = (gpu.copy_bandwidth(1 << 30, 3).unwrap(), gpu.read_bandwidth(1 << 30, 3).unwrap());
    for (what, bytes_per_s) in [("copy", copy), ("read", read)] {
        // Any GPU with bf16 tensor cores exceeds 100 GB/s; none reaches 20 TB/s.
        assert!(bytes_per_s > 1e11 && bytes_per_s < 2e13, "{what} bandwidth {bytes_per_s:.3e} B/s is not a memory bandwidth");
    }
}

/// Memory the pool kept from freed activations is not counted against the next cache: a
/// second engine in the same process (a bench sweep) gets the room the first one had.
#[test]
fn freed_activations_do_not_shrink_the_cache_budget() {
    let Some(gpu) = gpu() else { return };
    let before = gpu.cache_budget(0.9, 0).unwrap();
    let gib = 1 << 30;
    {
        // 2 GiB of activations, computed and freed.
        let x = gpu.from_host(&vec![1.0f32; 1024], 1, 1024);
        let big: Vec<_> = (0..4).map(|_| gpu.gather_rows(&x, &vec![0u32; gib / 8 / 1024])).collect();
        gpu.synchronize();
        drop(big);
    }
    let after = gpu.cache_budget(0.9, 0).unwrap();
    assert!(after + gib / 4 >= before, "cache budget fell from {before} to {after} bytes after freeing activations");
}

#[test]
fn fused_projections_equal_the_separate_ops_bitwise() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    // Odd part widths; totals past 8320 columns take the pipelined kernel from 17 rows.
    for (inputs, widths) in [(96, vec![37, 64, 1, 3]), (264, vec![130, 6]), (128, vec![8192, 100, 32, 32]), (2048, vec![40, 24, 16, 8])] {
        for dtype in [Dtype::F32, Dtype::BF16] {
            let parts: Vec<_> = widths.iter().map(|&n| random_matrix(&mut rng, n, inputs, dtype)).collect();
            let stacked = gpu.upload_stacked(&parts).unwrap();
            let separate: Vec<_> = parts.iter().map(|m| gpu.upload_matrix(m).unwrap()).collect();
            let (gate_up, cpu_gate_up) = (gpu.upload_stacked(&parts[..2]).unwrap(), cpu.upload_stacked(&parts[..2]).unwrap());
            let (i, j) = (widths[0], widths[1]);
            // SwiGLU pairs need gate and up of one width: the first part's width, twice.
            let pair = [parts[0].clone(), random_matrix(&mut rng, i, inputs, dtype)];
            let (swiglu_w, cpu_swiglu_w) = (gpu.upload_stacked(&pair).unwrap(), cpu.upload_stacked(&pair).unwrap());
            let (gate, up) = (gpu.upload_matrix(&pair[0]).unwrap(), gpu.upload_matrix(&pair[1]).unwrap());
            for rows in [1, 7, 17, 40, 64, 65, 200] {
                let x = rng.vec(rows * inputs, 1.0);
                let gx = gpu.from_host(&x, rows, inputs);
                let what = format!("{inputs} -> {widths:?} ({dtype:?}), {rows} rows");
                let got: Vec<Vec<f32>> = gpu.matmul_parts(&gx, &stacked, &widths).iter().map(|t| gpu.to_host(t)).collect();
                for (p, w) in separate.iter().enumerate() {
                    assert!(bitwise_equal(&got[p], &gpu.to_host(&gpu.matmul(&gx, w))), "matmul_parts part {p}: {what}");
                }
                let two = gpu.matmul_parts(&gx, &gate_up, &[i, j]);
                assert!(bitwise_equal(&gpu.to_host(&two[1]), &got[1]), "two parts: {what}");
                let want = gpu.silu_mul(&gpu.matmul(&gx, &gate), &gpu.matmul(&gx, &up));
                let fused = gpu.matmul_swiglu(&gx, &swiglu_w);
                assert!(bitwise_equal(&gpu.to_host(&fused), &gpu.to_host(&want)), "matmul_swiglu: {what}");
                let cx = cpu.from_host(&x, rows, inputs);
                let err = relative_error(&gpu.to_host(&fused), &cpu.to_host(&cpu.matmul_swiglu(&cx, &cpu_swiglu_w)));
                assert!(err < 1e-4, "matmul_swiglu against the CPU: {what}: relative error {err}");
                let err = relative_error(&gpu.to_host(&two[0]), &cpu.to_host(&cpu.matmul_parts(&cx, &cpu_gate_up, &[i, j])[0]));
                assert!(err < 1e-4, "matmul_parts against the CPU: {what}: relative error {err}");
                let acc0 = rng.vec(rows * i, 1.0);
                let mut acc = gpu.from_host(&acc0, rows, i);
                gpu.matmul_add(&mut acc, &gx, &gate);
                let mut want = gpu.from_host(&acc0, rows, i);
                gpu.add_assign(&mut want, &gpu.matmul(&gx, &gate));
                assert!(bitwise_equal(&gpu.to_host(&acc), &gpu.to_host(&want)), "matmul_add: {what}");
                // The norm inside the projection's launch (bf16 weights up to 16 rows, K in
                // whole 32-wide blocks: the streaming kernels normalize the rows themselves).
                let norm = gpu.upload_vector(&rng.vec(inputs, 1.0)).unwrap();
                let h = gpu.rms_norm(&gx, &norm, 1e-6);
                let want: Vec<Vec<f32>> = gpu.matmul_parts(&h, &stacked, &widths).iter().map(|t| gpu.to_host(t)).collect();
                let got = gpu.rms_norm_matmul_parts(&gx, &norm, 1e-6, &stacked, &widths);
                for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(bitwise_equal(&gpu.to_host(g), w), "rms_norm_matmul_parts part {p}: {what}");
                }
                let got = gpu.rms_norm_matmul_swiglu(&gx, &norm, 1e-6, &swiglu_w);
                assert!(bitwise_equal(&gpu.to_host(&got), &gpu.to_host(&gpu.matmul_swiglu(&h, &swiglu_w))), "rms_norm_matmul_swiglu: {what}");
            }
        }
    }
    // Parts that do not share a column count are refused.
    let bad = [random_matrix(&mut rng, 4, 32, Dtype::BF16), random_matrix(&mut rng, 4, 48, Dtype::BF16)];
    let Err(e) = gpu.upload_stacked(&bad) else { panic!("stacked 32 and 48 columns") };
    assert!(e.to_string().contains("4x48 matrix under 32 columns"), "{e}");
}

#[test]
fn row_ops_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    for (rows, cols) in [(1, 7), (5, 64), (33, 300), (130, 1024)] {
        let x = rng.vec(rows * cols, 2.0);
        let y = rng.vec(rows * cols, 2.0);
        let (gx, gy) = (gpu.from_host(&x, rows, cols), gpu.from_host(&y, rows, cols));
        let (cx, cy) = (cpu.from_host(&x, rows, cols), cpu.from_host(&y, rows, cols));
        let w = rng.vec(cols, 1.5);
        let check = |name: &str, got: Vec<f32>, want: Vec<f32>| {
            let err = relative_error(&got, &want);
            assert!(err < 2e-6, "{name} {rows}x{cols}: relative error {err}");
        };
        check("rms_norm", gpu.to_host(&gpu.rms_norm(&gx, &gpu.upload_vector(&w).unwrap(), 1e-6)), cpu.to_host(&cpu.rms_norm(&cx, &w, 1e-6)));
        check("silu_mul", gpu.to_host(&gpu.silu_mul(&gx, &gy)), cpu.to_host(&cpu.silu_mul(&cx, &cy)));
        let (mut gs, mut cs) = (gpu.from_host(&x, rows, cols), cpu.from_host(&x, rows, cols));
        gpu.add_assign(&mut gs, &gy);
        cpu.add_assign(&mut cs, &cy);
        check("add_assign", gpu.to_host(&gs), cpu.to_host(&cs));
        let picks: Vec<u32> = (0..cols + 3).map(|_| rng.below(cols) as u32).collect();
        check("gather_cols", gpu.to_host(&gpu.gather_cols(&gx, &picks)), cpu.to_host(&cpu.gather_cols(&cx, &picks)));
        let rpicks: Vec<u32> = (0..rows + 2).map(|_| rng.below(rows) as u32).collect();
        check("gather_rows", gpu.to_host(&gpu.gather_rows(&gx, &rpicks)), cpu.to_host(&cpu.gather_rows(&cx, &rpicks)));
        check("concat_cols", gpu.to_host(&gpu.concat_cols(&gx, &gy)), cpu.to_host(&cpu.concat_cols(&cx, &cy)));
        for dtype in [Dtype::F32, Dtype::BF16] {
            let table = random_matrix(&mut rng, 50, cols, dtype);
            let ids: Vec<u32> = (0..rows).map(|_| rng.below(50) as u32).collect();
            let got = gpu.to_host(&gpu.embed(&gpu.upload_matrix(&table).unwrap(), &ids));
            let want = cpu.to_host(&cpu.embed(&cpu.upload_matrix(&table).unwrap(), &ids));
            let err = relative_error(&got, &want);
            assert!(err < 2e-5, "embed ({dtype:?}): relative error {err}");
        }
    }
}

fn linear_spec(l: LinearAttnShape) -> CacheSpec {
    CacheSpec { attention_layers: 0, num_blocks: 1, block_size: 16, kv_heads: 1, head_dim: 1, kv_dtype: KvDtype::F32, linear_layers: 1, linear: l, state_slots: 3, snapshot_slots: 8, checkpoint_slots: 0 }
}

#[test]
fn gated_attention_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    for (nq, nkv, hd, rot) in [(4, 2, 32, 8), (3, 1, 16, 4), (6, 3, 64, 16), (16, 4, 256, 64)] {
        let dims = AttentionDims { num_heads: nq, num_kv_heads: nkv, head_dim: hd, rotary_dim: rot, rope_theta: 1e6, eps: 1e-6 };
        let spec = attention_spec(KvDtype::F32, nkv, hd, 30, 3);
        let mut gcache = gpu.alloc_cache(&spec).unwrap();
        let mut ccache = cpu.alloc_cache(&spec).unwrap();
        let (qn, kn) = (rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>(), rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>());
        let (gqn, gkn) = (gpu.upload_vector(&qn).unwrap(), gpu.upload_vector(&kn).unwrap());
        let mut seqs = cache_sequences(&mut rng, 3, 10);
        for (step, rows) in cache_steps().iter().enumerate() {
            let lay = layout_rows(&seqs, rows);
            let t = lay.num_tokens();
            let qg = rng.vec(t * nq * 2 * hd, 2.0);
            let k = rng.vec(t * nkv * hd, 2.0);
            let v = rng.vec(t * nkv * hd, 1.0);
            let got = gpu.gated_attention(&gpu.from_host(&qg, t, nq * 2 * hd), &gpu.from_host(&k, t, nkv * hd), &gpu.from_host(&v, t, nkv * hd), &gqn, &gkn, &dims, &lay, &mut gcache, 0);
            let want = cpu.gated_attention(&cpu.from_host(&qg, t, nq * 2 * hd), &cpu.from_host(&k, t, nkv * hd), &cpu.from_host(&v, t, nkv * hd), &qn, &kn, &dims, &lay, &mut ccache, 0);
            let err = relative_error(&gpu.to_host(&got), &cpu.to_host(&want));
            assert!(err < 1e-4, "attention {nq}/{nkv}x{hd} step {step}: relative error {err}");
            advance_rows(&mut seqs, rows);
        }
        let host = gpu.cache_to_host(&gcache);
        assert!(relative_error(&host.kv.keys(0), &ccache.kv.keys(0)) < 1e-5, "attention {nq}/{nkv}x{hd}: K cache differs");
        assert!(relative_error(&host.kv.values(0), &ccache.kv.values(0)) < 1e-6, "attention {nq}/{nkv}x{hd}: V cache differs");
    }
}

/// A decode step with few rows gives each context range of a query its own block and merges
/// them in a second launch; a step with many rows walks the ranges in one block. A step whose
/// rows are all one token prepares its queries, keys and values in the attention launch itself
/// (attn_decode); other steps prepare them in a launch before (attn_prep). Outputs and cached
/// keys and values must agree bitwise (speculation and preemption put the same query in steps
/// of any size).
#[test]
fn attention_ranges_merge_the_same_in_split_and_walked_blocks() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    let (nq, nkv, hd) = (4, 2, 64);
    let dims = AttentionDims { num_heads: nq, num_kv_heads: nkv, head_dim: hd, rotary_dim: 16, rope_theta: 1e6, eps: 1e-6 };
    let spec = attention_spec(KvDtype::F32, nkv, hd, 3 * 90, 3);
    let (mut gcache, mut ccache) = (gpu.alloc_cache(&spec).unwrap(), cpu.alloc_cache(&spec).unwrap());
    let (cqn, ckn): (Vec<f32>, Vec<f32>) = (rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect(), rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect());
    let (qn, kn) = (gpu.upload_vector(&cqn).unwrap(), gpu.upload_vector(&ckn).unwrap());
    let mut seqs = cache_sequences(&mut rng, 3, 90);
    let mut run = |seqs: &[CacheSeq], rows: &[(RowKind, usize, usize)], rng: &mut Rng, check_cpu: bool| {
        let lay = layout_rows(seqs, rows);
        let t = lay.num_tokens();
        let (qg, k, v) = (rng.vec(t * nq * 2 * hd, 2.0), rng.vec(t * nkv * hd, 2.0), rng.vec(t * nkv * hd, 1.0));
        let got = gpu.to_host(&gpu.gated_attention(&gpu.from_host(&qg, t, nq * 2 * hd), &gpu.from_host(&k, t, nkv * hd), &gpu.from_host(&v, t, nkv * hd), &qn, &kn, &dims, &lay, &mut gcache, 0));
        if check_cpu {
            let want = cpu.gated_attention(&cpu.from_host(&qg, t, nq * 2 * hd), &cpu.from_host(&k, t, nkv * hd), &cpu.from_host(&v, t, nkv * hd), &cqn, &ckn, &dims, &lay, &mut ccache, 0);
            let err = relative_error(&got, &cpu.to_host(&want));
            assert!(err < 1e-4, "attention with {t} tokens: relative error {err}");
        }
        (got, qg, k, v)
    };
    // Contexts of 1100+ keys: six ranges of 192 keys.
    for (s, n) in [(0, 1100), (1, 700)] {
        run(&seqs, &[(RowKind::Prefill, s, n)], &mut rng, true);
        advance_rows(&mut seqs, &[(RowKind::Prefill, s, n)]);
    }
    // The same query alone (split ranges) and beside 150 prefill tokens (walked ranges).
    let alone = [(RowKind::Generate, 0, 1)];
    let lay = layout_rows(&seqs, &alone);
    let (qg, k, v) = (rng.vec(nq * 2 * hd, 2.0), rng.vec(nkv * hd, 2.0), rng.vec(nkv * hd, 1.0));
    let single = gpu.to_host(&gpu.gated_attention(&gpu.from_host(&qg, 1, nq * 2 * hd), &gpu.from_host(&k, 1, nkv * hd), &gpu.from_host(&v, 1, nkv * hd), &qn, &kn, &dims, &lay, &mut gcache, 0));
    let cached_alone = gpu.cache_to_host(&gcache);
    let crowd = [(RowKind::Generate, 0, 1), (RowKind::Prefill, 1, 150)];
    let lay = layout_rows(&seqs, &crowd);
    let t = lay.num_tokens();
    let mut qg_all = qg.clone();
    qg_all.extend(rng.vec((t - 1) * nq * 2 * hd, 2.0));
    let mut k_all = k.clone();
    k_all.extend(rng.vec((t - 1) * nkv * hd, 2.0));
    let mut v_all = v.clone();
    v_all.extend(rng.vec((t - 1) * nkv * hd, 1.0));
    let many = gpu.to_host(&gpu.gated_attention(&gpu.from_host(&qg_all, t, nq * 2 * hd), &gpu.from_host(&k_all, t, nkv * hd), &gpu.from_host(&v_all, t, nkv * hd), &qn, &kn, &dims, &lay, &mut gcache, 0));
    assert!(bitwise_equal(&single, &many[..nq * hd]), "a query's attention differs between a 1-token and a {t}-token step");
    // The crowd step wrote the query's key and value again (and the prefill row's, elsewhere).
    let cached_crowd = gpu.cache_to_host(&gcache);
    let (table, p) = (&seqs[0].table, seqs[0].pos);
    let slot = (table[p / 16] as usize * 16 + p % 16) * nkv * hd;
    for (what, alone, crowd) in [("key", &cached_alone.kv.keys(0), &cached_crowd.kv.keys(0)), ("value", &cached_alone.kv.values(0), &cached_crowd.kv.values(0))] {
        assert!(bitwise_equal(&alone[slot..slot + nkv * hd], &crowd[slot..slot + nkv * hd]), "the query's cached {what} differs between a 1-token and a {t}-token step");
    }
    let want = cpu.gated_attention(&cpu.from_host(&qg, 1, nq * 2 * hd), &cpu.from_host(&k, 1, nkv * hd), &cpu.from_host(&v, 1, nkv * hd), &cqn, &ckn, &dims, &layout_rows(&seqs, &alone), &mut ccache, 0);
    let err = relative_error(&single, &cpu.to_host(&want));
    assert!(err < 1e-4, "decode attention over 1101 keys: relative error {err}");
}

fn compare_linear_caches(what: &str, got: &CpuCache, want: &CpuCache) {
    for (name, a, b) in [("conv", &got.conv, &want.conv), ("rec", &got.rec, &want.rec), ("conv_snap", &got.conv_snap, &want.conv_snap), ("rec_snap", &got.rec_snap, &want.rec_snap)] {
        let err = relative_error(&a[0], &b[0]);
        assert!(err < 1e-3, "{what}: {name} state relative error {err}");
    }
}

#[test]
fn gated_delta_net_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    // (1, 2, 24, 20): dk not a multiple of 16 (the device keeps such states row by row) and a
    // conv window of 3 * 88 floats, which commit_states' chunks once left a tail of.
    for (nk, nv, dk, dv) in [(2, 4, 16, 24), (3, 3, 32, 32), (1, 2, 128, 128), (2, 2, 64, 128), (1, 3, 32, 48), (1, 2, 24, 20)] {
        let cfg = LinearAttnShape { num_key_heads: nk, num_value_heads: nv, key_head_dim: dk, value_head_dim: dv, conv_kernel: 4, out_heads_tiled: false };
        let what = format!("gdn {nk}/{nv} heads, dk {dk}, dv {dv}");
        let spec = linear_spec(cfg.clone());
        let mut gcache = gpu.alloc_cache(&spec).unwrap();
        let mut ccache = cpu.alloc_cache(&spec).unwrap();
        let conv_w = rng.vec(cfg.conv_dim() * 4, 0.5);
        let neg_a: Vec<f32> = rng.vec(nv, 1.0).iter().map(|v| -v.exp()).collect();
        let dt_bias = rng.vec(nv, 1.0);
        let norm_w: Vec<f32> = rng.vec(dv, 0.2).iter().map(|v| 1.0 + v).collect();
        let cparams = GdnParams::<CpuBackend> { conv_weight: conv_w.clone(), neg_a: neg_a.clone(), dt_bias: dt_bias.clone(), norm_weight: norm_w.clone() };
        let gparams = GdnParams::<CudaBackend> {
            conv_weight: gpu.upload_vector(&conv_w).unwrap(),
            neg_a: gpu.upload_vector(&neg_a).unwrap(),
            dt_bias: gpu.upload_vector(&dt_bias).unwrap(),
            norm_weight: gpu.upload_vector(&norm_w).unwrap(),
        };
        let mut seqs = cache_sequences(&mut rng, 3, 10);
        for (step, rows) in cache_steps().iter().enumerate() {
            if step == 2 {
                // Accept the second of sequence 1's three generated tokens; start over on slot 2.
                // Slot 0 takes snapshot 2's conv window in the same launch (any snapshot works
                // for the comparison; two commits at once exercise the batched kernel, one of
                // them a one-token row's). The last step's one-token rows write their delta-rule
                // state in place, which the comparison after it checks.
                let commits = [StateCommit { slot: 1, snapshot: 1, conv_only: false }, StateCommit { slot: 0, snapshot: 2, conv_only: true }];
                gpu.commit_states(&mut gcache, &commits);
                cpu.commit_states(&mut ccache, &commits);
                gpu.reset_states(&mut gcache, &[2]);
                cpu.reset_states(&mut ccache, &[2]);
                seqs[1].pos -= 1;
                seqs[2].pos = 0;
            }
            let lay = layout_rows(&seqs, rows);
            let t = lay.num_tokens();
            let mixed = rng.vec(t * cfg.conv_dim(), 1.0);
            let z = rng.vec(t * cfg.value_dim(), 2.0);
            let b = rng.vec(t * nv, 2.0);
            let a = rng.vec(t * nv, 2.0);
            let got = {
                let f = |v: &[f32], c: usize| gpu.from_host(v, t, c);
                gpu.gated_delta_net(&f(&mixed, cfg.conv_dim()), &f(&z, cfg.value_dim()), &f(&b, nv), &f(&a, nv), &gparams, &cfg, 1e-6, &lay, &mut gcache, 0)
            };
            let want = {
                let f = |v: &[f32], c: usize| cpu.from_host(v, t, c);
                cpu.gated_delta_net(&f(&mixed, cfg.conv_dim()), &f(&z, cfg.value_dim()), &f(&b, nv), &f(&a, nv), &cparams, &cfg, 1e-6, &lay, &mut ccache, 0)
            };
            let err = relative_error(&gpu.to_host(&got), &cpu.to_host(&want));
            assert!(err < 1e-3, "{what} step {step}: relative error {err}");
            compare_linear_caches(&format!("{what} step {step}"), &gpu.cache_to_host(&gcache), &ccache);
            advance_rows(&mut seqs, rows);
        }
    }
}

/// MoE weights on backend `b` as the model loads them: the router (with the shared expert's
/// gate row under it), each expert's gate over up, then down.
fn moe_weights<B: Backend>(b: &B, routers: &[MatrixBytes], experts: &[[MatrixBytes; 3]], shared: Option<&[MatrixBytes; 3]>) -> MoeWeights<B> {
    let expert = |[gate, up, down]: &[MatrixBytes; 3]| [b.upload_stacked(&[gate.clone(), up.clone()]).unwrap(), b.upload_matrix(down).unwrap()];
    MoeWeights { router: b.upload_stacked(routers).unwrap(), experts: experts.iter().map(expert).collect(), shared: shared.map(expert), shared_gate: shared.is_some() }
}

/// The smallest gap, over `t` tokens of `x`, between a token's k-th and (k+1)-th largest router
/// logits (the first `e` router outputs), on the CPU.
fn smallest_top_k_gap(cpu: &CpuBackend, w: &MoeWeights<CpuBackend>, x: &[f32], t: usize, h: usize, e: usize, k: usize) -> f32 {
    let logits = cpu.to_host(&cpu.matmul(&cpu.from_host(x, t, h), &w.router));
    let width = logits.len() / t;
    logits
        .chunks(width)
        .map(|row| {
            let mut v = row[..e].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            if k < e { v[k - 1] - v[k] } else { f32::INFINITY }
        })
        .fold(f32::INFINITY, f32::min)
}

#[test]
fn moe_matches_cpu_and_tokens_are_independent() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    for (h, e, k, inter, shared, renorm, dtype) in [(64, 8, 2, 48, 32, true, Dtype::F32), (96, 16, 5, 40, 0, false, Dtype::F32), (128, 64, 8, 64, 64, true, Dtype::BF16), (256, 16, 4, 96, 64, true, Dtype::BF16), (1024, 8, 2, 32, 32, true, Dtype::BF16), (2048, 8, 2, 32, 32, true, Dtype::BF16)] {
        let cfg = MoeShape { num_experts: e, top_k: k, expert_intermediate: inter, shared_intermediate: shared, norm_topk_prob: renorm };
        let m = |rng: &mut Rng, r, c| random_matrix(rng, r, c, dtype);
        let router = m(&mut rng, e, h);
        let experts: Vec<[_; 3]> = (0..e).map(|_| [m(&mut rng, inter, h), m(&mut rng, inter, h), m(&mut rng, h, inter)]).collect();
        let shared_w = (shared > 0).then(|| [m(&mut rng, shared, h), m(&mut rng, shared, h), m(&mut rng, h, shared)]);

        // The shared expert's gate row stacked under the router, as the model loads it.
        let routers: Vec<_> = if shared > 0 { vec![router.clone(), m(&mut rng, 1, h)] } else { vec![router.clone()] };
        let gw = moe_weights(&gpu, &routers, &experts, shared_w.as_ref());
        let cw = moe_weights(&cpu, &routers, &experts, shared_w.as_ref());
        let max_t = 150;
        // Router logits spread enough that the top-k choice has no near-ties: the inputs are
        // drawn again (from the same seed's stream) until every token's k-th and (k+1)-th
        // largest logits are far further apart than the two backends' rounding, which could
        // otherwise pick different experts. The MoE output is added into a residual stream.
        let x = loop {
            let x = rng.vec(max_t * h, 3.0);
            if smallest_top_k_gap(&cpu, &cw, &x, max_t, h, e, k) > 1e-4 {
                break x;
            }
        };
        let residual = rng.vec(max_t * h, 1.0);
        let run_gpu = |t: usize| {
            let mut acc = gpu.from_host(&residual[..t * h], t, h);
            gpu.moe_add(&mut acc, &gpu.from_host(&x[..t * h], t, h), &gw, &cfg);
            gpu.to_host(&acc)
        };
        let full = run_gpu(max_t);
        // 1 and 5 tokens: the router matmul routes and groups in its last block (one launch
        // after another, so its block counter must be back at zero each time); 12 route in
        // per-token blocks and group in one; 70 and 150 route and group in blocks per token and
        // per expert.
        for t in [1, 5, 12, 70, 150] {
            let got = run_gpu(t);
            let mut acc = cpu.from_host(&residual[..t * h], t, h);
            cpu.moe_add(&mut acc, &cpu.from_host(&x[..t * h], t, h), &cw, &cfg);
            let want = cpu.to_host(&acc);
            let err = relative_error(&got, &want);
            // Both backends round the SwiGLU rows to bf16 before the down projection; where the
            // GPU's f32 sums and the CPU's differ in their last bit, a value can round to the
            // neighbouring bf16 (2^-8 apart): 2.1e-4 measured at E16 k5, 70 tokens (H100).
            assert!(err < 1e-3, "moe E{e} k{k} with {t} tokens: relative error {err}");
            assert!(bitwise_equal(&got, &full[..t * h]), "moe E{e} k{k}: tokens differ between {t} and {max_t} tokens");
        }
        // The whole MoE half of a layer (the input norm inside the streaming router for up to
        // 8 bf16 tokens, the next layer's norm in the combine pass): the residual stream and
        // its norm are bitwise those of the separate ops.
        let (pre_norm, norm) = (gpu.upload_vector(&rng.vec(h, 1.0)).unwrap(), gpu.upload_vector(&rng.vec(h, 1.0)).unwrap());
        let widths = [40, 24, 72];
        let proj = gpu.upload_stacked(&widths.map(|n| random_matrix(&mut rng, n, h, Dtype::BF16))).unwrap();
        for t in [1, 5, 150] {
            let res = &x[..t * h];
            let mut fused = gpu.from_host(res, t, h);
            let launches_before = gpu.launch_count();
            let normed = gpu.moe_residual(&mut fused, &pre_norm, &gw, &cfg, &norm, 1e-6);
            // One bf16 token with the shared expert among the groups, on sm_90 and later: the
            // router, the routing and the gate/up in one launch (moe_route_gate_up), the down
            // projection adding into the residual row, then the norm; the comparisons below
            // then check that launch against the separate ops bitwise.
            if t == 1 && shared == inter && dtype == Dtype::BF16 && sm_version(&gpu) >= 90 && std::env::var("KESTREL_CUDA_ROUTE_GATE_UP").map_or(true, |v| v != "0") {
                assert_eq!(gpu.launch_count() - launches_before, 3, "moe_residual E{e} h{h}: one token should take the fused router and gate/up launch");
            }
            let mut separate = gpu.from_host(res, t, h);
            let input = gpu.rms_norm(&separate, &pre_norm, 1e-6);
            gpu.moe_add(&mut separate, &input, &gw, &cfg);
            let want = gpu.rms_norm(&separate, &norm, 1e-6);
            assert!(bitwise_equal(&gpu.to_host(&fused), &gpu.to_host(&separate)), "moe_residual E{e} with {t} tokens: residual stream differs from the separate ops");
            assert!(bitwise_equal(&gpu.to_host(&normed), &gpu.to_host(&want)), "moe_residual E{e} with {t} tokens: norm differs from rms_norm");
            // Then the next layer's input projection (bf16, three parts): up to 16 tokens the
            // streaming projection adds up the experts' rows and normalizes them itself. Its
            // parts and the residual stream are bitwise those of the separate ops.
            let mut projected = gpu.from_host(res, t, h);
            let parts = gpu.moe_residual_project(&mut projected, &pre_norm, &gw, &cfg, &norm, 1e-6, &proj, &widths);
            let want_parts = gpu.matmul_parts(&want, &proj, &widths);
            assert!(bitwise_equal(&gpu.to_host(&projected), &gpu.to_host(&separate)), "moe_residual_project E{e} h{h} with {t} tokens: residual stream differs from the separate ops");
            for (i, (got, want)) in parts.iter().zip(&want_parts).enumerate() {
                assert!(bitwise_equal(&gpu.to_host(got), &gpu.to_host(want)), "moe_residual_project E{e} h{h} with {t} tokens: part {i} differs from matmul_parts of the norm");
            }
        }
    }
}

/// The GPU's compute capability as a number (90 for sm_90), from its description.
fn sm_version(gpu: &CudaBackend) -> u32 {
    let desc = gpu.device_description();
    desc.rsplit("sm_").next().map(|v| v.chars().take_while(char::is_ascii_digit).collect::<String>()).and_then(|v| v.parse().ok()).unwrap_or(0)
}
