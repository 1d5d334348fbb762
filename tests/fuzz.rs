//! A bounded fuzz harness over everything that reads files a user downloads: the config
//! parser (`ModelConfig::from_json_str`), the safetensors / shard-index loader
//! (`Model::load`) and the tokenizer wrapper (`Tokenizer`). For any input: no panic, no hang,
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
/// allocator) — slow, finite, and not ours to fix.
const SLOW: Duration = Duration::from_secs(if cfg!(debug_assertions) { 40 } else { 30 });
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
// The config parser
// ---------------------------------------------------------------------------------------

/// Real configs: the fixtures, the embedded model, and the formats of src/config.rs's tests.
static CONFIGS: LazyLock<Vec<(String, serde_json::Value)>> = LazyLock::new(|| {
    let mut texts: Vec<(String, String)> = FIXTURES
        .iter()
        .map(|d| format!("{d}/config.json"))
        .chain(["assets/config.json".to_string()])
        .map(|p| (p.clone(), bytes_to_text(read(&p))))
        .collect();
    let inline = [
        (
            "mamba_ssm",
            r#"{"d_model":768,"n_layer":24,"vocab_size":50277,"ssm_cfg":{"layer":"Mamba2","d_state":128,
            "headdim":64,"ngroups":1,"expand":2,"d_conv":4,"chunk_size":256,"dt_limit":[0.0,{"__float__":"Infinity"}]},
            "pad_vocab_size_multiple":16,"tie_embeddings":true,"rms_norm":true,"attn_layer_idx":[]}"#,
        ),
        (
            "mistral params.json",
            r#"{"dim":4096,"n_layers":64,"vocab_size":32768,"n_groups":8,"rms_norm":true,
            "residual_in_fp32":true,"fused_add_norm":true,"pad_vocab_size_multiple":1,
            "tie_embeddings":false,"model_type":"mamba"}"#,
        ),
        (
            "nemotron_h old names",
            r#"{"model_type":"nemotron_h","hidden_size":48,"vocab_size":100,"mamba_num_heads":8,
            "mamba_head_dim":12,"num_attention_heads":4,"num_key_value_heads":2,"attention_head_dim":16,
            "intermediate_size":96,"hybrid_override_pattern":"M*-M","mamba_n_groups":2,"mamba_d_conv":3,
            "num_nextn_predict_layers":1,"mlp_hidden_act":"relu2","max_position_embeddings":8192}"#,
        ),
        (
            "nemotron_h 8B shape",
            r#"{"model_type":"nemotron_h","hidden_size":4096,"vocab_size":131072,
            "hybrid_override_pattern":"M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
            "mamba_num_heads":128,"mamba_head_dim":64,"n_groups":8,"ssm_state_size":128,"conv_kernel":4,
            "chunk_size":128,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,
            "intermediate_size":21504,"mlp_hidden_act":"relu2","max_position_embeddings":8192,
            "layer_norm_epsilon":1e-5,"mamba_hidden_act":"silu","tie_word_embeddings":false}"#,
        ),
        (
            "hf mamba2 2.7b shape",
            r#"{"model_type":"mamba2","hidden_size":2560,"num_hidden_layers":64,"vocab_size":50288,
            "expand":2,"head_dim":64,"num_heads":80,"n_groups":1,"state_size":128,"conv_kernel":4,
            "chunk_size":256,"layer_norm_epsilon":1e-5,"tie_word_embeddings":true,"use_conv_bias":true,
            "use_bias":false,"rms_norm":true,"norm_before_gate":false,"time_step_limit":[0.0,{"__float__":"Infinity"}]}"#,
        ),
    ];
    texts.extend(inline.iter().map(|(n, t)| (n.to_string(), t.to_string())));
    texts
        .into_iter()
        .map(|(name, text)| {
            let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, v)
        })
        .collect()
});

/// Every field some parser reads (top level).
const KEYS: &[&str] = &[
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "expand",
    "head_dim",
    "num_heads",
    "n_groups",
    "state_size",
    "conv_kernel",
    "chunk_size",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "use_conv_bias",
    "time_step_limit",
    "use_bias",
    "rms_norm",
    "norm_before_gate",
    "hybrid_override_pattern",
    "layers_block_type",
    "num_nextn_predict_layers",
    "mamba_num_heads",
    "mamba_head_dim",
    "mamba_proj_bias",
    "mamba_hidden_act",
    "num_attention_heads",
    "num_key_value_heads",
    "attention_head_dim",
    "sliding_window",
    "mlp_hidden_act",
    "intermediate_size",
    "mlp_bias",
    "mamba_n_groups",
    "mamba_d_conv",
    "mamba_chunk_size",
    "ssm_state_size",
    "time_step_min",
    "max_position_embeddings",
    "d_model",
    "n_layer",
    "pad_vocab_size_multiple",
    "attn_layer_idx",
    "ssm_cfg",
    "norm_epsilon",
    "tie_embeddings",
    "dim",
    "n_layers",
    "norm_eps",
];

/// mamba_ssm's `ssm_cfg` fields.
const SSM_KEYS: &[&str] = &[
    "layer",
    "bias",
    "rmsnorm",
    "norm_before_gate",
    "D_has_hdim",
    "d_ssm",
    "expand",
    "headdim",
    "ngroups",
    "d_state",
    "d_conv",
    "chunk_size",
    "conv_bias",
    "dt_limit",
];

/// Values, as raw JSON text (so bare `NaN`/`Infinity` and out-of-range numbers can appear).
const VALUES: &[&str] = &[
    // integers, small to beyond u64
    "0",
    "1",
    "2",
    "3",
    "4",
    "7",
    "8",
    "16",
    "64",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "4294967297",
    "1000000000",
    "1099511627776",
    "9007199254740992",
    "9007199254740993",
    "4611686018427387904",
    "9223372036854775807",
    "9223372036854775808",
    "9223372036854775824",
    "18446744073709551615",
    "18446744073709551616",
    "-1",
    "-9223372036854775808",
    // floats and the spellings of non-finite ones
    "0.5",
    "-0.0",
    "0.0",
    "1.5",
    "2.0",
    "-1.0",
    "1e20",
    "1e308",
    "1e-320",
    "4294967296.0",
    "9007199254740992.0",
    "1.8446744073709552e19",
    "1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    "\"Infinity\"",
    "\"NaN\"",
    "\"-inf\"",
    "\"1e400\"",
    "\"1e20\"",
    "\"12\"",
    "{\"__float__\":\"Infinity\"}",
    "{\"__float__\":\"NaN\"}",
    "{\"__float__\":{\"__float__\":\"-Infinity\"}}",
    // wrong types
    "true",
    "false",
    "null",
    "[]",
    "[1,2]",
    "[0.0]",
    "[0.0,NaN]",
    "[1.0,0.5]",
    "[0.0,1.0,2.0]",
    "[\"x\",1]",
    "{}",
    "{\"a\":1}",
    "{\"layer\":\"Mamba2\",\"d_state\":4294967296}",
    "\"\"",
    "\"big\"",
    "\"M*-\"",
    "\"mamba\"",
    "\"mamba2\"",
    "\"nemotron_h\"",
    "\"Mamba2\"",
    "\"relu2\"",
    "\"silu\"",
    "\"gelu\"",
];

const FACTORS: &[u128] = &[0, 2, 3, 1000, 1 << 16, 1 << 32, 1 << 40];

#[derive(Clone, Debug)]
enum KeySel {
    /// A field the base config has.
    Present(Index),
    /// Any field a parser reads.
    Known(usize),
    /// A field of `ssm_cfg`.
    Ssm(usize),
}

#[derive(Clone, Debug)]
enum CfgOp {
    Set(KeySel, usize),
    Scale(KeySel, usize),
    Remove(KeySel),
    /// The key twice in the text: before the original (`false`: the original wins) or
    /// after it (`true`).
    Dup(usize, usize, bool),
}

fn key_sel() -> impl Strategy<Value = KeySel> {
    prop_oneof![
        3 => any::<Index>().prop_map(KeySel::Present),
        3 => (0..KEYS.len()).prop_map(KeySel::Known),
        1 => (0..SSM_KEYS.len()).prop_map(KeySel::Ssm),
    ]
}

fn cfg_op() -> impl Strategy<Value = CfgOp> {
    prop_oneof![
        6 => (key_sel(), 0..VALUES.len()).prop_map(|(k, v)| CfgOp::Set(k, v)),
        3 => (key_sel(), 0..FACTORS.len()).prop_map(|(k, f)| CfgOp::Scale(k, f)),
        2 => key_sel().prop_map(CfgOp::Remove),
        1 => (0..KEYS.len(), 0..VALUES.len(), any::<bool>()).prop_map(|(k, v, l)| CfgOp::Dup(k, v, l)),
    ]
}

/// A JSON value under construction; `Raw` holds text spliced in after serializing.
struct Raw(Vec<String>);

impl Raw {
    fn put(&mut self, text: String) -> serde_json::Value {
        self.0.push(text);
        serde_json::Value::String(format!("@@RAW{}@@", self.0.len() - 1))
    }
    fn render(&self, v: &serde_json::Value) -> String {
        let mut s = v.to_string();
        for (i, text) in self.0.iter().enumerate().rev() {
            s = s.replace(&format!("\"@@RAW{i}@@\""), text);
        }
        s
    }
}

/// The object a key lives in: the top level, or `ssm_cfg` (made an object if it is not).
fn slot(
    obj: &mut serde_json::Map<String, serde_json::Value>,
    nested: bool,
) -> &mut serde_json::Map<String, serde_json::Value> {
    if !nested {
        return obj;
    }
    let e = obj
        .entry("ssm_cfg")
        .or_insert_with(|| serde_json::json!({"layer": "Mamba2"}));
    if !e.is_object() {
        *e = serde_json::json!({"layer": "Mamba2"});
    }
    e.as_object_mut().unwrap()
}

