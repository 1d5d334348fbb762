//! A bounded fuzz harness over everything that reads files a user downloads: the config
//! parser (`ModelConfig::from_json_str`), the safetensors / shard-index loader
//! (`Model::load`), GGUF files with their metadata-built tokenizers
//! (`Model::load_with_tokenizer`), the tokenizer wrapper (`Tokenizer`) and saved states
//! (`state_file`: `chat --resume` files and the prefix cache's directory, resumed by a chat
//! or a session on the CPU reference). For any input: no panic, no hang,
//! no allocation above a budget; when a config is accepted, every size derived from it
//! computes exactly (no wrap) and fits in the `u32` the kernels take it as.
//!
//! Inputs are real files (the fixtures, the embedded model's tokenizer, the config formats in
//! the wild) mutated structurally (huge or wrong-typed values, duplicate keys, long layer
//! patterns, bad shapes and offsets, shard paths leaving the directory) and byte by byte.
//!
//! Each target runs in a child process of this binary, so an aborting case (an allocation
//! over the hard limit aborts the process; a hang is cut by a watchdog) fails that target
//! alone, with the case that did it. Environment:
//! - `MAMBA2_FUZZ_SCALE=10`: ten times the cases (the default runs in well under a minute
//!   in release on two cores, about 20 s when nothing fails);
//! - `MAMBA2_FUZZ_SEED=N`: another fixed seed (the default is fixed, so CI is repeatable);
//! - `MAMBA2_FUZZ_COLLECT=1`: record every distinct failure (printed as found and at the
//!   end, run with `--nocapture`) instead of stopping at the first, shrunk one;
//! - `MAMBA2_FUZZ_SLOW=1`: print every case slower than 100 ms;
//! - `MAMBA2_FUZZ_IGNORE=a,b`: pass over failures whose kind contains `a` or `b` (say, a
//!   known upstream panic's `file.rs:line`), to shrink the next one.
//!
//! Budgets: 256 MiB peak allocation per case (counted per thread by the global allocator
//! below), 5 s per case in release (20 s in debug), 60 s before the watchdog calls it a hang.

mod config;
mod gguf;
mod safetensors;
mod shard_index;
mod special_files;
mod state_file;
mod tokenizer;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Once};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use mamba2_wgpu::config::BlockKind;
use mamba2_wgpu::{Model, ModelConfig, Tokenizer};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{RngSeed, TestCaseError, TestError, TestRunner};

// ---------------------------------------------------------------------------------------
// Allocation accounting
// ---------------------------------------------------------------------------------------

/// What one case may allocate at its peak (bytes live at once, beyond what was live before).
const BUDGET: usize = 256 << 20;
/// A request this large (or a case this far over) is refused: the process aborts, after
/// printing the case. Stays well inside what a shared 2-core CI machine can hand out.
const HARD_LIMIT: usize = 1 << 30;

/// `System`, counting per thread the bytes live and their peak. Per thread, because the
/// test harness runs targets side by side; a case runs on one thread.
struct Counting;

#[global_allocator]
static ALLOC: Counting = Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
    static BASE: Cell<isize> = const { Cell::new(0) };
    /// Inside a case: enforce the hard limit.
    static ARMED: Cell<bool> = const { Cell::new(false) };
    /// The running case, printed when it is aborted.
    static CASE: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    static IN_CASE: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The running case's number within its target (from 1).
    static CASE_NO: Cell<usize> = const { Cell::new(0) };
}

/// Counts `size` more bytes; false refuses the request.
fn grow(size: usize) -> bool {
    let Ok(now) = LIVE.try_with(|live| {
        let now = live.get().saturating_add(size as isize);
        live.set(now);
        now
    }) else {
        return true;
    };
    let _ = PEAK.try_with(|p| {
        if now > p.get() {
            p.set(now)
        }
    });
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let over = now - BASE.try_with(Cell::get).unwrap_or(0);
        if size > HARD_LIMIT || over > HARD_LIMIT as isize {
            let _ = ARMED.try_with(|a| a.set(false));
            report_refusal(size, over);
            return false;
        }
    }
    true
}

