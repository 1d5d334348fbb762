#!/usr/bin/env python3
"""External-oracle fixtures for mamba2-wgpu, made with HF transformers on the CPU in float32.

Writes four folders under --out (default tests/fixtures):

  hf_mamba2_g1/       HF Mamba2ForCausalLM (model_type mamba2), random tiny, n_groups = 1, tied embeddings
  nemotron_h_g2/      HF NemotronHForCausalLM, all-Mamba layers, n_groups = 2, head_dim 12, untied lm_head
  nemotron_h_hybrid/  HF NemotronHForCausalLM, pattern "M*-M-*M" (Mamba2, GQA attention 4 q / 2 kv heads of
                      head_dim 16 != hidden / heads, relu2 MLP), n_groups = 2, untied lm_head
  nemotron_h_mqa/     HF NemotronHForCausalLM, pattern "*M-M*" (attention first; multi-query: 4 q / 1 kv head
                      of head_dim 24), n_groups = 4, MLP with biases, untied lm_head

Each folder holds config.json + model.safetensors exactly as `save_pretrained` writes them (f32),
oracle.safetensors (prompt_ids, prompt_logits, greedy_ids, greedy_logits, prompt_nll),
versions.json and README.md.

Everything is deterministic (fixed seeds, CPU, float32, no TF32, deterministic algorithms), so the
same command gives the same weights bit for bit on any machine with the same torch version, and
the same logits up to CPU float rounding.

Greedy continuations are computed by full forwards with use_cache=False (NemotronH's generate
fails without attention layers), which is faithful to the chunked (prefill) path of the model:
greedy_logits[i] are the last-position logits of a fresh forward over prompt + greedy_ids[:i].

The hybrid fixtures scale their weight matrices up (random init at initializer_range 0.1 gives a model whose
greedy continuation repeats a few tokens): every 2-D weight x8, except q_proj and k_proj x2, which keeps the
attention softmax spread over several keys (largest weight ~0.3-0.5, not one-hot), and the dt rows of the Mamba
in_proj (x1), which keeps delta = softplus(dt + dt_bias) clear of NemotronH's prefill-only clamp at time_step_min.
Their seeds must pass stricter checks: top1-top2 gap >= 0.05 along the greedy path, >= 10 distinct greedy ids
and no period <= 6 in the last 12.
Their attention runs the `eager` implementation (the plain formula; sdpa agreement is checked and printed).

Usage:  python3 scripts/make_fixtures.py --out tests/fixtures
        python3 scripts/make_fixtures.py --out tests/fixtures --only nemotron_h_mqa   (one fixture alone)
"""

import argparse
import functools
import json
import os
import platform
import shutil
import sys

import torch
import transformers
import safetensors
from safetensors.torch import save_file, load_file

PROMPT_LEN = 37  # not a multiple of chunk_size (16)
N_GREEDY = 24
MIN_MARGIN = 1e-3  # smallest allowed top1 - top2 logit gap along the greedy path
MIN_DISTINCT = 4  # greedy ids must hold at least this many distinct tokens
# Stricter checks for the hybrid fixtures, whose scaled-up logits have a std of ~5-7.
HYBRID_MIN_MARGIN = 0.05
HYBRID_MIN_DISTINCT = 10
PERIOD_TAIL = 12  # the last PERIOD_TAIL greedy ids must have no period <= MAX_PERIOD
MAX_PERIOD = 6
HYBRID_WEIGHT_SCALE = 8.0  # every 2-D weight (embeddings, lm_head, all projections) ...
HYBRID_QK_SCALE = 2.0  # ... except q_proj / k_proj, which get this factor instead, and in_proj's dt rows (x1)
BIAS_STD = 1.0  # N(0, BIAS_STD) noise added to projection biases (zero at init)


def setup_torch():
    torch.set_default_dtype(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(min(4, os.cpu_count() or 1))


def versions():
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
    }