/// Applies `ops` to config `base`, returning the text.
fn mutate_config(base: &serde_json::Value, ops: &[CfgOp]) -> String {
    let mut v = base.clone();
    let mut raw = Raw(Vec::new());
    let mut dups: Vec<(usize, usize, bool)> = Vec::new();
    for op in ops {
        let serde_json::Value::Object(obj) = &mut v else {
            break;
        };
        let key = |obj: &serde_json::Map<String, serde_json::Value>, k: &KeySel| match k {
            KeySel::Present(i) if !obj.is_empty() => {
                (false, obj.keys().nth(i.index(obj.len())).unwrap().clone())
            }
            KeySel::Present(_) => (false, "hidden_size".to_string()),
            KeySel::Known(i) => (false, KEYS[*i].to_string()),
            KeySel::Ssm(i) => (true, SSM_KEYS[*i].to_string()),
        };
        match op {
            CfgOp::Set(k, val) => {
                let (nested, name) = key(obj, k);
                let value = raw.put(VALUES[*val].to_string());
                slot(obj, nested).insert(name, value);
            }
            CfgOp::Scale(k, f) => {
                let (nested, name) = key(obj, k);
                let map = slot(obj, nested);
                if let Some(n) = map.get(&name).and_then(|x| x.as_u64()) {
                    let value = raw.put((n as u128 * FACTORS[*f]).to_string());
                    map.insert(name, value);
                }
            }
            CfgOp::Remove(k) => {
                let (nested, name) = key(obj, k);
                slot(obj, nested).remove(&name);
            }
            CfgOp::Dup(k, val, last) => dups.push((*k, *val, *last)),
        }
    }
    let mut text = raw.render(&v);
    for (k, val, last) in dups {
        let field = format!("\"{}\":{}", KEYS[k], VALUES[val]);
        if text.starts_with('{') && text.ends_with('}') {
            if last {
                text.insert_str(text.len() - 1, &format!(",{field}"));
            } else {
                text.insert_str(1, &format!("{field},"));
            }
        }
    }
    text
}

/// u128 arithmetic where `None` means "beyond u128" (certainly beyond usize).
#[derive(Clone, Copy, Debug, PartialEq)]
struct N(Option<u128>);

impl std::ops::Add for N {
    type Output = N;
    fn add(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_add(b)))
    }
}

impl std::ops::Mul for N {
    type Output = N;
    fn mul(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_mul(b)))
    }
}

fn n(x: usize) -> N {
    N(Some(x as u128))
}

impl std::fmt::Display for N {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(x) => write!(f, "{x}"),
            None => write!(f, "> 2^128"),
        }
    }
}

/// An exact size that must fit `usize`; then the library's value must equal it.
fn same(name: &str, exact: N, lib: impl FnOnce() -> usize) -> Check {
    match exact.0 {
        Some(x) if x <= usize::MAX as u128 => {
            let got = lib();
            if got as u128 != x {
                return Err(fail(
                    format!("[wrong size] {name}"),
                    format!("{name}() = {got}, exactly {x} (an arithmetic wrap)"),
                ));
            }
            Ok(())
        }
        _ => Err(fail(
            format!("[overflow] {name}"),
            format!("{name} = {exact} does not fit usize, yet the config was accepted"),
        )),
    }
}

fn fits_u32(name: &str, exact: N) -> Check {
    match exact.0 {
        Some(x) if x <= u32::MAX as u128 => Ok(()),
        _ => Err(fail(
            format!("[u32] {name}"),
            format!(
                "{name} = {exact} exceeds u32::MAX, yet the config was accepted (the kernels take it as u32)"
            ),
        )),
    }
}

/// What an accepted config promises: its invariants hold, every derived size computes
/// exactly, and what the kernels index with fits u32.
fn check_config(c: &ModelConfig) -> Check {
    let invariant = |ok: bool, what: &str| -> Check {
        if ok {
            Ok(())
        } else {
            Err(fail(
                format!("[invariant] {what}"),
                format!("accepted a config with {what}: {c:?}"),
            ))
        }
    };
    invariant(c.d_conv >= 2, "d_conv < 2")?;
    invariant(c.n_groups > 0 && c.n_heads > 0, "zero heads or groups")?;
    invariant(c.blocks.len() == c.n_layer, "blocks.len() != n_layer")?;
    let count = |k: BlockKind| n(c.blocks.iter().filter(|&&b| b == k).count());
    let (m, att, mlp) = (
        count(BlockKind::Mamba2),
        count(BlockKind::Attention),
        count(BlockKind::Mlp),
    );
    let (d, v, di, h, p, g, st, k) = (
        n(c.d_model),
        n(c.vocab_size),
        n(c.d_inner),
        n(c.n_heads),
        n(c.head_dim),
        n(c.n_groups),
        n(c.d_state),
        n(c.d_conv),
    );
    let two = n(2);
    let conv_dim = di + two * g * st;
    let d_in_proj = two * di + two * g * st + h;
    let ssm = h * p * st;
    let conv_state = conv_dim * n(c.d_conv - 1);
    let state_bytes = n(4) * m * (ssm + conv_state);
    let (qkv, qw, kw) = match &c.attention {
        Some(a) => (
            (n(a.heads) + two * n(a.kv_heads)) * n(a.head_dim),
            n(a.heads) * n(a.head_dim),
            n(a.kv_heads) * n(a.head_dim),
        ),
        None => (n(0), n(0), n(0)),
    };
    let kv_bytes = if c.attention.is_some() {
        two * kw * n(4) * att
    } else {
        n(0)
    };
    let mamba_params = d_in_proj * d
        + conv_dim * k
        + if c.conv_bias { conv_dim } else { n(0) }
        + n(3) * h
        + di
        + d * di;
    let att_params = match &c.attention {
        Some(a) => qkv * d + d * qw + if a.bias { qkv + d } else { n(0) },
        None => n(0),
    };
    let mlp_params = match &c.mlp {
        Some(ml) => {
            let ups = n(if ml.act == mamba2_wgpu::config::MlpAct::SiluGated {
                2
            } else {
                1
            });
            let bias = if ml.bias {
                ups * n(ml.intermediate) + d
            } else {
                n(0)
            };
            (ups + n(1)) * n(ml.intermediate) * d + bias
        }
        None => n(0),
    };
    let layers = m * (d + mamba_params) + att * (d + att_params) + mlp * (d + mlp_params);
    let head = if c.tie_embeddings { n(0) } else { v * d };
    let params = v * d + layers + d + head;

    // What the kernels take as u32: sizes, state lengths, and each tensor's element count.
    for (name, x) in [
        ("d_model", d),
        ("vocab_size", v),
        ("vocab_size × d_model (embedding)", v * d),
    ] {
        fits_u32(name, x)?;
    }
    if m != n(0) {
        for (name, x) in [
            ("d_inner", di),
            ("conv_dim", conv_dim),
            ("d_in_proj", d_in_proj),
            ("ssm_state_len", ssm),
            ("conv_state_len", conv_state),
            ("d_in_proj × d_model (in_proj)", d_in_proj * d),
            ("conv_dim × d_conv (conv1d)", conv_dim * k),
            ("d_model × d_inner (out_proj)", d * di),
            ("chunk_size", n(c.chunk_size)),
        ] {
            fits_u32(name, x)?;
        }
    }
    if att != n(0) {
        for (name, x) in [
            ("qkv_rows", qkv),
            ("qkv_rows × d_model (q/k/v)", qkv * d),
            ("q_width × d_model (o_proj)", qw * d),
        ] {
            fits_u32(name, x)?;
        }
    }
    if mlp != n(0)
        && let Some(ml) = &c.mlp
    {
        fits_u32("intermediate_size × d_model", n(ml.intermediate) * d)?;
    }
    // Every derived size the config exposes computes exactly.
    same("conv_dim", conv_dim, || c.conv_dim())?;
    same("d_in_proj", d_in_proj, || c.d_in_proj())?;
    same("ssm_state_len", ssm, || c.ssm_state_len())?;
    same("conv_state_len", conv_state, || c.conv_state_len())?;
    same("state_bytes", state_bytes, || c.state_bytes())?;
    same("kv_bytes_per_token(4)", kv_bytes, || {
        c.kv_bytes_per_token(4)
    })?;
    same("param_count", params, || c.param_count())?;
    if let Some(a) = &c.attention {
        same("qkv_rows", qkv, || a.qkv_rows())?;
        same("q_width", qw, || a.q_width())?;
        same("kv_width", kw, || a.kv_width())?;
        let _ = a.dims();
    }
    let _ = (
        c.group_size(),
        c.heads_per_group(),
        c.pattern(),
        c.is_hybrid(),
    );
    // What `Model::save` writes reads back as the same model.
    let json = c.to_hf_json().to_string();
    match ModelConfig::from_json_str(&json, Path::new("config.json")) {
        Ok(back) => {
            let key = |c: &ModelConfig| {
                (
                    (
                        c.d_model,
                        c.n_layer,
                        c.vocab_size,
                        c.d_inner,
                        c.n_heads,
                        c.head_dim,
                    ),
                    (
                        c.n_groups,
                        c.d_state,
                        c.d_conv,
                        c.chunk_size,
                        c.tie_embeddings,
                        c.conv_bias,
                    ),
                    c.blocks.clone(),
                )
            };
            if key(&back) != key(c)
                || back.attention != c.attention
                || back.mlp != c.mlp
                || back.norm_eps != c.norm_eps
            {
                return Err(fail(
                    "[round trip] to_hf_json reads back as another model",
                    format!("{c:?}\n  wrote {json}\n  read back {back:?}"),
                ));
            }
        }
        Err(e) => {
            return Err(fail(
                "[round trip] to_hf_json does not read back",
                format!("{e}\n  wrote {json}"),
            ));
        }
    }
    Ok(())
}

