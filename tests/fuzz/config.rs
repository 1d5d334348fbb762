use super::*;
use crate::safetensors::FIXTURES;

// ---------------------------------------------------------------------------------------
// The config parser
// ---------------------------------------------------------------------------------------

/// Real configs: the fixtures, the embedded model, and the formats of src/config.rs's tests.
static CONFIGS: LazyLock<Vec<(String, serde_json::Value)>> = LazyLock::new(|| {
    let mut texts: Vec<(String, String)> = FIXTURES
        .iter()
        .map(|d| format!("{d}/config.json"))
        .chain(["assets/config.json".to_string()])
        .map(|p| (p.clone(), bytes_to_text(read(&p))))
        .collect();
    let inline = [
        (
            "mamba_ssm",
            r#"{"d_model":768,"n_layer":24,"vocab_size":50277,"ssm_cfg":{"layer":"Mamba2","d_state":128,
            "headdim":64,"ngroups":1,"expand":2,"d_conv":4,"chunk_size":256,"dt_limit":[0.0,{"__float__":"Infinity"}]},
            "pad_vocab_size_multiple":16,"tie_embeddings":true,"rms_norm":true,"attn_layer_idx":[]}"#,
        ),
        (
            "mistral params.json",
            r#"{"dim":4096,"n_layers":64,"vocab_size":32768,"n_groups":8,"rms_norm":true,
            "residual_in_fp32":true,"fused_add_norm":true,"pad_vocab_size_multiple":1,
            "tie_embeddings":false,"model_type":"mamba"}"#,
        ),
        (
            "nemotron_h old names",
            r#"{"model_type":"nemotron_h","hidden_size":48,"vocab_size":100,"mamba_num_heads":8,
            "mamba_head_dim":12,"num_attention_heads":4,"num_key_value_heads":2,"attention_head_dim":16,
            "intermediate_size":96,"hybrid_override_pattern":"M*-M","mamba_n_groups":2,"mamba_d_conv":3,
            "num_nextn_predict_layers":1,"mlp_hidden_act":"relu2","max_position_embeddings":8192}"#,
        ),
        (
            "nemotron_h 8B shape",
            r#"{"model_type":"nemotron_h","hidden_size":4096,"vocab_size":131072,
            "hybrid_override_pattern":"M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
            "mamba_num_heads":128,"mamba_head_dim":64,"n_groups":8,"ssm_state_size":128,"conv_kernel":4,
            "chunk_size":128,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,
            "intermediate_size":21504,"mlp_hidden_act":"relu2","max_position_embeddings":8192,
            "layer_norm_epsilon":1e-5,"mamba_hidden_act":"silu","tie_word_embeddings":false}"#,
        ),
        (
            "hf mamba2 2.7b shape",
            r#"{"model_type":"mamba2","hidden_size":2560,"num_hidden_layers":64,"vocab_size":50288,
            "expand":2,"head_dim":64,"num_heads":80,"n_groups":1,"state_size":128,"conv_kernel":4,
            "chunk_size":256,"layer_norm_epsilon":1e-5,"tie_word_embeddings":true,"use_conv_bias":true,
            "use_bias":false,"rms_norm":true,"norm_before_gate":false,"time_step_limit":[0.0,{"__float__":"Infinity"}]}"#,
        ),
    ];
    texts.extend(inline.iter().map(|(n, t)| (n.to_string(), t.to_string())));
    texts
        .into_iter()
        .map(|(name, text)| {
            let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, v)
        })
        .collect()
});

/// Every field some parser reads (top level).
pub(crate) const KEYS: &[&str] = &[
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "expand",
    "head_dim",
    "num_heads",
    "n_groups",
    "state_size",
    "conv_kernel",
    "chunk_size",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "use_conv_bias",
    "time_step_limit",
    "use_bias",
    "rms_norm",
    "norm_before_gate",
    "hybrid_override_pattern",
    "layers_block_type",
    "num_nextn_predict_layers",
    "mamba_num_heads",
    "mamba_head_dim",
    "mamba_proj_bias",
    "mamba_hidden_act",
    "num_attention_heads",
    "num_key_value_heads",
    "attention_head_dim",
    "sliding_window",
    "mlp_hidden_act",
    "intermediate_size",
    "mlp_bias",
    "mamba_n_groups",
    "mamba_d_conv",
    "mamba_chunk_size",
    "ssm_state_size",
    "time_step_min",
    "max_position_embeddings",
    "d_model",
    "n_layer",
    "pad_vocab_size_multiple",
    "attn_layer_idx",
    "ssm_cfg",
    "norm_epsilon",
    "tie_embeddings",
    "dim",
    "n_layers",
    "norm_eps",
];

