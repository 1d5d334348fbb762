//! The CPU router and expert MLPs (src/reference/moe.rs) against transformers 5.17's own
//! routing, recorded by scripts/make_fixtures.py in the `nemotron_h_moe` and
//! `granite_moe_hybrid` fixtures: for every MoE layer and every position of prompt + greedy path,
//! the router logits, the chosen experts and weights, the MoE input and the routed and shared
//! outputs. The chosen ids must match exactly: the fixtures' closest decisions are 2e-4 away from
//! a tie (their READMEs), far above f32 rounding.

use std::collections::HashMap;
use std::path::PathBuf;

use mamba2_wgpu::reference::math::dot;
use mamba2_wgpu::reference::moe::{
    GroupRouting, Route, expert_block, gated_mlp, relu2_mlp, route_grouped, route_softmax_top_k,
    routed_sum,
};
use safetensors::{Dtype, SafeTensors};

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Every tensor of a safetensors file as f64 values (from f32, f64 or i64) with its shape.
fn load(path: PathBuf) -> HashMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
            let v: Vec<f64> = match t.dtype() {
                Dtype::F32 => t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::F64 => t
                    .data()
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::I64 => t
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            (name, (t.shape().to_vec(), v))
        })
        .collect()
}

/// One fixture's routing record and weights.
struct Fixture {
    config: serde_json::Value,
    oracle: HashMap<String, (Vec<usize>, Vec<f64>)>,
    model: HashMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Fixture {
    fn open(name: &str) -> Self {
        let d = dir(name);
        let config = std::fs::read_to_string(d.join("config.json")).unwrap();
        Fixture {
            config: serde_json::from_str(&config).unwrap(),
            oracle: load(d.join("oracle.safetensors")),
            model: load(d.join("model.safetensors")),
        }
    }

    fn cfg(&self, key: &str) -> &serde_json::Value {
        self.config
            .get(key)
            .unwrap_or_else(|| panic!("config.json has no {key}"))
    }

    fn usize(&self, key: &str) -> usize {
        self.cfg(key).as_u64().unwrap() as usize
    }

    fn moe_layers(&self) -> Vec<usize> {
        self.oracle["moe_layers"]
            .1
            .iter()
            .map(|&x| x as usize)
            .collect()
    }

    /// `moe.{layer}.{what}` as rows.
    fn rows(&self, layer: usize, what: &str) -> Vec<Vec<f64>> {
        let (shape, v) = &self.oracle[&format!("moe.{layer}.{what}")];
        v.chunks(shape[1]).map(<[f64]>::to_vec).collect()
    }

    fn weight(&self, name: &str) -> &[f64] {
        &self
            .model
            .get(name)
            .unwrap_or_else(|| panic!("model.safetensors has no {name}"))
            .1
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// The route as a map id → weight (the oracle's Nemotron-H order is torch.topk(sorted=False)'s).
fn by_id(ids: &[usize], weights: &[f64]) -> Vec<(usize, f64)> {
    let mut v: Vec<(usize, f64)> = ids.iter().copied().zip(weights.iter().copied()).collect();
    v.sort_by_key(|p| p.0);
    v
}

fn same_route(
    got: &Route<f64>,
    oracle_ids: &[f64],
    oracle_w: &[f64],
    tol: f64,
) -> Result<(), String> {
    let oids: Vec<usize> = oracle_ids.iter().map(|&x| x as usize).collect();
    let (a, b) = (by_id(&got.ids, &got.weights), by_id(&oids, oracle_w));
    let ids_equal = a.iter().map(|p| p.0).eq(b.iter().map(|p| p.0));
    let weights_close = a.iter().zip(&b).all(|(x, y)| (x.1 - y.1).abs() <= tol);
    if ids_equal && weights_close {
        Ok(())
    } else {
        Err(format!("ours {a:?}, oracle {b:?}"))
    }
}

fn nemotron_routing(fx: &Fixture) -> GroupRouting {
    let r = GroupRouting {
        experts: fx.usize("n_routed_experts"),
        n_group: fx.usize("n_group"),
        topk_group: fx.usize("topk_group"),
        top_k: fx.usize("num_experts_per_tok"),
        norm_topk_prob: fx.cfg("norm_topk_prob").as_bool().unwrap(),
        routed_scaling_factor: fx.cfg("routed_scaling_factor").as_f64().unwrap(),
    };
    r.check().unwrap();
    r
}

#[test]
fn nemotron_router_chooses_the_oracles_experts() {
    let fx = Fixture::open("nemotron_h_moe");
    let r = nemotron_routing(&fx);
    // What the fixture is for: group routing with a real choice of groups.
    assert!(r.n_group > 1 && r.topk_group < r.n_group && r.top_k == 2);
    assert!(r.norm_topk_prob && r.routed_scaling_factor != 1.0);
    let layers = fx.moe_layers();
    assert!(!layers.is_empty());
    let mut checked = 0;
    for &l in &layers {
        let bias = fx.weight(&format!(
            "backbone.layers.{l}.mixer.gate.e_score_correction_bias"
        ));
        assert!(bias.iter().any(|&b| b != 0.0), "layer {l}: zero bias");
        let (logits, ids, w) = (
            fx.rows(l, "router_logits"),
            fx.rows(l, "expert_ids"),
            fx.rows(l, "expert_weights"),
        );
        for t in 0..logits.len() {
            // f32, as transformers routes, and f64: the same experts.
            let r32 = route_grouped(&to_f32(&logits[t]), &to_f32(bias), &r);
            let r32 = Route {
                ids: r32.ids,
                weights: r32.weights.iter().map(|&x| x as f64).collect(),
            };
            same_route(&r32, &ids[t], &w[t], 2e-6)
                .unwrap_or_else(|e| panic!("layer {l} position {t} (f32): {e}"));
            let r64 = route_grouped(&logits[t], bias, &r);
            same_route(&r64, &ids[t], &w[t], 2e-6)
                .unwrap_or_else(|e| panic!("layer {l} position {t} (f64): {e}"));
            checked += 1;
        }
    }
    assert_eq!(checked, layers.len() * fx.oracle["moe_tokens"].1.len());
}

#[test]
fn granite_router_chooses_the_oracles_experts_in_order() {
    let fx = Fixture::open("granite_moe_hybrid");
    let k = fx.usize("num_experts_per_tok");
    let experts = fx.usize("num_local_experts");
    for l in fx.moe_layers() {
        let (logits, ids, w) = (
            fx.rows(l, "router_logits"),
            fx.rows(l, "expert_ids"),
            fx.rows(l, "expert_weights"),
        );
        assert_eq!(logits[0].len(), experts);
        for t in 0..logits.len() {
            let ours = route_softmax_top_k(&to_f32(&logits[t]), k);
            // torch.topk(sorted=True): descending logits, the same order as ours.
            let oids: Vec<usize> = ids[t].iter().map(|&x| x as usize).collect();
            assert_eq!(ours.ids, oids, "layer {l} position {t}");
            for (a, b) in ours.weights.iter().zip(&w[t]) {
                assert!(
                    (*a as f64 - b).abs() < 2e-6,
                    "layer {l} position {t}: {a} vs {b}"
                );
            }
        }
    }
}

/// The router logits recomputed from the recorded MoE input and the saved router weight (what
/// the engine computes), and the route taken from them: the stored names are the right ones and
/// the choice holds when the logits carry our own rounding.
#[test]
fn router_logits_from_the_saved_weights() {
    for (name, weight) in [
        ("nemotron_h_moe", "backbone.layers.{l}.mixer.gate.weight"),
        (
            "granite_moe_hybrid",
            "model.layers.{l}.block_sparse_moe.router.layer.weight",
        ),
    ] {
        let fx = Fixture::open(name);
        for l in fx.moe_layers() {
            let w = fx.weight(&weight.replace("{l}", &l.to_string()));
            let (x, logits, ids) = (
                fx.rows(l, "input"),
                fx.rows(l, "router_logits"),
                fx.rows(l, "expert_ids"),
            );
            let d = x[0].len();
            for t in 0..x.len() {
                let ours: Vec<f64> = w.chunks(d).map(|row| dot(row, &x[t])).collect();
                for (a, b) in ours.iter().zip(&logits[t]) {
                    assert!(
                        (a - b).abs() < 1e-4,
                        "{name} layer {l} position {t}: {a} vs {b}"
                    );
                }
                let route = if name == "nemotron_h_moe" {
                    let bias = fx.weight(&format!(
                        "backbone.layers.{l}.mixer.gate.e_score_correction_bias"
                    ));
                    route_grouped(&ours, bias, &nemotron_routing(&fx))
                } else {
                    route_softmax_top_k(&ours, fx.usize("num_experts_per_tok"))
                };
                let mut a = route.ids.clone();
                let mut b: Vec<usize> = ids[t].iter().map(|&x| x as usize).collect();
                a.sort_unstable();
                b.sort_unstable();
                assert_eq!(a, b, "{name} layer {l} position {t}");
            }
        }
    }
}

/// `|a − b| ≤ tol · max|b|` over a whole row (the expert outputs reach hundreds).
fn assert_rows_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    let scale = b.iter().fold(1.0f64, |m, &x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(
        worst <= tol * scale,
        "{what}: max |diff| {worst} (scale {scale})"
    );
}

#[test]
fn nemotron_experts_and_shared_expert_match_the_oracle() {
    let fx = Fixture::open("nemotron_h_moe");
    let r = nemotron_routing(&fx);
    for l in fx.moe_layers() {
        let p = format!("backbone.layers.{l}.mixer.");
        let bias = fx.weight(&format!("{p}gate.e_score_correction_bias"));
        let (x, logits) = (fx.rows(l, "input"), fx.rows(l, "router_logits"));
        let (routed, shared) = (fx.rows(l, "routed_out"), fx.rows(l, "shared_out"));
        for t in 0..x.len() {
            let route = route_grouped(&logits[t], bias, &r);
            let y = routed_sum(&route, x[t].len(), |e| {
                relu2_mlp(
                    &x[t],
                    fx.weight(&format!("{p}experts.{e}.up_proj.weight")),
                    fx.weight(&format!("{p}experts.{e}.down_proj.weight")),
                )
            });
            assert_rows_close(
                &y,
                &routed[t],
                1e-5,
                &format!("layer {l} position {t} routed"),
            );
            let s = relu2_mlp(
                &x[t],
                fx.weight(&format!("{p}shared_experts.up_proj.weight")),
                fx.weight(&format!("{p}shared_experts.down_proj.weight")),
            );
            assert_rows_close(
                &s,
                &shared[t],
                1e-5,
                &format!("layer {l} position {t} shared"),
            );
        }
    }
}

#[test]
fn granite_experts_and_shared_mlp_match_the_oracle() {
    let fx = Fixture::open("granite_moe_hybrid");
    let (k, experts) = (
        fx.usize("num_experts_per_tok"),
        fx.usize("num_local_experts"),
    );
    for l in fx.moe_layers() {
        let p = format!("model.layers.{l}.");
        let input_linear = fx.weight(&format!("{p}block_sparse_moe.input_linear.weight"));
        let output_linear = fx.weight(&format!("{p}block_sparse_moe.output_linear.weight"));
        let (x, logits) = (fx.rows(l, "input"), fx.rows(l, "router_logits"));
        let (routed, shared) = (fx.rows(l, "routed_out"), fx.rows(l, "shared_out"));
        for t in 0..x.len() {
            let route = route_softmax_top_k(&logits[t], k);
            let y = routed_sum(&route, x[t].len(), |e| {
                gated_mlp(
                    &x[t],
                    expert_block(input_linear, experts, e),
                    expert_block(output_linear, experts, e),
                )
            });
            assert_rows_close(
                &y,
                &routed[t],
                1e-5,
                &format!("layer {l} position {t} routed"),
            );
            let s = gated_mlp(
                &x[t],
                fx.weight(&format!("{p}shared_mlp.input_linear.weight")),
                fx.weight(&format!("{p}shared_mlp.output_linear.weight")),
            );
            assert_rows_close(
                &s,
                &shared[t],
                1e-5,
                &format!("layer {l} position {t} shared"),
            );
        }
    }
}
