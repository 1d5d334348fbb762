//! Causal grouped-query attention on the CPU: the oracle of the attention kernels.
//! Shapes: `q [T][H][hd]` for T new tokens at positions `pos0 … pos0+T−1`, the caches
//! `k, v [len][Hkv][hd]` holding every earlier token and the new ones (`len ≥ pos0 + T`);
//! head `h` reads kv head `h / (H / Hkv)`. Scores in the working precision, softmax with
//! the running maximum subtracted.

use super::math::Real;

/// Head counts and width of one attention layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// `H`, query heads.
    pub heads: usize,
    /// `Hkv`, key/value heads; divides `H`.
    pub kv_heads: usize,
    /// `hd`
    pub head_dim: usize,
}

impl AttnDims {
    /// Values of one token's queries, `H·hd`.
    pub fn q_len(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Values of one token's keys (or values), `Hkv·hd`.
    pub fn kv_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// `o [T][H][hd]`: token `t` attends to cache rows `0 ..= pos0 + t` with weights
/// `softmax(scale · q·k)`.
pub fn attend<T: Real>(dims: AttnDims, q: &[T], k: &[T], v: &[T], pos0: usize, scale: T) -> Vec<T> {
    attend_rounding(dims, q, k, v, pos0, scale, |p| p)
}

/// `attend` with each unnormalized weight `exp(s − max)` passed through `round` before it
/// multiplies v and joins the row's sum (the tensor-core kernel rounds them to f16).
pub fn attend_rounding<T: Real>(
    dims: AttnDims,
    q: &[T],
    k: &[T],
    v: &[T],
    pos0: usize,
    scale: T,
    round: impl Fn(T) -> T,
) -> Vec<T> {
    let AttnDims {
        heads,
        kv_heads,
        head_dim: hd,
    } = dims;
    let tokens = q.len() / dims.q_len();
    let kvl = dims.kv_len();
    assert!(
        k.len() >= (pos0 + tokens) * kvl && v.len() == k.len(),
        "KV cache shorter than the positions attended"
    );
    let per_kv = heads / kv_heads;
    let mut out = vec![T::zero(); q.len()];
    let mut scores = Vec::with_capacity(pos0 + tokens);
    for t in 0..tokens {
        let len = pos0 + t + 1;
        for h in 0..heads {
            let qh = &q[(t * heads + h) * hd..][..hd];
            let g = h / per_kv;
            scores.clear();
            for j in 0..len {
                let kj = &k[(j * kv_heads + g) * hd..][..hd];
                let dot: T = qh.iter().zip(kj).map(|(&a, &b)| a * b).sum();
                scores.push(dot * scale);
            }
            let max = scores
                .iter()
                .copied()
                .fold(T::of(f64::NEG_INFINITY), T::max);
            let mut total = T::zero();
            for s in scores.iter_mut() {
                *s = round((*s - max).exp());
                total = total + *s;
            }
            let o = &mut out[(t * heads + h) * hd..][..hd];
            for (j, &p) in scores.iter().enumerate() {
                let vj = &v[(j * kv_heads + g) * hd..][..hd];
                for (o, &x) in o.iter_mut().zip(vj) {
                    *o = *o + p * x;
                }
            }
            for o in o.iter_mut() {
                *o = *o / total;
            }
        }
    }
    out
}

/// Rotary position embedding in place (HF's `rotate_half` convention): `x [heads][hd]` of
/// the token at `pos`; pair `(i, i + hd/2)` turns by `pos · θ^(−2i/hd)`.
pub fn rope<T: Real>(x: &mut [T], head_dim: usize, pos: usize, theta: f64) {
    let half = head_dim / 2;
    for head in x.chunks_mut(head_dim) {
        for i in 0..half {
            // The angle in f32 first, as HF computes inv_freq and the product in f32.
            let inv = (theta as f32).powf(-((2 * i) as f32) / head_dim as f32);
            let angle = pos as f32 * inv;
            let (sin, cos) = (T::of_f32(angle.sin()), T::of_f32(angle.cos()));
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_returns_its_value() {
        let dims = AttnDims {
            heads: 4,
            kv_heads: 2,
            head_dim: 3,
        };
        let q: Vec<f64> = (0..12).map(|i| i as f64 * 0.1).collect();
        let k = vec![0.5f64; 6];
        let v: Vec<f64> = (0..6).map(|i| i as f64).collect();
        let o = attend(dims, &q, &k, &v, 0, 0.5);
        // Heads 0,1 read kv head 0, heads 2,3 kv head 1.
        assert_eq!(o, vec![0., 1., 2., 0., 1., 2., 3., 4., 5., 3., 4., 5.]);
    }

    #[test]
    fn equal_scores_average_the_values() {
        let dims = AttnDims {
            heads: 1,
            kv_heads: 1,
            head_dim: 2,
        };
        let q = vec![0.0f64, 0.0];
        let k = vec![1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
        let v = vec![1.0f64, 0.0, 2.0, 0.0, 6.0, 3.0];
        let o = attend(dims, &q, &k, &v, 2, 1.0);
        assert!(
            (o[0] - 3.0).abs() < 1e-12 && (o[1] - 1.0).abs() < 1e-12,
            "{o:?}"
        );
    }

    #[test]
    fn rope_keeps_norms_and_is_identity_at_zero() {
        let mut x: Vec<f64> = (0..8).map(|i| i as f64 - 3.0).collect();
        let before = x.clone();
        rope(&mut x, 4, 0, 10000.0);
        assert_eq!(x, before);
        rope(&mut x, 4, 7, 10000.0);
        let n = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>();
        // sin and cos come from f32 (as HF computes them): norms hold to f32 rounding.
        assert!((n(&x) - n(&before)).abs() < 1e-5 * n(&before));
        assert_ne!(x, before);
    }
}
