//! A tiny Qwen3.5-architecture model with the real Qwen3 tokenizer whose greedy output is scripted.
//!
//! The front-end tests need answers they can predict: a chat reply, a tool call, a repetitive
//! text that ngram speculation accepts. A random model cannot promise those, so this one is built
//! so that some tokens have a fixed successor:
//!
//! * the hidden state has `SCRIPT_DIMS` "script" dimensions and the rest "random" dimensions;
//! * a scripted token embeds as a large one-hot vector in its own script dimension, and its
//!   successor's `lm_head` row reads that dimension with a large weight, so after the final
//!   norm the successor wins the argmax by a wide margin;
//! * every other token embeds randomly in the random dimensions, and the decoder layers (random
//!   weights) write only to the random dimensions, so context changes the output of unscripted
//!   tokens (prompts give different continuations) but never reaches a script dimension.
//!
//! Special tokens never win unless scripted: their `lm_head` rows are zero. Tokens listed as
//! poisoned embed as NaN, so a prompt holding one makes every later logit NaN.

use half::bf16;
use std::collections::HashMap;
use std::path::Path;

/// Width of the hidden state, and how many of its dimensions carry the script.
const HIDDEN: usize = 64;
const SCRIPT_DIMS: usize = 24;
const INTERMEDIATE: usize = 64;
const HEAD_DIM: usize = 16;
const NUM_HEADS: usize = 2;
const LINEAR_KEY_HEAD_DIM: usize = 16;
const LINEAR_VALUE_HEADS: usize = 2;
const LINEAR_VALUE_HEAD_DIM: usize = 16;
const CONV_KERNEL: usize = 4;
/// Embedding of a scripted token in its dimension, and the successor's weight on it.
const SCRIPT_EMBEDDING: f32 = 8.0;
const SCRIPT_READOUT: f32 = 64.0;
/// Scale of the random decoder weights (small enough that the script always wins).
const LAYER_WEIGHT_SCALE: f32 = 0.15;
/// First id of the Qwen3 special and added tokens (`<|endoftext|>`).
const FIRST_SPECIAL_ID: usize = 151_643;

/// Deterministic pseudo-random numbers (splitmix64), so a model is the same on every run.
struct Noise(u64);

impl Noise {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale).
    fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

/// Token `from` is always followed by token `to` under greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: u32,
    pub to: u32,
}

/// Transitions that make `start` continue with `text`'s tokens, each followed by the next. With
/// `cycle`, the last token leads back to the first, so the text repeats until `max_tokens`.
/// Panics if a token would need two different successors.
pub fn chain(tokenizer: &kestrel::tokenizer::Tokenizer, start: u32, text: &str, cycle: bool) -> Vec<Transition> {
    let ids = tokenizer.encode(text, false).expect("the script text tokenizes");
    let mut transitions = vec![Transition { from: start, to: ids[0] }];
    transitions.extend(ids.windows(2).map(|pair| Transition { from: pair[0], to: pair[1] }));
    if cycle {
        transitions.push(Transition { from: *ids.last().expect("non-empty script"), to: ids[0] });
    }
    let mut successor = HashMap::new();
    for t in &transitions {
        let previous = successor.insert(t.from, t.to);
        assert!(previous.is_none() || previous == Some(t.to), "token {} would need two successors in {text:?}", t.from);
    }
    transitions
}

