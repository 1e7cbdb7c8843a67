//! The tensor-parallel split plan (model/tensor_parallel.rs) for every preset and 1, 2, 4 and 8
//! GPUs: every tensor the loader reads is planned, each shard has the shape its heads give it,
//! the shards tile each tensor exactly, heads that work together stay on one GPU, row-parallel
//! inputs are whole K slices, and sizes that cannot split a model are refused with a message.

use kestrel::backend::tensor_parallel::add_slices_in_order;
use kestrel::backend::KvDtype;
use kestrel::model::arch::qwen35::cache_spec;
use kestrel::model::config::{LayerKind, ModelConfig};
use kestrel::model::dummy::{dummy_store, preset_config, PRESETS};
use kestrel::model::tensor_parallel::{Layout, SplitError, SplitPlan, TensorSplit, K_SLICES};
use std::collections::BTreeSet;

const SIZES: [usize; 4] = [1, 2, 4, 8];

fn plan(preset: &str, n: usize) -> (ModelConfig, SplitPlan) {
    let config = preset_config(preset).expect("preset");
    let plan = SplitPlan::new(&config, n).unwrap_or_else(|e| panic!("{preset} over {n} GPUs: {e}"));
    (config, plan)
}

/// The shard shape of `name` on `rank`.
fn shard(plan: &SplitPlan, name: &str, rank: usize) -> Vec<usize> {
    plan.tensor(name).unwrap_or_else(|| panic!("{name} is not planned")).shard_shape(rank)
}

#[test]
fn every_tensor_the_loader_reads_is_planned_with_its_full_shape() {
    for preset in PRESETS {
        let config = preset_config(preset).unwrap();
        let store = dummy_store(&config, 1).unwrap();
        let stored: BTreeSet<(String, Vec<usize>)> = store.names().into_iter().map(|n| (n.to_string(), store.get(n).unwrap().shape.to_vec())).collect();
        for n in SIZES {
            let (_, plan) = plan(preset, n);
            let planned: BTreeSet<(String, Vec<usize>)> =
                plan.tensors.iter().map(|t| (if t.name == "lm_head.weight" { t.name.clone() } else { store.text_name(&t.name) }, t.shape.clone())).collect();
            assert_eq!(planned, stored, "{preset} over {n} GPUs");
            assert_eq!(plan.tensors.len(), stored.len(), "{preset}: a tensor planned twice");
        }
    }
}

/// Every index along the split dimension is held by exactly `copies` GPUs, and every GPU holds
/// the same amount (vocabulary shards aside, whose last one is short).
fn assert_tiles(t: &TensorSplit, n: usize, what: &str) {
    let len = t.shape[t.dim];
    let mut held = vec![0usize; len];
    for ranges in &t.ranks {
        for r in ranges {
            assert!(r.start < r.end || len == 0 || t.layout == Layout::Vocab, "{what}: empty range {r:?}");
            assert!(r.end <= len, "{what}: {r:?} past {len}");
            for i in r.clone() {
                held[i] += 1;
            }
        }
    }
    assert!(held.iter().all(|&c| c == t.copies), "{what}: an index is held by other than {} GPUs", t.copies);
    let expected_copies = match t.layout {
        Layout::Replicated => n,
        _ if t.name.ends_with("k_proj.weight") || t.name.ends_with("v_proj.weight") => t.copies,
        _ => 1,
    };
    assert_eq!(t.copies, expected_copies, "{what}");
    let total: usize = (0..n).map(|r| t.shard_elements(r)).sum();
    assert_eq!(total, t.elements() * t.copies, "{what}");
    if t.layout != Layout::Vocab {
        assert!((0..n).all(|r| t.shard_shape(r) == t.shard_shape(0)), "{what}: uneven shards");
    }
}

