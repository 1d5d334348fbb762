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
                BlockKind::Mlp | BlockKind::Moe => LayerState::Stateless,
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
                (LayerState::Stateless, BlockKind::Mlp | BlockKind::Moe) => true,
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

    /// The same state with every value converted by `f` (e.g. to f16 and back).
    pub fn map<U>(&self, f: impl Fn(T) -> U) -> State<U> {
        let v = |x: &[T]| x.iter().map(|&a| f(a)).collect::<Vec<U>>();
        State {
            layers: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Mamba2 { conv, ssm } => LayerState::Mamba2 {
                        conv: v(conv),
                        ssm: v(ssm),
                    },
                    LayerState::Attention { k, v: vv } => {
                        LayerState::Attention { k: v(k), v: v(vv) }
                    }
                    LayerState::Stateless => LayerState::Stateless,
                })
                .collect(),
            len: self.len,
        }
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

/// Where a state holds its first NaN or ±Inf (see `State::first_nonfinite`).
#[derive(Clone, Debug, PartialEq)]
pub struct NonFinite {
    pub layer: usize,
    /// "conv", "ssm", "K" or "V".
    pub part: &'static str,
    /// The element within that part.
    pub index: usize,
    pub value: f64,
}

impl<T: Copy + Into<f64>> State<T> {
    /// The first non-finite value, in layer order (conv before SSM, K before V). A NaN or
    /// Inf in a token's activations reaches the state of every later stateful layer, so the
    /// first layer holding one is where the fault entered the recurrent state.
    pub fn first_nonfinite(&self) -> Option<NonFinite> {
        self.layers.iter().enumerate().find_map(|(layer, l)| {
            let parts: [(&'static str, &[T]); 2] = match l {
                LayerState::Mamba2 { conv, ssm } => [("conv", conv), ("ssm", ssm)],
                LayerState::Attention { k, v } => [("K", k), ("V", v)],
                LayerState::Stateless => return None,
            };
            parts.into_iter().find_map(|(part, values)| {
                let index = values.iter().position(|&v| !v.into().is_finite())?;
                Some(NonFinite {
                    layer,
                    part,
                    index,
                    value: values[index].into(),
                })
            })
        })
    }

    /// The error for non-finite logits (NaN or ±Inf) at token position `pos`, naming the
    /// layer at fault as far as this state (read after them) tells: the first layer whose
    /// state is non-finite, or the output of a layer before it since the last finite state;
    /// with every state finite, a layer after the last stateful one, the final norm or the
    /// head. One wording for every device.
    pub fn nonfinite_logits_error(&self, pos: u64) -> Error {
        let stateless = |i: usize| matches!(self.layers[i], LayerState::Stateless);
        // What lies between the last stateful layer before `end` and `end`: that layer's
        // output and the stateless (MLP) layers after it.
        let upstream = |end: usize| -> Vec<String> {
            let mut out = Vec::new();
            let first_mlp = (0..end).rev().find(|&i| !stateless(i)).map_or(0, |i| i + 1);
            if first_mlp < end {
                out.push(if first_mlp + 1 == end {
                    format!("the MLP layer {first_mlp}")
                } else {
                    format!("the MLP layers {first_mlp}–{}", end - 1)
                });
            }
            if let Some(p) = first_mlp.checked_sub(1) {
                out.push(format!("layer {p}'s output"));
            }
            out
        };
        let why = match self.first_nonfinite() {
            Some(b) => {
                let kind = match self.layers[b.layer] {
                    LayerState::Mamba2 { .. } => "mamba2",
                    _ => "attention",
                };
                let mut culprits = vec![format!("layer {}", b.layer)];
                culprits.extend(upstream(b.layer));
                format!(
                    "layer {} ({kind}) is the first whose state is not finite ({} element {} \
                     is {}), so the fault lies in {}",
                    b.layer,
                    b.part,
                    b.index,
                    b.value,
                    one_of(&culprits)
                )
            }
            None => {
                let mut culprits = upstream(self.layers.len());
                culprits.reverse();
                culprits.extend(["the final norm".into(), "the head".into()]);
                format!(
                    "every layer's state is finite, so the fault lies in {}",
                    one_of(&culprits)
                )
            }
        };
        Error::NonFinite(format!(
            "non-finite logits (NaN or ±Inf) at position {pos}: {why}"
        ))
    }
}

/// "a", "a or b", "a, b or c".
fn one_of(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [a] => a.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
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

    #[test]
    fn the_first_nonfinite_value_and_the_layers_it_blames() {
        let c = tiny_hybrid("M*-M", 2);
        let mut s = State::<f32>::new(&c);
        assert_eq!(s.first_nonfinite(), None);
        let e = s.nonfinite_logits_error(4).to_string();
        assert!(
            e.ends_with(
                "at position 4: every layer's state is finite, so the fault lies in layer 3's \
                 output, the final norm or the head"
            ),
            "{e}"
        );
        s.mamba_mut(3).unwrap().1[7] = f32::INFINITY;
        s.mamba_mut(3).unwrap().0[2] = f32::NAN;
        let b = s.first_nonfinite().unwrap();
        assert_eq!((b.layer, b.part, b.index), (3, "conv", 2));
        assert!(b.value.is_nan());
        let e = s.nonfinite_logits_error(9).to_string();
        assert!(
            e.ends_with(
                "layer 3 (mamba2) is the first whose state is not finite (conv element 2 is \
                 NaN), so the fault lies in layer 3, the MLP layer 2 or layer 1's output"
            ),
            "{e}"
        );
        if let LayerState::Attention { k, v } = &mut s.layers[1] {
            k.resize(16, 0.0);
            v.resize(16, f32::NEG_INFINITY);
        }
        let b = s.first_nonfinite().unwrap();
        assert_eq!(
            (b.layer, b.part, b.index, b.value),
            (1, "V", 0, f64::NEG_INFINITY)
        );
        assert_eq!(one_of(&["a".into(), "b".into(), "c".into()]), "a, b or c");
    }
}