/// Writes config.json, model.safetensors and the tokenizer files into `dir`.
pub fn write_scripted_model(dir: &Path, tokenizer_dir: &Path, transitions: &[Transition], seed: u64, poisoned: &[u32]) {
    std::fs::create_dir_all(dir).expect("model dir can be created");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir.join(file), dir.join(file)).unwrap_or_else(|err| panic!("cannot copy {file} from {}: {err}", tokenizer_dir.display()));
    }
    let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(dir).expect("the copied tokenizer loads");
    let vocab = tokenizer.vocab_size();
    let eos = tokenizer.eos_token_ids();

    let mut script_dim: HashMap<u32, usize> = HashMap::new();
    for t in transitions {
        let next = script_dim.len();
        script_dim.entry(t.from).or_insert(next);
    }
    assert!(script_dim.len() <= SCRIPT_DIMS, "{} scripted tokens do not fit {SCRIPT_DIMS} script dimensions", script_dim.len());

    let mut noise = Noise(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();

    let mut embed = vec![0f32; vocab * HIDDEN];
    for (token, row) in embed.chunks_mut(HIDDEN).enumerate() {
        match script_dim.get(&(token as u32)) {
            Some(&dim) => row[dim] = SCRIPT_EMBEDDING,
            None => row[SCRIPT_DIMS..].iter_mut().for_each(|v| *v = noise.uniform(1.7)),
        }
    }
    for &token in poisoned {
        assert!(!script_dim.contains_key(&token), "token {token} is both scripted and poisoned");
        embed[token as usize * HIDDEN..(token as usize + 1) * HIDDEN].fill(f32::NAN);
    }
    tensors.push(("model.embed_tokens.weight".into(), vec![vocab, HIDDEN], embed));

    let mut lm_head = vec![0f32; vocab * HIDDEN];
    let scripted_successors: std::collections::HashSet<u32> = transitions.iter().map(|t| t.to).collect();
    for (token, row) in lm_head.chunks_mut(HIDDEN).enumerate() {
        let special = token >= FIRST_SPECIAL_ID;
        if !special && !scripted_successors.contains(&(token as u32)) {
            row[SCRIPT_DIMS..].iter_mut().for_each(|v| *v = noise.uniform(1.7));
        }
    }
    for t in transitions {
        lm_head[t.to as usize * HIDDEN + script_dim[&t.from]] = SCRIPT_READOUT;
    }
    tensors.push(("lm_head.weight".into(), vec![vocab, HIDDEN], lm_head));

    let mut random = |name: &str, shape: Vec<usize>, writes_residual: bool| {
        let (rows, cols) = (shape[0], shape[1..].iter().product::<usize>());
        let mut values: Vec<f32> = (0..rows * cols).map(|_| noise.uniform(LAYER_WEIGHT_SCALE)).collect();
        if writes_residual {
            // Rows are output features: keep the layers out of the script dimensions.
            values[..SCRIPT_DIMS * cols].iter_mut().for_each(|v| *v = 0.0);
        }
        tensors.push((name.to_string(), shape, values));
    };
    let key_dim = LINEAR_KEY_HEAD_DIM;
    let value_dim = LINEAR_VALUE_HEADS * LINEAR_VALUE_HEAD_DIM;
    let conv_dim = 2 * key_dim + value_dim;
    let p = "model.layers.0.linear_attn.";
    random(&format!("{p}in_proj_qkv.weight"), vec![conv_dim, HIDDEN], false);
    random(&format!("{p}in_proj_z.weight"), vec![value_dim, HIDDEN], false);
    random(&format!("{p}in_proj_b.weight"), vec![LINEAR_VALUE_HEADS, HIDDEN], false);
    random(&format!("{p}in_proj_a.weight"), vec![LINEAR_VALUE_HEADS, HIDDEN], false);
    random(&format!("{p}conv1d.weight"), vec![conv_dim, 1, CONV_KERNEL], false);
    random(&format!("{p}out_proj.weight"), vec![HIDDEN, value_dim], true);
    let p = "model.layers.1.self_attn.";
    random(&format!("{p}q_proj.weight"), vec![NUM_HEADS * HEAD_DIM * 2, HIDDEN], false);
    random(&format!("{p}k_proj.weight"), vec![HEAD_DIM, HIDDEN], false);
    random(&format!("{p}v_proj.weight"), vec![HEAD_DIM, HIDDEN], false);
    random(&format!("{p}o_proj.weight"), vec![HIDDEN, NUM_HEADS * HEAD_DIM], true);
    for layer in 0..2 {
        let p = format!("model.layers.{layer}.mlp.");
        random(&format!("{p}gate_proj.weight"), vec![INTERMEDIATE, HIDDEN], false);
        random(&format!("{p}up_proj.weight"), vec![INTERMEDIATE, HIDDEN], false);
        random(&format!("{p}down_proj.weight"), vec![HIDDEN, INTERMEDIATE], true);
    }

    let constant = |name: &str, len: usize, value: f32| (name.to_string(), vec![len], vec![value; len]);
    let p = "model.layers.0.linear_attn.";
    tensors.push(constant(&format!("{p}A_log"), LINEAR_VALUE_HEADS, 0.0));
    tensors.push(constant(&format!("{p}dt_bias"), LINEAR_VALUE_HEADS, 0.0));
    tensors.push(constant(&format!("{p}norm.weight"), LINEAR_VALUE_HEAD_DIM, 1.0));
    tensors.push(constant("model.layers.1.self_attn.q_norm.weight", HEAD_DIM, 0.0));
    tensors.push(constant("model.layers.1.self_attn.k_norm.weight", HEAD_DIM, 0.0));
    for layer in 0..2 {
        tensors.push(constant(&format!("model.layers.{layer}.input_layernorm.weight"), HIDDEN, 0.0));
        tensors.push(constant(&format!("model.layers.{layer}.post_attention_layernorm.weight"), HIDDEN, 0.0));
    }
    tensors.push(constant("model.norm.weight", HIDDEN, 0.0));

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.into_iter().map(|(name, shape, values)| (name, shape, values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        bytes.iter().map(|(name, shape, data)| (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).expect("consistent tensor"))).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("weights are written");

    let config = serde_json::json!({
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": LINEAR_VALUE_HEADS,
        "linear_key_head_dim": LINEAR_KEY_HEAD_DIM,
        "linear_value_head_dim": LINEAR_VALUE_HEAD_DIM,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false,
        "max_position_embeddings": 4096,
        "eos_token_id": eos,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).expect("config serializes")).expect("config is written");
}
