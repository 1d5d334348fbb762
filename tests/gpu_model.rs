//! Whole-model decode on the GPU (lavapipe in CI) against the CPU reference.

mod common;

use mamba2_wgpu::gpu::engine::{Engine, EngineOptions};
use mamba2_wgpu::gpu::graph::{Ctrl, Tail};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::tiny_config;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};

#[test]
fn synthetic_decode_matches_reference() {
    for (groups, head_dim) in [(1, 8), (2, 6)] {
        let model = Model::synthetic(tiny_config(groups, head_dim), 3);
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else { return };
        for fused in [true, false] {
            let engine = Engine::new(ctx.clone(), &model, EngineOptions { format: WeightFormat::F32, fused }).unwrap();
            let cpu = CpuModel::<f32>::new(&model.config, &model.weights);
            let mut state = cpu.new_state();
            let tokens = [5u32, 17, 3, 60, 2, 9, 9, 41];
            for &t in &tokens {
                let want = &cpu.forward(&mut state, &[t], Scan::Sequential, Logits::Last).unwrap()[0];
                engine.write_ctrl(&Ctrl { token: t, ..Default::default() });
                let mut enc = ctx.device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    engine.graph(Tail::Greedy).record(&mut pass, None);
                }
                ctx.queue.submit([enc.finish()]);
                let got = engine.read_logits().unwrap();
                let e = common::nmse(&got, want);
                assert!(e <= 1e-7, "G={groups} fused={fused} token {t}: logits NMSE {e:e}");
                let ctrl = engine.read_ctrl().unwrap();
                assert_eq!(ctrl.token, mamba2_wgpu::sampling::argmax(want));
            }
            let gpu_state = engine.read_state().unwrap();
            for l in 0..model.config.n_layer {
                assert!(common::nmse(&gpu_state.ssm[l], &state.ssm[l]) <= 1e-7);
                assert!(common::nmse(&gpu_state.conv[l], &state.conv[l]) <= 1e-7);
            }
        }
    }
}
