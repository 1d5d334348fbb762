//! The live recurrent state, summarized for the eye: one cell per (Mamba2 layer, head)
//! holding a norm of that head's P×N SSM state (RMS or max |S|), one strip per Mamba2 layer
//! for the conv state (max |x| over bins of channels), the KV occupancy of the attention
//! layers, and every NaN/Inf found, located. The summary is
//! a plain value computed from a `State<f32>` anywhere (the worker, a test), so a test can
//! inject a state with a NaN and watch the flag go up.

use egui::{Align2, Color32, FontId, Rect, RichText, Sense, Stroke, StrokeKind, Ui, pos2, vec2};

use crate::config::ModelConfig;
use crate::reference::State;

/// Which norm of a head's P×N state a heatmap cell shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StateNorm {
    /// Root mean square over the head's P·N values.
    #[default]
    Rms,
    /// Largest |S| over the head's values.
    MaxAbs,
}

impl StateNorm {
    pub fn name(self) -> &'static str {
        match self {
            StateNorm::Rms => "RMS",
            StateNorm::MaxAbs => "max |S|",
        }
    }
}

/// Where a non-finite value sits.
#[derive(Clone, Debug, PartialEq)]
pub struct BadValue {
    pub layer: usize,
    /// "ssm" or "conv".
    pub part: &'static str,
    /// The head (ssm) or channel (conv).
    pub index: usize,
    pub value: f32,
}

/// Columns of the conv-state strip (channels are binned into at most this many).
pub const CONV_BINS: usize = 128;
/// How many non-finite values are located individually.
const MAX_BAD: usize = 16;

/// A per-(layer, head) summary of a state.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSummary {
    /// Rows of the heatmaps: the Mamba2 layers.
    pub layers: usize,
    /// The model layer of each row.
    pub layer_ids: Vec<usize>,
    /// The attention layers, and the tokens their KV caches hold.
    pub kv_layers: Vec<usize>,
    pub kv_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub d_state: usize,
    pub conv_dim: usize,
    /// Columns of conv state kept per channel, `K−1`.
    pub conv_cols: usize,
    /// `[layer][head]` RMS over the finite values of the head's P×N state.
    pub rms: Vec<f32>,
    /// `[layer][head]` max |S| over the finite values.
    pub max_abs: Vec<f32>,
    /// `[layer][head]` count of NaN/Inf values.
    pub nonfinite: Vec<u32>,
    /// Channels per conv bin.
    pub conv_bin: usize,
    /// Conv bins per layer.
    pub conv_bins: usize,
    /// `[layer][bin]` max |x| over the bin's channels and columns.
    pub conv_max: Vec<f32>,
    /// `[layer][bin]` count of NaN/Inf values.
    pub conv_nonfinite: Vec<u32>,
    /// The first few non-finite values, located.
    pub bad: Vec<BadValue>,
    /// All NaN/Inf values in the state.
    pub total_nonfinite: usize,
    /// The token position the state was read at, when known.
    pub position: Option<u64>,
}

