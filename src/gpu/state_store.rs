//! The state store on the device: per layer, a Mamba2 layer's conv `[conv_dim][K−1]` and
//! SSM `[H][P][N]` state (f32), an attention layer's K and V caches `[ctx][Hkv][hd]`
//! (f16 by default, f32 on request) sized at load for `ctx` tokens. It reads and writes
//! itself as `state::State` (the CPU reference's form), and snapshots on the device copy the
//! fixed part plus the KV prefix in use. An engine's store holds one sequence; a batch's
//! holds `slots` side by side in the same buffers (slot s at s times one sequence's size),
//! which the batched decode kernels index by lane.

use crate::config::{BlockKind, ModelConfig};
use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::state::{LayerState, State};

/// How the KV caches store their values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// Two f16 per u32 (the default: half the memory and bandwidth).
    F16,
    F32,
}

impl KvFormat {
    pub fn bytes(self) -> usize {
        match self {
            KvFormat::F16 => 2,
            KvFormat::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F16 => "f16",
            KvFormat::F32 => "f32",
        }
    }
}

impl std::str::FromStr for KvFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f16" => Ok(KvFormat::F16),
            "f32" => Ok(KvFormat::F32),
            _ => Err(format!("`{s}`: expected f16 or f32")),
        }
    }
}

/// One layer's state buffers.
pub enum DeviceLayerState {
    Mamba2 {
        conv: wgpu::Buffer,
        ssm: wgpu::Buffer,
    },
    Attention {
        k: wgpu::Buffer,
        v: wgpu::Buffer,
    },
    Stateless,
}

/// A sequence's state on the device.
pub struct DeviceState {
    pub layers: Vec<DeviceLayerState>,
    /// Rows each KV cache holds.
    pub ctx: usize,
    pub kv: KvFormat,
    /// Values of one cached row, `Hkv·hd`.
    kv_width: usize,
    /// Sequences held side by side in every buffer (1 but in a batch's store).
    pub slots: usize,
}

/// A copy of a sequence's state kept on the device: the buffers in use, and the length.
pub struct DeviceSnapshot {
    buffers: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    pub len: usize,
    /// The KV caches' format it was taken in (its bytes are that format's).
    kv: KvFormat,
}

impl DeviceState {
    /// Zeroed state for `c` with KV caches of `ctx` rows.
    pub fn new(gpu: &GpuContext, c: &ModelConfig, ctx: usize, kv: KvFormat) -> Result<Self> {
        Self::with_slots(gpu, c, ctx, kv, 1)
    }

