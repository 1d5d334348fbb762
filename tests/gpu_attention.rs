//! The attention kernels (kv_store → attention_decode + attention_combine, or kv_store →
//! attention_prefill) against the CPU oracle `reference::attention` in f64, from one table
//! of cases. The oracle reads the K/V the GPU stored (read back, so f16 caches are compared
//! on the same rounded values) and the queries rotated on the host. Cache rows past the
//! ones a case stores hold NaN: a kernel that reads past the length fails. Every decode
//! pipeline that holds a case's length gives the same bits (a batch runs the one its
//! longest lane needs, and a lane must equal its run alone). The qkv GEMV
//! that stores K/V itself (fused decode), with or without the pre-norm in its prologue,
//! against the norm, the GEMV and kv_store, bit for bit.

mod common;

use std::sync::Arc;
use std::time::Instant;

use half::f16;
use mamba2_wgpu::gpu::context::GpuContext;
use mamba2_wgpu::gpu::graph::Ctrl;
use mamba2_wgpu::gpu::kernels::attention_combine::attention_combine;
use mamba2_wgpu::gpu::kernels::attention_decode::{
    attention_decode, decode_partials_len, decode_segment,
};
use mamba2_wgpu::gpu::kernels::attention_prefill::attention_prefill;
use mamba2_wgpu::gpu::kernels::attention_prefill_coop::{self, attention_prefill_coop};
use mamba2_wgpu::gpu::kernels::attn::{AttnBuffers, AttnConsts, KvFormat};
use mamba2_wgpu::gpu::kernels::gemv::{GemvBuffers, GemvInput, GemvOutput, KvOut, gemv, stores_kv};
use mamba2_wgpu::gpu::kernels::kv_store::kv_store;
use mamba2_wgpu::gpu::kernels::rmsnorm::{self, NormBuffers, rmsnorm};
use mamba2_wgpu::gpu::kernels::{Dispatch, Kernels, Lanes};
use mamba2_wgpu::gpu::weights::DeviceMatrix;
use mamba2_wgpu::model::quant::{WeightFormat, pack, quantize_activation_block};
use mamba2_wgpu::reference::attention::{AttnDims, attend, attend_rounding, rope};
use mamba2_wgpu::sampling::uniform;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    /// One token: attention_decode + attention_combine (the combine writes q8 too).
    Decode,
    /// A block of `tokens` tokens: attention_prefill.
    Prefill,
    /// The same block on attention_prefill_coop with the stand-ins of its cooperative ops
    /// (the path the tensor cores take, on any device); the oracle rounds the scaled
    /// queries, the keys, the values and the unnormalized weights to f16 as it does.
    PrefillCoop,
}
use Kernel::*;
use KvFormat::{F16, F32};

/// One row of the table. The cache holds `pos0` rows before the step; the step stores
/// `tokens` more (rows pos0 … pos0+tokens−1) and attends to them causally.
#[derive(Clone, Copy, Debug)]
struct Case {
    name: &'static str,
    kernel: Kernel,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Cache capacity (rows).
    ctx: usize,
    pos0: usize,
    tokens: usize,
    format: KvFormat,
    /// RoPE θ.
    rope: Option<f64>,
    /// Largest |o − oracle| allowed (`COOP_TOL` wherever the cooperative kernel runs).
    tol: f64,
}

