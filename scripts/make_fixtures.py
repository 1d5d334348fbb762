#!/usr/bin/env python3
"""External-oracle fixtures for mamba2-wgpu, made with HF transformers on the CPU in float32.

Writes two folders under --out (default tests/fixtures):

  hf_mamba2_g1/     HF Mamba2ForCausalLM (model_type mamba2), random tiny, n_groups = 1, tied embeddings
  nemotron_h_g2/    HF NemotronHForCausalLM, all-Mamba layers, n_groups = 2, head_dim 12, untied lm_head

Each folder holds config.json + model.safetensors exactly as `save_pretrained` writes them (f32),
oracle.safetensors (prompt_ids, prompt_logits, greedy_ids, greedy_logits, prompt_nll),
versions.json and README.md.

Everything is deterministic (fixed seeds, CPU, float32, no TF32, deterministic algorithms), so the
same command gives the same weights bit for bit on any machine with the same torch version, and
the same logits up to CPU float rounding.

Greedy continuations are computed by full forwards with use_cache=False (NemotronH's generate
fails without attention layers), which is faithful to the chunked (prefill) path of the model:
greedy_logits[i] are the last-position logits of a fresh forward over prompt + greedy_ids[:i].

Usage:  python3 scripts/make_fixtures.py --out tests/fixtures
"""

import argparse
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


def make_one(name, builder, base_seed, out_root, vocab):
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
        if float(m.min()) >= MIN_MARGIN and distinct >= MIN_DISTINCT:
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
    reloaded = type(model).from_pretrained(out, dtype=torch.float32).eval()
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    args = ap.parse_args()

    setup_torch()
    vers = versions()
    print(f"transformers {transformers.__version__}  torch {torch.__version__}  "
          f"safetensors {safetensors.__version__}  python {vers['python']}")
    os.makedirs(args.out, exist_ok=True)
    import importlib.util
    for pkg in ("mamba_ssm", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"WARNING: {pkg} is installed; transformers may route through it instead of its torch path")

    # (a) HF Mamba2, G = 1, tied
    name = "hf_mamba2_g1"
    model, seed, touched, mm, cdiff, nll, sd = make_one(name, build_mamba2_g1, 1234, args.out, 100)
    assert "lm_head.weight" not in sd, "tied model must not save lm_head.weight"
    print(f"[{name}] lm_head.weight absent from model.safetensors: OK (tied)")
    out = os.path.join(args.out, name)
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

    # (b) NemotronH, all Mamba, G = 2, head_dim 12, untied
    name = "nemotron_h_g2"
    model, seed, touched, mm, cdiff, nll, sd = make_one(name, build_nemotron_h_g2, 4321, args.out, 101)
    assert "lm_head.weight" in sd, "untied model must save lm_head.weight"
    print(f"[{name}] lm_head.weight present: OK (untied)")
    info = nemotron_checks(model, load_file(os.path.join(args.out, name, "oracle.safetensors"))["prompt_ids"])
    print(f"[{name}] checks: {json.dumps(info)}")
    assert min(info["min_delta_per_layer"]) > 10 * info["time_step_min_clamp"], \
        "the dt clamp at time_step_min would be active: pick other perturbations"
    assert info["max_abs_logit_diff_if_norm_not_grouped"] > 1e-2, "group norm would not show"
    out = os.path.join(args.out, name)
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

    for n in ("hf_mamba2_g1", "nemotron_h_g2"):
        d = os.path.join(args.out, n)
        for f in os.listdir(d):
            os.chmod(os.path.join(d, f), 0o644)
        total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"{d}: {sorted(os.listdir(d))} {total} bytes")
        assert total < 1_000_000


if __name__ == "__main__":
    main()
