//! Every WGSL kernel against the CPU reference (the ggml test-backend-ops habit), at shapes
//! that are not multiples of the workgroup or row-block sizes, with G > 1 and a head dim
//! that is not a power of two. f32 paths: NMSE ≤ 1e-7. The q8_0 GEMV equals the host's q8_0
//! dot product to f32 rounding.

mod common;

use std::sync::Arc;

use mamba2_wgpu::gpu::context::GpuContext;
use mamba2_wgpu::gpu::graph::Ctrl;
use mamba2_wgpu::gpu::kernels::argmax::ArgmaxInput;
use mamba2_wgpu::gpu::kernels::gated_norm::{Batch, GatedNormBuffers};
use mamba2_wgpu::gpu::kernels::gemv::{
    GemvBuffers, GemvInput, GemvOutput, MixerConsts, NormOut, gemv,
};
use mamba2_wgpu::gpu::kernels::rmsnorm::NormBuffers;
use mamba2_wgpu::gpu::kernels::ssd_step::{SsdBuffers, SsdConsts, ssd_step};
use mamba2_wgpu::gpu::kernels::{
    Dispatch, Kernels, Lanes, argmax, conv_step, embed, gated_norm, residual_add, rmsnorm, sample,
};
use mamba2_wgpu::gpu::weights::DeviceMatrix;
use mamba2_wgpu::model::quant::{
    Packed, WeightFormat, pack, q8_0_gemv_reference, quantize_activation_block, unpack,
};
use mamba2_wgpu::reference::math::{
    gated_group_rmsnorm, matvec, rmsnorm as ref_rmsnorm, silu, softplus,
};
use mamba2_wgpu::reference::{ScanDims, ScanInputs, scan_sequential};
use mamba2_wgpu::sampling::{
    Sampling, argmax as ref_argmax, sample as ref_sample, seed_key, uniform,
};

struct Gpu {
    k: Kernels,
}

impl Gpu {
    fn new() -> Option<Self> {
        common::kernels(1 << 20).map(|k| Gpu { k })
    }
    fn ctx(&self) -> &Arc<GpuContext> {
        &self.k.ctx
    }
    fn buf(&self, v: &[f32]) -> wgpu::Buffer {
        self.ctx()
            .storage_with("test", bytemuck::cast_slice(v))
            .unwrap()
    }
    /// u32 words (q8 blocks, expert ids) as a storage buffer.
    fn words(&self, v: &[u32]) -> wgpu::Buffer {
        self.ctx()
            .storage_with("words", bytemuck::cast_slice(v))
            .unwrap()
    }
    fn zeros(&self, n: usize) -> wgpu::Buffer {
        self.ctx().storage_zeroed("test", 4 * n as u64).unwrap()
    }
    fn ctrl(&self, c: &Ctrl) -> wgpu::Buffer {
        self.ctx()
            .storage_with("ctrl", bytemuck::bytes_of(c))
            .unwrap()
    }
    fn run(&self, d: &Dispatch) {
        let mut enc = self
            .ctx()
            .device
            .create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            d.record(&mut pass);
        }
        self.ctx().queue.submit([enc.finish()]);
        self.ctx().wait().unwrap();
    }
    fn read(&self, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
        self.ctx().read_f32(b, n).unwrap()
    }
    fn read_ctrl(&self, b: &wgpu::Buffer) -> Ctrl {
        let bytes = self.ctx().read(b, 64).unwrap();
        bytemuck::pod_read_unaligned(&bytes[..64])
    }
}

fn rand(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * uniform(seed, i))
        .collect()
}

fn assert_nmse(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = common::nmse(got, want);
    assert!(e <= tol, "{what}: NMSE {e:e} > {tol:e}");
}

fn matrix(
    g: &Gpu,
    format: WeightFormat,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> (DeviceMatrix, Vec<f32>) {
    let p = pack(format, w, rows, cols);
    (DeviceMatrix::upload(g.ctx(), "w", &p).unwrap(), unpack(&p))
}

/// x zero-padded to a multiple of 32 (what producers leave in the activation buffers).
fn padded(x: &[f32]) -> Vec<f32> {
    let mut v = x.to_vec();
    v.resize(x.len().next_multiple_of(32), 0.0);
    v
}

/// The q8 activation blocks of x, as the kernels' producers write them.
fn q8_blocks(x: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let x = padded(x);
    let (mut q, mut d) = (Vec::new(), Vec::new());
    for b in x.chunks(32) {
        let (qs, s) = quantize_activation_block(b.try_into().unwrap());
        q.extend(
            qs.chunks(4)
                .map(|c| u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8])),
        );
        d.push(s);
    }
    (q, d)
}

/// A kernel's q8 output (`q` words, `d` scales) against the host's blocks of its own f32
/// output `x`: the quants exact; a scale is amax / 127, and Vulkan lets OpFDiv be off by
/// 2.5 ulp (NVIDIA's is, by one), so the scales match to 3 ulp, not bit for bit.
fn assert_q8_of(what: &str, q: &[u32], d: &[f32], x: &[f32]) {
    let (q8, d8) = q8_blocks(x);
    assert_eq!(q, q8, "{what}: q8 blocks");
    for (i, (a, b)) in d.iter().zip(&d8).enumerate() {
        let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(ulps <= 3, "{what}: q8 scale {i}: {a} against {b}");
    }
}

/// Dequantized q8 blocks (to check a producer's q8 output against its f32 output).
fn dequant(q: &[u32], d: &[f32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (q[i / 4].to_le_bytes()[i % 4] as i8) as f32 * d[i / 32])
        .collect()
}

/// `dst = W·x` for a quantized `p` through the GEMV's integer dots: x (zero-padded to the
/// matrix's KP) goes in as q8 blocks, which are returned.
fn q8_gemv(
    g: &Gpu,
    p: &Packed,
    x: &[f32],
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> (Vec<u32>, Vec<f32>) {
    let m = DeviceMatrix::upload(g.ctx(), "w", p).unwrap();
    let mut xp = x.to_vec();
    xp.resize(p.kp, 0.0);
    let (q, d) = q8_blocks(&xp);
    let (qb, db) = (
        g.ctx()
            .storage_with("xq", bytemuck::cast_slice(&q))
            .unwrap(),
        g.buf(&d),
    );
    g.run(
        &gemv(
            &g.k,
            "t",
            &m,
            GemvInput::Plain,
            GemvOutput::Store,
            gemv_buffers(src, Some((&qb, &db)), dst),
        )
        .unwrap(),
    );
    (q, d)
}

fn gemv_buffers<'a>(
    src: &'a wgpu::Buffer,
    q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    dst: &'a wgpu::Buffer,
) -> GemvBuffers<'a> {
    GemvBuffers::plain(src, q8, dst)
}

#[test]
fn gemv_every_format_and_shape() {
    let Some(g) = Gpu::new() else { return };
    // Row counts that take 1, 2 and 4 rows per team, none a multiple of anything.
    for (rows, cols) in [
        (37, 70),
        (8, 256),
        (129, 1000),
        (3, 5),
        (2051, 70),
        (8195, 40),
    ] {
        let w = rand(1, rows * cols, -1.0, 1.0);
        let x = rand(2, cols, -2.0, 2.0);
        let (src, dst) = (g.buf(&padded(&x)), g.zeros(rows));
        for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16] {
            let (m, deq) = matrix(&g, format, &w, rows, cols);
            g.run(
                &gemv(
                    &g.k,
                    "t",
                    &m,
                    GemvInput::Plain,
                    GemvOutput::Store,
                    gemv_buffers(&src, None, &dst),
                )
                .unwrap(),
            );
            let mut want = vec![0f32; rows];
            matvec(&deq, &x, &mut want);
            assert_nmse(
                &format!("gemv {} [{rows},{cols}]", format.name()),
                &g.read(&dst, rows),
                &want,
                1e-7,
            );
        }
        // q8_0: equal to the host's q8_0 dot product (same integer dots) to f32 rounding.
        let p = pack(WeightFormat::Q8_0, &w, rows, cols);
        q8_gemv(&g, &p, &x, &src, &dst);
        let want = q8_0_gemv_reference(&p, &x);
        let got = g.read(&dst, rows);
        let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
        for (r, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-6 * scale,
                "q8_0 [{rows},{cols}] row {r}: {a} vs {b}"
            );
        }
        // The 4/5/6-bit formats: the dot product of the dequantized weights with the
        // dequantized q8 input (what their integer dots compute exactly), to f32 rounding
        // of the block sums.
        for format in [
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q4_K,
            WeightFormat::Q5_K,
            WeightFormat::Q6_K,
        ] {
            let p = pack(format, &w, rows, cols);
            let (q, d) = q8_gemv(&g, &p, &x, &src, &dst);
            let (deq, xd) = (unpack(&p), dequant(&q, &d, cols));
            let got = g.read(&dst, rows);
            for r in 0..rows {
                let row = &deq[r * cols..(r + 1) * cols];
                let want: f64 = row
                    .iter()
                    .zip(&xd)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                let mag: f64 = row.iter().zip(&xd).map(|(a, b)| (a * b).abs() as f64).sum();
                assert!(
                    (got[r] as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                    "{} [{rows},{cols}] row {r}: {} vs {want}",
                    format.name(),
                    got[r]
                );
            }
        }
    }
}