def perturb(model, gen):
    """Move every norm weight, D, conv1d.bias, dt_bias and A_log away from its init."""
    touched = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.split(".")[-2:]
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                # block norms, mixer gated norm, final norm: multiply by U(0.5, 1.5)
                p.mul_(torch.rand(p.shape, generator=gen) + 0.5)
            elif leaf[-1] == "dt_bias":
                # The init (inverse softplus of U[0.001, 0.1]) gives tiny deltas, which make the SSM nearly
                # an identity and can touch NemotronH's delta >= time_step_min clamp: use U(-1.5, 1.0) instead,
                # so delta = softplus(dt + dt_bias) is mostly 0.1 .. 2 and the decay exp(delta * A) matters.
                p.copy_(torch.rand(p.shape, generator=gen) * 2.5 - 1.5)
            elif leaf[-1] in ("D", "A_log") or name.endswith("conv1d.bias"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            elif leaf[-1] == "bias" and leaf[-2].endswith("_proj"):
                # projection biases (hybrid fixtures with mlp_bias; the Mamba-only ones have none): zero at init
                p.add_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            else:
                continue
            touched.append(name)
    return touched


@torch.no_grad()
def logits_of(model, ids):
    out = model(input_ids=ids[None, :], use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def greedy(model, prompt_ids, prompt_logits, n):
    ids = prompt_ids.clone()
    g_ids, g_logits = [], []
    last = prompt_logits[-1]
    for i in range(n):
        if i > 0:
            last = logits_of(model, ids)[-1]
        nxt = int(torch.argmax(last))
        g_ids.append(nxt)
        g_logits.append(last.clone())
        ids = torch.cat([ids, torch.tensor([nxt], dtype=torch.int64)])
    return torch.tensor(g_ids, dtype=torch.int64), torch.stack(g_logits)


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def tail_period(ids, tail=PERIOD_TAIL, max_period=MAX_PERIOD):
    """Smallest p <= max_period with ids[i] == ids[i + p] over the last `tail` ids, else None."""
    t = list(ids)[-tail:]
    for p in range(1, max_period + 1):
        if all(t[i] == t[i + p] for i in range(len(t) - p)):
            return p
    return None


def build_mamba2_g1(seed):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        expand=2,
        head_dim=16,
        num_heads=8,  # 64 * 2 / 16
        n_groups=1,
        state_size=16,
        conv_kernel=4,
        chunk_size=16,
        use_conv_bias=True,
        use_bias=False,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        residual_in_fp32=True,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(cfg).float().eval()
    return model


def build_nemotron_h_g2(seed):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=101,
        hidden_size=48,
        hybrid_override_pattern="MMM",  # becomes layers_block_type = ["linear_attention"] * 3
        mamba_num_heads=8,
        mamba_head_dim=12,  # not a power of two; d_inner = 96
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        use_conv_bias=True,
        use_bias=False,
        mamba_proj_bias=False,
        mamba_hidden_act="silu",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        use_mamba_kernels=False,
        initializer_range=0.1,
        residual_in_fp32=True,
        num_logits_to_keep=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).float().eval()
    return model


def nemotron_checks(model, prompt_ids):
    """Diagnostics: smallest delta before the clamp, and how much a whole-d_inner norm would differ."""
    info = {}
    mins = []
    # smallest softplus(dt + dt_bias) over the prompt, per layer
    with torch.no_grad():
        h = model.model.embeddings(prompt_ids[None])
        for layer in model.model.layers:
            mixer = layer.mixer
            x = layer.norm(h)
            proj = mixer.in_proj(x)
            dt = proj[..., -mixer.num_heads:]
            delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
            mins.append(float(delta.min()))
            h = h + mixer(x)
    info["min_delta_per_layer"] = mins
    info["time_step_min_clamp"] = model.config.time_step_min
    # A whole-d_inner gated norm (the G = 1 formula) must give visibly different logits.
    ref = logits_of(model, prompt_ids)
    saved = [l.mixer.norm.group_size for l in model.model.layers]
    for l in model.model.layers:
        l.mixer.norm.group_size = l.mixer.intermediate_size
    wrong = logits_of(model, prompt_ids)
    for l, g in zip(model.model.layers, saved):
        l.mixer.norm.group_size = g
    info["max_abs_logit_diff_if_norm_not_grouped"] = float((ref - wrong).abs().max())
    return info


# The two hybrid fixtures: every dense Nemotron-H block kind (M Mamba2, * attention, - MLP).
HYBRIDS = {
    "nemotron_h_hybrid": dict(
        seed=5000,
        pattern="M*-M-*M",
        hidden_size=48,
        mamba_num_heads=8,
        mamba_head_dim=12,  # d_inner 96
        n_groups=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: q head h reads kv head h // 2
        head_dim=16,  # != hidden_size / num_attention_heads = 12
        intermediate_size=96,
        mlp_bias=False,
    ),
    "nemotron_h_mqa": dict(
        seed=6000,
        pattern="*M-M*",
        hidden_size=64,
        mamba_num_heads=8,
        mamba_head_dim=16,  # d_inner 128
        n_groups=4,
        num_attention_heads=4,
        num_key_value_heads=1,  # multi-query
        head_dim=24,  # != hidden_size / num_attention_heads = 16, not a power of two
        intermediate_size=128,
        mlp_bias=True,  # up_proj.bias / down_proj.bias present (perturbed)
    ),
}


def build_nemotron_h_hybrid(seed, *, pattern, hidden_size, mamba_num_heads, mamba_head_dim, n_groups,
                            num_attention_heads, num_key_value_heads, head_dim, intermediate_size, mlp_bias):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=101,
        hidden_size=hidden_size,
        hybrid_override_pattern=pattern,  # saved as layers_block_type (linear_attention / full_attention / mlp)
        mamba_num_heads=mamba_num_heads,
        mamba_head_dim=mamba_head_dim,
        n_groups=n_groups,
        ssm_state_size=16,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        use_conv_bias=True,
        use_bias=False,
        mamba_proj_bias=False,
        mamba_hidden_act="silu",
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        attention_bias=False,  # transformers 5.17 NemotronHAttention ignores it (q/k/v/o are bias=False)
        attention_dropout=0.0,
        intermediate_size=intermediate_size,
        mlp_hidden_act="relu2",
        mlp_bias=mlp_bias,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        use_mamba_kernels=False,
        initializer_range=0.1,
        residual_in_fp32=True,
        num_logits_to_keep=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).float().eval()
    model.set_attn_implementation("eager")  # the plain formula (not saved in config.json)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 2:
                continue
            if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
                p.mul_(HYBRID_QK_SCALE)
            elif name.endswith("mixer.in_proj.weight"):
                # z and xBC rows scaled; the last mamba_num_heads rows (dt) keep the init, or
                # softplus(dt + dt_bias) would reach NemotronH's prefill-only clamp at time_step_min
                p[: -mamba_num_heads].mul_(HYBRID_WEIGHT_SCALE)
            else:
                p.mul_(HYBRID_WEIGHT_SCALE)
    return model


