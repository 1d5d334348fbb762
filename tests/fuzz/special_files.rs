use super::*;
use crate::safetensors::{FIXTURE, check_load, entries, header_text, safetensors_file};
use crate::tokenizer::BIG_TOKENIZER;

/// Files that are not regular files where the loader expects one: each is refused (or
/// skipped) quickly — a FIFO must not block the load.
pub(crate) fn special_files() {
    #[derive(Debug, Clone, Copy)]
    enum Kind {
        Fifo,
        Dir,
        DevZero,
        DevUrandom,
        SelfLoop,
        OutsideCopy,
        Empty,
    }
    let have_mkfifo = std::process::Command::new("mkfifo")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let make = |path: &Path, kind: Kind, other: &Path| {
        let _ = std::fs::remove_file(path);
        match kind {
            Kind::Fifo => {
                let ok = std::process::Command::new("mkfifo")
                    .arg(path)
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "mkfifo {}", path.display());
            }
            Kind::Dir => std::fs::create_dir_all(path).unwrap(),
            Kind::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
            Kind::DevUrandom => std::os::unix::fs::symlink("/dev/urandom", path).unwrap(),
            Kind::SelfLoop => std::os::unix::fs::symlink(path, path).unwrap(),
            Kind::OutsideCopy => std::os::unix::fs::symlink(other, path).unwrap(),
            Kind::Empty => std::fs::write(path, b"").unwrap(),
        }
    };
    let kinds = [
        Kind::Fifo,
        Kind::Dir,
        Kind::DevZero,
        Kind::DevUrandom,
        Kind::SelfLoop,
        Kind::OutsideCopy,
        Kind::Empty,
    ];
    // (file, through an index naming it)
    let places = [
        ("model.safetensors", false),
        ("pipe.safetensors", true),
        ("config.json", false),
        ("model.safetensors.index.json", false),
        ("tokenizer.json", false),
        ("tokenizer_config.json", false),
    ];
    let mut failures = Vec::new();
    for (place, via_index) in places {
        for kind in kinds {
            if matches!(kind, Kind::Fifo) && !have_mkfifo {
                continue;
            }
            let desc: Arc<str> = format!(
                "{place} is {kind:?}{}",
                if via_index {
                    " (named by the index)"
                } else {
                    ""
                }
            )
            .into();
            let scratch = Scratch::new();
            let dir = scratch.0.join("model");
            let other = scratch.0.join("other");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::create_dir_all(&other).unwrap();
            let fx = &FIXTURE[0];
            let (es, data) = entries(&fx.tensors, fx.metadata.as_deref());
            let st = safetensors_file(header_text(&es).as_bytes(), None, &data);
            std::fs::write(other.join("model.safetensors"), &st).unwrap();
            std::fs::write(other.join("tokenizer.json"), &*BIG_TOKENIZER).unwrap();
            std::fs::write(other.join("tokenizer_config.json"), "{}").unwrap();
            std::fs::write(other.join("config.json"), &fx.config).unwrap();
            std::fs::write(
                other.join("model.safetensors.index.json"),
                "{\"weight_map\":{}}",
            )
            .unwrap();
            std::fs::write(dir.join("config.json"), &fx.config).unwrap();
            if place != "model.safetensors" {
                std::fs::write(dir.join("model.safetensors"), &st).unwrap();
            }
            if via_index {
                let map: serde_json::Map<String, serde_json::Value> = fx
                    .tensors
                    .iter()
                    .map(|t| (t.name.clone(), place.into()))
                    .collect();
                std::fs::write(
                    dir.join("model.safetensors.index.json"),
                    serde_json::json!({ "weight_map": map }).to_string(),
                )
                .unwrap();
            }
            make(&dir.join(place), kind, &other.join(place));
            // A FIFO nobody writes to blocks its reader: open its writing end after a while
            // so a blocked load comes back (and fails the time limit) instead of hanging.
            let done = Arc::new(AtomicBool::new(false));
            let unblock = matches!(kind, Kind::Fifo).then(|| {
                let (fifo, done) = (dir.join(place), done.clone());
                thread::spawn(move || {
                    use std::os::unix::fs::OpenOptionsExt;
                    let t0 = Instant::now();
                    while !done.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(10) {
                        thread::sleep(Duration::from_millis(50));
                        if t0.elapsed() > Duration::from_millis(1500) {
                            // O_NONBLOCK: fails (ENXIO) while no reader has it open.
                            let _ = std::fs::OpenOptions::new()
                                .write(true)
                                .custom_flags(0o4000)
                                .open(&fifo);
                        }
                    }
                })
            });
            let t0 = Instant::now();
            let r = run_case(&desc, || {
                if place.starts_with("tokenizer") {
                    let _ = Tokenizer::from_dir(&dir);
                    return Ok(());
                }
                // A symlink out of the directory is how the HF cache lays models out: it
                // loads. An index that is not a regular file is not an index (the single
                // file loads instead). Anything else is refused.
                let must_fail = match kind {
                    _ if place == "model.safetensors.index.json" => None,
                    Kind::OutsideCopy => None,
                    _ => Some((
                        "a special file read as a regular one",
                        "a weights or config file is not a regular file",
                    )),
                };
                check_load(&dir, must_fail, None)
            });
            let elapsed = t0.elapsed();
            done.store(true, Ordering::Relaxed);
            if let Some(h) = unblock {
                let _ = h.join();
            }
            let r = r.and_then(|()| {
                if elapsed > Duration::from_secs(1) {
                    Err(fail(
                        "[blocked] a special file blocked the load",
                        format!("took {elapsed:.1?}"),
                    ))
                } else {
                    Ok(())
                }
            });
            if let Err(f) = r {
                failures.push(format!("{desc}: {}\n  {}", f.kind, f.detail));
            }
        }
    }
    if collect_mode() {
        for f in &failures {
            eprintln!("FUZZ FOUND [special_files] {f}\n");
        }
    } else {
        assert!(
            failures.is_empty(),
            "special files:\n{}",
            failures.join("\n")
        );
    }
}