#[test]
fn shards_tile_every_tensor_exactly() {
    for preset in PRESETS {
        for n in SIZES {
            let (_, plan) = plan(preset, n);
            assert_eq!(plan.size, n);
            for t in &plan.tensors {
                assert_eq!(t.ranks.len(), n, "{preset}/{n}: {}", t.name);
                assert_tiles(t, n, &format!("{preset} over {n} GPUs: {}", t.name));
                if n == 1 {
                    assert_eq!(t.shard_shape(0), t.shape, "{preset}: {} on one GPU", t.name);
                }
            }
        }
    }
}

#[test]
fn shard_shapes_follow_the_heads_of_every_preset() {
    for preset in PRESETS {
        for n in SIZES {
            let (c, plan) = plan(preset, n);
            let (h, d, l) = (c.hidden_size, c.head_dim, &c.linear);
            let kv = (c.num_kv_heads / n).max(1);
            assert_eq!(plan.heads.attention, c.num_heads / n);
            assert_eq!(plan.heads.kv, kv);
            assert_eq!((plan.heads.linear_key, plan.heads.linear_value), (l.num_key_heads / n, l.num_value_heads / n));
            let vocab_rows = c.vocab_size.div_ceil(n).next_multiple_of(64);
            for rank in 0..n {
                let want_vocab = vocab_rows.min(c.vocab_size.saturating_sub(rank * vocab_rows));
                assert_eq!(shard(&plan, "embed_tokens.weight", rank), [want_vocab, h], "{preset}/{n}");
                if !c.tie_word_embeddings {
                    assert_eq!(shard(&plan, "lm_head.weight", rank), [want_vocab, h], "{preset}/{n}");
                }
                assert_eq!(shard(&plan, "norm.weight", rank), [h]);
                for (i, kind) in c.layer_kinds.iter().enumerate() {
                    let p = format!("layers.{i}.");
                    assert_eq!(shard(&plan, &format!("{p}input_layernorm.weight"), rank), [h]);
                    match kind {
                        LayerKind::FullAttention => {
                            let a = format!("{p}self_attn.");
                            assert_eq!(shard(&plan, &format!("{a}q_proj.weight"), rank), [c.num_heads / n * 2 * d, h]);
                            assert_eq!(shard(&plan, &format!("{a}k_proj.weight"), rank), [kv * d, h]);
                            assert_eq!(shard(&plan, &format!("{a}v_proj.weight"), rank), [kv * d, h]);
                            assert_eq!(shard(&plan, &format!("{a}o_proj.weight"), rank), [h, c.num_heads / n * d]);
                            assert_eq!(shard(&plan, &format!("{a}q_norm.weight"), rank), [d]);
                        }
                        LayerKind::LinearAttention => {
                            let a = format!("{p}linear_attn.");
                            let (kd, vd, nv) = (l.key_dim() / n, l.value_dim() / n, l.num_value_heads / n);
                            if c.family == kestrel::model::config::ModelFamily::Qwen3Next {
                                assert_eq!(shard(&plan, &format!("{a}in_proj_qkvz.weight"), rank), [2 * kd + 2 * vd, h]);
                                assert_eq!(shard(&plan, &format!("{a}in_proj_ba.weight"), rank), [2 * nv, h]);
                            } else {
                                assert_eq!(shard(&plan, &format!("{a}in_proj_qkv.weight"), rank), [2 * kd + vd, h]);
                                assert_eq!(shard(&plan, &format!("{a}in_proj_z.weight"), rank), [vd, h]);
                                assert_eq!(shard(&plan, &format!("{a}in_proj_b.weight"), rank), [nv, h]);
                                assert_eq!(shard(&plan, &format!("{a}in_proj_a.weight"), rank), [nv, h]);
                            }
                            assert_eq!(shard(&plan, &format!("{a}conv1d.weight"), rank), [2 * kd + vd, 1, l.conv_kernel]);
                            assert_eq!(shard(&plan, &format!("{a}A_log"), rank), [nv]);
                            assert_eq!(shard(&plan, &format!("{a}dt_bias"), rank), [nv]);
                            assert_eq!(shard(&plan, &format!("{a}norm.weight"), rank), [l.value_head_dim]);
                            assert_eq!(shard(&plan, &format!("{a}out_proj.weight"), rank), [h, vd]);
                        }
                    }
                    let m = format!("{p}mlp.");
                    match (&c.moe, c.moe_layers[i]) {
                        (Some(moe), true) => {
                            let (e, im, s) = (moe.num_experts, moe.expert_intermediate / n, moe.shared_intermediate / n);
                            assert_eq!(shard(&plan, &format!("{m}gate.weight"), rank), [e, h]);
                            assert_eq!(shard(&plan, &format!("{m}experts.gate_up_proj"), rank), [e, 2 * im, h]);
                            assert_eq!(shard(&plan, &format!("{m}experts.down_proj"), rank), [e, h, im]);
                            assert_eq!(shard(&plan, &format!("{m}shared_expert.gate_proj.weight"), rank), [s, h]);
                            assert_eq!(shard(&plan, &format!("{m}shared_expert.down_proj.weight"), rank), [h, s]);
                            assert_eq!(shard(&plan, &format!("{m}shared_expert_gate.weight"), rank), [1, h]);
                        }
                        _ => {
                            let im = c.intermediate_size / n;
                            assert_eq!(shard(&plan, &format!("{m}gate_proj.weight"), rank), [im, h]);
                            assert_eq!(shard(&plan, &format!("{m}up_proj.weight"), rank), [im, h]);
                            assert_eq!(shard(&plan, &format!("{m}down_proj.weight"), rank), [h, im]);
                        }
                    }
                }
            }
        }
    }
}

