//! Attention on tensor cores (attn_flash, bf16, fp8 and tq3 caches) against the CPU reference on
//! random inputs: prefill pieces starting at unaligned positions, odd head counts and group
//! sizes, verify and decode rows, and a context long enough to cut into several ranges; and the
//! bitwise cases: a prompt prefilled in one piece or in 64- and 128-token pieces, a decode row
//! alone, among 7 and among 63 rows, a verify row alone and beside a prefill; and a plain decode
//! step, whose launch prepares its own heads (attn_flash_decode), against the same tokens
//! prepared by attn_prep in verify and prefill rows; and the same bits with and without the
//! shared weights and staged codes the kernel uses where shared memory allows. Runs where a GPU
//! is present:
//!
//!     cargo test --release --test cuda_flash_attention

mod cuda_support;

use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::{CudaBackend, CudaCache};
use kestrel::backend::{AttentionDims, Backend, BatchLayout, KvDtype, RowKind};

/// The formats whose attention runs on tensor cores.
const FLASH_DTYPES: [KvDtype; 3] = [KvDtype::Bf16, KvDtype::Fp8, KvDtype::Tq3];

/// q and the softmax weights enter the MMAs as two 16-bit parts each and the MMAs accumulate in
/// f32 in their own order: close to f32 products, with a margin (one bf16 rounding of q and
/// the weights, as FlashAttention does, left 2e-3). tq3's codebook levels enter as fp16 (within
/// 2^-12 of the f32 levels the reference reads; as bf16 they left 2e-3 too).
const TOLERANCE: f32 = 1e-3;

