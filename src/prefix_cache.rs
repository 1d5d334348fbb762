//! The prefix cache: sequence states at exact positions, found by the longest prefix of a
//! new prompt. A recurrent state is exact at any position and of fixed size whatever the
//! length (a hybrid's KV caches add their rows), so a follow-up request or a new chat turn
//! restores the state at the end of the shared prefix and feeds only the rest.
//!
//! Entries are keyed by their token ids in a radix tree and live in three tiers: device
//! snapshots (a buffer copy to take or restore), host memory (`State<f32>`, or `State<f16>`
//! at half the bytes on request), and safetensors files in a directory (`state_file`), which outlive the
//! process: a new process lists them, refusing files made for another model. Each tier has a
//! byte budget; the least recently used entry moves down a tier when one is full, and off
//! the bottom when the disk is.

use std::any::Any;
use std::collections::HashMap;
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::session::Backend;
use crate::state::State;
use crate::state_file::{self, SavedState, StateDtype, StateKey};

/// Budgets and placement.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes of device memory for snapshots.
    pub device_bytes: u64,
    /// Bytes of host memory for states.
    pub host_bytes: u64,
    /// Where entries go when host memory is full, and where they survive a restart.
    pub dir: Option<PathBuf>,
    /// Bytes of files in `dir`.
    pub disk_bytes: u64,
    /// How host and disk entries store their values.
    pub dtype: StateDtype,
    /// Long prompts also leave an entry every this many tokens (0: only at prompt and
    /// reply ends).
    pub every: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            device_bytes: 4 << 30,
            host_bytes: 4 << 30,
            dir: None,
            disk_bytes: 32 << 30,
            dtype: StateDtype::F32,
            every: 1024,
        }
    }
}

/// Where an entry's state is.
enum Tier {
    /// A snapshot the backend took (restored with one copy).
    Device(Box<dyn Any + Send>),
    Host(HostState),
    Disk,
}

/// A host entry's values in the cache's dtype: f16 entries hold half the bytes of f32 ones
/// (widened back to f32 to restore or write out, which is exact).
enum HostState {
    F32(State<f32>),
    F16(State<half::f16>),
}

impl HostState {
    fn new(s: State<f32>, dtype: StateDtype) -> Self {
        match dtype {
            StateDtype::F32 => HostState::F32(s),
            StateDtype::F16 => HostState::F16(s.map(half::f16::from_f32)),
        }
    }

    /// Its values as f32: borrowed, or widened from f16.
    fn f32(&self) -> std::borrow::Cow<'_, State<f32>> {
        match self {
            HostState::F32(s) => std::borrow::Cow::Borrowed(s),
            HostState::F16(s) => std::borrow::Cow::Owned(s.map(half::f16::to_f32)),
        }
    }

    /// Bytes it holds in memory.
    fn bytes(&self) -> u64 {
        match self {
            HostState::F32(s) => s.bytes(4) as u64,
            HostState::F16(s) => s.bytes(2) as u64,
        }
    }
}

impl Tier {
    /// 0 device, 1 host, 2 disk (the order of `CacheStats`' arrays).
    fn index(&self) -> usize {
        match self {
            Tier::Device(_) => 0,
            Tier::Host(_) => 1,
            Tier::Disk => 2,
        }
    }
}

struct Entry {
    tokens: Vec<u32>,
    tier: Tier,
    /// Bytes in its tier.
    bytes: u64,
    /// Whether its file exists (then dropping it from memory loses nothing).
    file: Option<(PathBuf, u64)>,
    last_used: u64,
}

/// A radix tree over token ids: each edge holds a run of tokens; a node may hold an entry.
#[derive(Default)]
struct Node {
    edges: Vec<(Vec<u32>, Node)>,
    entry: Option<u64>,
}

impl Node {
    fn insert(&mut self, tokens: &[u32], id: u64) -> Option<u64> {
        if tokens.is_empty() {
            return self.entry.replace(id);
        }
        for (label, child) in self.edges.iter_mut() {
            let common = label.iter().zip(tokens).take_while(|(a, b)| a == b).count();
            if common == 0 {
                continue;
            }
            if common < label.len() {
                // Split the edge at the divergence.
                let tail = label.split_off(common);
                let old = std::mem::take(child);
                child.edges.push((tail, old));
            }
            return child.insert(&tokens[common..], id);
        }
        let leaf = Node {
            edges: Vec::new(),
            entry: Some(id),
        };
        self.edges.push((tokens.to_vec(), leaf));
        None
    }

    /// The deepest entry on the path of `tokens` no longer than `max`, with its length.
    fn longest(&self, tokens: &[u32], max: usize, depth: usize) -> Option<(usize, u64)> {
        let here = self.entry.filter(|_| depth <= max).map(|id| (depth, id));
        for (label, child) in &self.edges {
            if tokens.len() >= label.len() && tokens[..label.len()] == label[..] {
                let deeper = child.longest(&tokens[label.len()..], max, depth + label.len());
                return deeper.or(here);
            }
        }
        here
    }

