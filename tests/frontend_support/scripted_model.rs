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
//! Special tokens never win unless scripted: their `lm_head` rows are zero.
//!
//! The model has an MTP head that follows the script too: its input projection copies the next
//! token's script dimension through, so it drafts the token after next, and MTP speculation is
//! accepted on scripted text as it is on a real model.
//!
//! A text in which some token would need two successors (XML tool calls repeat their tags) is
//! spelled with distinct tokens instead ([`distinct_chain`]): byte-level BPE decodes any split
//! of a text into tokens to that text, so a chain of tokens used once each says anything.

use half::bf16;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Dimensions of the hidden state that carry no script (context reaches only these).
const RANDOM_DIMS: usize = 40;
/// Script dimensions at least (more when more tokens are scripted).
const MIN_SCRIPT_DIMS: usize = 24;
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

/// One scripted reply: after token `start`, the model writes `text`, then `end` (when given).
pub struct Script<'a> {
    pub start: u32,
    pub text: &'a str,
    pub end: Option<u32>,
}

/// Transitions for several replies, each text spelled with tokens that occur once in all of
/// them (and are no script's start or end); special tokens (`<think>`, `<tool_call>`, ...) are
/// written by their own id the first time they occur. Panics if a text cannot be spelled so.
pub fn distinct_chains(tokenizer: &kestrel::tokenizer::Tokenizer, scripts: &[Script]) -> Vec<Transition> {
    let mut by_bytes: HashMap<Vec<u8>, u32> = HashMap::new();
    for id in 0..FIRST_SPECIAL_ID as u32 {
        let bytes = tokenizer.token_bytes(id);
        if !bytes.is_empty() && bytes.len() <= MAX_SPELLING_BYTES {
            by_bytes.entry(bytes).or_insert(id);
        }
    }
    let specials: Vec<(String, u32)> = ["<think>", "</think>", "<tool_call>", "</tool_call>"].iter().filter_map(|t| tokenizer.token_to_id(t).map(|id| (t.to_string(), id))).collect();
    let mut used: HashSet<u32> = scripts.iter().flat_map(|s| [Some(s.start), s.end]).flatten().collect();
    let mut transitions = Vec::new();
    for script in scripts {
        let ids = spell(script.text.as_bytes(), &by_bytes, &specials, &mut used).unwrap_or_else(|| panic!("{:?} cannot be spelled with distinct tokens", script.text));
        assert_eq!(tokenizer.decode(&ids, false).expect("decodes"), script.text, "the spelling decodes to the text");
        transitions.push(Transition { from: script.start, to: ids[0] });
        transitions.extend(ids.windows(2).map(|pair| Transition { from: pair[0], to: pair[1] }));
        if let Some(end) = script.end {
            transitions.push(Transition { from: *ids.last().expect("non-empty text"), to: end });
        }
    }
    transitions
}

/// Longest token spelling tried.
const MAX_SPELLING_BYTES: usize = 24;

/// Tokens for `text`, none in `used`, longest first with backtracking.
fn spell(text: &[u8], by_bytes: &HashMap<Vec<u8>, u32>, specials: &[(String, u32)], used: &mut HashSet<u32>) -> Option<Vec<u32>> {
    if text.is_empty() {
        return Some(Vec::new());
    }
    let mut candidates: Vec<(usize, u32)> = specials.iter().filter(|(t, id)| text.starts_with(t.as_bytes()) && !used.contains(id)).map(|(t, id)| (t.len(), *id)).collect();
    candidates.extend((1..=text.len().min(MAX_SPELLING_BYTES)).rev().filter_map(|len| by_bytes.get(&text[..len]).filter(|id| !used.contains(id)).map(|&id| (len, id))));
    for (len, id) in candidates {
        used.insert(id);
        if let Some(mut rest) = spell(&text[len..], by_bytes, specials, used) {
            rest.insert(0, id);
            return Some(rest);
        }
        used.remove(&id);
    }
    None
}