fn seed() -> u64 {
    let s = std::env::var("KESTREL_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    eprintln!("seed {s}");
    s
}

/// One attention layer's shapes, norm weights and step inputs.
struct Layer {
    dims: AttentionDims,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

impl Layer {
    fn new(rng: &mut Rng, nq: usize, nkv: usize, hd: usize, rot: usize) -> Self {
        let dims = AttentionDims { num_heads: nq, num_kv_heads: nkv, head_dim: hd, rotary_dim: rot, rope_theta: 1e6, eps: 1e-6 };
        let q_norm = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
        let k_norm = rng.vec(hd, 0.5).iter().map(|v| 1.0 + v).collect();
        Layer { dims, q_norm, k_norm }
    }

    /// Random q/gate projection, keys and values for `t` tokens.
    fn inputs(&self, rng: &mut Rng, t: usize) -> Inputs {
        let (nq, nkv, hd) = (self.dims.num_heads, self.dims.num_kv_heads, self.dims.head_dim);
        Inputs { qg: rng.vec(t * nq * 2 * hd, 2.0), k: rng.vec(t * nkv * hd, 2.0), v: rng.vec(t * nkv * hd, 1.0) }
    }

    fn run(&self, gpu: &CudaBackend, cache: &mut CudaCache, lay: &BatchLayout, x: &Inputs) -> Vec<f32> {
        let (nq, nkv, hd) = (self.dims.num_heads, self.dims.num_kv_heads, self.dims.head_dim);
        let t = lay.num_tokens();
        let (qn, kn) = (gpu.upload_vector(&self.q_norm).unwrap(), gpu.upload_vector(&self.k_norm).unwrap());
        let out = gpu.gated_attention(&gpu.from_host(&x.qg, t, nq * 2 * hd), &gpu.from_host(&x.k, t, nkv * hd), &gpu.from_host(&x.v, t, nkv * hd), &qn, &kn, &self.dims, lay, cache, 0);
        gpu.to_host(&out)
    }
}

#[derive(Clone)]
struct Inputs {
    qg: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Inputs {
    /// Tokens `a..b` of these inputs.
    fn tokens(&self, a: usize, b: usize, nq: usize, nkv: usize, hd: usize) -> Inputs {
        Inputs { qg: self.qg[a * nq * 2 * hd..b * nq * 2 * hd].to_vec(), k: self.k[a * nkv * hd..b * nkv * hd].to_vec(), v: self.v[a * nkv * hd..b * nkv * hd].to_vec() }
    }

    fn concat(parts: &[&Inputs]) -> Inputs {
        Inputs { qg: parts.iter().flat_map(|p| p.qg.clone()).collect(), k: parts.iter().flat_map(|p| p.k.clone()).collect(), v: parts.iter().flat_map(|p| p.v.clone()).collect() }
    }
}

/// Each of these formats runs on the tensor-core kernels (`KESTREL_CUDA_FLASH_ATTN=0` keeps the
/// per-(token, head) kernels), and f32, the exact reference, does not.
#[test]
fn flash_attention_serves_bf16_fp8_and_tq3() {
    let Some(gpu) = gpu() else { return };
    let on = std::env::var("KESTREL_CUDA_FLASH_ATTN").map_or(true, |v| v != "0");
    for dtype in FLASH_DTYPES {
        for (hd, group) in [(256, 4), (16, 3), (128, 1)] {
            assert_eq!(gpu.attention_on_tensor_cores(dtype, hd, group), on, "{dtype} {hd}x{group}");
        }
    }
    assert!(!gpu.attention_on_tensor_cores(KvDtype::F32, 256, 4));
    assert!(!gpu.attention_on_tensor_cores(KvDtype::Tq3UniformValues, 256, 4));
}

/// The device's tensor-core attention reads its own cache as the CPU reference reads that same
/// cache: prefill pieces at unaligned positions beside verify rows, a prefill that takes a
/// context past 2048 keys (ranges of two tiles), decode and verify steps after it; group sizes
/// 4, 3, 1 and 2, head dims 256, 16, 128, 32.
#[test]
fn flash_attention_matches_the_cpu_on_random_inputs() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    use RowKind::*;
    let steps: Vec<Vec<(RowKind, usize, usize)>> = vec![
        vec![(Prefill, 0, 37), (Prefill, 1, 100)],
        vec![(Prefill, 0, 300), (Generate, 1, 3), (Prefill, 2, 5)],
        vec![(Prefill, 0, 1900), (Generate, 2, 2)],
        vec![(Prefill, 0, 211), (Generate, 1, 1), (Prefill, 3, 70)],
        vec![(Generate, 0, 1), (Generate, 1, 1), (Generate, 2, 1), (Generate, 3, 1)],
        vec![(Generate, 0, 4), (Generate, 3, 4)],
    ];
    for dtype in FLASH_DTYPES {
        for (nq, nkv, hd, rot) in [(16, 4, 256, 64), (3, 1, 16, 4), (15, 5, 128, 32), (4, 2, 32, 8)] {
            let what = format!("{dtype} {nq}/{nkv}x{hd}");
            let layer = Layer::new(&mut rng, nq, nkv, hd, rot);
            let spec = attention_spec(dtype, nkv, hd, 4 * 160, 4);
            let mut cache = gpu.alloc_cache(&spec).unwrap();
            let mut seqs = cache_sequences(&mut rng, 4, 160);
            for (step, rows) in steps.iter().enumerate() {
                let lay = layout_rows(&seqs, rows);
                let x = layer.inputs(&mut rng, lay.num_tokens());
                let got = layer.run(&gpu, &mut cache, &lay, &x);
                let stored = gpu.cache_to_host(&cache);
                // The reference over the rows after a row's first 1800 tokens (a long prompt's
                // early rows cost the CPU more than they check).
                let skip: usize = if rows[0].2 > 1800 { 1800 } else { 0 };
                let mut check = lay.clone();
                check.rows[0].token_start = 0;
                check.rows[0].num_tokens -= skip;
                check.rows[0].start_position += skip;
                for r in check.rows.iter_mut().skip(1) {
                    r.token_start -= skip;
                }
                let qg = &x.qg[skip * nq * 2 * hd..];
                let want = cpu.to_host(&cpu.attention_over_cache(&cpu.from_host(qg, lay.num_tokens() - skip, nq * 2 * hd), &layer.q_norm, &layer.dims, &check, &stored, 0));
                let err = relative_error(&got[skip * nq * hd..], &want);
                eprintln!("{what} step {step}: relative error {err:.2e}");
                assert!(err < TOLERANCE, "{what} step {step}: relative error {err}");
                advance_rows(&mut seqs, rows);
            }
        }
    }
}

/// A prompt's rows have the same bits prefilled in one piece, in 64-token pieces (a block per
/// token and range), in 72- and 76-token pieces (each piece's last block holds 2 or 3 row tiles
/// of 16 query rows, so its warps split otherwise than in a full block of 4 or a decode token's
/// block of 1) and in 128-token pieces (pieces end and start inside key tiles and ranges: the
/// prompt crosses 2048 keys).
#[test]
fn flash_attention_prefill_pieces_are_bitwise_equal() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    for dtype in FLASH_DTYPES {
        for (nq, nkv, hd, rot) in [(16, 4, 256, 64), (3, 1, 16, 4)] {
            let what = format!("{dtype} {nq}/{nkv}x{hd}");
            let layer = Layer::new(&mut rng, nq, nkv, hd, rot);
            let n: usize = 2200;
            let seqs = cache_sequences(&mut rng, 1, n.div_ceil(16));
            let x = layer.inputs(&mut rng, n);
            let mut outputs = Vec::new();
            for piece in [n, 64, 72, 76, 128] {
                let mut cache = gpu.alloc_cache(&attention_spec(dtype, nkv, hd, n.div_ceil(16), 1)).unwrap();
                let mut s = seqs.clone();
                let mut out = Vec::new();
                for a in (0..n).step_by(piece) {
                    let b = (a + piece).min(n);
                    let rows = [(RowKind::Prefill, 0, b - a)];
                    out.extend(layer.run(&gpu, &mut cache, &layout_rows(&s, &rows), &x.tokens(a, b, nq, nkv, hd)));
                    advance_rows(&mut s, &rows);
                }
                outputs.push((piece, out));
            }
            for (piece, out) in &outputs[1..] {
                let first_diff = out.iter().zip(&outputs[0].1).position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(first_diff.is_none(), "{what}: {piece}-token pieces differ from one piece at token {}", first_diff.unwrap_or(0) / (nq * hd));
            }
        }
    }
}

/// A decode row has the same bits alone (a block per range, merged by attn_flash_combine),
/// among 7 rows and among 63 (ranges merged in one block); a verify row of 4 tokens the same
/// alone and beside a 150-token prefill (tiles of 16 tokens sharing their key tiles). The rows'
/// contexts reach past 2048 keys.
#[test]
fn flash_attention_rows_are_bitwise_invariant() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    for dtype in FLASH_DTYPES {
        for (nq, nkv, hd, rot) in [(16, 4, 256, 64), (3, 1, 16, 4)] {
            let what = format!("{dtype} {nq}/{nkv}x{hd}");
            let layer = Layer::new(&mut rng, nq, nkv, hd, rot);
            let mut cache = gpu.alloc_cache(&attention_spec(dtype, nkv, hd, 64 * 150, 64)).unwrap();
            let mut seqs = cache_sequences(&mut rng, 64, 150);
            // Contexts: sequence 0 2300 keys, the others 1 to 100.
            let mut fill: Vec<(RowKind, usize, usize)> = vec![(RowKind::Prefill, 0, 2300)];
            fill.extend((1..64).map(|s| (RowKind::Prefill, s, 1 + rng.below(100))));
            let lay = layout_rows(&seqs, &fill);
            let x = layer.inputs(&mut rng, lay.num_tokens());
            layer.run(&gpu, &mut cache, &lay, &x);
            advance_rows(&mut seqs, &fill);
            // Decode: the row alone, among 7, among 63 (same inputs for the shared rows; each
            // run stores the same keys and values at the same positions).
            let mine = layer.inputs(&mut rng, 1);
            let others = layer.inputs(&mut rng, 62);
            let mut results = Vec::new();
            for count in [1, 7, 63] {
                let rows: Vec<(RowKind, usize, usize)> = (0..count).map(|s| (RowKind::Generate, s, 1)).collect();
                let x = Inputs::concat(&[&mine, &others.tokens(0, count - 1, nq, nkv, hd)]);
                let out = layer.run(&gpu, &mut cache, &layout_rows(&seqs, &rows), &x);
                results.push((count, out[..nq * hd].to_vec()));
            }
            for (count, out) in &results[1..] {
                assert!(bitwise_equal(out, &results[0].1), "{what}: a decode row among {count} rows differs from the row alone");
            }
            // Verify rows of 4 tokens: alone, and beside a 150-token prefill.
            let verify = layer.inputs(&mut rng, 4);
            let alone = layer.run(&gpu, &mut cache, &layout_rows(&seqs, &[(RowKind::Generate, 0, 4)]), &verify);
            let prefill = layer.inputs(&mut rng, 150);
            let rows = [(RowKind::Prefill, 5, 150), (RowKind::Generate, 0, 4)];
            let beside = layer.run(&gpu, &mut cache, &layout_rows(&seqs, &rows), &Inputs::concat(&[&prefill, &verify]));
            assert!(bitwise_equal(&alone, &beside[150 * nq * hd..]), "{what}: a verify row beside a prefill differs from the row alone");
        }
    }
}