    /// Removes the entry at exactly `tokens`; prunes nodes left empty.
    fn remove(&mut self, tokens: &[u32]) {
        if tokens.is_empty() {
            self.entry = None;
            return;
        }
        let Some(i) = self
            .edges
            .iter()
            .position(|(l, _)| tokens.len() >= l.len() && tokens[..l.len()] == l[..])
        else {
            return;
        };
        let n = self.edges[i].0.len();
        self.edges[i].1.remove(&tokens[n..]);
        let child = &mut self.edges[i].1;
        if child.entry.is_none() && child.edges.is_empty() {
            self.edges.remove(i);
        } else if child.entry.is_none() && child.edges.len() == 1 {
            let (tail, grandchild) = child.edges.pop().expect("one edge");
            let (label, _) = &mut self.edges[i];
            label.extend(tail);
            self.edges[i].1 = grandchild;
        }
    }
}

/// Counters for `/metrics` and the closing notes.
#[derive(Clone, Debug, Default)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens not fed thanks to hits.
    pub hit_tokens: u64,
    pub entries: [usize; 3],
    /// Bytes held in the device, host and disk tiers.
    pub bytes: [u64; 3],
    /// Files in the directory refused at start (another model, format or version).
    pub refused_files: usize,
}

/// The cache of one model on one backend.
pub struct PrefixCache {
    key: StateKey,
    config: ModelConfig,
    cfg: CacheConfig,
    root: Node,
    entries: HashMap<u64, Entry>,
    next_id: u64,
    clock: u64,
    stats: CacheStats,
    /// The directory's lock file, held while the cache lives: the entries' files are named
    /// by their tokens, so two processes on one directory would delete and overwrite each
    /// other's files and each count only its own against `--cache-disk`.
    _lock: Option<std::fs::File>,
}

impl PrefixCache {
    /// An empty cache; with a directory, the files in it made for this model (others are
    /// refused and left alone; `on_note` hears about each).
    pub fn open(
        key: StateKey,
        config: &ModelConfig,
        cfg: CacheConfig,
        on_note: &mut dyn FnMut(String),
    ) -> Result<Self> {
        let mut cache = PrefixCache {
            key,
            config: config.clone(),
            cfg,
            root: Node::default(),
            entries: HashMap::new(),
            next_id: 0,
            clock: 0,
            stats: CacheStats::default(),
            _lock: None,
        };
        if let Some(dir) = cache.cfg.dir.clone() {
            if dir.exists() && !dir.is_dir() {
                return Err(crate::Error::format(&dir, "is not a directory"));
            }
            std::fs::create_dir_all(&dir).map_err(|e| crate::Error::io(&dir, e))?;
            cache._lock = Some(lock_dir(&dir)?);
            let mut files = Vec::new();
            for e in std::fs::read_dir(&dir).map_err(|e| crate::Error::io(&dir, e))? {
                let path = e.map_err(|e| crate::Error::io(&dir, e))?.path();
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // A file half written when a process stopped (the lock says none writes now).
                if name.ends_with(state_file::PARTIAL) && path.is_file() {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
                    continue;
                }
                let meta = std::fs::metadata(&path).map_err(|e| crate::Error::io(&path, e))?;
                match state_file::read_header(&path, &cache.key) {
                    Ok(h) if !h.tokens.is_empty() => {
                        let modified = meta.modified().ok();
                        files.push((modified, path, h.tokens, meta.len()));
                    }
                    Ok(_) => {}
                    Err(err) => {
                        cache.stats.refused_files += 1;
                        on_note(format!("prefix cache: not using {err}"));
                    }
                }
            }
            // Oldest first, so the newest are the most recently used.
            files.sort_by_key(|f| f.0);
            for (_, path, tokens, len) in files {
                let id = cache.new_id();
                // Two files of the same tokens (one copied in by hand): the newer one stays.
                if let Some(old) = cache.root.insert(&tokens, id)
                    && let Some(Entry {
                        file: Some((old_path, _)),
                        ..
                    }) = cache.entries.remove(&old)
                {
                    let _ = std::fs::remove_file(old_path);
                }
                cache.entries.insert(
                    id,
                    Entry {
                        tokens,
                        tier: Tier::Disk,
                        bytes: len,
                        file: Some((path, len)),
                        last_used: cache.clock,
                    },
                );
            }
            cache.evict_disk();
        }
        Ok(cache)
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.clock += 1;
        self.next_id
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Whether anything may be cached at all.
    pub fn enabled(&self) -> bool {
        self.cfg.device_bytes > 0 || self.cfg.host_bytes > 0 || self.cfg.dir.is_some()
    }

    pub fn stats(&self) -> CacheStats {
        let mut s = self.stats.clone();
        s.entries = [0; 3];
        s.bytes = [0; 3];
        for e in self.entries.values() {
            let t = e.tier.index();
            s.entries[t] += 1;
            s.bytes[t] += e.bytes;
            if let (Some((_, len)), false) = (&e.file, t == 2) {
                s.bytes[2] += len;
            }
        }
        s
    }

    /// Puts the state of the longest cached prefix of `tokens` (at most `max` tokens) into
    /// `backend` and returns its length; 0 (and the backend untouched) on a miss. An entry
    /// that cannot be read back is dropped and counts as a miss.
    pub fn resume(
        &mut self,
        tokens: &[u32],
        max: usize,
        backend: &mut dyn Backend,
        on_note: &mut dyn FnMut(String),
    ) -> usize {
        let Some((len, id)) = self.root.longest(tokens, max, 0).filter(|(l, _)| *l > 0) else {
            self.stats.misses += 1;
            return 0;
        };
        match self.restore(id, backend) {
            Ok(()) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += len as u64;
                len
            }
            Err(err) => {
                on_note(format!("prefix cache: dropping an entry: {err}"));
                self.remove(id);
                self.stats.misses += 1;
                0
            }
        }
    }

