//! The inspector's expert-load heatmap: for each MoE layer (rows), how often each routed
//! expert (columns) was chosen since the model was opened — the GPU router's own counters
//! (`Engine::expert_counts`), so the host never sees a token's routing. A well-balanced
//! layer is one flat color; a hot column is an expert most tokens go to.

use egui::{Color32, RichText, Ui};

use super::state_view::{grid_map, viridis};
use crate::config::{BlockKind, ModelConfig};

/// Expert choices per MoE layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertLoad {
    /// The model layer (block) of each row.
    pub layer_ids: Vec<usize>,
    /// `[row][expert]` choices.
    pub counts: Vec<Vec<u32>>,
}

impl ExpertLoad {
    /// The counters of `config`'s MoE layers, one row each (`None` without MoE layers or
    /// when the shapes disagree).
    pub fn new(config: &ModelConfig, counts: Vec<Vec<u32>>) -> Option<Self> {
        let m = config.moe.as_ref()?;
        let layer_ids: Vec<usize> = (0..config.n_layer)
            .filter(|&i| config.blocks[i] == BlockKind::Moe)
            .collect();
        (counts.len() == layer_ids.len() && counts.iter().all(|r| r.len() == m.experts))
            .then_some(ExpertLoad { layer_ids, counts })
    }

    /// Choices made in a row (tokens routed × top_k).
    pub fn total(&self, row: usize) -> u64 {
        self.counts[row].iter().map(|&c| c as u64).sum()
    }

    /// The busiest expert's share over the mean share (1 = perfectly balanced).
    pub fn imbalance(&self, row: usize) -> f64 {
        let total = self.total(row);
        let n = self.counts[row].len();
        if total == 0 || n == 0 {
            return 1.0;
        }
        let max = self.counts[row].iter().copied().max().unwrap_or(0) as f64;
        max / (total as f64 / n as f64)
    }
}

/// The counters of a GPU backend running an MoE model (a small blocking read); `None`
/// otherwise (the CPU reference keeps no counters).
pub fn read_expert_load(backend: &mut dyn crate::session::Backend) -> Option<ExpertLoad> {
    let config = backend.config().clone();
    config.moe.as_ref()?;
    let counts = backend.gpu()?.engine.expert_counts().ok()?;
    ExpertLoad::new(&config, counts)
}

/// The heatmap: each cell colored by its share of the layer's choices, relative to the
/// busiest expert of that layer.
pub fn expert_panel(ui: &mut Ui, load: &ExpertLoad) {
    let rows = load.counts.len();
    let cols = load.counts.first().map_or(0, Vec::len);
    if rows == 0 || cols == 0 {
        ui.weak("No MoE layers.");
        return;
    }
    let total = load.total(0);
    if total == 0 {
        ui.weak("No token routed yet.");
        return;
    }
    ui.label(format!(
        "{rows} MoE layers × {cols} experts; {total} choices per layer so far"
    ));
    let row_max: Vec<u32> = load
        .counts
        .iter()
        .map(|r| r.iter().copied().max().unwrap_or(0).max(1))
        .collect();
    let (response, hovered) = grid_map(ui, rows, cols, "E", 10.0, |r, c| {
        let t = load.counts[r][c] as f32 / row_max[r] as f32;
        (
            if load.counts[r][c] == 0 {
                Color32::from_gray(30)
            } else {
                viridis(t)
            },
            false,
        )
    });
    if let Some((r, c)) = hovered {
        let n = load.counts[r][c];
        response.on_hover_text(format!(
            "layer {} expert {c}: chosen {n} times ({:.1}% of the layer's choices)",
            load.layer_ids[r],
            100.0 * n as f64 / load.total(r).max(1) as f64
        ));
    }
    let worst = (0..rows)
        .max_by(|&a, &b| load.imbalance(a).total_cmp(&load.imbalance(b)))
        .unwrap_or(0);
    ui.label(
        RichText::new(format!(
            "color: choices / the layer's busiest expert (dark: never chosen); most uneven: \
             layer {} (busiest expert {:.1}× the mean)",
            load.layer_ids[worst],
            load.imbalance(worst)
        ))
        .small(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::tiny_moe;

    #[test]
    fn rows_are_the_moe_layers_and_imbalance_is_max_over_mean() {
        let c = tiny_moe("ME*E-M", false);
        let e = c.moe.as_ref().unwrap().experts;
        let mut flat = vec![3u32; e];
        flat[0] = 9;
        let load = ExpertLoad::new(&c, vec![flat, vec![0; e]]).unwrap();
        assert_eq!(load.layer_ids, vec![1, 3]);
        assert_eq!(load.total(0), 9 + 3 * (e as u64 - 1));
        let mean = load.total(0) as f64 / e as f64;
        assert!((load.imbalance(0) - 9.0 / mean).abs() < 1e-12);
        assert_eq!(load.imbalance(1), 1.0);
        // Shapes that disagree with the config are refused.
        assert!(ExpertLoad::new(&c, vec![vec![0; e]]).is_none());
    }
}
