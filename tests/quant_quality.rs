//! What each weight format costs in quality: held-out perplexity of the embedded model with
//! its big matrices rounded through f16, q8_0, q6_k, q4_k and q4_0, on the CPU reference
//! (which runs the k-quants' zero-padded superblocks on the model's 320- and 640-wide rows;
//! the GPU engine, like llama.cpp, falls back to a 32-value block type there). The GPU
//! kernels are held to the CPU reference on the same rounded weights elsewhere (gguf_mamba2.rs,
//! gpu_kernels.rs), so these figures are the formats' own.

mod common;

use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::perplexity::perplexity;
use mamba2_wgpu::reference::CpuModel;
use mamba2_wgpu::{CpuBackend, Session};

/// Tokens scored: the first 16 windows of 256 of tests/data/heldout.txt (text the
/// embedded model never trained on).
const TOKENS: usize = 16 * 256;

#[test]
fn four_bit_formats_stay_within_5_percent_of_f16_perplexity() {
    let (model, tokenizer) = mamba2_wgpu::assets::embedded().unwrap();
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/heldout.txt"),
    )
    .unwrap();
    let tokens = tokenizer.encode_with(&text, false).unwrap();
    assert!(
        tokens.len() >= TOKENS,
        "heldout.txt: {} tokens",
        tokens.len()
    );
    let tokens = &tokens[..TOKENS];
    let ppl = |format: WeightFormat| {
        let m = common::rounded(&model, |_| format);
        let cpu = CpuModel::<f32>::new(&m.config, &m.weights).unwrap();
        let mut s = Session::new(Box::new(CpuBackend::new(cpu)));
        perplexity(&mut s, tokens, 256, |_, _| {}).unwrap().ppl
    };
    let f16 = ppl(WeightFormat::F16);
    eprintln!("f16: perplexity {f16:.4} over {TOKENS} tokens");
    // (format, the most its perplexity may exceed f16's by)
    for (format, bound) in [
        (WeightFormat::Q8_0, 0.01),
        (WeightFormat::Q6_K, 0.01),
        (WeightFormat::Q5_K, 0.02),
        (WeightFormat::Q5_1, 0.02),
        (WeightFormat::Q5_0, 0.02),
        (WeightFormat::Q4_K, 0.05),
        (WeightFormat::Q4_1, 0.05),
        (WeightFormat::Q4_0, 0.05),
    ] {
        let p = ppl(format);
        let rel = p / f16 - 1.0;
        eprintln!(
            "{}: perplexity {p:.4} ({:+.2} % vs f16)",
            format.name(),
            rel * 100.0
        );
        assert!(
            rel <= bound,
            "{}: perplexity {p:.4} is {:.2} % above f16's {f16:.4} (bound {:.0} %)",
            format.name(),
            rel * 100.0,
            bound * 100.0
        );
    }
}
