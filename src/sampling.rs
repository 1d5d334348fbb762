//! Seeded, reproducible sampling. The same rule runs on the host (CPU device) and in the
//! GPU sampling kernel: temperature, then top-k and top-p as probability thresholds (ties
//! at a threshold are kept), then one uniform draw walked over the vocabulary in index
//! order. The draw for the token at sequence position `pos` is `uniform(seed, pos)`, so
//! a sequence is reproducible however it was chunked or interrupted.

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 means greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p`; 1 turns it off.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Rejects values that have no meaning, naming the option.
    pub fn validate(&self) -> crate::Result<()> {
        match self.problem() {
            Some((option, why)) => Err(crate::Error::InvalidInput(format!("{option} {why}"))),
            None => Ok(()),
        }
    }

    /// The first value that has no meaning, as (option name, why): front-ends name their
    /// own flag or field with it, before loading anything. `top_k` and `seed` take any
    /// value (a `top_k` of 0 or beyond the vocabulary keeps every token).
    pub fn problem(&self) -> Option<(&'static str, String)> {
        // NaN fails both comparisons, so the checks are written to accept, not to reject.
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Some((
                "temperature",
                format!("must be a finite number ≥ 0, found {}", self.temperature),
            ));
        }
        // A subnormal value may be flushed to zero on a GPU (WGSL allows it), where the
        // sampler would then divide 0 by 0 or keep no token: the CPU and the device would
        // pick different tokens.
        if self.temperature != 0.0 && self.temperature < f32::MIN_POSITIVE {
            return Some((
                "temperature",
                format!(
                    "must be 0 (greedy) or at least {:e}, found {:e}",
                    f32::MIN_POSITIVE,
                    self.temperature
                ),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Some(("top-p", format!("must be in (0, 1], found {}", self.top_p)));
        }
        // (Subnormal: as for the temperature.)
        if self.top_p < f32::MIN_POSITIVE {
            return Some((
                "top-p",
                format!(
                    "must be at least {:e} (a normal f32), found {:e}",
                    f32::MIN_POSITIVE,
                    self.top_p
                ),
            ));
        }
        None
    }
}

/// A sampling value read as f64 (a flag, a JSON number) narrowed to the f32 the sampler
/// takes, or why f32 cannot hold it: beyond its range (it would become inf) or below it
/// (a silent 0). Infinities and NaN pass through for the range checks (`Sampling::problem`)
/// to name; callers put the value itself before the reason.
pub fn narrow_f32(x: f64) -> std::result::Result<f32, String> {
    if x.is_finite() && x.abs() > f32::MAX as f64 {
        return Err(format!("is beyond f32's range (at most {:e})", f32::MAX));
    }
    if x != 0.0 && x as f32 == 0.0 {
        return Err(format!(
            "is below f32's range (the smallest is {:e}; 0 is taken as 0)",
            f32::from_bits(1)
        ));
    }
    Ok(x as f32)
}

/// PCG's output permutation as a hash (Jarzynski & Olano 2020); the WGSL kernel has the
/// same function, so host and device draw the same numbers.
pub fn pcg_hash(x: u32) -> u32 {
    let state = x.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// The uniform draw in `[0, 1)` (24 bits) for the token at position `pos`.
pub fn uniform(seed: u64, pos: u64) -> f32 {
    let k = seed_key(seed);
    let h = pcg_hash(k ^ pcg_hash(pos as u32 ^ pcg_hash((pos >> 32) as u32)));
    (h >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// The 32-bit key the GPU kernel receives for a 64-bit seed.
pub fn seed_key(seed: u64) -> u32 {
    pcg_hash(seed as u32 ^ pcg_hash((seed >> 32) as u32))
}

/// Index of the largest value, the lowest index on ties; NaN never wins.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] || values[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Chooses the token at position `pos` from `logits` by the module's rule.
pub fn sample(logits: &[f32], s: &Sampling, pos: u64) -> u32 {
    if s.is_greedy() {
        return argmax(logits);
    }
    let max = logits[argmax(logits) as usize];
    let mut p: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / s.temperature).exp())
        .collect();
    let mut threshold = 0.0f32;
    if s.top_k > 0 && s.top_k < p.len() {
        let mut sorted = p.clone();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        threshold = sorted[s.top_k - 1];
    }
    if s.top_p < 1.0 {
        let mut kept: Vec<f32> = p.iter().copied().filter(|&v| v >= threshold).collect();
        kept.sort_unstable_by(|a, b| b.total_cmp(a));
        let total: f32 = kept.iter().sum();
        let mut cum = 0.0;
        for &v in &kept {
            cum += v;
            if cum >= s.top_p * total {
                threshold = threshold.max(v);
                break;
            }
        }
    }
    for v in &mut p {
        if *v < threshold {
            *v = 0.0;
        }
    }
    let total: f32 = p.iter().sum();
    let target = uniform(s.seed, pos) * total;
    let mut cum = 0.0;
    let mut last_kept = 0;
    for (i, &v) in p.iter().enumerate() {
        if v > 0.0 {
            cum += v;
            last_kept = i;
            if cum > target {
                return i as u32;
            }
        }
    }
    last_kept as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_with_lowest_tie() {
        assert_eq!(sample(&[0.0, 3.0, 3.0, 1.0], &Sampling::greedy(), 7), 1);
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_seed() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        for seed in 0..50 {
            let s = Sampling {
                temperature: 1.0,
                top_k: 1,
                top_p: 1.0,
                seed,
            };
            assert_eq!(sample(&logits, &s, seed * 3), 1);
        }
    }

    #[test]
    fn top_p_cuts_the_tail_and_sampling_follows_probabilities() {
        // p ∝ [0.5, 0.3, 0.2] at T = 1: top-p 0.7 keeps tokens 0 and 1 only.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let s = |seed| Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
            seed,
        };
        let mut counts = [0usize; 3];
        for pos in 0..4000 {
            counts[sample(&logits, &s(pos % 7), pos) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let frac0 = counts[0] as f64 / 4000.0;
        assert!((frac0 - 0.625).abs() < 0.03, "{counts:?}");
    }

    #[test]
    fn meaningless_values_name_their_option() {
        let with = |temperature, top_p| Sampling {
            temperature,
            top_p,
            ..Sampling::default()
        };
        assert_eq!(with(0.0, 1.0).problem(), None);
        for t in [
            f32::NAN,
            f32::INFINITY,
            -0.5,
            1e-45,
            f32::MIN_POSITIVE / 2.0,
        ] {
            assert_eq!(with(t, 1.0).problem().map(|p| p.0), Some("temperature"));
        }
        for p in [0.0, 1.5, f32::NAN, 1e-45] {
            assert_eq!(with(0.7, p).problem().map(|p| p.0), Some("top-p"));
        }
        assert_eq!(with(f32::MIN_POSITIVE, f32::MIN_POSITIVE).problem(), None);
        assert_eq!(
            with(f32::NAN, 1.0).validate().unwrap_err().to_string(),
            "invalid input: temperature must be a finite number ≥ 0, found NaN"
        );
    }

    #[test]
    fn same_seed_same_draw() {
        assert_eq!(uniform(42, 5), uniform(42, 5));
        assert_ne!(uniform(42, 5), uniform(42, 6));
        assert_ne!(uniform(42, 5), uniform(43, 5));
        let u: Vec<f32> = (0..1000).map(|i| uniform(1, i)).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().sum::<f32>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05);
    }
}
