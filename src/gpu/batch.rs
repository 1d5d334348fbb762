//! Batched decode: `slots` sequences side by side in one state store, advanced together by
//! one submit per step. Lane l of a step is slot l: the step's GEMVs read each weight once
//! for all its lanes, its MoE blocks route the lanes as the tokens of one pass (each lane's
//! chosen experts read for it), and its SSD steps, conv steps, attention and samplers run
//! per lane with the lane's own state, length, sampling options and seed. A lane's arithmetic is the
//! one-sequence graph's, in the same order, so its logits and tokens are bitwise those of
//! the same sequence decoded alone (`tests/gpu_batch.rs` checks it).
//!
//! A sequence enters a slot from the engine's own store (where its prompt was prefilled)
//! and leaves back into it (for the prefix cache). Slots between live ones (and up to the
//! next power of two, which bounds the graphs built) are stopped lanes: their steps change
//! nothing. Steps are pipelined like the one-sequence decode:
//! up to `RING` in flight, each lane's control block read back asynchronously.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;

use crate::error::{Error, Result};
use crate::gpu::blocks::{self, BlockCtx, mamba2};
use crate::gpu::engine::Engine;
use crate::gpu::graph::{Ctrl, Graph, Tail};
use crate::gpu::kernels::Lanes;
use crate::gpu::scratch::Scratch;
use crate::gpu::state_store::DeviceState;
use crate::sampling::Sampling;

/// Steps in flight.
const RING: usize = 3;

type MapResult = mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>;

/// What the host knows of a slot.
#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    /// A sequence occupies it.
    live: bool,
    /// The host stopped it (its later steps change nothing).
    ended: bool,
    /// Greedy (argmax) or sampled.
    greedy: bool,
    /// Tokens in its state (the device's `kv_len`, as last read).
    len: u32,
}

/// The batch's state store, scratch and graphs (one per lane count and tail, made on
/// first use).
pub struct Batch {
    pub slots: usize,
    state: DeviceState,
    scratch: Scratch,
    graphs: HashMap<(usize, Tail), Graph>,
    ring: Vec<wgpu::Buffer>,
    lanes: Vec<Slot>,
}

/// The lanes a step dispatches when slot `live - 1` is the highest live one: a power of
/// two (at most the slots), so a batch builds at most log2(slots) + 1 graphs per tail (each
/// lane count is its own set of pipelines); the free slots in between are stopped lanes.
fn lanes_for(live: usize, slots: usize) -> usize {
    live.next_power_of_two().min(slots)
}

/// A free slot's control block: stopped, so a step that spans it changes nothing there,
/// and with no rows, so no decode attention grid is sized by a length it once had.
fn free_slot() -> Ctrl {
    Ctrl {
        stopped: 1,
        ..Default::default()
    }
}

/// Why a model cannot decode in batches (group sizes the fused graph cannot take, or an
/// engine running the unfused graph), or None.
pub fn unsupported(engine: &Engine) -> Option<String> {
    let c = &engine.config;
    if c.count(crate::config::BlockKind::Mamba2) > 0 && !mamba2::fusable(c, engine.format) {
        return Some(format!(
            "batched decode needs the fused Mamba2 graph, which {} groups of {} channels \
             do not fit",
            engine.format.name(),
            c.group_size()
        ));
    }
    // (A batch runs the fused graph: an unfused engine's sequences alone would differ.)
    if !engine.fused {
        return Some(
            "batched decode runs the fused graph, and this engine runs the unfused one \
             (--no-fuse or MAMBA2_NO_FUSE): its lanes would not equal their runs alone"
                .into(),
        );
    }
    None
}

impl Batch {
    /// A store of `slots` sequences for `engine`'s model and context.
    pub fn new(engine: &Engine, slots: usize) -> Result<Self> {
        if let Some(why) = unsupported(engine) {
            return Err(Error::InvalidInput(why));
        }
        if !(2..=256).contains(&slots) {
            return Err(Error::InvalidInput(format!(
                "a batch holds 2…256 sequences, not {slots}"
            )));
        }
        let ctx = engine.ctx();
        let c = &engine.config;
        let state = DeviceState::with_slots(ctx, c, engine.state.ctx, engine.state.kv, slots)?;
        let blocks = mamba2::ssd_consts(c, &engine.layout).blocks();
        let attn_part = blocks::attention::partials_len(c, engine.state.ctx);
        let scratch = Scratch::with_lanes(ctx, c, blocks, attn_part, slots)?;
        let ring = (0..RING)
            .map(|i| {
                ctx.buffer(
                    &format!("batch ring {i}"),
                    (slots * std::mem::size_of::<Ctrl>()) as u64,
                    wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                )
            })
            .collect::<Result<_>>()?;
        let all: Vec<Ctrl> = vec![free_slot(); slots];
        ctx.queue
            .write_buffer(&scratch.ctrl, 0, bytemuck::cast_slice(&all));
        ctx.check()?;
        Ok(Batch {
            slots,
            state,
            scratch,
            graphs: HashMap::new(),
            ring,
            lanes: vec![Slot::default(); slots],
        })
    }