fn shrink(size: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get() - size as isize));
}

/// Printed just before the process aborts on a refused allocation.
fn report_refusal(size: usize, live: isize) {
    let mut err = std::io::stderr();
    let no = CASE_NO.try_with(Cell::get).unwrap_or(0);
    let _ = writeln!(
        err,
        "\nFUZZ: refusing an allocation of {size} bytes ({live} bytes live in this case; hard \
         limit {HARD_LIMIT}); the process aborts (case #{no}). The case was:"
    );
    let _ = CASE.try_with(|c| {
        if let Ok(c) = c.try_borrow()
            && let Some(c) = c.as_ref()
        {
            let _ = writeln!(err, "{c}");
        }
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old {
            if !grow(new_size - old) {
                return std::ptr::null_mut();
            }
        } else {
            shrink(old - new_size);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

// ---------------------------------------------------------------------------------------
// Running one case: panics, the allocation budget, time
// ---------------------------------------------------------------------------------------

/// A case slower than this fails (a sign of unbounded work); one this slow is a hang: the
/// watchdog prints it and exits. The release limit leaves room for one known upstream
/// super-linear path: tokenizers 0.23 splits around an added token `" "` with lstrip/rstrip
/// in time quadratic in a run of spaces (about 24 s for 50 KB under this harness's counting
/// allocator, 31 s once in CI with the twelve targets sharing two cores) — slow, finite, and
/// not ours to fix. The limit is wall time, so it leaves room for a loaded machine.
const SLOW: Duration = Duration::from_secs(if cfg!(debug_assertions) { 50 } else { 45 });
const HANG: Duration = Duration::from_secs(60);

/// A failed property: `kind` groups failures with one cause (collect mode), `detail` says
/// what happened.
#[derive(Debug, Clone)]
struct Failure {
    kind: String,
    detail: String,
}

fn fail(kind: impl Into<String>, detail: impl Into<String>) -> Failure {
    Failure {
        kind: kind.into(),
        detail: detail.into(),
    }
}

type Check = Result<(), Failure>;

/// The running cases: thread, start, number, description.
type Watched = (ThreadId, Instant, usize, Arc<str>);

static WATCH: Mutex<Vec<Watched>> = Mutex::new(Vec::new());

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if IN_CASE.with(Cell::get) {
                let payload = info.payload();
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(non-string payload)".into());
                let at = info
                    .location()
                    .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
                    .unwrap_or_default();
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{at}\t{msg}")));
            } else {
                default(info)
            }
        }));
        thread::spawn(|| {
            loop {
                thread::sleep(Duration::from_millis(250));
                let watch = WATCH.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((_, since, no, desc)) =
                    watch.iter().find(|(_, t, ..)| t.elapsed() > HANG)
                {
                    eprintln!(
                        "\nFUZZ: a case has run for {:.0?} (a hang); exiting (case #{no}). The \
                         case was:\n{desc}",
                        since.elapsed()
                    );
                    std::process::exit(3);
                }
            }
        });
    });
}

