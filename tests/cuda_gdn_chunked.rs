//! The chunked delta rule of prefill rows on the GPU (cuda/gdn_chunk.cu) against the CPU
//! reference and an f64 recurrence on random inputs: several chunks, a short last chunk, pieces
//! starting at aligned and unaligned positions, rows of different lengths in one step; and its
//! invariances, bitwise: a row alone or among others, a prompt in one piece or in 64-aligned
//! pieces. Runs where a GPU is present.

mod cuda_support;

use cuda_support::*;
use kestrel::backend::cpu::CpuBackend;
use kestrel::backend::cuda::CudaBackend;
use kestrel::backend::shapes::LinearAttnShape;
use kestrel::backend::{Backend, BatchLayout, CacheSpec, GdnParams, KvDtype, RowKind, RowLayout};

const EPS: f32 = 1e-6;

fn seed() -> u64 {
    let s = std::env::var("KESTREL_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    eprintln!("seed {s}");
    s
}

fn spec(cfg: &LinearAttnShape, slots: usize) -> CacheSpec {
    CacheSpec { attention_layers: 0, num_blocks: 1, block_size: 16, kv_heads: 1, head_dim: 1, kv_dtype: KvDtype::F32, linear_layers: 1, linear: cfg.clone(), state_slots: slots, snapshot_slots: 1, checkpoint_slots: 0 }
}

/// A layer's parameters and every token's inputs of each sequence.
struct Problem {
    cfg: LinearAttnShape,
    conv_w: Vec<f32>,
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
    /// Per sequence, per token: the projections (mixed, z, b, a).
    seqs: Vec<[Vec<f32>; 4]>,
}

impl Problem {
    fn new(rng: &mut Rng, cfg: LinearAttnShape, lengths: &[usize]) -> Problem {
        let nv = cfg.num_value_heads;
        let seqs = lengths.iter().map(|&n| [rng.vec(n * cfg.conv_dim(), 1.0), rng.vec(n * cfg.value_dim(), 2.0), rng.vec(n * nv, 2.0), rng.vec(n * nv, 2.0)]).collect();
        Problem {
            conv_w: rng.vec(cfg.conv_dim() * cfg.conv_kernel, 0.5),
            neg_a: rng.vec(nv, 1.0).iter().map(|v| -v.exp()).collect(),
            dt_bias: rng.vec(nv, 1.0),
            norm_w: rng.vec(cfg.value_head_dim, 0.2).iter().map(|v| 1.0 + v).collect(),
            cfg,
            seqs,
        }
    }

    fn widths(&self) -> [usize; 4] {
        [self.cfg.conv_dim(), self.cfg.value_dim(), self.cfg.num_value_heads, self.cfg.num_value_heads]
    }

    /// One step of prefill rows (sequence, first token, tokens; the sequence's slot is its
    /// index): the layer's output and the states of every slot after it.
    fn run<B: Backend>(&self, b: &B, params: &GdnParams<B>, cache: &mut B::Cache, rows: &[(usize, usize, usize)]) -> Vec<f32> {
        let widths = self.widths();
        let mut inputs: [Vec<f32>; 4] = Default::default();
        let mut layout = BatchLayout::default();
        let mut start = 0;
        for &(s, from, n) in rows {
            for (x, (seq, w)) in inputs.iter_mut().zip(self.seqs[s].iter().zip(widths)) {
                x.extend_from_slice(&seq[from * w..(from + n) * w]);
            }
            // No attention layer reads the block table, but the layout must cover the positions.
            layout.rows.push(RowLayout { kind: RowKind::Prefill, token_start: start, num_tokens: n, start_position: from, block_table: vec![0; (from + n).div_ceil(16)], state_slot: s, snapshot_base: 0 });
            start += n;
        }
        let t = start;
        let [mixed, z, bb, a] = &inputs;
        let f = |v: &[f32], w: usize| b.from_host(v, t, w);
        let out = b.gated_delta_net(&f(mixed, widths[0]), &f(z, widths[1]), &f(bb, widths[2]), &f(a, widths[3]), params, &self.cfg, EPS, &layout, cache, 0);
        b.to_host(&out)
    }

    fn gpu_params(&self, gpu: &CudaBackend) -> GdnParams<CudaBackend> {
        let up = |v: &[f32]| gpu.upload_vector(v).unwrap();
        GdnParams { conv_weight: up(&self.conv_w), neg_a: up(&self.neg_a), dt_bias: up(&self.dt_bias), norm_weight: up(&self.norm_w) }
    }

    fn cpu_params(&self) -> GdnParams<CpuBackend> {
        GdnParams { conv_weight: self.conv_w.clone(), neg_a: self.neg_a.clone(), dt_bias: self.dt_bias.clone(), norm_weight: self.norm_w.clone() }
    }

    /// Sequence s's outputs over its first n tokens and its state after them, token by token
    /// in f64 from a zero state.
    fn reference(&self, s: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
        let c = &self.cfg;
        let (nk, nv, dk, dv, kw) = (c.num_key_heads, c.num_value_heads, c.key_head_dim, c.value_head_dim, c.conv_kernel);
        let (cd, kd, vd) = (c.conv_dim(), c.key_dim(), c.value_dim());
        let [mixed, z, b, a] = &self.seqs[s];
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let mut state = vec![0.0f64; nv * dk * dv];
        let mut out = vec![0.0f64; n * vd];
        for i in 0..n {
            let conv: Vec<f64> = (0..cd)
                .map(|ch| {
                    let acc: f64 = (0..kw).filter(|&j| i + j + 1 >= kw).map(|j| self.conv_w[ch * kw + j] as f64 * mixed[(i + j + 1 - kw) * cd + ch] as f64).sum();
                    silu(acc)
                })
                .collect();
            let normed = |x: &[f64], scale: f64| -> Vec<f64> {
                let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
                x.iter().map(|v| v * inv * scale).collect()
            };
            for h in 0..nv {
                let kh = h / (nv / nk);
                let q = normed(&conv[kh * dk..(kh + 1) * dk], 1.0 / (dk as f64).sqrt());
                let k = normed(&conv[kd + kh * dk..kd + (kh + 1) * dk], 1.0);
                let v = &conv[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                let x = a[i * nv + h] as f64 + self.dt_bias[h] as f64;
                let g = self.neg_a[h] as f64 * if x > 20.0 { x } else { x.exp().ln_1p() };
                let beta = 1.0 / (1.0 + (-(b[i * nv + h] as f64)).exp());
                let st = &mut state[h * dk * dv..(h + 1) * dk * dv];
                st.iter_mut().for_each(|x| *x *= g.exp());
                let mut o = vec![0.0f64; dv];
                for j in 0..dv {
                    let kv: f64 = (0..dk).map(|r| st[r * dv + j] * k[r]).sum();
                    let u = beta * (v[j] - kv);
                    for r in 0..dk {
                        st[r * dv + j] += k[r] * u;
                    }
                    o[j] = (0..dk).map(|r| st[r * dv + j] * q[r]).sum();
                }
                let inv = 1.0 / (o.iter().map(|v| v * v).sum::<f64>() / dv as f64 + EPS as f64).sqrt();
                for j in 0..dv {
                    out[i * vd + h * dv + j] = o[j] * inv * self.norm_w[j] as f64 * silu(z[i * vd + h * dv + j] as f64);
                }
            }
        }
        (out, state)
    }
}

/// Output rows of step `rows` that belong to its `index`-th row.
fn row_slice<'a>(out: &'a [f32], rows: &[(usize, usize, usize)], index: usize, width: usize) -> &'a [f32] {
    let start: usize = rows[..index].iter().map(|r| r.2).sum();
    &out[start * width..(start + rows[index].2) * width]
}