/// Rows of `ranges` as head indices of width `width`, relative to `base`.
fn heads_of(ranges: &[std::ops::Range<usize>], base: usize, len: usize, width: usize) -> Vec<usize> {
    ranges.iter().filter(|r| r.start >= base && r.end <= base + len).flat_map(|r| (r.start - base) / width..(r.end - base) / width).collect()
}

#[test]
fn heads_that_work_together_stay_on_one_gpu() {
    for preset in PRESETS {
        for n in SIZES {
            let (c, plan) = plan(preset, n);
            let (d, l) = (c.head_dim, &c.linear);
            let attention = c.layer_kinds.iter().position(|k| *k == LayerKind::FullAttention).unwrap();
            let linear = c.layer_kinds.iter().position(|k| *k == LayerKind::LinearAttention).unwrap();
            for rank in 0..n {
                // Each query head's KV head (grouped-query attention) is held by the same GPU.
                let a = format!("layers.{attention}.self_attn.");
                let q = heads_of(&plan.tensor(&format!("{a}q_proj.weight")).unwrap().ranks[rank], 0, c.num_heads * 2 * d, 2 * d);
                let k = heads_of(&plan.tensor(&format!("{a}k_proj.weight")).unwrap().ranks[rank], 0, c.num_kv_heads * d, d);
                assert_eq!(heads_of(&plan.tensor(&format!("{a}v_proj.weight")).unwrap().ranks[rank], 0, c.num_kv_heads * d, d), k);
                for head in &q {
                    assert!(k.contains(&(head / (c.num_heads / c.num_kv_heads))), "{preset}/{n} rank {rank}: query head {head} without its KV head");
                }
                let o = heads_of(&plan.tensor(&format!("{a}o_proj.weight")).unwrap().ranks[rank], 0, c.num_heads * d, d);
                assert_eq!(o, q, "{preset}/{n}: o_proj's input heads are the rank's query heads");
                // Each value head's key head, conv channels, decay and output columns are too.
                let g = format!("layers.{linear}.linear_attn.");
                let values = heads_of(&plan.tensor(&format!("{g}A_log")).unwrap().ranks[rank], 0, l.num_value_heads, 1);
                assert_eq!(heads_of(&plan.tensor(&format!("{g}dt_bias")).unwrap().ranks[rank], 0, l.num_value_heads, 1), values);
                let conv = &plan.tensor(&format!("{g}conv1d.weight")).unwrap().ranks[rank];
                let (kd, vd) = (l.key_dim(), l.value_dim());
                let conv_q = heads_of(conv, 0, kd, l.key_head_dim);
                assert_eq!(heads_of(conv, kd, kd, l.key_head_dim), conv_q, "{preset}/{n}: q and k channels");
                assert_eq!(heads_of(conv, 2 * kd, vd, l.value_head_dim), values, "{preset}/{n}: v channels");
                for v in &values {
                    assert!(conv_q.contains(&(v / l.heads_per_key_head())), "{preset}/{n}: value head {v} without its key head");
                }
                assert_eq!(heads_of(&plan.tensor(&format!("{g}out_proj.weight")).unwrap().ranks[rank], 0, vd, l.value_head_dim), values);
            }
        }
    }
}

