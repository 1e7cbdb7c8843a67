//! `kestrel info`: what a model is, without running it.

use super::flags::ModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use kestrel::backend::{CacheSpec, KvDtype};
use kestrel::model::arch::qwen35::cache_spec;
use kestrel::model::config::LayerKind;
use kestrel::model::tensor_parallel::{SplitPlan, TensorSplit};
use kestrel::model::{mtp_tensor_names, ModelFiles};

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Show the model's split over N GPUs (tensor parallelism, also -tp): the part of each
    /// tensor a GPU holds and the memory per GPU.
    #[arg(long, visible_alias = "tp", value_name = "N")]
    pub tensor_parallel_size: Option<usize>,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let files = args.model.open()?;
    let c = &files.config;
    let split = match args.tensor_parallel_size {
        Some(n) => Some(SplitPlan::for_store(c, n, &files.store).with_context(|| format!("cannot split {} over {n} GPUs", files.source))?),
        None => None,
    };
    let mtp = mtp_tensor_names(&files.store);
    let layers: String = c.layer_kinds.iter().map(|k| if *k == LayerKind::FullAttention { 'F' } else { 'L' }).collect();
    // What the GPU keeps: quantized weights in their own bits (with --quantization, after it).
    let gpu_bytes = files.store.device_bytes(c.online_quantization.map(|q| (q, c.num_layers())));
    let params = files.store.matrix_parameters();
    let per_weight = gpu_bytes as f64 / params.max(1) as f64;
    let sampling = &files.sampling_defaults;
    // Bytes of one token's keys and values per KV cache format (formats the heads cannot be
    // stored in are left out).
    let geometry = cache_spec(c, !mtp.is_empty(), 0, 16, 0, 0);
    let kv_per_token: Vec<(KvDtype, usize)> = [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8, KvDtype::Tq3]
        .into_iter()
        .filter(|d| d.check_head_dim(c.head_dim).is_ok())
        .map(|kv_dtype| (kv_dtype, CacheSpec { kv_dtype, ..geometry.clone() }.kv_bytes_per_token()))
        .collect();
    if args.json {
        let obj = serde_json::json!({
            "source": files.source,
            "family": c.family.name(),
            "model_type": c.model_type,
            "layers": layers,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "tensors": files.store.len(),
            "weight_bytes": files.store.total_bytes(),
            "mtp_tensors": mtp,
            "moe": c.moe.as_ref().map(|m| serde_json::json!({"experts": m.num_experts, "top_k": m.top_k})),
            "quantization": c.quantization.as_ref().map(|q| q.to_string()),
            "online_quantization": c.online_quantization.map(|q| q.to_string()),
            "matrix_parameters": params,
            "gpu_weight_bytes": gpu_bytes,
            "gpu_bytes_per_weight": per_weight,
            "eos_token_ids": c.eos_token_ids,
            "sampling_defaults": sampling.to_json(),
            "kv_bytes_per_token": kv_per_token.iter().map(|(d, b)| (d.name().to_string(), serde_json::json!(b))).collect::<serde_json::Map<_, _>>(),
            "tensor_parallel": split.as_ref().map(|plan| split_json(plan, &files, &geometry)),
        });
        println!("{}", serde_json::to_string_pretty(&obj)?);
        return Ok(());
    }
    println!("model       {}", files.source);
    println!("family      {} ({})", c.family.name(), c.model_type);
    println!("layers      {} [{}]  (L = Gated DeltaNet, F = full attention)", c.num_layers(), layers);
    println!("hidden      {}   vocab {}   tied embeddings {}", c.hidden_size, c.vocab_size, c.tie_word_embeddings);
    println!("attention   {} heads / {} kv heads x {} (rotary {}, theta {})", c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta);
    println!(
        "deltanet    {} key heads x {} / {} value heads x {}, conv {}",
        c.linear.num_key_heads, c.linear.key_head_dim, c.linear.num_value_heads, c.linear.value_head_dim, c.linear.conv_kernel
    );
    match &c.moe {
        Some(m) => println!("mlp         MoE {} experts, top {}, width {}, shared {}", m.num_experts, m.top_k, m.expert_intermediate, m.shared_intermediate),
        None => println!("mlp         dense SwiGLU, width {}", c.intermediate_size),
    }
    println!("context     {} tokens (max_position_embeddings)", c.max_position_embeddings);
    let per_token: Vec<String> = kv_per_token.iter().map(|(d, b)| format!("{d} {:.1} KiB", *b as f64 / 1024.0)).collect();
    println!("kv cache    per token {} ({} attention layers x {} kv heads x {})", per_token.join(", "), geometry.attention_layers, c.num_kv_heads, c.head_dim);
    println!("weights     {} tensors, {:.1} MiB", files.store.len(), files.store.total_bytes() as f64 / (1 << 20) as f64);
    if let Some(q) = &c.quantization {
        println!("quantized   {q}");
    }
    if let Some(q) = &c.online_quantization {
        println!("at load     {q}");
    }
    println!("on the GPU  {:.2} GiB of weights, {per_weight:.3} bytes per weight ({:.2}B parameters in matrices)", gpu_bytes as f64 / (1u64 << 30) as f64, params as f64 / 1e9);
    println!("eos ids     {:?}", c.eos_token_ids);
    if sampling.is_empty() {
        println!("sampling    no recommendation (generation_config.json)");
    } else {
        let values: Vec<String> = sampling.describe().into_iter().map(|(name, value)| format!("{name} {value}")).collect();
        println!("sampling    {} (generation_config.json; requests and flags override)", values.join(", "));
    }
    println!("tokenizer   {} tokens, chat template {}", files.tokenizer.vocab_size(), if files.tokenizer.has_chat_template() { "yes" } else { "no" });
    println!("mtp         {} tensors", mtp.len());
    for name in mtp {
        // Quantized linears keep their packed weights and zero points as I32 tensors.
        if files.store.contains(name) {
            let t = files.store.get(name)?;
            println!("  {name} {:?} {}", t.shape, t.dtype.name());
        } else {
            println!("  {name} {:?} I32", files.store.int32(name)?.shape);
        }
    }
    if let Some(plan) = &split {
        print_split(plan, &files, &geometry);
    }
    Ok(())
}