fn parse_and_check(text: &str) -> Check {
    match ModelConfig::from_json_str(text, Path::new("config.json")) {
        Ok(c) => check_config(&c),
        Err(e) => {
            let msg = e.to_string();
            if msg.is_empty() {
                return Err(fail("[error] empty message", ""));
            }
            Ok(())
        }
    }
}

fn fuzz_config_values() {
    let strategy = (0..CONFIGS.len(), prop::collection::vec(cfg_op(), 1..5));
    fuzz(
        "config_values",
        16000,
        strategy,
        |(base, ops)| mutate_config(&CONFIGS[*base].1, ops),
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}

/// Layer pattern spellings: a string of letters or a list of names.
#[derive(Clone, Debug)]
struct PatternCase {
    base: usize,
    list: bool,
    len: usize,
    alphabet: usize,
    seed: u64,
    /// `num_hidden_layers`: 0 the pattern's length, 1 absent, 2.. a `VALUES` entry.
    layers: usize,
    ops: Vec<CfgOp>,
}

const PATTERN_LENS: &[usize] = &[0, 1, 2, 3, 7, 64, 1000, 65536, 1 << 20];
const LETTERS: &[&[&str]] = &[
    &["M"],
    &["M", "*", "-"],
    &["M", "*", "-", "E"],
    &["M", "*", "-", "X", "m", " ", "é", "\u{0}", "\u{1F600}"],
];
const NAMES: &[&[&str]] = &[
    &["mamba", "attention", "mlp"],
    &["linear_attention", "full_attention", "mlp", "moe"],
    &["M", "*", "-", "", "Mamba", "\u{0}", "attention "],
];

fn pattern_case() -> impl Strategy<Value = PatternCase> {
    (
        0..4usize,
        any::<bool>(),
        prop_oneof![
            16 => 0..PATTERN_LENS.len() - 2,
            1 => PATTERN_LENS.len() - 2..PATTERN_LENS.len(),
        ],
        0..4usize,
        any::<u64>(),
        prop_oneof![4 => Just(0usize), 1 => Just(1usize), 2 => 2..VALUES.len() + 2],
        prop::collection::vec(cfg_op(), 0..3),
    )
        .prop_map(
            |(base, list, len, alphabet, seed, layers, ops)| PatternCase {
                base,
                list,
                len: PATTERN_LENS[len],
                alphabet,
                seed,
                layers,
                ops,
            },
        )
}

/// Nemotron-H bases: the three fixtures and the 8B shape.
fn nemotron_base(i: usize) -> &'static serde_json::Value {
    let names = [
        "tests/fixtures/nemotron_h_g2/config.json",
        "tests/fixtures/nemotron_h_hybrid/config.json",
        "tests/fixtures/nemotron_h_mqa/config.json",
        "nemotron_h 8B shape",
    ];
    &CONFIGS.iter().find(|(n, _)| n == names[i]).unwrap().1
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn pattern_config(p: &PatternCase) -> String {
    let mut v = nemotron_base(p.base).clone();
    let obj = v.as_object_mut().unwrap();
    obj.remove("hybrid_override_pattern");
    obj.remove("layers_block_type");
    let mut s = p.seed | 1;
    let pick =
        |s: &mut u64, from: &[&'static str]| from[(xorshift(s) % from.len() as u64) as usize];
    if p.list {
        let names = NAMES[p.alphabet % NAMES.len()];
        let list: Vec<serde_json::Value> = (0..p.len)
            .map(|_| {
                if xorshift(&mut s).is_multiple_of(97) {
                    serde_json::Value::from(1)
                } else {
                    pick(&mut s, names).into()
                }
            })
            .collect();
        obj.insert("layers_block_type".into(), list.into());
    } else {
        let letters = LETTERS[p.alphabet];
        let pattern: String = (0..p.len).map(|_| pick(&mut s, letters)).collect();
        obj.insert("hybrid_override_pattern".into(), pattern.into());
    }
    match p.layers {
        0 => {
            obj.insert("num_hidden_layers".into(), p.len.into());
        }
        1 => {
            obj.remove("num_hidden_layers");
        }
        _ => {}
    }
    let mut ops = p.ops.clone();
    if p.layers >= 2 {
        ops.push(CfgOp::Set(
            KeySel::Known(KEYS.iter().position(|k| *k == "num_hidden_layers").unwrap()),
            p.layers - 2,
        ));
    }
    mutate_config(&v, &ops)
}

fn fuzz_config_patterns() {
    fuzz(
        "config_patterns",
        400,
        pattern_case(),
        pattern_config,
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}

fn fuzz_config_bytes() {
    let strategy = (
        0..CONFIGS.len(),
        prop::collection::vec(cfg_op(), 0..3),
        prop::collection::vec(byte_op(), 1..5),
    );
    fuzz(
        "config_bytes",
        16000,
        strategy,
        |(base, ops, bytes)| {
            let text = mutate_config(&CONFIGS[*base].1, ops);
            bytes_to_text(apply_bytes(text.into_bytes(), bytes))
        },
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}

// ---------------------------------------------------------------------------------------
// The safetensors and shard-index loader
// ---------------------------------------------------------------------------------------

/// The fixture model directories (`config.json` + `model.safetensors`): the first one is a
/// plain Mamba2 that loads; every other fixture in tests/fixtures joins in.
static FIXTURES: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut dirs: Vec<String> = std::fs::read_dir(manifest("tests/fixtures"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            let p = e.path();
            p.join("config.json").is_file() && p.join("model.safetensors").is_file()
        })
        .map(|e| format!("tests/fixtures/{}", e.file_name().to_string_lossy()))
        .collect();
    dirs.sort_by_key(|d| (!d.ends_with("hf_mamba2_g1"), d.clone()));
    assert!(dirs[0].ends_with("hf_mamba2_g1"), "{dirs:?}");
    dirs
});

/// One tensor of a safetensors file.
#[derive(Clone)]
struct StTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

struct Fixture {
    config: String,
    /// Whether the config parses (a fixture of a model kind still in the works may not):
    /// only then does a load get as far as the weights.
    config_ok: bool,
    tensors: Vec<StTensor>,
    metadata: Option<String>,
}

static FIXTURE: LazyLock<Vec<Fixture>> = LazyLock::new(|| {
    FIXTURES
        .iter()
        .map(|dir| {
            let bytes = read(&format!("{dir}/model.safetensors"));
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let data = &bytes[8 + n..];
            let mut metadata = None;
            let mut tensors: Vec<(u64, StTensor)> = Vec::new();
            for (name, info) in header {
                if name == "__metadata__" {
                    metadata = Some(info.to_string());
                    continue;
                }
                let off: Vec<u64> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
                tensors.push((
                    off[0],
                    StTensor {
                        name,
                        dtype: info["dtype"].as_str().unwrap().into(),
                        shape: serde_json::from_value(info["shape"].clone()).unwrap(),
                        data: data[off[0] as usize..off[1] as usize].to_vec(),
                    },
                ));
            }
            tensors.sort_by_key(|(o, _)| *o);
            let config = bytes_to_text(read(&format!("{dir}/config.json")));
            Fixture {
                config_ok: ModelConfig::from_json_str(&config, Path::new("config.json")).is_ok(),
                config,
                tensors: tensors.into_iter().map(|(_, t)| t).collect(),
                metadata,
            }
        })
        .collect()
});

/// One header entry: a name and its value, as raw JSON text (so anything can be written).
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: String,
    offsets: String,
    /// The whole value, when not an ordinary tensor entry.
    raw: Option<String>,
    /// Extra text inside the entry's object (a duplicate or unknown field).
    extra: String,
}

fn entries(tensors: &[StTensor], metadata: Option<&str>) -> (Vec<Entry>, Vec<u8>) {
    let mut out = Vec::new();
    let mut data = Vec::new();
    if let Some(m) = metadata {
        out.push(Entry {
            name: "__metadata__".into(),
            dtype: String::new(),
            shape: String::new(),
            offsets: String::new(),
            raw: Some(m.into()),
            extra: String::new(),
        });
    }
    for t in tensors {
        let start = data.len();
        data.extend_from_slice(&t.data);
        out.push(Entry {
            name: t.name.clone(),
            dtype: format!("\"{}\"", t.dtype),
            shape: serde_json::to_string(&t.shape).unwrap(),
            offsets: format!("[{start},{}]", data.len()),
            raw: None,
            extra: String::new(),
        });
    }
    (out, data)
}

fn header_text(entries: &[Entry]) -> String {
    let mut s = String::from("{");
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&serde_json::to_string(&e.name).unwrap());
        s.push(':');
        match &e.raw {
            Some(raw) => s.push_str(raw),
            None => {
                let _ = write!(
                    s,
                    "{{\"dtype\":{},\"shape\":{},\"data_offsets\":{}{}}}",
                    e.dtype, e.shape, e.offsets, e.extra
                );
            }
        }
    }
    s.push('}');
    s
}