fn state_of(cache: &[f32], cfg: &LinearAttnShape, slot: usize) -> Vec<f32> {
    let n = cfg.recurrent_state_len();
    cache[slot * n..(slot + 1) * n].to_vec()
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn shapes() -> [LinearAttnShape; 3] {
    let shape = |nk, nv, dk, dv| LinearAttnShape { num_key_heads: nk, num_value_heads: nv, key_head_dim: dk, value_head_dim: dv, conv_kernel: 4, out_heads_tiled: false };
    // The models' head dims, a dk that is no multiple of 16 with dk != dv, and dims below a tile.
    [shape(2, 4, 128, 128), shape(1, 3, 40, 24), shape(1, 1, 8, 12)]
}

#[test]
fn chunked_delta_rule_matches_cpu_and_f64() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(seed());
    // Step 1: sequence 0 over four whole chunks and a short fifth, sequence 1 one chunk,
    // sequence 2 one token. Step 2: sequence 0 resumes at 300 (a first chunk of 20 tokens),
    // sequence 1 at 64 (an aligned piece), sequence 2 at 1 over 130 tokens.
    let steps: [&[(usize, usize, usize)]; 2] = [&[(0, 0, 300), (1, 0, 64), (2, 0, 1)], &[(1, 64, 200), (0, 300, 150), (2, 1, 130)]];
    let lengths = [450, 264, 131];
    for cfg in shapes() {
        let what = format!("{}/{} heads, dk {}, dv {}", cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim);
        let p = Problem::new(&mut rng, cfg.clone(), &lengths);
        let (gp, cp) = (p.gpu_params(&gpu), p.cpu_params());
        let mut gcache = gpu.alloc_cache(&spec(&cfg, 3)).unwrap();
        let mut ccache = cpu.alloc_cache(&spec(&cfg, 3)).unwrap();
        let (mut gout, mut cout) = (vec![Vec::new(); 3], vec![Vec::new(); 3]);
        for rows in steps {
            let g = p.run(&gpu, &gp, &mut gcache, rows);
            let c = p.run(&cpu, &cp, &mut ccache, rows);
            let err = relative_error(&g, &c);
            assert!(err < 1e-4, "{what}: output against the CPU, relative error {err}");
            for (i, &(s, _, _)) in rows.iter().enumerate() {
                gout[s].extend_from_slice(row_slice(&g, rows, i, cfg.value_dim()));
                cout[s].extend_from_slice(row_slice(&c, rows, i, cfg.value_dim()));
            }
            let (gs, cs) = (&gpu.cache_to_host(&gcache).rec[0], &ccache.rec[0]);
            let err = relative_error(gs, cs);
            assert!(err < 1e-4, "{what}: state against the CPU, relative error {err}");
        }
        let gs = gpu.cache_to_host(&gcache).rec[0].clone();
        for (s, &n) in lengths.iter().enumerate() {
            let (out, state) = p.reference(s, n);
            let (out, state) = (to_f32(&out), to_f32(&state));
            let (g_out, c_out) = (relative_error(&gout[s], &out), relative_error(&cout[s], &out));
            let (g_state, c_state) = (relative_error(&state_of(&gs, &cfg, s), &state), relative_error(&state_of(&ccache.rec[0], &cfg, s), &state));
            eprintln!("{what}, sequence {s} ({n} tokens): relative error against f64: output GPU {g_out:.2e} CPU {c_out:.2e}, state GPU {g_state:.2e} CPU {c_state:.2e}");
            assert!(g_out < 1e-4 && g_state < 1e-4, "{what}, sequence {s}: GPU against f64: output {g_out}, state {g_state}");
        }
    }
}

