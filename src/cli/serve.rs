//! `mamba2 serve`: the OpenAI-compatible HTTP server (see `mamba2_wgpu::server`).

use std::net::TcpListener;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::server::{Server, ServerConfig};
use mamba2_wgpu::state_file::StateDtype;

use super::{EngineArgs, ModelArgs, check_at_least, note_unused_ctx, parse_bytes, state_key};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to bind. The default takes connections from this machine only; anything
    /// else exposes the model to the network (consider --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the one chosen is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Hybrid models: tokens each sequence's KV caches hold.
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// Sequences in flight at once (the others wait in the queue).
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// Requests that may wait for a slot; beyond them a request gets 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// max_tokens of a request that gives none.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// The most max_tokens a request may ask for (more gets a 400): a reply holds its slot
    /// until it ends.
    #[arg(long, default_value_t = 65536, value_name = "N")]
    max_completion: usize,
    /// Longest prompt taken, in tokens (hybrids: also capped by the context).
    #[arg(long, default_value_t = 65536)]
    max_prompt: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health (default: the
    /// MAMBA2_API_KEY environment variable, if set).
    #[arg(long, env = "MAMBA2_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model id clients see (default: the model directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Host memory for prefix-cache states (0 turns the host tier off), e.g. 4G.
    #[arg(long, default_value = "4G", value_parser = parse_bytes)]
    cache_mem: u64,
    /// Device memory for prefix-cache snapshots (0: none), e.g. 8G [default: 4G]. Each
    /// request leaves up to two entries (its prompt's end, its reply's end) of one state
    /// each (Codestral: 276 MB); an entry moved to host memory is read back while the other
    /// requests wait. (The CPU reference keeps its snapshots in host memory.)
    #[arg(long, value_parser = parse_bytes)]
    cache_device_mem: Option<u64>,
    /// Directory where prefix-cache entries spill and survive restarts (files from another
    /// model or version found there are refused and left alone).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Bytes of files in --cache-dir, e.g. 32G [default: 32G]; 0 keeps no file there (and
    /// removes this model's files found there).
    #[arg(long, value_parser = parse_bytes)]
    cache_disk: Option<u64>,
    /// How host and disk entries store their values: f32 (exact) or f16 (half the bytes).
    #[arg(long, default_value = "f32")]
    cache_dtype: StateDtype,
    /// Long prompts leave a cache entry every N tokens (0: only at prompt and reply ends).
    #[arg(long, default_value_t = 1024, value_name = "N")]
    cache_every: usize,
    /// Seconds a stop (Ctrl-C, SIGTERM) waits for the replies in flight to finish before it
    /// closes their connections (a client that stopped reading would hold it for ever).
    #[arg(long, default_value_t = 30, value_name = "SECS")]
    shutdown_grace: u64,
    /// Seconds a write to a client may wait for it to read before its connection is closed
    /// and its request cancelled (a client that stopped reading a stream); 1 to 86400.
    #[arg(long, default_value_t = 60, value_name = "SECS",
          value_parser = clap::value_parser!(u64).range(1..=mamba2_wgpu::server::MAX_WRITE_TIMEOUT.as_secs()))]
    write_timeout: u64,
}