@torch.no_grad()
def cached_greedy(model, prompt_ids, n):
    """transformers' own cached path: one prefill forward, then one-token steps with the cache (no generate(),
    whose logits processors and eos handling would get in the way)."""
    out = model(input_ids=prompt_ids[None, :], use_cache=True)
    cache, last = out.past_key_values, out.logits[0, -1].float()
    ids, logits = [], []
    for i in range(n):
        nxt = int(torch.argmax(last))
        ids.append(nxt)
        logits.append(last.clone())
        if i + 1 < n:
            out = model(input_ids=torch.tensor([[nxt]], dtype=torch.int64), past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[0, -1].float()
    return torch.tensor(ids, dtype=torch.int64), torch.stack(logits)


def hybrid_checks(model, prompt_ids, greedy_ids, greedy_logits):
    """Diagnostics for the hybrid fixtures: what a wrong formula would change, and the dt clamp."""
    from transformers.models.nemotron_h import modeling_nemotron_h as mnh

    info = {}
    layers = model.model.layers
    kinds = [l.block_type for l in layers]
    mamba = [l for l in layers if l.block_type == "linear_attention"]
    attn = [l for l in layers if l.block_type == "full_attention"]
    mlp = [l for l in layers if l.block_type == "mlp"]
    ref = logits_of(model, prompt_ids)

    # smallest softplus(dt + dt_bias) per Mamba layer, from the mixer's own input (captured by a hook)
    seen = {}
    hooks = [l.mixer.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach()))
             for i, l in enumerate(layers) if l.block_type == "linear_attention"]
    attn_maxp = []
    with torch.no_grad():
        out = model(input_ids=prompt_ids[None, :], use_cache=False, output_attentions=True)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        mins = []
        for i, l in enumerate(layers):
            if l.block_type != "linear_attention":
                continue
            dt = l.mixer.in_proj(seen[i])[..., -l.mixer.num_heads:]
            mins.append(float(torch.nn.functional.softplus(dt + l.mixer.dt_bias).min()))
    info["min_delta_per_mamba_layer"] = mins
    info["time_step_min_clamp"] = model.config.time_step_min
    # how spread the attention is: mean over heads and positions >= 8 of the largest softmax weight
    for a in out.attentions:
        if a is not None:
            attn_maxp.append(round(float(a[0].max(-1).values[:, 8:].mean()), 3))
    info["attention_mean_max_weight_per_layer"] = attn_maxp

    def diff_with(fn_on, fn_off):
        fn_on()
        try:
            return float((logits_of(model, prompt_ids) - ref).abs().max())
        finally:
            fn_off()

    # (1) whole-d_inner gated norm instead of per group
    saved = [l.mixer.norm.group_size for l in mamba]
    info["max_abs_logit_diff_if_norm_not_grouped"] = diff_with(
        lambda: [setattr(l.mixer.norm, "group_size", l.mixer.intermediate_size) for l in mamba],
        lambda: [setattr(l.mixer.norm, "group_size", g) for l, g in zip(mamba, saved)])
    # (2) softmax scale 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim)
    wrong = (model.config.hidden_size // model.config.num_attention_heads) ** -0.5
    right = [l.mixer.scaling for l in attn]
    info["max_abs_logit_diff_if_scale_used_hidden_over_heads"] = diff_with(
        lambda: [setattr(l.mixer, "scaling", wrong) for l in attn],
        lambda: [setattr(l.mixer, "scaling", r) for l, r in zip(attn, right)])
    # (3) GQA head mapping h % Hkv (tiled) instead of h // (H / Hkv) (interleaved): only when 1 < Hkv < H
    if 1 < model.config.num_key_value_heads < model.config.num_attention_heads:
        orig = mnh.repeat_kv
        info["max_abs_logit_diff_if_kv_head_is_h_mod_hkv"] = diff_with(
            lambda: setattr(mnh, "repeat_kv", lambda x, n: x.repeat(1, n, 1, 1)),
            lambda: setattr(mnh, "repeat_kv", orig))
    # (4) relu instead of relu2 in the MLP
    acts = [l.mixer.act_fn for l in mlp]
    info["max_abs_logit_diff_if_mlp_act_is_relu"] = diff_with(
        lambda: [setattr(l.mixer, "act_fn", torch.nn.ReLU()) for l in mlp],
        lambda: [setattr(l.mixer, "act_fn", a) for l, a in zip(mlp, acts)])
    # (5) MLP biases dropped
    if model.config.mlp_bias:
        biases = [(l.mixer.up_proj, l.mixer.up_proj.bias, l.mixer.down_proj, l.mixer.down_proj.bias) for l in mlp]
        info["max_abs_logit_diff_if_mlp_bias_dropped"] = diff_with(
            lambda: [(setattr(u, "bias", None), setattr(d, "bias", None)) for u, _, d, _ in biases],
            lambda: [(setattr(u, "bias", ub), setattr(d, "bias", db)) for u, ub, d, db in biases])
    # (6) the same model through torch sdpa (transformers' default attention implementation)
    model.set_attn_implementation("sdpa")
    try:
        info["max_abs_logit_diff_sdpa_vs_eager"] = float((logits_of(model, prompt_ids) - ref).abs().max())
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(logits_of(model, prompt_ids), ref), "diagnostics left the model changed"
    # (7) transformers' cached decode (Mamba recurrent step + KV cache) against the uncached oracle
    c_ids, c_logits = cached_greedy(model, prompt_ids, len(greedy_ids))
    info["cached_decode_greedy_ids_equal"] = bool(torch.equal(c_ids, greedy_ids))
    info["max_abs_logit_diff_cached_decode"] = float((c_logits - greedy_logits).abs().max())
    info["layer_kinds"] = kinds
    return info


def make_one(name, builder, base_seed, out_root, vocab, min_margin=MIN_MARGIN, min_distinct=MIN_DISTINCT,
             check_period=False, load_kwargs=None):
    for attempt in range(50):
        seed = base_seed + attempt
        model = builder(seed)
        gen = torch.Generator().manual_seed(seed + 1000)
        touched = perturb(model, gen)
        prompt_ids = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen, dtype=torch.int64)
        prompt_logits = logits_of(model, prompt_ids)
        g_ids, g_logits = greedy(model, prompt_ids, prompt_logits, N_GREEDY)
        m = margins(g_logits)
        distinct = len(set(g_ids.tolist()))
        print(
            f"[{name}] seed {seed}: greedy distinct={distinct} min top1-top2 gap={float(m.min()):.5f} "
            f"logit std={float(prompt_logits.std()):.3f}"
        )
        period = tail_period(g_ids.tolist()) if check_period else None
        if check_period:
            print(f"[{name}] seed {seed}: greedy_ids = {g_ids.tolist()}  tail period = {period}  "
                  f"max |logit| = {float(prompt_logits.abs().max()):.3f}")
        if float(m.min()) >= min_margin and distinct >= min_distinct and period is None:
            break
        print(f"[{name}] seed {seed} rejected, trying the next one")
    else:
        raise SystemExit(f"{name}: no acceptable seed found")

    # consistency: greedy_logits[0] == prompt_logits[T-1] (same tensor by construction)
    assert torch.equal(g_logits[0], prompt_logits[-1])
    # the last-token logits of a longer forward must agree with the prompt logits (causality)
    check = logits_of(model, torch.cat([prompt_ids, g_ids[:5]]))[:PROMPT_LEN]
    causal_diff = float((check - prompt_logits).abs().max())
    print(f"[{name}] causality check (prefix logits of a longer forward): max |diff| = {causal_diff:.3e}")

    lp = torch.log_softmax(prompt_logits[:-1].double(), dim=-1)
    nll = -lp.gather(1, prompt_ids[1:, None]).mean()
    prompt_nll = nll.reshape(1).to(torch.float64)
    print(f"[{name}] prompt_nll = {float(prompt_nll):.6f}  greedy_ids = {g_ids.tolist()}")

    out = os.path.join(out_root, name)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    model.save_pretrained(out, safe_serialization=True)
    save_file(
        {
            "prompt_ids": prompt_ids.contiguous(),
            "prompt_logits": prompt_logits.contiguous(),
            "greedy_ids": g_ids.contiguous(),
            "greedy_logits": g_logits.contiguous(),
            "prompt_nll": prompt_nll.contiguous(),
        },
        os.path.join(out, "oracle.safetensors"),
    )  # no metadata: its key order is not stable, and the files should be byte-identical run to run
    # Reload to verify what was written.
    sd = load_file(os.path.join(out, "model.safetensors"))
    print(f"[{name}] model.safetensors tensors:")
    for k in sorted(sd):
        print(f"    {k:45s} {str(sd[k].dtype):14s} {list(sd[k].shape)}")
    assert all(v.dtype == torch.float32 for v in sd.values()), "weights must be f32"
    # Round trip: from_pretrained on the saved folder must give the same logits (catches names that
    # would silently load as random init, e.g. the backbone./model. renaming NemotronH does on save).
    reloaded = type(model).from_pretrained(out, dtype=torch.float32, **(load_kwargs or {})).eval()
    rt = logits_of(reloaded, prompt_ids)
    rt_diff = float((rt - prompt_logits).abs().max())
    print(f"[{name}] reload round trip: max |diff| = {rt_diff:.3e}")
    assert rt_diff == 0.0, "reloaded model differs"
    return model, seed, touched, float(m.min()), causal_diff, prompt_nll, sd


