//! Kernel timings as the inspector keeps them: the profiles of the last tokens (GPU time
//! per dispatch, host encode and submit time), token arrival times for tok/s, aggregates
//! per section and per kernel kind, the plots and tables that show them, and the CSV/JSON
//! export.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use egui::{Color32, RichText, Sense, Ui, vec2};
use egui_plot::{Bar, BarChart, Legend, Line, Plot, PlotPoints};

use crate::gpu::kernels::Section;
use crate::gpu::profiler::TokenProfile;

/// Profiles kept (older ones are dropped; the export holds what is kept).
pub const KEEP_PROFILES: usize = 4096;
/// Token arrival times kept for the tok/s plot.
const KEEP_ARRIVALS: usize = 100_000;
/// Width of a tok/s bucket, seconds.
const RATE_BUCKET_S: f64 = 1.0;

/// The color of a section in bars and plots.
pub fn section_color(s: Section) -> Color32 {
    match s {
        Section::Matmul => Color32::from_rgb(66, 133, 244),
        Section::Conv => Color32::from_rgb(255, 153, 0),
        Section::Ssd => Color32::from_rgb(52, 168, 83),
        Section::Norm => Color32::from_rgb(171, 71, 188),
        Section::Attn => Color32::from_rgb(0, 150, 136),
        Section::Mlp => Color32::from_rgb(255, 112, 67),
        Section::Moe => Color32::from_rgb(233, 30, 99),
        Section::Other => Color32::from_rgb(140, 140, 140),
    }
}

/// One kernel kind's share of a token.
#[derive(Clone, Debug, PartialEq)]
pub struct KindRow {
    pub kind: String,
    pub section: Section,
    /// Dispatches of this kind per token.
    pub count: usize,
    /// Mean GPU ns per token, all dispatches of the kind together.
    pub ns: f64,
}

/// Means over the last profiled tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub tokens: usize,
    pub gpu_ns: f64,
    pub encode_ns: f64,
    pub submit_ns: f64,
    pub dispatches: usize,
    pub sections: Vec<(Section, f64)>,
    pub kinds: Vec<KindRow>,
}

/// What the inspector knows about timings.
pub struct Timings {
    start: Instant,
    /// `(token index, profile)`, oldest first.
    pub profiles: VecDeque<(u64, TokenProfile)>,
    /// Seconds since `start` at which tokens arrived.
    arrivals: VecDeque<f64>,
    /// Tokens seen in total.
    pub tokens_seen: u64,
    /// Profiled tokens the means are taken over.
    pub window: usize,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            start: Instant::now(),
            profiles: VecDeque::new(),
            arrivals: VecDeque::new(),
            tokens_seen: 0,
            window: 32,
        }
    }
}

impl Timings {
    pub fn clear(&mut self) {
        *self = Timings {
            window: self.window,
            ..Timings::default()
        };
    }

    /// A token arrived at `at`.
    pub fn token(&mut self, at: Instant) {
        self.tokens_seen += 1;
        self.arrivals
            .push_back(at.saturating_duration_since(self.start).as_secs_f64());
        if self.arrivals.len() > KEEP_ARRIVALS {
            self.arrivals.pop_front();
        }
    }

    /// Profiles of tokens, in order.
    pub fn add_profiles(&mut self, profiles: impl IntoIterator<Item = TokenProfile>) {
        for p in profiles {
            let index = self.profiles.back().map_or(0, |(i, _)| i + 1);
            self.profiles.push_back((index, p));
            if self.profiles.len() > KEEP_PROFILES {
                self.profiles.pop_front();
            }
        }
    }