/// Runs `body` as one case: panics are caught (with their location), the peak allocation
/// is held to the budget, the time to `SLOW`.
fn run_case(desc: &Arc<str>, body: impl FnOnce() -> Check) -> Check {
    setup();
    let me = thread::current().id();
    CASE.with(|c| *c.borrow_mut() = Some(desc.clone()));
    let no = CASE_NO.with(Cell::get);
    WATCH
        .lock()
        .unwrap()
        .push((me, Instant::now(), no, desc.clone()));
    let t0 = Instant::now();
    let base = LIVE.with(Cell::get);
    BASE.with(|b| b.set(base));
    PEAK.with(|p| p.set(base));
    IN_CASE.with(|c| c.set(true));
    ARMED.with(|a| a.set(true));
    let result = panic::catch_unwind(AssertUnwindSafe(body));
    ARMED.with(|a| a.set(false));
    IN_CASE.with(|c| c.set(false));
    let peak = (PEAK.with(Cell::get) - base).max(0) as usize;
    let elapsed = t0.elapsed();
    WATCH.lock().unwrap().retain(|(t, ..)| *t != me);
    match result {
        Err(_) => {
            let p = LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_default();
            let (at, msg) = p.split_once('\t').unwrap_or(("?", &p));
            // Group by location; numbers in messages vary from case to case.
            return Err(fail(
                format!("panic at {at}"),
                format!("panicked at {at}: {msg}"),
            ));
        }
        Ok(Err(f)) => return Err(f),
        Ok(Ok(())) => {}
    }
    if peak > BUDGET {
        return Err(fail(
            "allocation over budget",
            format!("peak allocation {peak} bytes > budget {BUDGET}"),
        ));
    }
    if elapsed > SLOW {
        return Err(fail(
            "slow case",
            format!("took {elapsed:.1?} (limit {SLOW:?})"),
        ));
    }
    Ok(())
}

fn collect_mode() -> bool {
    std::env::var_os("MAMBA2_FUZZ_COLLECT").is_some_and(|v| v != "0")
}

fn runner_config(cases: u32) -> ProptestConfig {
    let scale: f64 = std::env::var("MAMBA2_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let seed: u64 = std::env::var("MAMBA2_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6d61_6d62_6132);
    ProptestConfig {
        cases: ((cases as f64 * scale).ceil() as u32).max(1),
        // Nothing is written into the repository.
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        max_shrink_iters: 512,
        max_shrink_time: 30_000,
        ..ProptestConfig::default()
    }
}

/// Collect mode: failures by (kind), with how often and the shortest input.
type Found = BTreeMap<String, (usize, Failure, Arc<str>)>;

/// Runs `cases` inputs of `strategy`: `build` turns one into the case (outside the
/// accounting), `describe` prints it, `check` runs it.
fn fuzz<S, P>(
    target: &str,
    cases: u32,
    strategy: S,
    build: impl Fn(&S::Value) -> P,
    describe: impl Fn(&P) -> String,
    check: impl Fn(&P) -> Check,
) where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let collect = collect_mode();
    let found: Mutex<Found> = Mutex::new(BTreeMap::new());
    // Cases that aborted an earlier run of this target (collect mode, see `isolated`).
    let skip: Vec<usize> = std::env::var("MAMBA2_FUZZ_SKIP")
        .unwrap_or_default()
        .split(',')
        .filter_map(|n| n.parse().ok())
        .collect();
    // Failures to pass over, by a piece of their kind (e.g. a known upstream panic's file).
    let ignore: Vec<String> = std::env::var("MAMBA2_FUZZ_IGNORE")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let slow_report = std::env::var_os("MAMBA2_FUZZ_SLOW").is_some();
    let counter = AtomicUsize::new(0);
    let mut runner = TestRunner::new(runner_config(cases));
    let result = runner.run(&strategy, |input| {
        let no = counter.fetch_add(1, Ordering::Relaxed) + 1;
        CASE_NO.with(|c| c.set(no));
        if skip.contains(&no) {
            return Ok(());
        }
        let case = build(&input);
        let desc: Arc<str> = clip(&describe(&case), 6000).into();
        let t0 = Instant::now();
        let outcome = run_case(&desc, || check(&case));
        if slow_report && t0.elapsed() > Duration::from_millis(100) {
            eprintln!(
                "FUZZ SLOW [{target}] case #{no}: {:.2?}: {}",
                t0.elapsed(),
                clip(&desc, 300)
            );
        }
        match outcome {
            Ok(()) => Ok(()),
            Err(f) if ignore.iter().any(|i| f.kind.contains(i.as_str())) => Ok(()),
            Err(f) if collect => {
                let mut found = found.lock().unwrap();
                let entry = found
                    .entry(f.kind.clone())
                    .or_insert_with(|| (0, f.clone(), desc.clone()));
                if entry.0 == 0 {
                    eprintln!(
                        "FUZZ FOUND [{target}] {}\n  {}\n  input: {desc}\n",
                        f.kind, f.detail
                    );
                }
                entry.0 += 1;
                if desc.len() < entry.2.len() {
                    entry.1 = f;
                    entry.2 = desc;
                }
                Ok(())
            }
            Err(f) => Err(TestCaseError::fail(format!("{}\n  {}", f.kind, f.detail))),
        }
    });
    if collect {
        let found = found.into_inner().unwrap();
        eprintln!("FUZZ SUMMARY [{target}]: {} distinct failures", found.len());
        for (kind, (n, f, desc)) in &found {
            eprintln!("- {kind} ({n}×)\n  {}\n  shortest input: {desc}", f.detail);
        }
    }
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, input)) => {
            let desc = clip(&describe(&build(&input)), 20_000);
            panic!("{target}: {reason}\nminimal failing input:\n{desc}\n(generated from {input:?})")
        }
        Err(TestError::Abort(reason)) => panic!("{target}: aborted: {reason}"),
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &s[..end], s.len())
}

