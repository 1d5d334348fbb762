//! The state store: what one sequence carries from token to token, typed per block —
//! Mamba2 layers a conv state `[conv_dim][K−1]` (oldest column first) and an SSM state
//! `[H][P][N]`, both of fixed size; attention layers their K and V rows `[len][Hkv][hd]`,
//! growing with the position; MLP layers nothing. The CPU reference keeps it in this form,
//! the GPU engine reads and writes its device buffers as it (`read_state`/`write_state`),
//! and the session, the chat, the UI's state view and snapshots all go through it.

use crate::config::{BlockKind, ModelConfig};
use crate::error::{Error, Result};

/// One layer's part of a sequence's state.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState<T> {
    Mamba2 {
        conv: Vec<T>,
        ssm: Vec<T>,
    },
    /// The cached keys and values of every token so far, `[len][Hkv][hd]` each.
    Attention {
        k: Vec<T>,
        v: Vec<T>,
    },
    Stateless,
}

/// The state of one sequence: a `LayerState` per layer and the number of tokens fed.
#[derive(Clone, Debug, PartialEq)]
pub struct State<T> {
    pub layers: Vec<LayerState<T>>,
    /// Tokens fed so far (the rows in every KV cache).
    pub len: usize,
}

impl<T: Copy + Default> State<T> {
    /// The state of a fresh sequence: zeros, empty caches.
    pub fn new(c: &ModelConfig) -> Self {
        let layers = c
            .blocks
            .iter()
            .map(|k| match k {
                BlockKind::Mamba2 => LayerState::Mamba2 {
                    conv: vec![T::default(); c.conv_state_len()],
                    ssm: vec![T::default(); c.ssm_state_len()],
                },
                BlockKind::Attention => LayerState::Attention {
                    k: Vec::new(),
                    v: Vec::new(),
                },
                BlockKind::Mlp => LayerState::Stateless,
            })
            .collect();
        State { layers, len: 0 }
    }

    /// `(layer, conv, ssm)` of every Mamba2 layer.
    pub fn mamba_layers(&self) -> impl Iterator<Item = (usize, &[T], &[T])> {
        self.layers.iter().enumerate().filter_map(|(i, l)| match l {
            LayerState::Mamba2 { conv, ssm } => Some((i, conv.as_slice(), ssm.as_slice())),
            _ => None,
        })
    }

    /// The conv and SSM state of Mamba2 layer `layer` (None for other blocks).
    pub fn mamba_mut(&mut self, layer: usize) -> Option<(&mut Vec<T>, &mut Vec<T>)> {
        match self.layers.get_mut(layer)? {
            LayerState::Mamba2 { conv, ssm } => Some((conv, ssm)),
            _ => None,
        }
    }

    /// Every value the state holds, layer by layer (conv, SSM, K, V): for comparisons.
    pub fn values(&self) -> Vec<T> {
        let mut out = Vec::new();
        for l in &self.layers {
            match l {
                LayerState::Mamba2 { conv, ssm } => {
                    out.extend_from_slice(conv);
                    out.extend_from_slice(ssm);
                }
                LayerState::Attention { k, v } => {
                    out.extend_from_slice(k);
                    out.extend_from_slice(v);
                }
                LayerState::Stateless => {}
            }
        }
        out
    }

    /// `(layer, k, v)` of every attention layer.
    pub fn kv_layers(&self) -> impl Iterator<Item = (usize, &[T], &[T])> {
        self.layers.iter().enumerate().filter_map(|(i, l)| match l {
            LayerState::Attention { k, v } => Some((i, k.as_slice(), v.as_slice())),
            _ => None,
        })
    }

    /// Checks that the state has `c`'s layers and sizes (one cached row per token fed).
    pub fn check(&self, c: &ModelConfig) -> Result<()> {
        if self.layers.len() != c.n_layer {
            return Err(Error::InvalidInput(format!(
                "the state has {} layers, the model {}",
                self.layers.len(),
                c.n_layer
            )));
        }
        let kv_row = c.attention.as_ref().map_or(0, |a| a.kv_width());
        for (i, (l, kind)) in self.layers.iter().zip(&c.blocks).enumerate() {
            let ok = match (l, kind) {
                (LayerState::Mamba2 { conv, ssm }, BlockKind::Mamba2) => {
                    conv.len() == c.conv_state_len() && ssm.len() == c.ssm_state_len()
                }
                (LayerState::Attention { k, v }, BlockKind::Attention) => {
                    k.len() == self.len * kv_row && v.len() == k.len()
                }
                (LayerState::Stateless, BlockKind::Mlp) => true,
                _ => false,
            };
            if !ok {
                return Err(Error::InvalidInput(format!(
                    "the state of layer {i} does not fit its {} block",
                    kind.name()
                )));
            }
        }
        Ok(())
    }

    /// Bytes this state holds at `elem` bytes per value.
    pub fn bytes(&self, elem: usize) -> usize {
        let values: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Mamba2 { conv, ssm } => conv.len() + ssm.len(),
                LayerState::Attention { k, v } => k.len() + v.len(),
                LayerState::Stateless => 0,
            })
            .sum();
        values * elem
    }
}

/// Bytes of state one sequence needs on a device with KV caches of `ctx` rows in
/// `kv_elem`-byte values: the fixed Mamba2 part (f32) plus the caches.
pub fn sequence_bytes(c: &ModelConfig, ctx: usize, kv_elem: usize) -> u64 {
    c.state_bytes() as u64 + (ctx as u64) * c.kv_bytes_per_token(kv_elem) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::tiny_hybrid;

    #[test]
    fn typed_per_block_and_checked() {
        let c = tiny_hybrid("M*-M", 2);
        let mut s = State::<f32>::new(&c);
        assert_eq!(
            s.mamba_layers().map(|(i, ..)| i).collect::<Vec<_>>(),
            [0, 3]
        );
        assert_eq!(s.kv_layers().count(), 1);
        s.check(&c).unwrap();
        s.len = 1;
        let e = s.check(&c).unwrap_err().to_string();
        assert!(
            e.contains("layer 1 does not fit its attention block"),
            "{e}"
        );
        if let LayerState::Attention { k, v } = &mut s.layers[1] {
            k.resize(16, 0.0);
            v.resize(16, 0.0);
        }
        s.check(&c).unwrap();
        assert_eq!(
            s.bytes(4),
            4 * (2 * (c.conv_state_len() + c.ssm_state_len()) + 32)
        );
    }
}