    /// Tokens per second over the last `seconds` of arrivals (0 when idle that long).
    pub fn recent_rate(&self, seconds: f64) -> f64 {
        let now = self.start.elapsed().as_secs_f64();
        let n = self
            .arrivals
            .iter()
            .rev()
            .take_while(|&&t| now - t <= seconds)
            .count();
        // A slow device: fewer than 2 tokens in the window, but decoding still (the
        // last token arrived within a few windows): the rate over the last 8 tokens.
        let n = match self.arrivals.back() {
            Some(&last) if n < 2 && now - last <= 4.0 * seconds => self.arrivals.len().min(8),
            _ => n,
        };
        if n < 2 {
            return 0.0;
        }
        let first = self.arrivals[self.arrivals.len() - n];
        let last = self.arrivals[self.arrivals.len() - 1];
        if last > first {
            (n - 1) as f64 / (last - first)
        } else {
            0.0
        }
    }

    /// `(seconds, tok/s)` per bucket of arrivals.
    pub fn rate_series(&self) -> Vec<[f64; 2]> {
        let mut buckets: BTreeMap<i64, usize> = BTreeMap::new();
        for &t in &self.arrivals {
            *buckets
                .entry((t / RATE_BUCKET_S).floor() as i64)
                .or_default() += 1;
        }
        buckets
            .into_iter()
            .map(|(b, n)| [(b as f64 + 0.5) * RATE_BUCKET_S, n as f64 / RATE_BUCKET_S])
            .collect()
    }

    /// Means over the last `window` profiled tokens.
    pub fn summary(&self) -> Summary {
        let recent: Vec<&TokenProfile> = self
            .profiles
            .iter()
            .rev()
            .take(self.window.max(1))
            .map(|(_, p)| p)
            .collect();
        let n = recent.len();
        if n == 0 {
            return Summary::default();
        }
        let mean =
            |f: &dyn Fn(&TokenProfile) -> f64| recent.iter().map(|p| f(p)).sum::<f64>() / n as f64;
        let sections = Section::ALL
            .iter()
            .map(|&s| (s, mean(&|p| p.section_ns(s))))
            .collect();
        let mut kinds: Vec<KindRow> = Vec::new();
        for (j, p) in recent.iter().enumerate() {
            for k in &p.kernels {
                let kind = k.kind();
                let i = match kinds.iter().position(|r| r.kind == kind) {
                    Some(i) => i,
                    None => {
                        kinds.push(KindRow {
                            kind: kind.clone(),
                            section: k.section,
                            count: 0,
                            ns: 0.0,
                        });
                        kinds.len() - 1
                    }
                };
                kinds[i].ns += k.ns;
                if j == 0 {
                    kinds[i].count += 1;
                }
            }
        }
        for r in &mut kinds {
            r.ns /= n as f64;
        }
        kinds.sort_by(|a, b| b.ns.total_cmp(&a.ns));
        Summary {
            tokens: n,
            gpu_ns: mean(&|p| p.gpu_ns()),
            encode_ns: mean(&|p| p.encode_ns),
            submit_ns: mean(&|p| p.submit_ns),
            dispatches: recent[0].kernels.len(),
            sections,
            kinds,
        }
    }

