//! How many KV blocks the cache gets on a device: what the memory budget holds after the
//! recurrent state, at the real bytes of the chosen KV format, capped at what the requests can
//! use.

use anyhow::{bail, Result};
use kestrel::backend::CacheSpec;
use kestrel::engine::padding::Scratch;

/// The blocks a cache gets and the blocks that would fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPlan {
    pub blocks: usize,
    pub fit: usize,
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Plans the cache of `cache` (its geometry and KV format; its block count is ignored) in
/// `budget` bytes: `wanted` blocks, or exactly `requested` (`--kv-blocks`), and at least the
/// `per_request` blocks one request of the full context needs.
pub fn plan_kv_blocks(budget: usize, cache: &CacheSpec, wanted: usize, requested: Option<usize>, per_request: usize, utilization: f32) -> Result<KvPlan> {
    let per_block = cache.bytes_per_block().max(1);
    // The engine keeps scratch blocks for padded rows past those the plan hands out.
    let fit = (budget.saturating_sub(cache.state_bytes()) / per_block).saturating_sub(Scratch::BLOCKS);
    if let Some(n) = requested.filter(|&n| n > fit) {
        bail!("--kv-blocks {n} needs {:.2} GiB, but {:.2} GiB are left under --gpu-memory-utilization {utilization}", gib(n * per_block), gib(budget));
    }
    if fit < per_request {
        bail!(
            "the KV cache fits {fit} blocks of {} tokens ({}) but one request of the full context needs {per_request}; lower --max-model-len, --max-num-seqs or --prefix-cache-memory, pick a smaller --kv-cache-dtype, or raise --gpu-memory-utilization",
            cache.block_size,
            cache.kv_dtype
        );
    }
    Ok(KvPlan { blocks: wanted.min(fit), fit })
}

/// The line kestrel prints about the cache it plans: the format, the tokens it holds and the
/// tokens that would fit.
pub fn describe(plan: &KvPlan, cache: &CacheSpec) -> String {
    let bs = cache.block_size;
    format!(
        "KV cache {} ({} bytes per token): {} blocks ({} tokens, {:.2} GiB) of the {} tokens that fit; recurrent state {:.2} GiB",
        cache.kv_dtype,
        cache.kv_bytes_per_token(),
        plan.blocks,
        plan.blocks * bs,
        gib(plan.blocks * cache.bytes_per_block()),
        plan.fit * bs,
        gib(cache.state_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel::backend::KvDtype;
    use kestrel::model::arch::qwen35::cache_spec;
    use kestrel::model::dummy::preset_config;

    /// qwen3.5-9b: 8 full-attention layers of 4 kv heads x 256.
    fn spec_9b(kv_dtype: KvDtype) -> CacheSpec {
        let config = preset_config("qwen3.5-9b").expect("preset");
        CacheSpec { kv_dtype, ..cache_spec(&config, false, 0, 16, 16, 16) }
    }

    #[test]
    fn bytes_per_block_count_the_real_format() {
        let want = [(KvDtype::F32, 2048), (KvDtype::Bf16, 1024), (KvDtype::Fp8, 516), (KvDtype::Tq3, 196)];
        for (dtype, per_token_head) in want {
            let s = spec_9b(dtype);
            assert_eq!((s.attention_layers, s.kv_heads, s.head_dim), (8, 4, 256));
            assert_eq!(s.bytes_per_block(), 16 * 8 * 4 * per_token_head, "{dtype}");
            assert_eq!(s.kv_bytes_per_token(), 8 * 4 * per_token_head, "{dtype}");
        }
    }

    /// At the same memory budget, tq3 holds at least 4.5x the tokens of bf16 and fp8 about 2x
    /// (its scale per token and kv head costs 2 bytes per 256).
    #[test]
    fn block_counts_scale_with_the_format() {
        let budget = 40usize << 30;
        let blocks = |dtype| plan_kv_blocks(budget, &spec_9b(dtype), usize::MAX, None, 1, 0.9).expect("fits").blocks;
        let (bf16, fp8, tq3) = (blocks(KvDtype::Bf16), blocks(KvDtype::Fp8), blocks(KvDtype::Tq3));
        let state = spec_9b(KvDtype::Bf16).state_bytes();
        // One block goes to the padded rows' scratch.
        assert_eq!(bf16, (budget - state) / spec_9b(KvDtype::Bf16).bytes_per_block() - 1);
        let (r_fp8, r_tq3) = (fp8 as f64 / bf16 as f64, tq3 as f64 / bf16 as f64);
        eprintln!("qwen3.5-9b, 40 GiB: bf16 {bf16} blocks, fp8 {fp8} ({r_fp8:.3}x), tq3 {tq3} ({r_tq3:.3}x)");
        assert!(r_tq3 >= 4.5, "tq3 holds {r_tq3:.3}x the tokens of bf16");
        assert!(r_fp8 >= 1.98, "fp8 holds {r_fp8:.3}x the tokens of bf16");
        assert_eq!(tq3, (budget - state) / (16 * 8 * 4 * 196) - 1);
    }

    #[test]
    fn plans_take_what_is_wanted_up_to_what_fits() {
        let s = spec_9b(KvDtype::Tq3);
        // Room for 101 blocks: one is the scratch block padded rows write to.
        let budget = s.state_bytes() + 101 * s.bytes_per_block() + 5;
        assert_eq!(plan_kv_blocks(budget, &s, 30, None, 10, 0.9).unwrap(), KvPlan { blocks: 30, fit: 100 });
        assert_eq!(plan_kv_blocks(budget, &s, 500, None, 10, 0.9).unwrap(), KvPlan { blocks: 100, fit: 100 });
        let line = describe(&KvPlan { blocks: 30, fit: 100 }, &s);
        assert!(line.contains("tq3") && line.contains("480 tokens") && line.contains("1600 tokens that fit"), "{line}");
    }

    #[test]
    fn plans_that_cannot_fit_are_refused() {
        let s = spec_9b(KvDtype::Bf16);
        let budget = s.state_bytes() + 101 * s.bytes_per_block();
        let err = plan_kv_blocks(budget, &s, 50, Some(101), 10, 0.9).unwrap_err().to_string();
        assert!(err.contains("--kv-blocks 101"), "{err}");
        let err = plan_kv_blocks(budget, &s, 500, None, 101, 0.9).unwrap_err().to_string();
        assert!(err.contains("fits 100 blocks") && err.contains("bf16") && err.contains("--kv-cache-dtype"), "{err}");
        // Less than the recurrent state: nothing fits.
        assert!(plan_kv_blocks(s.state_bytes() / 2, &s, 5, None, 1, 0.9).is_err());
    }
}