/// The batch GEMV (`gemv_lanes.wgsl`) against the one-token kernel, bitwise, lane by lane:
/// every weight format, plain and group-normed inputs (whose teams own several rows), row
/// counts no tiling divides, 3 of 5 lanes dispatched (60 of 64 on one matrix).
#[test]
fn gemv_lanes_equal_the_one_token_kernel_bitwise() {
    let Some(g) = Gpu::new() else { return };
    // q8_0 takes the staged kernel on small matrices (3 lanes: one lane group per row; 9:
    // three, the last short) and the register kernel on 16448 rows with the group norm
    // (257 of its workgroups; `gemv::staging` says where each goes).
    let all = &WeightFormat::ALL[..];
    for (n, cap, rows, cols, grouped, formats) in [
        (3, 5, 37, 256, true, all),
        (3, 5, 2051, 256, true, all),
        (3, 5, 129, 1000, false, all),
        (9, 10, 37, 256, true, all),
        (9, 10, 129, 1000, false, all),
        // (Small f32 matrices spread their lanes over more workgroups, `gemv::spread_small`:
        // at 60 lanes f32 takes 2 a workgroup.)
        (60, 64, 129, 1000, false, all),
        (3, 5, 129, 1024, true, all),
        (3, 5, 16448, 256, true, &[WeightFormat::Q8_0][..]),
    ] {
        let lanes = Lanes::new(n, cap);
        let w = rand(3, rows * cols, -1.0, 1.0);
        // 300 blocks per group: more than a 256-invocation prologue's share.
        let (groups, bpg) = (2, if cols == 1024 { 300 } else { 4 });
        for &format in formats {
            let p = pack(format, &w, rows, cols);
            let m = DeviceMatrix::upload(g.ctx(), "w", &p).unwrap();
            // Each lane's input: f32 rows and q8 blocks, lanes W values apart.
            let width = p.kp.next_multiple_of(256);
            let (mut src, mut xq, mut xd) = (
                vec![0f32; cap * width],
                vec![0u32; cap * width / 4],
                vec![0f32; cap * width / 32],
            );
            let mut one = Vec::new();
            for l in 0..cap {
                let mut x = rand(10 + l as u64, cols, -2.0, 2.0);
                x.resize(p.kp, 0.0);
                let (q, d) = q8_blocks(&x);
                src[l * width..l * width + p.kp].copy_from_slice(&x);
                xq[l * width / 4..l * width / 4 + q.len()].copy_from_slice(&q);
                xd[l * width / 32..l * width / 32 + d.len()].copy_from_slice(&d);
                one.push((x, q, d));
            }
            let part = rand(7, cap * groups * bpg, 0.5, 2.0);
            let input = if grouped {
                GemvInput::Group {
                    groups,
                    group_size: cols / groups,
                    blocks_per_group: bpg,
                    eps: 1e-5,
                }
            } else {
                GemvInput::Plain
            };
            let quantized = format.reads_q8();
            let (sb, qb, db, pb) = (
                g.buf(&src),
                g.ctx()
                    .storage_with("xq", bytemuck::cast_slice(&xq))
                    .unwrap(),
                g.buf(&xd),
                g.buf(&part),
            );
            let dst = g.zeros(cap * rows);
            g.run(
                &gemv(
                    &g.k,
                    "lanes",
                    &m,
                    input,
                    GemvOutput::Store,
                    GemvBuffers {
                        part: Some(&pb),
                        lanes,
                        ..gemv_buffers(&sb, quantized.then_some((&qb, &db)), &dst)
                    },
                )
                .unwrap(),
            );
            let got = g.read(&dst, cap * rows);
            for (l, (x, q, d)) in one.iter().enumerate().take(n) {
                let (s1, q1, d1, p1) = (
                    g.buf(x),
                    g.ctx().storage_with("xq", bytemuck::cast_slice(q)).unwrap(),
                    g.buf(d),
                    g.buf(&part[l * groups * bpg..(l + 1) * groups * bpg]),
                );
                let d1st = g.zeros(rows);
                g.run(
                    &gemv(
                        &g.k,
                        "one",
                        &m,
                        input,
                        GemvOutput::Store,
                        GemvBuffers {
                            part: Some(&p1),
                            ..gemv_buffers(&s1, quantized.then_some((&q1, &d1)), &d1st)
                        },
                    )
                    .unwrap(),
                );
                let want = g.read(&d1st, rows);
                let lane = &got[l * rows..(l + 1) * rows];
                for r in 0..rows {
                    assert_eq!(
                        lane[r].to_bits(),
                        want[r].to_bits(),
                        "{} [{rows},{cols}] grouped {grouped}, {n} lanes: lane {l} row {r}: {} vs {}",
                        format.name(),
                        lane[r],
                        want[r]
                    );
                }
            }
        }
    }
}

/// A part of a stacked projection (`GemvBuffers::dst_row0`, attention's q/k/v kept in
/// their stored types): its rows land from row0 of each lane's output, bit for bit what
/// the whole-buffer GEMV writes, stored or added, one token and over lanes, and every other
/// value of the output stays as it was. With an output scale (`DeviceMatrix::out_scale`,
/// Granite's residual multiplier) every stored row is the unscaled row times it, bit for
/// bit.
#[test]
fn gemv_writes_a_part_from_its_first_row_and_scales_it() {
    let Some(g) = Gpu::new() else { return };
    let (rows, cols, row0, width) = (37, 256, 45, 101);
    let w = rand(5, rows * cols, -1.0, 1.0);
    for (n, cap) in [(1, 1), (3, 4)] {
        let lanes = Lanes::new(n, cap);
        for format in [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q6_K] {
            let p = pack(format, &w, rows, cols);
            let stride = p.kp.next_multiple_of(256);
            let mut src = vec![0f32; cap * stride];
            for l in 0..cap {
                let x = rand(20 + l as u64, cols, -2.0, 2.0);
                src[l * stride..l * stride + cols].copy_from_slice(&x);
            }
            let (mut xq, mut xd) = (Vec::new(), Vec::new());
            for l in 0..cap {
                let (q, d) = q8_blocks(&src[l * stride..(l + 1) * stride]);
                xq.extend(q);
                xd.extend(d);
            }
            let (sb, qb, db) = (
                g.buf(&src),
                g.ctx()
                    .storage_with("xq", bytemuck::cast_slice(&xq))
                    .unwrap(),
                g.buf(&xd),
            );
            let q8 = format.reads_q8().then_some((&qb, &db));
            let before = rand(9, cap * width, -3.0, 3.0);
            let mut unscaled = Vec::new();
            for (rs, output) in [
                (1.0, GemvOutput::Store),
                (1.0, GemvOutput::Add),
                (0.22, GemvOutput::Store),
                (0.22, GemvOutput::Add),
            ] {
                let m = DeviceMatrix::upload(g.ctx(), "w", &p).unwrap().scaled(rs);
                // The whole-buffer GEMV over the same lanes (rows `rows` apart, no offset).
                let whole = g.buf(&vec![0f32; cap * rows]);
                let lane_rows: Vec<f32> = (0..cap)
                    .flat_map(|l| before[l * width + row0..l * width + row0 + rows].to_vec())
                    .collect();
                g.ctx()
                    .queue
                    .write_buffer(&whole, 0, bytemuck::cast_slice(&lane_rows));
                let run = |dst: &wgpu::Buffer, dst_row0: usize| {
                    g.run(
                        &gemv(
                            &g.k,
                            "part",
                            &m,
                            GemvInput::Plain,
                            output,
                            GemvBuffers {
                                lanes,
                                dst_row0,
                                ..gemv_buffers(&sb, q8, dst)
                            },
                        )
                        .unwrap(),
                    )
                };
                run(&whole, 0);
                let part = g.buf(&before);
                run(&part, row0);
                let (want, got) = (g.read(&whole, cap * rows), g.read(&part, cap * width));
                if let GemvOutput::Store = output {
                    if rs == 1.0 {
                        unscaled = want.clone();
                    }
                    for (i, (a, b)) in want.iter().zip(&unscaled).enumerate().take(n * rows) {
                        assert_eq!(
                            a.to_bits(),
                            (rs * b).to_bits(),
                            "{} × {rs}, {n} of {cap} lanes: value {i}",
                            format.name()
                        );
                    }
                }
                for (i, v) in got.iter().enumerate() {
                    let (l, r) = (i / width, i % width);
                    let expect = if l < n && (row0..row0 + rows).contains(&r) {
                        want[l * rows + r - row0]
                    } else {
                        before[i]
                    };
                    assert_eq!(
                        v.to_bits(),
                        expect.to_bits(),
                        "{} {output:?} × {rs}, {n} of {cap} lanes: lane {l} value {r}",
                        format.name()
                    );
                }
            }
        }
    }
}

/// `q8_rows` (a latent MoE's experts read fc1's f32 output through it): each row's q8
/// blocks are the host's rule over its K values, zero blocks past K up to the row's
/// multiple of 32, rows `ds` apart, for one short row and rows wider than a workgroup's
/// chunk (the grid-stride loop).
#[test]
fn q8_rows_make_the_host_blocks_of_each_row() {
    use mamba2_wgpu::gpu::kernels::q8_rows::q8_rows;
    let Some(g) = Gpu::new() else { return };
    for (tokens, k, ss, ds) in [(1, 20, 32, 32), (3, 70, 80, 128), (2, 1000, 1000, 1024)] {
        let src = rand(31, tokens * ss, -4.0, 4.0);
        let sb = g.buf(&src);
        let (qb, db) = (g.zeros(tokens * ds / 4), g.zeros(tokens * ds / 32));
        g.run(&q8_rows(&g.k, "q8", k, tokens, &sb, ss, (&qb, &db), ds).unwrap());
        let q: Vec<u32> = g
            .read(&qb, tokens * ds / 4)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let d = g.read(&db, tokens * ds / 32);
        let kp = k.next_multiple_of(32);
        for t in 0..tokens {
            let row = &src[t * ss..t * ss + k];
            let what = format!("{tokens} rows of {k} values, row {t}");
            assert_q8_of(
                &what,
                &q[t * ds / 4..t * ds / 4 + kp / 4],
                &d[t * ds / 32..t * ds / 32 + kp / 32],
                row,
            );
        }
    }
}

#[test]
fn rmsnorm_writes_f32_and_q8_inputs() {
    let Some(g) = Gpu::new() else { return };
    for d in [300, 48, 4096] {
        let x = rand(30, d, -3.0, 3.0);
        let params = [vec![0.0; 7], rand(31, d, 0.5, 1.5)].concat();
        for wg in norm_wgs(&g) {
            let (got, q, s) = one_lane_norm(&g, &x, &g.buf(&params), wg);
            assert_nmse("rmsnorm", &got, &ref_rmsnorm(&x, &params[7..], 1e-5), 1e-7);
            assert_q8_of(&format!("rmsnorm d = {d}, wg {wg}"), &q, &s, &got);
        }
    }
}

/// The norms' workgroup sizes to test: the default and the largest the device allows (up to
/// 1024; `MAMBA2_NORM_WG` picks among such for the Mamba2 and attention pre-norms).
fn norm_wgs(g: &Gpu) -> Vec<usize> {
    let mut v = vec![rmsnorm::CHUNK, (g.k.max_workgroup() as usize).min(1024)];
    v.dedup();
    v
}

