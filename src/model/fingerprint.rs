//! A model's fingerprint: what a saved state (a prefix-cache file, a saved chat) names so
//! that it is never loaded into another model. A SHA-256 over the normalized config, every
//! tensor's name, dtype and shape, and sampled windows of every tensor's bytes (16 windows
//! of 4 KiB, the first and last included): a fine-tune with the same shapes differs in its
//! bytes, and hashing a whole 14 GB checkpoint at every start would take seconds.

use sha2::{Digest, Sha256};

use super::Model;

/// Bytes hashed per window.
const WINDOW: usize = 4096;
/// Windows hashed per tensor (evenly spaced; a smaller tensor is hashed whole).
const WINDOWS: usize = 16;

impl Model {
    /// 32 hex digits naming this model's config and weights (see the module doc).
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        let mut config = self.config.clone();
        // Notices describe how the config was read, not the model.
        config.notices.clear();
        h.update(format!("{config:?}").as_bytes());
        for t in self.weights.all() {
            h.update(format!("{}:{:?}:{:?};", t.name, t.dtype, t.shape).as_bytes());
            let bytes = t.bytes();
            if bytes.len() <= WINDOW * WINDOWS {
                h.update(bytes);
                continue;
            }
            let last = bytes.len() - WINDOW;
            for i in 0..WINDOWS {
                let at = last / (WINDOWS - 1) * i;
                let at = if i + 1 == WINDOWS { last } else { at };
                h.update(&bytes[at..at + WINDOW]);
            }
        }
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}