def write_readme(out, name, what, seed, min_margin, extra, vers):
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"# Fixture `{name}`\n\n")
        f.write(what + "\n\n")
        f.write(
            "Made by `python3 scripts/make_fixtures.py --out tests/fixtures` (from the repo root), "
            f"on the CPU in float32, model seed {seed} (the script starts at a fixed seed and moves to the next "
            "one only if the greedy path is degenerate or has a top1-top2 logit gap below 1e-3).\n\n"
            f"Versions: transformers {vers['transformers']}, torch {vers['torch']}, safetensors "
            f"{vers['safetensors']}, python {vers['python']} (also in versions.json).\n\n"
            "Files:\n"
            "- `config.json`, `model.safetensors`: exactly as `save_pretrained(dir, safe_serialization=True)` "
            "wrote them (f32). Every norm weight (block `norm`, `mixer.norm`, `norm_f`) was multiplied by U(0.5, 1.5) "
            "and N(0, 0.3) noise was added to `D`, `A_log` and `conv1d.bias` before saving, and `dt_bias` was "
            "replaced by U(-1.5, 1.0) (so delta = softplus(dt + dt_bias) is mostly 0.1 .. 2, not the init's "
            "0.001 .. 0.1), so a wrong formula shows.\n"
            f"- `oracle.safetensors`: `prompt_ids` int64 [{PROMPT_LEN}] (random ids; {PROMPT_LEN} is not a multiple "
            "of chunk_size 16); `prompt_logits` f32 [T, V] from one full forward (use_cache=False); "
            f"`greedy_ids` int64 [{N_GREEDY}]; `greedy_logits` f32 [{N_GREEDY}, V] where greedy_logits[i] is the "
            "last-position logits of a fresh full forward over prompt + greedy_ids[:i] and greedy_ids[i] is its "
            "argmax (greedy_logits[0] == prompt_logits[T-1]); `prompt_nll` f64 [1] = mean over t of "
            "-log_softmax(prompt_logits[t])[prompt_ids[t+1]], t = 0..T-2, computed in float64.\n"
            f"- Smallest top1-top2 gap along the greedy path: {min_margin:.4f}.\n"
        )
        if extra:
            f.write("\n" + extra + "\n")