impl StateSummary {
    /// Summarizes `state` for `config`, checking its shape.
    pub fn from_state(config: &ModelConfig, state: &State<f32>) -> Result<Self, String> {
        let (heads, p, n) = (config.n_heads, config.head_dim, config.d_state);
        let conv_dim = config.conv_dim();
        let conv_cols = config.d_conv.saturating_sub(1);
        if state.layers.len() != config.n_layer {
            return Err(format!(
                "the state has {} layers; the model has {}",
                state.layers.len(),
                config.n_layer
            ));
        }
        let layer_ids: Vec<usize> = state.mamba_layers().map(|(i, ..)| i).collect();
        let layers = layer_ids.len();
        let head_len = p * n;
        let conv_bins = conv_dim.clamp(1, CONV_BINS);
        let conv_bin = conv_dim.div_ceil(conv_bins).max(1);
        let conv_bins = conv_dim.div_ceil(conv_bin).max(1);
        let mut s = StateSummary {
            layers,
            layer_ids,
            kv_layers: state.kv_layers().map(|(i, ..)| i).collect(),
            kv_len: state.len,
            heads,
            head_dim: p,
            d_state: n,
            conv_dim,
            conv_cols,
            rms: vec![0.0; layers * heads],
            max_abs: vec![0.0; layers * heads],
            nonfinite: vec![0; layers * heads],
            conv_bin,
            conv_bins,
            conv_max: vec![0.0; layers * conv_bins],
            conv_nonfinite: vec![0; layers * conv_bins],
            bad: Vec::new(),
            total_nonfinite: 0,
            position: None,
        };
        for (row, (l, conv, ssm)) in state.mamba_layers().enumerate() {
            if ssm.len() != heads * head_len {
                return Err(format!(
                    "layer {l}: SSM state has {} values, expected H·P·N = {heads}·{p}·{n} = {}",
                    ssm.len(),
                    heads * head_len
                ));
            }
            if conv.len() != conv_dim * conv_cols {
                return Err(format!(
                    "layer {l}: conv state has {} values, expected conv_dim·(K−1) = {}",
                    conv.len(),
                    conv_dim * conv_cols
                ));
            }
            for h in 0..heads {
                let (mut sum, mut max, mut count, mut bad) = (0f64, 0f32, 0usize, 0u32);
                for &v in &ssm[h * head_len..(h + 1) * head_len] {
                    if v.is_finite() {
                        sum += (v as f64) * (v as f64);
                        max = max.max(v.abs());
                        count += 1;
                    } else {
                        bad += 1;
                        if s.bad.len() < MAX_BAD
                            && !s
                                .bad
                                .iter()
                                .any(|b| b.layer == l && b.part == "ssm" && b.index == h)
                        {
                            s.bad.push(BadValue {
                                layer: l,
                                part: "ssm",
                                index: h,
                                value: v,
                            });
                        }
                    }
                }
                let i = row * heads + h;
                s.rms[i] = if count > 0 {
                    (sum / count as f64).sqrt() as f32
                } else {
                    0.0
                };
                s.max_abs[i] = max;
                s.nonfinite[i] = bad;
                s.total_nonfinite += bad as usize;
            }
            for c in 0..conv_dim {
                let b = row * conv_bins + c / conv_bin;
                for &v in &conv[c * conv_cols..(c + 1) * conv_cols] {
                    if v.is_finite() {
                        s.conv_max[b] = s.conv_max[b].max(v.abs());
                    } else {
                        s.conv_nonfinite[b] += 1;
                        s.total_nonfinite += 1;
                        if s.bad.len() < MAX_BAD {
                            s.bad.push(BadValue {
                                layer: l,
                                part: "conv",
                                index: c,
                                value: v,
                            });
                        }
                    }
                }
            }
        }
        Ok(s)
    }

    pub fn with_position(mut self, position: u64) -> Self {
        self.position = Some(position);
        self
    }

    pub fn has_nonfinite(&self) -> bool {
        self.total_nonfinite > 0
    }

    /// The cell values for `norm`, `[layer][head]`.
    pub fn values(&self, norm: StateNorm) -> &[f32] {
        match norm {
            StateNorm::Rms => &self.rms,
            StateNorm::MaxAbs => &self.max_abs,
        }
    }

    /// One line naming where the non-finite values are.
    pub fn nonfinite_report(&self) -> String {
        let spots: Vec<String> = self
            .bad
            .iter()
            .map(|b| match b.part {
                "ssm" => format!("layer {} head {} ({})", b.layer, b.index, b.value),
                _ => format!("layer {} conv channel {} ({})", b.layer, b.index, b.value),
            })
            .collect();
        let more = if self.total_nonfinite > spots.len() {
            ", …"
        } else {
            ""
        };
        format!(
            "{} NaN/Inf values in the state: {}{more}",
            self.total_nonfinite,
            spots.join(", ")
        )
    }
}

/// A color scale over positive values: log-spaced between the smallest and largest finite
/// positive values present.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub lo: f32,
    pub hi: f32,
}