/// mamba_ssm's `ssm_cfg` fields.
const SSM_KEYS: &[&str] = &[
    "layer",
    "bias",
    "rmsnorm",
    "norm_before_gate",
    "D_has_hdim",
    "d_ssm",
    "expand",
    "headdim",
    "ngroups",
    "d_state",
    "d_conv",
    "chunk_size",
    "conv_bias",
    "dt_limit",
];

/// Values, as raw JSON text (so bare `NaN`/`Infinity` and out-of-range numbers can appear).
const VALUES: &[&str] = &[
    // integers, small to beyond u64
    "0",
    "1",
    "2",
    "3",
    "4",
    "7",
    "8",
    "16",
    "64",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "4294967297",
    "1000000000",
    "1099511627776",
    "9007199254740992",
    "9007199254740993",
    "4611686018427387904",
    "9223372036854775807",
    "9223372036854775808",
    "9223372036854775824",
    "18446744073709551615",
    "18446744073709551616",
    "-1",
    "-9223372036854775808",
    // floats and the spellings of non-finite ones
    "0.5",
    "-0.0",
    "0.0",
    "1.5",
    "2.0",
    "-1.0",
    "1e20",
    "1e308",
    "1e-320",
    "4294967296.0",
    "9007199254740992.0",
    "1.8446744073709552e19",
    "1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    "\"Infinity\"",
    "\"NaN\"",
    "\"-inf\"",
    "\"1e400\"",
    "\"1e20\"",
    "\"12\"",
    "{\"__float__\":\"Infinity\"}",
    "{\"__float__\":\"NaN\"}",
    "{\"__float__\":{\"__float__\":\"-Infinity\"}}",
    // wrong types
    "true",
    "false",
    "null",
    "[]",
    "[1,2]",
    "[0.0]",
    "[0.0,NaN]",
    "[1.0,0.5]",
    "[0.0,1.0,2.0]",
    "[\"x\",1]",
    "{}",
    "{\"a\":1}",
    "{\"layer\":\"Mamba2\",\"d_state\":4294967296}",
    "\"\"",
    "\"big\"",
    "\"M*-\"",
    "\"mamba\"",
    "\"mamba2\"",
    "\"nemotron_h\"",
    "\"Mamba2\"",
    "\"relu2\"",
    "\"silu\"",
    "\"gelu\"",
];

pub(crate) const FACTORS: &[u128] = &[0, 2, 3, 1000, 1 << 16, 1 << 32, 1 << 40];

#[derive(Clone, Debug)]
pub(crate) enum KeySel {
    /// A field the base config has.
    Present(Index),
    /// Any field a parser reads.
    Known(usize),
    /// A field of `ssm_cfg`.
    Ssm(usize),
}

#[derive(Clone, Debug)]
pub(crate) enum CfgOp {
    Set(KeySel, usize),
    Scale(KeySel, usize),
    Remove(KeySel),
    /// The key twice in the text: before the original (`false`: the original wins) or
    /// after it (`true`).
    Dup(usize, usize, bool),
}

fn key_sel() -> impl Strategy<Value = KeySel> {
    prop_oneof![
        3 => any::<Index>().prop_map(KeySel::Present),
        3 => (0..KEYS.len()).prop_map(KeySel::Known),
        1 => (0..SSM_KEYS.len()).prop_map(KeySel::Ssm),
    ]
}

fn cfg_op() -> impl Strategy<Value = CfgOp> {
    prop_oneof![
        6 => (key_sel(), 0..VALUES.len()).prop_map(|(k, v)| CfgOp::Set(k, v)),
        3 => (key_sel(), 0..FACTORS.len()).prop_map(|(k, f)| CfgOp::Scale(k, f)),
        2 => key_sel().prop_map(CfgOp::Remove),
        1 => (0..KEYS.len(), 0..VALUES.len(), any::<bool>()).prop_map(|(k, v, l)| CfgOp::Dup(k, v, l)),
    ]
}

/// A JSON value under construction; `Raw` holds text spliced in after serializing.
pub(crate) struct Raw(pub(crate) Vec<String>);