    fn restore(&mut self, id: u64, backend: &mut dyn Backend) -> Result<()> {
        self.clock += 1;
        let clock = self.clock;
        let e = self.entries.get_mut(&id).expect("entry of the tree");
        e.last_used = clock;
        match &e.tier {
            Tier::Device(snap) => backend.restore(snap.as_ref()),
            Tier::Host(state) => backend.restore(&*state.f32()),
            Tier::Disk => {
                let (path, _) = e.file.as_ref().expect("a disk entry has a file");
                let saved = state_file::load(path, &self.key, &self.config)?;
                if saved.tokens != e.tokens {
                    return Err(crate::Error::format(
                        path,
                        "its tokens changed since it was listed",
                    ));
                }
                backend.restore(&saved.state)?;
                // Back to host memory: the next hit needs no file read.
                let state = HostState::new(saved.state, self.cfg.dtype);
                let bytes = state.bytes();
                if bytes <= self.cfg.host_bytes {
                    e.tier = Tier::Host(state);
                    e.bytes = bytes;
                    self.evict_host();
                }
                Ok(())
            }
        }
    }

    /// Whether an entry for exactly `tokens` exists (it is then marked used).
    pub fn touch(&mut self, tokens: &[u32]) -> bool {
        match self.root.longest(tokens, tokens.len(), 0) {
            Some((len, id)) if len == tokens.len() => {
                self.clock += 1;
                if let Some(e) = self.entries.get_mut(&id) {
                    e.last_used = self.clock;
                }
                true
            }
            _ => false,
        }
    }

    /// Keeps the backend's current state as the entry for `tokens` (the tokens it was fed).
    pub fn insert(&mut self, tokens: &[u32], backend: &mut dyn Backend) -> Result<()> {
        if tokens.is_empty() || !self.enabled() || self.touch(tokens) {
            return Ok(());
        }
        let device = backend.snapshot_device_bytes();
        let (tier, bytes) = if device > 0 && device <= self.cfg.device_bytes {
            (Tier::Device(backend.snapshot()?), device)
        } else {
            let state = HostState::new(backend.state()?, self.cfg.dtype);
            let bytes = state.bytes();
            (Tier::Host(state), bytes)
        };
        let id = self.new_id();
        if let Some(old) = self.root.insert(tokens, id) {
            self.entries.remove(&old);
        }
        self.entries.insert(
            id,
            Entry {
                tokens: tokens.to_vec(),
                tier,
                bytes,
                file: None,
                last_used: self.clock,
            },
        );
        self.evict_device(backend)?;
        self.evict_host();
        Ok(())
    }

    fn used(&self, tier: usize) -> u64 {
        self.entries
            .values()
            .filter(|e| e.tier.index() == tier)
            .map(|e| e.bytes)
            .sum::<u64>()
            + if tier == 2 {
                self.entries
                    .values()
                    .filter(|e| !matches!(e.tier, Tier::Disk))
                    .filter_map(|e| e.file.as_ref().map(|f| f.1))
                    .sum::<u64>()
            } else {
                0
            }
    }