/// Runs a target in a child process of this binary (so an abort or a hang fails the target
/// with its case instead of taking the other targets down), or the target itself when this
/// is that child.
fn isolated(name: &str, body: fn()) {
    if std::env::var("MAMBA2_FUZZ_CHILD").as_deref() == Ok(name) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let run = |skip: &[usize]| {
        let skip: Vec<String> = skip.iter().map(|n| n.to_string()).collect();
        let out = std::process::Command::new(&exe)
            .args([name, "--exact", "--nocapture", "--test-threads", "1"])
            .env("MAMBA2_FUZZ_CHILD", name)
            .env("MAMBA2_FUZZ_SKIP", skip.join(","))
            .output()
            .expect("running the fuzz target in a child process");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status, text)
    };
    if collect_mode() {
        // Collect mode: a case that aborts the child (an allocation over the hard limit, a
        // hang) is reported, then skipped on a rerun, so the rest of the target still runs.
        let mut skip = Vec::new();
        loop {
            let (status, text) = run(&skip);
            eprintln!("{text}");
            let aborted = text
                .split("(case #")
                .nth(1)
                .and_then(|rest| rest.split(')').next())
                .and_then(|n| n.parse::<usize>().ok());
            match aborted {
                Some(no) if !status.success() && skip.len() < 100 && !skip.contains(&no) => {
                    skip.push(no);
                }
                _ => {
                    if !skip.is_empty() {
                        eprintln!("FUZZ [{name}]: cases that aborted the process: {skip:?}");
                    }
                    assert!(
                        status.success() || !skip.is_empty(),
                        "fuzz target `{name}` failed"
                    );
                    return;
                }
            }
        }
    }
    let (status, text) = run(&[]);
    if !status.success() {
        eprintln!("{text}");
    }
    assert!(
        status.success(),
        "fuzz target `{name}` failed ({status}); its output is above"
    );
    assert!(
        text.contains("1 passed"),
        "fuzz target `{name}` did not run in the child:\n{text}"
    );
}

// ---------------------------------------------------------------------------------------
// Mutations shared by every target
// ---------------------------------------------------------------------------------------

/// Byte-level edits of a text or file.
#[derive(Clone, Debug)]
enum ByteOp {
    Flip(Index, u8),
    Set(Index, u8),
    Insert(Index, usize),
    Delete(Index, u8),
    Dup(Index, u8),
    Truncate(Index),
}

