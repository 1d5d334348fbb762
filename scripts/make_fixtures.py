#!/usr/bin/env python3
"""External-oracle fixtures for mamba2-wgpu, made with HF transformers on the CPU in float32.

Writes eight folders under --out (default tests/fixtures):

  hf_mamba2_g1/       HF Mamba2ForCausalLM (model_type mamba2), random tiny, n_groups = 1, tied embeddings
  nemotron_h_g2/      HF NemotronHForCausalLM, all-Mamba layers, n_groups = 2, head_dim 12, untied lm_head
  nemotron_h_hybrid/  HF NemotronHForCausalLM, pattern "M*-M-*M" (Mamba2, GQA attention 4 q / 2 kv heads of
                      head_dim 16 != hidden / heads, relu2 MLP), n_groups = 2, untied lm_head
  nemotron_h_mqa/     HF NemotronHForCausalLM, pattern "*M-M*" (attention first; multi-query: 4 q / 1 kv head
                      of head_dim 24), n_groups = 4, MLP with biases, untied lm_head
  nemotron_h_moe/     HF NemotronHForCausalLM, pattern "ME*E-M": two mixture-of-experts layers (16 relu2 experts in 4
                      groups, top-2 of the best 2 groups, sigmoid router with a random e_score_correction_bias,
                      norm_topk_prob, routed_scaling_factor 2.5, a shared expert) among Mamba2, attention and MLP layers
  nemotron_h_latent/  the same shapes with latent MoE projections (moe_latent_size 32: the routed experts work on
                      fc1_latent_proj(x), fc2_latent_proj brings their weighted sum back)
  granite_moe_hybrid/ HF GraniteMoeHybridForCausalLM, layers mamba/attention/mamba/mamba, each followed by a shared
                      gated MLP plus an MoE (10 gated experts, softmax over the top 3 logits); all four multipliers
                      != 1, NoPE, mamba_n_groups 1, tied embeddings
  granite_rope/       the same GraniteMoeHybrid shapes with position_embedding_type rope (theta 10000), layers
                      attention/mamba/attention/mamba

Each folder holds config.json + model.safetensors exactly as `save_pretrained` writes them (f32),
oracle.safetensors (prompt_ids, prompt_logits, greedy_ids, greedy_logits, prompt_nll; the MoE fixtures add their
routing: each MoE layer's input, router logits, chosen expert ids and weights, routed and shared outputs),
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
import torch.nn.functional as F
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
             check_period=False, load_kwargs=None, accept=None):
    """`accept(model, prompt_ids, greedy_ids) -> (ok, message)`, when given, can reject a seed for reasons of its
    own (the MoE fixtures: a near tie in the router)."""
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
        ok, why = (True, "") if accept is None else accept(model, prompt_ids, g_ids)
        if why:
            print(f"[{name}] seed {seed}: {why}")
        if float(m.min()) >= min_margin and distinct >= min_distinct and period is None and ok:
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


# ----------------------------------------------------------------------------------------------------------------------
# Mixture-of-experts fixtures ("Hybrid models, part 2"): a Nemotron-H with MoE layers and a GraniteMoeHybrid.

ROUTE_MIN_GAP = 1e-5  # smallest allowed gap at every routing decision (see route_stats): f32 rounding can't flip one
MIN_EXPERTS_USED = 0.75  # each MoE layer must choose at least this fraction of its experts along the greedy path
MOE_ROUTER_SCALE = 2.0  # router weights get x2 only, so the sigmoid / softmax scores stay spread, not saturated

MOES = {
    "nemotron_h_moe": dict(
        seed=7000,
        pattern="ME*E-M",
        hidden_size=48,
        mamba_num_heads=8,
        mamba_head_dim=12,  # d_inner 96
        n_groups=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,  # the `-` layer's MLP
        n_routed_experts=16,
        n_group=4,  # 4 groups of 4 experts: a group's score is the sum of its best 2 of 4
        topk_group=2,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        bias_range=0.2,  # e_score_correction_bias ~ U(-0.2, 0.2), set after the init (which zeroes it); the
        # sigmoid scores' spread is ~0.26: the bias changes most choices, yet (unlike U(-0.5, 0.5)) leaves every
        # expert a chance
    ),
    # The same shapes with latent MoE projections (Nemotron 3 Super's LatentMoE): the routed experts work on
    # fc1_latent_proj(x) (32 wide) and fc2_latent_proj brings their weighted sum back to the hidden size; the router
    # and the shared expert read x.
    "nemotron_h_latent": dict(
        seed=9000,
        pattern="ME*E-M",
        hidden_size=48,
        mamba_num_heads=8,
        mamba_head_dim=12,
        n_groups=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        bias_range=0.2,
        moe_latent_size=32,
    ),
    "granite_moe_hybrid": dict(
        seed=8000,
        layer_types=["mamba", "attention", "mamba", "mamba"],  # the released configs' names (5.17 renames them)
        hidden_size=48,
        mamba_n_heads=8,  # d_inner = mamba_expand * hidden = 96, head dim 12
        mamba_d_state=16,
        mamba_expand=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head_dim = 48 / 4 = 12
        num_local_experts=10,
        num_experts_per_tok=3,
        intermediate_size=16,  # per expert
        shared_intermediate_size=32,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,  # != 1/sqrt(12) = 0.289
        logits_scaling=2.5,
    ),
    # The same layer kinds with RoPE on (`position_embedding_type: rope`, theta 10000, rotate-half pairs), attention
    # first: the released Granite-4.0-H models are all NoPE, but the config allows rope and the engine takes it.
    "granite_rope": dict(
        seed=8100,
        layer_types=["attention", "mamba", "attention", "mamba"],
        hidden_size=48,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_expand=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=10,
        num_experts_per_tok=3,
        intermediate_size=16,
        shared_intermediate_size=32,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.5,
        position_embedding_type="rope",
        rope_theta=10000.0,
    ),
}


def scale_moe_model(model, n_dt_rows):
    """The hybrid fixtures' scaling (every 2-D weight x8, q/k x2, the Mamba in_proj's dt rows x1), plus: the stacked
    expert tensors x8 like the other projections, the router weights x MOE_ROUTER_SCALE."""
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
                p.mul_(HYBRID_QK_SCALE)
            elif name.endswith("mixer.gate.weight") or name.endswith("block_sparse_moe.router.weight"):
                p.mul_(MOE_ROUTER_SCALE)
            elif "latent_proj" in name:
                pass  # the latent projections keep their init: the experts after them are scaled already
            elif name.endswith("in_proj.weight"):
                p[:-n_dt_rows].mul_(HYBRID_WEIGHT_SCALE)
            elif name.split(".")[-1] in ("up_proj", "down_proj", "gate_up_proj") and ".experts." in name:
                p.mul_(HYBRID_WEIGHT_SCALE)  # [E, out, in]
            elif p.ndim == 2:
                p.mul_(HYBRID_WEIGHT_SCALE)


def build_nemotron_h_moe(seed, *, pattern, hidden_size, mamba_num_heads, mamba_head_dim, n_groups, num_attention_heads,
                         num_key_value_heads, head_dim, intermediate_size, n_routed_experts, n_group, topk_group,
                         num_experts_per_tok, moe_intermediate_size, moe_shared_expert_intermediate_size,
                         routed_scaling_factor, norm_topk_prob, bias_range, moe_latent_size=None):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=101,
        hidden_size=hidden_size,
        hybrid_override_pattern=pattern,  # saved as layers_block_type (linear_attention / moe / full_attention / mlp)
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
        attention_bias=False,
        attention_dropout=0.0,
        intermediate_size=intermediate_size,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        n_routed_experts=n_routed_experts,
        n_shared_experts=1,
        moe_intermediate_size=moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size,
        moe_latent_size=moe_latent_size,
        num_experts_per_tok=num_experts_per_tok,
        routed_scaling_factor=routed_scaling_factor,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
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
    print(f"[nemotron_h_moe] default experts implementation: {model.config._experts_implementation}")
    model.set_attn_implementation("eager")  # the plain formulas (neither is saved in config.json)
    model.set_experts_implementation("eager")
    scale_moe_model(model, mamba_num_heads)
    gen = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.block_type == "moe":
                b = layer.mixer.gate.e_score_correction_bias
                b.copy_((torch.rand(b.shape, generator=gen) * 2 - 1) * bias_range)
    return model


def build_granite_moe_hybrid(seed, *, layer_types, hidden_size, mamba_n_heads, mamba_d_state, mamba_expand,
                             num_attention_heads, num_key_value_heads, num_local_experts, num_experts_per_tok,
                             intermediate_size, shared_intermediate_size, embedding_multiplier, residual_multiplier,
                             attention_multiplier, logits_scaling, position_embedding_type="nope", rope_theta=None):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=101,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        pad_token_id=None,  # a padding_idx would zero one embedding row
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        embedding_multiplier=embedding_multiplier,
        logits_scaling=logits_scaling,
        residual_multiplier=residual_multiplier,
        attention_multiplier=attention_multiplier,
        num_local_experts=num_local_experts,
        num_experts_per_tok=num_experts_per_tok,
        output_router_logits=False,
        shared_intermediate_size=shared_intermediate_size,
        position_embedding_type=position_embedding_type,
        **({"rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}} if rope_theta else {}),
        layer_types=layer_types,
        mamba_n_heads=mamba_n_heads,
        mamba_n_groups=1,
        mamba_d_state=mamba_d_state,
        mamba_d_head="auto",
        mamba_d_conv=4,
        mamba_expand=mamba_expand,
        mamba_chunk_size=16,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
    )
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(cfg).float().eval()
    print(f"[granite] default experts implementation: {model.config._experts_implementation}")
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings not tied"
    scale_moe_model(model, mamba_n_heads)
    return model


def moe_parts(model, family):
    """(layer index, MoE module, router, experts, shared MLP) for every layer with an MoE."""
    parts = []
    for i, l in enumerate(model.model.layers):
        if family == "nemotron":
            if l.block_type == "moe":
                parts.append((i, l.mixer, l.mixer.gate, l.mixer.experts, l.mixer.shared_experts))
        else:
            parts.append((i, l.block_sparse_moe, l.block_sparse_moe.router, l.block_sparse_moe.experts, l.shared_mlp))
    return parts


@torch.no_grad()
def record_routing(model, ids, family):
    """One full forward over `ids` with hooks on every MoE layer: its input, the router's logits / chosen ids /
    weights, the routed experts' weighted sum and the shared MLP's output (rows = positions)."""
    rec, hooks = {}, []

    def rows(t):
        return t.detach().reshape(-1, t.shape[-1]).clone().contiguous()

    for i, moe, router, experts, shared in moe_parts(model, family):
        hooks.append(moe.register_forward_pre_hook(lambda m, a, i=i: rec.__setitem__((i, "input"), rows(a[0]))))
        hooks.append(router.register_forward_hook(lambda m, a, o, i=i: rec.__setitem__((i, "router"), o)))
        hooks.append(experts.register_forward_hook(lambda m, a, o, i=i: rec.__setitem__((i, "routed"), rows(o))))
        hooks.append(shared.register_forward_hook(lambda m, a, o, i=i: rec.__setitem__((i, "shared"), rows(o))))
    try:
        logits = logits_of(model, ids)
    finally:
        for h in hooks:
            h.remove()
    layers = [p[0] for p in moe_parts(model, family)]
    out = {"moe_layers": torch.tensor(layers, dtype=torch.int64), "moe_tokens": ids.clone().contiguous()}
    for i in layers:
        if family == "nemotron":
            lg, w, idx = rec[(i, "router")]  # NemotronHTopkRouter: (router_logits, topk_weights, topk_indices)
        else:
            idx, w, lg = rec[(i, "router")]  # GraniteMoeHybridTopKRouter: (top_k_index, top_k_weights, router_logits)
        out[f"moe.{i}.input"] = rec[(i, "input")]
        out[f"moe.{i}.router_logits"] = rows(lg.float())
        out[f"moe.{i}.expert_ids"] = rows(idx.to(torch.int64))
        out[f"moe.{i}.expert_weights"] = rows(w.float())
        out[f"moe.{i}.routed_out"] = rec[(i, "routed")]
        out[f"moe.{i}.shared_out"] = rec[(i, "shared")]
    return out, logits


def nemotron_route_py(logits, bias, *, n_group, topk_group, top_k, norm, scale, fill=float("-inf"),
                      bias_for_choice=True, groups=True, weights_from_choice=False):
    """NemotronHTopkRouter.forward of transformers 5.17 from the router logits [T, E] (checked equal to it below),
    with switches for the formulas one could get wrong. Returns (weights [T, k], ids [T, k])."""
    E = logits.shape[-1]
    scores = logits.float().sigmoid()
    choice = scores + bias if bias_for_choice else scores.clone()
    corrected = choice
    if groups:
        gs = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        gidx = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs)
        gmask.scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        choice = choice.masked_fill(~smask.bool(), fill)
    idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    w = (corrected if weights_from_choice else scores).gather(1, idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


def granite_route_py(logits, *, top_k, softmax_all=False):
    """GraniteMoeHybridTopKRouter's choice from the logits [T, E]; softmax_all: softmax over every expert, then top-k
    without renormalising (a wrong formula). Returns (ids, weights)."""
    if softmax_all:
        top = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        return top.indices, top.values
    vals, idx = logits.topk(top_k, dim=-1)
    return idx, torch.softmax(vals, dim=-1)


class patched_routers:
    """Context manager: every MoE router of the model computes its routing through nemotron_route_py /
    granite_route_py with `variant` switches."""

    def __init__(self, model, family, **variant):
        self.model, self.family, self.variant = model, family, variant

    def __enter__(self):
        self.routers = [p[2] for p in moe_parts(self.model, self.family)]
        for r in self.routers:
            if self.family == "nemotron":
                def fwd(hidden_states, r=r):
                    logits = F.linear(hidden_states.view(-1, r.hidden_dim).float(), r.weight.float())
                    kw = dict(n_group=r.num_group, topk_group=r.topk_group, top_k=r.top_k, norm=r.norm_topk_prob,
                              scale=r.routed_scaling_factor) | self.variant
                    w, idx = nemotron_route_py(logits, r.e_score_correction_bias, **kw)
                    return logits, w, idx
            else:
                def fwd(hidden_states, r=r):
                    logits = F.linear(hidden_states, r.weight).float()
                    idx, w = granite_route_py(logits, top_k=r.top_k, **self.variant)
                    return idx, w.type_as(hidden_states), logits
            r.forward = fwd
        return self

    def __exit__(self, *exc):
        for r in self.routers:
            del r.forward


def route_stats(rec, model, family):
    """How close each routing decision came to a tie, and how often the formulas one could get wrong would choose
    other experts (from the recorded router logits, layer by layer)."""
    cfg = model.config
    st = {"min_gap_expert": float("inf"), "load": {}}
    if family == "nemotron":
        st |= {"min_gap_group": float("inf"), "choices_changed_without_bias": 0, "choices_changed_without_groups": 0,
               "choices_changed_with_zero_fill": 0, "both_chosen_in_one_group": 0, "negative_corrected_scores": 0}
    routers = {p[0]: p[2] for p in moe_parts(model, family)}
    n = 0
    for i in rec["moe_layers"].tolist():
        lg = rec[f"moe.{i}.router_logits"]
        ids = rec[f"moe.{i}.expert_ids"]
        E, k = lg.shape[-1], ids.shape[-1]
        n += lg.shape[0]
        st["load"][i] = torch.bincount(ids.flatten(), minlength=E).tolist()
        if family == "nemotron":
            r = routers[i]
            kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=k, norm=cfg.norm_topk_prob,
                      scale=cfg.routed_scaling_factor)
            w_py, ids_py = nemotron_route_py(lg, r.e_score_correction_bias, **kw)
            assert torch.equal(ids_py.sort(-1).values, ids.sort(-1).values), "nemotron_route_py != the oracle"
            c = (lg.sigmoid() + r.e_score_correction_bias).double()
            st["negative_corrected_scores"] += int((c < 0).sum())
            gsize = E // cfg.n_group
            gs = c.view(-1, cfg.n_group, gsize).topk(2, dim=-1)[0].sum(-1)
            if cfg.topk_group < cfg.n_group:
                gsorted = gs.sort(-1, descending=True).values
                st["min_gap_group"] = min(st["min_gap_group"],
                                          float((gsorted[:, cfg.topk_group - 1] - gsorted[:, cfg.topk_group]).min()))
            kept = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, dim=-1)[1], 1).bool()
            ck = c.masked_fill(~kept.repeat_interleave(gsize, dim=-1), float("-inf")).sort(-1, descending=True).values
            st["min_gap_expert"] = min(st["min_gap_expert"], float((ck[:, k - 1] - ck[:, k]).min()))
            same = lambda a, b: int((a.sort(-1).values != b.sort(-1).values).any(-1).sum())
            st["choices_changed_without_bias"] += same(ids, nemotron_route_py(
                lg, r.e_score_correction_bias, bias_for_choice=False, **kw)[1])
            st["choices_changed_without_groups"] += same(ids, nemotron_route_py(
                lg, r.e_score_correction_bias, groups=False, **kw)[1])
            st["choices_changed_with_zero_fill"] += same(ids, nemotron_route_py(
                lg, r.e_score_correction_bias, fill=0.0, **kw)[1])
            st["both_chosen_in_one_group"] += int(((ids // gsize).min(-1).values == (ids // gsize).max(-1).values).sum())
        else:
            srt = lg.double().sort(-1, descending=True).values
            st["min_gap_expert"] = min(st["min_gap_expert"], float((srt[:, k - 1] - srt[:, k]).min()))
    st["routings"] = n
    return st


def moe_accept(model, prompt_ids, g_ids, *, family):
    rec, _ = record_routing(model, torch.cat([prompt_ids, g_ids[:-1]]), family)
    st = route_stats(rec, model, family)
    gaps = [st["min_gap_expert"]] + ([st["min_gap_group"]] if "min_gap_group" in st else [])
    ok = min(gaps) >= ROUTE_MIN_GAP
    ok = ok and all(sum(c > 0 for c in load) >= MIN_EXPERTS_USED * len(load) for load in st["load"].values())
    if family == "nemotron":
        ok = ok and st["choices_changed_without_bias"] > 0 and st["choices_changed_without_groups"] > 0
    used = {i: sum(c > 0 for c in load) for i, load in st["load"].items()}
    msg = "routing " + json.dumps({k: v for k, v in st.items() if k != "load"} | {"experts_used_per_layer": used})
    return ok, msg + ("" if ok else "  -> rejected (a near tie, the bias / groups never change a choice, or too few "
                                    "experts used)")


def moe_diagnostics(model, family, prompt_ids):
    """Max |diff| of the prompt logits under formulas one could get wrong (routing, experts, shared MLP)."""
    ref = logits_of(model, prompt_ids)
    info = {}
    with patched_routers(model, family):
        assert torch.equal(logits_of(model, prompt_ids), ref), "the python router differs from transformers'"

    def diff_router(**variant):
        with patched_routers(model, family, **variant):
            return float((logits_of(model, prompt_ids) - ref).abs().max())

    if family == "nemotron":
        cfg = model.config
        info["max_abs_logit_diff_if_bias_not_used_for_choice"] = diff_router(bias_for_choice=False)
        info["max_abs_logit_diff_if_no_group_limit"] = diff_router(groups=False)
        info["max_abs_logit_diff_if_weights_from_corrected_scores"] = diff_router(weights_from_choice=True)
        info["max_abs_logit_diff_if_no_norm_topk_prob"] = diff_router(norm=not cfg.norm_topk_prob)
        info["max_abs_logit_diff_if_routed_scaling_factor_ignored"] = diff_router(scale=1.0)
        info["max_abs_logit_diff_if_masked_groups_filled_with_0"] = diff_router(fill=0.0)
    else:
        info["max_abs_logit_diff_if_softmax_over_all_experts"] = diff_router(softmax_all=True)

    parts = moe_parts(model, family)
    # experts: relu instead of relu^2 (Nemotron) / gate and up halves swapped (Granite, experts and shared MLP)
    if family == "nemotron":
        acts = [p[3].act_fn for p in parts]
        for p in parts:
            p[3].act_fn = torch.nn.ReLU()
        info["max_abs_logit_diff_if_expert_act_is_relu"] = float((logits_of(model, prompt_ids) - ref).abs().max())
        for p, a in zip(parts, acts):
            p[3].act_fn = a
    else:
        def swap():
            with torch.no_grad():
                for p in parts:
                    for w in (p[3].gate_up_proj, p[4].input_linear.weight):
                        h = w.shape[-2] // 2
                        w.copy_(torch.cat([w[..., h:, :], w[..., :h, :]], dim=-2))
        swap()
        info["max_abs_logit_diff_if_gate_up_halves_swapped"] = float((logits_of(model, prompt_ids) - ref).abs().max())
        swap()
    # the shared MLP dropped
    for p in parts:
        p[4].forward = lambda x: torch.zeros_like(x)
    info["max_abs_logit_diff_if_shared_mlp_dropped"] = float((logits_of(model, prompt_ids) - ref).abs().max())
    for p in parts:
        del p[4].forward
    # transformers' default experts implementation against the eager loop the oracle ran
    try:
        model.set_experts_implementation("grouped_mm")
        info["max_abs_logit_diff_grouped_mm_vs_eager_experts"] = float((logits_of(model, prompt_ids) - ref).abs().max())
    except Exception as e:  # not available on this machine
        info["grouped_mm_experts"] = f"unavailable: {type(e).__name__}: {e}"[:200]
    finally:
        model.set_experts_implementation("eager")
    assert torch.equal(logits_of(model, prompt_ids), ref), "diagnostics left the model changed"
    return info


def granite_checks(model, prompt_ids, greedy_ids, greedy_logits):
    """Diagnostics for the Granite fixture: what a wrong formula would change, deltas, cached decode."""
    info = {}
    layers = model.model.layers
    cfg = model.config
    ref = logits_of(model, prompt_ids)
    seen = {}

    def grab(i):
        return lambda mod, args, kwargs: seen.__setitem__(i, (kwargs.get("hidden_states") if args == () else args[0]))

    hooks = [l.mamba.register_forward_pre_hook(grab(i), with_kwargs=True)
             for i, l in enumerate(layers) if l.mamba is not None]
    with torch.no_grad():
        out = model(input_ids=prompt_ids[None, :], use_cache=False, output_attentions=True)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        mins = []
        for i, l in enumerate(layers):
            if l.mamba is not None:
                dt = l.mamba.in_proj(seen[i])[..., -l.mamba.num_heads:]
                mins.append(float(torch.nn.functional.softplus(dt + l.mamba.dt_bias).min()))
    info["min_delta_per_mamba_layer"] = mins
    info["attention_mean_max_weight_per_layer"] = [
        round(float(a[0].max(-1).values[:, 8:].mean()), 3) for a in (out.attentions or ()) if a is not None]

    def diff_with(fn_on, fn_off):
        fn_on()
        try:
            return float((logits_of(model, prompt_ids) - ref).abs().max())
        finally:
            fn_off()

    attn = [l.self_attn for l in layers if l.self_attn is not None]
    hd = cfg.hidden_size // cfg.num_attention_heads
    info["max_abs_logit_diff_if_attention_scale_is_1_over_sqrt_head_dim"] = diff_with(
        lambda: [setattr(a, "scaling", hd ** -0.5) for a in attn],
        lambda: [setattr(a, "scaling", cfg.attention_multiplier) for a in attn])
    info["max_abs_logit_diff_if_embedding_multiplier_ignored"] = diff_with(
        lambda: setattr(model.model, "embedding_multiplier", 1.0),
        lambda: setattr(model.model, "embedding_multiplier", cfg.embedding_multiplier))
    info["max_abs_logit_diff_if_residual_multiplier_ignored"] = diff_with(
        lambda: [setattr(l, "residual_multiplier", 1.0) for l in layers],
        lambda: [setattr(l, "residual_multiplier", cfg.residual_multiplier) for l in layers])
    ls = cfg.logits_scaling
    info["max_abs_logit_diff_if_logits_scaling_ignored"] = diff_with(
        lambda: setattr(model.config, "logits_scaling", 1.0), lambda: setattr(model.config, "logits_scaling", ls))
    if model.model.rotary_emb is not None:
        rotary = model.model.rotary_emb
        info["max_abs_logit_diff_if_rope_ignored"] = diff_with(
            lambda: setattr(model.model, "rotary_emb", None), lambda: setattr(model.model, "rotary_emb", rotary))
    model.set_attn_implementation("sdpa")
    try:
        info["max_abs_logit_diff_sdpa_vs_eager"] = float((logits_of(model, prompt_ids) - ref).abs().max())
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(logits_of(model, prompt_ids), ref), "diagnostics left the model changed"
    c_ids, c_logits = cached_greedy(model, prompt_ids, len(greedy_ids))
    info["cached_decode_greedy_ids_equal"] = bool(torch.equal(c_ids, greedy_ids))
    info["max_abs_logit_diff_cached_decode"] = float((c_logits - greedy_logits).abs().max())
    info["layer_kinds"] = [l.block_type for l in layers]
    return info


def saved_names_summary(sd):
    """`name [shape]` lines with layer and expert numbers folded (`layers.N`, `experts.J`), with counts."""
    import re
    seen = {}
    for k in sorted(sd):
        key = re.sub(r"experts\.\d+\.", "experts.J.", re.sub(r"layers\.\d+\.", "layers.N.", k))
        seen.setdefault((key, tuple(sd[k].shape)), []).append(k)
    return "\n".join(f"- `{key}` {list(shape)} x{len(v)}" for (key, shape), v in seen.items())


def add_routing_to_oracle(model, out, family):
    """Record the routing over prompt + greedy_ids[:-1] (every position the oracle's greedy path saw) into
    oracle.safetensors; returns the routing stats."""
    path = os.path.join(out, "oracle.safetensors")
    oracle = load_file(path)
    ids = torch.cat([oracle["prompt_ids"], oracle["greedy_ids"][:-1]])
    rec, logits = record_routing(model, ids, family)
    d = float((logits[:PROMPT_LEN] - oracle["prompt_logits"]).abs().max())
    assert d < 1e-4, f"the routing forward's prompt logits differ from prompt_logits by {d}"
    assert int(torch.argmax(logits[-1])) == int(oracle["greedy_ids"][-1])
    st = route_stats(rec, model, family)
    save_file(oracle | rec, path)
    return st, rec


def write_readme_moe(out, name, what, seed, min_margin, st, rec, extra, vers, sd):
    T = rec["moe_tokens"].numel()
    k = rec[f"moe.{int(rec['moe_layers'][0])}.expert_ids"].shape[-1]
    E = rec[f"moe.{int(rec['moe_layers'][0])}.router_logits"].shape[-1]
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"# Fixture `{name}`\n\n{what}\n\n")
        f.write(
            f"Made by `python3 scripts/make_fixtures.py --out tests/fixtures --only {name}` (from the repo root), on "
            f"the CPU in float32, model seed {seed} (the script starts at a fixed seed and moves to the next one only if "
            f"the greedy path has a top1-top2 logit gap below {HYBRID_MIN_MARGIN}, fewer than {HYBRID_MIN_DISTINCT} "
            f"distinct ids or a period <= {MAX_PERIOD} in its last {PERIOD_TAIL} ids, or if a routing decision along "
            f"the path comes within {ROUTE_MIN_GAP:g} of a tie, or if an MoE layer chooses fewer than "
            f"{MIN_EXPERTS_USED:.0%} of its experts along it"
            + (", or if the correction bias or the group limit never changes a choice" if "min_gap_group" in st else "")
            + ").\n\n"
            f"Versions: transformers {vers['transformers']}, torch {vers['torch']}, safetensors "
            f"{vers['safetensors']}, python {vers['python']} (also in versions.json). transformers ran its `eager` "
            "attention and its `eager` experts loop (the plain formulas).\n\n"
            "Files:\n"
            "- `config.json`, `model.safetensors`: exactly as `save_pretrained(dir, safe_serialization=True)` wrote "
            f"them (f32). After the random init (initializer_range 0.1) every 2-D weight and the expert tensors were "
            f"multiplied by {HYBRID_WEIGHT_SCALE:g}, except q_proj/k_proj (x{HYBRID_QK_SCALE:g}), the router weights "
            f"(x{MOE_ROUTER_SCALE:g}, so the router scores stay spread) and the dt rows of each Mamba in_proj (x1). "
            "Then every norm weight was multiplied by U(0.5, 1.5), N(0, 0.3) noise was added to `D`, `A_log` and "
            "`conv1d.bias`, and `dt_bias` was replaced by U(-1.5, 1.0).\n"
            f"- `oracle.safetensors`: `prompt_ids` int64 [{PROMPT_LEN}]; `prompt_logits` f32 [T, V] from one full "
            f"forward (use_cache=False); `greedy_ids` int64 [{N_GREEDY}]; `greedy_logits` f32 [{N_GREEDY}, V] "
            "(greedy_logits[i]: last-position logits of a fresh full forward over prompt + greedy_ids[:i], whose "
            "argmax is greedy_ids[i]); `prompt_nll` f64 [1] (mean -log_softmax(prompt_logits[t])[prompt_ids[t+1]]).\n"
            f"  Routing, from one full forward over `moe_tokens` int64 [{T}] = prompt_ids + greedy_ids[:-1] (rows "
            f"0..{PROMPT_LEN - 1} are the prompt positions): `moe_layers` int64 [L] (the layers with an MoE), and for "
            f"each such layer i: `moe.i.input` f32 [{T}, d] (the MoE block's input, after the layer's norm), "
            f"`moe.i.router_logits` f32 [{T}, {E}] (x . W_router^T in f32, before any sigmoid / softmax), "
            f"`moe.i.expert_ids` int64 [{T}, {k}] and `moe.i.expert_weights` f32 [{T}, {k}] (the router's output, "
            "pairs in the order transformers returned them"
            + (": torch.topk(sorted=False), so compare as sets" if "min_gap_group" in st else ": descending logits")
            + f"), `moe.i.routed_out` f32 [{T}, d] (the experts' weighted sum), `moe.i.shared_out` f32 [{T}, d] (the "
            "shared MLP's output on the same input).\n"
            f"- Smallest top1-top2 gap along the greedy path: {min_margin:.4f}.\n"
            "- Closest routing decisions over all MoE layers and positions: "
            + (f"group selection gap {st['min_gap_group']:.2e} (topk_group-th minus next group score), "
               if "min_gap_group" in st else "")
            + f"expert gap {st['min_gap_expert']:.2e} (k-th minus (k+1)-th "
            + ("corrected score inside the kept groups" if "min_gap_group" in st else "router logit") + ").\n"
            f"- Expert load (how often each expert was chosen, per MoE layer, {st['routings'] // len(st['load'])} "
            f"positions): {json.dumps(st['load'])}.\n"
        )
        if "min_gap_group" in st:
            f.write(
                f"- Of the {st['routings']} routings: the correction bias changes the chosen set in "
                f"{st['choices_changed_without_bias']}, the group limit in {st['choices_changed_without_groups']}; "
                f"both chosen experts sit in one group in {st['both_chosen_in_one_group']}; filling the masked groups "
                f"with 0.0 instead of -inf would change {st['choices_changed_with_zero_fill']} "
                f"({st['negative_corrected_scores']} corrected scores are negative).\n")
        f.write("\n" + extra + "\n\nSaved tensors (`layers.N` / `experts.J` folded, with counts):\n"
                + saved_names_summary(sd) + "\n")


def fixture_nemotron_h_moe(name, out_root, vers):
    spec = MOES[name]
    params = {k: v for k, v in spec.items() if k != "seed"}
    model, seed, touched, mm, cdiff, nll, sd = make_one(
        name, functools.partial(build_nemotron_h_moe, **params), spec["seed"], out_root, 101,
        min_margin=HYBRID_MIN_MARGIN, min_distinct=HYBRID_MIN_DISTINCT, check_period=True,
        load_kwargs={"attn_implementation": "eager", "experts_implementation": "eager"},
        accept=functools.partial(moe_accept, family="nemotron"))
    out = os.path.join(out_root, name)
    cfg = model.config
    d, E, I, S = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
    L = cfg.moe_latent_size  # None: the experts read and write d
    X = L or d
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    expected_kinds = [kinds[c] for c in spec["pattern"]]

    # The MoE tensors users download (per-expert, as save_pretrained is expected to write them).
    want = {}
    for i, kind in enumerate(expected_kinds):
        if kind == "moe":
            pre = f"backbone.layers.{i}.mixer."
            want[pre + "gate.weight"] = [E, d]
            want[pre + "gate.e_score_correction_bias"] = [E]
            want[pre + "shared_experts.up_proj.weight"] = [S, d]
            want[pre + "shared_experts.down_proj.weight"] = [d, S]
            for j in range(E):
                want[pre + f"experts.{j}.up_proj.weight"] = [I, X]
                want[pre + f"experts.{j}.down_proj.weight"] = [X, I]
            if L:
                want[pre + "fc1_latent_proj.weight"] = [L, d]
                want[pre + "fc2_latent_proj.weight"] = [d, L]
    got = {k: list(v.shape) for k, v in sd.items() if ".mixer." in k and k.split(".")[2] in
           {str(i) for i, kd in enumerate(expected_kinds) if kd == "moe"}}
    per_expert = got == want
    print(f"[{name}] MoE tensors per expert as expected: {per_expert}"
          + ("" if per_expert else f"; differences: {sorted(set(got) ^ set(want))[:20]}"))

    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    print(f"[{name}] config.json:\n{json.dumps(saved_cfg, indent=2)}")
    assert saved_cfg["layers_block_type"] == expected_kinds, saved_cfg["layers_block_type"]

    oracle = load_file(os.path.join(out, "oracle.safetensors"))
    info = hybrid_checks(model, oracle["prompt_ids"], oracle["greedy_ids"], oracle["greedy_logits"])
    info |= moe_diagnostics(model, "nemotron", oracle["prompt_ids"])
    print(f"[{name}] checks: {json.dumps(info)}")
    assert min(info["min_delta_per_mamba_layer"]) > 10 * info["time_step_min_clamp"], "the dt clamp would be active"
    assert info["max_abs_logit_diff_sdpa_vs_eager"] < 1e-3, "sdpa and eager attention disagree"
    assert info["cached_decode_greedy_ids_equal"], "transformers' cached decode gives other greedy ids"
    assert info["max_abs_logit_diff_cached_decode"] < 1e-3, "transformers' cached decode disagrees"
    for key in ("max_abs_logit_diff_if_bias_not_used_for_choice", "max_abs_logit_diff_if_no_group_limit",
                "max_abs_logit_diff_if_no_norm_topk_prob", "max_abs_logit_diff_if_routed_scaling_factor_ignored",
                "max_abs_logit_diff_if_weights_from_corrected_scores", "max_abs_logit_diff_if_expert_act_is_relu",
                "max_abs_logit_diff_if_shared_mlp_dropped"):
        assert info[key] > 1e-2, f"{key}: a wrong formula would hardly show"

    st, rec = add_routing_to_oracle(model, out, "nemotron")
    print(f"[{name}] routing: {json.dumps(st)}")

    what = (
        "HF transformers `NemotronHForCausalLM` (model_type `nemotron_h`) with mixture-of-experts layers, made with "
        f"`hybrid_override_pattern=\"{spec['pattern']}\"` (saved as `layers_block_type: {json.dumps(expected_kinds)}`), "
        f"`use_mamba_kernels=False`, random weights: hidden {d}, vocab {cfg.vocab_size}, untied `lm_head.weight`, eps "
        f"1e-5 (`layer_norm_epsilon`). Mamba2: {cfg.mamba_num_heads} heads x {cfg.mamba_head_dim}, n_groups "
        f"{cfg.n_groups}, state 16, conv 4, chunk 16. Attention: {cfg.num_attention_heads} q / "
        f"{cfg.num_key_value_heads} kv heads of head_dim {cfg.head_dim}, no positional encoding. MLP (`-`): relu2, "
        f"intermediate {cfg.intermediate_size}, no bias. MoE (`E`): {E} routed experts `down(relu(up(x))^2)` of "
        f"intermediate {I} (`moe_intermediate_size`), one shared expert of intermediate {S} "
        "(`moe_shared_expert_intermediate_size`, same relu2 MLP, added unweighted), "
        + (f"latent projections of width {L} (`moe_latent_size`): the routed experts read `mixer.fc1_latent_proj`(x) "
           f"[{L}, {d}] and their weighted sum goes through `mixer.fc2_latent_proj` [{d}, {L}]; the router and the "
           "shared expert read x. " if L else "no latent projections (`moe_latent_size` null). ")
        + f"Router (f32): s = sigmoid(x . W_gate^T); c = s + e_score_correction_bias (random "
        f"U(-{spec['bias_range']}, {spec['bias_range']}), set after the init); n_group {cfg.n_group} groups of "
        f"{E // cfg.n_group} consecutive experts, group score = sum of its best 2 c; the best topk_group "
        f"{cfg.topk_group} groups are kept, the other experts' c set to -inf (transformers 5.17); top "
        f"num_experts_per_tok {cfg.num_experts_per_tok} of c; weights = s of those, / (their sum + 1e-20) "
        f"(norm_topk_prob {str(cfg.norm_topk_prob).lower()}), x routed_scaling_factor {cfg.routed_scaling_factor}."
    )
    extra = (
        f"Causality check: prefix logits of a longer forward match prompt_logits to {cdiff:.2e}. transformers' cached "
        "path (prefill with use_cache=True, then one-token steps) gives the same greedy_ids, its logits within "
        f"{info['max_abs_logit_diff_cached_decode']:.2e}; sdpa attention within {info['max_abs_logit_diff_sdpa_vs_eager']:.2e}"
        + (f"; the default grouped_mm experts within {info['max_abs_logit_diff_grouped_mm_vs_eager_experts']:.2e}"
           if "max_abs_logit_diff_grouped_mm_vs_eager_experts" in info else "")
        + ". Smallest delta per Mamba layer: "
        f"{[round(v, 4) for v in info['min_delta_per_mamba_layer']]} (NemotronH's clamp at time_step_min "
        f"{info['time_step_min_clamp']} never active).\n\n"
        "What a wrong formula would change (max |diff| of the prompt logits): "
        + "; ".join(f"{k.removeprefix('max_abs_logit_diff_if_').replace('_', ' ')} {v:.3f}"
                    for k, v in info.items() if k.startswith("max_abs_logit_diff_if_"))
        + ".\n\nParsing notes: names use the prefix `backbone.`; an MoE layer holds `mixer.gate.weight` [E, d], "
        "`mixer.gate.e_score_correction_bias` [E] (f32), "
        + ("`mixer.experts.J.up_proj.weight` [I, d] and `mixer.experts.J.down_proj.weight` [d, I] for J < E "
           "(save_pretrained splits transformers' stacked in-memory tensors per expert)"
           if per_expert else "the expert tensors as listed below")
        + ", `mixer.shared_experts.{up,down}_proj.weight`. Config keys: `n_routed_experts`, `num_experts_per_tok`, "
        "`n_group`, `topk_group`, `norm_topk_prob`, `routed_scaling_factor`, `moe_intermediate_size`, "
        "`moe_shared_expert_intermediate_size`, `n_shared_experts` (1), "
        + (f"`moe_latent_size` ({L}: `mixer.fc1_latent_proj.weight`, `mixer.fc2_latent_proj.weight`), " if L
           else "`moe_latent_size` (null), ")
        + "`mlp_hidden_act` "
        "(experts, shared expert and MLP alike)."
    )
    write_readme_moe(out, name, what, seed, mm, st, rec, extra, vers, sd)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(vers | {"seed": seed}, f, indent=2)


def fixture_granite_moe_hybrid(name, out_root, vers):
    spec = MOES[name]
    params = {k: v for k, v in spec.items() if k != "seed"}
    model, seed, touched, mm, cdiff, nll, sd = make_one(
        name, functools.partial(build_granite_moe_hybrid, **params), spec["seed"], out_root, 101,
        min_margin=HYBRID_MIN_MARGIN, min_distinct=HYBRID_MIN_DISTINCT, check_period=True,
        load_kwargs={"attn_implementation": "eager", "experts_implementation": "eager"},
        accept=functools.partial(moe_accept, family="granite"))
    out = os.path.join(out_root, name)
    cfg = model.config
    d, E, I, S = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, cfg.shared_intermediate_size
    assert "lm_head.weight" not in sd, "tied model must not save lm_head.weight"
    want = {}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        want[pre + "block_sparse_moe.router.layer.weight"] = [E, d]
        want[pre + "block_sparse_moe.input_linear.weight"] = [E, 2 * I, d]
        want[pre + "block_sparse_moe.output_linear.weight"] = [E, d, I]
        want[pre + "shared_mlp.input_linear.weight"] = [2 * S, d]
        want[pre + "shared_mlp.output_linear.weight"] = [d, S]
    got = {k: list(v.shape) for k, v in sd.items() if "block_sparse_moe" in k or "shared_mlp" in k}
    legacy_names = got == want
    print(f"[{name}] MoE tensors under the released names: {legacy_names}"
          + ("" if legacy_names else f"; differences: {sorted(set(got) ^ set(want))[:20]}"))

    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    print(f"[{name}] config.json:\n{json.dumps(saved_cfg, indent=2)}")

    oracle = load_file(os.path.join(out, "oracle.safetensors"))
    info = granite_checks(model, oracle["prompt_ids"], oracle["greedy_ids"], oracle["greedy_logits"])
    info |= moe_diagnostics(model, "granite", oracle["prompt_ids"])
    print(f"[{name}] checks: {json.dumps(info)}")
    assert info["max_abs_logit_diff_sdpa_vs_eager"] < 1e-3, "sdpa and eager attention disagree"
    assert info["cached_decode_greedy_ids_equal"], "transformers' cached decode gives other greedy ids"
    assert info["max_abs_logit_diff_cached_decode"] < 1e-3, "transformers' cached decode disagrees"
    for key, v in info.items():
        if key.startswith("max_abs_logit_diff_if_"):
            assert v > 1e-2, f"{key}: a wrong formula would hardly show"

    st, rec = add_routing_to_oracle(model, out, "granite")
    print(f"[{name}] routing: {json.dumps(st)}")

    hd = d // cfg.num_attention_heads
    d_inner = cfg.mamba_expand * d
    what = (
        "HF transformers `GraniteMoeHybridForCausalLM` (model_type `granitemoehybrid`), random weights: "
        f"{cfg.num_hidden_layers} layers, made with `layer_types: {json.dumps(spec['layer_types'])}` (the released "
        f"models' names; transformers 5.17 saves them as `{json.dumps(saved_cfg.get('layer_types'))}`), hidden {d}, "
        f"vocab {cfg.vocab_size}, tied embeddings (no `lm_head.weight`), rms_norm_eps 1e-5. Every layer: "
        "h += residual_multiplier * mixer(input_layernorm(h)); then with u = post_attention_layernorm(h): "
        "h += residual_multiplier * (moe(u) + shared_mlp(u)). Embedding output x embedding_multiplier "
        f"{cfg.embedding_multiplier}; residual_multiplier {cfg.residual_multiplier}; logits = lm_head(norm(h)) / "
        f"logits_scaling {cfg.logits_scaling}. Mamba2 (Bamba's): {cfg.mamba_n_heads} heads x {cfg.mamba_d_head} "
        f"(d_inner {d_inner}), mamba_n_groups 1 (its gated norm over all of d_inner), state {cfg.mamba_d_state}, conv "
        f"4 with bias, chunk 16, no in/out bias, silu (`hidden_act`), time_step_limit (0, inf). Attention: "
        f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads of head_dim {hd} (hidden / heads), "
        f"softmax scale attention_multiplier {cfg.attention_multiplier} (not 1/sqrt({hd})), causal, "
        + (f"position_embedding_type `rope` (rotary embeddings on q and k, theta {spec['rope_theta']:g}, "
           "rotate-half pairs (i, i + head_dim/2), positions from 0), no biases."
           if spec.get("position_embedding_type") == "rope" else "position_embedding_type `nope` (no RoPE), no biases.")
        + " Shared MLP: `output_linear(silu(a) * b)` with "
        f"[a; b] = input_linear(u), intermediate {S} (`shared_intermediate_size`). MoE: {E} experts "
        f"(`num_local_experts`), the same gated MLP with intermediate {I} (`intermediate_size`); router: logits = "
        f"u . W_router^T, the top num_experts_per_tok {cfg.num_experts_per_tok} logits, weights = softmax over "
        "those only; routed output = sum of weight x expert(u)."
    )
    extra = (
        f"Causality check: prefix logits of a longer forward match prompt_logits to {cdiff:.2e}. transformers' cached "
        "path (prefill with use_cache=True, then one-token steps) gives the same greedy_ids, its logits within "
        f"{info['max_abs_logit_diff_cached_decode']:.2e}; sdpa attention within {info['max_abs_logit_diff_sdpa_vs_eager']:.2e}"
        + (f"; the default grouped_mm experts within {info['max_abs_logit_diff_grouped_mm_vs_eager_experts']:.2e}"
           if "max_abs_logit_diff_grouped_mm_vs_eager_experts" in info else "")
        + f". Smallest delta = softplus(dt + dt_bias) per Mamba layer: "
        f"{[round(v, 4) for v in info['min_delta_per_mamba_layer']]}. Mean largest softmax weight per attention layer "
        f"(positions >= 8): {info['attention_mean_max_weight_per_layer']}.\n\n"
        "What a wrong formula would change (max |diff| of the prompt logits): "
        + "; ".join(f"{k.removeprefix('max_abs_logit_diff_if_').replace('_', ' ')} {v:.3f}"
                    for k, v in info.items() if k.startswith("max_abs_logit_diff_if_"))
        + ".\n\nParsing notes: names use the prefix `model.` (`model.embed_tokens.weight`, "
        "`model.layers.N.{input_layernorm,post_attention_layernorm}.weight`, `model.layers.N.mamba.*` or "
        "`model.layers.N.self_attn.{q,k,v,o}_proj.weight`, `model.norm.weight`); "
        + ("`block_sparse_moe.router.layer.weight` [E, d], `block_sparse_moe.input_linear.weight` [E, 2I, d] (rows "
           "0..I of each expert are the gate), `block_sparse_moe.output_linear.weight` [E, d, I], "
           "`shared_mlp.input_linear.weight` [2S, d] (gate first), `shared_mlp.output_linear.weight` [d, S] "
           "(save_pretrained writes the released names, not transformers' in-memory `experts.gate_up_proj` / "
           "`router.weight`)" if legacy_names else "the MoE tensors as listed below")
        + ". config.json keys: `layer_types`, `num_local_experts`, `num_experts_per_tok`, `intermediate_size` (per "
        "expert), `shared_intermediate_size`, `embedding_multiplier`, `residual_multiplier`, `attention_multiplier`, "
        "`logits_scaling`, `position_embedding_type`, `mamba_*`, `rms_norm_eps`, `tie_word_embeddings`."
    )
    write_readme_moe(out, name, what, seed, mm, st, rec, extra, vers, sd)
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(vers | {"seed": seed}, f, indent=2)


FIXTURES = ["hf_mamba2_g1", "nemotron_h_g2", "nemotron_h_hybrid", "nemotron_h_mqa", "nemotron_h_moe",
            "nemotron_h_latent", "granite_moe_hybrid", "granite_rope"]


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
        elif name in ("nemotron_h_moe", "nemotron_h_latent"):
            fixture_nemotron_h_moe(name, args.out, vers)
        elif name in ("granite_moe_hybrid", "granite_rope"):
            fixture_granite_moe_hybrid(name, args.out, vers)
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