/// The one-lane norm of `x` (weights at 7 in `params`, eps 1e-5, workgroups of `wg`): its
/// output, q8 values and q8 scales (padded to whole blocks).
fn one_lane_norm(
    g: &Gpu,
    x: &[f32],
    params: &wgpu::Buffer,
    wg: usize,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let (d, kp) = (x.len(), x.len().next_multiple_of(32));
    let (src, dst) = (g.buf(x), g.zeros(kp));
    let (xq, xd) = (g.zeros(kp / 4), g.zeros(kp / 32));
    let b = NormBuffers {
        src: &src,
        params,
        dst: &dst,
        q8: Some((&xq, &xd)),
    };
    g.run(&rmsnorm::rmsnorm(&g.k, "t", d, 1e-5, 7, 1, wg, b).unwrap());
    let q = bytemuck::cast_slice(&g.ctx().read(&xq, kp as u64).unwrap()).to_vec();
    (g.read(&dst, d), q, g.read(&xd, kp / 32))
}

/// The batched decode norm past 2¹⁶ values (20 lanes of 4096, spread over many workgroups
/// per lane): every lane's output and q8 blocks equal the one-lane norm's, bit for bit, with workgroups
/// of every size `norm_wgs` gives.
#[test]
fn rmsnorm_lanes_equal_each_lane_alone() {
    let Some(g) = Gpu::new() else { return };
    let (d, n, w) = (4096, 20, 4096);
    let x = rand(32, n * d, -3.0, 3.0);
    let params = [vec![0.0; 7], rand(33, d, 0.5, 1.5)].concat();
    let (src, pbuf) = (g.buf(&x), g.buf(&params));
    for wg in norm_wgs(&g) {
        let dst = g.buf(&vec![f32::NAN; n * w]);
        let (xq, xd) = (g.zeros(n * w / 4), g.zeros(n * w / 32));
        let b = NormBuffers {
            src: &src,
            params: &pbuf,
            dst: &dst,
            q8: Some((&xq, &xd)),
        };
        let lanes = Lanes { n, cap: n };
        g.run(&rmsnorm::rmsnorm_lanes(&g.k, "t", d, 1e-5, 7, lanes, wg, b).unwrap());
        let got = g.read(&dst, n * w);
        let q: Vec<u32> =
            bytemuck::cast_slice(&g.ctx().read(&xq, (n * w) as u64).unwrap()).to_vec();
        let s = g.read(&xd, n * w / 32);
        for l in 0..n {
            let lane = &x[l * d..(l + 1) * d];
            let (want, q1, s1) = one_lane_norm(&g, lane, &pbuf, wg);
            assert_nmse(
                &format!("lane {l}, workgroups of {wg}"),
                &want,
                &ref_rmsnorm(lane, &params[7..], 1e-5),
                1e-7,
            );
            assert_eq!(
                common::bits(&got[l * w..l * w + d]),
                common::bits(&want),
                "lane {l}'s norm"
            );
            assert_eq!(
                &q[l * w / 4..l * w / 4 + d / 4],
                &q1[..],
                "lane {l}'s q8 values"
            );
            assert_eq!(
                common::bits(&s[l * w / 32..l * w / 32 + d / 32]),
                common::bits(&s1),
                "lane {l}'s q8 scales"
            );
        }
    }
}

/// The decode graph's unfolded way: the norm kernel (weights at `nw_off` of `params`) into
/// `h` and its q8 blocks (zero past d, as the scratch buffers are), then the plain GEMV
/// (reading the q8 blocks for the quantized formats). Returns (h, xq, xd, y).
fn norm_then_gemv(
    g: &Gpu,
    m: &DeviceMatrix,
    (d, nw_off, wg): (usize, usize, usize),
    src: &wgpu::Buffer,
    params: &wgpu::Buffer,
) -> (wgpu::Buffer, wgpu::Buffer, wgpu::Buffer, wgpu::Buffer) {
    let kp = m.kp.max(d.next_multiple_of(32));
    let nb = kp / 32;
    let (h, q, s, y) = (g.zeros(kp), g.zeros(nb * 8), g.zeros(nb), g.zeros(m.rows));
    let norm = NormBuffers {
        src,
        params,
        dst: &h,
        q8: Some((&q, &s)),
    };
    g.run(&rmsnorm::rmsnorm(&g.k, "t", d, 1e-5, nw_off, 1, wg, norm).unwrap());
    let q8 = m.format.reads_q8().then_some((&q, &s));
    let plain = gemv(
        &g.k,
        "t",
        m,
        GemvInput::Plain,
        GemvOutput::Store,
        gemv_buffers(&h, q8, &y),
    );
    g.run(&plain.unwrap());
    (h, q, s, y)
}

/// The MoE router's GEMV with the block's pre-norm in its prologue: its rows equal the norm
/// kernel followed by the plain GEMV bit for bit (the same sum order, the same team per
/// row), its normed vector and q8 blocks equal the norm kernel's, and the rows match the
/// CPU reference; widths that are not multiples of 32, and rows spread over many
/// workgroups (2688: Nemotron 3 Nano's 11 norm chunks over the router's 64 workgroups).
#[test]
fn gemv_with_the_pre_norm_folded_in() {
    let Some(g) = Gpu::new() else { return };
    for (d, rows) in [(300usize, 37usize), (2688, 128), (48, 5)] {
        let kp = d.next_multiple_of(32);
        let nb = d.div_ceil(32);
        let x = rand(50, d, -3.0, 3.0);
        let params = [vec![0.0; 7], rand(51, d, 0.5, 1.5)].concat();
        let w = rand(52, rows * d, -0.5, 0.5);
        let (m, deq) = matrix(&g, WeightFormat::F32, &w, rows, d);
        let (src, pbuf) = (g.buf(&x), g.buf(&params));
        let wg = rmsnorm::CHUNK;
        let (h0, q0, d0, y0) = norm_then_gemv(&g, &m, (d, 7, wg), &src, &pbuf);
        // The folded GEMV.
        let (h1, q1, d1, y1) = (g.zeros(kp), g.zeros(nb * 8), g.zeros(nb), g.zeros(rows));
        let b = GemvBuffers {
            params: Some(&pbuf),
            norm_out: Some(NormOut {
                h: &h1,
                q8: Some((&q1, &d1)),
            }),
            ..gemv_buffers(&src, None, &y1)
        };
        let input = GemvInput::Norm {
            d,
            eps: 1e-5,
            nw_off: 7,
            wg,
        };
        g.run(&gemv(&g.k, "t", &m, input, GemvOutput::Store, b).unwrap());
        let bits = |b: &wgpu::Buffer, n: usize| -> Vec<u32> {
            bytemuck::cast_slice(&g.ctx().read(b, 4 * n as u64).unwrap()).to_vec()
        };
        let what = format!("pre-norm gemv d {d}, {rows} rows");
        assert_eq!(bits(&y1, rows), bits(&y0, rows), "{what}: rows");
        assert_eq!(bits(&h1, kp), bits(&h0, kp), "{what}: normed vector");
        assert_eq!(bits(&q1, nb * 8), bits(&q0, nb * 8), "{what}: q8 quants");
        assert_eq!(bits(&d1, nb), bits(&d0, nb), "{what}: q8 scales");
        let mut want = vec![0f32; rows];
        let xn = ref_rmsnorm(&x, &params[7..], 1e-5);
        matvec(&deq, &xn, &mut want);
        assert_nmse(&what, &g.read(&y1, rows), &want, 1e-7);
    }
}

/// A quantized GEMV (Mamba2's one-token in_proj) with the block's pre-norm in its
/// prologue, its q8 blocks made in each workgroup's memory: rows bit for bit those of the
/// norm kernel followed by the plain GEMV, in every format that reads q8 blocks; widths
/// that are not multiples of 32 (the padding past d is zero) or of a k-quant's 256, and a
/// 130m-wide row over many workgroups; every norm workgroup size `norm_wgs` gives.
#[test]
fn quantized_gemv_with_the_pre_norm_folded_in() {
    let Some(g) = Gpu::new() else { return };
    for (d, rows) in [(768usize, 200usize), (300, 37), (2688, 21)] {
        let x = rand(60, d, -3.0, 3.0);
        let params = [vec![0.0; 5], rand(61, d, 0.5, 1.5)].concat();
        let w = rand(62, rows * d, -0.5, 0.5);
        let (src, pbuf) = (g.buf(&x), g.buf(&params));
        for format in [
            WeightFormat::Q8_0,
            WeightFormat::Q4_0,
            WeightFormat::Q4_1,
            WeightFormat::Q5_0,
            WeightFormat::Q5_1,
            WeightFormat::Q4_K,
            WeightFormat::Q6_K,
        ] {
            let (m, _) = matrix(&g, format, &w, rows, d);
            for wg in norm_wgs(&g) {
                let (_, _, _, y0) = norm_then_gemv(&g, &m, (d, 5, wg), &src, &pbuf);
                // The folded GEMV reads the residual itself.
                let y1 = g.zeros(rows);
                let b = GemvBuffers {
                    params: Some(&pbuf),
                    ..gemv_buffers(&src, None, &y1)
                };
                let input = GemvInput::Norm {
                    d,
                    eps: 1e-5,
                    nw_off: 5,
                    wg,
                };
                g.run(&gemv(&g.k, "t", &m, input, GemvOutput::Store, b).unwrap());
                let bits = |b: &wgpu::Buffer| -> Vec<u32> {
                    bytemuck::cast_slice(&g.ctx().read(b, 4 * rows as u64).unwrap()).to_vec()
                };
                assert_eq!(
                    bits(&y1),
                    bits(&y0),
                    "{} pre-norm gemv d {d}, {rows} rows, workgroups of {wg}",
                    format.name()
                );
                assert!(
                    g.read(&y0, rows).iter().any(|v| *v != 0.0),
                    "{}: the rows are not all zero",
                    format.name()
                );
            }
        }
    }
}

