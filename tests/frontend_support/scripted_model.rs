//! A tiny Qwen3.5-architecture model with the real Qwen3 tokenizer whose greedy output is scripted.
//!
//! The front-end tests need answers they can predict: a chat reply, a tool call, reasoning, a
//! repetitive text that ngram speculation accepts. A random model cannot promise those, so this
//! one is built so that a scripted token's successor is fixed by it and the two tokens before it:
//!
//! * the hidden state has "script" dimensions (one per scripted token), two blocks of as many
//!   "context" dimensions, and "random" dimensions;
//! * a scripted token embeds as a large one-hot vector in its script dimension;
//! * the Gated DeltaNet layer copies the one-hots of the token before and the one before that
//!   into the two context blocks: its causal conv reads one value head a token back and the other
//!   two tokens back, and a decay of almost zero with a gate of one makes the delta rule's output
//!   that value;
//! * a successor's `lm_head` row reads the current token's script dimension and the context
//!   tokens' dimensions with the same large weight, so the successor of the three scores three
//!   times that weight, more than any token that matches fewer of them;
//! * every other token embeds randomly in the random dimensions, and the other layers (random
//!   weights) write only there, so context changes the output of unscripted tokens (prompts give
//!   different continuations) but never reaches the script.
//!
//! Special tokens never win unless scripted: their `lm_head` rows are zero. Tokens listed as
//! poisoned embed as NaN, so a prompt holding one makes every later logit NaN.
//!
//! The MTP head follows the script too: its input projection copies the next token's script
//! dimension, and the current context shifted by one, so it drafts the token after next, and MTP
//! speculation is accepted on scripted text as on a real model.
//!
//! A text in which the same three tokens would need two successors (XML tool calls repeat their
//! tags) is spelled with other tokens there ([`script_chains`]): byte-level BPE decodes any split
//! of a text into tokens to that text.

use half::bf16;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// Dimensions of the hidden state that carry no script (context reaches only these).
const RANDOM_DIMS: usize = 40;
const INTERMEDIATE: usize = 64;
const HEAD_DIM: usize = 16;
const NUM_HEADS: usize = 2;
const LINEAR_KEY_HEAD_DIM: usize = 16;
const CONV_KERNEL: usize = 4;
/// Embedding of a scripted token in its dimension, and the successor's weight on it.
const SCRIPT_EMBEDDING: f32 = 8.0;
const SCRIPT_READOUT: f32 = 64.0;
/// Scale of the random decoder weights (small enough that the script always wins).
const LAYER_WEIGHT_SCALE: f32 = 0.15;
/// First id of the Qwen3 special and added tokens (`<|endoftext|>`).
const FIRST_SPECIAL_ID: usize = 151_643;
/// Longest token spelling tried.
const MAX_SPELLING_BYTES: usize = 24;


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

/// After the tokens `context` (the older first) then `from`, greedy decoding picks `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Transition {
    pub context: [u32; CONTEXT],
    pub from: u32,
    pub to: u32,
}

/// Tokens before the current one that a successor depends on.
const CONTEXT: usize = 2;

impl Transition {
    /// From a window of `CONTEXT + 2` tokens.
    fn of_window(w: &[u32]) -> Self {
        Transition { context: [w[0], w[1]], from: w[2], to: w[3] }
    }
}

/// One scripted reply: after `context` then `start` (the last tokens of the prompt), the model
/// writes `text`, then `end` (when given).
pub struct Script<'a> {
    pub context: [u32; CONTEXT],
    pub start: u32,
    pub text: &'a str,
    pub end: Option<u32>,
}

/// Transitions that make the prompt's `context`, `start` continue with `text`'s tokens (as the
/// tokenizer splits it) over and over.
pub fn chain(tokenizer: &kestrel::tokenizer::Tokenizer, context: [u32; CONTEXT], start: u32, text: &str) -> Vec<Transition> {
    let ids = tokenizer.encode(text, false).expect("the script text tokenizes");
    let mut path = context.to_vec();
    path.push(start);
    path.extend(&ids);
    path.extend(&ids[..(CONTEXT + 1).min(ids.len())]);
    let transitions: Vec<Transition> = path.windows(CONTEXT + 2).map(Transition::of_window).collect();
    assert!(clashes(&transitions).is_empty(), "{text:?} repeats itself inside: some tokens would need two successors");
    dedup(transitions)
}

fn dedup(mut transitions: Vec<Transition>) -> Vec<Transition> {
    transitions.sort();
    transitions.dedup();
    transitions
}