fn safetensors_file(header: &[u8], len: Option<u64>, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend_from_slice(&len.unwrap_or(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

const DTYPES: &[&str] = &[
    "\"F32\"",
    "\"F16\"",
    "\"BF16\"",
    "\"F64\"",
    "\"I8\"",
    "\"U8\"",
    "\"BOOL\"",
    "\"F8_E4M3\"",
    "\"F4\"",
    "\"F6_E2M3\"",
    "\"E8M0\"",
    "\"C64\"",
    "\"Q8_0\"",
    "\"f32\"",
    "\"\"",
    "17",
    "null",
];
const SHAPES: &[&str] = &[
    "[]",
    "[0]",
    "[1]",
    "[0,0]",
    "[4294967296]",
    "[4294967296,4294967296]",
    "[18446744073709551615]",
    "[2305843009213693952]",
    "[4611686018427387904,4]",
    "[-1]",
    "[1.5]",
    "\"x\"",
    "null",
    "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
];
const OFFSETS: &[&str] = &[
    "[0,0]",
    "[0,4]",
    "[1,0]",
    "[0,18446744073709551615]",
    "[18446744073709551615,18446744073709551615]",
    "[0]",
    "[0,1,2]",
    "null",
    "\"0\"",
    "[-1,4]",
    "[4294967296,4294967300]",
];
const METADATA: &[&str] = &[
    "{}",
    "{\"format\":\"pt\"}",
    "{\"format\":1}",
    "[]",
    "\"x\"",
    "null",
    "{\"a\":{\"b\":1}}",
];

#[derive(Clone, Debug)]
enum HdrOp {
    Dtype(Index, usize),
    Shape(Index, usize),
    ShapeReverse(Index),
    ShapeFlat(Index),
    Offsets(Index, usize),
    /// `data_offsets[end?] += delta`
    Nudge(Index, bool, i8),
    /// Entry i takes entry j's name: a duplicate key with other offsets.
    Rename(Index, Index),
    /// Entry i again, verbatim: a duplicate key with the same offsets.
    DupEntry(Index),
    Remove(Index),
    /// Entries i and j swap their offsets.
    SwapOffsets(Index, Index),
    Metadata(usize),
    /// A field twice inside one entry, or an unknown field.
    Field(Index, bool),
    /// The 8-byte header length set to something else (see `header_len`).
    HeaderLen(usize),
    /// Offsets chained up to the top of u64 (see `huge_chain`).
    HugeChain(usize),
}

fn hdr_op() -> impl Strategy<Value = HdrOp> {
    prop_oneof![
        2 => (any::<Index>(), 0..DTYPES.len()).prop_map(|(i, v)| HdrOp::Dtype(i, v)),
        2 => (any::<Index>(), 0..SHAPES.len()).prop_map(|(i, v)| HdrOp::Shape(i, v)),
        1 => any::<Index>().prop_map(HdrOp::ShapeReverse),
        1 => any::<Index>().prop_map(HdrOp::ShapeFlat),
        2 => (any::<Index>(), 0..OFFSETS.len()).prop_map(|(i, v)| HdrOp::Offsets(i, v)),
        2 => (any::<Index>(), any::<bool>(), any::<i8>()).prop_map(|(i, e, d)| HdrOp::Nudge(i, e, d)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| HdrOp::Rename(i, j)),
        2 => any::<Index>().prop_map(HdrOp::DupEntry),
        1 => any::<Index>().prop_map(HdrOp::Remove),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| HdrOp::SwapOffsets(i, j)),
        1 => (0..METADATA.len()).prop_map(HdrOp::Metadata),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(i, d)| HdrOp::Field(i, d)),
        2 => (0..13usize).prop_map(HdrOp::HeaderLen),
        1 => (0..3usize).prop_map(HdrOp::HugeChain),
    ]
}

/// Byte edits of the assembled file.
#[derive(Clone, Debug)]
enum FileOp {
    Truncate(Index),
    Append(u16),
    /// A flipped bit in the data (past the header).
    FlipData(Index, u8),
}

fn file_op() -> impl Strategy<Value = FileOp> {
    prop_oneof![
        any::<Index>().prop_map(FileOp::Truncate),
        (0u16..600).prop_map(FileOp::Append),
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| FileOp::FlipData(i, b)),
    ]
}

#[derive(Clone, Debug)]
struct StCase {
    fixture: usize,
    hdr: Vec<HdrOp>,
    hdr_bytes: Vec<ByteOp>,
    file: Vec<FileOp>,
}

/// The file a case writes, and what it requires of the loader.
struct StBuilt {
    fixture: usize,
    header: Vec<u8>,
    file: Vec<u8>,
    /// Set when the file must be refused, saying why.
    /// Set when the file must be refused: (what, in detail).
    must_fail: Option<(String, String)>,
}

fn header_len(choice: usize, n: u64, file_len: u64) -> u64 {
    [
        0,
        1,
        7,
        n.saturating_sub(1),
        n + 1,
        n + 8,
        file_len,
        file_len + 1,
        u64::MAX,
        1 << 63,
        100_000_001,
        100_000_000,
        u32::MAX as u64 + 1,
    ][choice]
}

/// Offsets that sum to the top of u64: `read_metadata` adds 8 + header length to their end.
fn huge_chain(variant: usize, names: &[String]) -> Vec<Entry> {
    let s: u64 = (1 << 61) - 1; // U8 elements: bits = 8·s < 2^64
    let count = match variant {
        0 => 8,
        1 => 7,
        _ => 1,
    };
    (0..count)
        .map(|i| Entry {
            name: names
                .get(i as usize)
                .filter(|_| variant == 1)
                .cloned()
                .unwrap_or_else(|| format!("t{i}")),
            dtype: "\"U8\"".into(),
            shape: format!("[{s}]"),
            offsets: format!("[{},{}]", i * s, (i + 1) * s),
            raw: None,
            extra: String::new(),
        })
        .collect()
}

