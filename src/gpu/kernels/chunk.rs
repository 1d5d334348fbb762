//! Sizes shared by the chunked-SSD prefill kernels (`ssd_cumsum`, `ssd_cb`,
//! `ssd_chunk_state`, `ssd_state_pass`, `ssd_chunk_scan`, `prefill_conv`).
//! Buffer shapes for a block of up to `max_tokens` tokens in chunks of `q`:
//! `mix [T][d_in_proj]`, `lam [NC][H][Q]`, `cb [NC][G][Q][Q]`, `cst [NC][H][P][N]`,
//! `y [T][d_inner]` with NC = ceil(max_tokens / q).

use crate::gpu::shader::Const;

#[derive(Clone, Copy, Debug)]
pub struct ChunkConsts {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub d_state: usize,
    pub d_inner: usize,
    pub conv_dim: usize,
    pub d_in_proj: usize,
    /// Chunk length Q.
    pub q: usize,
    /// Tokens per block (the buffers' capacity).
    pub max_tokens: usize,
    /// Whether the conv's output `u [T][conv_dim]` is stored in f16 (`prefill_conv::u_in_f16`
    /// says when): then only the SSD kernels on cooperative matrices read it.
    pub u_f16: bool,
}

impl ChunkConsts {
    /// The 4-byte words of `u` for a full block.
    pub fn u_words(&self) -> usize {
        let values = self.max_tokens * self.conv_dim;
        if self.u_f16 {
            values.div_ceil(2)
        } else {
            values
        }
    }

    /// Values of `cst [NC][H][P][N]` (the chunk states, then the states entering the chunks).
    pub fn states_len(&self) -> usize {
        self.chunks() * self.heads * self.head_dim * self.d_state
    }

    /// The 4-byte words of the entering states in f16 (`cst16`: two halves a word).
    pub fn states_f16_words(&self) -> usize {
        self.states_len().div_ceil(2)
    }

    /// Adds the U16 flag of the kernels that read `u` where it is f16.
    pub fn u_flag(&self, flags: &mut Vec<&'static str>) {
        if self.u_f16 {
            flags.push("U16");
        }
    }

    /// An error for a kernel that reads `u` only in f32, where it is f16.
    pub fn require_u_f32(&self, name: &str) -> crate::error::Result<()> {
        if self.u_f16 {
            return Err(crate::error::Error::Gpu(format!(
                "{name}: u is in f16, which only the SSD kernels on cooperative matrices read"
            )));
        }
        Ok(())
    }

    /// Chunks of a full block.
    pub fn chunks(&self) -> usize {
        self.max_tokens.div_ceil(self.q)
    }

    pub fn consts(&self) -> Vec<(&'static str, Const)> {
        let u = |v: usize| Const::U32(v as u32);
        vec![
            ("H", u(self.heads)),
            ("P", u(self.head_dim)),
            ("G", u(self.groups)),
            ("N", u(self.d_state)),
            ("DI", u(self.d_inner)),
            ("CD", u(self.conv_dim)),
            ("DIP", u(self.d_in_proj)),
            ("Q", u(self.q)),
        ]
    }
}