    fn lru(&self, tier: usize) -> Option<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| e.tier.index() == tier)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(id, _)| *id)
    }

    /// Moves device entries to host memory until the device budget holds.
    fn evict_device(&mut self, backend: &mut dyn Backend) -> Result<()> {
        while self.used(0) > self.cfg.device_bytes {
            let id = self.lru(0).expect("a device entry");
            self.move_to_host(id, backend)?;
        }
        Ok(())
    }

    /// Reads a device entry's snapshot into host memory (in the cache's dtype);
    /// other entries are left as they are.
    fn move_to_host(&mut self, id: u64, backend: &mut dyn Backend) -> Result<()> {
        let e = self.entries.get(&id).expect("entry");
        let Tier::Device(snap) = &e.tier else {
            return Ok(());
        };
        let state = HostState::new(backend.snapshot_state(snap.as_ref())?, self.cfg.dtype);
        let e = self.entries.get_mut(&id).expect("entry");
        e.bytes = state.bytes();
        e.tier = Tier::Host(state);
        Ok(())
    }

    /// Moves host entries to files (or drops them without a directory) until the host
    /// budget holds.
    fn evict_host(&mut self) {
        while self.used(1) > self.cfg.host_bytes {
            let id = self.lru(1).expect("a host entry");
            if let Err(err) = self.spill(id) {
                tracing::warn!("prefix cache: {err}");
                self.remove(id);
            }
        }
        self.evict_disk();
    }

    /// Writes a memory entry to its file (when there is a directory and none yet) and
    /// leaves it on disk only; without a directory it is dropped.
    fn spill(&mut self, id: u64) -> Result<()> {
        // (No file is kept with a disk budget of 0: none is written only to be deleted.)
        let Some(dir) = self.cfg.dir.clone().filter(|_| self.cfg.disk_bytes > 0) else {
            self.remove(id);
            return Ok(());
        };
        let e = self.entries.get_mut(&id).expect("entry");
        if e.file.is_none() {
            let Tier::Host(state) = &e.tier else {
                return Ok(());
            };
            let path = dir.join(format!("{}.safetensors", file_stem(&e.tokens)));
            let saved = SavedState {
                state: state.f32().into_owned(),
                tokens: e.tokens.clone(),
                extra: None,
            };
            state_file::save(&path, &self.key, &saved, self.cfg.dtype, &self.config)?;
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            e.file = Some((path, len));
        }
        e.bytes = e.file.as_ref().map_or(0, |f| f.1);
        e.tier = Tier::Disk;
        Ok(())
    }

    /// Deletes the least recently used files until the disk budget holds.
    fn evict_disk(&mut self) {
        while self.used(2) > self.cfg.disk_bytes {
            // Only entries living on disk alone are deleted; memory entries keep theirs.
            let Some(id) = self.lru(2) else { break };
            self.remove(id);
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(e) = self.entries.remove(&id) {
            self.root.remove(&e.tokens);
            if let Some((path, _)) = e.file {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Writes every memory entry to the directory (at shutdown: what a restart finds).
    pub fn persist(&mut self, backend: &mut dyn Backend) -> Result<usize> {
        if self.cfg.dir.is_none() || self.cfg.disk_bytes == 0 {
            return Ok(0);
        }
        let ids: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.file.is_none())
            .map(|(id, _)| *id)
            .collect();
        for &id in &ids {
            self.move_to_host(id, backend)?;
            self.spill(id)?;
        }
        self.evict_disk();
        Ok(ids.len())
    }
}

/// Takes `dir`'s lock file (`.lock`), or says which directory another process holds.
fn lock_dir(dir: &std::path::Path) -> Result<std::fs::File> {
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| crate::Error::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(crate::Error::InvalidInput(format!(
            "the prefix cache directory {} is in use by another mamba2 process (its lock \
             file {} is held): give each server its own --cache-dir",
            dir.display(),
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(crate::Error::io(&path, e)),
    }
}

/// A file name for the entry of `tokens`: the first 16 bytes of their SHA-256, in hex.
fn file_stem(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::Node;

    #[test]
    fn radix_tree_finds_the_longest_prefix_at_most_max() {
        let mut t = Node::default();
        assert_eq!(t.insert(&[1, 2, 3, 4], 1), None);
        assert_eq!(t.insert(&[1, 2], 2), None);
        assert_eq!(t.insert(&[1, 2, 5], 3), None);
        assert_eq!(t.longest(&[1, 2, 3, 4, 9], 10, 0), Some((4, 1)));
        assert_eq!(t.longest(&[1, 2, 3, 4], 3, 0), Some((2, 2)));
        assert_eq!(t.longest(&[1, 2, 5, 6], 9, 0), Some((3, 3)));
        assert_eq!(t.longest(&[1, 3], 9, 0), None);
        assert_eq!(t.insert(&[1, 2], 4), Some(2));
        t.remove(&[1, 2, 3, 4]);
        assert_eq!(t.longest(&[1, 2, 3, 4], 9, 0), Some((2, 4)));
        t.remove(&[1, 2]);
        assert_eq!(t.longest(&[1, 2, 3], 9, 0), None);
        assert_eq!(t.longest(&[1, 2, 5], 9, 0), Some((3, 3)));
    }
}