impl Raw {
    pub(crate) fn put(&mut self, text: String) -> serde_json::Value {
        self.0.push(text);
        serde_json::Value::String(format!("@@RAW{}@@", self.0.len() - 1))
    }
    pub(crate) fn render(&self, v: &serde_json::Value) -> String {
        let mut s = v.to_string();
        for (i, text) in self.0.iter().enumerate().rev() {
            s = s.replace(&format!("\"@@RAW{i}@@\""), text);
        }
        s
    }
}

/// The object a key lives in: the top level, or `ssm_cfg` (made an object if it is not).
fn slot(
    obj: &mut serde_json::Map<String, serde_json::Value>,
    nested: bool,
) -> &mut serde_json::Map<String, serde_json::Value> {
    if !nested {
        return obj;
    }
    let e = obj
        .entry("ssm_cfg")
        .or_insert_with(|| serde_json::json!({"layer": "Mamba2"}));
    if !e.is_object() {
        *e = serde_json::json!({"layer": "Mamba2"});
    }
    e.as_object_mut().unwrap()
}

/// Applies `ops` to config `base`, returning the text.
pub(crate) fn mutate_config(base: &serde_json::Value, ops: &[CfgOp]) -> String {
    let mut v = base.clone();
    let mut raw = Raw(Vec::new());
    let mut dups: Vec<(usize, usize, bool)> = Vec::new();
    for op in ops {
        let serde_json::Value::Object(obj) = &mut v else {
            break;
        };
        let key = |obj: &serde_json::Map<String, serde_json::Value>, k: &KeySel| match k {
            KeySel::Present(i) if !obj.is_empty() => {
                (false, obj.keys().nth(i.index(obj.len())).unwrap().clone())
            }
            KeySel::Present(_) => (false, "hidden_size".to_string()),
            KeySel::Known(i) => (false, KEYS[*i].to_string()),
            KeySel::Ssm(i) => (true, SSM_KEYS[*i].to_string()),
        };
        match op {
            CfgOp::Set(k, val) => {
                let (nested, name) = key(obj, k);
                let value = raw.put(VALUES[*val].to_string());
                slot(obj, nested).insert(name, value);
            }
            CfgOp::Scale(k, f) => {
                let (nested, name) = key(obj, k);
                let map = slot(obj, nested);
                if let Some(n) = map.get(&name).and_then(|x| x.as_u64()) {
                    let value = raw.put((n as u128 * FACTORS[*f]).to_string());
                    map.insert(name, value);
                }
            }
            CfgOp::Remove(k) => {
                let (nested, name) = key(obj, k);
                slot(obj, nested).remove(&name);
            }
            CfgOp::Dup(k, val, last) => dups.push((*k, *val, *last)),
        }
    }
    let mut text = raw.render(&v);
    for (k, val, last) in dups {
        let field = format!("\"{}\":{}", KEYS[k], VALUES[val]);
        if text.starts_with('{') && text.ends_with('}') {
            if last {
                text.insert_str(text.len() - 1, &format!(",{field}"));
            } else {
                text.insert_str(1, &format!("{field},"));
            }
        }
    }
    text
}

/// u128 arithmetic where `None` means "beyond u128" (certainly beyond usize).
#[derive(Clone, Copy, Debug, PartialEq)]
struct N(Option<u128>);

impl std::ops::Add for N {
    type Output = N;
    fn add(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_add(b)))
    }
}

impl std::ops::Mul for N {
    type Output = N;
    fn mul(self, o: N) -> N {
        N(self.0.zip(o.0).and_then(|(a, b)| a.checked_mul(b)))
    }
}

fn n(x: usize) -> N {
    N(Some(x as u128))
}

impl std::fmt::Display for N {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(x) => write!(f, "{x}"),
            None => write!(f, "> 2^128"),
        }
    }
}

/// An exact size that must fit `usize`; then the library's value must equal it.
fn same(name: &str, exact: N, lib: impl FnOnce() -> usize) -> Check {
    match exact.0 {
        Some(x) if x <= usize::MAX as u128 => {
            let got = lib();
            if got as u128 != x {
                return Err(fail(
                    format!("[wrong size] {name}"),
                    format!("{name}() = {got}, exactly {x} (an arithmetic wrap)"),
                ));
            }
            Ok(())
        }
        _ => Err(fail(
            format!("[overflow] {name}"),
            format!("{name} = {exact} does not fit usize, yet the config was accepted"),
        )),
    }
}

