use super::*;
use crate::config::{CfgOp, FACTORS, KEYS, KeySel, mutate_config};
use crate::safetensors::{
    FIXTURE, FIXTURES, StTensor, check_load, entries, header_text, safetensors_file,
};

/// Where an index entry can point.
#[derive(Clone, Copy, Debug)]
enum Target {
    Missing,
    /// The model file itself, by its absolute path.
    AbsoluteInside,
    AbsoluteOutside,
    /// `../other/model.safetensors`: a valid copy outside the model directory.
    Parent,
    /// `sub/../model.safetensors`
    DotDotInside,
    Empty,
    Dot,
    Subdir,
    Nul,
    DotSlash,
    OtherShard,
    LongName,
    Backslash,
    NonString(usize),
}

const TARGETS: &[Target] = &[
    Target::Missing,
    Target::AbsoluteInside,
    Target::AbsoluteOutside,
    Target::Parent,
    Target::DotDotInside,
    Target::Empty,
    Target::Dot,
    Target::Subdir,
    Target::Nul,
    Target::DotSlash,
    Target::OtherShard,
    Target::LongName,
    Target::Backslash,
    Target::NonString(0),
    Target::NonString(1),
    Target::NonString(2),
    Target::NonString(3),
];
const NON_STRINGS: &[&str] = &["1", "null", "[]", "{}"];
const WEIGHT_MAPS: &[&str] = &["[]", "\"x\"", "null", "1", "{}", "{\"a\":{}}"];

#[derive(Clone, Debug)]
enum IdxOp {
    Retarget(Index, usize),
    /// A weight_map key twice.
    DupName(Index, usize),
    Remove(Index),
    WeightMap(usize),
    /// No `weight_map` at all.
    NoWeightMap,
}

fn idx_op() -> impl Strategy<Value = IdxOp> {
    prop_oneof![
        6 => (any::<Index>(), 0..TARGETS.len()).prop_map(|(i, t)| IdxOp::Retarget(i, t)),
        2 => (any::<Index>(), 0..TARGETS.len()).prop_map(|(i, t)| IdxOp::DupName(i, t)),
        2 => any::<Index>().prop_map(IdxOp::Remove),
        1 => (0..WEIGHT_MAPS.len()).prop_map(IdxOp::WeightMap),
        1 => Just(IdxOp::NoWeightMap),
    ]
}

#[derive(Clone, Debug)]
struct IdxCase {
    fixture: usize,
    /// Two shards instead of one file.
    split: bool,
    ops: Vec<IdxOp>,
    bytes: Vec<ByteOp>,
}

fn shard_name(split: bool, i: usize, count: usize) -> String {
    if split {
        format!(
            "model-{:05}-of-00002.safetensors",
            1 + (i >= count / 2) as usize
        )
    } else {
        "model.safetensors".into()
    }
}

fn target_text(t: Target, dir: &Path, split: bool) -> String {
    let s = |x: &str| serde_json::to_string(x).unwrap();
    let model = shard_name(split, 0, 2);
    match t {
        Target::Missing => s("missing.safetensors"),
        Target::AbsoluteInside => s(&dir.join(&model).display().to_string()),
        Target::AbsoluteOutside => s("/etc/passwd"),
        Target::Parent => s("../other/model.safetensors"),
        Target::DotDotInside => s(&format!("subdir/../{model}")),
        Target::Empty => s(""),
        Target::Dot => s("."),
        Target::Subdir => s("subdir"),
        Target::Nul => s("a\u{0}b.safetensors"),
        Target::DotSlash => s(&format!("./{model}")),
        Target::OtherShard => s(&shard_name(split, 1, 2)),
        Target::LongName => s(&"x".repeat(5000)),
        Target::Backslash => s("..\\other\\model.safetensors"),
        Target::NonString(i) => NON_STRINGS[i].into(),
    }
}

/// Whether a shard path leaves the model directory (absolute, or through `..`).
fn escapes(t: Target) -> bool {
    matches!(
        t,
        Target::AbsoluteInside | Target::AbsoluteOutside | Target::Parent | Target::DotDotInside
    )
}