def write_readme_hybrid(out, name, what, seed, min_margin, extra, vers):
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"# Fixture `{name}`\n\n")
        f.write(what + "\n\n")
        f.write(
            f"Made by `python3 scripts/make_fixtures.py --out tests/fixtures --only {name}` (from the repo root; "
            "without `--only` all fixtures are remade), on the CPU in float32, model seed "
            f"{seed} (the script starts at a fixed seed and moves to the next one only if the greedy path has a "
            f"top1-top2 logit gap below {HYBRID_MIN_MARGIN}, fewer than {HYBRID_MIN_DISTINCT} distinct ids, or a "
            f"period <= {MAX_PERIOD} in its last {PERIOD_TAIL} ids).\n\n"
            f"Versions: transformers {vers['transformers']}, torch {vers['torch']}, safetensors "
            f"{vers['safetensors']}, python {vers['python']} (also in versions.json).\n\n"
            "Files:\n"
            "- `config.json`, `model.safetensors`: exactly as `save_pretrained(dir, safe_serialization=True)` "
            "wrote them (f32). After the random init (initializer_range 0.1) every 2-D weight (embeddings, "
            f"lm_head, Mamba in_proj/out_proj, attention v_proj/o_proj, MLP up_proj/down_proj) was multiplied by "
            f"{HYBRID_WEIGHT_SCALE:g}, except q_proj/k_proj, multiplied by {HYBRID_QK_SCALE:g} (so the softmax "
            "stays spread over several keys), and the dt rows of each Mamba in_proj (its last mamba_num_heads "
            "rows), left as they were (so delta stays clear of NemotronH's prefill-only clamp at time_step_min). "
            "The plain init gives a model whose greedy continuation repeats a few tokens. "
            "Then every norm weight (block `norm` of every layer kind, Mamba `mixer.norm`, `norm_f`) was multiplied "
            "by U(0.5, 1.5), N(0, 0.3) noise was added to `D`, `A_log` and `conv1d.bias`, `dt_bias` was replaced "
            f"by U(-1.5, 1.0), and N(0, {BIAS_STD:g}) noise was added to every projection bias present (MLP "
            "`up_proj.bias` / `down_proj.bias` when `mlp_bias` is true), so a wrong formula shows.\n"
            f"- `oracle.safetensors`: `prompt_ids` int64 [{PROMPT_LEN}] (random ids; {PROMPT_LEN} is not a multiple "
            "of chunk_size 16); `prompt_logits` f32 [T, V] from one full forward (use_cache=False); "
            f"`greedy_ids` int64 [{N_GREEDY}]; `greedy_logits` f32 [{N_GREEDY}, V] where greedy_logits[i] is the "
            "last-position logits of a fresh full forward (use_cache=False) over prompt + greedy_ids[:i] and "
            "greedy_ids[i] is its argmax (greedy_logits[0] == prompt_logits[T-1]); `prompt_nll` f64 [1] = mean over "
            "t of -log_softmax(prompt_logits[t])[prompt_ids[t+1]], t = 0..T-2, computed in float64.\n"
            f"- Smallest top1-top2 gap along the greedy path: {min_margin:.4f}.\n"
        )
        if extra:
            f.write("\n" + extra + "\n")


