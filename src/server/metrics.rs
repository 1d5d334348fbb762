//! Counters the server exports at `/metrics` in Prometheus' text format.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::prefix_cache::CacheStats;

#[derive(Default)]
pub struct Metrics {
    /// HTTP requests answered, by status class.
    pub requests_ok: AtomicU64,
    pub requests_client_error: AtomicU64,
    pub requests_server_error: AtomicU64,
    /// Requests refused because the queue was full.
    pub rejected: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    /// Requests whose client went away before the end (while queued or running).
    pub cancelled: AtomicU64,
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Time spent in prefill and decode steps.
    pub prefill_ns: AtomicU64,
    pub decode_ns: AtomicU64,
    /// The prefix cache's tiers, as of the engine's last report.
    pub cache: Mutex<CacheStats>,
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP mamba2_{name} {help}");
            let _ = writeln!(out, "# TYPE mamba2_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "mamba2_{name}{labels} {v}");
            }
        };
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        counter(
            "http_requests_total",
            "HTTP requests answered, by status class.",
            "counter",
            &[
                ("{class=\"2xx\"}", get(&self.requests_ok)),
                ("{class=\"4xx\"}", get(&self.requests_client_error)),
                ("{class=\"5xx\"}", get(&self.requests_server_error)),
            ],
        );
        counter(
            "requests_rejected_total",
            "Requests refused with 503 because the queue was full.",
            "counter",
            &[("", get(&self.rejected))],
        );
        counter(
            "requests_completed_total",
            "Generations that ran to their end.",
            "counter",
            &[("", get(&self.completed))],
        );
        counter(
            "requests_failed_total",
            "Generations that ended in an error.",
            "counter",
            &[("", get(&self.failed))],
        );
        counter(
            "requests_cancelled_total",
            "Requests whose client went away before the reply ended, queued or running.",
            "counter",
            &[("", get(&self.cancelled))],
        );
        counter(
            "queue_depth",
            "Requests waiting for a sequence slot.",
            "gauge",
            &[("", self.queued.load(Ordering::Relaxed) as f64)],
        );
        counter(
            "active_slots",
            "Sequences in flight.",
            "gauge",
            &[("", self.active.load(Ordering::Relaxed) as f64)],
        );
        counter(
            "prompt_tokens_total",
            "Prompt tokens of started requests.",
            "counter",
            &[("", get(&self.prompt_tokens))],
        );
        counter(
            "prompt_tokens_cached_total",
            "Prompt tokens restored from the prefix cache instead of fed.",
            "counter",
            &[("", get(&self.cached_tokens))],
        );
        counter(
            "generated_tokens_total",
            "Tokens generated.",
            "counter",
            &[("", get(&self.generated_tokens))],
        );
        let decode_s = get(&self.decode_ns) / 1e9;
        counter(
            "decode_tokens_per_second",
            "Generated tokens over the time spent decoding, since the start.",
            "gauge",
            &[(
                "",
                if decode_s > 0.0 {
                    get(&self.generated_tokens) / decode_s
                } else {
                    0.0
                },
            )],
        );
        counter(
            "prefill_seconds_total",
            "Time spent reading prompts.",
            "counter",
            &[("", get(&self.prefill_ns) / 1e9)],
        );
        counter(
            "prefix_cache_hits_total",
            "Requests that resumed from a cached prefix.",
            "counter",
            &[("", get(&self.cache_hits))],
        );
        counter(
            "prefix_cache_misses_total",
            "Requests that found no cached prefix.",
            "counter",
            &[("", get(&self.cache_misses))],
        );
        let cache = self.cache.lock().map(|c| c.clone()).unwrap_or_default();
        let tiers = |v: [f64; 3]| {
            [
                ("{tier=\"device\"}", v[0]),
                ("{tier=\"host\"}", v[1]),
                ("{tier=\"disk\"}", v[2]),
            ]
        };
        counter(
            "prefix_cache_bytes",
            "Bytes the prefix cache holds, by tier.",
            "gauge",
            &tiers(cache.bytes.map(|b| b as f64)),
        );
        counter(
            "prefix_cache_entries",
            "Entries of the prefix cache, by tier.",
            "gauge",
            &tiers(cache.entries.map(|n| n as f64)),
        );
        out
    }
}