/// Writes config.json, model.safetensors and the tokenizer files into `dir`.
pub fn write_scripted_model(dir: &Path, tokenizer_dir: &Path, transitions: &[Transition], seed: u64) {
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
    // Successors get a dimension too, so that the MTP head can read the token after next.
    for t in transitions {
        let next = script_dim.len();
        script_dim.entry(t.to).or_insert(next);
    }
    #[allow(non_snake_case)]
    let SCRIPT_DIMS = script_dim.len().max(MIN_SCRIPT_DIMS).next_multiple_of(8);
    #[allow(non_snake_case)]
    let HIDDEN = SCRIPT_DIMS + RANDOM_DIMS;

    let mut noise = Noise(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();

    let mut embed = vec![0f32; vocab * HIDDEN];
    for (token, row) in embed.chunks_mut(HIDDEN).enumerate() {
        match script_dim.get(&(token as u32)) {
            Some(&dim) => row[dim] = SCRIPT_EMBEDDING,
            None => row[SCRIPT_DIMS..].iter_mut().for_each(|v| *v = noise.uniform(1.7)),
        }
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

    let key_dim = LINEAR_KEY_HEAD_DIM;
    let value_dim = LINEAR_VALUE_HEADS * LINEAR_VALUE_HEAD_DIM;
    let conv_dim = 2 * key_dim + value_dim;
    // The MTP head: `fc` reads [norm(embed(next token)) | norm(hidden)] and copies the next
    // token's script dimension through; its layer, like the others, writes random dimensions only.
    let mut fc = vec![0f32; HIDDEN * 2 * HIDDEN];
    for (row, out) in fc.chunks_mut(2 * HIDDEN).enumerate() {
        if row < SCRIPT_DIMS {
            out[row] = 1.0;
        } else {
            out.iter_mut().enumerate().filter(|(col, _)| *col % HIDDEN >= SCRIPT_DIMS).for_each(|(_, v)| *v = noise.uniform(LAYER_WEIGHT_SCALE));
        }
    }
    tensors.push(("mtp.fc.weight".into(), vec![HIDDEN, 2 * HIDDEN], fc));
    let mut random = |name: &str, shape: Vec<usize>, writes_residual: bool| {
        let (rows, cols) = (shape[0], shape[1..].iter().product::<usize>());
        let mut values: Vec<f32> = (0..rows * cols).map(|_| noise.uniform(LAYER_WEIGHT_SCALE)).collect();
        if writes_residual {
            // Rows are output features: keep the layers out of the script dimensions.
            values[..SCRIPT_DIMS * cols].iter_mut().for_each(|v| *v = 0.0);
        }
        tensors.push((name.to_string(), shape, values));
    };
    for p in ["model.layers.1.self_attn.", "mtp.layers.0.self_attn."] {
        random(&format!("{p}q_proj.weight"), vec![NUM_HEADS * HEAD_DIM * 2, HIDDEN], false);
        random(&format!("{p}k_proj.weight"), vec![HEAD_DIM, HIDDEN], false);
        random(&format!("{p}v_proj.weight"), vec![HEAD_DIM, HIDDEN], false);
        random(&format!("{p}o_proj.weight"), vec![HIDDEN, NUM_HEADS * HEAD_DIM], true);
    }
    for p in ["model.layers.0.mlp.", "model.layers.1.mlp.", "mtp.layers.0.mlp."] {
        random(&format!("{p}gate_proj.weight"), vec![INTERMEDIATE, HIDDEN], false);
        random(&format!("{p}up_proj.weight"), vec![INTERMEDIATE, HIDDEN], false);
        random(&format!("{p}down_proj.weight"), vec![HIDDEN, INTERMEDIATE], true);
    }
    let p = "model.layers.0.linear_attn.";
    random(&format!("{p}in_proj_qkv.weight"), vec![conv_dim, HIDDEN], false);
    random(&format!("{p}in_proj_z.weight"), vec![value_dim, HIDDEN], false);
    random(&format!("{p}in_proj_b.weight"), vec![LINEAR_VALUE_HEADS, HIDDEN], false);
    random(&format!("{p}in_proj_a.weight"), vec![LINEAR_VALUE_HEADS, HIDDEN], false);
    random(&format!("{p}conv1d.weight"), vec![conv_dim, 1, CONV_KERNEL], false);
    random(&format!("{p}out_proj.weight"), vec![HIDDEN, value_dim], true);

    let constant = |name: &str, len: usize, value: f32| (name.to_string(), vec![len], vec![value; len]);
    let p = "model.layers.0.linear_attn.";
    tensors.push(constant(&format!("{p}A_log"), LINEAR_VALUE_HEADS, 0.0));
    tensors.push(constant(&format!("{p}dt_bias"), LINEAR_VALUE_HEADS, 0.0));
    tensors.push(constant(&format!("{p}norm.weight"), LINEAR_VALUE_HEAD_DIM, 1.0));
    for p in ["model.layers.1.", "mtp.layers.0."] {
        tensors.push(constant(&format!("{p}self_attn.q_norm.weight"), HEAD_DIM, 0.0));
        tensors.push(constant(&format!("{p}self_attn.k_norm.weight"), HEAD_DIM, 0.0));
    }
    for p in ["model.layers.0.", "model.layers.1.", "mtp.layers.0."] {
        tensors.push(constant(&format!("{p}input_layernorm.weight"), HIDDEN, 0.0));
        tensors.push(constant(&format!("{p}post_attention_layernorm.weight"), HIDDEN, 0.0));
    }
    for name in ["model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"] {
        tensors.push(constant(name, HIDDEN, 0.0));
    }

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
        "mtp_num_hidden_layers": 1,
        "eos_token_id": eos,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).expect("config serializes")).expect("config is written");
}
