//! What a dispatch costs the GPU by itself: chains of N tiny dispatches recorded in one
//! compute pass, submitted, waited for; the difference between N = 256 and N = 1, over 255,
//! is the time one more dispatch adds (launch, wgpu's barrier between dispatches, drain).
//! Decode is a chain of such dispatches (mamba2-130m: 76 a token), so this is the floor
//! under its ms/token that no kernel work can go below.
//!
//!     cargo run --release --example dispatch_floor [-- ADAPTER_SUBSTR]
//!
//! Variants: one workgroup or a full GPU's worth (1024 × 64 invocations), each dispatch
//! updating the same buffer (read-write every time: wgpu puts a barrier before each) or a
//! buffer of its own (no hazard between dispatches).

use std::time::Instant;

use anyhow::{Context, Result};
use mamba2_wgpu::gpu::context::{DeviceChoice, GpuContext, Needs, pick_adapter};

const SHADER: &str = "
@group(0) @binding(0) var<storage, read_write> b: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let i = g.x % arrayLength(&b);
    b[i] = b[i] + 1u;
}
";

/// Dispatches per chain, and how many times each chain is timed (the median is kept).
const CHAINS: [u32; 2] = [1, 256];
const REPEATS: usize = 30;

fn main() -> Result<()> {
    let choice = DeviceChoice::Gpu(std::env::args().nth(1));
    let adapter = pick_adapter(&choice)?.context("no GPU adapter")?;
    let needs = Needs {
        largest_buffer: ("dispatch floor".into(), 1 << 20),
        storage_buffers_per_stage: 1,
        workgroup_storage: 0,
        invocations_per_workgroup: 64,
    };
    let ctx = GpuContext::new(adapter, &needs)?;
    println!("device: {}", ctx.describe());
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("dispatch floor"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
    let pipeline = ctx
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("dispatch floor"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
    let max = *CHAINS.iter().max().unwrap_or(&1) as usize;
    let buffers: Vec<wgpu::Buffer> = (0..max)
        .map(|_| ctx.storage_zeroed("dispatch floor", 64 * 1024 * 4))
        .collect::<mamba2_wgpu::Result<_>>()?;
    let groups: Vec<wgpu::BindGroup> = buffers
        .iter()
        .map(|b| {
            ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: b.as_entire_binding(),
                }],
            })
        })
        .collect();
    for workgroups in [1u32, 1024] {
        for own_buffer in [false, true] {
            let mut per_chain = Vec::new();
            for n in CHAINS {
                let mut times = Vec::with_capacity(REPEATS);
                for _ in 0..REPEATS + 3 {
                    let mut enc = ctx.device.create_command_encoder(&Default::default());
                    {
                        let mut pass = enc.begin_compute_pass(&Default::default());
                        pass.set_pipeline(&pipeline);
                        for i in 0..n as usize {
                            pass.set_bind_group(0, &groups[if own_buffer { i } else { 0 }], &[]);
                            pass.dispatch_workgroups(workgroups, 1, 1);
                        }
                    }
                    let cmd = enc.finish();
                    let t0 = Instant::now();
                    ctx.queue.submit([cmd]);
                    ctx.wait()?;
                    times.push(t0.elapsed().as_secs_f64() * 1e6);
                }
                let mut times = times.split_off(3);
                times.sort_by(f64::total_cmp);
                per_chain.push((n, times[times.len() / 2]));
            }
            let (n0, t0) = per_chain[0];
            let (n1, t1) = per_chain[per_chain.len() - 1];
            println!(
                "{workgroups:>5} workgroups, {}: {n0} dispatch {t0:.1} µs, {n1} dispatches {t1:.1} µs \
                 → {:.2} µs per dispatch",
                if own_buffer {
                    "a buffer each"
                } else {
                    "one buffer   "
                },
                (t1 - t0) / (n1 - n0) as f64
            );
        }
    }
    Ok(())
}