#[rustfmt::skip]
const CASES: &[Case] = &[
    // name                                                   kernel  H  Hkv  hd   ctx     pos0 T   cache rope          tol
    Case { name: "nemotron-h-8b: H 32, Hkv 8, hd 128, len 1000", kernel: Decode, heads: 32, kv_heads: 8, head_dim: 128, ctx: 4096, pos0: 999, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "nemotron-h-8b: first token (len 1)", kernel: Decode, heads: 32, kv_heads: 8, head_dim: 128, ctx: 4096, pos0: 0, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "nemotron-h-8b: f32 cache, len 37", kernel: Decode, heads: 32, kv_heads: 8, head_dim: 128, ctx: 300, pos0: 36, tokens: 1, format: F32, rope: None, tol: 2e-6 },
    Case { name: "granite-4.0-h-tiny: H 12, Hkv 4, hd 64, len 300", kernel: Decode, heads: 12, kv_heads: 4, head_dim: 64, ctx: 1000, pos0: 299, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "granite-4.0-h-tiny: long segments, len 5001 of 20000", kernel: Decode, heads: 12, kv_heads: 4, head_dim: 64, ctx: 20000, pos0: 5000, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "nemotron-3-nano: H 32, Hkv 2, hd 128, segments of 64, len 9000 of 16384", kernel: Decode, heads: 32, kv_heads: 2, head_dim: 128, ctx: 16384, pos0: 8999, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "mqa: H 16, Hkv 1, hd 128 (two head chunks), len 300", kernel: Decode, heads: 16, kv_heads: 1, head_dim: 128, ctx: 1000, pos0: 299, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "mqa, ragged head chunks: H 9, Hkv 1, hd 128 (5 + 4), len 77", kernel: Decode, heads: 9, kv_heads: 1, head_dim: 128, ctx: 200, pos0: 76, tokens: 1, format: F32, rope: None, tol: 2e-6 },
    Case { name: "mha + rope: H 8, Hkv 8, hd 64, len 1000 = ctx", kernel: Decode, heads: 8, kv_heads: 8, head_dim: 64, ctx: 1000, pos0: 999, tokens: 1, format: F16, rope: Some(10000.0), tol: 1e-5 },
    Case { name: "small: H 6, Hkv 2, hd 16, f32 + rope, len 37 = ctx", kernel: Decode, heads: 6, kv_heads: 2, head_dim: 16, ctx: 37, pos0: 36, tokens: 1, format: F32, rope: Some(500.0), tol: 1e-5 },
    Case { name: "odd: H 3, Hkv 1, hd 18 (o padded, q8 blocks span heads), len 21", kernel: Decode, heads: 3, kv_heads: 1, head_dim: 18, ctx: 50, pos0: 20, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "f16, hd 20 (keys four values per load), H 4, Hkv 2, len 51", kernel: Decode, heads: 4, kv_heads: 2, head_dim: 20, ctx: 100, pos0: 50, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "long: segments of two key tiles, H 4, Hkv 1, hd 64, len 40000 = ctx", kernel: Decode, heads: 4, kv_heads: 1, head_dim: 64, ctx: 40000, pos0: 39999, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "long, odd: two key tiles, H 3, Hkv 1, hd 18, f32, len 33000 of 33001", kernel: Decode, heads: 3, kv_heads: 1, head_dim: 18, ctx: 33001, pos0: 32999, tokens: 1, format: F32, rope: None, tol: 2e-6 },
    Case { name: "nemotron-h-8b: block 40 at pos0 300", kernel: Prefill, heads: 32, kv_heads: 8, head_dim: 128, ctx: 512, pos0: 300, tokens: 40, format: F16, rope: None, tol: 2e-6 },
    Case { name: "granite-4.0-h-tiny: block 64 at pos0 0, f32 cache", kernel: Prefill, heads: 12, kv_heads: 4, head_dim: 64, ctx: 100, pos0: 0, tokens: 64, format: F32, rope: None, tol: 2e-6 },
    Case { name: "granite-4.0-h-tiny: block 37 ending at ctx 1000", kernel: Prefill, heads: 12, kv_heads: 4, head_dim: 64, ctx: 1000, pos0: 963, tokens: 37, format: F16, rope: None, tol: 2e-6 },
    Case { name: "mqa + rope: H 16, Hkv 1, hd 128, block 20 at pos0 5", kernel: Prefill, heads: 16, kv_heads: 1, head_dim: 128, ctx: 64, pos0: 5, tokens: 20, format: F16, rope: Some(10000.0), tol: 1e-5 },
    Case { name: "mqa, ragged head chunks: H 9, Hkv 1, hd 128, block 9 at pos0 50", kernel: Prefill, heads: 9, kv_heads: 1, head_dim: 128, ctx: 59, pos0: 50, tokens: 9, format: F16, rope: None, tol: 2e-6 },
    Case { name: "odd + rope: H 3, Hkv 1, hd 18, f32, block 33 at pos0 7", kernel: Prefill, heads: 3, kv_heads: 1, head_dim: 18, ctx: 45, pos0: 7, tokens: 33, format: F32, rope: Some(10000.0), tol: 1e-5 },
    Case { name: "small: H 6, Hkv 2, hd 16, block 1 at pos0 0", kernel: Prefill, heads: 6, kv_heads: 2, head_dim: 16, ctx: 8, pos0: 0, tokens: 1, format: F16, rope: None, tol: 2e-6 },
    Case { name: "coop, nemotron-h-8b: block 40 at pos0 300", kernel: PrefillCoop, heads: 32, kv_heads: 8, head_dim: 128, ctx: 512, pos0: 300, tokens: 40, format: F16, rope: None, tol: COOP_TOL },
    Case { name: "coop, granite-4.0-h-tiny: block 64 at pos0 0, f32 cache", kernel: PrefillCoop, heads: 12, kv_heads: 4, head_dim: 64, ctx: 100, pos0: 0, tokens: 64, format: F32, rope: None, tol: COOP_TOL },
    Case { name: "coop, granite-4.0-h-tiny: block 37 ending at ctx 1000", kernel: PrefillCoop, heads: 12, kv_heads: 4, head_dim: 64, ctx: 1000, pos0: 963, tokens: 37, format: F16, rope: None, tol: COOP_TOL },
    Case { name: "coop, mqa + rope: H 16, Hkv 1, hd 128, block 20 at pos0 5", kernel: PrefillCoop, heads: 16, kv_heads: 1, head_dim: 128, ctx: 64, pos0: 5, tokens: 20, format: F16, rope: Some(10000.0), tol: COOP_TOL },
    Case { name: "coop, mqa, ragged head chunks: H 9, Hkv 1, hd 128, block 9 at pos0 50", kernel: PrefillCoop, heads: 9, kv_heads: 1, head_dim: 128, ctx: 59, pos0: 50, tokens: 9, format: F16, rope: None, tol: COOP_TOL },
    Case { name: "coop, mha: H 4, Hkv 4, hd 32, block 100 at pos0 70 (many diagonal tiles)", kernel: PrefillCoop, heads: 4, kv_heads: 4, head_dim: 32, ctx: 200, pos0: 70, tokens: 100, format: F16, rope: None, tol: COOP_TOL },
    Case { name: "coop, small: H 6, Hkv 2, hd 16, block 1 at pos0 0", kernel: PrefillCoop, heads: 6, kv_heads: 2, head_dim: 16, ctx: 8, pos0: 0, tokens: 1, format: F16, rope: None, tol: COOP_TOL },
];