/// A plain decode step prepares its heads inside the attention launch (attn_flash_decode): its
/// rows and the keys and values it stores have the bits of the same tokens prepared by attn_prep
/// as the last token of a 4-token verify row and as the last token of a prefill piece. Decode
/// steps of 36 rows (one block per token for 4 and 5 kv heads) and of 5 rows (a block per
/// range); contexts of 2301 keys, at tile edges (the new token first or last of its tile) and
/// random.
#[test]
fn flash_attention_fused_decode_rows_equal_the_prepared_rows() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    let n = 36;
    for dtype in FLASH_DTYPES {
        for (nq, nkv, hd, rot) in [(16, 4, 256, 64), (3, 1, 16, 4), (15, 5, 128, 32)] {
            let what = format!("{dtype} {nq}/{nkv}x{hd}");
            let layer = Layer::new(&mut rng, nq, nkv, hd, rot);
            // Prompt lengths (each at least 4: the verify run prefills all but the last 3 first);
            // the decoded token follows the prompt.
            let mut prompts = vec![2300, 63, 64, 127, 128, 4];
            prompts.extend((prompts.len()..n).map(|_| 4 + rng.below(200)));
            let seqs = cache_sequences(&mut rng, n, 2301_usize.div_ceil(16));
            let tokens: Vec<Inputs> = prompts.iter().map(|&p| layer.inputs(&mut rng, p + 1)).collect();
            let spec = attention_spec(dtype, nkv, hd, n * seqs[0].table.len(), n);
            // Runs `steps`, each a list of (kind, sequence, first token, tokens), on a fresh cache;
            // returns each step's output and the cache.
            let run = |steps: &[Vec<(RowKind, usize, usize, usize)>]| {
                let mut cache = gpu.alloc_cache(&spec).unwrap();
                let mut s = seqs.clone();
                let mut outs = Vec::new();
                for step in steps {
                    let rows: Vec<(RowKind, usize, usize)> = step.iter().map(|&(kind, q, _, len)| (kind, q, len)).collect();
                    let parts: Vec<Inputs> = step.iter().map(|&(_, q, a, len)| tokens[q].tokens(a, a + len, nq, nkv, hd)).collect();
                    outs.push(layer.run(&gpu, &mut cache, &layout_rows(&s, &rows), &Inputs::concat(&parts.iter().collect::<Vec<_>>())));
                    advance_rows(&mut s, &rows);
                }
                (outs, gpu.cache_to_host(&cache).kv)
            };
            let row = |out: &[f32], i: usize| out[i * nq * hd..(i + 1) * nq * hd].to_vec();
            let prefill: Vec<_> = (0..n).map(|q| (RowKind::Prefill, q, 0, prompts[q])).collect();
            // Decoded: all rows, and on a cache of its own the first 5.
            let decode = |count: usize| (0..count).map(|q| (RowKind::Generate, q, prompts[q], 1)).collect::<Vec<_>>();
            let (fused, fused_kv) = run(&[prefill.clone(), decode(n)]);
            let (few, _) = run(&[prefill, decode(5)]);
            // Verified: the prompts' last 3 tokens and the new one as 4-token rows.
            let short: Vec<_> = (0..n).map(|q| (RowKind::Prefill, q, 0, prompts[q] - 3)).collect();
            let verify: Vec<_> = (0..n).map(|q| (RowKind::Generate, q, prompts[q] - 3, 4)).collect();
            let (verified, verified_kv) = run(&[short, verify]);
            // Prefilled: prompt and token in one piece.
            let whole: Vec<_> = (0..n).map(|q| (RowKind::Prefill, q, 0, prompts[q] + 1)).collect();
            let (prefilled, prefilled_kv) = run(&[whole]);
            let mut ends = (0, 0);
            for q in 0..n {
                ends.0 += 4;
                ends.1 += prompts[q] + 1;
                let want = row(&verified[1], ends.0 - 1);
                assert!(bitwise_equal(&row(&fused[1], q), &want), "{what}: decode row {q} (context {}) differs from the verify row's", prompts[q] + 1);
                assert!(bitwise_equal(&row(&prefilled[0], ends.1 - 1), &want), "{what}: prefilled row {q} differs from the verify row's");
                if q < 5 {
                    assert!(bitwise_equal(&row(&few[1], q), &want), "{what}: decode row {q} among 5 differs from the verify row's");
                }
            }
            assert!(fused_kv.k == verified_kv.k && fused_kv.v == verified_kv.v, "{what}: the decode step stored other keys or values than the verify step");
            assert!(prefilled_kv.k == verified_kv.k && prefilled_kv.v == verified_kv.v, "{what}: the prefill stored other keys or values than the verify step");
        }
    }
}