/// Per GPU of `plan`: weight bytes, KV bytes per token (bf16) and recurrent-state bytes per sequence.
fn per_gpu(plan: &SplitPlan, files: &ModelFiles, geometry: &CacheSpec) -> Vec<(usize, usize, usize)> {
    let c = &files.config;
    let weights = plan.weight_bytes_per_rank(&files.store, c.online_quantization.map(|q| (q, c.num_layers())));
    let cache = plan.rank_cache(&CacheSpec { kv_dtype: KvDtype::Bf16, ..geometry.clone() });
    weights.into_iter().map(|w| (w, cache.kv_bytes_per_token(), cache.bytes_per_state())).collect()
}

/// Each kind of tensor once (the first layer that has it): its name without the layer number.
fn tensor_kinds(plan: &SplitPlan) -> Vec<(String, &TensorSplit)> {
    let mut seen = std::collections::HashSet::new();
    plan.tensors
        .iter()
        .filter_map(|t| {
            let kind = match t.name.strip_prefix("layers.") {
                Some(rest) => rest.split_once('.').map_or(rest, |(_, name)| name).to_string(),
                None => t.name.clone(),
            };
            seen.insert(kind.clone()).then_some((kind, t))
        })
        .collect()
}

fn dims(shape: &[usize]) -> String {
    shape.iter().map(usize::to_string).collect::<Vec<_>>().join("x")
}

fn print_split(plan: &SplitPlan, files: &ModelFiles, geometry: &CacheSpec) {
    let (c, h) = (&files.config, &plan.heads);
    println!(
        "split       over {} GPU{}: each holds {} of {} attention heads, {} of {} kv heads, {} of {} delta-rule key heads and {} of {} value heads",
        plan.size,
        if plan.size == 1 { "" } else { "s" },
        h.attention, c.num_heads, h.kv, c.num_kv_heads, h.linear_key, c.linear.num_key_heads, h.linear_value, c.linear.num_value_heads
    );
    for (rank, (weights, kv, state)) in per_gpu(plan, files, geometry).into_iter().enumerate() {
        println!(
            "  GPU {rank}     {:.2} GiB of weights, KV cache {:.1} KiB per token (bf16), recurrent state {:.2} MiB per sequence",
            weights as f64 / (1u64 << 30) as f64,
            kv as f64 / 1024.0,
            state as f64 / (1u64 << 20) as f64
        );
    }
    println!("  {:<40} {:<11} {:<16} per GPU", "tensor", "split", "shape");
    for (kind, t) in tensor_kinds(plan) {
        println!("  {kind:<40} {:<11} {:<16} {}", t.layout.name(), dims(&t.shape), dims(&t.shard_shape(0)));
    }
    println!("  (row: each GPU sums whole K slices; the partial sums are added in the one-GPU slice order)");
}

fn split_json(plan: &SplitPlan, files: &ModelFiles, geometry: &CacheSpec) -> serde_json::Value {
    let h = &plan.heads;
    serde_json::json!({
        "size": plan.size,
        "heads_per_gpu": {"attention": h.attention, "kv": h.kv, "linear_key": h.linear_key, "linear_value": h.linear_value},
        "gpus": per_gpu(plan, files, geometry).into_iter().map(|(w, kv, state)| serde_json::json!({"weight_bytes": w, "kv_bytes_per_token_bf16": kv, "state_bytes_per_sequence": state})).collect::<Vec<_>>(),
        "tensors": tensor_kinds(plan).into_iter().map(|(kind, t)| serde_json::json!({"tensor": kind, "split": t.layout.name(), "shape": t.shape, "shard_shape": t.shard_shape(0), "copies": t.copies})).collect::<Vec<_>>(),
    })
}