/// Largest |o − oracle| of the cooperative prefill kernel: its f32 scores differ from the
/// oracle's f64 ones in the last bits, so now and then a weight rounds to the neighbouring
/// f16 (2^-11 of a weight ≤ 1), which moves o by up to 2^-11·|v − o| over a row sum ≥ 1
/// (lavapipe measured ≤ 1.1e-4; a wrong mask or tile is off by 1e-2 and more).
const COOP_TOL: f64 = 5e-4;

/// Whether the case runs on attention_prefill_coop: always for `PrefillCoop`, and for
/// `Prefill` where `attention_prefill` picks it (a device with cooperative matrices).
fn on_coop(g: &Gpu, c: &Case) -> bool {
    match c.kernel {
        Decode => false,
        Prefill => attention_prefill_coop::applies(&g.k, &consts(c)),
        PrefillCoop => true,
    }
}

/// Extra values at the end of each qkv row (the stride is not the row length).
const QKV_PAD: usize = 3;
/// Prefill buffers hold this many more tokens than the block (the grid is for all of them).
const SPARE_TOKENS: usize = 5;

struct Gpu {
    k: Kernels,
}

impl Gpu {
    fn new() -> Option<Self> {
        common::kernels(64 << 20).map(|k| Gpu { k })
    }
    fn ctx(&self) -> &Arc<GpuContext> {
        &self.k.ctx
    }
    fn buf(&self, bytes: &[u8]) -> wgpu::Buffer {
        self.ctx().storage_with("test", bytes).unwrap()
    }
    fn zeros(&self, n: usize) -> wgpu::Buffer {
        self.ctx().storage_zeroed("test", 4 * n as u64).unwrap()
    }
    fn run(&self, ds: &[&Dispatch]) {
        self.run_rows(ds, None);
    }
    /// Records as a decode step with `rows` KV rows in use (None: the longest length).
    fn run_rows(&self, ds: &[&Dispatch], rows: Option<u32>) {
        let mut enc = self
            .ctx()
            .device
            .create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for d in ds {
                d.record_tokens(&mut pass, rows);
            }
        }
        self.ctx().queue.submit([enc.finish()]);
        self.ctx().wait().unwrap();
    }
    fn words(&self, b: &wgpu::Buffer, n: usize) -> Vec<u32> {
        bytemuck::cast_slice(&self.ctx().read(b, 4 * n as u64).unwrap()).to_vec()
    }
    fn read(&self, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
        self.ctx().read_f32(b, n).unwrap()
    }
}

fn rand(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * uniform(seed, i))
        .collect()
}

/// A cache's host image: `rows` of values, then NaN up to `cap_rows` (never to be read).
fn cache_bytes(format: KvFormat, vals: &[f32], cap_values: usize) -> Vec<u8> {
    match format {
        KvFormat::F32 => {
            let mut v = vals.to_vec();
            v.resize(cap_values, f32::NAN);
            bytemuck::cast_slice(&v).to_vec()
        }
        KvFormat::F16 => {
            let mut v: Vec<f16> = vals.iter().map(|&x| f16::from_f32(x)).collect();
            v.resize(cap_values, f16::NAN);
            bytemuck::cast_slice(&v).to_vec()
        }
    }
}

/// The first `n` values of a cache as f64.
fn cache_values(g: &Gpu, format: KvFormat, b: &wgpu::Buffer, n: usize) -> Vec<f64> {
    match format {
        KvFormat::F32 => g.read(b, n).iter().map(|&x| x as f64).collect(),
        KvFormat::F16 => g
            .words(b, n.div_ceil(2))
            .iter()
            .flat_map(|w| [*w as u16, (*w >> 16) as u16])
            .take(n)
            .map(|h| f16::from_bits(h).to_f64())
            .collect(),
    }
}

fn consts(c: &Case) -> AttnConsts {
    let dims = AttnDims {
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
    };
    AttnConsts {
        dims,
        ctx: c.ctx,
        format: c.format,
        qkv_stride: (c.heads + 2 * c.kv_heads) * c.head_dim + QKV_PAD,
        scale: 1.0 / (c.head_dim as f64).sqrt(),
        rope: c.rope,
    }
}

