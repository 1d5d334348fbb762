//! The prefix cache's tiers. The host tier in f16 (`--cache-dtype f16`): entries hold half
//! the bytes of f32 ones, and what comes back — from memory or from the file a spill wrote —
//! is the state rounded to f16, value for value; the budgets' least-recently-used order. The
//! CPU reference is the backend there (its snapshots live in host memory, so every entry
//! takes the host tier). The device tier takes a GPU backend: its snapshots move down to
//! host memory and files, and come back exact.

mod common;

use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::synthetic::{tiny_config, tiny_moe};
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::reference::CpuModel;
use mamba2_wgpu::session::{Backend, CpuBackend};
use mamba2_wgpu::state::State;
use mamba2_wgpu::state_file::{StateDtype, StateKey};

/// A hybrid with Mamba2, attention (KV rows in the state) and MoE blocks.
fn model() -> Model {
    Model::synthetic(tiny_moe("ME*E-M", false), 5)
}

fn backend(model: &Model) -> CpuBackend {
    CpuBackend::new(CpuModel::<f32>::new(&model.config, &model.weights).unwrap())
}

fn cache(
    model: &Model,
    dtype: StateDtype,
    host_bytes: u64,
    dir: Option<&std::path::Path>,
) -> PrefixCache {
    open(
        model,
        CacheConfig {
            device_bytes: 0,
            host_bytes,
            dir: dir.map(std::path::Path::to_path_buf),
            dtype,
            ..Default::default()
        },
    )
}

/// A cache of `model`'s states with budgets `cfg`.
fn open(model: &Model, cfg: CacheConfig) -> PrefixCache {
    let key = StateKey {
        model: model.fingerprint(),
        format: "f32".into(),
        blocks: model.config.pattern(),
    };
    PrefixCache::open(key, &model.config, cfg, &mut |_| {}).unwrap()
}

const PROMPT: [u32; 9] = [3, 1, 4, 1, 5, 9, 2, 6, 5];

/// The backend's state after feeding `PROMPT`.
fn fed(model: &Model) -> (CpuBackend, State<f32>) {
    let mut b = backend(model);
    b.prefill_logits(&PROMPT).unwrap();
    let s = b.state().clone();
    assert_eq!(s.len, PROMPT.len());
    (b, s)
}

fn to_f16(s: &State<f32>) -> State<f32> {
    s.map(|x| half::f16::from_f32(x).to_f32())
}

#[test]
fn f16_host_entries_take_half_the_bytes_and_restore_rounded() {
    let model = model();
    let (mut b, state) = fed(&model);
    assert_ne!(
        to_f16(&state),
        state,
        "the state has values f16 cannot hold"
    );
    let mut c32 = cache(&model, StateDtype::F32, 1 << 30, None);
    let mut c16 = cache(&model, StateDtype::F16, 1 << 30, None);
    c32.insert(&PROMPT, &mut b).unwrap();
    c16.insert(&PROMPT, &mut b).unwrap();
    let (h32, h16) = (c32.stats().bytes[1], c16.stats().bytes[1]);
    assert_eq!(h32, state.bytes(4) as u64);
    assert_eq!(h16 * 2, h32, "an f16 entry holds half the bytes");
    for (cache, want) in [(&mut c32, state.clone()), (&mut c16, to_f16(&state))] {
        let mut fresh = backend(&model);
        let hit = cache.resume(&PROMPT, PROMPT.len(), &mut fresh, &mut |n| panic!("{n}"));
        assert_eq!(hit, PROMPT.len());
        assert_eq!(fresh.state(), &want);
    }
}