impl Scale {
    pub fn of(values: &[f32]) -> Self {
        let (mut lo, mut hi) = (f32::INFINITY, 0f32);
        for &v in values {
            if v.is_finite() && v > 0.0 {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        if hi.is_nan() || hi <= 0.0 {
            return Scale { lo: 0.0, hi: 0.0 };
        }
        Scale {
            lo: lo.max(hi * 1e-6),
            hi,
        }
    }

    /// `v` mapped to [0, 1].
    pub fn t(&self, v: f32) -> f32 {
        if self.hi.is_nan() || self.hi <= 0.0 || v <= 0.0 {
            return 0.0;
        }
        if self.hi <= self.lo * 1.000_001 {
            return 1.0;
        }
        ((v.max(self.lo).ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())).clamp(0.0, 1.0)
    }
}

/// Viridis, from five control points.
pub fn viridis(t: f32) -> Color32 {
    const P: [[f32; 3]; 5] = [
        [68.0, 1.0, 84.0],
        [59.0, 82.0, 139.0],
        [33.0, 145.0, 140.0],
        [94.0, 201.0, 98.0],
        [253.0, 231.0, 37.0],
    ];
    let x = t.clamp(0.0, 1.0) * 4.0;
    let i = (x.floor() as usize).min(3);
    let f = x - i as f32;
    let c = |k: usize| (P[i][k] + (P[i + 1][k] - P[i][k]) * f).round() as u8;
    Color32::from_rgb(c(0), c(1), c(2))
}

/// The color of a non-finite cell.
pub const NONFINITE: Color32 = Color32::from_rgb(255, 0, 200);

/// The loud banner shown while the state holds NaN/Inf. Returns whether it was shown.
pub fn nonfinite_banner(ui: &mut Ui, summary: &StateSummary) -> bool {
    if !summary.has_nonfinite() {
        return false;
    }
    egui::Frame::new()
        .fill(Color32::from_rgb(150, 0, 30))
        .inner_margin(8.0)
        .corner_radius(4.0)
        .show(ui, |ui| {
            ui.label(
                RichText::new("NaN/Inf in the state!")
                    .color(Color32::WHITE)
                    .strong()
                    .size(18.0),
            );
            ui.label(RichText::new(summary.nonfinite_report()).color(Color32::WHITE));
        });
    true
}

/// Paints a `rows × cols` heatmap with row labels every few rows; `cell(r, c)` gives the
/// color of a cell. Returns the hovered cell.
pub(crate) fn grid_map(
    ui: &mut Ui,
    rows: usize,
    cols: usize,
    row_label: &str,
    max_cell: f32,
    cell: impl Fn(usize, usize) -> (Color32, bool),
) -> (egui::Response, Option<(usize, usize)>) {
    let label_w = 34.0;
    let avail = (ui.available_width() - label_w).max(40.0);
    let cw = (avail / cols.max(1) as f32).clamp(1.0, max_cell);
    let ch = (cw * 0.6)
        .clamp(4.0, 20.0)
        .min((420.0 / rows.max(1) as f32).max(2.0));
    let size = vec2(label_w + cw * cols as f32, ch * rows as f32);
    let (rect, response) = ui.allocate_exact_size(size, Sense::hover());
    let painter = ui.painter_at(rect);
    let origin = rect.min + vec2(label_w, 0.0);
    let font = FontId::proportional(10.0);
    let text = ui.visuals().text_color();
    let label_every = ((11.0 / ch).ceil() as usize).max(1);
    for r in 0..rows {
        for c in 0..cols {
            let (color, flagged) = cell(r, c);
            let min = origin + vec2(c as f32 * cw, r as f32 * ch);
            let cell_rect = Rect::from_min_size(min, vec2(cw, ch));
            painter.rect_filled(cell_rect, 0.0, color);
            if flagged {
                painter.rect_stroke(
                    cell_rect,
                    0.0,
                    Stroke::new(1.5, Color32::WHITE),
                    StrokeKind::Inside,
                );
            }
        }
        if r % label_every == 0 {
            painter.text(
                pos2(rect.min.x + label_w - 4.0, origin.y + (r as f32 + 0.5) * ch),
                Align2::RIGHT_CENTER,
                format!("{row_label}{r}"),
                font.clone(),
                text,
            );
        }
    }
    let hovered = response.hover_pos().and_then(|p| {
        let d = p - origin;
        if d.x < 0.0 || d.y < 0.0 {
            return None;
        }
        let (c, r) = ((d.x / cw) as usize, (d.y / ch) as usize);
        (r < rows && c < cols).then_some((r, c))
    });
    (response, hovered)
}

/// A horizontal color bar from `lo` to `hi` (log scale).
fn colorbar(ui: &mut Ui, scale: Scale) {
    ui.horizontal(|ui| {
        ui.small(format!("{:.2e}", scale.lo));
        let (rect, _) = ui.allocate_exact_size(vec2(160.0, 10.0), Sense::hover());
        let steps = 40;
        for i in 0..steps {
            let t = i as f32 / (steps - 1) as f32;
            let x0 = rect.min.x + rect.width() * i as f32 / steps as f32;
            let x1 = rect.min.x + rect.width() * (i + 1) as f32 / steps as f32;
            ui.painter().rect_filled(
                Rect::from_min_max(pos2(x0, rect.min.y), pos2(x1, rect.max.y)),
                0.0,
                viridis(t),
            );
        }
        ui.small(format!("{:.2e} (log)", scale.hi));
        let (r, _) = ui.allocate_exact_size(vec2(10.0, 10.0), Sense::hover());
        ui.painter().rect_filled(r, 0.0, NONFINITE);
        ui.small("NaN/Inf");
    });
}

/// The SSM heatmap (rows = layers, columns = heads) and the conv-state strips.
pub fn state_panel(ui: &mut Ui, summary: &StateSummary, norm: &mut StateNorm) {
    nonfinite_banner(ui, summary);
    ui.horizontal(|ui| {
        ui.label(format!(
            "SSM state: {} layers × {} heads (each head {}×{})",
            summary.layers, summary.heads, summary.head_dim, summary.d_state
        ));
        if let Some(p) = summary.position {
            ui.weak(format!("at token {p}"));
        }
    });
    if summary.layers < summary.layer_ids.last().map_or(0, |l| l + 1) {
        ui.weak(format!(
            "rows are the Mamba2 layers {:?}",
            summary.layer_ids
        ));
    }
    if !summary.kv_layers.is_empty() {
        ui.label(format!(
            "KV caches: {} tokens in each of the attention layers {:?}",
            summary.kv_len, summary.kv_layers
        ));
    }
    ui.horizontal(|ui| {
        ui.label("cell =");
        ui.selectable_value(norm, StateNorm::Rms, "RMS");
        ui.selectable_value(norm, StateNorm::MaxAbs, "max |S|");
    });
    let values = summary.values(*norm);
    let scale = Scale::of(values);
    let heads = summary.heads;
    let (response, hovered) = grid_map(ui, summary.layers, heads, "L", 36.0, |r, c| {
        let i = r * heads + c;
        cell_color(summary.nonfinite[i], scale, values[i])
    });
    if let Some((l, h)) = hovered {
        let i = l * heads + h;
        response.on_hover_ui_at_pointer(|ui| {
            ui.label(format!("layer {l}, head {h}"));
            ui.label(format!("RMS {:.4e}", summary.rms[i]));
            ui.label(format!("max |S| {:.4e}", summary.max_abs[i]));
            nonfinite_note(ui, summary.nonfinite[i]);
        });
    }
    colorbar(ui, scale);
    ui.add_space(6.0);
    ui.label(format!(
        "Conv state: {} layers × {} channels × {} columns (max |x| over {} channels per cell)",
        summary.layers, summary.conv_dim, summary.conv_cols, summary.conv_bin
    ));
    let bins = summary.conv_bins;
    let cscale = Scale::of(&summary.conv_max);
    let (response, hovered) = grid_map(ui, summary.layers, bins, "L", 8.0, |r, c| {
        let i = r * bins + c;
        cell_color(summary.conv_nonfinite[i], cscale, summary.conv_max[i])
    });
    if let Some((l, b)) = hovered {
        let i = l * bins + b;
        let lo = b * summary.conv_bin;
        let hi = ((b + 1) * summary.conv_bin).min(summary.conv_dim);
        response.on_hover_ui_at_pointer(|ui| {
            ui.label(format!("layer {l}, channels {lo}..{hi}"));
            ui.label(format!("max |x| {:.4e}", summary.conv_max[i]));
            nonfinite_note(ui, summary.conv_nonfinite[i]);
        });
    }
    colorbar(ui, cscale);
}

/// A heatmap cell's colour, and whether it is flagged (any NaN/Inf in it).
fn cell_color(nonfinite: u32, scale: Scale, value: f32) -> (Color32, bool) {
    if nonfinite > 0 {
        (NONFINITE, true)
    } else {
        (viridis(scale.t(value)), false)
    }
}

/// The hover line for a cell with NaN/Inf values.
fn nonfinite_note(ui: &mut Ui, nonfinite: u32) {
    if nonfinite > 0 {
        ui.colored_label(NONFINITE, format!("{nonfinite} NaN/Inf values"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::{tiny_config, tiny_hybrid};
    use crate::state::LayerState;

    #[test]
    fn hybrid_rows_are_the_mamba_layers() {
        let c = tiny_hybrid("M*-M", 2);
        let mut st = zero_state(&c);
        ssm(&mut st, 3)[0] = f32::NAN;
        st.len = 5;
        let s = StateSummary::from_state(&c, &st).expect("shape");
        assert_eq!((s.layers, s.layer_ids.clone()), (2, vec![0, 3]));
        assert_eq!((s.kv_layers.clone(), s.kv_len), (vec![1], 5));
        assert_eq!(s.bad[0].layer, 3);
        assert_eq!(s.nonfinite[s.heads], 1);
    }

    fn zero_state(c: &ModelConfig) -> State<f32> {
        State::new(c)
    }

    fn ssm(st: &mut State<f32>, layer: usize) -> &mut Vec<f32> {
        match &mut st.layers[layer] {
            LayerState::Mamba2 { ssm, .. } => ssm,
            _ => panic!("layer {layer} is not Mamba2"),
        }
    }

    fn conv(st: &mut State<f32>, layer: usize) -> &mut Vec<f32> {
        match &mut st.layers[layer] {
            LayerState::Mamba2 { conv, .. } => conv,
            _ => panic!("layer {layer} is not Mamba2"),
        }
    }

    #[test]
    fn summary_locates_nan_and_inf() {
        let c = tiny_config(2, 6);
        let mut st = zero_state(&c);
        let head_len = c.head_dim * c.d_state;
        ssm(&mut st, 1)[3 * head_len + 5] = f32::NAN;
        ssm(&mut st, 0)[head_len] = 2.0;
        conv(&mut st, 0)[7] = f32::INFINITY;
        let s = StateSummary::from_state(&c, &st).expect("shape");
        assert_eq!((s.layers, s.heads), (2, 8));
        assert_eq!(s.total_nonfinite, 2);
        assert_eq!(s.nonfinite[c.n_heads + 3], 1);
        assert!(s.max_abs[1] == 2.0 && s.rms[1] > 0.0);
        assert!(
            s.bad
                .iter()
                .any(|b| b.layer == 1 && b.part == "ssm" && b.index == 3)
        );
        assert!(s.nonfinite_report().contains("layer 1 head 3"));
    }

    #[test]
    fn summary_rejects_wrong_shapes() {
        let c = tiny_config(1, 4);
        let mut st = zero_state(&c);
        ssm(&mut st, 0).pop();
        assert!(
            StateSummary::from_state(&c, &st)
                .unwrap_err()
                .contains("layer 0")
        );
        st.layers.pop();
        assert!(StateSummary::from_state(&c, &st).is_err());
    }

    #[test]
    fn scale_is_log_and_clamped() {
        let s = Scale::of(&[0.0, 1e-3, 1.0, f32::NAN]);
        assert!((s.t(1e-3)).abs() < 1e-6 && (s.t(1.0) - 1.0).abs() < 1e-6);
        assert!((s.t(10f32.powf(-1.5)) - 0.5).abs() < 1e-3);
        assert_eq!(s.t(0.0), 0.0);
        assert_eq!(Scale::of(&[0.0]).t(1.0), 0.0);
    }
}