    /// Zeroed state of `slots` sequences side by side (slot s's part of each buffer starts
    /// at s times one sequence's size): the store a batch decodes from. Fails, naming the
    /// sizes, when a buffer would exceed what the adapter binds.
    pub fn with_slots(
        gpu: &GpuContext,
        c: &ModelConfig,
        ctx: usize,
        kv: KvFormat,
        slots: usize,
    ) -> Result<Self> {
        let slots = slots.max(1);
        let max = gpu.limits.max_storage_buffer_binding_size;
        let f32s = |n: usize| -> Result<u64> {
            let b = (4 * n as u64)
                .checked_mul(slots as u64)
                .filter(|&b| slots == 1 || b <= max)
                .ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "{slots} sequence slots of {} MiB state per layer exceed the {} MiB \
                         the adapter binds per buffer: use fewer slots",
                        (4 * n) >> 20,
                        max >> 20
                    ))
                })?;
            Ok(b)
        };
        let kv_width = c.attention.as_ref().map_or(0, |a| a.kv_width());
        let kv_bytes = (ctx as u64)
            .checked_mul((kv_width * kv.bytes()) as u64)
            .ok_or_else(|| Error::InvalidInput(format!("a {ctx}-token KV cache overflows")))?
            .next_multiple_of(4);
        if slots > 1 && kv_bytes.saturating_mul(slots as u64) > max {
            return Err(Error::InvalidInput(format!(
                "{slots} sequence slots of a {ctx}-token KV cache ({} MiB each) exceed the {} \
                         MiB the adapter binds per buffer: use fewer slots or a smaller --ctx",
                kv_bytes >> 20,
                max >> 20
            )));
        }
        let kv_bytes = kv_bytes * slots as u64;
        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, kind) in c.blocks.iter().enumerate() {
            layers.push(match kind {
                BlockKind::Mamba2 => DeviceLayerState::Mamba2 {
                    conv: gpu.storage_zeroed(
                        &format!("layers.{i}.conv_state"),
                        f32s(c.conv_state_len())?,
                    )?,
                    ssm: gpu.storage_zeroed(
                        &format!("layers.{i}.ssm_state"),
                        f32s(c.ssm_state_len())?,
                    )?,
                },
                BlockKind::Attention => DeviceLayerState::Attention {
                    k: gpu.storage_zeroed(&format!("layers.{i}.k_cache"), kv_bytes)?,
                    v: gpu.storage_zeroed(&format!("layers.{i}.v_cache"), kv_bytes)?,
                },
                BlockKind::Mlp | BlockKind::Moe => DeviceLayerState::Stateless,
            });
        }
        Ok(DeviceState {
            layers,
            ctx,
            kv,
            kv_width,
            slots,
        })
    }

    /// Whether any layer keeps a KV cache (the context limits the length only then).
    fn has_kv(&self) -> bool {
        self.kv_width > 0
            && self
                .layers
                .iter()
                .any(|l| matches!(l, DeviceLayerState::Attention { .. }))
    }

    /// Bytes of the first `len` rows of a KV cache.
    fn kv_prefix(&self, len: usize) -> u64 {
        ((len * self.kv_width * self.kv.bytes()) as u64).next_multiple_of(4)
    }

    /// Bytes in use of each buffer of a layer's pair for a sequence of `len` tokens: all of
    /// a Mamba2 layer's, the first `len` rows of the KV caches.
    fn in_use(&self, layer: &DeviceLayerState, len: usize) -> (u64, u64) {
        match layer {
            DeviceLayerState::Mamba2 { conv, ssm } => (conv.size(), ssm.size()),
            DeviceLayerState::Attention { .. } => (self.kv_prefix(len), self.kv_prefix(len)),
            DeviceLayerState::Stateless => (0, 0),
        }
    }

    /// Zeroes every buffer (a fresh sequence).
    pub fn reset(&self, gpu: &GpuContext) -> Result<()> {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for (a, b) in self.layers.iter().filter_map(pair) {
            enc.clear_buffer(a, 0, None);
            enc.clear_buffer(b, 0, None);
        }
        gpu.queue.submit([enc.finish()]);
        gpu.check()
    }

    /// The conv and SSM state buffers of every Mamba2 layer, in layer order (for readers
    /// that copy the state out asynchronously, like the inspector's state tap).
    pub fn mamba_buffers(&self) -> Vec<(wgpu::Buffer, wgpu::Buffer)> {
        self.layers
            .iter()
            .filter_map(|l| match l {
                DeviceLayerState::Mamba2 { conv, ssm } => Some((conv.clone(), ssm.clone())),
                _ => None,
            })
            .collect()
    }

    /// Bytes of the fixed part (Mamba2 layers).
    pub fn fixed_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| match l {
                DeviceLayerState::Mamba2 { conv, ssm } => conv.size() + ssm.size(),
                _ => 0,
            })
            .sum()
    }

    /// Bytes of the KV caches at full capacity.
    pub fn kv_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| match l {
                DeviceLayerState::Attention { k, v } => k.size() + v.size(),
                _ => 0,
            })
            .sum()
    }

    /// The state of a sequence of `len` tokens as the CPU reference lays it out (blocking
    /// reads; not for the hot path).
    pub fn read(&self, gpu: &GpuContext, c: &ModelConfig, len: usize) -> Result<State<f32>> {
        self.read_pairs(gpu, c, len, self.layers.iter().map(pair))
    }

    /// A device snapshot of this state, read as the CPU reference lays it out (blocking;
    /// the prefix cache moves entries to host memory with it).
    pub fn read_snapshot(
        &self,
        gpu: &GpuContext,
        c: &ModelConfig,
        s: &DeviceSnapshot,
    ) -> Result<State<f32>> {
        if s.buffers.len() != self.layers.len() {
            return Err(Error::InvalidInput(
                "snapshot belongs to another model".into(),
            ));
        }
        let pairs = s.buffers.iter().map(|b| b.as_ref().map(|(a, b)| (a, b)));
        self.read_pairs(gpu, c, s.len, pairs)
    }

    /// Reads each layer's buffer pair (this state's, or a snapshot's of the same layout).
    fn read_pairs<'a>(
        &self,
        gpu: &GpuContext,
        c: &ModelConfig,
        len: usize,
        pairs: impl Iterator<Item = Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>>,
    ) -> Result<State<f32>> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, p) in self.layers.iter().zip(pairs) {
            layers.push(match (l, p) {
                (DeviceLayerState::Mamba2 { .. }, Some((conv, ssm))) => LayerState::Mamba2 {
                    conv: gpu.read_f32(conv, c.conv_state_len())?,
                    ssm: gpu.read_f32(ssm, c.ssm_state_len())?,
                },
                (DeviceLayerState::Attention { .. }, Some((k, v))) => LayerState::Attention {
                    k: self.read_kv(gpu, k, len)?,
                    v: self.read_kv(gpu, v, len)?,
                },
                _ => LayerState::Stateless,
            });
        }
        Ok(State { layers, len })
    }

    /// Bytes a snapshot of a `len`-token sequence holds on the device.
    pub fn snapshot_bytes(&self, len: usize) -> u64 {
        self.layers
            .iter()
            .map(|l| {
                let (a, b) = self.in_use(l, len);
                a + b
            })
            .sum()
    }

    fn read_kv(&self, gpu: &GpuContext, b: &wgpu::Buffer, len: usize) -> Result<Vec<f32>> {
        let n = len * self.kv_width;
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(match self.kv {
            KvFormat::F32 => gpu.read_f32(b, n)?,
            KvFormat::F16 => {
                let bytes = gpu.read(b, 2 * n as u64)?;
                bytemuck::cast_slice::<u8, u16>(&bytes[..2 * n])
                    .iter()
                    .map(|&h| half::f16::from_bits(h).to_f32())
                    .collect()
            }
        })
    }

    /// Replaces the state (e.g. to continue from a CPU-computed one).
    pub fn write(&self, gpu: &GpuContext, c: &ModelConfig, st: &State<f32>) -> Result<()> {
        st.check(c)?;
        if self.has_kv() && st.len > self.ctx {
            return Err(Error::InvalidInput(format!(
                "the state holds {} tokens, more than the {}-token context",
                st.len, self.ctx
            )));
        }
        let put = |b: &wgpu::Buffer, v: &[f32]| {
            if v.is_empty() {
                return;
            }
            match self.kv {
                KvFormat::F32 => gpu.queue.write_buffer(b, 0, bytemuck::cast_slice(v)),
                KvFormat::F16 => {
                    let mut h: Vec<u16> = v
                        .iter()
                        .map(|&x| half::f16::from_f32(x).to_bits())
                        .collect();
                    if h.len() % 2 == 1 {
                        h.push(0);
                    }
                    gpu.queue.write_buffer(b, 0, bytemuck::cast_slice(&h));
                }
            }
        };
        for (l, s) in self.layers.iter().zip(&st.layers) {
            match (l, s) {
                (
                    DeviceLayerState::Mamba2 { conv, ssm },
                    LayerState::Mamba2 { conv: c0, ssm: s0 },
                ) => {
                    gpu.queue.write_buffer(conv, 0, bytemuck::cast_slice(c0));
                    gpu.queue.write_buffer(ssm, 0, bytemuck::cast_slice(s0));
                }
                (DeviceLayerState::Attention { k, v }, LayerState::Attention { k: k0, v: v0 }) => {
                    put(k, k0);
                    put(v, v0);
                }
                _ => {}
            }
        }
        gpu.queue.submit([]);
        gpu.check()
    }

    /// A copy of the state of a sequence of `len` tokens kept on the device.
    pub fn snapshot(&self, gpu: &GpuContext, len: usize) -> Result<DeviceSnapshot> {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        let mut buffers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let Some((a, b)) = pair(l) else {
                buffers.push(None);
                continue;
            };
            let (sa, sb) = self.in_use(l, len);
            let ca = gpu.storage_zeroed("snapshot", sa.max(4))?;
            let cb = gpu.storage_zeroed("snapshot", sb.max(4))?;
            if sa > 0 {
                enc.copy_buffer_to_buffer(a, 0, &ca, 0, Some(sa));
                enc.copy_buffer_to_buffer(b, 0, &cb, 0, Some(sb));
            }
            buffers.push(Some((ca, cb)));
        }
        gpu.queue.submit([enc.finish()]);
        gpu.check()?;
        Ok(DeviceSnapshot {
            buffers,
            len,
            kv: self.kv,
        })
    }

    /// Bytes of one slot's part of a layer's pair (the whole of a Mamba2 layer's, the
    /// full KV capacity).
    fn slot_bytes(&self, layer: &DeviceLayerState) -> (u64, u64) {
        match layer {
            DeviceLayerState::Mamba2 { conv, ssm } => (
                conv.size() / self.slots as u64,
                ssm.size() / self.slots as u64,
            ),
            DeviceLayerState::Attention { k, .. } => {
                let b = k.size() / self.slots as u64;
                (b, b)
            }
            DeviceLayerState::Stateless => (0, 0),
        }
    }

    /// Records copies of a `len`-token sequence between `one` (a one-sequence store of the
    /// same model and context) and slot `slot` of this store: into the slot with `into`,
    /// out of it otherwise. Copies the fixed part and the KV rows in use.
    pub fn copy_slot(
        &self,
        enc: &mut wgpu::CommandEncoder,
        one: &DeviceState,
        slot: usize,
        len: usize,
        into: bool,
    ) -> Result<()> {
        if slot >= self.slots
            || one.slots != 1
            || one.layers.len() != self.layers.len()
            || one.ctx != self.ctx
            || one.kv != self.kv
        {
            return Err(Error::Gpu(format!(
                "slot {slot} of {}: the stores do not match",
                self.slots
            )));
        }
        for (mine, theirs) in self.layers.iter().zip(&one.layers) {
            let (Some((a, b)), Some((oa, ob))) = (pair(mine), pair(theirs)) else {
                continue;
            };
            let (sa, sb) = self.slot_bytes(mine);
            let (ua, ub) = one.in_use(theirs, len);
            for (buf, other, stride, used) in [(a, oa, sa, ua), (b, ob, sb, ub)] {
                if used == 0 {
                    continue;
                }
                let at = slot as u64 * stride;
                if into {
                    enc.copy_buffer_to_buffer(other, 0, buf, at, Some(used));
                } else {
                    enc.copy_buffer_to_buffer(buf, at, other, 0, Some(used));
                }
            }
        }
        Ok(())
    }

    /// Puts a snapshot of this state back.
    pub fn restore(&self, gpu: &GpuContext, s: &DeviceSnapshot) -> Result<()> {
        let foreign = || {
            Error::InvalidInput("snapshot belongs to another model, context or KV format".into())
        };
        if s.buffers.len() != self.layers.len()
            || (self.has_kv() && (s.len > self.ctx || s.kv != self.kv))
        {
            return Err(foreign());
        }
        // Every layer's bytes in use must be in the snapshot (a shorter copy would leave
        // the rest of the state as it was); nothing is submitted before all are checked.
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        for (l, saved) in self.layers.iter().zip(&s.buffers) {
            match (pair(l), saved) {
                (Some((a, b)), Some((sa, sb))) => {
                    let (na, nb) = self.in_use(l, s.len);
                    if na > sa.size() || nb > sb.size() {
                        return Err(foreign());
                    }
                    if na > 0 {
                        enc.copy_buffer_to_buffer(sa, 0, a, 0, Some(na));
                        enc.copy_buffer_to_buffer(sb, 0, b, 0, Some(nb));
                    }
                }
                (None, None) => {}
                _ => return Err(foreign()),
            }
        }
        gpu.queue.submit([enc.finish()]);
        gpu.check()
    }
}

fn pair(l: &DeviceLayerState) -> Option<(&wgpu::Buffer, &wgpu::Buffer)> {
    match l {
        DeviceLayerState::Mamba2 { conv, ssm } => Some((conv, ssm)),
        DeviceLayerState::Attention { k, v } => Some((k, v)),
        DeviceLayerState::Stateless => None,
    }
}