fn build_st(c: &StCase) -> StBuilt {
    let fx = &FIXTURE[c.fixture];
    let (mut es, data) = entries(&fx.tensors, fx.metadata.as_deref());
    let mut len_choice = None;
    let mut data = data;
    for op in &c.hdr {
        let len = es.len();
        if len == 0 {
            break;
        }
        let at = |i: &Index| i.index(len);
        match op {
            HdrOp::Dtype(i, v) => es[at(i)].dtype = DTYPES[*v].into(),
            HdrOp::Shape(i, v) => es[at(i)].shape = SHAPES[*v].into(),
            HdrOp::ShapeReverse(i) | HdrOp::ShapeFlat(i) => {
                let e = &mut es[at(i)];
                if let Ok(mut shape) = serde_json::from_str::<Vec<u64>>(&e.shape) {
                    if matches!(op, HdrOp::ShapeReverse(_)) {
                        shape.reverse();
                    } else {
                        shape = vec![shape.iter().product()];
                    }
                    e.shape = serde_json::to_string(&shape).unwrap();
                }
            }
            HdrOp::Offsets(i, v) => es[at(i)].offsets = OFFSETS[*v].into(),
            HdrOp::Nudge(i, end, delta) => {
                let e = &mut es[at(i)];
                if let Ok(mut o) = serde_json::from_str::<Vec<i128>>(&e.offsets)
                    && o.len() == 2
                {
                    o[*end as usize] += *delta as i128;
                    e.offsets = format!("[{},{}]", o[0], o[1]);
                }
            }
            HdrOp::Rename(i, j) => {
                let name = es[at(j)].name.clone();
                es[at(i)].name = name;
            }
            HdrOp::DupEntry(i) => {
                let e = es[at(i)].clone();
                es.push(e);
            }
            HdrOp::Remove(i) => {
                es.remove(at(i));
            }
            HdrOp::SwapOffsets(i, j) => {
                let (a, b) = (at(i), at(j));
                let o = es[a].offsets.clone();
                es[a].offsets = es[b].offsets.clone();
                es[b].offsets = o;
            }
            HdrOp::Metadata(v) => match es.iter_mut().find(|e| e.name == "__metadata__") {
                Some(e) => e.raw = Some(METADATA[*v].into()),
                None => es.insert(
                    0,
                    Entry {
                        name: "__metadata__".into(),
                        dtype: String::new(),
                        shape: String::new(),
                        offsets: String::new(),
                        raw: Some(METADATA[*v].into()),
                        extra: String::new(),
                    },
                ),
            },
            HdrOp::Field(i, dup) => {
                es[at(i)].extra = if *dup {
                    ",\"shape\":[1]".into()
                } else {
                    ",\"quantization\":\"q8_0\"".into()
                }
            }
            HdrOp::HeaderLen(v) => len_choice = Some(*v),
            HdrOp::HugeChain(v) => {
                let names: Vec<String> = fx.tensors.iter().map(|t| t.name.clone()).collect();
                es = huge_chain(*v, &names);
                data.clear();
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    let dup = es.iter().find(|e| !seen.insert(e.name.as_str()));
    let must_fail = if c.hdr_bytes.is_empty() {
        dup.map(|e| {
            (
                "a tensor name twice in one safetensors header".to_string(),
                format!(
                    "the tensor name `{}` appears twice in one safetensors header",
                    e.name
                ),
            )
        })
    } else {
        None
    };
    let header = apply_bytes(header_text(&es).into_bytes(), &c.hdr_bytes);
    let n = header.len() as u64;
    let file_len = 8 + n + data.len() as u64;
    let len = len_choice.map(|v| header_len(v, n, file_len));
    let mut file = safetensors_file(&header, len, &data);
    for op in &c.file {
        match op {
            FileOp::Truncate(i) => {
                let l = file.len();
                file.truncate(i.index(l + 1).min(l));
            }
            FileOp::Append(k) => file.extend((0..*k).map(|x| x as u8)),
            FileOp::FlipData(i, b) => {
                let start = (8 + header.len()).min(file.len());
                if file.len() > start {
                    let p = start + i.index(file.len() - start);
                    file[p] ^= 1 << b;
                }
            }
        }
    }
    StBuilt {
        fixture: c.fixture,
        header,
        file,
        must_fail,
    }
}

fn describe_st(b: &StBuilt) -> String {
    format!(
        "fixture {} + model.safetensors of {} bytes, first 8 = {:?}, header:\n{}",
        FIXTURES[b.fixture],
        b.file.len(),
        &b.file[..b.file.len().min(8)],
        clip(&String::from_utf8_lossy(&b.header), 4000),
    )
}

/// Loads `dir`: no panic; when the case says so, an error (naming `must_name` if given);
/// when loaded, every tensor's bytes match its shape.
fn check_load(dir: &Path, must_fail: Option<(&str, &str)>, must_name: Option<&str>) -> Check {
    match Model::load(dir) {
        Ok(model) => {
            if let Some((kind, why)) = must_fail {
                return Err(fail(
                    format!("[accepted] {kind}"),
                    format!("Model::load accepted a directory where {why}"),
                ));
            }
            for t in model.weights.all() {
                let numel = t
                    .shape
                    .iter()
                    .try_fold(1usize, |a, &b| a.checked_mul(b))
                    .and_then(|n| n.checked_mul(t.dtype.size()));
                if numel != Some(t.bytes().len()) {
                    return Err(fail(
                        "[loaded] tensor bytes do not match its shape",
                        format!("{:?}: {} bytes", t, t.bytes().len()),
                    ));
                }
                let _ = t.to_f32();
            }
            let _ = (model.param_count(), model.dtype_counts());
            Ok(())
        }
        Err(e) => {
            let msg = e.to_string();
            if let (Some(_), Some(name)) = (must_fail, must_name)
                && !msg.contains(name)
            {
                return Err(fail(
                    format!("[error] does not name {name}"),
                    format!("the error should name {name}: {msg}"),
                ));
            }
            Ok(())
        }
    }
}

fn check_st(b: &StBuilt) -> Check {
    let scratch = Scratch::new();
    let dir = &scratch.0;
    std::fs::write(dir.join("config.json"), &FIXTURE[b.fixture].config).unwrap();
    std::fs::write(dir.join("model.safetensors"), &b.file).unwrap();
    let must_fail = b.must_fail.as_ref().map(|(k, w)| (k.as_str(), w.as_str()));
    check_load(dir, must_fail, None)
}

fn fuzz_safetensors_header() {
    let strategy =
        (0..FIXTURES.len(), prop::collection::vec(hdr_op(), 1..4)).prop_map(|(fixture, hdr)| {
            StCase {
                fixture,
                hdr,
                hdr_bytes: vec![],
                file: vec![],
            }
        });
    fuzz(
        "safetensors_header",
        1000,
        strategy,
        build_st,
        describe_st,
        check_st,
    );
}

fn fuzz_safetensors_bytes() {
    let strategy = (
        0..FIXTURES.len(),
        prop::collection::vec(hdr_op(), 0..2),
        prop::collection::vec(byte_op(), 0..4),
        prop::collection::vec(file_op(), 0..3),
    )
        .prop_map(|(fixture, hdr, hdr_bytes, file)| StCase {
            fixture,
            hdr,
            hdr_bytes,
            file,
        });
    fuzz(
        "safetensors_bytes",
        800,
        strategy,
        build_st,
        describe_st,
        check_st,
    );
}

/// Where an index entry can point.
#[derive(Clone, Copy, Debug)]
enum Target {
    Missing,
    /// The model file itself, by its absolute path.
    AbsoluteInside,
    AbsoluteOutside,
    /// `../other/model.safetensors`: a valid copy outside the model directory.
    Parent,
    /// `sub/../model.safetensors`
    DotDotInside,
    Empty,
    Dot,
    Subdir,
    Nul,
    DotSlash,
    OtherShard,
    LongName,
    Backslash,
    NonString(usize),
}

const TARGETS: &[Target] = &[
    Target::Missing,
    Target::AbsoluteInside,
    Target::AbsoluteOutside,
    Target::Parent,
    Target::DotDotInside,
    Target::Empty,
    Target::Dot,
    Target::Subdir,
    Target::Nul,
    Target::DotSlash,
    Target::OtherShard,
    Target::LongName,
    Target::Backslash,
    Target::NonString(0),
    Target::NonString(1),
    Target::NonString(2),
    Target::NonString(3),
];
const NON_STRINGS: &[&str] = &["1", "null", "[]", "{}"];
const WEIGHT_MAPS: &[&str] = &["[]", "\"x\"", "null", "1", "{}", "{\"a\":{}}"];

#[derive(Clone, Debug)]
enum IdxOp {
    Retarget(Index, usize),
    /// A weight_map key twice.
    DupName(Index, usize),
    Remove(Index),
    WeightMap(usize),
    /// No `weight_map` at all.
    NoWeightMap,
}

fn idx_op() -> impl Strategy<Value = IdxOp> {
    prop_oneof![
        6 => (any::<Index>(), 0..TARGETS.len()).prop_map(|(i, t)| IdxOp::Retarget(i, t)),
        2 => (any::<Index>(), 0..TARGETS.len()).prop_map(|(i, t)| IdxOp::DupName(i, t)),
        2 => any::<Index>().prop_map(IdxOp::Remove),
        1 => (0..WEIGHT_MAPS.len()).prop_map(IdxOp::WeightMap),
        1 => Just(IdxOp::NoWeightMap),
    ]
}

#[derive(Clone, Debug)]
struct IdxCase {
    fixture: usize,
    /// Two shards instead of one file.
    split: bool,
    ops: Vec<IdxOp>,
    bytes: Vec<ByteOp>,
}

fn shard_name(split: bool, i: usize, count: usize) -> String {
    if split {
        format!(
            "model-{:05}-of-00002.safetensors",
            1 + (i >= count / 2) as usize
        )
    } else {
        "model.safetensors".into()
    }
}

fn target_text(t: Target, dir: &Path, split: bool) -> String {
    let s = |x: &str| serde_json::to_string(x).unwrap();
    let model = shard_name(split, 0, 2);
    match t {
        Target::Missing => s("missing.safetensors"),
        Target::AbsoluteInside => s(&dir.join(&model).display().to_string()),
        Target::AbsoluteOutside => s("/etc/passwd"),
        Target::Parent => s("../other/model.safetensors"),
        Target::DotDotInside => s(&format!("subdir/../{model}")),
        Target::Empty => s(""),
        Target::Dot => s("."),
        Target::Subdir => s("subdir"),
        Target::Nul => s("a\u{0}b.safetensors"),
        Target::DotSlash => s(&format!("./{model}")),
        Target::OtherShard => s(&shard_name(split, 1, 2)),
        Target::LongName => s(&"x".repeat(5000)),
        Target::Backslash => s("..\\other\\model.safetensors"),
        Target::NonString(i) => NON_STRINGS[i].into(),
    }
}

/// Whether a shard path leaves the model directory (absolute, or through `..`).
fn escapes(t: Target) -> bool {
    matches!(
        t,
        Target::AbsoluteInside | Target::AbsoluteOutside | Target::Parent | Target::DotDotInside
    )
}

fn check_index(c: &IdxCase) -> Check {
    let scratch = Scratch::new();
    let dir = scratch.0.join("model");
    let other = scratch.0.join("other");
    std::fs::create_dir_all(dir.join("subdir")).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    let fx = &FIXTURE[c.fixture];
    std::fs::write(dir.join("config.json"), &fx.config).unwrap();
    let count = fx.tensors.len();
    let write_shard = |path: &Path, tensors: &[StTensor]| {
        let (es, data) = entries(tensors, fx.metadata.as_deref());
        std::fs::write(
            path,
            safetensors_file(header_text(&es).as_bytes(), None, &data),
        )
        .unwrap();
    };
    if c.split {
        write_shard(
            &dir.join(shard_name(true, 0, count)),
            &fx.tensors[..count / 2],
        );
        write_shard(
            &dir.join(shard_name(true, count, count)),
            &fx.tensors[count / 2..],
        );
    } else {
        write_shard(&dir.join("model.safetensors"), &fx.tensors);
    }
    write_shard(&other.join("model.safetensors"), &fx.tensors);
    let mut map: Vec<(String, String, Option<Target>)> = fx
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.clone(),
                serde_json::to_string(&shard_name(c.split, i, count)).unwrap(),
                None,
            )
        })
        .collect();
    let mut weight_map: Option<Option<&str>> = Some(None);
    for op in &c.ops {
        let len = map.len();
        match op {
            IdxOp::Retarget(i, t) if len > 0 => {
                let e = &mut map[i.index(len)];
                e.1 = target_text(TARGETS[*t], &dir, c.split);
                e.2 = Some(TARGETS[*t]);
            }
            IdxOp::DupName(i, t) if len > 0 => {
                let name = map[i.index(len)].0.clone();
                map.push((
                    name,
                    target_text(TARGETS[*t], &dir, c.split),
                    Some(TARGETS[*t]),
                ));
            }
            IdxOp::Remove(i) if len > 0 => {
                map.remove(i.index(len));
            }
            IdxOp::WeightMap(v) => weight_map = Some(Some(WEIGHT_MAPS[*v])),
            IdxOp::NoWeightMap => weight_map = None,
            _ => {}
        }
    }
    let map_text = {
        let mut s = String::from("{");
        for (i, (name, target, _)) in map.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{}:{target}", serde_json::to_string(name).unwrap());
        }
        s.push('}');
        s
    };
    let index = match weight_map {
        Some(None) => format!("{{\"metadata\":{{\"total_size\":1}},\"weight_map\":{map_text}}}"),
        Some(Some(raw)) => format!("{{\"metadata\":{{}},\"weight_map\":{raw}}}"),
        None => "{\"metadata\":{}}".into(),
    };
    let index = apply_bytes(index.into_bytes(), &c.bytes);
    std::fs::write(dir.join("model.safetensors.index.json"), &index).unwrap();
    // A shard path that leaves the directory must be refused, naming the index. Of a
    // name given twice, the last entry counts (as when the JSON is read into a map).
    let mut effective: BTreeMap<&str, (&String, Option<Target>)> = BTreeMap::new();
    for (name, target, kind) in &map {
        effective.insert(name, (target, *kind));
    }
    let escaping = (c.bytes.is_empty() && weight_map == Some(None))
        .then(|| {
            effective
                .values()
                .find_map(|(t, k)| k.filter(|k| escapes(*k)).map(|k| ((*t).clone(), k)))
        })
        .flatten();
    let why = escaping.map(|(t, k)| {
        (
            format!("a shard path leaving the directory ({k:?})"),
            format!("the index names the shard {t}, outside the model directory"),
        )
    });
    check_load(
        &dir,
        why.as_ref().map(|(k, w)| (k.as_str(), w.as_str())),
        fx.config_ok.then_some("model.safetensors.index.json"),
    )
    .map_err(|mut f| {
        f.detail = format!(
            "{}\n  index: {}",
            f.detail,
            clip(&String::from_utf8_lossy(&index), 3000)
        );
        f
    })
}