fn fits_u32(name: &str, exact: N) -> Check {
    match exact.0 {
        Some(x) if x <= u32::MAX as u128 => Ok(()),
        _ => Err(fail(
            format!("[u32] {name}"),
            format!(
                "{name} = {exact} exceeds u32::MAX, yet the config was accepted (the kernels take it as u32)"
            ),
        )),
    }
}

/// What an accepted config promises: its invariants hold, every derived size computes
/// exactly, and what the kernels index with fits u32.
fn check_config(c: &ModelConfig) -> Check {
    let invariant = |ok: bool, what: &str| -> Check {
        if ok {
            Ok(())
        } else {
            Err(fail(
                format!("[invariant] {what}"),
                format!("accepted a config with {what}: {c:?}"),
            ))
        }
    };
    invariant(c.d_conv >= 2, "d_conv < 2")?;
    invariant(c.n_groups > 0 && c.n_heads > 0, "zero heads or groups")?;
    invariant(c.blocks.len() == c.n_layer, "blocks.len() != n_layer")?;
    let count = |k: BlockKind| n(c.blocks.iter().filter(|&&b| b == k).count());
    let (m, att, mlp) = (
        count(BlockKind::Mamba2),
        count(BlockKind::Attention),
        count(BlockKind::Mlp),
    );
    let (d, v, di, h, p, g, st, k) = (
        n(c.d_model),
        n(c.vocab_size),
        n(c.d_inner),
        n(c.n_heads),
        n(c.head_dim),
        n(c.n_groups),
        n(c.d_state),
        n(c.d_conv),
    );
    let two = n(2);
    let conv_dim = di + two * g * st;
    let d_in_proj = two * di + two * g * st + h;
    let ssm = h * p * st;
    let conv_state = conv_dim * n(c.d_conv - 1);
    let state_bytes = n(4) * m * (ssm + conv_state);
    let (qkv, qw, kw) = match &c.attention {
        Some(a) => (
            (n(a.heads) + two * n(a.kv_heads)) * n(a.head_dim),
            n(a.heads) * n(a.head_dim),
            n(a.kv_heads) * n(a.head_dim),
        ),
        None => (n(0), n(0), n(0)),
    };
    let kv_bytes = if c.attention.is_some() {
        two * kw * n(4) * att
    } else {
        n(0)
    };
    let mamba_params = d_in_proj * d
        + conv_dim * k
        + if c.conv_bias { conv_dim } else { n(0) }
        + n(3) * h
        + di
        + d * di;
    let att_params = match &c.attention {
        Some(a) => qkv * d + d * qw + if a.bias { qkv + d } else { n(0) },
        None => n(0),
    };
    let mlp_params = match &c.mlp {
        Some(ml) => {
            let ups = n(if ml.act == mamba2_wgpu::config::MlpAct::SiluGated {
                2
            } else {
                1
            });
            let bias = if ml.bias {
                ups * n(ml.intermediate) + d
            } else {
                n(0)
            };
            (ups + n(1)) * n(ml.intermediate) * d + bias
        }
        None => n(0),
    };
    let moe = count(BlockKind::Moe);
    let gated = |a| {
        n(if a == mamba2_wgpu::config::MlpAct::SiluGated {
            2
        } else {
            1
        })
    };
    let moe_params = match &c.moe {
        Some(mo) => {
            let (e, i) = (n(mo.experts), n(mo.intermediate));
            // The routed experts read and write the latent width when there is one.
            let x = mo.latent.map_or(d, n);
            let router = e * d;
            let bias = if mo.has_correction_bias() { e } else { n(0) };
            let experts = e * (gated(mo.act) * i * x + x * i);
            let latent = mo.latent.map_or(n(0), |l| n(2) * n(l) * d);
            let shared = match &mo.shared {
                Some(s) => (gated(s.act) + n(1)) * n(s.intermediate) * d,
                None => n(0),
            };
            router + bias + experts + shared + latent
        }
        None => n(0),
    };
    let layers = m * (d + mamba_params)
        + att * (d + att_params)
        + mlp * (d + mlp_params)
        + moe * (d + moe_params);
    let head = if c.tie_embeddings { n(0) } else { v * d };
    let params = v * d + layers + d + head;

    // What the kernels take as u32: sizes, state lengths, and each tensor's element count.
    for (name, x) in [
        ("d_model", d),
        ("vocab_size", v),
        ("vocab_size × d_model (embedding)", v * d),
    ] {
        fits_u32(name, x)?;
    }
    if m != n(0) {
        for (name, x) in [
            ("d_inner", di),
            ("conv_dim", conv_dim),
            ("d_in_proj", d_in_proj),
            ("ssm_state_len", ssm),
            ("conv_state_len", conv_state),
            ("d_in_proj × d_model (in_proj)", d_in_proj * d),
            ("conv_dim × d_conv (conv1d)", conv_dim * k),
            ("d_model × d_inner (out_proj)", d * di),
            ("chunk_size", n(c.chunk_size)),
        ] {
            fits_u32(name, x)?;
        }
    }
    if att != n(0) {
        for (name, x) in [
            ("qkv_rows", qkv),
            ("qkv_rows × d_model (q/k/v)", qkv * d),
            ("q_width × d_model (o_proj)", qw * d),
        ] {
            fits_u32(name, x)?;
        }
    }
    if mlp != n(0)
        && let Some(ml) = &c.mlp
    {
        fits_u32("intermediate_size × d_model", n(ml.intermediate) * d)?;
    }
    if moe != n(0)
        && let Some(mo) = &c.moe
    {
        let (e, i) = (n(mo.experts), n(mo.intermediate));
        let x = mo.latent.map_or(d, n);
        fits_u32("experts × up rows × width", e * gated(mo.act) * i * x)?;
        fits_u32("experts × width × intermediate", e * x * i)?;
        invariant(
            (1..=mo.experts).contains(&mo.top_k),
            "num_experts_per_tok outside 1..=experts",
        )?;
    }
    // Every derived size the config exposes computes exactly.
    same("conv_dim", conv_dim, || c.conv_dim())?;
    same("d_in_proj", d_in_proj, || c.d_in_proj())?;
    same("ssm_state_len", ssm, || c.ssm_state_len())?;
    same("conv_state_len", conv_state, || c.conv_state_len())?;
    same("state_bytes", state_bytes, || c.state_bytes())?;
    same("kv_bytes_per_token(4)", kv_bytes, || {
        c.kv_bytes_per_token(4)
    })?;
    same("param_count", params, || c.param_count())?;
    if let Some(a) = &c.attention {
        same("qkv_rows", qkv, || a.qkv_rows())?;
        same("q_width", qw, || a.q_width())?;
        same("kv_width", kw, || a.kv_width())?;
        let _ = a.dims();
    }
    let _ = (
        c.group_size(),
        c.heads_per_group(),
        c.pattern(),
        c.is_hybrid(),
    );
    // What `Model::save` writes reads back as the same model.
    let json = c.to_hf_json().to_string();
    match ModelConfig::from_json_str(&json, Path::new("config.json")) {
        Ok(back) => {
            let key = |c: &ModelConfig| {
                (
                    (
                        c.d_model,
                        c.n_layer,
                        c.vocab_size,
                        c.d_inner,
                        c.n_heads,
                        c.head_dim,
                    ),
                    (
                        c.n_groups,
                        c.d_state,
                        c.d_conv,
                        c.chunk_size,
                        c.tie_embeddings,
                        c.conv_bias,
                    ),
                    c.blocks.clone(),
                )
            };
            if key(&back) != key(c)
                || back.attention != c.attention
                || back.mlp != c.mlp
                || back.moe != c.moe
                || back.scales != c.scales
                || back.norm_eps != c.norm_eps
            {
                return Err(fail(
                    "[round trip] to_hf_json reads back as another model",
                    format!("{c:?}\n  wrote {json}\n  read back {back:?}"),
                ));
            }
        }
        Err(e) => {
            return Err(fail(
                "[round trip] to_hf_json does not read back",
                format!("{e}\n  wrote {json}"),
            ));
        }
    }
    Ok(())
}