    /// One row per dispatch of every kept token.
    pub fn to_csv(&self) -> String {
        let mut s = String::from("token,dispatch,kernel,section,gpu_ns,encode_ns,submit_ns\n");
        for (i, p) in &self.profiles {
            for (d, k) in p.kernels.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "{i},{d},{},{},{:.0},{:.0},{:.0}",
                    csv_field(&k.name),
                    k.section.name(),
                    k.ns,
                    p.encode_ns,
                    p.submit_ns
                );
            }
        }
        s
    }

    /// Every kept token with its dispatches, plus the summary and `meta` (device, model).
    pub fn to_json(&self, meta: serde_json::Value) -> serde_json::Value {
        let sum = self.summary();
        let tokens: Vec<serde_json::Value> = self
            .profiles
            .iter()
            .map(|(i, p)| {
                serde_json::json!({
                    "token": i,
                    "gpu_ns": p.gpu_ns(),
                    "encode_ns": p.encode_ns,
                    "submit_ns": p.submit_ns,
                    "kernels": p.kernels.iter().map(|k| serde_json::json!({
                        "name": k.name, "section": k.section.name(), "ns": k.ns,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        serde_json::json!({
            "meta": meta,
            "summary": {
                "tokens_averaged": sum.tokens,
                "gpu_ns_per_token": sum.gpu_ns,
                "encode_ns_per_token": sum.encode_ns,
                "submit_ns_per_token": sum.submit_ns,
                "dispatches_per_token": sum.dispatches,
                "sections_ns": sum.sections.iter().map(|(s, ns)| (s.name().to_string(), serde_json::json!(ns))).collect::<serde_json::Map<_, _>>(),
            },
            "tokens": tokens,
        })
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The export formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    Csv,
    Json,
}

/// Writes the timings to `path` (its extension replaced by the format's), creating the
/// parent folder. Returns the absolute path written.
pub fn export(
    timings: &Timings,
    path: &Path,
    format: ExportFormat,
    meta: serde_json::Value,
) -> Result<PathBuf, String> {
    if path.as_os_str().is_empty() {
        return Err("give a file path to export to".into());
    }
    if timings.profiles.is_empty() {
        return Err("no profiled tokens yet: turn profiling on and decode some tokens".into());
    }
    let (ext, text) = match format {
        ExportFormat::Csv => ("csv", timings.to_csv()),
        ExportFormat::Json => (
            "json",
            serde_json::to_string_pretty(&timings.to_json(meta))
                .map_err(|e| format!("could not encode JSON: {e}"))?,
        ),
    };
    let path = path.with_extension(ext);
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("could not create {}: {e}", parent.display()))?;
    }
    std::fs::write(&path, text).map_err(|e| format!("could not write {}: {e}", path.display()))?;
    Ok(std::path::absolute(&path).unwrap_or(path))
}

pub fn us(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} µs", ns / 1e3)
    }
}

/// A labelled bar of `frac` of `width`.
fn bar(ui: &mut Ui, frac: f64, width: f32, color: Color32) {
    let (rect, _) = ui.allocate_exact_size(vec2(width, 12.0), Sense::hover());
    ui.painter()
        .rect_filled(rect, 2.0, ui.visuals().faint_bg_color);
    let w = rect.width() * frac.clamp(0.0, 1.0) as f32;
    ui.painter().rect_filled(
        egui::Rect::from_min_size(rect.min, vec2(w, rect.height())),
        2.0,
        color,
    );
}

/// The numbers, section bars and kernel table.
pub fn summary_ui(ui: &mut Ui, t: &Timings, graph_dispatches: Option<usize>) {
    let s = t.summary();
    egui::Grid::new("timing_summary")
        .num_columns(2)
        .striped(true)
        .show(ui, |ui| {
            ui.label("tokens decoded");
            ui.label(t.tokens_seen.to_string());
            ui.end_row();
            ui.label("tokens/s (last 2 s)");
            ui.label(format!("{:.1}", t.recent_rate(2.0)));
            ui.end_row();
            ui.label("profiled tokens (mean over)");
            ui.label(format!("{} ({})", t.profiles.len(), s.tokens));
            ui.end_row();
            ui.label("dispatches per token");
            ui.label(match (s.tokens, graph_dispatches) {
                (0, Some(g)) => g.to_string(),
                (0, None) => "–".into(),
                _ => s.dispatches.to_string(),
            });
            ui.end_row();
            ui.label("GPU time per token");
            ui.label(if s.tokens > 0 {
                us(s.gpu_ns)
            } else {
                "–".into()
            });
            ui.end_row();
            ui.label("host encode / submit");
            ui.label(if s.tokens > 0 {
                format!("{} / {}", us(s.encode_ns), us(s.submit_ns))
            } else {
                "–".into()
            });
            ui.end_row();
        });
    if s.tokens == 0 {
        ui.weak("No GPU timings yet (profiling off, no timestamp queries on this adapter, or nothing decoded).");
        return;
    }
    ui.add_space(4.0);
    ui.strong("GPU time per token by section");
    let total = s.gpu_ns.max(1.0);
    egui::Grid::new("section_bars")
        .num_columns(4)
        .show(ui, |ui| {
            // Sections with no dispatch in this graph (fused away) are left out.
            for &(sec, ns) in s
                .sections
                .iter()
                .filter(|(sec, _)| s.kinds.iter().any(|k| k.section == *sec))
            {
                ui.label(RichText::new(sec.name()).color(section_color(sec)).strong());
                ui.label(us(ns));
                ui.label(format!("{:.1}%", 100.0 * ns / total));
                bar(ui, ns / total, 160.0, section_color(sec));
                ui.end_row();
            }
        });
    ui.add_space(4.0);
    ui.strong("GPU time per token by kernel");
    egui::Grid::new("kernel_table")
        .num_columns(5)
        .striped(true)
        .show(ui, |ui| {
            for h in [
                "kernel (colored by section)",
                "×/token",
                "per token",
                "share",
                "",
            ] {
                ui.label(RichText::new(h).weak());
            }
            ui.end_row();
            let top = s.kinds.first().map_or(1.0, |k| k.ns.max(1.0));
            for k in &s.kinds {
                ui.label(RichText::new(&k.kind).color(section_color(k.section)))
                    .on_hover_text(k.section.name());
                ui.label(k.count.to_string());
                ui.label(us(k.ns));
                ui.label(format!("{:.1}%", 100.0 * k.ns / total));
                bar(ui, k.ns / top, 70.0, section_color(k.section));
                ui.end_row();
            }
        });
}

/// GPU time per token and tok/s over time, and the dispatch timeline of the last token.
pub fn plots_ui(ui: &mut Ui, t: &Timings) {
    let h = 140.0;
    if !t.profiles.is_empty() {
        ui.strong("GPU time per token (µs), by section");
        Plot::new("gpu_per_token")
            .height(h)
            .legend(Legend::default())
            .allow_scroll(false)
            .x_axis_label("token")
            .show(ui, |plot| {
                let total: Vec<[f64; 2]> = t
                    .profiles
                    .iter()
                    .map(|(i, p)| [*i as f64, p.gpu_ns() / 1e3])
                    .collect();
                plot.line(Line::new("total", PlotPoints::from(total)).color(Color32::WHITE));
                for s in Section::ALL {
                    let pts: Vec<[f64; 2]> = t
                        .profiles
                        .iter()
                        .map(|(i, p)| [*i as f64, p.section_ns(s) / 1e3])
                        .collect();
                    if pts.iter().any(|p| p[1] > 0.0) {
                        plot.line(
                            Line::new(s.name(), PlotPoints::from(pts)).color(section_color(s)),
                        );
                    }
                }
            });
    }
    ui.strong("tokens/s over time");
    Plot::new("tok_per_s")
        .height(h)
        .allow_scroll(false)
        .x_axis_label("s")
        .include_y(0.0)
        .show(ui, |plot| {
            plot.line(
                Line::new("tok/s", PlotPoints::from(t.rate_series()))
                    .color(Color32::from_rgb(255, 200, 60))
                    .fill(0.0),
            );
        });
    if let Some((i, p)) = t.profiles.back() {
        ui.strong(format!(
            "Token timeline: the {} dispatches of token {i} (µs)",
            p.kernels.len()
        ));
        // One row per section present in the token, in Section::ALL order.
        let rows: Vec<Section> = Section::ALL
            .iter()
            .copied()
            .filter(|s| p.kernels.iter().any(|k| k.section == *s))
            .collect();
        let mut start = 0.0;
        let mut charts: Vec<(Section, Vec<Bar>)> = rows.iter().map(|&s| (s, Vec::new())).collect();
        for k in &p.kernels {
            let us = k.ns / 1e3;
            let row = rows.iter().position(|&s| s == k.section).unwrap_or(0);
            charts[row].1.push(
                Bar::new(row as f64, us.max(1e-3))
                    .base_offset(start)
                    .width(0.7)
                    .name(&k.name)
                    .fill(section_color(k.section)),
            );
            start += us;
        }
        Plot::new("token_timeline")
            .height(50.0 + 30.0 * rows.len() as f32)
            .allow_scroll(false)
            .show_y(false)
            .x_axis_label("µs from the token's first dispatch")
            .y_axis_formatter(|m, _| {
                let i = m.value.round();
                if (m.value - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < rows.len() {
                    rows[i as usize].name().to_string()
                } else {
                    String::new()
                }
            })
            .show(ui, |plot| {
                for (s, bars) in charts {
                    if !bars.is_empty() {
                        plot.bar_chart(
                            BarChart::new(s.name(), bars)
                                .horizontal()
                                .color(section_color(s)),
                        );
                    }
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BlockKind;
    use crate::gpu::kernels::Label;
    use crate::gpu::profiler::KernelTime;

    fn profile(scale: f64) -> TokenProfile {
        let k = |name: &str, section, ns: f64| {
            let label = match name.strip_prefix("layers.").and_then(|r| r.split_once('.')) {
                Some((layer, kernel)) => Label {
                    layer: layer.parse().ok(),
                    block: Some(BlockKind::Mamba2),
                    kernel: kernel.into(),
                    gemm: None,
                },
                None => Label::default(),
            };
            KernelTime {
                name: name.into(),
                section,
                label,
                ns: ns * scale,
            }
        };
        TokenProfile {
            kernels: vec![
                k("embed", Section::Other, 1000.0),
                k("layers.0.in_proj", Section::Matmul, 4000.0),
                k("layers.0.ssd_step", Section::Ssd, 2000.0),
                k("layers.1.in_proj", Section::Matmul, 4000.0),
                k("layers.1.ssd_step", Section::Ssd, 2000.0),
                k("lm_head, \"big\"", Section::Matmul, 3000.0),
            ],
            encode_ns: 500.0,
            submit_ns: 700.0,
        }
    }

    #[test]
    fn summary_means_sections_and_kinds() {
        let mut t = Timings::default();
        t.add_profiles([profile(1.0), profile(3.0)]);
        let s = t.summary();
        assert_eq!((s.tokens, s.dispatches), (2, 6));
        assert!((s.gpu_ns - 32_000.0).abs() < 1e-6);
        let matmul = s
            .sections
            .iter()
            .find(|(x, _)| *x == Section::Matmul)
            .map(|x| x.1);
        assert_eq!(matmul, Some(22_000.0));
        let in_proj = s
            .kinds
            .iter()
            .find(|k| k.kind == "mamba2/in_proj")
            .expect("in_proj row");
        assert_eq!((in_proj.count, in_proj.ns), (2, 16_000.0));
        assert_eq!(s.kinds[0].kind, "mamba2/in_proj");
    }

    #[test]
    fn csv_and_json_hold_every_dispatch() {
        let mut t = Timings::default();
        t.add_profiles([profile(1.0), profile(2.0)]);
        let csv = t.to_csv();
        assert_eq!(csv.lines().count(), 1 + 12);
        assert!(csv.contains("1,1,layers.0.in_proj,MATMUL,8000,500,700"));
        assert!(csv.contains("\"lm_head, \"\"big\"\"\""));
        let j = t.to_json(serde_json::json!({"device": "test"}));
        assert_eq!(j["tokens"].as_array().map(Vec::len), Some(2));
        assert_eq!(j["tokens"][1]["kernels"][1]["ns"], 8000.0);
        assert_eq!(j["meta"]["device"], "test");
        let dir = std::env::temp_dir().join(format!("mamba2-ui-export-{}", std::process::id()));
        let written = export(
            &t,
            &dir.join("t.txt"),
            ExportFormat::Json,
            serde_json::Value::Null,
        )
        .expect("export");
        assert!(written.ends_with("t.json") && written.is_absolute());
        let back: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&written).expect("read")).expect("json");
        assert_eq!(back["summary"]["dispatches_per_token"], 6);
        assert!(
            export(
                &Timings::default(),
                &dir.join("e"),
                ExportFormat::Csv,
                serde_json::Value::Null
            )
            .is_err()
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