fn fuzz_shard_index() {
    let strategy = (
        0..FIXTURES.len(),
        any::<bool>(),
        prop::collection::vec(idx_op(), 0..4),
        prop_oneof![4 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
    )
        .prop_map(|(fixture, split, ops, bytes)| IdxCase {
            fixture,
            split,
            ops,
            bytes,
        });
    fuzz(
        "shard_index",
        600,
        strategy,
        |c| c.clone(),
        |c| format!("{c:?}"),
        check_index,
    );
}

/// The fixtures' weights under a config with mutated sizes: a config that claims far more
/// layers or a far larger vocabulary than its weights must be refused cheaply.
fn fuzz_loader_config() {
    const SIZE_KEYS: &[&str] = &[
        "num_hidden_layers",
        "vocab_size",
        "hidden_size",
        "num_heads",
        "head_dim",
        "state_size",
        "n_groups",
        "conv_kernel",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "expand",
    ];
    let op = prop_oneof![
        3 => (0..SIZE_KEYS.len(), 0..27usize).prop_map(|(k, v)| (k, v, false)),
        1 => (0..SIZE_KEYS.len(), 0..FACTORS.len()).prop_map(|(k, f)| (k, f, true)),
    ];
    let strategy = (0..FIXTURES.len(), prop::collection::vec(op, 1..3));
    fuzz(
        "loader_config",
        600,
        strategy,
        |(fixture, ops)| {
            let base: serde_json::Value = serde_json::from_str(&FIXTURE[*fixture].config).unwrap();
            let ops: Vec<CfgOp> = ops
                .iter()
                .map(|&(k, v, scale)| {
                    let key = KeySel::Known(KEYS.iter().position(|x| *x == SIZE_KEYS[k]).unwrap());
                    if scale {
                        CfgOp::Scale(key, v)
                    } else {
                        CfgOp::Set(key, v)
                    }
                })
                .collect();
            (*fixture, mutate_config(&base, &ops))
        },
        |(fixture, config)| format!("{} with config.json:\n{config}", FIXTURES[*fixture]),
        |(fixture, config)| {
            let scratch = Scratch::new();
            std::fs::write(scratch.0.join("config.json"), config).unwrap();
            let (es, data) = entries(
                &FIXTURE[*fixture].tensors,
                FIXTURE[*fixture].metadata.as_deref(),
            );
            std::fs::write(
                scratch.0.join("model.safetensors"),
                safetensors_file(header_text(&es).as_bytes(), None, &data),
            )
            .unwrap();
            check_load(&scratch.0, None, None)
        },
    );
}

/// Files that are not regular files where the loader expects one: each is refused (or
/// skipped) quickly — a FIFO must not block the load.
fn special_files() {
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

// ---------------------------------------------------------------------------------------
// The tokenizer wrapper
// ---------------------------------------------------------------------------------------

static BIG_TOKENIZER: LazyLock<String> =
    LazyLock::new(|| bytes_to_text(read("assets/tokenizer.json")));

/// The embedded model's tokenizer, loaded once.
static EMBEDDED: LazyLock<Tokenizer> =
    LazyLock::new(|| Tokenizer::from_bytes(BIG_TOKENIZER.as_bytes(), None).unwrap());

/// A small byte-level BPE cut from the embedded one (fast to load): vocab (JSON object),
/// merges (JSON array), and its tokens.
static TINY: LazyLock<(String, String, Vec<String>)> = LazyLock::new(|| {
    let v: serde_json::Value = serde_json::from_str(&BIG_TOKENIZER).unwrap();
    let vocab = v["model"]["vocab"].as_object().unwrap();
    let keep: BTreeMap<&str, u64> = vocab
        .iter()
        .filter_map(|(t, id)| id.as_u64().filter(|&i| i < 320).map(|i| (t.as_str(), i)))
        .collect();
    let merges: Vec<serde_json::Value> = v["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| {
            let (a, b) = (m[0].as_str().unwrap_or(""), m[1].as_str().unwrap_or(""));
            keep.contains_key(a) && keep.contains_key(b) && keep.contains_key(&*format!("{a}{b}"))
        })
        .cloned()
        .collect();
    (
        serde_json::to_string(&keep).unwrap(),
        serde_json::Value::from(merges).to_string(),
        keep.keys().map(|s| s.to_string()).collect(),
    )
});

/// Models: BPE in its variants, WordPiece, WordLevel, Unigram, broken ones. `VOCAB`,
/// `MERGES` and `PIECES` are replaced by the tiny tokenizer's.
const MODELS: &[&str] = &[
    r###"{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","unk_token":"<unk>","byte_fallback":true,"fuse_unk":true,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":1.0,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":1.5,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":-0.5,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","vocab":VOCAB,"merges":[["zz","qq"],["a"]]}"###,
    r###"{"type":"BPE","vocab":VOCAB,"merges":["a b","a","a b c",""]}"###,
    r###"{"type":"BPE","vocab":{"a":4294967295,"b":4294967294,"ab":0},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","vocab":{"a":1,"b":1,"ab":1},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","vocab":{},"merges":[]}"###,
    r###"{"type":"BPE","vocab":{"a":-1},"merges":[]}"###,
    r###"{"type":"BPE","continuing_subword_prefix":"##","end_of_word_suffix":"</w>","vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","unk_token":"<|endoftext|>","fuse_unk":true,"vocab":{"<|endoftext|>":0,"a":1,"b":2,"ab":3},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","ignore_merges":true,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"WordPiece","unk_token":"[UNK]","continuing_subword_prefix":"##","max_input_chars_per_word":100,"vocab":{"[UNK]":0,"a":1,"##b":2,"b":3,"##a":4,"the":5}}"###,
    r###"{"type":"WordPiece","unk_token":"[MISSING]","continuing_subword_prefix":"","max_input_chars_per_word":0,"vocab":{"a":0,"b":1}}"###,
    r###"{"type":"WordPiece","unk_token":"[UNK]","continuing_subword_prefix":"##","max_input_chars_per_word":18446744073709551615,"vocab":{"[UNK]":4294967295}}"###,
    r###"{"type":"WordLevel","vocab":VOCAB,"unk_token":"<unk>"}"###,
    r###"{"type":"WordLevel","vocab":{"<unk>":0,"a":1},"unk_token":"<unk>"}"###,
    r###"{"type":"WordLevel","vocab":{},"unk_token":""}"###,
    r###"{"type":"Unigram","unk_id":0,"vocab":PIECES,"byte_fallback":false}"###,
    r###"{"type":"Unigram","unk_id":null,"vocab":PIECES,"byte_fallback":true}"###,
    r###"{"type":"Unigram","unk_id":4294967295,"vocab":PIECES}"###,
    r###"{"type":"Unigram","unk_id":0,"vocab":[]}"###,
    r###"{"type":"Unigram","unk_id":1,"vocab":[["<unk>",0.0],["a",1e308],["a",-1e308],["b",-3.4e38],["",-1.0]]}"###,
    r###"{"type":"Nope"}"###,
    r###"null"###,
];
const NORMALIZERS: &[&str] = &[
    "null",
    r###"{"type":"NFC"}"###,
    r###"{"type":"NFKD"}"###,
    r###"{"type":"Lowercase"}"###,
    r###"{"type":"Strip","strip_left":true,"strip_right":true}"###,
    r###"{"type":"StripAccents"}"###,
    r###"{"type":"Replace","pattern":{"String":""},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"("},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"a*"},"content":"bb"}"###,
    r###"{"type":"Replace","pattern":{"String":" "},"content":"▁"}"###,
    r###"{"type":"Prepend","prepend":""}"###,
    r###"{"type":"Prepend","prepend":"▁"}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":"AAAA"}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":""}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":"////////////////////////AAAA"}"###,
    r###"{"type":"BertNormalizer","clean_text":true,"handle_chinese_chars":true,"strip_accents":null,"lowercase":true}"###,
    r###"{"type":"Sequence","normalizers":[{"type":"NFD"},{"type":"StripAccents"},{"type":"Lowercase"}]}"###,
    r###"{"type":"ByteLevel"}"###,
    r###"{"type":"Nope"}"###,
];
const PRE_TOKENIZERS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"###,
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":false}"###,
    r###"{"type":"Whitespace"}"###,
    r###"{"type":"WhitespaceSplit"}"###,
    r###"{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}"###,
    r###"{"type":"Metaspace","replacement":"","prepend_scheme":"first","split":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"\\s*"},"behavior":"Isolated","invert":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"(?=a)"},"behavior":"MergedWithNext","invert":true}"###,
    r###"{"type":"Split","pattern":{"Regex":"(a+)+$"},"behavior":"Removed","invert":false}"###,
    r###"{"type":"Split","pattern":{"String":""},"behavior":"Contiguous","invert":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"(?<=x"},"behavior":"Isolated","invert":false}"###,
    r###"{"type":"Punctuation","behavior":"Isolated"}"###,
    r###"{"type":"Digits","individual_digits":true}"###,
    r###"{"type":"UnicodeScripts"}"###,
    r###"{"type":"CharDelimiterSplit","delimiter":"a"}"###,
    r###"{"type":"BertPreTokenizer"}"###,
    r###"{"type":"Sequence","pretokenizers":[{"type":"WhitespaceSplit"},{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}]}"###,
    r###"{"type":"Nope"}"###,
];
const POST_PROCESSORS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":true}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<|endoftext|>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],"special_tokens":{"<|endoftext|>":{"id":"<|endoftext|>","ids":[0],"tokens":["<|endoftext|>"]}}}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{"<s>":{"id":"<s>","ids":[4294967295,1],"tokens":["<s>"]}}}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<missing>","type_id":0}},{"Sequence":{"id":"A","type_id":4294967295}}],"pair":[{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{}}"###,
    r###"{"type":"TemplateProcessing","single":[],"pair":[],"special_tokens":{}}"###,
    r###"{"type":"BertProcessing","sep":["[SEP]",4294967295],"cls":["[CLS]",0]}"###,
    r###"{"type":"RobertaProcessing","sep":["</s>",2],"cls":["<s>",0],"trim_offsets":true,"add_prefix_space":true}"###,
    r###"{"type":"Sequence","processors":[{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},{"type":"BertProcessing","sep":["[SEP]",1],"cls":["[CLS]",0]}]}"###,
    r###"{"type":"Nope"}"###,
];
const DECODERS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"###,
    r###"{"type":"WordPiece","prefix":"##","cleanup":true}"###,
    r###"{"type":"WordPiece","prefix":"","cleanup":false}"###,
    r###"{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}"###,
    r###"{"type":"BPEDecoder","suffix":""}"###,
    r###"{"type":"ByteFallback"}"###,
    r###"{"type":"Fuse"}"###,
    r###"{"type":"Strip","content":" ","start":1000000,"stop":1000000}"###,
    r###"{"type":"Strip","content":"a","start":18446744073709551615,"stop":0}"###,
    r###"{"type":"Replace","pattern":{"String":""},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"[a-z]*"},"content":"xy"}"###,
    r###"{"type":"CTC","pad_token":"","word_delimiter_token":"","cleanup":true}"###,
    r###"{"type":"Sequence","decoders":[{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}"###,
    r###"{"type":"Nope"}"###,
];
const ADDED: &[&str] = &[
    "[]",
    r###"[{"id":0,"content":"<|endoftext|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}]"###,
    r###"[{"id":4294967295,"content":"<big>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}]"###,
    r###"[{"id":5,"content":"","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":false}]"###,
    r###"[{"id":0,"content":"a","single_word":true,"lstrip":true,"rstrip":true,"normalized":true,"special":false},{"id":0,"content":"b","single_word":false,"lstrip":false,"rstrip":false,"normalized":true,"special":true}]"###,
    r###"[{"id":1000000,"content":"aa","single_word":false,"lstrip":true,"rstrip":true,"normalized":true,"special":false},{"id":1000001,"content":"aaa","single_word":true,"lstrip":false,"rstrip":false,"normalized":false,"special":true},{"id":1000002,"content":" ","single_word":false,"lstrip":true,"rstrip":true,"normalized":true,"special":false}]"###,
    r###"[{"id":-1,"content":"x","special":true}]"###,
];
const TRUNCATIONS: &[&str] = &[
    "null",
    r###"{"direction":"Right","max_length":0,"strategy":"LongestFirst","stride":0}"###,
    r###"{"direction":"Left","max_length":2,"strategy":"OnlyFirst","stride":5}"###,
    r###"{"direction":"Right","max_length":1,"strategy":"LongestFirst","stride":1}"###,
    r###"{"direction":"Right","max_length":18446744073709551615,"strategy":"OnlySecond","stride":18446744073709551615}"###,
];
const PADDINGS: &[&str] = &[
    "null",
    r###"{"strategy":"BatchLongest","direction":"Right","pad_to_multiple_of":null,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":{"Fixed":16},"direction":"Left","pad_to_multiple_of":null,"pad_id":4294967295,"pad_type_id":0,"pad_token":""}"###,
    r###"{"strategy":{"Fixed":0},"direction":"Right","pad_to_multiple_of":0,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":"BatchLongest","direction":"Right","pad_to_multiple_of":7,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":{"Fixed":100000000},"direction":"Right","pad_to_multiple_of":null,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
];