fn check_index(c: &IdxCase) -> Check {
    let scratch = Scratch::new();
    let dir = scratch.0.join("model");
    let other = scratch.0.join("other");
    std::fs::create_dir_all(dir.join("subdir")).unwrap();
    std::fs::create_dir_all(&other).unwrap();
    let fx = &FIXTURE[c.fixture];
    std::fs::write(dir.join("config.json"), &fx.config).unwrap();
    let count = fx.tensors.len();
    let write_shard = |path: &Path, tensors: &[StTensor]| {
        let (es, data) = entries(tensors, fx.metadata.as_deref());
        std::fs::write(
            path,
            safetensors_file(header_text(&es).as_bytes(), None, &data),
        )
        .unwrap();
    };
    if c.split {
        write_shard(
            &dir.join(shard_name(true, 0, count)),
            &fx.tensors[..count / 2],
        );
        write_shard(
            &dir.join(shard_name(true, count, count)),
            &fx.tensors[count / 2..],
        );
    } else {
        write_shard(&dir.join("model.safetensors"), &fx.tensors);
    }
    write_shard(&other.join("model.safetensors"), &fx.tensors);
    let mut map: Vec<(String, String, Option<Target>)> = fx
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.clone(),
                serde_json::to_string(&shard_name(c.split, i, count)).unwrap(),
                None,
            )
        })
        .collect();
    let mut weight_map: Option<Option<&str>> = Some(None);
    for op in &c.ops {
        let len = map.len();
        match op {
            IdxOp::Retarget(i, t) if len > 0 => {
                let e = &mut map[i.index(len)];
                e.1 = target_text(TARGETS[*t], &dir, c.split);
                e.2 = Some(TARGETS[*t]);
            }
            IdxOp::DupName(i, t) if len > 0 => {
                let name = map[i.index(len)].0.clone();
                map.push((
                    name,
                    target_text(TARGETS[*t], &dir, c.split),
                    Some(TARGETS[*t]),
                ));
            }
            IdxOp::Remove(i) if len > 0 => {
                map.remove(i.index(len));
            }
            IdxOp::WeightMap(v) => weight_map = Some(Some(WEIGHT_MAPS[*v])),
            IdxOp::NoWeightMap => weight_map = None,
            _ => {}
        }
    }
    let map_text = {
        let mut s = String::from("{");
        for (i, (name, target, _)) in map.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{}:{target}", serde_json::to_string(name).unwrap());
        }
        s.push('}');
        s
    };
    let index = match weight_map {
        Some(None) => format!("{{\"metadata\":{{\"total_size\":1}},\"weight_map\":{map_text}}}"),
        Some(Some(raw)) => format!("{{\"metadata\":{{}},\"weight_map\":{raw}}}"),
        None => "{\"metadata\":{}}".into(),
    };
    let index = apply_bytes(index.into_bytes(), &c.bytes);
    std::fs::write(dir.join("model.safetensors.index.json"), &index).unwrap();
    // A shard path that leaves the directory must be refused, naming the index. Of a
    // name given twice, the last entry counts (as when the JSON is read into a map).
    let mut effective: BTreeMap<&str, (&String, Option<Target>)> = BTreeMap::new();
    for (name, target, kind) in &map {
        effective.insert(name, (target, *kind));
    }
    let escaping = (c.bytes.is_empty() && weight_map == Some(None))
        .then(|| {
            effective
                .values()
                .find_map(|(t, k)| k.filter(|k| escapes(*k)).map(|k| ((*t).clone(), k)))
        })
        .flatten();
    let why = escaping.map(|(t, k)| {
        (
            format!("a shard path leaving the directory ({k:?})"),
            format!("the index names the shard {t}, outside the model directory"),
        )
    });
    check_load(
        &dir,
        why.as_ref().map(|(k, w)| (k.as_str(), w.as_str())),
        fx.config_ok.then_some("model.safetensors.index.json"),
    )
    .map_err(|mut f| {
        f.detail = format!(
            "{}\n  index: {}",
            f.detail,
            clip(&String::from_utf8_lossy(&index), 3000)
        );
        f
    })
}

pub(crate) fn fuzz_shard_index() {
    let strategy = (
        0..FIXTURES.len(),
        any::<bool>(),
        prop::collection::vec(idx_op(), 0..4),
        prop_oneof![4 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
    )
        .prop_map(|(fixture, split, ops, bytes)| IdxCase {
            fixture,
            split,
            ops,
            bytes,
        });
    fuzz(
        "shard_index",
        600,
        strategy,
        |c| c.clone(),
        |c| format!("{c:?}"),
        check_index,
    );
}

/// The fixtures' weights under a config with mutated sizes: a config that claims far more
/// layers or a far larger vocabulary than its weights must be refused cheaply.
pub(crate) fn fuzz_loader_config() {
    const SIZE_KEYS: &[&str] = &[
        "num_hidden_layers",
        "vocab_size",
        "hidden_size",
        "num_heads",
        "head_dim",
        "state_size",
        "n_groups",
        "conv_kernel",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "expand",
    ];
    let op = prop_oneof![
        3 => (0..SIZE_KEYS.len(), 0..27usize).prop_map(|(k, v)| (k, v, false)),
        1 => (0..SIZE_KEYS.len(), 0..FACTORS.len()).prop_map(|(k, f)| (k, f, true)),
    ];
    let strategy = (0..FIXTURES.len(), prop::collection::vec(op, 1..3));
    fuzz(
        "loader_config",
        600,
        strategy,
        |(fixture, ops)| {
            let base: serde_json::Value = serde_json::from_str(&FIXTURE[*fixture].config).unwrap();
            let ops: Vec<CfgOp> = ops
                .iter()
                .map(|&(k, v, scale)| {
                    let key = KeySel::Known(KEYS.iter().position(|x| *x == SIZE_KEYS[k]).unwrap());
                    if scale {
                        CfgOp::Scale(key, v)
                    } else {
                        CfgOp::Set(key, v)
                    }
                })
                .collect();
            (*fixture, mutate_config(&base, &ops))
        },
        |(fixture, config)| format!("{} with config.json:\n{config}", FIXTURES[*fixture]),
        |(fixture, config)| {
            let scratch = Scratch::new();
            std::fs::write(scratch.0.join("config.json"), config).unwrap();
            let (es, data) = entries(
                &FIXTURE[*fixture].tensors,
                FIXTURE[*fixture].metadata.as_deref(),
            );
            std::fs::write(
                scratch.0.join("model.safetensors"),
                safetensors_file(header_text(&es).as_bytes(), None, &data),
            )
            .unwrap();
            check_load(&scratch.0, None, None)
        },
    );
}
