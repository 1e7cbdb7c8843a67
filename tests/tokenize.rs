//! `kestrel tokenize` / `kestrel detokenize` against llama.cpp's own tokenizer test vectors
//! (models/ggml-vocab-qwen{2,35}.gguf with their .inp/.out files: inputs, and the ids Hugging
//! Face's tokenizer gives them), fetched by scripts/fetch_llamacpp_vocab.sh.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn vocab_dir() -> PathBuf {
    std::env::var_os("KESTREL_LLAMACPP_VOCAB_DIR")
        .map(PathBuf::from)
        .expect("set KESTREL_LLAMACPP_VOCAB_DIR to a folder filled by scripts/fetch_llamacpp_vocab.sh (bash .ci/run does both)")
}

/// The test cases of one vocabulary: (input, expected ids).
fn vectors(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = vocab_dir();
    let inputs = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp"))).expect("inputs");
    let outputs = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).expect("outputs");
    // Each input is followed by the separator; each output is one line of ids.
    let inputs: Vec<&str> = inputs.strip_suffix(SEPARATOR).expect("inputs end with the separator").split(SEPARATOR).collect();
    let outputs: Vec<Vec<u32>> = outputs.lines().map(|line| line.split_whitespace().map(|id| id.parse().expect("an id")).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "one line of ids per input");
    assert!(inputs.len() >= 40, "the vectors are all there");
    inputs.into_iter().map(String::from).zip(outputs).collect()
}

fn kestrel(args: &[&str], stdin: Option<&str>) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel")).args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("kestrel runs");
    let mut input = child.stdin.take().expect("piped stdin");
    input.write_all(stdin.unwrap_or_default().as_bytes()).expect("stdin is written");
    drop(input);
    let out = child.wait_with_output().expect("kestrel finishes");
    assert!(out.status.success(), "kestrel {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[test]
fn every_llamacpp_vector_tokenizes_to_its_ids() {
    for name in ["qwen35", "qwen2"] {
        let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
        let tokenizer = kestrel::model::open_tokenizer(Some(&path)).expect("the vocab-only GGUF opens");
        for (input, ids) in vectors(name) {
            assert_eq!(tokenizer.encode(&input, false).expect("encodes"), ids, "{name}: {input:?}");
            assert_eq!(tokenizer.decode(&ids, false).expect("decodes"), input, "{name}: ids of {input:?} decode back");
        }
    }
}

#[test]
fn the_command_reproduces_the_qwen35_vectors() {
    let model = vocab_dir().join("ggml-vocab-qwen35.gguf");
    let model = model.to_str().expect("a UTF-8 path");
    let cases = vectors("qwen35");
    // Whitespace runs, combining marks left decomposed, emoji sequences, digits and CJK.
    let picked = ["\n\n\n", "e\u{301}", "re\u{301}sume\u{301}", "    Hello\n    Hello", "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～", "333333333"];
    for wanted in picked {
        let (input, ids) = cases.iter().find(|(input, _)| input == wanted).unwrap_or_else(|| panic!("{wanted:?} is a llama.cpp vector"));
        let expected = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
        assert_eq!(kestrel(&["tokenize", "--model", model, input], None), format!("{expected}\n"), "{input:?}");
    }
    // Standard input is read exactly as given, the last newline included.
    let (input, ids) = cases.iter().find(|(input, _)| input.contains("🚀")).expect("the emoji vector");
    let json: serde_json::Value = serde_json::from_str(&kestrel(&["tokenize", "--model", model, "--json"], Some(input))).expect("JSON");
    assert_eq!(json, serde_json::json!({ "ids": ids }));
    let id_args: Vec<String> = ids.iter().map(u32::to_string).collect();
    let mut args = vec!["detokenize", "--model", model];
    args.extend(id_args.iter().map(String::as_str));
    assert_eq!(kestrel(&args, None), *input);
    assert_eq!(kestrel(&["detokenize", "--model", model], Some(&id_args.join(","))), *input);
}

#[test]
fn bad_input_is_refused_clearly() {
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["detokenize", "12", "x7"]).output().expect("kestrel runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`x7` is not a token id"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["detokenize", "999999999"]).output().expect("kestrel runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("999999999"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["tokenize", "--model", "/no/such/vocab.gguf", "x"]).output().expect("kestrel runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/vocab.gguf"), "{}", String::from_utf8_lossy(&out.stderr));
    // The embedded model's tokenizer needs no --model.
    let out = Command::new(env!("CARGO_BIN_EXE_kestrel")).args(["tokenize", "def f():"]).output().expect("kestrel runs");
    assert!(out.status.success() && !out.stdout.is_empty());
}
