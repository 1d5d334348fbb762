//! `mamba2 serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of one engine
//! thread that runs many sequences with a prefix cache (`engine`). The HTTP side never
//! touches the device: it parses, tokenizes, queues and relays, so nothing a client sends
//! reaches the engine unchecked, and a slow or vanished client only drops its own channel.

pub mod api;
pub mod auth;
pub mod engine;
pub mod listen;
pub mod metrics;
pub mod request;
pub mod stop;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

use self::engine::{Engine, Job};
use self::metrics::Metrics;
use crate::error::{Error, Result};
use crate::prefix_cache::PrefixCache;
use crate::session::Backend;
use crate::tokenizer::Tokenizer;

/// The longest `ServerConfig::write_timeout` (a day; `--write-timeout`'s bound too).
pub const MAX_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(86_400);

/// How the server behaves (the engine's own settings live in `Engine`).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id `/v1/models` reports and responses carry.
    pub model_name: String,
    /// Sequences in flight at once.
    pub slots: usize,
    /// Requests that may wait for a slot; beyond it, 503.
    pub queue: usize,
    /// `max_tokens` of a request that gives none.
    pub max_tokens: usize,
    /// The most `max_tokens` a request may ask for.
    pub max_completion: usize,
    /// Longest prompt taken, in tokens.
    pub max_prompt: usize,
    /// Required as `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Largest request body, in bytes.
    pub body_limit: usize,
    /// Prompt tokens read per engine step (`engine::PREFILL_CHUNK`; tests make it small to
    /// read a short prompt in many steps between the other streams' tokens).
    pub prefill_chunk: usize,
    /// How long a connection may take to send a whole request head (also while idle
    /// between requests) before it is closed (`listen`).
    pub header_timeout: std::time::Duration,
    /// How long a request's body may take to arrive once its head has.
    pub body_timeout: std::time::Duration,
    /// How long a write to a client may wait for it to read before its connection is
    /// closed (and its request cancelled): a client that stopped reading a stream.
    pub write_timeout: std::time::Duration,
    /// How long a stop waits for the open requests to finish (a stream to a client that
    /// stopped reading never would) before it closes their connections.
    pub shutdown_grace: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_name: "mamba2".into(),
            slots: 4,
            queue: 64,
            max_tokens: 512,
            max_completion: 65536,
            max_prompt: 65536,
            api_key: None,
            body_limit: 16 << 20,
            prefill_chunk: engine::PREFILL_CHUNK,
            header_timeout: std::time::Duration::from_secs(30),
            body_timeout: std::time::Duration::from_secs(60),
            write_timeout: std::time::Duration::from_secs(60),
            shutdown_grace: std::time::Duration::from_secs(30),
        }
    }
}

/// What the handlers share.
pub struct App {
    pub config: ServerConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<Metrics>,
    jobs: Mutex<mpsc::Sender<Job>>,
    /// Requests past their first checks and not yet let go of by the engine: being
    /// tokenized, queued or running (`api::Place`).
    in_flight: Arc<AtomicUsize>,
    /// Prompts being tokenized at once: a 16 MiB prompt takes hundreds of MB while the
    /// `tokenizers` crate splits it, so no more run together than the cores can serve.
    tokenizing: Arc<tokio::sync::Semaphore>,
    next_id: AtomicU64,
    seed: AtomicU64,
    stop_ids: Vec<u32>,
    vocab: usize,
    started: u64,
}

impl App {
    /// A fresh seed for a request that gives none (from the clock at start, then counted).
    fn next_seed(&self) -> u64 {
        self.seed
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
    }
}

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<JoinHandle<std::io::Result<()>>>,
    engine: Option<JoinHandle<()>>,
}