#[test]
fn chunked_rows_are_bitwise_invariant() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng::new(seed());
    for cfg in shapes() {
        let what = format!("{}/{} heads, dk {}, dv {}", cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim);
        let p = Problem::new(&mut rng, cfg.clone(), &[293, 150, 77, 10]);
        let gp = p.gpu_params(&gpu);
        let fresh = || gpu.alloc_cache(&spec(&cfg, 4)).unwrap();
        let state = |cache: &<CudaBackend as Backend>::Cache, s: usize| state_of(&gpu.cache_to_host(cache).rec[0], &cfg, s);
        // Sequence 0 alone in one piece, then among three other rows of other lengths.
        let mut alone = fresh();
        let alone_out = p.run(&gpu, &gp, &mut alone, &[(0, 0, 293)]);
        let crowd_rows = [(1, 0, 150), (3, 0, 10), (0, 0, 293), (2, 0, 77)];
        let mut crowd = fresh();
        let crowd_out = p.run(&gpu, &gp, &mut crowd, &crowd_rows);
        assert!(bitwise_equal(&alone_out, row_slice(&crowd_out, &crowd_rows, 2, cfg.value_dim())), "{what}: a row's output differs alone and among others");
        assert!(bitwise_equal(&state(&alone, 0), &state(&crowd, 0)), "{what}: a row's state differs alone and among others");
        // The same prompt in 64-aligned pieces of 128, 64 and 101 tokens (the second beside
        // another row).
        let mut pieces = fresh();
        let mut split_out = p.run(&gpu, &gp, &mut pieces, &[(0, 0, 128)]);
        let rows = [(2, 0, 77), (0, 128, 64)];
        split_out.extend_from_slice(row_slice(&p.run(&gpu, &gp, &mut pieces, &rows), &rows, 1, cfg.value_dim()));
        split_out.extend(p.run(&gpu, &gp, &mut pieces, &[(0, 192, 101)]));
        assert!(bitwise_equal(&alone_out, &split_out), "{what}: a prompt's output differs in one piece and in 64-aligned pieces");
        assert!(bitwise_equal(&state(&alone, 0), &state(&pieces, 0)), "{what}: a prompt's state differs in one piece and in 64-aligned pieces");
    }
}