#[derive(Clone, Debug)]
struct TokCase {
    /// Indices into MODELS, NORMALIZERS, PRE_TOKENIZERS, POST_PROCESSORS, DECODERS, ADDED,
    /// TRUNCATIONS, PADDINGS.
    parts: [usize; 8],
    bytes: Vec<ByteOp>,
    texts: Vec<String>,
    ids: Vec<u32>,
}

fn tiny_json(parts: &[usize; 8]) -> String {
    let (vocab, merges, tokens) = &*TINY;
    let pieces: Vec<(String, f64)> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), -(i as f64) / 10.0))
        .collect();
    let pieces = serde_json::to_string(&pieces).unwrap();
    let model = MODELS[parts[0]]
        .replace("VOCAB", vocab)
        .replace("MERGES", merges)
        .replace("PIECES", &pieces);
    format!(
        r#"{{"version":"1.0","truncation":{},"padding":{},"added_tokens":{},"normalizer":{},"pre_tokenizer":{},"post_processor":{},"decoder":{},"model":{model}}}"#,
        TRUNCATIONS[parts[6]],
        PADDINGS[parts[7]],
        ADDED[parts[5]],
        NORMALIZERS[parts[1]],
        PRE_TOKENIZERS[parts[2]],
        POST_PROCESSORS[parts[3]],
        DECODERS[parts[4]],
    )
}

/// Text to encode: arbitrary Unicode, the special tokens' pieces, long runs.
fn text() -> impl Strategy<Value = String> {
    const PIECES: &[&str] = &[
        "<|endoftext|>",
        "<|",
        "|>",
        "\u{0}",
        "\u{feff}",
        "\r\n",
        " ",
        "   ",
        "é",
        "e\u{301}",
        "😀",
        "\u{10FFFF}",
        "\u{200d}",
        "Ġ",
        "▁",
        "##",
        "[UNK]",
        "<unk>",
        "a",
        "aa",
        "the",
        "ﬁ",
        "İ",
        "ß",
        "\u{fffd}",
        "<0xFF>",
        "x",
    ];
    prop_oneof![
        3 => any::<String>(),
        3 => prop::collection::vec(prop::sample::select(PIECES), 0..24).prop_map(|v| v.concat()),
        1 => (prop::sample::select(PIECES), 0usize..20_000).prop_map(|(p, n)| p.repeat(n)),
        1 => "[a-z <|>0-9]{0,64}",
    ]
}

fn ids(vocab: u32) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(
        prop_oneof![
            6 => 0..vocab + 20,
            1 => Just(u32::MAX),
            1 => Just(1u32 << 31),
            1 => any::<u32>(),
        ],
        0..48,
    )
}

/// Encode and decode through every entry point of the wrapper: no panic.
fn exercise(tok: &Tokenizer, texts: &[String], ids: &[u32]) -> Check {
    for t in texts {
        if let Ok(enc) = tok.encode(t) {
            let _ = tok.decode(&enc);
            let mut s = tok.stream();
            for &id in enc.iter().take(256) {
                let _ = s.step(tok, id);
            }
        }
        let _ = tok.encode_with(t, false);
    }
    let _ = tok.decode(ids);
    let _ = tok.vocab_size();
    let mut s = tok.stream();
    for &id in ids {
        let _ = s.step(tok, id);
    }
    Ok(())
}

fn fuzz_tokenizer_embedded() {
    let vocab = EMBEDDED.vocab_size() as u32;
    fuzz(
        "tokenizer_embedded",
        600,
        (prop::collection::vec(text(), 1..4), ids(vocab)),
        |c| c.clone(),
        |(texts, ids)| format!("texts {texts:?}\nids {ids:?}"),
        |(texts, ids)| exercise(&EMBEDDED, texts, ids),
    );
}

fn fuzz_tokenizer_json() {
    let parts = (
        0..MODELS.len(),
        0..NORMALIZERS.len(),
        0..PRE_TOKENIZERS.len(),
        0..POST_PROCESSORS.len(),
        0..DECODERS.len(),
        0..ADDED.len(),
        0..TRUNCATIONS.len(),
        0..PADDINGS.len(),
    )
        .prop_map(|(a, b, c, d, e, f, g, h)| [a, b, c, d, e, f, g, h]);
    let strategy = (
        parts,
        prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..4)],
        prop::collection::vec(text(), 1..3),
        ids(400),
    )
        .prop_map(|(parts, bytes, texts, ids)| TokCase {
            parts,
            bytes,
            texts,
            ids,
        });
    fuzz(
        "tokenizer_json",
        800,
        strategy,
        |c| {
            (
                apply_bytes(tiny_json(&c.parts).into_bytes(), &c.bytes),
                c.clone(),
            )
        },
        |(_, c)| {
            let p = &c.parts;
            format!(
                "tokenizer.json: model {}\n  normalizer {}\n  pre_tokenizer {}\n  \
                 post_processor {}\n  decoder {}\n  added_tokens {}\n  truncation {}\n  \
                 padding {}\n  then bytes {:?}\ntexts {:?}\nids {:?}",
                MODELS[p[0]],
                NORMALIZERS[p[1]],
                PRE_TOKENIZERS[p[2]],
                POST_PROCESSORS[p[3]],
                DECODERS[p[4]],
                ADDED[p[5]],
                TRUNCATIONS[p[6]],
                PADDINGS[p[7]],
                c.bytes,
                c.texts,
                c.ids
            )
        },
        |(json, c)| match Tokenizer::from_bytes(json, None) {
            Ok(tok) => exercise(&tok, &c.texts, &c.ids),
            Err(_) => Ok(()),
        },
    );
}