/// Indices of the transitions the model could not follow: a context with two successors, or a
/// successor that the additive readout cannot tell apart (another token that also follows the
/// current token somewhere and each context token at its place somewhere scores the same).
fn clashes(transitions: &[Transition]) -> Vec<usize> {
    let mut of_context: HashMap<([u32; CONTEXT], u32), HashSet<u32>> = HashMap::new();
    let mut after_from: HashMap<u32, HashSet<u32>> = HashMap::new();
    let mut after_context: [HashMap<u32, HashSet<u32>>; CONTEXT] = Default::default();
    for t in transitions {
        of_context.entry((t.context, t.from)).or_default().insert(t.to);
        after_from.entry(t.from).or_default().insert(t.to);
        for (lag, &token) in t.context.iter().enumerate() {
            after_context[lag].entry(token).or_default().insert(t.to);
        }
    }
    (0..transitions.len())
        .filter(|&i| {
            let t = transitions[i];
            let scores_as_high = |x: &u32| *x != t.to && t.context.iter().enumerate().all(|(lag, token)| after_context[lag][token].contains(x));
            of_context[&(t.context, t.from)].len() > 1 || after_from[&t.from].iter().any(scores_as_high)
        })
        .collect()
}

/// Transitions for several replies. Each text is split into tokens (special ones such as
/// `<think>` or `<tool_call>` by their own id where they fit) so that every pair of tokens has
/// one successor the model can score apart: where the usual split clashes, the tokens around the
/// clash are split another way, at random, until nothing clashes. Panics if that fails.
pub fn script_chains(tokenizer: &kestrel::tokenizer::Tokenizer, scripts: &[Script]) -> Vec<Transition> {
    let table = tokenizer.token_bytes_table(FIRST_SPECIAL_ID).expect("a byte-level tokenizer");
    let mut by_bytes: HashMap<Vec<u8>, u32> = HashMap::new();
    for (id, entry) in table.into_iter().enumerate() {
        if let kestrel::tokenizer::TokenBytes::Text(bytes) = entry {
            if !bytes.is_empty() && bytes.len() <= MAX_SPELLING_BYTES {
                by_bytes.entry(bytes).or_insert(id as u32);
            }
        }
    }
    let specials: Vec<(Vec<u8>, u32)> = ["<think>", "</think>", "<tool_call>", "</tool_call>"].iter().filter_map(|t| tokenizer.token_to_id(t).map(|id| (t.as_bytes().to_vec(), id))).collect();
    let bytes_of: HashMap<u32, Vec<u8>> = by_bytes.iter().map(|(b, &id)| (id, b.clone())).chain(specials.iter().map(|(b, id)| (*id, b.clone()))).collect();
    let mut noise = Noise(7);
    // Start from the tokenizer's own split, special tokens by id.
    let mut spellings: Vec<Vec<u32>> = scripts.iter().map(|s| tokenizer.encode(s.text, false).expect("the script text tokenizes")).collect();
    let transitions_of = |spellings: &[Vec<u32>]| -> Vec<(usize, usize, Transition)> {
        let mut all = Vec::new();
        for (k, (script, ids)) in scripts.iter().zip(spellings).enumerate() {
            let mut path = script.context.to_vec();
            path.push(script.start);
            path.extend(ids);
            path.extend(script.end);
            all.extend(path.windows(CONTEXT + 2).enumerate().map(|(i, w)| (k, i, Transition::of_window(w))));
        }
        all
    };
    for _ in 0..SPELLING_REPAIRS {
        let all = transitions_of(&spellings);
        let plain: Vec<Transition> = all.iter().map(|(_, _, t)| *t).collect();
        let clashing = clashes(&plain);
        if clashing.is_empty() {
            for (script, ids) in scripts.iter().zip(&spellings) {
                assert_eq!(tokenizer.decode(ids, false).expect("decodes"), script.text, "the spelling decodes to the text");
            }
            return dedup(plain);
        }
        // Split a few tokens around one clash anew: the transition's `from` and `to` are tokens
        // `i - 1` and `i` of its script's spelling, its context the ones before (the prompt's
        // tokens stay).
        let (k, i, _) = all[clashing[(noise.next_u64() % clashing.len() as u64) as usize]];
        let ids = &mut spellings[k];
        let lo = i.saturating_sub(1 + (noise.next_u64() % (CONTEXT as u64 + 1)) as usize);
        let hi = (i + 1 + (noise.next_u64() % 2) as usize).min(ids.len());
        if lo >= hi {
            continue;
        }
        let span: Vec<u8> = ids[lo..hi].iter().flat_map(|id| bytes_of[id].iter().copied()).collect();
        let respelled = random_split(&span, &by_bytes, &specials, &mut noise);
        ids.splice(lo..hi, respelled);
    }
    panic!("the scripts cannot be spelled so that every pair of tokens has one successor: {:?}", scripts.iter().map(|s| s.text).collect::<Vec<_>>());
}

/// Tries of [`script_chains`] to clear the clashes.
const SPELLING_REPAIRS: usize = 200_000;