#[test]
fn row_parallel_inputs_are_whole_k_slices() {
    for preset in PRESETS {
        for n in SIZES {
            let (_, plan) = plan(preset, n);
            let rows: Vec<&TensorSplit> = plan.tensors.iter().filter(|t| t.layout == Layout::Row).collect();
            assert!(!rows.is_empty());
            for t in rows {
                assert_eq!(t.dim, t.shape.len() - 1, "{}: row-parallel splits the input", t.name);
                let k = t.shape[t.dim];
                let slice = k / K_SLICES;
                assert_eq!(slice % 32, 0, "{preset}: {} K {k}", t.name);
                for (rank, ranges) in t.ranks.iter().enumerate() {
                    assert_eq!(ranges.len(), 1);
                    let r = &ranges[0];
                    assert_eq!((r.start, r.len()), (rank * slice * (K_SLICES / n), slice * (K_SLICES / n)), "{preset}/{n}: {}", t.name);
                }
            }
        }
    }
}

#[test]
fn memory_per_gpu_shrinks_with_the_split() {
    for preset in PRESETS {
        let config = preset_config(preset).unwrap();
        let store = dummy_store(&config, 1).unwrap();
        let total = store.device_bytes(None);
        let geometry = cache_spec(&config, false, 0, 16, 1, 0);
        for n in SIZES {
            let (_, plan) = plan(preset, n);
            let per_rank = plan.weight_bytes_per_rank(&store, None);
            assert_eq!(per_rank.len(), n);
            if n == 1 {
                assert_eq!(per_rank[0], total, "{preset}");
            }
            for (rank, bytes) in per_rank.iter().enumerate() {
                // Replicated norms, routers and KV heads add a little above an even share.
                assert!(*bytes >= total / n && (*bytes as f64) < total as f64 / n as f64 * 1.05 + (1 << 20) as f64, "{preset}/{n} rank {rank}: {bytes} of {total}");
            }
            let rank_cache = plan.rank_cache(&geometry);
            for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
                let (one, per) = (kestrel::backend::CacheSpec { kv_dtype: dtype, ..geometry.clone() }, kestrel::backend::CacheSpec { kv_dtype: dtype, ..rank_cache.clone() });
                assert_eq!(per.kv_bytes_per_token() * n.min(config.num_kv_heads), one.kv_bytes_per_token(), "{preset}/{n} {dtype}");
            }
            assert_eq!(rank_cache.bytes_per_state() * n, geometry.bytes_per_state(), "{preset}/{n}");
        }
    }
}

