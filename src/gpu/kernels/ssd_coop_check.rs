//! The load-time check of the SSD chunk kernels on the real cooperative ops (C·Bᵀ, chunk
//! states, chunk scan), beside `gemm_coop::self_check`: one small chunked block (2 heads of
//! 64 channels, a state of 128, chunks of 64, 100 tokens: one whole chunk and one partial)
//! through each kernel, against the CPU's sums in f64. The kernels multiply f16-rounded
//! operands, so the bound is loose (1 % of the largest value): it catches a kernel the
//! device's compiler got wrong, not rounding. Both ways of storing u (f32, and the f16 the
//! prefill uses where all three kernels run: `ChunkConsts::u_f16`) are checked.

use super::chunk::ChunkConsts;
use super::ssd_chunk_scan::ScanBuffers;
use super::{Dispatch, Kernels};
use crate::error::{Error, Result};

const H: usize = 2;
const P: usize = 64;
const N: usize = 128;
const Q: usize = 64;
const T: usize = 100;
const DI: usize = H * P;
const CD: usize = DI + 2 * N;
const DIP: usize = DI + CD + H;
const NC: usize = T.div_ceil(Q);

/// Runs the check (`emulate`: on the stand-ins, for the tests); an error names the kernel
/// and how far off it was.
pub fn self_check(k: &Kernels, emulate: bool) -> Result<()> {
    check(k, emulate, false)?;
    check(k, emulate, true)
}

