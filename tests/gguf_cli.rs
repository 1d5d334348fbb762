//! The `mamba2` binary on GGUF files: `info` and `generate` with the file's own tokenizer
//! (the ids the CPU reference gives), `--model DIR` holding one `.gguf` (two are refused),
//! `info` on a file whose tokenizer cannot be built, `info --chat-template`, and the text
//! commands on a file without tokenizer metadata.

mod common;

use std::path::Path;

use common::gguf::{dir, scratch, with_key};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};

#[test]
fn cli_runs_a_gguf_file_with_its_own_tokenizer() {
    let bin = env!("CARGO_BIN_EXE_mamba2");
    let file = dir().join("k256.q4_k.gguf");
    let out = std::process::Command::new(bin)
        .args(["info", "--model"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "format     GGUF mamba2 (llama.cpp)",
        "gguf       version 3, 20 tensors (f32 ×15, Q4_K ×4, Q6_K ×1)",
        "  mamba2.ssm.inner_size = 512",
        "tokenizer  256 tokens",
        "gpu        --dtype q4_k by default (Q4_K, Q6_K blocks go up as stored)",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    // Generation from text through the GGUF's byte-level vocabulary, on the CPU reference:
    // the same ids as the reference run directly on the tokens of the prompt.
    let out = std::process::Command::new(bin)
        .args(["generate", "--device", "cpu", "-n", "6", "--model"])
        .arg(&file)
        .arg("hi!\"")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (model, tok) = Model::load_with_tokenizer(&file).unwrap();
    let tok = tok.unwrap();
    let ids = tok.encode("hi!\"").unwrap();
    // `!"` is one token (the vocabulary's one merge); h and i are byte tokens.
    assert_eq!(ids, vec![71, 72, 255]);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let mut state = cpu.new_state();
    let mut logits = cpu
        .forward(&mut state, &ids, Scan::Sequential, Logits::Last)
        .unwrap();
    let mut text = String::from("hi!\"");
    for _ in 0..6 {
        let next = mamba2_wgpu::sampling::argmax(&logits[0]);
        text.push_str(&tok.decode(&[next]).unwrap());
        logits = cpu
            .forward(&mut state, &[next], Scan::Sequential, Logits::Last)
            .unwrap();
    }
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end(), text);
}

/// A copy of fixture `src` with `edit` applied, as `name`.gguf in a scratch directory.
fn edited(src: &str, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> common::ScratchFile {
    let mut bytes = std::fs::read(dir().join(src)).unwrap();
    edit(&mut bytes);
    let path = common::ScratchFile::within(scratch(name), &format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A GGUF string value's bytes.
fn gguf_str(s: &str) -> Vec<u8> {
    [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat()
}

fn mamba2(args: &[&str], model: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(args)
        .arg("--model")
        .arg(model)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `--model DIR` where DIR holds one `.gguf` runs that file (the same text as naming it);
/// with a second `.gguf` beside it, every command refuses the directory naming both.
#[test]
fn model_dir_holding_one_gguf_runs_it_and_two_are_refused() {
    let d = scratch("dir");
    let file = d.join("k256.q4_k.gguf");
    std::fs::copy(dir().join("k256.q4_k.gguf"), &file).unwrap();
    let generate = ["generate", "--device", "cpu", "-n", "5", "hi!"];
    let (by_dir, by_file) = (mamba2(&generate, &d), mamba2(&generate, &file));
    assert!(by_dir.status.success(), "{}", stderr(&by_dir));
    assert!(by_file.status.success(), "{}", stderr(&by_file));
    assert!(stdout(&by_dir).starts_with("hi!"), "{}", stdout(&by_dir));
    assert_eq!(stdout(&by_dir), stdout(&by_file));
    let info = mamba2(&["info"], &d);
    assert!(
        stdout(&info).contains("format     GGUF mamba2 (llama.cpp)"),
        "{}",
        stdout(&info)
    );
    std::fs::copy(dir().join("g1.f32.gguf"), d.join("g1.f32.gguf")).unwrap();
    for args in [&["info"][..], &generate[..]] {
        let out = mamba2(args, &d);
        assert!(!out.status.success(), "{args:?}");
        let e = stderr(&out);
        assert!(
            e.contains(&format!(
                "{}: holds 2 GGUF files (g1.f32.gguf, k256.q4_k.gguf): name one with --model",
                d.display()
            )),
            "{args:?}: {e}"
        );
    }
}

/// `mamba2 info` on a GGUF whose tokenizer cannot be built (an unknown
/// `tokenizer.ggml.pre`) still describes the whole file, the tokenizer's problem as a line.
#[test]
fn info_describes_a_gguf_whose_tokenizer_cannot_be_built() {
    let file = edited("k256.q4_k.gguf", "pre", |b| {
        let k = b"tokenizer.ggml.pre";
        let at = b.windows(k.len()).position(|w| w == k).unwrap() + k.len() + 4 + 8;
        assert_eq!(&b[at..at + 5], b"gpt-2");
        b[at..at + 5].copy_from_slice(b"qwen9");
    });
    let out = mamba2(&["info"], &file);
    let text = stdout(&out);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    for want in [
        "format     GGUF mamba2 (llama.cpp)",
        "tokenizer  cannot be built, so text commands refuse this model (use --prompt-ids): ",
        "metadata key `tokenizer.ggml.pre`: pre-tokenizer `qwen9` is not known",
        "gguf       version 3, 20 tensors (f32 ×15, Q4_K ×4, Q6_K ×1)",
        "  tokenizer.ggml.pre = \"qwen9\"",
        "gpu        --dtype q4_k by default",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
}

/// `mamba2 info --chat-template` prints a template longer than the description's summary
/// in full, as stored; a model without one is an error naming the key.
#[test]
fn info_prints_the_whole_chat_template() {
    let template = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>\n{% endif %}";
    let d = scratch("template");
    let file = d.join("t.gguf");
    let src = dir().join("k256.q4_k.gguf");
    std::fs::write(
        &file,
        with_key(&src, "tokenizer.chat_template", 8, &gguf_str(template)),
    )
    .unwrap();
    let out = mamba2(&["info", "--chat-template"], &file);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{template}\n"));
    let out = mamba2(&["info"], &file);
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "chat template yes ({} chars; `mamba2 info --chat-template` prints it)",
            template.chars().count()
        )),
        "{text}"
    );
    let out = mamba2(&["info", "--chat-template"], &src);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("has no chat template (no `tokenizer.chat_template` metadata key)"),
        "{}",
        stderr(&out)
    );
    // A template of another type (here a uint32) is an error naming the key, not "no
    // template" (which would make chat continue plain text without a word).
    let odd = d.join("odd.gguf");
    std::fs::write(
        &odd,
        with_key(&src, "tokenizer.chat_template", 4, &7u32.to_le_bytes()),
    )
    .unwrap();
    let out = mamba2(&["info"], &odd);
    let text = stdout(&out);
    assert!(
        text.contains("metadata key `tokenizer.chat_template`") && text.contains("not a string"),
        "{text}"
    );
}

/// A GGUF without tokenizer metadata: the commands that need text name the file and the
/// `tokenizer.ggml.*` keys it lacks (not a tokenizer.json it was never meant to have);
/// `info` says the same in its tokenizer line, and ids still run.
#[test]
fn text_commands_name_the_missing_gguf_tokenizer_keys() {
    let file = edited("k256.q4_k.gguf", "notok", |b| {
        for k in [&b"tokenizer.ggml.model"[..], b"tokenizer.ggml.tokens"] {
            let at = b.windows(k.len()).position(|w| w == k).unwrap();
            b[at + k.len() - 1] = b'X';
        }
    });
    let want = format!(
        "{} has no tokenizer: its metadata lacks `tokenizer.ggml.model` and \
         `tokenizer.ggml.tokens` and no tokenizer.json lies beside it",
        file.display()
    );
    let text = file.with_file_name("text.txt");
    std::fs::write(&text, "some text to score").unwrap();
    let text = text.to_str().unwrap();
    for (args, hint) in [
        (
            &["generate", "--device", "cpu", "hello"][..],
            "pass the prompt as --prompt-ids",
        ),
        (&["chat", "--device", "cpu"][..], "chat needs one"),
        (
            &["perplexity", "--device", "cpu", "--file", text][..],
            "perplexity scores text",
        ),
    ] {
        let out = mamba2(args, &file);
        assert!(!out.status.success(), "{args:?}");
        let e = stderr(&out);
        assert!(e.contains(&format!("{want}: {hint}")), "{args:?}: {e}");
    }
    let out = mamba2(&["info"], &file);
    assert!(
        stdout(&out).contains(&format!("tokenizer  none: {want} (use --prompt-ids)")),
        "{}",
        stdout(&out)
    );
    let out = mamba2(
        &[
            "generate",
            "--device",
            "cpu",
            "-n",
            "3",
            "--prompt-ids",
            "71,72",
        ],
        &file,
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `perplexity --model FILE.gguf` scores text through the GGUF's own tokenizer: the mean
/// NLL it prints equals the CPU reference's over the same windows of the same ids.
#[test]
fn perplexity_scores_text_through_a_gguf_file() {
    let file = dir().join("k256.q4_k.gguf");
    let text_file = common::ScratchFile::within(scratch("ppl"), "text.txt");
    let text = "the quick brown fox jumps over the lazy dog; \"hi!\" said the fox, twice.";
    std::fs::write(&text_file, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(["perplexity", "--device", "cpu", "--ctx", "32", "-f"])
        .arg(&text_file)
        .arg("--model")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let (model, tok) = Model::load_with_tokenizer(&file).unwrap();
    let ids = tok.unwrap().encode_with(text, false).unwrap();
    // The same windows scored by the library on the CPU reference over the same ids.
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let mut session = mamba2_wgpu::Session::new(Box::new(mamba2_wgpu::CpuBackend::new(cpu)));
    let want = mamba2_wgpu::perplexity::perplexity(&mut session, &ids, 32, |_, _| {}).unwrap();
    assert!(want.windows >= 2, "{} ids", ids.len());
    let printed = stdout(&out);
    let tail = format!(
        "nats over {} predicted tokens, {} windows of ≤ 32 tokens)",
        want.predicted, want.windows
    );
    assert!(printed.contains(&tail), "{tail} not in {printed}");
    let nll: f64 = printed
        .split("mean NLL ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no mean NLL in {printed}"));
    assert!(
        (nll - want.nll).abs() <= 1e-4,
        "mean NLL {nll}, the reference's {}",
        want.nll
    );
}