/// `bytes` as a random sequence of tokens (special tokens by id where their text is).
fn random_split(bytes: &[u8], by_bytes: &HashMap<Vec<u8>, u32>, specials: &[(Vec<u8>, u32)], noise: &mut Noise) -> Vec<u32> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let mut options: Vec<(usize, u32)> = specials.iter().filter(|(b, _)| rest.starts_with(b)).map(|(b, id)| (b.len(), *id)).collect();
        options.extend((1..=rest.len().min(MAX_SPELLING_BYTES)).filter_map(|len| by_bytes.get(&rest[..len]).map(|&id| (len, id))));
        // Every byte is a token, so there is always an option.
        let (len, id) = options[(noise.next_u64() % options.len() as u64) as usize];
        out.push(id);
        at += len;
    }
    out
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
        for token in t.context.into_iter().chain([t.from, t.to]) {
            let next = script_dim.len();
            script_dim.entry(token).or_insert(next);
        }
    }
    // Script dimensions, then a block of as many per context token (the token before first),
    // then the random ones.
    let script_dims = script_dim.len().next_multiple_of(8);
    let context_block = |lag_back: usize| lag_back * script_dims;
    let kept = (CONTEXT + 1) * script_dims;
    let hidden = kept + RANDOM_DIMS;

    let mut noise = Noise(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();

    let mut embed = vec![0f32; vocab * hidden];
    for (token, row) in embed.chunks_mut(hidden).enumerate() {
        match script_dim.get(&(token as u32)) {
            Some(&dim) => row[dim] = SCRIPT_EMBEDDING,
            None => row[kept..].iter_mut().for_each(|v| *v = noise.uniform(1.7)),
        }
    }
    for &token in poisoned {
        assert!(!script_dim.contains_key(&token), "token {token} is both scripted and poisoned");
        embed[token as usize * hidden..(token as usize + 1) * hidden].fill(f32::NAN);
    }
    tensors.push(("model.embed_tokens.weight".into(), vec![vocab, hidden], embed));

    let mut lm_head = vec![0f32; vocab * hidden];
    let scripted_successors: HashSet<u32> = transitions.iter().map(|t| t.to).collect();
    for (token, row) in lm_head.chunks_mut(hidden).enumerate() {
        let special = token >= FIRST_SPECIAL_ID;
        if !special && !scripted_successors.contains(&(token as u32)) {
            row[kept..].iter_mut().for_each(|v| *v = noise.uniform(1.7));
        }
    }
    for t in transitions {
        lm_head[t.to as usize * hidden + script_dim[&t.from]] = SCRIPT_READOUT;
        for (back, token) in t.context.iter().rev().enumerate() {
            lm_head[t.to as usize * hidden + context_block(back + 1) + script_dim[token]] = SCRIPT_READOUT;
        }
    }
    tensors.push(("lm_head.weight".into(), vec![vocab, hidden], lm_head));

    // Layer 0, Gated DeltaNet: copies the one-hots of the tokens before into the context blocks.
    // q and k read a constant from any scripted token (so q.k is fixed); value head h reads the
    // token's one-hot, and the conv feeds it h + 1 tokens back; a decay of e^-20 forgets the past,
    // a gate of one writes the value whole.
    let x_normed = (hidden as f32).sqrt();
    let key_dim = LINEAR_KEY_HEAD_DIM;
    let value_heads = CONTEXT;
    let value_dim = value_heads * script_dims;
    let conv_dim = 2 * key_dim + value_dim;
    let p = "model.layers.0.linear_attn.";
    let mut qkv = vec![0f32; conv_dim * hidden];
    let mut conv = vec![0f32; conv_dim * CONV_KERNEL];
    for channel in 0..conv_dim {
        if channel < 2 * key_dim {
            (0..script_dims).for_each(|d| qkv[channel * hidden + d] = 0.5);
            conv[channel * CONV_KERNEL + CONV_KERNEL - 1] = 1.0;
        } else {
            let (head, d) = ((channel - 2 * key_dim) / script_dims, (channel - 2 * key_dim) % script_dims);
            qkv[channel * hidden + d] = 1.0;
            conv[channel * CONV_KERNEL + CONV_KERNEL - 2 - head] = 1.0;
        }
    }
    tensors.push((format!("{p}in_proj_qkv.weight"), vec![conv_dim, hidden], qkv));
    tensors.push((format!("{p}conv1d.weight"), vec![conv_dim, 1, CONV_KERNEL], conv));
    let z_weight = 1.0 / x_normed;
    let mut z = vec![0f32; value_dim * hidden];
    z.chunks_mut(hidden).for_each(|row| row[..script_dims].iter_mut().for_each(|v| *v = z_weight));
    tensors.push((format!("{p}in_proj_z.weight"), vec![value_dim, hidden], z));
    let mut b = vec![0f32; value_heads * hidden];
    b.chunks_mut(hidden).for_each(|row| row[..script_dims].iter_mut().for_each(|v| *v = 2.0));
    tensors.push((format!("{p}in_proj_b.weight"), vec![value_heads, hidden], b));
    tensors.push((format!("{p}in_proj_a.weight"), vec![value_heads, hidden], vec![0f32; value_heads * hidden]));
    // The gated norm leaves sqrt(head dim) * silu(1) in the one-hot's channel; scale it back to
    // the embedding's size.
    let silu_one = 1.0 / (1.0 + (-1.0f32).exp());
    let mut out = vec![0f32; hidden * value_dim];
    for head in 0..value_heads {
        for d in 0..script_dims {
            out[(context_block(head + 1) + d) * value_dim + head * script_dims + d] = SCRIPT_EMBEDDING / ((script_dims as f32).sqrt() * silu_one);
        }
    }
    tensors.push((format!("{p}out_proj.weight"), vec![hidden, value_dim], out));

    // The MTP head: `fc` reads [norm(embed(next token)) | norm(hidden)] and copies the next
    // token's script dimension through, and the hidden state's script and context blocks one
    // block further back.
    let mut fc = vec![0f32; hidden * 2 * hidden];
    for (row, weights) in fc.chunks_mut(2 * hidden).enumerate() {
        if row < script_dims {
            weights[row] = 1.0;
        } else if row < kept {
            weights[hidden + row - script_dims] = 1.0;
        } else {
            weights.iter_mut().enumerate().filter(|(col, _)| *col % hidden >= kept).for_each(|(_, v)| *v = noise.uniform(LAYER_WEIGHT_SCALE));
        }
    }
    tensors.push(("mtp.fc.weight".into(), vec![hidden, 2 * hidden], fc));

    let mut random = |name: &str, shape: Vec<usize>, writes_residual: bool| {
        let (rows, cols) = (shape[0], shape[1..].iter().product::<usize>());
        let mut values: Vec<f32> = (0..rows * cols).map(|_| noise.uniform(LAYER_WEIGHT_SCALE)).collect();
        if writes_residual {
            // Rows are output features: keep the layers out of the script and previous dimensions.
            values[..kept * cols].iter_mut().for_each(|v| *v = 0.0);
        }
        tensors.push((name.to_string(), shape, values));
    };
    for p in ["model.layers.1.self_attn.", "mtp.layers.0.self_attn."] {
        random(&format!("{p}q_proj.weight"), vec![NUM_HEADS * HEAD_DIM * 2, hidden], false);
        random(&format!("{p}k_proj.weight"), vec![HEAD_DIM, hidden], false);
        random(&format!("{p}v_proj.weight"), vec![HEAD_DIM, hidden], false);
        random(&format!("{p}o_proj.weight"), vec![hidden, NUM_HEADS * HEAD_DIM], true);
    }
    for p in ["model.layers.0.mlp.", "model.layers.1.mlp.", "mtp.layers.0.mlp."] {
        random(&format!("{p}gate_proj.weight"), vec![INTERMEDIATE, hidden], false);
        random(&format!("{p}up_proj.weight"), vec![INTERMEDIATE, hidden], false);
        random(&format!("{p}down_proj.weight"), vec![hidden, INTERMEDIATE], true);
    }

    let constant = |name: &str, len: usize, value: f32| (name.to_string(), vec![len], vec![value; len]);
    tensors.push(constant(&format!("{p}A_log"), value_heads, 2f32.ln()));
    tensors.push(constant(&format!("{p}dt_bias"), value_heads, 10.0));
    tensors.push(constant(&format!("{p}norm.weight"), script_dims, 1.0));
    for p in ["model.layers.1.", "mtp.layers.0."] {
        tensors.push(constant(&format!("{p}self_attn.q_norm.weight"), HEAD_DIM, 0.0));
        tensors.push(constant(&format!("{p}self_attn.k_norm.weight"), HEAD_DIM, 0.0));
    }
    for p in ["model.layers.0.", "model.layers.1.", "mtp.layers.0."] {
        tensors.push(constant(&format!("{p}input_layernorm.weight"), hidden, 0.0));
        tensors.push(constant(&format!("{p}post_attention_layernorm.weight"), hidden, 0.0));
    }
    for name in ["model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"] {
        tensors.push(constant(name, hidden, 0.0));
    }

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.into_iter().map(|(name, shape, values)| (name, shape, values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        bytes.iter().map(|(name, shape, data)| (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).expect("consistent tensor"))).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("weights are written");

    let config = serde_json::json!({
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": LINEAR_KEY_HEAD_DIM,
        "linear_value_head_dim": script_dims,
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
