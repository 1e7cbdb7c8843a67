//! The CPU backend stays the reference whatever runs it: whole-model logits are bitwise the same
//! on the scalar kernels and the SIMD ones, on one thread and on several, for every model
//! family and for the GGUF block formats (read in place).

mod common;

use common::pieced_logit_bits;

use kestrel::backend::cpu::{CpuBackend, Isa};
use kestrel::model::arch::qwen35::Qwen35;
use kestrel::model::ModelFiles;
use std::path::Path;


fn check(files: ModelFiles, what: &str) {
    let loader = CpuBackend::with_threads(1);
    let model = Qwen35::load(&loader, files.config.clone(), &files.store, &indicatif::ProgressBar::hidden()).expect("weights load");
    let vocab = files.config.vocab_size;
    let reference = pieced_logit_bits(&model, &CpuBackend::with_options(1, Isa::Scalar), vocab);
    assert!(reference.iter().all(|&b| f32::from_bits(b).is_finite()), "{what}: non-finite logits");
    for (threads, isa) in [(1, Isa::detect()), (2, Isa::detect()), (3, Isa::detect()), (3, Isa::Scalar)] {
        let got = pieced_logit_bits(&model, &CpuBackend::with_options(threads, isa), vocab);
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