impl ServeArgs {
    fn check(&self) -> anyhow::Result<()> {
        check_at_least("--slots", self.slots, 1)?;
        check_at_least("--max-tokens", self.max_tokens, 1)?;
        if self.max_tokens > self.max_completion {
            anyhow::bail!(
                "--max-tokens {} is more than --max-completion {}",
                self.max_tokens,
                self.max_completion
            );
        }
        check_at_least("--max-prompt", self.max_prompt, 1)?;
        // Clients name the model in requests and read it in /v1/models: an empty or
        // blank id could not be named back.
        if self.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            anyhow::bail!("--name: empty (it is the model id clients see)");
        }
        if let Some(ctx) = self.ctx {
            check_at_least("--ctx", ctx, 2)?;
        }
        if let Some(key) = &self.api_key {
            // (The key may come from the environment: both are named.)
            let flag = "--api-key (or MAMBA2_API_KEY)";
            if key.trim().is_empty() {
                anyhow::bail!("{flag}: empty");
            }
            // A client sends it in an HTTP header, whose value holds no control characters
            // but tab and whose ends are trimmed: such a key could never match.
            if let Some(c) = key.chars().find(|&c| c.is_control() && c != '\t') {
                anyhow::bail!(
                    "{flag}: {c:?} cannot be sent in an Authorization header, so no request \
                     could match the key"
                );
            }
            if key.trim_end() != key {
                anyhow::bail!(
                    "{flag}: ends in whitespace, which an Authorization header drops, so no \
                     request could match the key"
                );
            }
        }
        self.engine.check()?;
        self.model.require_tokenizer("serve needs one")
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    args.check()?;
    // Bind first: a taken port fails before the model is read.
    let listener = TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("--host {} --port {}: cannot bind", args.host, args.port))?;
    let (model, tokenizer) = args.model.load()?;
    note_unused_ctx(&model, args.ctx);
    let tokenizer = tokenizer.ok_or_else(|| args.model.no_tokenizer(&model, "serve needs one"))?;
    let mut backend = args.engine.open(&model, args.ctx)?;
    super::note_ignored(
        [(
            args.cache_device_mem.is_some() && backend.gpu().is_none(),
            "--cache-device-mem",
        )],
        "on the CPU reference (its cache entries live in host memory, under --cache-mem)",
    );
    super::note_ignored(
        [(
            args.cache_disk.is_some() && args.cache_dir.is_none(),
            "--cache-disk",
        )],
        "without --cache-dir",
    );
    let defaults = CacheConfig::default();
    let disk_bytes = args.cache_disk.unwrap_or(defaults.disk_bytes);
    if disk_bytes == 0
        && let Some(dir) = &args.cache_dir
    {
        eprintln!(
            "note: --cache-disk 0: no prefix-cache file is kept in {} (this model's files \
             found there are removed)",
            dir.display()
        );
    }
    let key = state_key(&model, &args.engine, backend.as_mut());
    let cache = PrefixCache::open(
        key,
        &model.config,
        CacheConfig {
            device_bytes: args.cache_device_mem.unwrap_or(defaults.device_bytes),
            host_bytes: args.cache_mem,
            dir: args.cache_dir.clone(),
            disk_bytes,
            dtype: args.cache_dtype,
            every: args.cache_every,
        },
        &mut |n| eprintln!("note: {n}"),
    )
    // (Every error of `open` is about the directory: its files, its lock.)
    .map_err(|e| match &args.cache_dir {
        Some(_) => anyhow::anyhow!("--cache-dir: {e}"),
        None => e.into(),
    })?;
    let stats = cache.stats();
    let name = args.name.clone().unwrap_or_else(|| {
        args.model
            .model
            .as_ref()
            .and_then(|p| p.file_name())
            .map_or(args.model.name(), |n| n.to_string_lossy().into_owned())
    });
    let describe = backend.describe();
    let config = ServerConfig {
        model_name: name.clone(),
        slots: args.slots,
        queue: args.queue,
        max_tokens: args.max_tokens,
        max_completion: args.max_completion,
        max_prompt: args.max_prompt,
        api_key: args.api_key.clone(),
        shutdown_grace: std::time::Duration::from_secs(args.shutdown_grace),
        write_timeout: std::time::Duration::from_secs(args.write_timeout),
        ..Default::default()
    };
    let server = Server::start(listener, config, backend, tokenizer, cache)?;
    eprintln!("{name} on {describe}");
    if stats.entries[2] > 0 {
        eprintln!(
            "prefix cache: {} entries found in {}",
            stats.entries[2],
            args.cache_dir
                .as_ref()
                .map_or(String::new(), |d| d.display().to_string())
        );
    }
    // Scripts (and the tests) read the address from this line.
    outln!("listening on http://{}", server.addr);
    // Ctrl-C or (Unix) SIGTERM, as a service manager sends: stop taking connections, let
    // the open ones finish, write the prefix cache to --cache-dir.
    server.wait(async {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    })?;
    eprintln!("stopped");
    Ok(())
}