/// The check with u stored in f16 (`u_f16`) or f32; its values are f16-rounded either way,
/// so the CPU's sums serve both.
fn check(k: &Kernels, emulate: bool, u_f16: bool) -> Result<()> {
    let ctx = &k.ctx;
    let cc = ChunkConsts {
        heads: H,
        head_dim: P,
        groups: 1,
        d_state: N,
        d_inner: DI,
        conv_dim: CD,
        d_in_proj: DIP,
        q: Q,
        max_tokens: T,
        u_f16,
    };
    let rnd = super::check_values;
    let u: Vec<f32> = rnd(11, T * CD, -1.0, 1.0)
        .into_iter()
        .map(|v| half::f16::from_f32(v).to_f32())
        .collect();
    let mut mix = rnd(12, T * DIP, -1.0, 1.0);
    for t in 0..T {
        for h in 0..H {
            mix[t * DIP + DI + CD + h] =
                0.01 + 0.1 * crate::sampling::uniform(13, (t * H + h) as u64);
        }
    }
    // Λ: a decreasing cumulative sum per chunk and head.
    let mut lam = vec![0f32; NC * H * Q];
    for (i, l) in lam.iter_mut().enumerate() {
        *l = -0.05 * (i % Q) as f32;
    }
    let states = rnd(14, NC * H * P * N, -1.0, 1.0);
    let d_skip = rnd(15, H, 0.5, 1.5);
    let x = |t: usize, h: usize, p: usize| u[t * CD + h * P + p] as f64;
    let b = |t: usize, n: usize| u[t * CD + DI + n] as f64;
    let c = |t: usize, n: usize| u[t * CD + DI + N + n] as f64;
    let delta = |t: usize, h: usize| mix[t * DIP + DI + CD + h] as f64;
    let len = |ch: usize| Q.min(T - ch * Q);

    let buf = |label: &str, v: &[f32]| ctx.storage_with(label, bytemuck::cast_slice(v));
    let ub = if u_f16 {
        let halves: Vec<half::f16> = u.iter().map(|&v| half::f16::from_f32(v)).collect();
        ctx.storage_with("ssd check: u", bytemuck::cast_slice(&halves))?
    } else {
        buf("ssd check: u", &u)?
    };
    let (mixb, lamb) = (buf("ssd check: mix", &mix)?, buf("ssd check: lam", &lam)?);
    let cbb = ctx.storage_zeroed("ssd check: cb", (4 * NC * Q * Q) as u64)?;
    let cstb = ctx.storage_zeroed("ssd check: cst", (4 * states.len()) as u64)?;
    let yb = ctx.storage_zeroed("ssd check: y", (4 * NC * Q * DI) as u64)?;
    let params = buf("ssd check: D", &d_skip)?;
    let ctrl = super::check_ctrl(ctx, "ssd check: ctrl", T)?;
    let run = |d: Dispatch| d.run_now(ctx, None);

    // C·Bᵀ.
    run(super::ssd_cb_coop::ssd_cb_coop(
        k,
        "ssd check: cb",
        cc,
        &ub,
        &cbb,
        &ctrl,
        emulate,
    )?)?;
    let got = ctx.read_f32(&cbb, NC * Q * Q)?;
    let mut cb = vec![0f32; NC * Q * Q];
    let mut pairs = Vec::new();
    for ch in 0..NC {
        for i in 0..len(ch) {
            for j in 0..=i {
                let v: f64 = (0..N).map(|n| c(ch * Q + i, n) * b(ch * Q + j, n)).sum();
                let at = (ch * Q + i) * Q + j;
                cb[at] = v as f32;
                pairs.push((got[at], v));
            }
        }
    }
    agree("C·Bᵀ", &pairs)?;

    // Chunk states.
    run(super::ssd_chunk_state_coop::ssd_chunk_state_coop(
        k,
        "ssd check: chunk states",
        cc,
        &mixb,
        &ub,
        &lamb,
        &cstb,
        &ctrl,
        emulate,
    )?)?;
    let got = ctx.read_f32(&cstb, states.len())?;
    let mut pairs = Vec::new();
    for ch in 0..NC {
        for h in 0..H {
            let lb = (ch * H + h) * Q;
            let last = lam[lb + Q - 1] as f64;
            for p in 0..P {
                for n in 0..N {
                    let v: f64 = (0..len(ch))
                        .map(|j| {
                            let t = ch * Q + j;
                            (last - lam[lb + j] as f64).min(0.0).exp()
                                * delta(t, h)
                                * x(t, h, p)
                                * b(t, n)
                        })
                        .sum();
                    pairs.push((got[((ch * H + h) * P + p) * N + n], v));
                }
            }
        }
    }
    agree("the chunk states", &pairs)?;

    // The chunk scan, from the CPU's C·Bᵀ and given entering states.
    ctx.queue.write_buffer(&cbb, 0, bytemuck::cast_slice(&cb));
    ctx.queue
        .write_buffer(&cstb, 0, bytemuck::cast_slice(&states));
    // (In f16, as ssd_state_pass hands them to this kernel.)
    let states16: Vec<half::f16> = states.iter().map(|&v| half::f16::from_f32(v)).collect();
    let cst16 = ctx.storage_with("ssd check: cst16", bytemuck::cast_slice(&states16))?;
    let scan = ScanBuffers {
        mix: &mixb,
        u: &ub,
        params: &params,
        lam: &lamb,
        cb: &cbb,
        cst: &cstb,
        cst16: Some(&cst16),
        y: &yb,
        ctrl: &ctrl,
    };
    run(super::ssd_chunk_scan_coop::ssd_chunk_scan_coop(
        k,
        "ssd check: scan",
        cc,
        0,
        scan,
        emulate,
    )?)?;
    let got = ctx.read_f32(&yb, T * DI)?;
    let mut pairs = Vec::new();
    for t in 0..T {
        let (ch, i) = (t / Q, t % Q);
        for h in 0..H {
            let lb = (ch * H + h) * Q;
            let li = lam[lb + i] as f64;
            for p in 0..P {
                let st = &states[((ch * H + h) * P + p) * N..][..N];
                let inter: f64 = (0..N).map(|n| c(t, n) * st[n] as f64).sum();
                let intra: f64 = (0..=i)
                    .map(|j| {
                        let tj = ch * Q + j;
                        cb[(ch * Q + i) * Q + j] as f64
                            * (li - lam[lb + j] as f64).min(0.0).exp()
                            * delta(tj, h)
                            * x(tj, h, p)
                    })
                    .sum();
                let v = li.exp() * inter + intra + d_skip[h] as f64 * x(t, h, p);
                pairs.push((got[t * DI + h * P + p], v));
            }
        }
    }
    agree("the chunk scan", &pairs)
}

/// Whether every (got, want) pair is within 1 % of the largest |want| (a NaN never is).
fn agree(what: &str, pairs: &[(f32, f64)]) -> Result<()> {
    let scale = pairs.iter().fold(0f64, |a, &(_, w)| a.max(w.abs()));
    let (worst, at) = pairs
        .iter()
        .enumerate()
        .map(|(i, &(g, w))| ((g as f64 - w).abs(), i))
        .fold((0f64, 0usize), |a, b| {
            if b.0.is_nan() || b.0 > a.0 { b } else { a }
        });
    if !worst.is_nan() && worst <= 1e-2 * scale {
        Ok(())
    } else {
        Err(Error::Gpu(format!(
            "{what} on the cooperative matrices is off by {worst:.3e} at value {at} (largest \
             value {scale:.3})"
        )))
    }
}