/// The prefill block's norm (four values per load where D is a multiple of 4, scalar
/// otherwise): every token's row, written at its KP stride.
#[test]
fn rmsnorm_over_a_block() {
    let Some(g) = Gpu::new() else { return };
    for (d, tokens) in [(96usize, 5usize), (300, 3), (70, 4)] {
        let kp = d.next_multiple_of(32);
        let x = rand(40 + d as u64, tokens * d, -3.0, 3.0);
        let params = [vec![0.0; 7], rand(41, d, 0.5, 1.5)].concat();
        let (src, pbuf) = (g.buf(&x), g.buf(&params));
        let dst = g.buf(&vec![f32::NAN; tokens * kp]);
        let b = NormBuffers {
            src: &src,
            params: &pbuf,
            dst: &dst,
            q8: None,
        };
        g.run(&rmsnorm::rmsnorm_block(&g.k, "t", d, 1e-5, 7, tokens, b).unwrap());
        let got = g.read(&dst, tokens * kp);
        for t in 0..tokens {
            let want = ref_rmsnorm(&x[t * d..][..d], &params[7..], 1e-5);
            assert_nmse(
                &format!("rmsnorm d {d}, token {t}"),
                &got[t * kp..][..d],
                &want,
                1e-7,
            );
        }
    }
}

#[test]
fn gemv_with_the_group_norm_folded_in() {
    let Some(g) = Gpu::new() else { return };
    // (d_inner, G): 3 groups of 2 blocks; mamba2-130m's one group of 48 blocks (more than
    // the lanes summing them); 8 groups of 4 blocks. The SSD step's input: u = v ⊙ w and
    // Σv² per 32-channel block.
    for (di, groups) in [(192, 3), (1536, 1), (1024, 8)] {
        group_norm_gemv(&g, di, groups);
    }
}

fn group_norm_gemv(g: &Gpu, di: usize, groups: usize) {
    let (rows, cb) = (21, 32);
    let v = rand(7, di, -2.0, 2.0);
    let wn = rand(8, di, 0.5, 1.5);
    let u: Vec<f32> = v.iter().zip(&wn).map(|(a, b)| a * b).collect();
    let part: Vec<f32> = v
        .chunks(cb)
        .map(|c| c.iter().map(|a| a * a).sum())
        .collect();
    let size = di / groups;
    let mut x = v.clone();
    for (gi, chunk) in x.chunks_mut(size).enumerate() {
        let rstd = 1.0 / (chunk.iter().map(|a| a * a).sum::<f32>() / size as f32 + 1e-5).sqrt();
        for (k, a) in chunk.iter_mut().enumerate() {
            *a *= rstd * wn[gi * size + k];
        }
    }
    let w = rand(9, rows * di, -0.5, 0.5);
    let input = GemvInput::Group {
        groups,
        group_size: size,
        blocks_per_group: size / cb,
        eps: 1e-5,
    };
    let (src, partb, dst) = (g.buf(&u), g.buf(&part), g.zeros(rows));
    let (q, d) = q8_blocks(&u);
    let (qb, db) = (
        g.ctx()
            .storage_with("xq", bytemuck::cast_slice(&q))
            .unwrap(),
        g.buf(&d),
    );
    // Every format (the k-quants as the engine packs this width: q8_0 unless it tiles 256).
    for format in WeightFormat::ALL.map(|f| f.for_cols(di)) {
        let (m, deq) = matrix(g, format, &w, rows, di);
        let b = GemvBuffers {
            part: Some(&partb),
            ..gemv_buffers(&src, Some((&qb, &db)), &dst)
        };
        g.run(&gemv(&g.k, "t", &m, input, GemvOutput::Store, b).unwrap());
        let mut want = vec![0f32; rows];
        matvec(&deq, &x, &mut want);
        let tol = if format.reads_q8() { 1e-4 } else { 1e-7 };
        assert_nmse(
            &format!(
                "group-norm gemv {} (d_inner {di}, G {groups})",
                format.name()
            ),
            &g.read(&dst, rows),
            &want,
            tol,
        );
    }
}

/// Sizes of a mixer with G = 2, head dim 6, N = 12 and conv kernel 4.
fn mixer_consts() -> (MixerConsts, usize) {
    let (di, n, groups, heads, k) = (24, 12, 2, 4, 4);
    let cd = di + 2 * groups * n;
    let mc = MixerConsts {
        d_inner: di,
        conv_dim: cd,
        heads,
        kernel: k,
        cw_off: 0,
        cb_off: cd * k,
        dtb_off: cd * k + cd,
        dt_limit: (0.0, f64::INFINITY),
    };
    (mc, cd * k + cd + heads)
}

fn mixer_reference(
    mc: &MixerConsts,
    row: &[f32],
    params: &[f32],
    conv_state: &mut [f32],
) -> Vec<f32> {
    let (di, cd, k) = (mc.d_inner, mc.conv_dim, mc.kernel);
    let mut out = row.to_vec();
    for c in 0..cd {
        let st = &mut conv_state[c * (k - 1)..(c + 1) * (k - 1)];
        let mut acc = params[mc.cb_off + c] + params[mc.cw_off + c * k + k - 1] * row[di + c];
        for j in 0..k - 1 {
            acc += params[mc.cw_off + c * k + j] * st[j];
        }
        st.rotate_left(1);
        st[k - 2] = row[di + c];
        out[di + c] = silu(acc);
    }
    for h in 0..mc.heads {
        out[di + cd + h] = softplus(row[di + cd + h] + params[mc.dtb_off + h]);
    }
    out
}

#[test]
fn conv_step_and_fused_mixer_epilogue() {
    let Some(g) = Gpu::new() else { return };
    let (mc, plen) = mixer_consts();
    let rows = mc.d_inner + mc.conv_dim + mc.heads;
    let params = rand(10, plen, -0.8, 0.8);
    let conv0 = rand(11, mc.conv_dim * (mc.kernel - 1), -1.0, 1.0);
    let ctrl = g.ctrl(&Ctrl::default());
    // Unfused: the conv_step kernel on a raw row vector.
    let row = rand(12, rows, -2.0, 2.0);
    let (mix, pbuf, cs) = (g.buf(&row), g.buf(&params), g.buf(&conv0));
    // `out` and `state` against the reference mixer on the raw row `raw`.
    let check = |what: &str, raw: &[f32], out: &wgpu::Buffer, state: &wgpu::Buffer| {
        let mut conv_want = conv0.clone();
        let want = mixer_reference(&mc, raw, &params, &mut conv_want);
        assert_nmse(&format!("{what} output"), &g.read(out, rows), &want, 1e-7);
        let state = g.read(state, conv0.len());
        assert_nmse(&format!("{what} conv state"), &state, &conv_want, 1e-7);
    };
    g.run(&conv_step::conv_step(&g.k, "t", mc, &mix, &pbuf, &cs, &ctrl).unwrap());
    check("conv_step", &row, &mix, &cs);
    // Fused: the in_proj GEMV's epilogue does the same on its own output.
    let k = 10;
    let w = rand(13, rows * k, -1.0, 1.0);
    let x = rand(14, k, -1.0, 1.0);
    let (m, deq) = matrix(&g, WeightFormat::F32, &w, rows, k);
    let (src, dst, cs2) = (g.buf(&padded(&x)), g.zeros(rows), g.buf(&conv0));
    let b = GemvBuffers {
        params: Some(&pbuf),
        conv_state: Some(&cs2),
        ctrl: Some(&ctrl),
        ..gemv_buffers(&src, None, &dst)
    };
    g.run(&gemv(&g.k, "t", &m, GemvInput::Plain, GemvOutput::Mixer(mc), b).unwrap());
    let mut raw = vec![0f32; rows];
    matvec(&deq, &x, &mut raw);
    check("fused mixer", &raw, &dst, &cs2);
    // A stopped sequence leaves its conv state alone.
    let stopped = g.ctrl(&Ctrl {
        stopped: 1,
        ..Default::default()
    });
    let cs3 = g.buf(&conv0);
    g.run(&conv_step::conv_step(&g.k, "t", mc, &g.buf(&row), &pbuf, &cs3, &stopped).unwrap());
    assert_eq!(g.read(&cs3, conv0.len()), conv0);
}

