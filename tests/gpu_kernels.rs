//! Every WGSL kernel against the CPU reference (the ggml test-backend-ops habit), at shapes
//! that are not multiples of the workgroup or row-block sizes, with G > 1 and a head dim
//! that is not a power of two. f32 paths: NMSE ≤ 1e-7. The q8_0 GEMV equals the host's q8_0
//! dot product to f32 rounding.

mod common;

use std::sync::Arc;

use mamba2_wgpu::gpu::context::{GpuContext, Needs};
use mamba2_wgpu::gpu::graph::Ctrl;
use mamba2_wgpu::gpu::kernels::gemv::{GemvBuffers, GemvInput, GemvOutput, MixerConsts, gemv};
use mamba2_wgpu::gpu::kernels::ssd_step::{SsdBuffers, SsdConsts, ssd_step};
use mamba2_wgpu::gpu::kernels::{
    Dispatch, Kernels, argmax, embed, gated_norm, residual_add, rmsnorm, sample,
};
use mamba2_wgpu::gpu::weights::DeviceMatrix;
use mamba2_wgpu::model::quant::{WeightFormat, pack, q8_0_gemv_reference, unpack};
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
        let needs = Needs {
            largest_buffer: ("test".into(), 1 << 20),
            storage_buffers_per_stage: 8,
            workgroup_storage: 16384,
            invocations_per_workgroup: 256,
        };
        common::gpu(&needs).map(|ctx| Gpu {
            k: Kernels::new(ctx),
        })
    }
    fn ctx(&self) -> &Arc<GpuContext> {
        &self.k.ctx
    }
    fn buf(&self, v: &[f32]) -> wgpu::Buffer {
        self.ctx()
            .storage_with("test", bytemuck::cast_slice(v))
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

fn plain<'a>(src: &'a wgpu::Buffer, dst: &'a wgpu::Buffer) -> GemvBuffers<'a> {
    GemvBuffers {
        src,
        params: None,
        part: None,
        dst,
        conv_state: None,
        ctrl: None,
    }
}

#[test]
fn gemv_plain_every_format() {
    let Some(g) = Gpu::new() else { return };
    for (rows, cols) in [(37, 70), (8, 256), (129, 1000), (3, 5)] {
        let w = rand(1, rows * cols, -1.0, 1.0);
        let x = rand(2, cols, -2.0, 2.0);
        let (src, dst) = (g.buf(&x), g.zeros(rows));
        for format in [WeightFormat::F32, WeightFormat::F16] {
            let (m, deq) = matrix(&g, format, &w, rows, cols);
            g.run(
                &gemv(
                    &g.k,
                    "t",
                    &m,
                    GemvInput::Plain,
                    GemvOutput::Store,
                    plain(&src, &dst),
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
        let p = pack(WeightFormat::Q8_0, &w, rows, cols);
        let m = DeviceMatrix::upload(g.ctx(), "w", &p).unwrap();
        g.run(
            &gemv(
                &g.k,
                "t",
                &m,
                GemvInput::Plain,
                GemvOutput::Store,
                plain(&src, &dst),
            )
            .unwrap(),
        );
        let want = q8_0_gemv_reference(&p, &x);
        let got = g.read(&dst, rows);
        for (r, (a, b)) in got.iter().zip(&want).enumerate() {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                (a - b).abs() <= 2e-6 * scale.max(1.0),
                "q8_0 [{rows},{cols}] row {r}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn gemv_fused_norm_prologue_and_residual_epilogue() {
    let Some(g) = Gpu::new() else { return };
    let (rows, cols) = (45, 72);
    let w = rand(3, rows * cols, -0.5, 0.5);
    let resid = rand(4, cols, -3.0, 3.0);
    let params: Vec<f32> = [vec![9.0; 5], rand(5, cols, 0.5, 1.5)].concat(); // norm at offset 5
    let add_to = rand(6, rows, -1.0, 1.0);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Q8_0] {
        let (m, deq) = matrix(&g, format, &w, rows, cols);
        let (src, pbuf, dst) = (g.buf(&resid), g.buf(&params), g.buf(&add_to));
        let b = GemvBuffers {
            src: &src,
            params: Some(&pbuf),
            part: None,
            dst: &dst,
            conv_state: None,
            ctrl: None,
        };
        g.run(
            &gemv(
                &g.k,
                "t",
                &m,
                GemvInput::Rms {
                    nw_off: 5,
                    eps: 1e-5,
                },
                GemvOutput::Add,
                b,
            )
            .unwrap(),
        );
        let h = ref_rmsnorm(&resid, &params[5..], 1e-5);
        let mut want = vec![0f32; rows];
        matvec(&deq, &h, &mut want);
        want.iter_mut().zip(&add_to).for_each(|(w, a)| *w += a);
        // q8_0 also quantizes the activation: compare with a looser bound.
        let tol = if format == WeightFormat::Q8_0 {
            1e-4
        } else {
            1e-7
        };
        assert_nmse(
            &format!("rms gemv add {}", format.name()),
            &g.read(&dst, rows),
            &want,
            tol,
        );
    }
}

#[test]
fn gemv_group_norm_prologue() {
    let Some(g) = Gpu::new() else { return };
    // d_inner 96 = 8 heads × 12, G = 2, one partial per (head, 8-channel block): 2 blocks/head.
    let (heads, p, groups, rows) = (8, 12, 2, 21);
    let di = heads * p;
    let v = rand(7, di, -2.0, 2.0);
    let wn = rand(8, di, 0.5, 1.5);
    let blocks = 2;
    let mut part = vec![0f32; heads * blocks];
    for h in 0..heads {
        for pb in 0..blocks {
            part[h * blocks + pb] = (pb * 8..((pb + 1) * 8).min(p))
                .map(|c| v[h * p + c].powi(2))
                .sum();
        }
    }
    let w = rand(9, rows * di, -0.5, 0.5);
    let (m, deq) = matrix(&g, WeightFormat::F32, &w, rows, di);
    let (src, pbuf, partb, dst) = (g.buf(&v), g.buf(&wn), g.buf(&part), g.zeros(rows));
    let input = GemvInput::Group {
        nw_off: 0,
        groups,
        group_size: di / groups,
        parts_per_group: heads / groups * blocks,
        eps: 1e-5,
    };
    let b = GemvBuffers {
        src: &src,
        params: Some(&pbuf),
        part: Some(&partb),
        dst: &dst,
        conv_state: None,
        ctrl: None,
    };
    g.run(&gemv(&g.k, "t", &m, input, GemvOutput::Store, b).unwrap());
    // gated_group_rmsnorm with z → ∞ (silu(z) = z... use the plain group norm of v):
    let size = di / groups;
    let mut x = v.clone();
    for (gi, chunk) in x.chunks_mut(size).enumerate() {
        let rstd = 1.0 / (chunk.iter().map(|a| a * a).sum::<f32>() / size as f32 + 1e-5).sqrt();
        for (k, a) in chunk.iter_mut().enumerate() {
            *a *= rstd * wn[gi * size + k];
        }
    }
    let mut want = vec![0f32; rows];
    matvec(&deq, &x, &mut want);
    assert_nmse("group-norm gemv", &g.read(&dst, rows), &want, 1e-7);
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
    g.run(
        &mamba2_wgpu::gpu::kernels::conv_step::conv_step(&g.k, "t", mc, &mix, &pbuf, &cs, &ctrl)
            .unwrap(),
    );
    let mut conv_want = conv0.clone();
    let want = mixer_reference(&mc, &row, &params, &mut conv_want);
    assert_nmse("conv_step output", &g.read(&mix, rows), &want, 1e-7);
    assert_nmse(
        "conv_step state",
        &g.read(&cs, conv0.len()),
        &conv_want,
        1e-7,
    );
    // Fused: the in_proj GEMV's epilogue does the same on its own output.
    let k = 10;
    let w = rand(13, rows * k, -1.0, 1.0);
    let x = rand(14, k, -1.0, 1.0);
    let (m, deq) = matrix(&g, WeightFormat::F32, &w, rows, k);
    let (src, dst, cs2) = (g.buf(&x), g.zeros(rows), g.buf(&conv0));
    let b = GemvBuffers {
        src: &src,
        params: Some(&pbuf),
        part: None,
        dst: &dst,
        conv_state: Some(&cs2),
        ctrl: Some(&ctrl),
    };
    g.run(&gemv(&g.k, "t", &m, GemvInput::Plain, GemvOutput::Mixer(mc), b).unwrap());
    let mut raw = vec![0f32; rows];
    matvec(&deq, &x, &mut raw);
    let mut conv_want = conv0.clone();
    let want = mixer_reference(&mc, &raw, &params, &mut conv_want);
    assert_nmse("fused mixer output", &g.read(&dst, rows), &want, 1e-7);
    assert_nmse(
        "fused mixer conv state",
        &g.read(&cs2, conv0.len()),
        &conv_want,
        1e-7,
    );
    // A stopped sequence leaves its conv state alone.
    let stopped = g.ctrl(&Ctrl {
        stopped: 1,
        ..Default::default()
    });
    let cs3 = g.buf(&conv0);
    g.run(
        &mamba2_wgpu::gpu::kernels::conv_step::conv_step(
            &g.k,
            "t",
            mc,
            &g.buf(&row),
            &pbuf,
            &cs3,
            &stopped,
        )
        .unwrap(),
    );
    assert_eq!(g.read(&cs3, conv0.len()), conv0);
}

#[test]
fn ssd_step_plain_and_gated() {
    let Some(g) = Gpu::new() else { return };
    for (heads, p, groups, n) in [(4, 6, 2, 12), (6, 64, 3, 16), (2, 5, 1, 40)] {
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
        };
        let a = rand(20, heads, -4.0, -0.5);
        let dskip = rand(21, heads, 0.5, 1.5);
        let params = [a.clone(), dskip.clone()].concat();
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
        for gated in [false, true] {
            let (mixb, pbuf, st, y) = (g.buf(&mix), g.buf(&params), g.buf(&state0), g.zeros(di));
            let part = g.zeros(heads * c.blocks());
            let b = SsdBuffers {
                mix: &mixb,
                params: &pbuf,
                state: &st,
                y: &y,
                part: gated.then_some(&part),
                ctrl: &ctrl,
            };
            g.run(&ssd_step(&g.k, "t", c, b).unwrap());
            assert_nmse("ssd state", &g.read(&st, state0.len()), &state_want, 1e-7);
            let got = g.read(&y, di);
            if gated {
                let v: Vec<f32> = y_want
                    .iter()
                    .zip(&mix[..di])
                    .map(|(y, z)| y * silu(*z))
                    .collect();
                assert_nmse(&format!("ssd gated v H={heads} P={p}"), &got, &v, 1e-7);
                let parts = g.read(&part, heads * c.blocks());
                let total: f32 = parts.iter().sum();
                let want_total: f32 = v.iter().map(|a| a * a).sum();
                assert!(
                    (total - want_total).abs() <= 1e-4 * want_total,
                    "Σv² {total} vs {want_total}"
                );
            } else {
                assert_nmse(&format!("ssd y H={heads} P={p} N={n}"), &got, &y_want, 1e-7);
            }
        }
    }
}

#[test]
fn norms_residual_and_embedding() {
    let Some(g) = Gpu::new() else { return };
    // rmsnorm, D not a multiple of the workgroup
    let d = 300;
    let x = rand(30, d, -3.0, 3.0);
    let params = [vec![0.0; 7], rand(31, d, 0.5, 1.5)].concat();
    let (src, pbuf, dst) = (g.buf(&x), g.buf(&params), g.zeros(d));
    g.run(&rmsnorm::rmsnorm(&g.k, "t", d, 1e-5, 7, &src, &pbuf, &dst).unwrap());
    assert_nmse(
        "rmsnorm",
        &g.read(&dst, d),
        &ref_rmsnorm(&x, &params[7..], 1e-5),
        1e-7,
    );
    // gated group norm, G = 3
    let (di, groups) = (90, 3);
    let y = rand(32, di, -2.0, 2.0);
    let z = rand(33, di, -2.0, 2.0);
    let w = rand(34, di, 0.5, 1.5);
    let (yb, zb, wb, out) = (g.buf(&y), g.buf(&z), g.buf(&w), g.zeros(di));
    g.run(&gated_norm::gated_norm(&g.k, "t", di, groups, 1e-5, 0, &yb, &zb, &wb, &out).unwrap());
    assert_nmse(
        "gated group norm",
        &g.read(&out, di),
        &gated_group_rmsnorm(&y, &z, &w, groups, 1e-5),
        1e-7,
    );
    // residual add
    let a = rand(35, d, -1.0, 1.0);
    let (ab, rb) = (g.buf(&a), g.buf(&x));
    g.run(&residual_add::residual_add(&g.k, "t", d, &ab, &rb).unwrap());
    let want: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
    assert_eq!(g.read(&rb, d), want);
    // embedding gather, every format, a row of 70 (not a multiple of anything)
    let (v, dm) = (13, 70);
    let table = rand(36, v * dm, -1.0, 1.0);
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Q8_0] {
        let (m, deq) = matrix(&g, format, &table, v, dm);
        let (ctrl, resid) = (
            g.ctrl(&Ctrl {
                token: 11,
                ..Default::default()
            }),
            g.zeros(dm),
        );
        g.run(&embed::embed(&g.k, &m, &ctrl, &resid).unwrap());
        assert_eq!(
            g.read(&resid, dm),
            deq[11 * dm..12 * dm].to_vec(),
            "embed {}",
            format.name()
        );
    }
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
    g.run(&argmax::argmax(&g.k, vocab, &lb, &ctrl).unwrap());
    let c = g.read_ctrl(&ctrl);
    assert_eq!((c.token, c.pos, c.stopped), (ref_argmax(&logits), 6, 1));
    assert_eq!(c.token, 123);
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
        g.run(&sample::sample(&g.k, vocab, &lb, &ctrl, &probs).unwrap());
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
}
