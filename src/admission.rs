//! Admission: what a model will need of the machine, checked against what the machine has
//! before anything big is allocated, so that a model too large for it is refused with the
//! sizes instead of aborting in the allocator (or being killed by the kernel's OOM killer
//! half-way through a load).

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::files::human_bytes;
use crate::model::quant::WeightFormat;

/// The bytes a model needs on one device, by what they hold.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Footprint {
    pub weights: u64,
    /// Recurrent (Mamba2) state, fixed per sequence.
    pub state: u64,
    /// KV caches at the context in use.
    pub kv: u64,
    /// Activations and logits of one step or prefill block, roughly.
    pub scratch: u64,
}

impl Footprint {
    pub fn total(&self) -> u64 {
        self.weights + self.state + self.kv + self.scratch
    }

    /// e.g. "9.1 GiB (weights 8.0 GiB, KV caches at 4096 tokens 1.0 GiB, …)".
    pub fn describe(&self, context: usize) -> String {
        let mut parts = vec![format!("weights {}", human_bytes(self.weights))];
        if self.kv > 0 {
            parts.push(format!(
                "KV caches at {context} tokens {}",
                human_bytes(self.kv)
            ));
        }
        parts.push(format!(
            "state and activations {}",
            human_bytes(self.state + self.scratch)
        ));
        format!("{} ({})", human_bytes(self.total()), parts.join(", "))
    }

    /// The CPU reference: f32 copies of every weight (the mapped checkpoint is paged in
    /// and out by the kernel and not counted), f32 KV caches grown to `context` tokens.
    pub fn cpu(c: &ModelConfig, context: usize) -> Self {
        Footprint {
            weights: 4 * c.param_count() as u64,
            state: c.state_bytes() as u64,
            kv: c.kv_bytes_per_token(4) as u64 * context as u64,
            scratch: scratch_bytes(c),
        }
    }

    /// The GPU engine with its big matrices in `format` and KV caches of `kv_elem` bytes
    /// per value for `context` tokens.
    pub fn gpu(c: &ModelConfig, format: WeightFormat, kv_elem: usize, context: usize) -> Self {
        // Matrices dominate; vectors (norms, biases, A, D) are counted as f32.
        let matrices = c.matrices();
        let matrix_params: u64 = matrices
            .iter()
            .map(|&(_, r, k, n)| (r * k * n) as u64)
            .sum();
        let matrix_bytes: u64 = matrices
            .iter()
            .map(|&(_, r, k, n)| (format.bytes(r, k) * n) as u64)
            .sum();
        let vectors = (c.param_count() as u64).saturating_sub(matrix_params);
        Footprint {
            weights: matrix_bytes + 4 * vectors,
            state: c.state_bytes() as u64,
            kv: c.kv_bytes_per_token(kv_elem) as u64 * context as u64,
            scratch: scratch_bytes(c),
        }
    }
}

/// The widest per-token activations times a prefill block of 512 tokens, plus logits; with
/// MoE blocks, the expert rows of a 2048-token block (`gpu::prefill::MAX_MOE_BLOCK`: each
/// choice's up projection, activation and down projection, plus each expert's padding).
fn scratch_bytes(c: &ModelConfig) -> u64 {
    let moe = c.moe.as_ref().map_or(0, |m| {
        let rows = (2048 * m.slots() + 64 * m.stored_experts()) as u64;
        4 * rows * (m.up_rows() + m.intermediate + c.d_model) as u64
    });
    let widest = [
        c.d_in_proj(),
        c.attention.as_ref().map_or(0, |a| a.qkv_rows()),
        c.mlp.as_ref().map_or(0, |m| 2 * m.intermediate),
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    4 * (512 * (widest + 2 * c.d_model as u64) + c.vocab_size as u64) + moe
}

/// The most tokens of KV cache (`per_token` bytes each) that fit in `available` bytes
/// beside `fixed` (the footprint at context 0); `None` when there is no limit to apply.
pub fn context_that_fits(
    fixed: &Footprint,
    per_token: u64,
    available: Option<u64>,
) -> Option<usize> {
    let have = available?;
    if per_token == 0 {
        return None;
    }
    let room = have.saturating_sub(fixed.total());
    Some(usize::try_from(room / per_token).unwrap_or(usize::MAX))
}

/// Memory the system can still give this process without swapping (Linux: `MemAvailable`
/// of /proc/meminfo), or `None` where it cannot be known.
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses `needs` when it is more than `available` bytes of `what` (e.g. "host memory on
/// --device cpu"); `hint` says what to try instead.
pub fn admit(
    needs: &Footprint,
    context: usize,
    available: Option<u64>,
    what: &str,
    hint: &str,
) -> Result<()> {
    match available {
        Some(have) if needs.total() > have => Err(Error::InvalidInput(format!(
            "the model needs {} of {what}, but only {} is available: {hint}",
            needs.describe(context),
            human_bytes(have)
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footprints_count_weights_and_caches() {
        let c = crate::model::synthetic::tiny_hybrid("M*-M", 2);
        let cpu = Footprint::cpu(&c, 100);
        assert_eq!(cpu.weights, 4 * c.param_count() as u64);
        assert_eq!(cpu.kv, 100 * c.kv_bytes_per_token(4) as u64);
        let f16 = Footprint::gpu(&c, WeightFormat::F16, 2, 100);
        let f32 = Footprint::gpu(&c, WeightFormat::F32, 4, 100);
        assert!(f16.weights < f32.weights && f16.kv * 2 == f32.kv);
        let e = admit(&cpu, 100, Some(1000), "host memory", "try less").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("the model needs") && msg.contains("only 1000 B is available: try less"),
            "{msg}"
        );
        assert!(admit(&cpu, 100, None, "host memory", "").is_ok());
        assert!(host_available().is_none_or(|b| b > 0));
        let fixed = Footprint::cpu(&c, 0);
        let per = c.kv_bytes_per_token(4) as u64;
        assert_eq!(
            context_that_fits(&fixed, per, Some(fixed.total() + 10 * per + 1)),
            Some(10)
        );
        assert_eq!(context_that_fits(&fixed, per, Some(1)), Some(0));
        assert_eq!(context_that_fits(&fixed, per, None), None);
        assert_eq!(context_that_fits(&fixed, 0, Some(1)), None);
    }
}