/// Fragments inserted by `ByteOp::Insert`.
const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    "\"",
    ",",
    ":",
    "\\",
    "0",
    "-",
    "e",
    ".",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "18446744073709551616",
    "-9223372036854775809",
    "\\u0000",
    "\\ud800",
    "\u{feff}",
    "\u{0}",
    "é",
    "null",
    "true",
    "\"\":1,",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
];

fn byte_op() -> impl Strategy<Value = ByteOp> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| ByteOp::Flip(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| ByteOp::Set(i, b)),
        (any::<Index>(), 0..TOKENS.len()).prop_map(|(i, t)| ByteOp::Insert(i, t)),
        (any::<Index>(), 1u8..16).prop_map(|(i, n)| ByteOp::Delete(i, n)),
        (any::<Index>(), 1u8..64).prop_map(|(i, n)| ByteOp::Dup(i, n)),
        any::<Index>().prop_map(ByteOp::Truncate),
    ]
}

fn apply_bytes(mut v: Vec<u8>, ops: &[ByteOp]) -> Vec<u8> {
    for op in ops {
        let len = v.len();
        let at = |i: &Index| if len == 0 { 0 } else { i.index(len) };
        match op {
            ByteOp::Flip(i, b) if len > 0 => v[at(i)] ^= 1 << b,
            ByteOp::Set(i, b) if len > 0 => v[at(i)] = *b,
            ByteOp::Insert(i, t) => {
                let p = at(i);
                v.splice(p..p, TOKENS[*t].bytes());
            }
            ByteOp::Delete(i, n) if len > 0 => {
                let p = at(i);
                v.drain(p..(p + *n as usize).min(len));
            }
            ByteOp::Dup(i, n) if len > 0 => {
                let p = at(i);
                let piece = v[p..(p + *n as usize).min(len)].to_vec();
                v.splice(p..p, piece);
            }
            ByteOp::Truncate(i) => v.truncate(at(i)),
            _ => {}
        }
    }
    v
}

fn bytes_to_text(v: Vec<u8>) -> String {
    String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn manifest(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> Vec<u8> {
    std::fs::read(manifest(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// A fresh scratch directory per case, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mamba2-fuzz-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------
// The targets (each in its own child process; see `isolated`)
// ---------------------------------------------------------------------------------------

#[test]
fn config_values() {
    isolated("config_values", config::fuzz_config_values);
}

#[test]
fn config_patterns() {
    isolated("config_patterns", config::fuzz_config_patterns);
}

#[test]
fn config_bytes() {
    isolated("config_bytes", config::fuzz_config_bytes);
}

#[test]
fn safetensors_header() {
    isolated("safetensors_header", safetensors::fuzz_safetensors_header);
}

#[test]
fn safetensors_bytes() {
    isolated("safetensors_bytes", safetensors::fuzz_safetensors_bytes);
}

#[test]
fn shard_index() {
    isolated("shard_index", shard_index::fuzz_shard_index);
}

#[test]
fn loader_config() {
    isolated("loader_config", shard_index::fuzz_loader_config);
}

#[test]
fn loader_special_files() {
    isolated("loader_special_files", special_files::special_files);
}

#[test]
fn gguf_metadata() {
    isolated("gguf_metadata", gguf::fuzz_gguf_metadata);
}

#[test]
fn gguf_bytes() {
    isolated("gguf_bytes", gguf::fuzz_gguf_bytes);
}

#[test]
fn tokenizer_embedded() {
    isolated("tokenizer_embedded", tokenizer::fuzz_tokenizer_embedded);
}

#[test]
fn tokenizer_json() {
    isolated("tokenizer_json", tokenizer::fuzz_tokenizer_json);
}

#[test]
fn tokenizer_big() {
    isolated("tokenizer_big", tokenizer::fuzz_tokenizer_big);
}

#[test]
fn tokenizer_config() {
    isolated("tokenizer_config", tokenizer::fuzz_tokenizer_config);
}

#[test]
fn state_files() {
    isolated("state_files", state_file::fuzz_state_file);
}
