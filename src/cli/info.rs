//! `kestrel info`: what a model is, without running it.

use super::flags::ModelArgs;
use anyhow::Result;
use clap::Args;
use kestrel::backend::{CacheSpec, KvDtype};
use kestrel::model::arch::qwen35::cache_spec;
use kestrel::model::config::LayerKind;
use kestrel::model::mtp_tensor_names;

#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let files = args.model.open()?;
    let c = &files.config;
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
        let t = files.store.get(name)?;
        println!("  {name} {:?} {}", t.shape, t.dtype.name());
    }
    Ok(())
}