#[test]
fn an_f16_entry_spilled_to_disk_comes_back_the_same() {
    let model = model();
    let (mut b, state) = fed(&model);
    let dir = std::env::temp_dir().join(format!("mamba2-prefix-f16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A host budget below one entry: the entry goes straight to its file.
    let mut c = cache(&model, StateDtype::F16, 1, Some(&dir));
    c.insert(&PROMPT, &mut b).unwrap();
    let s = c.stats();
    assert_eq!((s.entries, s.bytes[1]), ([0, 0, 1], 0), "on disk only");
    let mut fresh = backend(&model);
    let hit = c.resume(&PROMPT, PROMPT.len(), &mut fresh, &mut |n| panic!("{n}"));
    assert_eq!(hit, PROMPT.len());
    assert_eq!(fresh.state(), &to_f16(&state));
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The budgets and their order (a pure Mamba2 model, so every entry holds the same bytes):
/// a full host tier drops its least recently used entry without a directory, and spills it
/// to a file with one; a full disk deletes the least recently used file.
#[test]
fn full_tiers_let_go_of_the_least_recently_used_entry() {
    let model = Model::synthetic(tiny_config(2, 16), 3);
    let prompts: [&[u32]; 3] = [&[3, 1, 4], &[1, 5, 9, 2], &[6, 5]];
    let feed = |p: &[u32]| {
        let mut b = backend(&model);
        b.prefill_logits(p).unwrap();
        b
    };
    let hit = |c: &mut PrefixCache, p: &[u32]| {
        let mut fresh = backend(&model);
        c.resume(p, p.len(), &mut fresh, &mut |n| panic!("{n}"))
    };
    let entry = {
        let mut c = cache(&model, StateDtype::F32, 1 << 30, None);
        c.insert(prompts[0], &mut feed(prompts[0])).unwrap();
        c.stats().bytes[1]
    };
    assert!(entry > 0);

    // Room for two in memory, no directory: the third drops the least recently used,
    // which a touch made the second one, not the first.
    let mut c = cache(&model, StateDtype::F32, 2 * entry, None);
    c.insert(prompts[0], &mut feed(prompts[0])).unwrap();
    c.insert(prompts[1], &mut feed(prompts[1])).unwrap();
    assert!(c.touch(prompts[0]));
    c.insert(prompts[2], &mut feed(prompts[2])).unwrap();
    assert_eq!(c.stats().entries, [0, 2, 0]);
    assert_eq!(
        hit(&mut c, prompts[1]),
        0,
        "the least recently used was dropped"
    );
    assert_eq!(hit(&mut c, prompts[0]), prompts[0].len());
    assert_eq!(hit(&mut c, prompts[2]), prompts[2].len());

    // Room for one in memory and about one file: each new entry spills the one before
    // it, and the second spill deletes the older file.
    let dir = std::env::temp_dir().join(format!("mamba2-prefix-lru-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = {
        let mut c = cache(&model, StateDtype::F32, 1, Some(&dir));
        c.insert(prompts[0], &mut feed(prompts[0])).unwrap();
        c.stats().bytes[2]
    };
    let _ = std::fs::remove_dir_all(&dir);
    let disk = file + file / 2;
    // Room for one entry in memory, `disk` bytes of files.
    let tiers = |disk: u64| {
        open(
            &model,
            CacheConfig {
                device_bytes: 0,
                host_bytes: entry,
                dir: Some(dir.clone()),
                disk_bytes: disk,
                ..Default::default()
            },
        )
    };
    let mut c = tiers(disk);
    for p in prompts {
        c.insert(p, &mut feed(p)).unwrap();
    }
    let s = c.stats();
    assert_eq!(s.entries, [0, 1, 1], "one in memory, one on disk");
    assert!(
        s.bytes[2] > 0 && s.bytes[2] <= disk,
        "{} bytes on disk",
        s.bytes[2]
    );
    let files = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|f| {
            let p = f.as_ref().unwrap().path();
            p.extension().is_some_and(|x| x == "safetensors")
        })
        .count();
    assert_eq!(files, 1, "the older file was deleted");
    assert_eq!(hit(&mut c, prompts[0]), 0, "the oldest entry is gone");
    assert_eq!(
        hit(&mut c, prompts[2]),
        prompts[2].len(),
        "the newest is in memory"
    );
    assert_eq!(
        hit(&mut c, prompts[1]),
        prompts[1].len(),
        "the middle one is on disk"
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);

    // A disk budget of 0 with a directory: a spilled entry is dropped, not written to be
    // deleted, and shutdown writes nothing either.
    let mut c = tiers(0);
    for p in prompts {
        c.insert(p, &mut feed(p)).unwrap();
    }
    assert_eq!(c.stats().entries, [0, 1, 0]);
    assert_eq!(c.persist(&mut backend(&model)).unwrap(), 0);
    let files = std::fs::read_dir(&dir).unwrap().count();
    // (The directory's lock file is all there is.)
    assert!(files <= 1, "{files} files");
    assert_eq!(
        hit(&mut c, prompts[2]),
        prompts[2].len(),
        "the newest is in memory"
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The device tier (a GPU backend's snapshots, here of a hybrid whose state holds KV rows):
/// past its budget the least recently used entry moves to host memory, and past that to a
/// file. A prompt resumed from any of the three tiers continues exactly as the run that made
/// the entry: the same logits for the next tokens, bit for bit.
#[test]
fn device_snapshots_move_down_the_tiers_and_resume_exactly() {
    use mamba2_wgpu::gpu::engine::EngineOptions;
    use mamba2_wgpu::gpu::state_store::KvFormat;
    let model = model();
    let opts = EngineOptions {
        format: mamba2_wgpu::WeightFormat::F32,
        context: Some(64),
        kv: KvFormat::F32,
        ..Default::default()
    };
    let Some(mut b) = common::gguf::gpu_with(&model, opts) else {
        return;
    };
    let prompts: [&[u32]; 3] = [&[3, 1, 4, 1, 5], &[9, 2, 6], &[5, 3, 5, 8, 9, 7]];
    let rest: &[u32] = &[2, 3, 8, 4];
    let run = |b: &mut mamba2_wgpu::gpu::backend::GpuBackend, p: &[u32]| {
        b.reset().unwrap();
        b.prefill_logits(p).unwrap();
    };
    // What each prompt's own run gives for `rest`: what a resume must give.
    let want: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .map(|p| {
            run(&mut b, p);
            b.prefill_logits(rest).unwrap()
        })
        .collect();
    // Each prompt's snapshot and host state, in bytes (the KV rows grow with the prompt).
    let sizes: Vec<(u64, u64)> = prompts
        .iter()
        .map(|p| {
            let mut c = open(
                &model,
                CacheConfig {
                    device_bytes: 0,
                    ..Default::default()
                },
            );
            run(&mut b, p);
            c.insert(p, &mut b).unwrap();
            (b.snapshot_device_bytes(), c.stats().bytes[1])
        })
        .collect();
    // Room for the last (longest) prompt's snapshot on the device and its state in host
    // memory, and not for two of them.
    let (snap, entry) = sizes[2];
    assert!(snap > 0, "a GPU backend's snapshots live on the device");
    assert!(
        sizes.iter().all(|&(d, h)| d <= snap && h <= entry)
            && sizes[0].0 + sizes[1].0 > snap
            && sizes[0].1 + sizes[1].1 > entry,
        "bytes (device, host) per prompt: {sizes:?}"
    );
    let dir = std::env::temp_dir().join(format!("mamba2-prefix-device-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Room for one snapshot on the device and one state in host memory.
    let mut c = open(
        &model,
        CacheConfig {
            device_bytes: snap,
            host_bytes: entry,
            dir: Some(dir.clone()),
            every: 0,
            ..Default::default()
        },
    );
    for p in prompts {
        run(&mut b, p);
        c.insert(p, &mut b).unwrap();
    }
    assert_eq!(
        c.stats().entries,
        [1, 1, 1],
        "the newest on the device, the one before in host memory, the oldest in a file"
    );
    // Newest first, so that each entry is still in its tier when it is read (a file's
    // entry then comes back to host memory).
    for (i, tier) in [(2, "device"), (1, "host"), (0, "disk")] {
        run(&mut b, &[7, 7, 7]);
        let p = prompts[i];
        let got = c.resume(p, p.len(), &mut b, &mut |n| panic!("{n}"));
        assert_eq!(got, p.len(), "prompt {i} from the {tier} tier");
        let logits = b.prefill_logits(rest).unwrap();
        for (t, (g, w)) in logits.iter().zip(&want[i]).enumerate() {
            assert_eq!(
                common::bits(g),
                common::bits(w),
                "prompt {i} resumed from the {tier} tier: logits of token {t} after it"
            );
        }
    }
    assert_eq!(c.stats().hits, 3);
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cache directory is read at startup whatever lies in it: a FIFO named like a state
/// file (whose `open` would wait for a writer for ever) and a directory so named are
/// refused with a note naming them, and the cache opens.
#[test]
fn a_cache_directory_s_fifo_and_subdirectory_are_refused_not_waited_on() {
    let model = model();
    let dir = std::env::temp_dir().join(format!("mamba2-prefix-fifo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub.safetensors")).unwrap();
    let fifo = dir.join("pipe.safetensors");
    common::mkfifo(&fifo);
    let key = StateKey {
        model: model.fingerprint(),
        format: "f32".into(),
        blocks: model.config.pattern(),
    };
    let cfg = CacheConfig {
        device_bytes: 0,
        dir: Some(dir.clone()),
        ..Default::default()
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let config = model.config.clone();
    std::thread::spawn(move || {
        let mut notes = Vec::new();
        let c = PrefixCache::open(key, &config, cfg, &mut |n| notes.push(n));
        let _ = tx.send((c.map(|c| c.stats().refused_files), notes));
    });
    let (refused, notes) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the cache opens without waiting on the FIFO");
    assert_eq!(refused.unwrap(), 2, "{notes:?}");
    for name in ["pipe.safetensors", "sub.safetensors"] {
        assert!(
            notes
                .iter()
                .any(|n| n.contains(name) && n.contains("not a regular file")
                    || n.contains(name) && n.contains("directory")),
            "{name}: {notes:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A safetensors header whose tensors' offsets run to 2^64 − 8 (eight U8 tensors of 2^61 − 1
/// values end to end, over 8 bytes of data) is refused naming a tensor, as a saved state
/// (`chat --resume`) and as a file in a cache directory (`serve --cache-dir` reads every
/// one at startup). The safetensors crate adds those offsets without checking: a panic with
/// overflow checks on, before any field of ours was read.
#[test]
fn a_state_file_whose_offsets_overflow_is_refused_not_a_panic() {
    let model = model();
    let dir = common::Scratch::new("prefix-overflow");
    let n: u64 = (1 << 61) - 1;
    let tensors: Vec<String> = (0..8u64)
        .map(|i| {
            format!(
                "\"t{i}\":{{\"dtype\":\"U8\",\"shape\":[{n}],\"data_offsets\":[{},{}]}}",
                i * n,
                (i + 1) * n
            )
        })
        .collect();
    let header = format!("{{{}}}", tensors.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend([0u8; 8]);
    let file = dir.join("hostile.safetensors");
    std::fs::write(&file, &bytes).unwrap();
    let key = StateKey {
        model: model.fingerprint(),
        format: "f32".into(),
        blocks: model.config.pattern(),
    };
    let err = mamba2_wgpu::state_file::read_header(&file, &key)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("hostile.safetensors") && err.contains("t0") && err.contains("outside"),
        "{err}"
    );
    let mut notes = Vec::new();
    let c = PrefixCache::open(
        key,
        &model.config,
        CacheConfig {
            device_bytes: 0,
            dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
        &mut |n| notes.push(n),
    )
    .unwrap();
    assert_eq!(c.stats().refused_files, 1, "{notes:?}");
    assert!(
        notes.iter().any(|n| n.contains("hostile.safetensors")),
        "{notes:?}"
    );
}
