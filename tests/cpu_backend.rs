//! The CPU backend stays the reference whatever runs it: whole-model logits are bitwise the same
//! on the scalar kernels and the SIMD ones, on one thread and on several, for every model
//! family and for the GGUF block formats (read in place).

mod common;

use kestrel::backend::cpu::{CpuBackend, Isa};
use kestrel::backend::{Backend, BatchLayout, RowKind, RowLayout};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;
use std::path::Path;

/// Logits of a 150-token prefill (pieces of 64: chunks of the delta rule, both attention paths)
/// followed by a 3-token generate row, every token's row, on `b`.
fn logits_on(model: &Qwen35<CpuBackend>, b: &CpuBackend, vocab: usize) -> Vec<u32> {
    let ids: Vec<u32> = (0..153u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
    let spec = model.cache_spec(16, 16, 1, 3);
    let mut cache = b.alloc_cache(&spec).expect("cache");
    b.reset_states(&mut cache, &[0]);
    let table: Vec<u32> = (0..16).collect();
    let mut bits = Vec::new();
    let mut start = 0;
    for (kind, n) in [(RowKind::Prefill, 64), (RowKind::Prefill, 64), (RowKind::Prefill, 22), (RowKind::Generate, 3)] {
        let layout = BatchLayout { rows: vec![RowLayout { kind, token_start: 0, num_tokens: n, start_position: start, block_table: table.clone(), state_slot: 0, snapshot_base: 0 }] };
        let rows: Vec<u32> = (0..n as u32).collect();
        let out = model.forward(b, &ids[start..start + n], &layout, &rows, &mut cache);
        bits.extend(b.to_host(&out.logits).iter().map(|v| v.to_bits()));
        start += n;
    }
    bits
}

fn check(files: ModelFiles, what: &str) {
    let loader = CpuBackend::with_threads(1);
    let model = Qwen35::load(&loader, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let vocab = files.config.vocab_size;
    let reference = logits_on(&model, &CpuBackend::with_options(1, Isa::Scalar), vocab);
    assert!(reference.iter().all(|&b| f32::from_bits(b).is_finite()), "{what}: non-finite logits");
    for (threads, isa) in [(1, Isa::detect()), (2, Isa::detect()), (3, Isa::detect()), (3, Isa::Scalar)] {
        let got = logits_on(&model, &CpuBackend::with_options(threads, isa), vocab);
        let differ = got.iter().zip(&reference).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{what}: {differ} logits differ on {threads} threads with {isa:?} from one scalar thread");
    }
}

#[test]
fn every_kernel_and_thread_count_gives_the_same_logits() {
    check(ModelFiles::open(None).expect("embedded model"), "default model");
    for name in common::FIXTURES {
        check(ModelFiles::open_dir(&common::fixture_dir(name)).expect("fixture"), name);
    }
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf");
    for name in ["qwen35-dense.gguf", "qwen35-moe-quant.gguf", "qwen3-next.gguf"] {
        check(ModelFiles::open_gguf(&gguf.join(name)).expect("gguf fixture"), name);
    }
}