/// Runs a case; returns the largest |o − oracle|.
fn run_case(g: &Gpu, c: &Case) -> f64 {
    let ac = consts(c);
    let dims = ac.dims;
    let (qs, os) = (ac.qkv_stride, ac.o_stride());
    let t_cap = match c.kernel {
        Decode => 1,
        Prefill | PrefillCoop => c.tokens + SPARE_TOKENS,
    };
    let seed = c.name.len() as u64 * 1000 + c.pos0 as u64;
    // Queries large enough for peaked softmaxes (scores of several units).
    let mut qkv = rand(seed, t_cap * qs, -1.0, 1.0);
    for t in 0..t_cap {
        for x in &mut qkv[t * qs..][..dims.q_len()] {
            *x *= 4.0;
        }
    }
    let kvl = dims.kv_len();
    let old_k = rand(seed + 1, c.pos0 * kvl, -1.0, 1.0);
    let old_v = rand(seed + 2, c.pos0 * kvl, -1.0, 1.0);
    let (kb, vb) = (
        g.buf(&cache_bytes(c.format, &old_k, c.ctx * kvl)),
        g.buf(&cache_bytes(c.format, &old_v, c.ctx * kvl)),
    );
    let qkv_buf = g.buf(bytemuck::cast_slice(&qkv));
    let ctrl = Ctrl {
        kv_len: c.pos0 as u32,
        prompt_len: c.tokens as u32,
        ..Default::default()
    };
    let ctrl_buf = g.buf(bytemuck::bytes_of(&ctrl));
    let b = AttnBuffers {
        qkv: &qkv_buf,
        k_cache: &kb,
        v_cache: &vb,
        ctrl: &ctrl_buf,
        lanes: Lanes::ONE,
    };
    // NaN in o: every value must be written.
    let o = g.buf(bytemuck::cast_slice(&vec![f32::NAN; t_cap * os]));
    let nb = os / 32;
    let (xq, xd) = (g.zeros(nb * 8), g.zeros(nb));
    // o of every pipeline the case runs, each checked against the oracle: decode has one
    // per key tile (the engine picks the narrower ones for shorter contexts), the widest
    // last, whose q8 blocks stay in xq/xd.
    let mut outs = Vec::new();
    match c.kernel {
        Decode => {
            let part = g.zeros(decode_partials_len(&ac));
            let store = kv_store(&g.k, "kv_store", ac, None, &b).unwrap();
            let attn = attention_decode(&g.k, "attn", ac, &b, &part).unwrap();
            let comb = attention_combine(
                &g.k,
                "combine",
                ac,
                Lanes::ONE,
                &part,
                &ctrl_buf,
                &o,
                Some((&xq, &xd)),
            )
            .unwrap();
            assert!(!attn.shorter.is_empty(), "{}: one decode pipeline", c.name);
            // (The store once: with RoPE it rotates q in place.)
            g.run(&[&store]);
            let nan = vec![f32::NAN; t_cap * os];
            let part_nan = vec![f32::NAN; decode_partials_len(&ac)];
            // o of a run from NaN partials and o (a segment or value the run leaves out
            // cannot pass on an earlier run's).
            let run_fresh = |ds: &[&Dispatch], rows: Option<u32>| {
                g.ctx()
                    .queue
                    .write_buffer(&part, 0, bytemuck::cast_slice(&part_nan));
                g.ctx()
                    .queue
                    .write_buffer(&o, 0, bytemuck::cast_slice(&nan));
                g.run_rows(ds, rows);
                g.read(&o, c.tokens * os)
            };
            // The narrowest pipeline that holds the length: the one a lone sequence runs.
            let mut alone: Option<usize> = None;
            let len = (c.pos0 + c.tokens) as u32;
            for (most, d) in attn
                .shorter
                .iter()
                .map(|(m, d)| (*m, d))
                .chain([(u32::MAX, &attn)])
            {
                outs.push(run_fresh(&[d, &comb], None));
                // Narrower grids (one workgroup, three, or the one the length alone needs
                // at segments of 32 keys, and one past it) walk the segments in steps of
                // their width: the same bits.
                let full = d.workgroups.0;
                for x in [1, 3, len.div_ceil(32), len.div_ceil(32) + 1] {
                    if x >= full {
                        continue;
                    }
                    let mut narrow = d.clone();
                    narrow.workgroups.0 = x;
                    let n = outs.len() - 1;
                    assert!(
                        common::bits(&run_fresh(&[&narrow, &comb], None)) == common::bits(&outs[n]),
                        "{}: pipeline {n} on a grid {x} wide (not {full}) gives other bits",
                        c.name
                    );
                }
                // A batch records the pipeline its longest lane needs, so every pipeline
                // that holds this length must give the same bits (batched == alone).
                if len <= most {
                    let n = outs.len() - 1;
                    let a = *alone.get_or_insert(n);
                    assert!(
                        common::bits(&outs[n]) == common::bits(&outs[a]),
                        "{}: pipelines {a} and {n} both hold length {len} but give other bits",
                        c.name
                    );
                }
            }
            // As a decode step records it for `len` rows in use (the narrowest tile that
            // holds them, on the grid their segments fill): the lone run's bits.
            let a = alone.expect("the widest pipeline holds every length");
            assert!(
                common::bits(&run_fresh(&[&attn, &comb], Some(len))) == common::bits(&outs[a]),
                "{}: recorded for {len} rows: other bits than pipeline {a}",
                c.name
            );
        }
        Prefill => {
            let store = kv_store(&g.k, "kv_store", ac, Some(t_cap), &b).unwrap();
            let attn = attention_prefill(&g.k, "attn", ac, t_cap, &b, &o).unwrap();
            g.run(&[&store, &attn]);
        }
        PrefillCoop => {
            let store = kv_store(&g.k, "kv_store", ac, Some(t_cap), &b).unwrap();
            // The real cooperative ops where the device has them, else their stand-ins.
            let emulate = !g.k.ctx.caps.coop_matrix;
            let attn =
                attention_prefill_coop(&g.k, "attn coop", ac, t_cap, &b, &o, emulate).unwrap();
            g.run(&[&store, &attn]);
        }
    }
    // The oracle: host-rotated queries, the K/V the GPU holds.
    let len = c.pos0 + c.tokens;
    let k = cache_values(g, c.format, &kb, len * kvl);
    let v = cache_values(g, c.format, &vb, len * kvl);
    let mut q = Vec::with_capacity(c.tokens * dims.q_len());
    for t in 0..c.tokens {
        let mut qt: Vec<f64> = qkv[t * qs..][..dims.q_len()]
            .iter()
            .map(|&x| x as f64)
            .collect();
        if let Some(theta) = c.rope {
            rope(&mut qt, c.head_dim, c.pos0 + t, theta);
        }
        q.extend(qt);
    }
    let want = if on_coop(g, c) {
        // The queries as the kernel read them (rotated in place by kv_store on the GPU),
        // scaled in f32 and rounded to f16.
        let h = |x: f64| f16::from_f64(x).to_f64();
        let rows = g.read(&qkv_buf, c.tokens * qs);
        let q: Vec<f64> = (0..c.tokens)
            .flat_map(|t| rows[t * qs..][..dims.q_len()].to_vec())
            .map(|x| f16::from_f32(x * ac.scale as f32).to_f64())
            .collect();
        let (k, v): (Vec<f64>, Vec<f64>) = (
            k.iter().map(|&x| h(x)).collect(),
            v.iter().map(|&x| h(x)).collect(),
        );
        attend_rounding(dims, &q, &k, &v, c.pos0, 1.0, h)
    } else {
        attend(dims, &q, &k, &v, c.pos0, ac.scale)
    };
    if outs.is_empty() {
        outs.push(g.read(&o, c.tokens * os));
    }
    let mut err = 0f64;
    for (n, got) in outs.iter().enumerate() {
        for t in 0..c.tokens {
            let row = &got[t * os..][..os];
            for (i, &x) in row.iter().enumerate() {
                let w = if i < dims.q_len() {
                    want[t * dims.q_len() + i]
                } else {
                    0.0
                };
                assert!(x.is_finite(), "{}: pipeline {n}: o[{t}][{i}] = {x}", c.name);
                err = err.max((x as f64 - w).abs());
            }
        }
    }
    let got = outs.last().expect("one output");
    if c.kernel == Decode {
        // The q8 blocks are those of o (ggml's rule).
        let (gq, gd) = (g.words(&xq, nb * 8), g.read(&xd, nb));
        for (bi, blk) in got[..os].chunks(32).enumerate() {
            let (q, d) = quantize_activation_block(blk.try_into().unwrap());
            assert!((gd[bi] - d).abs() <= 1e-6 * d.abs(), "{}: xd[{bi}]", c.name);
            for (j, &qi) in q.iter().enumerate() {
                let gi = (gq[bi * 8 + j / 4] >> (8 * (j % 4))) as u8 as i8;
                assert!(
                    (gi as i32 - qi as i32).abs() <= 1,
                    "{}: xq block {bi}",
                    c.name
                );
            }
        }
    }
    err
}