def fixture_hf_mamba2_g1(out_root, vers):
    # (a) HF Mamba2, G = 1, tied
    name = "hf_mamba2_g1"
    model, seed, touched, mm, cdiff, nll, sd = make_one(name, build_mamba2_g1, 1234, out_root, 100)
    assert "lm_head.weight" not in sd, "tied model must not save lm_head.weight"
    print(f"[{name}] lm_head.weight absent from model.safetensors: OK (tied)")
    out = os.path.join(out_root, name)
    write_readme(
        out, name,
        "HF transformers `Mamba2ForCausalLM` (model_type `mamba2`), random weights: hidden 64, 2 layers, expand 2 "
        "(d_inner 128), head_dim 16 (8 heads), n_groups 1, state_size 16, conv_kernel 4, chunk_size 16, vocab 100, "
        "use_conv_bias, no in/out bias, eps 1e-5, tie_word_embeddings (no `lm_head.weight` in the file). "
        "HF's Mamba2 gated norm spans all of d_inner, which is right for G = 1 only.",
        seed, mm, f"Causality check: prefix logits of a longer forward match prompt_logits to {cdiff:.2e}. "
        "`time_step_limit` is written as `[0.0, {\"__float__\": \"Infinity\"}]` (a no-op clamp).", vers)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(vers | {"seed": seed}, f, indent=2)


def fixture_nemotron_h_g2(out_root, vers):
    # (b) NemotronH, all Mamba, G = 2, head_dim 12, untied
    name = "nemotron_h_g2"
    model, seed, touched, mm, cdiff, nll, sd = make_one(name, build_nemotron_h_g2, 4321, out_root, 101)
    assert "lm_head.weight" in sd, "untied model must save lm_head.weight"
    print(f"[{name}] lm_head.weight present: OK (untied)")
    info = nemotron_checks(model, load_file(os.path.join(out_root, name, "oracle.safetensors"))["prompt_ids"])
    print(f"[{name}] checks: {json.dumps(info)}")
    assert min(info["min_delta_per_layer"]) > 10 * info["time_step_min_clamp"], \
        "the dt clamp at time_step_min would be active: pick other perturbations"
    assert info["max_abs_logit_diff_if_norm_not_grouped"] > 1e-2, "group norm would not show"
    out = os.path.join(out_root, name)
    write_readme(
        out, name,
        "HF transformers `NemotronHForCausalLM` (model_type `nemotron_h`), all three layers Mamba2 "
        "(made with `hybrid_override_pattern=\"MMM\"`; transformers 5.17 saves it as "
        "`layers_block_type: [\"linear_attention\", ...]`), `use_mamba_kernels=False`, random weights: hidden 48, "
        "mamba_num_heads 8, mamba_head_dim 12 (d_inner 96), n_groups 2, ssm_state_size 16, conv_kernel 4, "
        "chunk_size 16, vocab 101, use_conv_bias, no in/out bias, eps 1e-5, untied `lm_head.weight`. Its gated "
        "norm (`Zamba2RMSNormGated`) is per group (group_size = d_inner / n_groups = 48), gate applied before the "
        "norm: the G > 1 oracle.",
        seed, mm,
        "Note: NemotronH's mixer clamps delta = softplus(dt + dt_bias) from below at `time_step_min` "
        f"({info['time_step_min_clamp']}) in its chunked path (time_step_limit = (time_step_min, inf) hard-coded, "
        "not the config's time_step_limit). In this fixture the smallest delta per layer is "
        f"{[round(v, 4) for v in info['min_delta_per_layer']]}, so the clamp is never active. "
        "Normalizing over all of d_inner instead of per group would change the prompt logits by up to "
        f"{info['max_abs_logit_diff_if_norm_not_grouped']:.3f}. "
        f"Causality check: prefix logits of a longer forward match prompt_logits to {cdiff:.2e}.\n\n"
        "Parsing notes: the saved tensor names use the prefix `backbone.` (transformers 5.17 holds them as "
        "`model.` in memory and renames them back on save); config.json has no `num_hidden_layers` and no "
        "`hybrid_override_pattern`: the layer count is len(layers_block_type), and a Mamba layer is "
        "`linear_attention` (older configs: `mamba` or pattern letter `M`); config `head_dim` (128) is the "
        "attention head size, unused here: the Mamba head size is `mamba_head_dim`; the norms' eps is "
        "`layer_norm_epsilon` (block norms, gated norm and norm_f alike).",
        vers)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(vers | {"seed": seed}, f, indent=2)