/// The embedded tokenizer.json (4096 tokens) with a component swapped, a vocab id or merge
/// broken, or bytes edited: slower to load, so fewer cases.
fn fuzz_tokenizer_big() {
    #[derive(Clone, Debug)]
    enum BigOp {
        Part(usize, usize),
        VocabId(Index, usize),
        DropToken(Index),
        ModelField(usize),
    }
    const IDS: &[&str] = &["4294967295", "4096", "0", "-1", "1.5", "null", "\"7\""];
    const MODEL_FIELDS: &[(&str, &str)] = &[
        ("dropout", "1.0"),
        ("dropout", "2.0"),
        ("byte_fallback", "true"),
        ("unk_token", "\"<unk>\""),
        ("unk_token", "\"<|endoftext|>\""),
        ("ignore_merges", "true"),
        ("type", "\"WordPiece\""),
        ("type", "\"Unigram\""),
        ("merges", "[]"),
        ("vocab", "{}"),
        ("continuing_subword_prefix", "\"Ġ\""),
    ];
    let op = prop_oneof![
        (0..7usize, any::<usize>()).prop_map(|(p, v)| BigOp::Part(p, v)),
        (any::<Index>(), 0..IDS.len()).prop_map(|(i, v)| BigOp::VocabId(i, v)),
        any::<Index>().prop_map(BigOp::DropToken),
        (0..MODEL_FIELDS.len()).prop_map(BigOp::ModelField),
    ];
    let strategy = (
        prop::collection::vec(op, 0..3),
        prop_oneof![2 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop::collection::vec(text(), 1..3),
        ids(4200),
    );
    static BASE: LazyLock<serde_json::Value> =
        LazyLock::new(|| serde_json::from_str(&BIG_TOKENIZER).unwrap());
    fuzz(
        "tokenizer_big",
        60,
        strategy,
        |(ops, bytes, texts, ids)| {
            let mut v = BASE.clone();
            let mut raw = Raw(Vec::new());
            for op in ops {
                match op {
                    BigOp::Part(p, i) => {
                        let (key, list) = [
                            ("normalizer", NORMALIZERS),
                            ("pre_tokenizer", PRE_TOKENIZERS),
                            ("post_processor", POST_PROCESSORS),
                            ("decoder", DECODERS),
                            ("added_tokens", ADDED),
                            ("truncation", TRUNCATIONS),
                            ("padding", PADDINGS),
                        ][*p];
                        v[key] = raw.put(list[i % list.len()].into());
                    }
                    BigOp::VocabId(i, id) => {
                        let vocab = v["model"]["vocab"].as_object_mut().unwrap();
                        if !vocab.is_empty() {
                            let key = vocab.keys().nth(i.index(vocab.len())).unwrap().clone();
                            vocab[&key] = raw.put(IDS[*id].into());
                        }
                    }
                    BigOp::DropToken(i) => {
                        let vocab = v["model"]["vocab"].as_object_mut().unwrap();
                        if !vocab.is_empty() {
                            let key = vocab.keys().nth(i.index(vocab.len())).unwrap().clone();
                            vocab.remove(&key);
                        }
                    }
                    BigOp::ModelField(f) => {
                        let (k, val) = MODEL_FIELDS[*f];
                        v["model"][k] = raw.put(val.into());
                    }
                }
            }
            let json = apply_bytes(raw.render(&v).into_bytes(), bytes);
            (
                json,
                format!("{ops:?} {bytes:?}"),
                texts.clone(),
                ids.clone(),
            )
        },
        |(_, ops, texts, ids)| {
            format!("embedded tokenizer.json with {ops}\ntexts {texts:?}\nids {ids:?}")
        },
        |(json, _, texts, ids)| match Tokenizer::from_bytes(json, None) {
            Ok(tok) => exercise(&tok, texts, ids),
            Err(_) => Ok(()),
        },
    );
}

/// `tokenizer_config.json` (end-of-sequence token, chat template) through `from_dir`, and
/// the template rendered over arbitrary messages.
fn fuzz_tokenizer_config() {
    const TOKEN_VALUES: &[&str] = &[
        "\"<|endoftext|>\"",
        "\"</s>\"",
        "\"\"",
        "{\"content\":\"<|endoftext|>\",\"lstrip\":false}",
        "{\"content\":5}",
        "17",
        "[]",
        "null",
        "{}",
    ];
    const TEMPLATES: &[&str] = &[
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content.strip() }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}{% for m in messages %}{{ loop.index }}:{{ m.content|trim }}{% endfor %}",
        "{{ messages[100].content }}{{ messages|length }}{{ messages|tojson }}",
        "{% for i in range(1000000000) %}x{% endfor %}",
        "{{ 'ab' * 1000000000 }}",
        "{{ messages * 100000000 }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{{ a.content ~ b.content ~ c.content }}{% endfor %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(x='') %}{% for m in messages %}{% set ns.x = ns.x ~ ns.x ~ m.content %}{% endfor %}{{ ns.x|length }}",
        "{% for m in messages %}{{ m.content.split(' ')|join('|') }}{{ m.role.upper() }}{% endfor %}",
        "{% for %}",
        "{{ 1 / 0 }}{{ messages[-1] }}",
        "{{ (messages|first).content[1000000000:] }}",
    ];
    #[derive(Clone, Debug)]
    struct Case {
        eos: Option<usize>,
        bos: Option<usize>,
        template: Option<usize>,
        template_bytes: Vec<ByteOp>,
        config_bytes: Vec<ByteOp>,
        messages: Vec<(String, String)>,
        add_generation_prompt: bool,
    }
    let strategy = (
        prop::option::of(0..TOKEN_VALUES.len()),
        prop::option::of(0..TOKEN_VALUES.len()),
        prop::option::of(0..TEMPLATES.len()),
        prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop_oneof![6 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop::collection::vec(
            (
                prop_oneof![
                    Just("user".to_string()),
                    Just("assistant".to_string()),
                    Just("system".to_string()),
                    any::<String>()
                ],
                text(),
            ),
            0..5,
        ),
        any::<bool>(),
    )
        .prop_map(
            |(
                eos,
                bos,
                template,
                template_bytes,
                config_bytes,
                messages,
                add_generation_prompt,
            )| Case {
                eos,
                bos,
                template,
                template_bytes,
                config_bytes,
                messages,
                add_generation_prompt,
            },
        );
    fuzz(
        "tokenizer_config",
        600,
        strategy,
        |c| {
            let mut fields = Vec::new();
            if let Some(e) = c.eos {
                fields.push(format!("\"eos_token\":{}", TOKEN_VALUES[e]));
            }
            if let Some(b) = c.bos {
                fields.push(format!("\"bos_token\":{}", TOKEN_VALUES[b]));
            }
            if let Some(t) = c.template {
                let t = bytes_to_text(apply_bytes(
                    TEMPLATES[t].as_bytes().to_vec(),
                    &c.template_bytes,
                ));
                fields.push(format!(
                    "\"chat_template\":{}",
                    serde_json::to_string(&t).unwrap()
                ));
            }
            let config = format!("{{{}}}", fields.join(","));
            (apply_bytes(config.into_bytes(), &c.config_bytes), c.clone())
        },
        |(config, c)| {
            format!(
                "tokenizer_config.json: {}\nmessages {:?}, add_generation_prompt {}",
                String::from_utf8_lossy(config),
                c.messages,
                c.add_generation_prompt
            )
        },
        |(config, c)| {
            let scratch = Scratch::new();
            std::fs::write(
                scratch.0.join("tokenizer.json"),
                tiny_json(&[0, 0, 1, 2, 1, 1, 0, 0]),
            )
            .unwrap();
            std::fs::write(scratch.0.join("tokenizer_config.json"), config).unwrap();
            if let Ok(Some(tok)) = Tokenizer::from_dir(&scratch.0) {
                let _ = tok.render_chat(&c.messages, c.add_generation_prompt);
                if let Some(eos) = tok.eos {
                    let _ = tok.decode(&[eos]);
                }
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------
// The targets (each in its own child process; see `isolated`)
// ---------------------------------------------------------------------------------------

#[test]
fn config_values() {
    isolated("config_values", fuzz_config_values);
}

#[test]
fn config_patterns() {
    isolated("config_patterns", fuzz_config_patterns);
}

#[test]
fn config_bytes() {
    isolated("config_bytes", fuzz_config_bytes);
}

#[test]
fn safetensors_header() {
    isolated("safetensors_header", fuzz_safetensors_header);
}

#[test]
fn safetensors_bytes() {
    isolated("safetensors_bytes", fuzz_safetensors_bytes);
}

#[test]
fn shard_index() {
    isolated("shard_index", fuzz_shard_index);
}

#[test]
fn loader_config() {
    isolated("loader_config", fuzz_loader_config);
}

#[test]
fn loader_special_files() {
    isolated("loader_special_files", special_files);
}

#[test]
fn tokenizer_embedded() {
    isolated("tokenizer_embedded", fuzz_tokenizer_embedded);
}

#[test]
fn tokenizer_json() {
    isolated("tokenizer_json", fuzz_tokenizer_json);
}

#[test]
fn tokenizer_big() {
    isolated("tokenizer_big", fuzz_tokenizer_big);
}

#[test]
fn tokenizer_config() {
    isolated("tokenizer_config", fuzz_tokenizer_config);
}