#[test]
fn attention_matches_the_oracle() {
    let Some(g) = Gpu::new() else { return };
    let mut failed = Vec::new();
    for c in CASES {
        let start = Instant::now();
        let err = run_case(&g, c);
        let seg = match c.kernel {
            Decode => format!(", segment {}", decode_segment(&consts(c))),
            Prefill | PrefillCoop => String::new(),
        };
        eprintln!(
            "{:<72} max |err| {err:.2e} (tol {:.0e}){seg}, {:.2} s",
            c.name,
            if on_coop(&g, c) { COOP_TOL } else { c.tol },
            start.elapsed().as_secs_f64()
        );
        let tol = if on_coop(&g, c) { COOP_TOL } else { c.tol };
        if err.is_nan() || err > tol {
            failed.push(format!("{}: {err:e} > {tol:e}", c.name));
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

/// kv_store alone: rows land at kv_len + t and nowhere else (not even past ctx), q and k
/// are rotated as `rope` does, and a stopped step changes nothing.
#[test]
fn kv_store_rows_rope_and_stop() {
    let Some(g) = Gpu::new() else { return };
    let dims = AttnDims {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let (ctx, kvl) = (10, dims.kv_len());
    for format in [F32, F16] {
        for rope_theta in [None, Some(10000.0)] {
            // (kv_len, tokens, stopped): a block in the middle, a block running past ctx
            // (only rows < ctx are stored), one decode token at the last row, a stopped step.
            for (kv_len, tokens, stopped) in [(5, 3, 0), (8, 4, 0), (9, 0, 0), (2, 2, 1)] {
                let ac = AttnConsts {
                    dims,
                    ctx,
                    format,
                    qkv_stride: (dims.heads + 2 * dims.kv_heads) * 16 + QKV_PAD,
                    scale: 1.0,
                    rope: rope_theta,
                };
                let qs = ac.qkv_stride;
                let decode = tokens == 0;
                let t = tokens.max(1);
                let qkv = rand(7 + kv_len as u64, t * qs, -2.0, 2.0);
                // A block's buffer has room for its capacity (two spare tokens).
                let block = (!decode).then_some(t + 2);
                let mut room = qkv.clone();
                room.resize(block.unwrap_or(1) * qs, 0.0);
                let qkv_buf = g.buf(bytemuck::cast_slice(&room));
                // Two spare rows past ctx: they must stay untouched.
                let spare = (ctx + 2) * kvl;
                let sentinel = cache_bytes(format, &[], spare);
                let (kb, vb) = (g.buf(&sentinel), g.buf(&sentinel));
                let ctrl = Ctrl {
                    kv_len,
                    prompt_len: t as u32,
                    stopped,
                    ..Default::default()
                };
                let ctrl_buf = g.buf(bytemuck::bytes_of(&ctrl));
                let b = AttnBuffers {
                    qkv: &qkv_buf,
                    k_cache: &kb,
                    v_cache: &vb,
                    ctrl: &ctrl_buf,
                    lanes: Lanes::ONE,
                };
                g.run(&[&kv_store(&g.k, "kv_store", ac, block, &b).unwrap()]);
                let what = format!("{format:?} rope {rope_theta:?} kv_len {kv_len} T {t}");
                let got_q = g.read(&qkv_buf, t * qs);
                let got_k = cache_values(&g, format, &kb, spare);
                let got_v = cache_values(&g, format, &vb, spare);
                let ftol = |x: f64| match format {
                    F32 => 2e-6 * x.abs().max(1.0),
                    F16 => x.abs() / 1024.0 + 1e-7,
                };
                for row in 0..ctx + 2 {
                    let tok = row as isize - kv_len as isize;
                    let stored = stopped == 0 && row < ctx && tok >= 0 && (tok as usize) < t;
                    for i in 0..kvl {
                        let (gk, gv) = (got_k[row * kvl + i], got_v[row * kvl + i]);
                        if !stored {
                            assert!(gk.is_nan() && gv.is_nan(), "{what}: row {row} written");
                            continue;
                        }
                        let src = &qkv[tok as usize * qs..];
                        let mut k: Vec<f64> = src[dims.q_len()..][..kvl]
                            .iter()
                            .map(|&x| x as f64)
                            .collect();
                        if let Some(theta) = rope_theta {
                            rope(&mut k, 16, row, theta);
                        }
                        let v = src[dims.q_len() + kvl + i] as f64;
                        assert!((gk - k[i]).abs() <= ftol(k[i]), "{what}: k[{row}][{i}]");
                        assert!((gv - v).abs() <= ftol(v), "{what}: v[{row}][{i}]");
                    }
                }
                // q: rotated in place for stored tokens only; nothing else in qkv moves.
                for tk in 0..t {
                    let row = &qkv[tk * qs..][..qs];
                    let mut want: Vec<f64> = row.iter().map(|&x| x as f64).collect();
                    let pos = kv_len as usize + tk;
                    if let Some(theta) = rope_theta
                        && stopped == 0
                        && pos < ctx
                    {
                        rope(&mut want[..dims.q_len()], 16, pos, theta);
                    }
                    for (i, w) in want.iter().enumerate() {
                        let gq = got_q[tk * qs + i] as f64;
                        assert!((gq - w).abs() <= 1e-5, "{what}: qkv[{tk}][{i}] {gq} vs {w}");
                    }
                }
            }
        }
    }
}

/// One decode step of the qkv GEMV tests: a cache of `ctx` rows of `kvl` values, `kv_len`
/// rows in it, the step stopped or not.
struct KvStep {
    ac: AttnConsts,
    ctrl: wgpu::Buffer,
    /// The caches' bytes before the step: NaN everywhere (rows nothing should write).
    sentinel: Vec<u8>,
    rows: usize,
    kvl: usize,
}

impl KvStep {
    fn new(g: &Gpu, dims: AttnDims, ctx: usize, format: KvFormat, step: (u32, u32)) -> Self {
        let kvl = dims.kv_len();
        let rows = dims.q_len() + 2 * kvl;
        let ctrl = Ctrl {
            kv_len: step.0,
            stopped: step.1,
            ..Default::default()
        };
        KvStep {
            ac: AttnConsts {
                dims,
                ctx,
                format,
                qkv_stride: rows,
                scale: 1.0,
                rope: None,
            },
            ctrl: g.buf(bytemuck::bytes_of(&ctrl)),
            sentinel: cache_bytes(format, &[], ctx * kvl),
            rows,
            kvl,
        }
    }

    /// Runs what `record` makes for fresh buffers (qkv zeroed, NaN caches; the K/V output
    /// a GEMV stores to, and the same as the attention kernels' view): the words of qkv
    /// and of both caches after it.
    fn run(
        &self,
        g: &Gpu,
        record: impl Fn(&wgpu::Buffer, KvOut, &AttnBuffers) -> Vec<Dispatch>,
    ) -> [Vec<u32>; 3] {
        let (qkv, kb, vb) = (
            g.zeros(self.rows),
            g.buf(&self.sentinel),
            g.buf(&self.sentinel),
        );
        let f32 = self.ac.format == F32;
        let kv = KvOut {
            k_cache: &kb,
            v_cache: &vb,
            ctrl: &self.ctrl,
            q_rows: self.ac.dims.q_len(),
            kv_rows: self.kvl,
            ctx: self.ac.ctx,
            f32,
        };
        let b = AttnBuffers {
            qkv: &qkv,
            k_cache: &kb,
            v_cache: &vb,
            ctrl: &self.ctrl,
            lanes: Lanes::ONE,
        };
        let ds = record(&qkv, kv, &b);
        g.run(&ds.iter().collect::<Vec<_>>());
        let words = self.ac.ctx * self.kvl / if f32 { 1 } else { 2 };
        [
            g.words(&qkv, self.rows),
            g.words(&kb, words),
            g.words(&vb, words),
        ]
    }
}

/// `got` and `want` (`KvStep::run`'s) bit for bit, and the rows not all zero.
fn assert_same_step(what: &str, got: &[Vec<u32>; 3], want: &[Vec<u32>; 3]) {
    assert!(
        want[0].iter().any(|v| *v != 0),
        "{what}: the rows are not all zero"
    );
    for (i, part) in ["qkv", "k cache", "v cache"].iter().enumerate() {
        assert_eq!(got[i], want[i], "{what}: {part}");
    }
}

/// The one-token qkv GEMV that stores the k and v rows itself (NoPE, fused decode) leaves
/// the caches and `qkv` bit for bit as the GEMV followed by kv_store does, in f32 and f16
/// caches and f32 / f16 weights: at a middle row, the last row, a full cache (nothing
/// stored) and a stopped step (nothing stored).
#[test]
fn qkv_gemv_stores_kv_as_kv_store_does() {
    let Some(g) = Gpu::new() else { return };
    let dims = AttnDims {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let (ctx, kvl, cols) = (10, dims.kv_len(), 40);
    let rows = dims.q_len() + 2 * kvl;
    let w = rand(31, rows * cols, -0.5, 0.5);
    let mut x = rand(32, cols, -1.0, 1.0);
    x.resize(cols.next_multiple_of(32), 0.0);
    let xb = g.buf(bytemuck::cast_slice(&x));
    for wf in [WeightFormat::F32, WeightFormat::F16] {
        let m = DeviceMatrix::upload(g.ctx(), "qkv", &pack(wf, &w, rows, cols)).unwrap();
        for format in [F32, F16] {
            assert!(stores_kv(&g.k, &m, dims.q_len(), kvl, format == F32, None).unwrap());
            for (kv_len, stopped) in [(4, 0), (9, 0), (10, 0), (3, 1)] {
                let what = format!(
                    "{} weights, {format:?} cache, kv_len {kv_len}, stopped {stopped}",
                    wf.name()
                );
                let step = KvStep::new(&g, dims, ctx, format, (kv_len, stopped));
                let run = |fold: bool| {
                    step.run(&g, |qkv, kv, b| {
                        let bufs = GemvBuffers {
                            kv: fold.then_some(kv),
                            ..GemvBuffers::plain(&xb, None, qkv)
                        };
                        let input = GemvInput::Plain;
                        let mut ds =
                            vec![gemv(&g.k, "qkv", &m, input, GemvOutput::Store, bufs).unwrap()];
                        if !fold {
                            ds.push(kv_store(&g.k, "kv_store", step.ac, None, b).unwrap());
                        }
                        ds
                    })
                };
                let (want, got) = (run(false), run(true));
                assert_same_step(&what, &got, &want);
                let stored = stopped == 0 && (kv_len as usize) < ctx;
                let row =
                    &cache_values(&g, format, &g.buf(bytemuck::cast_slice(&got[1])), ctx * kvl)
                        [kv_len as usize % ctx * kvl..][..kvl];
                assert_eq!(
                    row.iter().all(|v| v.is_nan()),
                    !stored,
                    "{what}: the token's k row stored or not"
                );
            }
        }
    }
}

/// The one-token qkv GEMV of quantized weights with the block's pre-norm folded into its
/// prologue (it reads the residual) and the K/V store in its epilogue (fused decode where
/// `folds_norm` allows): `qkv` and the caches bit for bit what the norm kernel, the plain
/// GEMV and kv_store leave, for a width that is not a multiple of 32, f32 and f16 caches, a
/// middle row, a full cache and a stopped step.
#[test]
fn qkv_gemv_with_the_pre_norm_folded_in_stores_kv_as_the_kernels_do() {
    let Some(g) = Gpu::new() else { return };
    let dims = AttnDims {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let (ctx, kvl, d, nw_off) = (10, dims.kv_len(), 300, 5);
    let rows = dims.q_len() + 2 * kvl;
    let w = rand(41, rows * d, -0.5, 0.5);
    let resid = g.buf(bytemuck::cast_slice(&rand(42, d, -3.0, 3.0)));
    let params = [vec![0.0; nw_off], rand(43, d, 0.5, 1.5)].concat();
    let pbuf = g.buf(bytemuck::cast_slice(&params));
    // The norm's workgroup sizes: the default and the largest (`MAMBA2_NORM_WG` picks).
    let wgs = [rmsnorm::CHUNK, (g.k.max_workgroup() as usize).min(1024)];
    for wf in [WeightFormat::Q8_0, WeightFormat::Q4_K] {
        let m = DeviceMatrix::upload(g.ctx(), "qkv", &pack(wf, &w, rows, d)).unwrap();
        for format in [F32, F16] {
            for wg in wgs {
                assert!(stores_kv(&g.k, &m, dims.q_len(), kvl, format == F32, Some(wg)).unwrap());
            }
            for (kv_len, stopped, wg) in [
                (4, 0, wgs[0]),
                (10, 0, wgs[0]),
                (3, 1, wgs[0]),
                (4, 0, wgs[1]),
            ] {
                let what = format!(
                    "{} weights, {format:?} cache, kv_len {kv_len}, stopped {stopped}, \
                     norm workgroups of {wg}",
                    wf.name()
                );
                let step = KvStep::new(&g, dims, ctx, format, (kv_len, stopped));
                let want = step.run(&g, |qkv, _, b| {
                    // (A k-quant's columns pad to 256: zero blocks past d.)
                    let kp = m.kp;
                    let (h, xq, xd) = (g.zeros(kp), g.zeros(kp / 4), g.zeros(kp / 32));
                    let nb = NormBuffers {
                        src: &resid,
                        params: &pbuf,
                        dst: &h,
                        q8: Some((&xq, &xd)),
                    };
                    let bufs = GemvBuffers::plain(&h, Some((&xq, &xd)), qkv);
                    let input = GemvInput::Plain;
                    vec![
                        rmsnorm(&g.k, "norm", d, 1e-5, nw_off, 1, wg, nb).unwrap(),
                        gemv(&g.k, "qkv", &m, input, GemvOutput::Store, bufs).unwrap(),
                        kv_store(&g.k, "kv_store", step.ac, None, b).unwrap(),
                    ]
                });
                let got = step.run(&g, |qkv, kv, _| {
                    let input = GemvInput::Norm {
                        d,
                        eps: 1e-5,
                        nw_off,
                        wg,
                    };
                    let bufs = GemvBuffers {
                        params: Some(&pbuf),
                        kv: Some(kv),
                        ..GemvBuffers::plain(&resid, None, qkv)
                    };
                    vec![gemv(&g.k, "qkv", &m, input, GemvOutput::Store, bufs).unwrap()]
                });
                assert_same_step(&what, &got, &want);
            }
        }
    }
}

/// The cooperative prefill attention's WGSL with the real cooperative ops, for every
/// shape of the table it takes and the H200's 48 KiB of workgroup memory (lavapipe runs
/// the stand-ins), through naga's parser, validator and SPIR-V writer.
#[test]
fn attention_prefill_coop_wgsl_validates() {
    let mut checked = 0;
    for c in CASES {
        let ac = consts(c);
        if !attention_prefill_coop::takes(&ac) {
            continue;
        }
        let text = attention_prefill_coop::coop_wgsl(&ac, 48 * 1024).unwrap();
        let module = naga::front::wgsl::parse_str(&text)
            .unwrap_or_else(|e| panic!("{}: {}", c.name, e.emit_to_string(&text)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {e:?}", c.name));
        naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", c.name));
        checked += 1;
    }
    assert!(checked > 0, "no case the cooperative kernel takes");
}