impl Server {
    /// Starts the engine thread and the HTTP server on `listener` (already bound: a test
    /// binds port 0 and reads the address back).
    pub fn start(
        listener: std::net::TcpListener,
        mut config: ServerConfig,
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        cache: PrefixCache,
    ) -> Result<Server> {
        // The write timer adds the timeout to the current instant, which panics past the
        // clock's range; 0 would fail every write that waits at all.
        let shortest = std::time::Duration::from_millis(1);
        if !(shortest..=MAX_WRITE_TIMEOUT).contains(&config.write_timeout) {
            return Err(Error::InvalidInput(format!(
                "write_timeout: {:?} is outside {shortest:?} ..= {MAX_WRITE_TIMEOUT:?}",
                config.write_timeout
            )));
        }
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("listener", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener", e))?;
        if let Some(ctx) = backend.context() {
            config.max_prompt = config.max_prompt.min(ctx.saturating_sub(1).max(1));
        }
        let tokenizer = Arc::new(tokenizer);
        let metrics = Arc::new(Metrics::default());
        let (tx, rx) = mpsc::channel();
        let vocab = backend.config().vocab_size;
        let engine = Engine {
            backend,
            tokenizer: tokenizer.clone(),
            cache,
            metrics: metrics.clone(),
            slots: config.slots,
            prefill_chunk: config.prefill_chunk,
        };
        let engine = std::thread::Builder::new()
            .name("mamba2-engine".into())
            .spawn(move || engine.run(rx))
            .map_err(|e| Error::io("engine thread", e))?;
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let app = Arc::new(App {
            // The tokens that end a turn in `mamba2 chat` too: the EOS and the chat
            // template's end-of-turn token where that is another one.
            stop_ids: crate::chat::stop_ids(&tokenizer),
            config: config.clone(),
            tokenizer,
            metrics,
            jobs: Mutex::new(tx),
            in_flight: Arc::new(AtomicUsize::new(0)),
            tokenizing: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)),
            )),
            next_id: AtomicU64::new(1),
            seed: AtomicU64::new(started.wrapping_mul(0x2545_f491_4f6c_dd1d)),
            vocab,
            started,
        });
        let timers = listen::Timers {
            header: config.header_timeout,
            write: config.write_timeout,
            grace: config.shutdown_grace,
        };
        let router = Router::new()
            .route("/v1/chat/completions", post(api::chat))
            .route("/v1/completions", post(api::completions))
            .route("/v1/models", get(api::models))
            .route("/health", get(api::health))
            .route("/metrics", get(api::metrics))
            .fallback(api::not_found)
            // After the routes: it applies to those already added.
            .method_not_allowed_fallback(api::method_not_allowed)
            .layer(DefaultBodyLimit::max(config.body_limit))
            .layer(axum::middleware::from_fn({
                let app = app.clone();
                move |req, next| listen::body_deadline(app.clone(), req, next)
            }))
            .with_state(app);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let http = std::thread::Builder::new()
            .name("mamba2-http".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    listen::serve(listener, router, timers, async move {
                        let _ = stop_rx.await;
                    })
                    .await
                })
                // (Dropping the runtime here drops the connections a stop gave up on.)
            })
            .map_err(|e| Error::io("http thread", e))?;
        Ok(Server {
            addr,
            shutdown: Some(stop_tx),
            http: Some(http),
            engine: Some(engine),
        })
    }

    /// Stops taking connections, lets the open ones finish for at most
    /// `ServerConfig::shutdown_grace` (then closes them), then stops the engine (which
    /// writes its prefix cache to the cache directory).
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    /// Waits until the HTTP server ends on its own (it does not, short of an error) or
    /// `signal` resolves, then stops as `stop` does.
    pub fn wait(mut self, signal: impl std::future::Future<Output = ()>) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("runtime", e))?;
        rt.block_on(signal);
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.http.take() {
            match h.join() {
                Ok(r) => r.map_err(|e| Error::io("http server", e))?,
                Err(_) => return Err(Error::Gpu("the HTTP thread panicked".into())),
            }
        }
        // The router (and with it the job sender) is gone: the engine drains and ends.
        if let Some(e) = self.engine.take()
            && e.join().is_err()
        {
            return Err(Error::Gpu("the engine thread panicked".into()));
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}
