//! GPU time per kernel from timestamp queries: between the dispatches of the token's one
//! compute pass where the adapter allows it (TIMESTAMP_QUERY_INSIDE_PASSES), else one pass
//! per dispatch with pass timestamps. Only used when profiling is on: the normal decode
//! path records no queries at all.

use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::gpu::graph::Graph;
use crate::gpu::kernels::{Label, Section};

/// One kernel's GPU time in one token.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub section: Section,
    /// The dispatch's place in the model (layer, block kind, kernel role).
    pub label: Label,
    pub ns: f64,
}

impl KernelTime {
    /// The kernel's role without the layer, with its block kind (`mamba2/in_proj+conv`,
    /// `attention/kv_store`, `lm_head`…): what bench and the inspector group by.
    pub fn kind(&self) -> String {
        match self.label.block {
            Some(b) => format!("{}/{}", b.name(), self.label.kernel),
            None => self.name.clone(),
        }
    }
}

/// Everything measured about one profiled token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenProfile {
    pub kernels: Vec<KernelTime>,
    /// Host time recording the dispatches.
    pub encode_ns: f64,
    /// Host time inside `queue.submit`.
    pub submit_ns: f64,
}

impl TokenProfile {
    pub fn gpu_ns(&self) -> f64 {
        self.kernels.iter().map(|k| k.ns).sum()
    }

    pub fn section_ns(&self, s: Section) -> f64 {
        self.kernels
            .iter()
            .filter(|k| k.section == s)
            .map(|k| k.ns)
            .sum()
    }
}

/// Timestamp queries sized for a graph.
pub struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    capacity: u32,
    pub inside_passes: bool,
    period_ns: f64,
}

impl Profiler {
    /// `None` when the adapter has no timestamp queries.
    pub fn new(ctx: &GpuContext, max_dispatches: usize) -> Result<Option<Self>> {
        if !ctx.caps.timestamps {
            return Ok(None);
        }
        let inside_passes = ctx.caps.timestamps_in_passes;
        let capacity = (2 * max_dispatches + 2) as u32;
        let queries = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("profiler"),
            ty: wgpu::QueryType::Timestamp,
            count: capacity,
        });
        let bytes = 8 * capacity as u64;
        let resolve = ctx.buffer(
            "profiler resolve",
            bytes,
            wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        )?;
        let staging = ctx.buffer(
            "profiler staging",
            bytes,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        Ok(Some(Profiler {
            queries,
            resolve,
            staging,
            capacity,
            inside_passes,
            period_ns: ctx.queue.get_timestamp_period() as f64,
        }))
    }

    fn queries_for(&self, graph: &Graph) -> Result<u32> {
        let n = if self.inside_passes {
            graph.len() as u32 + 1
        } else {
            2 * graph.len() as u32
        };
        if n > self.capacity {
            return Err(Error::Gpu(format!(
                "profiler sized for {} queries, graph needs {n}",
                self.capacity
            )));
        }
        Ok(n)
    }

    /// Records `graph` with timestamps and the query resolve into `enc` (`tokens` as in
    /// `Graph::record`).
    pub fn record(
        &self,
        enc: &mut wgpu::CommandEncoder,
        graph: &Graph,
        tokens: Option<u32>,
    ) -> Result<()> {
        let n = self.queries_for(graph)?;
        if self.inside_passes {
            let mut pass = enc.begin_compute_pass(&Default::default());
            graph.record(&mut pass, Some((&self.queries, 0)), tokens);
        } else {
            for (i, d) in graph.dispatches.iter().enumerate() {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(&d.name),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &self.queries,
                        beginning_of_pass_write_index: Some(2 * i as u32),
                        end_of_pass_write_index: Some(2 * i as u32 + 1),
                    }),
                });
                d.record_tokens(&mut pass, tokens);
            }
        }
        enc.resolve_query_set(&self.queries, 0..n, &self.resolve, 0);
        Ok(())
    }

    /// After the recorded work was submitted: copies the timestamps out (in a separate
    /// encoder, which some Vulkan drivers need) and turns them into kernel times.
    pub fn read(&self, ctx: &GpuContext, graph: &Graph) -> Result<Vec<KernelTime>> {
        let n = self.queries_for(graph)?;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.staging, 0, Some(8 * n as u64));
        ctx.queue.submit([enc.finish()]);
        let bytes = ctx.read_mapped(&self.staging, 8 * n as u64)?;
        let ticks: &[u64] = bytemuck::cast_slice(&bytes);
        Ok(graph
            .dispatches
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let (a, b) = if self.inside_passes {
                    (ticks[i], ticks[i + 1])
                } else {
                    (ticks[2 * i], ticks[2 * i + 1])
                };
                KernelTime {
                    name: d.name.clone(),
                    section: d.section,
                    label: d.label.clone(),
                    ns: b.saturating_sub(a) as f64 * self.period_ns,
                }
            })
            .collect())
    }
}