#[test]
fn ssd_step_plain_and_gated() {
    let Some(g) = Gpu::new() else { return };
    // (heads, head dim, groups, state): a head dim that is not a power of two, blocks that
    // span heads, N not a multiple of the team, N not a multiple of 4 (scalar state loads),
    // and a 32-channel-block case with q8 output.
    for (heads, p, groups, n) in [
        (4, 6, 2, 12),
        (3, 8, 1, 13),
        (6, 64, 3, 16),
        (2, 5, 1, 40),
        (4, 24, 2, 128),
    ] {
        let di = heads * p;
        let cd = di + 2 * groups * n;
        let c = SsdConsts {
            heads,
            head_dim: p,
            groups,
            d_state: n,
            d_inner: di,
            conv_dim: cd,
            a_off: 0,
            d_off: heads,
            nw_off: 2 * heads,
        };
        let a = rand(20, heads, -4.0, -0.5);
        let dskip = rand(21, heads, 0.5, 1.5);
        let wn = rand(26, di, 0.5, 1.5);
        let params = [a.clone(), dskip.clone(), wn.clone()].concat();
        let mix = [
            rand(22, di, -2.0, 2.0),
            rand(23, cd, -1.0, 1.0),
            rand(24, heads, 0.01, 0.5),
        ]
        .concat();
        let state0 = rand(25, heads * p * n, -1.0, 1.0);
        let ctrl = g.ctrl(&Ctrl::default());
        let dims = ScanDims {
            heads,
            head_dim: p,
            groups,
            d_state: n,
        };
        let (x, bc) = (&mix[di..2 * di], &mix[2 * di..di + cd]);
        let inputs = ScanInputs {
            dims,
            x,
            dt: &mix[di + cd..],
            a: &a,
            b: &bc[..groups * n],
            c: &bc[groups * n..],
            d: &dskip,
        };
        let mut state_want = state0.clone();
        let y_want = scan_sequential(&inputs, &mut state_want);
        let v: Vec<f32> = y_want
            .iter()
            .zip(&mix[..di])
            .map(|(y, z)| y * silu(*z))
            .collect();
        for gated in [false, true] {
            let (mixb, pbuf, st, y) = (g.buf(&mix), g.buf(&params), g.buf(&state0), g.zeros(di));
            let part = g.zeros(c.blocks());
            let (xq, xd) = (g.zeros(di / 4 + 1), g.zeros(di / 32 + 1));
            let q8 = (gated && c.block() == 32).then_some((&xq, &xd));
            let b = SsdBuffers {
                mix: &mixb,
                params: &pbuf,
                state: &st,
                y: &y,
                part: gated.then_some(&part),
                q8,
                ctrl: &ctrl,
                lanes: Lanes::ONE,
            };
            g.run(&ssd_step(&g.k, "t", c, b).unwrap());
            assert_nmse("ssd state", &g.read(&st, state0.len()), &state_want, 1e-7);
            let got = g.read(&y, di);
            if !gated {
                assert_nmse(&format!("ssd y H={heads} P={p} N={n}"), &got, &y_want, 1e-7);
                continue;
            }
            let u: Vec<f32> = v.iter().zip(&wn).map(|(a, b)| a * b).collect();
            assert_nmse(&format!("ssd gated u H={heads} P={p}"), &got, &u, 1e-7);
            let parts = g.read(&part, c.blocks());
            for (i, (got, chunk)) in parts.iter().zip(v.chunks(c.block())).enumerate() {
                let want: f32 = chunk.iter().map(|a| a * a).sum();
                assert!(
                    (got - want).abs() <= 1e-5 * want.max(1.0),
                    "Σv² block {i}: {got} vs {want}"
                );
            }
            if q8.is_some() {
                let q: Vec<u32> =
                    bytemuck::cast_slice(&g.ctx().read(&xq, di as u64).unwrap()).to_vec();
                let s = g.read(&xd, di / 32);
                for (i, (a, b)) in dequant(&q, &s, di).iter().zip(&u).enumerate() {
                    assert!(
                        (a - b).abs() <= 0.51 * s[i / 32] + 1e-6,
                        "ssd q8 output {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// The gated norm over `(d_inner, groups, norm weight offset)` for `(tokens, mix stride)`,
/// eps 1e-5.
fn run_gated_norm(
    g: &Gpu,
    (di, groups, off): (usize, usize, usize),
    (tokens, mix_stride): (usize, usize),
    b: GatedNormBuffers,
) {
    let batch = Batch { tokens, mix_stride };
    g.run(&gated_norm::gated_norm(&g.k, "t", di, groups, 1e-5, off, batch, b).unwrap());
}

#[test]
fn gated_norm_residual_and_embedding() {
    let Some(g) = Gpu::new() else { return };
    // gated group norm, G = 3 groups of 30 (not a multiple of 32), with q8 output
    let (di, groups) = (90, 3);
    let y = rand(32, di, -2.0, 2.0);
    let z = rand(33, di, -2.0, 2.0);
    let w = rand(34, di, 0.5, 1.5);
    let (yb, zb, wb, out) = (g.buf(&y), g.buf(&z), g.buf(&w), g.zeros(di));
    let (xq, xd) = (g.zeros(24), g.zeros(3));
    let b = GatedNormBuffers {
        y: &yb,
        mix: &zb,
        params: &wb,
        dst: &out,
        q8: Some((&xq, &xd)),
    };
    run_gated_norm(&g, (di, groups, 0), (1, di), b);
    let got = g.read(&out, di);
    assert_nmse(
        "gated group norm",
        &got,
        &gated_group_rmsnorm(&y, &z, &w, groups, 1e-5),
        1e-7,
    );
    let q: Vec<u32> = bytemuck::cast_slice(&g.ctx().read(&xq, 96).unwrap()).to_vec();
    let s = g.read(&xd, 3);
    assert_q8_of("gated norm", &q, &s, &got);
    // The same over a block of tokens without q8 output (the vec4 path: 16-byte loads),
    // z in wider mix rows, the norm weight at an offset: a few tokens (many workgroups per
    // token), and enough that each token gets one workgroup holding its channels in
    // registers (two vec4 rounds per invocation, the last one partial).
    // (d_inner, groups, tokens, mix stride, norm weight offset; d_inner a multiple of 32,
    // so the output rows are d_inner apart)
    let cases = [(96, 3, 5, 100, 4), (2016, 4, 40, 2020, 8)];
    for (case, (di, groups, tokens, stride, off)) in cases.into_iter().enumerate() {
        let y = rand(35 + case as u64, tokens * di, -2.0, 2.0);
        let mix = rand(36 + case as u64, tokens * stride, -2.0, 2.0);
        let w = rand(37 + case as u64, off + di, 0.5, 1.5);
        let (yb, mb, wb) = (g.buf(&y), g.buf(&mix), g.buf(&w));
        let out = g.buf(&vec![f32::NAN; tokens * di]);
        let b = GatedNormBuffers {
            y: &yb,
            mix: &mb,
            params: &wb,
            dst: &out,
            q8: None,
        };
        run_gated_norm(&g, (di, groups, off), (tokens, stride), b);
        let got = g.read(&out, tokens * di);
        for t in 0..tokens {
            let want = gated_group_rmsnorm(
                &y[t * di..][..di],
                &mix[t * stride..][..di],
                &w[off..],
                groups,
                1e-5,
            );
            assert_nmse(
                &format!("gated group norm, d_inner {di}, token {t} of {tokens}"),
                &got[t * di..][..di],
                &want,
                1e-7,
            );
        }
    }
    // residual add
    let d = 300;
    let x = rand(30, d, -3.0, 3.0);
    let a = rand(35, d, -1.0, 1.0);
    let (ab, rb) = (g.buf(&a), g.buf(&x));
    g.run(&residual_add::residual_add(&g.k, "t", d, &ab, &rb).unwrap());
    let want: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
    assert_eq!(g.read(&rb, d), want);
    // embedding gather, every format, a row of 70 (not a multiple of anything)
    let (v, dm) = (13, 70);
    let table = rand(36, v * dm, -1.0, 1.0);
    for format in WeightFormat::ALL {
        let (m, deq) = matrix(&g, format, &table, v, dm);
        let (ctrl, resid) = (
            g.ctrl(&Ctrl {
                token: 11,
                ..Default::default()
            }),
            g.zeros(dm),
        );
        g.run(&embed::embed(&g.k, &m, 1.0, Lanes::ONE, &ctrl, &resid).unwrap());
        assert_eq!(
            g.read(&resid, dm),
            deq[11 * dm..12 * dm].to_vec(),
            "embed {}",
            format.name()
        );
    }
}

/// The one-lane greedy argmax of `input` into `ctrl`.
fn run_argmax(g: &Gpu, vocab: usize, input: ArgmaxInput, ctrl: &wgpu::Buffer) {
    g.run(&argmax::argmax(&g.k, vocab, Lanes::ONE, false, input, ctrl).unwrap());
}

#[test]
fn argmax_and_sampling_follow_the_host_rule() {
    let Some(g) = Gpu::new() else { return };
    let vocab = 1000;
    let mut logits = rand(40, vocab, -5.0, 5.0);
    logits[123] = 9.0;
    logits[777] = 9.0; // a tie: the lowest id wins
    let lb = g.buf(&logits);
    let ctrl = g.ctrl(&Ctrl {
        pos: 5,
        n_stop: 1,
        stop_ids: [123, 0, 0, 0],
        ..Default::default()
    });
    run_argmax(&g, vocab, ArgmaxInput::Logits(&lb), &ctrl);
    let c = g.read_ctrl(&ctrl);
    assert_eq!((c.token, c.pos, c.stopped), (ref_argmax(&logits), 6, 1));
    assert_eq!(c.token, 123);
    // Vocabularies of one to many load rounds (a partial last one): the best logit at the
    // end, then tied with one in another round, then unique somewhere in between.
    for vocab in [4_099, 50_280, 131_079] {
        let mut logits = rand(vocab as u64, vocab, -5.0, 5.0);
        let check = |logits: &[f32], want: usize| {
            let lb = g.buf(logits);
            let ctrl = g.ctrl(&Ctrl::default());
            run_argmax(&g, vocab, ArgmaxInput::Logits(&lb), &ctrl);
            let got = g.read_ctrl(&ctrl).token;
            assert_eq!(got as usize, ref_argmax(logits) as usize, "vocab {vocab}");
            assert_eq!(got as usize, want, "vocab {vocab}");
        };
        logits[vocab - 1] = 7.0;
        check(&logits, vocab - 1);
        logits[vocab / 3] = 7.0;
        check(&logits, vocab / 3);
        logits[vocab / 3] = 0.0;
        logits[vocab - 1] = 0.0;
        logits[vocab / 2 + 5] = 6.5;
        check(&logits, vocab / 2 + 5);
    }
    // Sampling: the same ids as the host rule for most draws (sums may round differently
    // at a boundary), top-k = 1 always greedy.
    let probs = g.zeros(vocab);
    let logits = rand(41, vocab, -3.0, 3.0);
    let lb = g.buf(&logits);
    let mut agree = 0;
    let cases = 120;
    for i in 0..cases {
        let s = Sampling {
            temperature: [0.7, 1.0, 1.5][i % 3],
            top_k: [0, 40, 1, 300][i % 4],
            top_p: [1.0, 0.9, 0.5][i % 3],
            seed: i as u64 * 31,
        };
        let pos = 17 + i as u32;
        let ctrl = g.ctrl(&Ctrl {
            pos,
            seed_key: seed_key(s.seed),
            temperature: s.temperature,
            top_k: s.top_k as u32,
            top_p: s.top_p,
            ..Default::default()
        });
        g.run(&sample::sample(&g.k, vocab, Lanes::ONE, false, &lb, &ctrl, &probs).unwrap());
        let got = g.read_ctrl(&ctrl).token;
        let want = ref_sample(&logits, &s, pos as u64);
        if s.top_k == 1 {
            assert_eq!(got, ref_argmax(&logits));
        }
        agree += (got == want) as usize;
    }
    assert!(
        agree * 100 >= cases * 97,
        "GPU sampling agreed with the host rule in {agree}/{cases} draws"
    );
    // Non-finite logits: both token pickers stay inside the vocabulary.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let lb = g.buf(&vec![bad; vocab]);
        let ctrl = g.ctrl(&Ctrl {
            temperature: 0.8,
            top_p: 0.9,
            ..Default::default()
        });
        g.run(&sample::sample(&g.k, vocab, Lanes::ONE, false, &lb, &ctrl, &probs).unwrap());
        let t = g.read_ctrl(&ctrl).token;
        assert!((t as usize) < vocab, "sampled id {t} from {bad} logits");
        let ctrl = g.ctrl(&Ctrl::default());
        run_argmax(&g, vocab, ArgmaxInput::Logits(&lb), &ctrl);
        let t = g.read_ctrl(&ctrl).token;
        assert!((t as usize) < vocab, "argmax id {t} from {bad} logits");
    }
}

/// The greedy lm_head's per-workgroup winners (`GemvBuffers::argmax_part`) reduced by the
/// argmax: the token the argmax over the same GEMV's logits picks, the lowest id among
/// equal logits (identical rows in one workgroup and in two), NaN rows never chosen but
/// flagged, in f32, f16 and q8_0 and vocabularies over one or many of the argmax's rounds.
#[test]
fn argmax_over_the_lm_head_partials() {
    let Some(g) = Gpu::new() else { return };
    let cols = 64;
    for (vocab, format) in [
        (4_099usize, WeightFormat::F32),
        (50_280, WeightFormat::Q8_0),
        (20_011, WeightFormat::F16),
    ] {
        let mut w = rand(vocab as u64, vocab * cols, -1.0, 1.0);
        // Rows 7 and 9 (one workgroup) and 5000 % vocab (another) equal row 3000 % vocab,
        // whose logit is made the largest below.
        let best = 3000 % vocab;
        let row = |w: &mut Vec<f32>, r: usize, from: usize| {
            let v: Vec<f32> = w[from * cols..(from + 1) * cols].to_vec();
            w[r * cols..(r + 1) * cols].copy_from_slice(&v);
        };
        let x: Vec<f32> = rand(3, cols, -1.0, 1.0);
        for (c, xv) in x.iter().enumerate() {
            w[best * cols + c] = 2.0 * xv.signum();
        }
        for r in [7, 9, 5000 % vocab] {
            row(&mut w, r, best);
        }
        let nan = format == WeightFormat::F32;
        if nan {
            w[11 * cols] = f32::NAN;
        }
        let (m, _) = matrix(&g, format, &w, vocab, cols);
        let (src, logits) = (g.buf(&padded(&x)), g.zeros(vocab));
        let q8 = format.reads_q8().then(|| {
            let (q, d) = q8_blocks(&x);
            (
                g.ctx()
                    .storage_with("xq", bytemuck::cast_slice(&q))
                    .unwrap(),
                g.buf(&d),
            )
        });
        let parts = g.zeros(4 * (vocab + 65_535));
        let head = gemv(
            &g.k,
            "t",
            &m,
            GemvInput::Plain,
            GemvOutput::Store,
            GemvBuffers {
                argmax_part: Some(&parts),
                ..gemv_buffers(&src, q8.as_ref().map(|(q, d)| (q, d)), &logits)
            },
        )
        .unwrap();
        let (gx, gy, gz) = head.workgroups;
        g.run(&head);
        let ctrl = g.ctrl(&Ctrl::default());
        let input = ArgmaxInput::Parts(&parts, gx * gy * gz);
        run_argmax(&g, vocab, input, &ctrl);
        let c = g.read_ctrl(&ctrl);
        let l = g.read(&logits, vocab);
        let what = format!("{} vocab {vocab}", format.name());
        assert_eq!(c.token, ref_argmax(&l), "{what}");
        assert_eq!(c.token, 7, "{what}: the lowest of the tied ids");
        assert_eq!(c.nonfinite != 0, nan, "{what}: the NaN row's flag");
        // The same through the logits.
        let ctrl2 = g.ctrl(&Ctrl::default());
        let all = ArgmaxInput::Logits(&logits);
        run_argmax(&g, vocab, all, &ctrl2);
        let c2 = g.read_ctrl(&ctrl2);
        assert_eq!((c.token, c.nonfinite), (c2.token, c2.nonfinite), "{what}");
    }
}

/// One `mlp_act` case: a shape named after a model (scaled where lavapipe needs it).
struct ActCase {
    name: &'static str,
    intermediate: usize,
    gated: bool,
    bias: bool,
    tokens: usize,
    /// Decode (one token, or a batch's lanes): the q8 blocks of every row too.
    q8: bool,
}

const ACT_CASES: [ActCase; 7] = [
    ActCase {
        name: "nemotron-h-8b relu² (decode, I 21504)",
        intermediate: 21504,
        gated: false,
        bias: false,
        tokens: 1,
        q8: true,
    },
    ActCase {
        name: "nemotron-nano-9b-v2 relu² (prefill, I 15680, 3 tokens)",
        intermediate: 15680,
        gated: false,
        bias: false,
        tokens: 3,
        q8: false,
    },
    ActCase {
        name: "granite-4.0-h-tiny shared MLP silu-gated (decode, I 1024)",
        intermediate: 1024,
        gated: true,
        bias: false,
        tokens: 1,
        q8: true,
    },
    ActCase {
        name: "odd relu² with biases (decode, I 40)",
        intermediate: 40,
        gated: false,
        bias: true,
        tokens: 1,
        q8: true,
    },
    ActCase {
        name: "odd silu-gated with biases (prefill, I 70, 5 tokens)",
        intermediate: 70,
        gated: true,
        bias: true,
        tokens: 5,
        q8: false,
    },
    ActCase {
        name: "odd relu² (prefill, I 33, 2 tokens)",
        intermediate: 33,
        gated: false,
        bias: false,
        tokens: 2,
        q8: false,
    },
    ActCase {
        name: "nemotron-h-8b relu² (16 batched lanes, I 21504: more than 2^16 values)",
        intermediate: 21504,
        gated: false,
        bias: true,
        tokens: 16,
        q8: true,
    },
];

#[test]
fn mlp_activation_every_form() {
    use mamba2_wgpu::config::MlpAct;
    use mamba2_wgpu::gpu::kernels::mlp_act::{ActBuffers, MlpBias, mlp_act};
    let Some(g) = Gpu::new() else { return };
    let d = 24;
    for c in ACT_CASES {
        let n = c.intermediate;
        let kp = n.next_multiple_of(32);
        let ups = if c.gated { 2 } else { 1 };
        let stride = ups * n + 3;
        let src = rand(40 + n as u64, c.tokens * stride, -2.0, 2.0);
        // params: [5 unused | up biases (ups·n) | down bias (d)]
        let params = rand(41, 5 + ups * n + d, -0.5, 0.5);
        let resid0 = rand(42, c.tokens * d, -1.0, 1.0);
        let (sbuf, pbuf, rbuf) = (g.buf(&src), g.buf(&params), g.buf(&resid0));
        let dst = g.buf(&vec![f32::NAN; c.tokens * kp]);
        let (xq, xd) = (g.zeros(c.tokens * kp / 4), g.zeros(c.tokens * kp / 32));
        let act = if c.gated {
            MlpAct::SiluGated
        } else {
            MlpAct::Relu2
        };
        let bias = c.bias.then(|| MlpBias {
            params: &pbuf,
            up_off: 5,
            down_off: 5 + ups * n,
            resid: &rbuf,
            d,
        });
        let b = ActBuffers {
            src: &sbuf,
            dst: &dst,
            q8: c.q8.then_some((&xq, &xd)),
        };
        g.run(&mlp_act(&g.k, "t", act, n, stride, c.tokens, b, bias).unwrap());
        let got = g.read(&dst, c.tokens * kp);
        let mut want = vec![0f32; c.tokens * kp];
        let mut resid = resid0.clone();
        for t in 0..c.tokens {
            let up = |k: usize| src[t * stride + k] + if c.bias { params[5 + k] } else { 0.0 };
            for k in 0..n {
                want[t * kp + k] = if c.gated {
                    silu(up(k)) * up(n + k)
                } else {
                    let r = up(k).max(0.0);
                    r * r
                };
            }
            if c.bias {
                for j in 0..d {
                    resid[t * d + j] += params[5 + ups * n + j];
                }
            }
        }
        assert_nmse(c.name, &got, &want, 1e-12);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a == b || (a - b).abs() <= 1e-5 * b.abs()),
            "{}: padding past I must be zero and values exact to f32 rounding",
            c.name
        );
        assert_nmse(
            &format!("{}: residual", c.name),
            &g.read(&rbuf, c.tokens * d),
            &resid,
            1e-14,
        );
        if c.q8 {
            let q: Vec<u32> =
                bytemuck::cast_slice(&g.ctx().read(&xq, (c.tokens * kp) as u64).unwrap()).to_vec();
            let scales = g.read(&xd, c.tokens * kp / 32);
            // The blocks of the kernel's own f32 output (ggml's rule, as the host packs it).
            for t in 0..c.tokens {
                assert_q8_of(
                    &format!("{} token {t}", c.name),
                    &q[t * kp / 4..(t + 1) * kp / 4],
                    &scales[t * kp / 32..(t + 1) * kp / 32],
                    &got[t * kp..t * kp + n],
                );
            }
        }
    }
}

/// A one-token experts' down pass that also makes the next block's pre-norm
/// (`expert_gemv::NormTail`): `rows` residual values (d_model), experts of `cols` inputs.
struct TailCase {
    name: &'static str,
    rows: usize,
    cols: usize,
    experts: usize,
    slots: usize,
    format: WeightFormat,
}

const TAIL_CASES: [TailCase; 4] = [
    TailCase {
        name: "nemotron-3-nano's d_model 2688, 6 chosen + 2 shared slices, q8_0",
        rows: 2688,
        cols: 96,
        experts: 10,
        slots: 8,
        format: WeightFormat::Q8_0,
    },
    TailCase {
        name: "d_model 200: a last block of 8 rows, q8_0",
        rows: 200,
        cols: 64,
        experts: 5,
        slots: 3,
        format: WeightFormat::Q8_0,
    },
    TailCase {
        name: "granite-4.0-h-tiny's d_model 1536, q4_k",
        rows: 1536,
        cols: 256,
        experts: 4,
        slots: 2,
        format: WeightFormat::Q4_K,
    },
    TailCase {
        name: "one expert, q6_k",
        rows: 64,
        cols: 256,
        experts: 1,
        slots: 1,
        format: WeightFormat::Q6_K,
    },
];

/// The residual the pass writes is the plain down pass's, bit for bit, and the CPU's sum to
/// f32 rounding; the q8 blocks are the host's of `x ⊙ w` (x: that residual), the per-block
/// Σx² the host's in row order, and every block's count is back at 0 for the next token
/// (checked over two tokens, then the two as a batch's lanes in one pass: `tail_over_lanes`).
#[test]
fn experts_down_pass_makes_the_next_pre_norm() {
    use mamba2_wgpu::gpu::kernels::expert_gemv::{
        Bank, ExpertBuffers, ExpertPass, NormTail, expert_gemv, takes_norm_tail,
    };
    let Some(g) = Gpu::new() else { return };
    for c in TAIL_CASES {
        let w = rand(60, c.experts * c.rows * c.cols, -1.0, 1.0);
        let (bank, wf) = matrix(&g, c.format, &w, c.experts * c.rows, c.cols);
        if !takes_norm_tail(&g.k, &bank, c.rows, c.slots, true).unwrap() {
            panic!("{}: this device's down pass cannot make the norm", c.name);
        }
        let kp = bank.kp;
        let blocks = c.rows.div_ceil(32);
        let nw_off = 7;
        let params = rand(61, nw_off + c.rows, 0.5, 1.5);
        let pbuf = g.buf(&params);
        let (xq, xd, part, counts) = (
            g.zeros(blocks * 8),
            g.zeros(blocks),
            g.zeros(blocks),
            g.zeros(blocks),
        );
        // Each token's inputs and what its one-token pass wrote, for the lanes run below.
        let mut runs = Vec::new();
        for token in 0..2u64 {
            let what = format!("{} (token {token})", c.name);
            // Each slot's activation as q8 blocks of KP values.
            let mut acts = Vec::new();
            let (mut aq, mut ad) = (Vec::new(), Vec::new());
            for s in 0..c.slots {
                let mut x = rand(62 + 10 * token + s as u64, c.cols, -2.0, 2.0);
                x.resize(kp, 0.0);
                let (q, d) = q8_blocks(&x);
                acts.push(dequant(&q, &d, kp));
                aq.extend(q);
                ad.extend(d);
            }
            let ids: Vec<u32> = (0..c.slots)
                .map(|s| ((s as u64 * 7 + token * 3) % c.experts as u64) as u32)
                .collect();
            let wts = rand(63 + token, c.slots, 0.1, 1.0);
            let resid0 = rand(64 + token, c.rows, -3.0, 3.0);
            let aqb = g
                .ctx()
                .storage_with("aq", bytemuck::cast_slice(&aq))
                .unwrap();
            let (adb, idb, wtb) = (
                g.buf(&ad),
                g.ctx()
                    .storage_with("ids", bytemuck::cast_slice(&ids))
                    .unwrap(),
                g.buf(&wts),
            );
            let (plain, tailed) = (g.buf(&resid0), g.buf(&resid0));
            for (dst, tail) in [(&plain, false), (&tailed, true)] {
                let d = expert_gemv(
                    &g.k,
                    "down",
                    &bank,
                    Bank {
                        first: 0,
                        count: c.experts,
                        rows_per_expert: c.rows,
                    },
                    ExpertPass::Down,
                    1,
                    c.slots,
                    ExpertBuffers {
                        src: &adb,
                        q8: Some((&aqb, &adb)),
                        dst,
                        dst_at: None,
                        ids: &idb,
                        weights: Some(&wtb),
                        store: false,
                        act: None,
                        route: None,
                        norm_tail: tail.then_some(NormTail {
                            params: &pbuf,
                            nw_off,
                            xq: &xq,
                            xd: &xd,
                            part: &part,
                            counts: &counts,
                        }),
                        lane_width: None,
                    },
                )
                .unwrap();
                g.run(&d);
            }
            let x = g.read(&tailed, c.rows);
            assert_eq!(
                common::bits(&x),
                common::bits(&g.read(&plain, c.rows)),
                "{what}: residual"
            );
            let want: Vec<f32> = (0..c.rows)
                .map(|r| {
                    let mut y = resid0[r];
                    for s in 0..c.slots {
                        let row = &wf[(ids[s] as usize * c.rows + r) * c.cols..][..c.cols];
                        let dot: f32 = row.iter().zip(&acts[s]).map(|(a, b)| a * b).sum();
                        y += wts[s] * dot;
                    }
                    y
                })
                .collect();
            assert_nmse(&format!("{what}: residual"), &x, &want, 1e-9);
            let v: Vec<f32> = (0..c.rows).map(|r| x[r] * params[nw_off + r]).collect();
            let got_q: Vec<u32> =
                bytemuck::cast_slice(&g.ctx().read(&xq, 32 * blocks as u64).unwrap())[..8 * blocks]
                    .to_vec();
            assert_q8_of(&what, &got_q, &g.read(&xd, blocks), &v);
            let got_part = g.read(&part, blocks);
            for (b, got) in got_part.iter().enumerate() {
                let want: f32 = x[32 * b..(32 * b + 32).min(c.rows)]
                    .iter()
                    .fold(0.0, |s, v| s + v * v);
                assert!(
                    (got - want).abs() <= 1e-6 * want,
                    "{what}: Σx² of block {b}: {got} against {want}"
                );
            }
            let left: Vec<u32> =
                bytemuck::cast_slice(&g.ctx().read(&counts, 4 * blocks as u64).unwrap())[..blocks]
                    .to_vec();
            assert!(left.iter().all(|&n| n == 0), "{what}: counts left {left:?}");
            let got_d = g.read(&xd, blocks);
            runs.push((aq, ad, ids, wts, resid0, x, got_q, got_d, got_part));
        }
        tail_over_lanes(&g, &c, &bank, &pbuf, nw_off, &runs);
    }
}

/// One token's inputs (q8 activations, ids, weights, residual) and its one-token pass's
/// outputs (residual, tail q8 blocks and scales, Σx² per block).
type TailRun = (
    Vec<u32>,
    Vec<f32>,
    Vec<u32>,
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    Vec<u32>,
    Vec<f32>,
    Vec<f32>,
);

/// The tokens of `runs` as a batch's lanes in one down pass (lanes a lane width of whole
/// superblocks apart, as `Scratch` lays them out): each lane's residual, tail q8 blocks and
/// sums are bitwise its one-token pass's, and the counters are back at 0.
fn tail_over_lanes(
    g: &Gpu,
    c: &TailCase,
    bank: &mamba2_wgpu::gpu::weights::DeviceMatrix,
    params: &wgpu::Buffer,
    nw_off: usize,
    runs: &[TailRun],
) {
    use mamba2_wgpu::gpu::kernels::expert_gemv::{
        Bank, ExpertBuffers, ExpertPass, NormTail, expert_gemv,
    };
    let lanes = runs.len();
    let blocks = c.rows.div_ceil(32);
    let lw = c.rows.next_multiple_of(256);
    let cat_u = |f: fn(&TailRun) -> &Vec<u32>| -> Vec<u32> {
        runs.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    let cat_f = |f: fn(&TailRun) -> &Vec<f32>| -> Vec<f32> {
        runs.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    let aq = g.words(&cat_u(|r| &r.0));
    let ad = g.buf(&cat_f(|r| &r.1));
    let ids = g.words(&cat_u(|r| &r.2));
    let wts = g.buf(&cat_f(|r| &r.3));
    let resid = g.buf(&cat_f(|r| &r.4));
    let (xq, xd, part, counts) = (
        g.zeros(lanes * lw / 4),
        g.zeros(lanes * lw / 32),
        g.zeros(lanes * blocks),
        g.zeros(lanes * blocks),
    );
    let d = expert_gemv(
        &g.k,
        "down over lanes",
        bank,
        Bank {
            first: 0,
            count: c.experts,
            rows_per_expert: c.rows,
        },
        ExpertPass::Down,
        lanes,
        c.slots,
        ExpertBuffers {
            src: &ad,
            q8: Some((&aq, &ad)),
            dst: &resid,
            dst_at: None,
            ids: &ids,
            weights: Some(&wts),
            store: false,
            act: None,
            route: None,
            norm_tail: Some(NormTail {
                params,
                nw_off,
                xq: &xq,
                xd: &xd,
                part: &part,
                counts: &counts,
            }),
            lane_width: Some(lw),
        },
    )
    .unwrap();
    g.run(&d);
    let x = g.read(&resid, lanes * c.rows);
    let q: Vec<u32> =
        bytemuck::cast_slice(&g.ctx().read(&xq, (lanes * lw) as u64).unwrap()).to_vec();
    let dq = g.read(&xd, lanes * lw / 32);
    let sums = g.read(&part, lanes * blocks);
    for (l, r) in runs.iter().enumerate() {
        let what = format!("{} (lane {l} of {lanes})", c.name);
        let lane = |v: &[f32], n: usize, at: usize| common::bits(&v[l * at..][..n]);
        // (Compared whole, reported by name: the vectors run to thousands of values.)
        assert!(
            lane(&x, c.rows, c.rows) == common::bits(&r.5),
            "{what}: residual"
        );
        assert!(
            q[l * lw / 4..][..8 * blocks] == r.6[..],
            "{what}: q8 blocks"
        );
        assert!(
            lane(&dq, blocks, lw / 32) == common::bits(&r.7),
            "{what}: q8 scales"
        );
        assert!(
            lane(&sums, blocks, blocks) == common::bits(&r.8),
            "{what}: Σx²"
        );
    }
    let left: Vec<u32> =
        bytemuck::cast_slice(&g.ctx().read(&counts, (4 * lanes * blocks) as u64).unwrap()).to_vec();
    assert!(
        left.iter().all(|&n| n == 0),
        "{}: counts left {left:?}",
        c.name
    );
}

/// How a case's lanes choose their experts.
#[derive(Clone, Copy)]
enum LaneChoice {
    /// Every lane the same experts (as every lane names the shared expert's slices).
    Same,
    /// Lane l the experts l·K … l·K + K − 1: no expert chosen twice.
    Distinct,
    /// Each lane K distinct experts drawn with this seed: some shared, some not.
    Drawn(u64),
}

/// A batch's up pass over its lanes (`lane_width`: inputs a lane width apart, every lane's
/// choices of a row block side by side in the grid): each lane's rows must be its one-token
/// pass's, bit for bit. `banks`: the bank sizes in order.
struct LaneUpCase {
    name: &'static str,
    banks: &'static [usize],
    rows: usize,
    cols: usize,
    slots: usize,
    lanes: usize,
    choice: LaneChoice,
    format: WeightFormat,
    /// The activation folded into the pass, written with its q8 blocks: relu², or with
    /// `gated` silu(gate)·up of the rows' two halves.
    fold: bool,
    gated: bool,
}

const LANE_UP_CASES: [LaneUpCase; 8] = [
    LaneUpCase {
        name: "silu(g)·u folded, 6 lanes drawing 4 of 9 experts of [gate; up] 2 × 400 rows \
               (several row blocks, the last one short), q8_0",
        banks: &[9],
        rows: 800,
        cols: 96,
        slots: 4,
        lanes: 6,
        choice: LaneChoice::Drawn(17),
        format: WeightFormat::Q8_0,
        fold: true,
        gated: true,
    },
    LaneUpCase {
        name: "silu(g)·u folded, 3 lanes drawing 2 of 4 experts of [gate; up] 2 × 40 rows, q4_k",
        banks: &[4],
        rows: 80,
        cols: 256,
        slots: 2,
        lanes: 3,
        choice: LaneChoice::Drawn(19),
        format: WeightFormat::Q4_K,
        fold: true,
        gated: true,
    },
    LaneUpCase {
        name: "16 lanes on the same 3 of 6 experts, q8_0",
        banks: &[6],
        rows: 100,
        cols: 96,
        slots: 3,
        lanes: 16,
        choice: LaneChoice::Same,
        format: WeightFormat::Q8_0,
        fold: false,
        gated: false,
    },
    LaneUpCase {
        name: "19 lanes drawing 4 of 40 experts in banks of 24 and 16, q8_0",
        banks: &[24, 16],
        rows: 72,
        cols: 64,
        slots: 4,
        lanes: 19,
        choice: LaneChoice::Drawn(5),
        format: WeightFormat::Q8_0,
        fold: false,
        gated: false,
    },
    LaneUpCase {
        name: "16 lanes × 4 slots, every one of 64 experts chosen once, q8_0",
        banks: &[64],
        rows: 40,
        cols: 32,
        slots: 4,
        lanes: 16,
        choice: LaneChoice::Distinct,
        format: WeightFormat::Q8_0,
        fold: false,
        gated: false,
    },
    LaneUpCase {
        name: "relu² folded, 5 lanes drawing 8 of 130 experts of 424 rows, q8_0",
        banks: &[130],
        rows: 424,
        cols: 96,
        slots: 8,
        lanes: 5,
        choice: LaneChoice::Drawn(9),
        format: WeightFormat::Q8_0,
        fold: true,
        gated: false,
    },
    LaneUpCase {
        name: "7 lanes drawing 2 of 5 experts in banks of 3 and 2, q4_k",
        banks: &[3, 2],
        rows: 48,
        cols: 256,
        slots: 2,
        lanes: 7,
        choice: LaneChoice::Drawn(11),
        format: WeightFormat::Q4_K,
        fold: false,
        gated: false,
    },
    LaneUpCase {
        name: "9 lanes drawing 3 of 12 experts, f16 against f32 inputs",
        banks: &[12],
        rows: 33,
        cols: 80,
        slots: 3,
        lanes: 9,
        choice: LaneChoice::Drawn(13),
        format: WeightFormat::F16,
        fold: false,
        gated: false,
    },
];

/// The K experts lane `l` of `c` chooses, distinct.
fn lane_choices(c: &LaneUpCase, l: usize) -> Vec<u32> {
    let experts: usize = c.banks.iter().sum();
    match c.choice {
        LaneChoice::Same => (0..c.slots).map(|s| (2 * s % experts) as u32).collect(),
        LaneChoice::Distinct => (0..c.slots).map(|s| (l * c.slots + s) as u32).collect(),
        LaneChoice::Drawn(seed) => {
            let mut ids = Vec::new();
            let mut i = 0u64;
            while ids.len() < c.slots {
                let e = (uniform(seed + l as u64, i) * experts as f32) as u32 % experts as u32;
                if !ids.contains(&e) {
                    ids.push(e);
                }
                i += 1;
            }
            ids
        }
    }
}

/// Each case's lanes through one up pass per bank (`lane_width`: inputs a lane width
/// apart) against each lane's one-token passes, bitwise: the rows, or
/// with the fold the activation and its q8 blocks; and the rows against the host's dot
/// products of the dequantized values.
#[test]
fn experts_up_pass_over_lanes_equals_each_lane_alone() {
    use mamba2_wgpu::gpu::kernels::expert_gemv::{
        ActFold, Bank, ExpertBuffers, ExpertPass, expert_gemv,
    };
    let Some(g) = Gpu::new() else { return };
    for c in LANE_UP_CASES {
        let experts: usize = c.banks.iter().sum();
        let w = rand(70, experts * c.rows * c.cols, -1.0, 1.0);
        let mut banks = Vec::new();
        let mut wf = Vec::new();
        let mut first = 0;
        for &count in c.banks {
            let part = &w[first * c.rows * c.cols..(first + count) * c.rows * c.cols];
            let (m, f) = matrix(&g, c.format, part, count * c.rows, c.cols);
            banks.push((first, count, m));
            wf.extend(f);
            first += count;
        }
        let kp = banks[0].2.kp;
        let q8 = c.format != WeightFormat::F16;
        let lw = kp.next_multiple_of(256);
        // (One token's f32 input is padded to 32 values, what norms and activations write.)
        let xs = c.cols.next_multiple_of(32).max(kp);
        // The activation rows a choice's fold writes (padded to whole q8 blocks).
        let act_n = if c.gated { c.rows / 2 } else { c.rows };
        let xm = act_n.next_multiple_of(32);
        // One pass per bank over `tokens` tokens whose inputs lie `stride` values apart;
        // returns the rows (or the activation) and, folded, its q8 words and scales.
        let run = |tokens: usize, ids: &[u32], x: &[f32], stride: Option<usize>| {
            let (mut xq, mut xd) = (Vec::new(), Vec::new());
            let row = stride.unwrap_or(xs);
            for t in 0..tokens {
                let (q, d) = q8_blocks(&x[t * row..t * row + kp]);
                xq.extend(q);
                xd.extend(d);
                xq.resize((t + 1) * row / 4, 0);
                xd.resize((t + 1) * row / 32, 0.0);
            }
            let (src, xqb, xdb, idb) = (g.buf(x), g.words(&xq), g.buf(&xd), g.words(ids));
            let z = tokens * c.slots;
            let (dst, mid, mq, md) = (
                g.zeros(z * c.rows),
                g.zeros(z * xm),
                g.zeros(z * xm / 4),
                g.zeros(z * xm / 32),
            );
            for (first, count, m) in &banks {
                let d = expert_gemv(
                    &g.k,
                    "up",
                    m,
                    Bank {
                        first: *first,
                        count: *count,
                        rows_per_expert: c.rows,
                    },
                    ExpertPass::Up,
                    tokens,
                    c.slots,
                    ExpertBuffers {
                        src: &src,
                        q8: q8.then_some((&xqb, &xdb)),
                        dst: &dst,
                        dst_at: None,
                        ids: &idb,
                        weights: None,
                        store: false,
                        act: c.fold.then_some(ActFold {
                            mid: &mid,
                            q8: Some((&mq, &md)),
                            gated: c.gated,
                        }),
                        route: None,
                        norm_tail: None,
                        lane_width: stride,
                    },
                )
                .unwrap();
                g.run(&d);
            }
            if c.fold {
                let q: Vec<u32> =
                    bytemuck::cast_slice(&g.ctx().read(&mq, (z * xm) as u64).unwrap()).to_vec();
                (g.read(&mid, z * xm), q, g.read(&md, z * xm / 32))
            } else {
                (g.read(&dst, z * c.rows), Vec::new(), Vec::new())
            }
        };
        let width = if c.fold { xm } else { c.rows };
        let mut inputs = Vec::new();
        let mut ids = Vec::new();
        let mut alone = Vec::new();
        for l in 0..c.lanes {
            let mut x = rand(71 + l as u64, c.cols, -2.0, 2.0);
            x.resize(xs, 0.0);
            let lane_ids = lane_choices(&c, l);
            let out = run(1, &lane_ids, &x, None);
            // The host's rows: each choice's expert against the lane's input (its q8
            // values where the pass reads those).
            let xin = if q8 {
                let (q, d) = q8_blocks(&x[..kp]);
                dequant(&q, &d, kp)
            } else {
                x.clone()
            };
            for (s, &e) in lane_ids.iter().enumerate() {
                let rows: Vec<f32> = (0..c.rows)
                    .map(|r| {
                        let row = &wf[(e as usize * c.rows + r) * c.cols..][..c.cols];
                        row.iter().zip(&xin).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let (want, width) = match (c.fold, c.gated) {
                    (false, _) => (rows, c.rows),
                    (true, false) => (rows.iter().map(|u| u.max(0.0).powi(2)).collect(), xm),
                    (true, true) => {
                        let (g, u) = rows.split_at(act_n);
                        let silu = |x: f32| x / (1.0 + (-x).exp());
                        (g.iter().zip(u).map(|(g, u)| silu(*g) * u).collect(), xm)
                    }
                };
                assert_nmse(
                    &format!("{} lane {l} slot {s}", c.name),
                    &out.0[s * width..][..act_n],
                    &want,
                    1e-9,
                );
            }
            x.resize(lw, 0.0);
            inputs.extend(x);
            ids.extend(lane_ids);
            alone.push(out);
        }
        let (rows, q, d) = run(c.lanes, &ids, &inputs, Some(lw));
        for (l, (a_rows, a_q, a_d)) in alone.iter().enumerate() {
            let what = format!("{} (lane {l} of {})", c.name, c.lanes);
            let n = c.slots * width;
            assert!(
                common::bits(&rows[l * n..][..n]) == common::bits(a_rows),
                "{what}: rows"
            );
            if c.fold {
                assert!(q[l * n / 4..][..n / 4] == a_q[..], "{what}: q8 blocks");
                assert!(
                    common::bits(&d[l * n / 32..][..n / 32]) == common::bits(a_d),
                    "{what}: q8 scales"
                );
            }
        }
    }
}
