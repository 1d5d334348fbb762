//! The selective state-space (SSD) core of a Mamba2 layer: the sequential scan (the decode
//! recurrence applied token by token) and the chunked SSD of MAMBA2.md, which must agree.

use super::math::Real;

/// Sizes of one layer's scan: `H` heads of `P` channels, `G` groups of `N` state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanDims {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub d_state: usize,
}

impl ScanDims {
    pub fn state_len(&self) -> usize {
        self.heads * self.head_dim * self.d_state
    }
    fn group_of(&self, h: usize) -> usize {
        h / (self.heads / self.groups)
    }
}

/// The inputs of a scan over `L` tokens (after conv, softplus and clamp).
/// Shapes: `x [L][H][P]`, `dt [L][H]` (δ), `a [H]` (A = −exp(A_log)), `b, c [L][G][N]`,
/// `d [H]`.
#[derive(Clone, Copy, Debug)]
pub struct ScanInputs<'a, T> {
    pub dims: ScanDims,
    pub x: &'a [T],
    pub dt: &'a [T],
    pub a: &'a [T],
    pub b: &'a [T],
    pub c: &'a [T],
    pub d: &'a [T],
}

impl<T: Real> ScanInputs<'_, T> {
    /// Number of tokens, after checking every shape against it.
    pub fn len(&self) -> usize {
        let ScanDims {
            heads,
            head_dim,
            groups,
            d_state,
        } = self.dims;
        let l = self.dt.len() / heads;
        assert_eq!(self.dt.len(), l * heads, "dt must be [L][H]");
        assert_eq!(self.x.len(), l * heads * head_dim, "x must be [L][H][P]");
        assert_eq!(self.b.len(), l * groups * d_state, "B must be [L][G][N]");
        assert_eq!(self.c.len(), l * groups * d_state, "C must be [L][G][N]");
        assert_eq!(
            (self.a.len(), self.d.len()),
            (heads, heads),
            "A and D must be [H]"
        );
        assert_eq!(heads % groups, 0, "heads must split into groups");
        l
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The recurrence, one token at a time (MAMBA2.md "one decode step"):
/// `S ← exp(δA)·S + δ·x ⊗ B; y = S·C + D·x`. Updates `state [H][P][N]`, returns `y [L][H][P]`.
pub fn scan_sequential<T: Real>(inp: &ScanInputs<T>, state: &mut [T]) -> Vec<T> {
    let l = inp.len();
    let ScanDims {
        heads,
        head_dim: p_dim,
        groups,
        d_state: n,
    } = inp.dims;
    assert_eq!(state.len(), inp.dims.state_len(), "state must be [H][P][N]");
    let mut y = vec![T::zero(); l * heads * p_dim];
    for t in 0..l {
        for h in 0..heads {
            let g = inp.dims.group_of(h);
            let delta = inp.dt[t * heads + h];
            let alpha = (delta * inp.a[h]).exp();
            let bv = &inp.b[(t * groups + g) * n..][..n];
            let cv = &inp.c[(t * groups + g) * n..][..n];
            for p in 0..p_dim {
                let xv = inp.x[(t * heads + h) * p_dim + p];
                let s = &mut state[(h * p_dim + p) * n..][..n];
                let mut acc = T::zero();
                for k in 0..n {
                    s[k] = alpha * s[k] + delta * xv * bv[k];
                    acc = acc + cv[k] * s[k];
                }
                y[(t * heads + h) * p_dim + p] = acc + inp.d[h] * xv;
            }
        }
    }
    y
}

/// The chunked SSD (MAMBA2.md "Chunked prefill"), chunks of `q` tokens starting from
/// `state`, which is left holding the final state. Returns `y [L][H][P]`.
pub fn scan_chunked<T: Real>(inp: &ScanInputs<T>, state: &mut [T], q: usize) -> Vec<T> {
    assert!(q > 0, "chunk size must be positive");
    let l = inp.len();
    let ScanDims {
        heads,
        head_dim: p_dim,
        groups,
        d_state: n,
    } = inp.dims;
    assert_eq!(state.len(), inp.dims.state_len(), "state must be [H][P][N]");
    let mut y = vec![T::zero(); l * heads * p_dim];
    let mut cb = vec![T::zero(); q * q];
    let mut lam = vec![T::zero(); q];
    let mut chunk_state = vec![T::zero(); p_dim * n];
    for start in (0..l).step_by(q) {
        let len = q.min(l - start);
        for g in 0..groups {
            // CB[i, j] = C_i · B_j, shared by the group's heads (causal part only).
            for i in 0..len {
                let ci = &inp.c[((start + i) * groups + g) * n..][..n];
                for j in 0..=i {
                    let bj = &inp.b[((start + j) * groups + g) * n..][..n];
                    cb[i * q + j] = ci.iter().zip(bj).map(|(&c, &b)| c * b).sum();
                }
            }
            let hpg = heads / groups;
            for h in g * hpg..(g + 1) * hpg {
                let delta = |i: usize| inp.dt[(start + i) * heads + h];
                let xv = |i: usize, p: usize| inp.x[((start + i) * heads + h) * p_dim + p];
                // Λ_i: inclusive cumsum of δ·A within the chunk.
                let mut acc = T::zero();
                for (i, slot) in lam.iter_mut().enumerate().take(len) {
                    acc = acc + delta(i) * inp.a[h];
                    *slot = acc;
                }
                let s = &mut state[h * p_dim * n..][..p_dim * n];
                for i in 0..len {
                    let ci = &inp.c[((start + i) * groups + g) * n..][..n];
                    let decay_in = lam[i].exp();
                    for p in 0..p_dim {
                        let inter: T = ci
                            .iter()
                            .zip(&s[p * n..][..n])
                            .map(|(&c, &sv)| c * sv)
                            .sum();
                        let mut intra = T::zero();
                        for j in 0..=i {
                            let w = (lam[i] - lam[j]).min(T::zero()).exp();
                            intra = intra + cb[i * q + j] * w * delta(j) * xv(j, p);
                        }
                        y[((start + i) * heads + h) * p_dim + p] =
                            decay_in * inter + intra + inp.d[h] * xv(i, p);
                    }
                }
                // s_c = Σ_j exp(Λ_last − Λ_j)·δ_j·x_j ⊗ B_j, then S ← exp(Λ_last)·S + s_c.
                let last = lam[len - 1];
                chunk_state.iter_mut().for_each(|v| *v = T::zero());
                for (j, &lam_j) in lam.iter().enumerate().take(len) {
                    let bj = &inp.b[((start + j) * groups + g) * n..][..n];
                    let w = (last - lam_j).min(T::zero()).exp() * delta(j);
                    for p in 0..p_dim {
                        let wx = w * xv(j, p);
                        for (cs, &b) in chunk_state[p * n..][..n].iter_mut().zip(bj) {
                            *cs = *cs + wx * b;
                        }
                    }
                }
                let decay = last.exp();
                for (sv, &cs) in s.iter_mut().zip(&chunk_state) {
                    *sv = decay * *sv + cs;
                }
            }
        }
    }
    y
}