    /// Bytes of the batch's store and scratch on the device.
    pub fn bytes(&self) -> u64 {
        self.state.fixed_bytes() + self.state.kv_bytes() + self.scratch.bytes()
    }

    /// The lowest free slot.
    pub fn free_slot(&self) -> Option<usize> {
        self.lanes.iter().position(|s| !s.live)
    }

    /// Live slots.
    pub fn live(&self) -> usize {
        self.lanes.iter().filter(|s| s.live).count()
    }

    /// Moves the sequence in `engine`'s store (`engine.len` tokens fed) into free slot
    /// `slot`: it continues by feeding `first` and sampling at `pos` with `sampling`; a
    /// sampled id in `stop` stops it.
    pub fn join(
        &mut self,
        engine: &Engine,
        slot: usize,
        first: u32,
        pos: u64,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<()> {
        if self.lanes.get(slot).is_none_or(|s| s.live) {
            return Err(Error::Gpu(format!("batch slot {slot} is not free")));
        }
        if first as usize >= engine.config.vocab_size {
            return Err(Error::InvalidInput(format!(
                "token id {first} is outside the vocabulary (size {})",
                engine.config.vocab_size
            )));
        }
        let ctrl = Ctrl::sequence(first, pos, engine.len, sampling, stop)?;
        let ctx = engine.ctx();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        self.state
            .copy_slot(&mut enc, &engine.state, slot, engine.len, true)?;
        ctx.queue.submit([enc.finish()]);
        ctx.queue.write_buffer(
            &self.scratch.ctrl,
            (slot * std::mem::size_of::<Ctrl>()) as u64,
            bytemuck::bytes_of(&ctrl),
        );
        self.lanes[slot] = Slot {
            live: true,
            ended: false,
            greedy: sampling.is_greedy(),
            len: engine.len as u32,
        };
        ctx.check()
    }

    /// Stops slot `slot` (its later steps change nothing) and frees it; with `take`, its
    /// state first goes back into `engine`'s store (`engine.len` set to its length). Call
    /// between `step`s, when nothing is in flight.
    pub fn leave(&mut self, engine: &mut Engine, slot: usize, take: bool) -> Result<()> {
        let Some(s) = self.lanes.get(slot).copied().filter(|s| s.live) else {
            return Err(Error::Gpu(format!("batch slot {slot} holds no sequence")));
        };
        let ctx = engine.ctx().clone();
        // Stopped, and with no rows: as a new batch's slot.
        ctx.queue.write_buffer(
            &self.scratch.ctrl,
            (slot * std::mem::size_of::<Ctrl>()) as u64,
            bytemuck::bytes_of(&free_slot()),
        );
        if take {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            self.state
                .copy_slot(&mut enc, &engine.state, slot, s.len as usize, false)?;
            ctx.queue.submit([enc.finish()]);
            engine.len = s.len as usize;
        }
        self.lanes[slot] = Slot::default();
        ctx.check()
    }

    /// Tokens in slot `slot`'s state (as last read back).
    pub fn len(&self, slot: usize) -> usize {
        self.lanes.get(slot).map_or(0, |s| s.len as usize)
    }

    /// Stops slot `slot` before the next step (it stays taken until `leave`).
    pub fn stop(&mut self, engine: &Engine, slot: usize) {
        if self.lanes.get(slot).is_some_and(|s| s.live && !s.ended) {
            self.stop_lane(engine.ctx(), slot);
        }
    }

    /// Sets a lane's `stopped` word (applied before the next submit's work).
    fn stop_lane(&mut self, ctx: &crate::gpu::context::GpuContext, slot: usize) {
        let at = slot * std::mem::size_of::<Ctrl>() + std::mem::offset_of!(Ctrl, stopped);
        ctx.queue
            .write_buffer(&self.scratch.ctrl, at as u64, bytemuck::bytes_of(&1u32));
        self.lanes[slot].ended = true;
    }

    /// Builds every graph a step may take (each power-of-two lane count, greedy, sampled
    /// and mixed), so no request waits for their pipelines to compile: a server calls it
    /// at start.
    pub fn prepare(&mut self, engine: &Engine) -> Result<()> {
        let mut n = 1;
        loop {
            for tail in [Tail::Greedy, Tail::Sample, Tail::Mixed] {
                self.graph(engine, n, tail)?;
            }
            if n >= self.slots {
                return Ok(());
            }
            n = lanes_for(n + 1, self.slots);
        }
    }

    /// The graph of `n` lanes with `tail`, built on first use.
    fn graph(&mut self, engine: &Engine, n: usize, tail: Tail) -> Result<&Graph> {
        if !self.graphs.contains_key(&(n, tail)) {
            let b = BlockCtx {
                k: &engine.kernels,
                c: &engine.config,
                format: engine.format,
                layout: &engine.layout,
                s: &self.scratch,
                state: &self.state,
                lanes: Lanes::new(n, self.slots),
            };
            let g = blocks::decode_graph(&b, &engine.weights, true, tail)?;
            engine.ctx().check()?;
            self.graphs.insert((n, tail), g);
        }
        Ok(&self.graphs[&(n, tail)])
    }

    /// Up to `steps` steps of every live lane, pipelined. `on_token(slot, ctrl)` sees each
    /// token a lane samples, in order (a stop token too; `ctrl.nonfinite` set when its
    /// logits held a NaN or ±Inf), and returns false to stop the lane. Steps already in
    /// flight when a lane stops still feed it: their tokens come to `on_token` as well
    /// (its state holds them). Returns when the steps are done or no lane runs.
    pub fn step(
        &mut self,
        engine: &Engine,
        steps: usize,
        on_token: &mut dyn FnMut(usize, &Ctrl) -> bool,
    ) -> Result<()> {
        self.step_while(engine, steps, on_token, &mut || true)
    }

    /// `step`, asking `more` before submitting each step after the first: false submits
    /// no more (the steps in flight still finish and report). A server ends a round of
    /// steps early this way when a new request can join.
    pub fn step_while(
        &mut self,
        engine: &Engine,
        steps: usize,
        on_token: &mut dyn FnMut(usize, &Ctrl) -> bool,
        more: &mut dyn FnMut() -> bool,
    ) -> Result<()> {
        let ctx = engine.ctx().clone();
        let size = std::mem::size_of::<Ctrl>();
        let mut inflight: VecDeque<(usize, usize, wgpu::SubmissionIndex, MapResult)> =
            VecDeque::new();
        let mut submitted = 0;
        let mut steps = steps;
        loop {
            let running: Vec<usize> = (0..self.slots)
                .filter(|&i| self.lanes[i].live && !self.lanes[i].ended)
                .collect();
            if submitted > 0 && submitted < steps && inflight.len() < RING && !more() {
                steps = submitted;
            }
            if submitted < steps && !running.is_empty() && inflight.len() < RING {
                let n = lanes_for(running.last().map_or(1, |&i| i + 1), self.slots);
                let greedy = running.iter().filter(|&&i| self.lanes[i].greedy).count();
                let tail = match greedy {
                    g if g == running.len() => Tail::Greedy,
                    0 => Tail::Sample,
                    _ => Tail::Mixed,
                };
                let ring = submitted % RING;
                let rows = self.rows_after(inflight.len());
                let mut enc = ctx.device.create_command_encoder(&Default::default());
                {
                    let graph = match self.graph(engine, n, tail) {
                        Ok(graph) => graph,
                        Err(e) => return Err(self.settle(&ctx, inflight, e)),
                    };
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    graph.record(&mut pass, None, Some(rows));
                }
                enc.copy_buffer_to_buffer(
                    &self.scratch.ctrl,
                    0,
                    &self.ring[ring],
                    0,
                    Some((n * size) as u64),
                );
                let index = ctx.queue.submit([enc.finish()]);
                let (tx, rx) = mpsc::channel();
                self.ring[ring].map_async(wgpu::MapMode::Read, ..(n * size) as u64, move |r| {
                    let _ = tx.send(r);
                });
                inflight.push_back((ring, n, index, rx));
                submitted += 1;
                continue;
            }
            let Some((ring, n, index, rx)) = inflight.pop_front() else {
                break;
            };
            let waited = ctx
                .device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index),
                    timeout: None,
                })
                .map_err(|e| Error::Gpu(format!("waiting for a batch step: {e}")))
                .and_then(|_| crate::gpu::backend::recv(rx));
            if let Err(e) = waited {
                return Err(self.settle(&ctx, inflight, e));
            }
            // Mapped from here: unmapped whatever the read gives.
            let ctrls = self.ring[ring]
                .get_mapped_range(..(n * size) as u64)
                .map(|view| {
                    view.chunks_exact(size)
                        .map(bytemuck::pod_read_unaligned::<Ctrl>)
                        .collect::<Vec<Ctrl>>()
                })
                .map_err(|e| Error::Gpu(format!("batch readback: {e}")));
            self.ring[ring].unmap();
            let ctrls = match ctrls {
                Ok(c) => c,
                Err(e) => return Err(self.settle(&ctx, inflight, e)),
            };
            for (i, c) in ctrls.iter().enumerate() {
                let lane = &mut self.lanes[i];
                // A step that fed the lane moved its length on (a stopped one did not).
                if !lane.live || c.kv_len <= lane.len {
                    continue;
                }
                lane.len = c.kv_len;
                let was_ended = lane.ended;
                if c.stopped != 0 {
                    lane.ended = true;
                }
                let go = on_token(i, c);
                if !go && !was_ended && c.stopped == 0 {
                    self.stop_lane(&ctx, i);
                }
            }
        }
        ctx.check()
    }

    /// After `err` ended a step loop with steps still in flight: waits for them and
    /// unmaps their ring buffers (`settle_ring`); returns `err`.
    fn settle(
        &self,
        ctx: &crate::gpu::context::GpuContext,
        inflight: VecDeque<(usize, usize, wgpu::SubmissionIndex, MapResult)>,
        err: Error,
    ) -> Error {
        let pending = inflight
            .into_iter()
            .map(|(ring, _, index, rx)| (ring, index, rx));
        crate::gpu::backend::settle_ring(&ctx.device, &self.ring, pending);
        err
    }

    /// The most KV cache rows any lane has in use after the next step, with `ahead` steps
    /// already in flight (an upper bound: a stopped step adds none). Every live lane counts,
    /// the stopped ones too: a step runs the attention of each lane it spans, and the
    /// decode attention's grid is sized by this (a free slot has none: `leave`).
    fn rows_after(&self, ahead: usize) -> u32 {
        let longest = self
            .lanes
            .iter()
            .filter(|s| s.live)
            .map(|s| s.len)
            .max()
            .unwrap_or(0);
        longest + ahead as u32 + 1
    }

    /// One step of the live lanes with kernel timestamps (the step counts like any other:
    /// its tokens are sampled and fed but not reported). None without timestamp queries.
    pub fn profile_step(
        &mut self,
        engine: &Engine,
    ) -> Result<Option<Vec<crate::gpu::profiler::KernelTime>>> {
        let running: Vec<usize> = (0..self.slots)
            .filter(|&i| self.lanes[i].live && !self.lanes[i].ended)
            .collect();
        let Some(&last) = running.last() else {
            return Ok(None);
        };
        let greedy = running.iter().all(|&i| self.lanes[i].greedy);
        let tail = if greedy { Tail::Greedy } else { Tail::Mixed };
        let ctx = engine.ctx().clone();
        let graph = self
            .graph(engine, lanes_for(last + 1, self.slots), tail)?
            .clone();
        let Some(profiler) = crate::gpu::profiler::Profiler::new(&ctx, graph.len())? else {
            return Ok(None);
        };
        let rows = self.rows_after(0);
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        profiler.record(&mut enc, &graph, Some(rows))?;
        ctx.queue.submit([enc.finish()]);
        let times = profiler.read(&ctx, &graph)?;
        // The lanes moved on by one token: their lengths as the device has them.
        let ctrls = ctx.read(
            &self.scratch.ctrl,
            (self.slots * std::mem::size_of::<Ctrl>()) as u64,
        )?;
        for (i, c) in ctrls.chunks_exact(std::mem::size_of::<Ctrl>()).enumerate() {
            let c: Ctrl = bytemuck::pod_read_unaligned(c);
            if self.lanes[i].live {
                self.lanes[i].len = c.kv_len;
            }
        }
        Ok(Some(times))
    }

    /// Lane `slot`'s logits from the last step (a blocking read, for tests).
    pub fn logits(&self, engine: &Engine, slot: usize) -> Result<Vec<f32>> {
        let v = engine.config.vocab_size;
        let all = engine
            .ctx()
            .read_f32(&self.scratch.logits, (slot + 1) * v)?;
        Ok(all[slot * v..].to_vec())
    }
}