fn parse_and_check(text: &str) -> Check {
    match ModelConfig::from_json_str(text, Path::new("config.json")) {
        Ok(c) => check_config(&c),
        Err(e) => {
            let msg = e.to_string();
            if msg.is_empty() {
                return Err(fail("[error] empty message", ""));
            }
            Ok(())
        }
    }
}

pub(crate) fn fuzz_config_values() {
    let strategy = (0..CONFIGS.len(), prop::collection::vec(cfg_op(), 1..5));
    fuzz(
        "config_values",
        16000,
        strategy,
        |(base, ops)| mutate_config(&CONFIGS[*base].1, ops),
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}

/// Layer pattern spellings: a string of letters or a list of names.
#[derive(Clone, Debug)]
struct PatternCase {
    base: usize,
    list: bool,
    len: usize,
    alphabet: usize,
    seed: u64,
    /// `num_hidden_layers`: 0 the pattern's length, 1 absent, 2.. a `VALUES` entry.
    layers: usize,
    ops: Vec<CfgOp>,
}

const PATTERN_LENS: &[usize] = &[0, 1, 2, 3, 7, 64, 1000, 65536, 1 << 20];
const LETTERS: &[&[&str]] = &[
    &["M"],
    &["M", "*", "-"],
    &["M", "*", "-", "E"],
    &["M", "*", "-", "X", "m", " ", "é", "\u{0}", "\u{1F600}"],
];
const NAMES: &[&[&str]] = &[
    &["mamba", "attention", "mlp"],
    &["linear_attention", "full_attention", "mlp", "moe"],
    &["M", "*", "-", "", "Mamba", "\u{0}", "attention "],
];

fn pattern_case() -> impl Strategy<Value = PatternCase> {
    (
        0..4usize,
        any::<bool>(),
        prop_oneof![
            16 => 0..PATTERN_LENS.len() - 2,
            1 => PATTERN_LENS.len() - 2..PATTERN_LENS.len(),
        ],
        0..4usize,
        any::<u64>(),
        prop_oneof![4 => Just(0usize), 1 => Just(1usize), 2 => 2..VALUES.len() + 2],
        prop::collection::vec(cfg_op(), 0..3),
    )
        .prop_map(
            |(base, list, len, alphabet, seed, layers, ops)| PatternCase {
                base,
                list,
                len: PATTERN_LENS[len],
                alphabet,
                seed,
                layers,
                ops,
            },
        )
}

/// Nemotron-H bases: the three fixtures and the 8B shape.
fn nemotron_base(i: usize) -> &'static serde_json::Value {
    let names = [
        "tests/fixtures/nemotron_h_g2/config.json",
        "tests/fixtures/nemotron_h_hybrid/config.json",
        "tests/fixtures/nemotron_h_mqa/config.json",
        "nemotron_h 8B shape",
    ];
    &CONFIGS.iter().find(|(n, _)| n == names[i]).unwrap().1
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn pattern_config(p: &PatternCase) -> String {
    let mut v = nemotron_base(p.base).clone();
    let obj = v.as_object_mut().unwrap();
    obj.remove("hybrid_override_pattern");
    obj.remove("layers_block_type");
    let mut s = p.seed | 1;
    let pick =
        |s: &mut u64, from: &[&'static str]| from[(xorshift(s) % from.len() as u64) as usize];
    if p.list {
        let names = NAMES[p.alphabet % NAMES.len()];
        let list: Vec<serde_json::Value> = (0..p.len)
            .map(|_| {
                if xorshift(&mut s).is_multiple_of(97) {
                    serde_json::Value::from(1)
                } else {
                    pick(&mut s, names).into()
                }
            })
            .collect();
        obj.insert("layers_block_type".into(), list.into());
    } else {
        let letters = LETTERS[p.alphabet];
        let pattern: String = (0..p.len).map(|_| pick(&mut s, letters)).collect();
        obj.insert("hybrid_override_pattern".into(), pattern.into());
    }
    match p.layers {
        0 => {
            obj.insert("num_hidden_layers".into(), p.len.into());
        }
        1 => {
            obj.remove("num_hidden_layers");
        }
        _ => {}
    }
    let mut ops = p.ops.clone();
    if p.layers >= 2 {
        ops.push(CfgOp::Set(
            KeySel::Known(KEYS.iter().position(|k| *k == "num_hidden_layers").unwrap()),
            p.layers - 2,
        ));
    }
    mutate_config(&v, &ops)
}

pub(crate) fn fuzz_config_patterns() {
    fuzz(
        "config_patterns",
        400,
        pattern_case(),
        pattern_config,
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}

pub(crate) fn fuzz_config_bytes() {
    let strategy = (
        0..CONFIGS.len(),
        prop::collection::vec(cfg_op(), 0..3),
        prop::collection::vec(byte_op(), 1..5),
    );
    fuzz(
        "config_bytes",
        16000,
        strategy,
        |(base, ops, bytes)| {
            let text = mutate_config(&CONFIGS[*base].1, ops);
            bytes_to_text(apply_bytes(text.into_bytes(), bytes))
        },
        |text| text.clone(),
        |text| parse_and_check(text),
    );
}