/// The 9b's plan in numbers: 16 query heads, 4 KV heads of 256, 16/32 delta-rule heads, an
/// intermediate of 12288.
#[test]
fn qwen35_9b_over_two_and_eight_gpus() {
    let (_, two) = plan("qwen3.5-9b", 2);
    assert_eq!(shard(&two, "layers.3.self_attn.q_proj.weight", 1), [4096, 4096]);
    assert_eq!(two.tensor("layers.3.self_attn.k_proj.weight").unwrap().ranks[1], [512..1024]);
    assert_eq!(two.tensor("layers.0.linear_attn.in_proj_qkv.weight").unwrap().ranks[1], [1024..2048, 3072..4096, 6144..8192]);
    assert_eq!(two.tensor("layers.0.mlp.down_proj.weight").unwrap().ranks[1], [6144..12288]);
    assert_eq!(two.tensor("embed_tokens.weight").unwrap().ranks[1], [124160..248320]);
    let (_, eight) = plan("qwen3.5-9b", 8);
    // 4 KV heads over 8 GPUs: GPUs 2k and 2k+1 share KV head k.
    let k = eight.tensor("layers.3.self_attn.k_proj.weight").unwrap();
    assert_eq!(k.copies, 2);
    assert_eq!((k.ranks[4].clone(), k.ranks[5].clone()), (vec![512..768], vec![512..768]));
    let (_, next) = plan("qwen3-next-80b-a3b", 8);
    // 151936 rows: 18992 per GPU rounded up to 19008, a multiple of 64; the last GPU holds the rest.
    assert_eq!(next.tensor("embed_tokens.weight").unwrap().ranks[7], [133056..151936]);
}

#[test]
fn sizes_that_cannot_split_a_model_are_refused_with_the_reason() {
    let base = preset_config("qwen3.5-9b").unwrap();
    let message = |config: &ModelConfig, n: usize| SplitPlan::new(config, n).expect_err("refused").to_string();
    for n in [0, 3, 5, 6, 16] {
        assert_eq!(SplitPlan::new(&base, n).unwrap_err(), SplitError::UnsupportedSize { size: n });
        assert!(message(&base, n).contains(&format!("--tensor-parallel-size {n} is not supported: use 1, 2, 4 or 8")), "{}", message(&base, n));
    }
    let mut heads = base.clone();
    heads.num_heads = 12;
    heads.num_kv_heads = 3;
    assert_eq!(SplitPlan::new(&heads, 8).unwrap_err(), SplitError::Indivisible { size: 8, what: "attention heads", count: 12 });
    assert!(message(&heads, 8).contains("does not divide the model's attention heads (12)"), "{}", message(&heads, 8));
    assert_eq!(SplitPlan::new(&heads, 4).unwrap_err(), SplitError::KvHeads { size: 4, kv_heads: 3 });
    assert!(message(&heads, 4).contains("3 KV heads"), "{}", message(&heads, 4));
    assert!(SplitPlan::new(&heads, 1).is_ok());

    let mut linear = base.clone();
    linear.linear.num_key_heads = 6;
    linear.linear.num_value_heads = 12;
    assert!(message(&linear, 4).contains("Gated DeltaNet key heads (6)"), "{}", message(&linear, 4));
    linear.linear.num_key_heads = 4;
    assert!(message(&linear, 8).contains("Gated DeltaNet key heads (4)"), "{}", message(&linear, 8));
    assert!(SplitPlan::new(&linear, 4).is_ok());

    let mut mlp = base.clone();
    mlp.intermediate_size = 1004;
    assert!(message(&mlp, 16).contains("not supported"));
    assert!(message(&mlp, 8).contains("does not divide the model's MLP intermediate size (1004)"), "{}", message(&mlp, 8));
    let err = SplitPlan::new(&mlp, 2).unwrap_err();
    assert_eq!(err, SplitError::SliceMisaligned { tensor: "layers.0.mlp.down_proj.weight".into(), k: 1004, unit: 32, size: 2 });
    assert!(err.to_string().contains("input width 1004 is not 8 equal slices of 32-wide units"), "{err}");
    assert!(SplitPlan::new(&mlp, 1).is_ok(), "one GPU has nothing to align");

    let mut moe = preset_config("qwen3-next-80b-a3b").unwrap();
    if let Some(m) = moe.moe.as_mut() {
        m.expert_intermediate = 100;
    }
    assert!(message(&moe, 8).contains("expert intermediate size (100)"), "{}", message(&moe, 8));

    let mut tiled = base.clone();
    tiled.linear.out_heads_tiled = true;
    assert_eq!(SplitPlan::new(&tiled, 2).unwrap_err(), SplitError::TiledOutputHeads);
    assert!(SplitPlan::new(&tiled, 1).is_ok());
}

