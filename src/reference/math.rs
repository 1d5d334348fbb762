//! Scalar building blocks of the CPU reference, generic over f32 and f64.

use std::fmt::Debug;

/// The float types the reference runs in.
pub trait Real:
    num_traits::Float + std::iter::Sum + Send + Sync + Debug + Default + 'static
{
    fn of(x: f64) -> Self;
    fn of_f32(x: f32) -> Self;
    fn f64(self) -> f64;
}

impl Real for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn of_f32(x: f32) -> Self {
        x
    }
    fn f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn of_f32(x: f32) -> Self {
        x as f64
    }
    fn f64(self) -> f64 {
        self
    }
}

pub fn silu<T: Real>(x: T) -> T {
    x / (T::one() + (-x).exp())
}

/// `log(1 + e^x)`, and `x` itself above 20 (the threshold every implementation uses).
pub fn softplus<T: Real>(x: T) -> T {
    if x > T::of(20.0) { x } else { x.exp().ln_1p() }
}

/// `1 / sqrt(mean(x²) + eps)`
pub fn rms_scale<T: Real>(x: &[T], eps: f64) -> T {
    let ss: T = x.iter().map(|&v| v * v).sum();
    (ss / T::of(x.len() as f64) + T::of(eps)).sqrt().recip()
}

/// `out = x / rms(x) ⊙ w`
pub fn rmsnorm<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let s = rms_scale(x, eps);
    x.iter().zip(w).map(|(&v, &w)| v * s * w).collect()
}

/// The gated group RMSNorm of the mixer (norm_before_gate = false): `v = y ⊙ silu(z)`,
/// then each of the `groups` contiguous slices is normalized by its own RMS, then `⊙ w`.
pub fn gated_group_rmsnorm<T: Real>(y: &[T], z: &[T], w: &[T], groups: usize, eps: f64) -> Vec<T> {
    let mut v: Vec<T> = y.iter().zip(z).map(|(&y, &z)| y * silu(z)).collect();
    let size = v.len() / groups;
    for (g, chunk) in v.chunks_mut(size).enumerate() {
        let s = rms_scale(chunk, eps);
        for (k, x) in chunk.iter_mut().enumerate() {
            *x = *x * s * w[g * size + k];
        }
    }
    v
}

/// Dot product with eight independent accumulators, so the f32 build vectorizes.
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] = acc[i] + x[i] * y[i];
        }
    }
    let tail: T = ar.iter().zip(br).map(|(&x, &y)| x * y).sum();
    acc.iter().copied().sum::<T>() + tail
}

/// `out[r] = Σ_k w[r, k]·x[k]` for a row-major `[rows, x.len()]` matrix, split over the
/// machine's cores when the matrix is large.
pub fn matvec<T: Real>(w: &[T], x: &[T], out: &mut [T]) {
    let cols = x.len();
    debug_assert_eq!(w.len(), out.len() * cols);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads == 1 || w.len() < 1 << 18 {
        for (r, o) in out.iter_mut().enumerate() {
            *o = dot(&w[r * cols..(r + 1) * cols], x);
        }
        return;
    }
    let rows_per = out.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(rows_per).enumerate() {
            let w = &w[i * rows_per * cols..];
            s.spawn(move || {
                for (r, o) in chunk.iter_mut().enumerate() {
                    *o = dot(&w[r * cols..(r + 1) * cols], x);
                }
            });
        }
    });
}

/// `out[t][r] = Σ_k w[r, k]·xs[t][k]` for every token `t`: the weights are streamed once
/// per call (each row stays in cache across the tokens), split by rows over the cores.
pub fn matmul<T: Real>(w: &[T], rows: usize, xs: &[Vec<T>]) -> Vec<Vec<T>> {
    let Some(cols) = xs.first().map(Vec::len) else {
        return Vec::new();
    };
    debug_assert_eq!(w.len(), rows * cols);
    let tokens = xs.len();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Each worker fills [rows of its range][tokens].
    let work = |r0: usize, r1: usize| -> Vec<T> {
        let mut part = Vec::with_capacity((r1 - r0) * tokens);
        for r in r0..r1 {
            let wr = &w[r * cols..(r + 1) * cols];
            part.extend(xs.iter().map(|x| dot(wr, x)));
        }
        part
    };
    let parts: Vec<(usize, Vec<T>)> = if threads == 1 || rows * cols * tokens < 1 << 19 {
        vec![(0, work(0, rows))]
    } else {
        let per = rows.div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..rows)
                .step_by(per)
                .map(|r0| {
                    let work = &work;
                    s.spawn(move || (r0, work(r0, (r0 + per).min(rows))))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("matmul worker panicked"))
                .collect()
        })
    };
    let mut out = vec![vec![T::zero(); rows]; tokens];
    for (r0, part) in parts {
        for (i, v) in part.into_iter().enumerate() {
            out[i % tokens][r0 + i / tokens] = v;
        }
    }
    out
}