def fixture_hybrid(name, out_root, vers):
    spec = HYBRIDS[name]
    params = {k: v for k, v in spec.items() if k != "seed"}
    builder = functools.partial(build_nemotron_h_hybrid, **params)
    model, seed, touched, mm, cdiff, nll, sd = make_one(
        name, builder, spec["seed"], out_root, 101, min_margin=HYBRID_MIN_MARGIN, min_distinct=HYBRID_MIN_DISTINCT,
        check_period=True, load_kwargs={"attn_implementation": "eager"})
    out = os.path.join(out_root, name)
    cfg = model.config
    H, Hkv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    d_inner = cfg.mamba_num_heads * cfg.mamba_head_dim
    conv_dim = d_inner + 2 * cfg.n_groups * cfg.ssm_state_size
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    expected_kinds = [kinds[c] for c in spec["pattern"]]

    # The names and shapes users download.
    want = {
        "backbone.embeddings.weight": [cfg.vocab_size, d],
        "backbone.norm_f.weight": [d],
        "lm_head.weight": [cfg.vocab_size, d],
    }
    for i, k in enumerate(expected_kinds):
        pre = f"backbone.layers.{i}."
        want[pre + "norm.weight"] = [d]
        if k == "linear_attention":
            want |= {
                pre + "mixer.in_proj.weight": [2 * d_inner + 2 * cfg.n_groups * cfg.ssm_state_size
                                               + cfg.mamba_num_heads, d],
                pre + "mixer.conv1d.weight": [conv_dim, 1, cfg.conv_kernel],
                pre + "mixer.conv1d.bias": [conv_dim],
                pre + "mixer.dt_bias": [cfg.mamba_num_heads],
                pre + "mixer.A_log": [cfg.mamba_num_heads],
                pre + "mixer.D": [cfg.mamba_num_heads],
                pre + "mixer.norm.weight": [d_inner],
                pre + "mixer.out_proj.weight": [d, d_inner],
            }
        elif k == "full_attention":
            want |= {
                pre + "mixer.q_proj.weight": [H * hd, d],
                pre + "mixer.k_proj.weight": [Hkv * hd, d],
                pre + "mixer.v_proj.weight": [Hkv * hd, d],
                pre + "mixer.o_proj.weight": [d, H * hd],
            }
        else:
            want |= {
                pre + "mixer.up_proj.weight": [cfg.intermediate_size, d],
                pre + "mixer.down_proj.weight": [d, cfg.intermediate_size],
            }
            if cfg.mlp_bias:
                want |= {pre + "mixer.up_proj.bias": [cfg.intermediate_size], pre + "mixer.down_proj.bias": [d]}
    got = {k: list(v.shape) for k, v in sd.items()}
    assert got == want, f"saved tensors differ from the expected names/shapes: {set(got) ^ set(want)}"
    print(f"[{name}] tensor names and shapes: as expected ({len(got)} tensors)")

    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    print(f"[{name}] config.json:\n{json.dumps(saved_cfg, indent=2)}")
    assert saved_cfg["layers_block_type"] == expected_kinds, saved_cfg["layers_block_type"]
    assert "hybrid_override_pattern" not in saved_cfg and "num_hidden_layers" not in saved_cfg
    assert saved_cfg["num_key_value_heads"] == Hkv and saved_cfg["head_dim"] == hd and hd * H != d
    assert saved_cfg["attention_bias"] is False and saved_cfg["mlp_bias"] == spec["mlp_bias"]
    assert saved_cfg["mlp_hidden_act"] == "relu2" and saved_cfg["use_mamba_kernels"] is False

    oracle = load_file(os.path.join(out, "oracle.safetensors"))
    info = hybrid_checks(model, oracle["prompt_ids"], oracle["greedy_ids"], oracle["greedy_logits"])
    print(f"[{name}] checks: {json.dumps(info)}")
    assert min(info["min_delta_per_mamba_layer"]) > 10 * info["time_step_min_clamp"], \
        "the dt clamp at time_step_min would be active: pick other perturbations"
    for key in ("max_abs_logit_diff_if_norm_not_grouped", "max_abs_logit_diff_if_scale_used_hidden_over_heads",
                "max_abs_logit_diff_if_kv_head_is_h_mod_hkv", "max_abs_logit_diff_if_mlp_act_is_relu",
                "max_abs_logit_diff_if_mlp_bias_dropped"):
        if key in info:
            assert info[key] > 1e-1, f"{key}: a wrong formula would hardly show"
    assert info["max_abs_logit_diff_sdpa_vs_eager"] < 1e-3, "sdpa and eager attention disagree"
    assert info["cached_decode_greedy_ids_equal"], "transformers' cached decode gives other greedy ids"
    assert info["max_abs_logit_diff_cached_decode"] < 1e-3, "transformers' cached decode disagrees"

    pattern = spec["pattern"]
    n_m, n_a, n_p = pattern.count("M"), pattern.count("*"), pattern.count("-")
    gqa = "multi-query" if Hkv == 1 else f"GQA, q head h reads kv head h // {H // Hkv}"
    what = (
        "HF transformers `NemotronHForCausalLM` (model_type `nemotron_h`), a dense hybrid made with "
        f"`hybrid_override_pattern=\"{pattern}\"` ({n_m} Mamba2, {n_a} attention, {n_p} MLP layers; transformers "
        f"5.17 saves it as `layers_block_type: {json.dumps(expected_kinds)}`), `use_mamba_kernels=False`, random "
        f"weights: hidden {d}, vocab {cfg.vocab_size}, untied `lm_head.weight`, eps 1e-5 (`layer_norm_epsilon`, "
        "every norm). "
        f"Mamba2: mamba_num_heads {cfg.mamba_num_heads}, mamba_head_dim {cfg.mamba_head_dim} (d_inner {d_inner}), "
        f"n_groups {cfg.n_groups} (per-group gated norm, group size {d_inner // cfg.n_groups}), ssm_state_size "
        f"{cfg.ssm_state_size}, conv_kernel {cfg.conv_kernel}, chunk_size {cfg.chunk_size}, use_conv_bias, no "
        f"in/out bias. Attention: {H} query heads, {Hkv} key/value head{'s' if Hkv > 1 else ''} ({gqa}), head_dim "
        f"{hd} (not hidden / heads = {d // H}), softmax scale 1/sqrt({hd}), causal, no positional encoding, no "
        f"biases (`attention_bias` false; transformers 5.17 builds q/k/v/o without bias whatever it says). MLP: "
        f"`down(relu(up(x))^2)` (`mlp_hidden_act` relu2), intermediate_size {cfg.intermediate_size}, "
        + ("with biases (`mlp_bias` true: `up_proj.bias`, `down_proj.bias`)." if cfg.mlp_bias
           else "no biases (`mlp_bias` false).")
    )
    extra = (
        "The oracle ran transformers' `eager` attention (the plain formula); its default `sdpa` gives prompt logits "
        f"within {info['max_abs_logit_diff_sdpa_vs_eager']:.2e} of it. "
        f"Causality check: prefix logits of a longer forward match prompt_logits to {cdiff:.2e}. "
        "transformers' own cached path (prefill with use_cache=True, then one-token steps through the Mamba "
        "recurrent update and the KV cache) gives the same greedy_ids, its logits within "
        f"{info['max_abs_logit_diff_cached_decode']:.2e} of greedy_logits. "
        f"The smallest delta = softplus(dt + dt_bias) per Mamba layer is "
        f"{[round(v, 4) for v in info['min_delta_per_mamba_layer']]}, so NemotronH's clamp at time_step_min "
        f"({info['time_step_min_clamp']}) is never active. Mean largest softmax weight per attention layer "
        f"(positions >= 8): {info['attention_mean_max_weight_per_layer']}.\n\n"
        "What a wrong formula would change (max |diff| of the prompt logits): "
        f"gated norm over all of d_inner instead of per group {info['max_abs_logit_diff_if_norm_not_grouped']:.3f}; "
        f"softmax scale 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim) "
        f"{info['max_abs_logit_diff_if_scale_used_hidden_over_heads']:.3f}; "
        + (f"kv head h % Hkv instead of h // (H / Hkv) {info['max_abs_logit_diff_if_kv_head_is_h_mod_hkv']:.3f}; "
           if "max_abs_logit_diff_if_kv_head_is_h_mod_hkv" in info else "")
        + f"relu instead of relu^2 {info['max_abs_logit_diff_if_mlp_act_is_relu']:.3f}"
        + (f"; MLP biases dropped {info['max_abs_logit_diff_if_mlp_bias_dropped']:.3f}"
           if "max_abs_logit_diff_if_mlp_bias_dropped" in info else "")
        + ".\n\n"
        "Parsing notes: the saved tensor names use the prefix `backbone.` (`backbone.embeddings.weight`, "
        "`backbone.layers.N.norm.weight` for every layer kind, `backbone.layers.N.mixer.*`, `backbone.norm_f.weight`, "
        "`lm_head.weight`); attention layers hold `mixer.{q,k,v,o}_proj.weight`, MLP layers "
        "`mixer.{up,down}_proj.weight`" + (" and `.bias`" if cfg.mlp_bias else "") + ". config.json has no "
        "`num_hidden_layers` and no `hybrid_override_pattern`: the layer list is `layers_block_type` with "
        "`linear_attention` (Mamba2), `full_attention` (attention) and `mlp`. config `head_dim` is the attention "
        "head size, `mamba_head_dim` the Mamba one. Fields such as `max_position_embeddings`, `sliding_window` "
        "(null), `moe_*`, `n_routed_experts`, `mtp_layers_block_type` are defaults that no layer here uses."
    )
    write_readme_hybrid(out, name, what, seed, mm, extra, vers)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(vers | {"seed": seed}, f, indent=2)


FIXTURES = ["hf_mamba2_g1", "nemotron_h_g2", "nemotron_h_hybrid", "nemotron_h_mqa"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", choices=FIXTURES, action="append",
                    help="make only this fixture (may be repeated); default: all of them")
    args = ap.parse_args()
    names = args.only or FIXTURES

    setup_torch()
    vers = versions()
    print(f"transformers {transformers.__version__}  torch {torch.__version__}  "
          f"safetensors {safetensors.__version__}  python {vers['python']}")
    os.makedirs(args.out, exist_ok=True)
    import importlib.util
    for pkg in ("mamba_ssm", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"WARNING: {pkg} is installed; transformers may route through it instead of its torch path")

    for name in names:
        if name == "hf_mamba2_g1":
            fixture_hf_mamba2_g1(args.out, vers)
        elif name == "nemotron_h_g2":
            fixture_nemotron_h_g2(args.out, vers)
        else:
            fixture_hybrid(name, args.out, vers)

    for n in names:
        d = os.path.join(args.out, n)
        for f in os.listdir(d):
            os.chmod(os.path.join(d, f), 0o644)
        total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"{d}: {sorted(os.listdir(d))} {total} bytes")
        assert total < 1_000_000


if __name__ == "__main__":
    main()