/// attn_flash's shared weights and tq3's staged codes (used where the launch's shared memory
/// holds them, as on Hopper) change nothing: prefill pieces, verify rows and decode steps (one
/// block per token and a block per range), with and without them, store the same cache and
/// compute the same bits. Head dims 256 and 128 (tq3 staged) and 16 (tq3 not).
#[test]
fn flash_attention_extras_keep_every_bit() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    for dtype in FLASH_DTYPES {
        for (nq, nkv, hd, rot) in [(16, 4, 256, 64), (15, 5, 128, 32), (3, 1, 16, 4)] {
            let what = format!("{dtype} {nq}/{nkv}x{hd}");
            let layer = Layer::new(&mut rng, nq, nkv, hd, rot);
            let n = 40;
            let prompts: Vec<usize> = (0..n).map(|q| if q == 0 { 2300 } else { 1 + rng.below(300) }).collect();
            let seqs = cache_sequences(&mut rng, n, (2300 + 8_usize).div_ceil(16));
            // Prefill (one block per 64 rows, runs of every size), a 5-token verify row each
            // (one to two row tiles), a decode step of every row (a block per token) and one of
            // the first row alone (a block per range).
            let mut steps: Vec<Vec<(RowKind, usize, usize)>> = vec![(0..n).map(|q| (RowKind::Prefill, q, prompts[q])).collect()];
            steps.push((0..n).map(|q| (RowKind::Generate, q, 5)).collect());
            steps.push((0..n).map(|q| (RowKind::Generate, q, 1)).collect());
            steps.push(vec![(RowKind::Generate, 0, 1)]);
            let inputs: Vec<Inputs> = steps.iter().map(|rows| layer.inputs(&mut rng, rows.iter().map(|r| r.2).sum())).collect();
            let run = |extras: bool| {
                gpu.set_flash_attention_extras(extras);
                let mut cache = gpu.alloc_cache(&attention_spec(dtype, nkv, hd, n * seqs[0].table.len(), n)).unwrap();
                let mut s = seqs.clone();
                let mut outs = Vec::new();
                for (rows, x) in steps.iter().zip(&inputs) {
                    outs.push(layer.run(&gpu, &mut cache, &layout_rows(&s, rows), x));
                    advance_rows(&mut s, rows);
                }
                gpu.set_flash_attention_extras(true);
                (outs, gpu.cache_to_host(&cache).kv)
            };
            let (with, with_kv) = run(true);
            let (without, without_kv) = run(false);
            for (i, (a, b)) in with.iter().zip(&without).enumerate() {
                let first_diff = a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits());
                assert!(first_diff.is_none(), "{what}: step {i} differs without the extras at token {}", first_diff.unwrap_or(0) / (nq * hd));
            }
            assert!(with_kv.k == without_kv.k && with_kv.v == without_kv.v, "{what}: the extras changed the stored keys or values");
        }
    }
}