/// The reduction rule row-parallel layers follow (backend/tensor_parallel.rs): slice partials add
/// from zero in slice order, and adding pre-summed groups of them gives other bits.
#[test]
fn slices_add_from_zero_in_order_and_grouping_them_changes_the_bits() {
    // 1 + 2^-24 rounds back to 1 at each step in order; grouped, the small terms survive.
    let big = [1.0f32];
    let small = [2f32.powi(-24)];
    let parts: Vec<&[f32]> = vec![&big, &small, &small, &small, &small, &small, &small, &small];
    let ordered = add_slices_in_order(&parts);
    assert_eq!(ordered, [1.0]);
    let halves = add_slices_in_order(&parts[..4])[0] + add_slices_in_order(&parts[4..])[0];
    assert_ne!(halves.to_bits(), ordered[0].to_bits(), "two pre-summed halves differ from the slice order");
    // The sum starts at +0, as the kernels' does: a lone -0.0 partial gives +0.0.
    let negative_zero = [-0.0f32];
    assert_eq!(add_slices_in_order(&[&negative_zero])[0].to_bits(), 0.0f32.to_bits());
    assert!(add_slices_in_order(&[]).is_empty());
}

/// Quantized weights are reduced in units of their format (128 for Q4_K and Q6_K): the 0.8b's
/// MLP (3584 wide: 8 slices of 448) splits in bf16 but not in q4_k; the 9b splits either way.
#[test]
fn quantized_formats_split_in_whole_units_of_their_format() {
    use kestrel::model::weights::online::OnlineQuantization;
    for (preset, q4k_splits) in [("qwen3.5-0.8b", false), ("qwen3.5-9b", true), ("qwen3.5-27b", true)] {
        let mut config = preset_config(preset).unwrap();
        let store = dummy_store(&config, 1).unwrap();
        assert!(SplitPlan::for_store(&config, 2, &store).is_ok(), "{preset} in bf16");
        config.online_quantization = Some(OnlineQuantization::Q4K);
        let store = dummy_store(&config, 1).unwrap();
        match SplitPlan::for_store(&config, 2, &store) {
            Ok(_) => assert!(q4k_splits, "{preset} in q4_k should be refused"),
            Err(e) => {
                assert!(!q4k_splits, "{preset} in q4_k: {e}");
                assert!(e.to_string().contains("input width 3584 is not 8 equal slices of 128-wide units"), "{e}");
            }
        }
    }
}

/// The NCCL probe tells a machine without NCCL from one with only the versioned library, which
/// cudarc does not load, and passes where cudarc can load it.
#[test]
fn the_nccl_probe_names_what_is_missing() {
    use kestrel::backend::cuda::collectives::{probe_nccl, NcclError};
    let loads = |name: &str| unsafe { libloading::Library::new(name) }.is_ok();
    match probe_nccl() {
        Ok(()) => assert!(loads("libnccl.so") || loads("libnccl.so.12") || loads("libnccl.so.13"), "the probe passed but no NCCL name cudarc looks for loads"),
        Err(e @ NcclError::OnlyVersioned { .. }) => {
            assert!(loads("libnccl.so.2") && !loads("libnccl.so"));
            assert!(e.to_string().contains("found libnccl.so.2") && e.to_string().contains("install libnccl-dev"), "{e}");
        }
        Err(e @ NcclError::Missing) => {
            assert!(!loads("libnccl.so.2") && !loads("libnccl.so"));
            assert!(e.to_string().contains("NCCL is not installed") && e.to_string().contains("LD_LIBRARY_PATH"), "{e}");
        }
    }
}
