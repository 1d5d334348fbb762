#!/usr/bin/env python3
"""GGUF fixtures in llama.cpp's `nemotron_h` layout, written with the `gguf` package (PyPI)
from tests/fixtures/nemotron_h_hybrid (whose HF oracle tests/gguf_hybrid.rs compares them with).

  pip install gguf numpy
  python3 scripts/make_nemotron_h_gguf.py --out tests/fixtures/gguf

The layout follows llama.cpp's converter (`NemotronHModel`, a `GraniteHybridModel`, read at
upstream commit #19519 through the ymcki/llama.cpp mirror 77d6ae4) and loader
(`llama-model.cpp`, LLM_ARCH_NEMOTRON_H):
- metadata `nemotron_h.{block_count, context_length (2^20), embedding_length,
  feed_forward_length (per layer: the MLP width on MLP layers, 0 elsewhere),
  attention.head_count (one value), attention.head_count_kv (per layer: the kv heads on
  attention layers, 0 elsewhere), attention.key_length / value_length (the attention head
  size), attention.layer_norm_rms_epsilon, vocab_size (unpadded), rope.dimension_count,
  ssm.{conv_kernel, state_size, group_count, inner_size, time_step_rank}}`; the loader
  calls a layer recurrent when both per-layer values are 0, attention when only its
  feed-forward length is 0, MLP otherwise;
- tensors `token_embd`, `output_norm`, `output`, `blk.N.attn_norm` (every layer), the
  Mamba layers' `ssm_*` as in the `mamba2` layout (`ssm_a = -exp(A_log)` `[H, 1]`, `ssm_d`
  `[H, 1]`, `ssm_conv1d` squeezed, `ssm_norm` `[G, d_inner/G]`), the attention layers'
  `attn_q/attn_k/attn_v/attn_output` (q and k rows permuted per head as the converter's
  llama-style `permute` does; with no rotary embedding this leaves q·k unchanged) and the MLP
  layers' `ffn_up/ffn_down`;
- a byte-level `gpt2` vocabulary padded to a multiple of 8 with `[PAD{i}]` tokens (the
  tensors keep the model's 101 rows).

Made: `nemotron_h_hybrid.f32.gguf`, and `nemotron_h_hybrid.q8_0.gguf` with every 2-D weight
whose rows are a multiple of 32 wide in Q8_0 (gguf-py's quantizer, as llama-quantize writes
Q8_0 blocks).

And in llama.cpp's `nemotron_h_moe` layout (Nemotron 3 Nano; converter `NemotronHModel` with
`num_experts_per_tok`, loader LLM_ARCH_NEMOTRON_H_MOE, read at ngxson/llama.cpp 3f545be;
names from gguf-py 0.19's tensor list for the architecture), from tests/fixtures/
nemotron_h_moe and nemotron_h_latent: `nemotron_h_moe.{expert_count, expert_used_count,
expert_shared_count, expert_feed_forward_length, expert_shared_feed_forward_length,
expert_group_count, expert_group_used_count, expert_weights_norm, expert_weights_scale,
moe_latent_size}`, `feed_forward_length` per layer (the expert width on MoE layers, the MLP
width on the fixtures' one dense layer, 0 elsewhere); tensors `blk.N.ffn_gate_inp` (the
router), `blk.N.exp_probs_b.bias` (its correction bias), `blk.N.ffn_{up,down}_exps` (the
per-expert matrices stacked expert-major, `torch.stack(dim=0)` as the converter does),
`blk.N.ffn_{up,down}_shexp`, `blk.N.ffn_latent_{down,up}` (fc1/fc2 latent projections).
llama.cpp's loader makes every feed-forward layer of such a file an MoE (the released
models have no dense one); this engine reads a layer holding `ffn_up` as a dense MLP.
Made: `nemotron_h_moe.f32.gguf`, `nemotron_h_latent.f32.gguf` (their widths, 48 and 24,
take no Q8_0 blocks); and `moe64.f32.gguf` / `moe64.q8_0.gguf`, a random `nemotron_h_moe`
model (numpy seed 11; layers M E * E, d 64, 8 experts of 32 in 2 groups, top 2, a shared
expert of 64) whose every matrix but the router is 32-multiple wide: the Q8_0 file holds
them all (the stacked experts, embedding and head too) in gguf-py's Q8_0 blocks;
`moe64.q4_0.gguf` / `moe64.q4_1.gguf` / `moe64.q5_0.gguf` / `moe64.q5_1.gguf` the same but
their stacked experts in gguf-py's Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks (mixed files, as
llama-quantize's mixes are: a Q5_K_M file's rows that are not a multiple of 256 values are
Q5_1), and `moe64.dequant.json`, gguf-py's dequantization of every tensor of the quantized
files (hash and first values).
"""

import argparse
import json
from pathlib import Path

import numpy as np
import gguf

from make_gguf_fixtures import MAMBA_NAMES, byte_tokens, dequant_record, mamba_layout, read_safetensors

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FIXTURE = FIXTURES / "nemotron_h_hybrid"


def permute(w, n_head):
    """llama.cpp's converter permutation of q/k rows (per head: interleaved halves)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def add_byte_vocab(w, vocab):
    """A byte-level `gpt2` vocabulary of `vocab` tokens (one per byte character but the
    last, `!"` with its one merge), padded to a multiple of 8 with `[PAD{i}]` tokens."""
    padded = -(vocab // -8) * 8
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    tokens = byte_tokens(vocab - 1) + ['!"'] + [f"[PAD{i}]" for i in range(padded - vocab)]
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab + [gguf.TokenType.UNUSED] * (padded - vocab))
    w.add_token_merges(['! "'])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)


def stack_experts(tensors):
    """Each layer's `mixer.experts.E.{up,down}_proj.weight` as one `blk.N.ffn_{up,down}_exps`
    `[E, rows, cols]` (expert order 0…E-1, as the converter's torch.stack(dim=0)), in the
    place of the layer's first expert; every other tensor as it was."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        rest = name.removeprefix("backbone.")
        parts = rest.split(".")
        if len(parts) == 7 and parts[2:4] == ["mixer", "experts"]:
            which = parts[5].removesuffix("_proj")
            key = f"layers.{parts[1]}.ffn_{which}_exps.weight"
            stacks.setdefault(key, {})[int(parts[4])] = t
            out.setdefault(key, None)
        else:
            out[name] = t
    for key, experts in stacks.items():
        out[key] = np.stack([experts[e] for e in range(len(experts))], axis=0)
    return out


def write(out, cfg, tensors, q8, experts=None):
    kinds = cfg["layers_block_type"]
    n = len(kinds)
    d = cfg["hidden_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    H, P, G = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"]
    d_inner = H * P
    vocab = tensors["backbone.embeddings.weight"].shape[0]
    moe = "moe" in kinds
    w = gguf.GGUFWriter(str(out), "nemotron_h_moe" if moe else "nemotron_h")
    w.add_name(out.stem)
    w.add_block_count(n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(d)
    widths = {"mlp": cfg["intermediate_size"], "moe": cfg.get("moe_intermediate_size")}
    w.add_feed_forward_length([widths.get(k) or 0 for k in kinds])
    if moe:
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("moe_latent_size"):
            w.add_moe_latent_size(cfg["moe_latent_size"])
    w.add_head_count(heads)
    w.add_head_count_kv([kv if k == "full_attention" else 0 for k in kinds])
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(d // heads)
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(G)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(H)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    add_byte_vocab(w, vocab)
    w.add_add_bos_token(True)
    names = {
        **MAMBA_NAMES,
        "mixer.q_proj.weight": "attn_q.weight",
        "mixer.k_proj.weight": "attn_k.weight",
        "mixer.v_proj.weight": "attn_v.weight",
        "mixer.o_proj.weight": "attn_output.weight",
        "mixer.up_proj.weight": "ffn_up.weight",
        "mixer.down_proj.weight": "ffn_down.weight",
        "mixer.gate.weight": "ffn_gate_inp.weight",
        "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
        "mixer.fc1_latent_proj.weight": "ffn_latent_down.weight",
        "mixer.fc2_latent_proj.weight": "ffn_latent_up.weight",
    }
    tensors = stack_experts(tensors)
    for name, t in tensors.items():
        rest = name.removeprefix("backbone.")
        if rest == "embeddings.weight":
            new = "token_embd.weight"
        elif rest == "norm_f.weight":
            new = "output_norm.weight"
        elif name == "lm_head.weight":
            new = "output.weight"
        elif rest.endswith("_exps.weight"):
            new = rest.replace("layers.", "blk.", 1)
        else:
            _, i, part = rest.split(".", 2)
            new = f"blk.{i}.{names[part]}"
            t = mamba_layout(part, t, G, d_inner)
            if part == "mixer.q_proj.weight":
                t = permute(t, heads)
            elif part == "mixer.k_proj.weight":
                t = permute(t, kv)
        t = np.ascontiguousarray(t, dtype=np.float32)
        # (llama-quantize keeps the router, `ffn_gate_inp`, in F32.)
        quantizable = t.ndim in (2, 3) and t.shape[-1] % 32 == 0
        if q8 and quantizable and "norm" not in new and "ffn_gate_inp" not in new:
            ty = gguf.GGMLQuantizationType.Q8_0
            if experts is not None and new.endswith("_exps.weight"):
                ty = experts
            q = gguf.quants.quantize(t, ty)
            w.add_tensor(new, q, raw_shape=q.shape, raw_dtype=ty)
        else:
            w.add_tensor(new, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_moe(seed=11):
    """A random Nemotron-H MoE config and HF-named tensors whose matrices are 32-multiple
    wide (so that a Q8_0 file can hold every one)."""
    rng = np.random.default_rng(seed)
    d, H, P, G, N, V = 64, 4, 16, 1, 16, 101
    E, I, S = 8, 32, 64
    cfg = {
        "hidden_size": d, "layers_block_type": ["mamba", "moe", "full_attention", "moe"],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "mamba_num_heads": H, "mamba_head_dim": P, "n_groups": G, "ssm_state_size": N,
        "conv_kernel": 4, "layer_norm_epsilon": 1e-5, "intermediate_size": 0,
        "n_routed_experts": E, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": I, "moe_shared_expert_intermediate_size": S,
        "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.0,
    }
    f32 = np.float32

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(f32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(f32)

    conv = H * P + 2 * G * N
    t = {"backbone.embeddings.weight": rng.standard_normal((V, d)).astype(f32),
         "backbone.norm_f.weight": norm(d), "lm_head.weight": mat(V, d)}
    for i, kind in enumerate(cfg["layers_block_type"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = norm(d)
        if kind == "mamba":
            t[p + "mixer.in_proj.weight"] = mat(2 * H * P + 2 * G * N + H, d)
            t[p + "mixer.conv1d.weight"] = (0.5 * rng.standard_normal((conv, 1, 4))).astype(f32)
            t[p + "mixer.conv1d.bias"] = (0.1 * rng.standard_normal(conv)).astype(f32)
            t[p + "mixer.dt_bias"] = (0.5 * rng.standard_normal(H)).astype(f32)
            t[p + "mixer.A_log"] = np.log(rng.uniform(1, 16, H)).astype(f32)
            t[p + "mixer.D"] = (1.0 + 0.1 * rng.standard_normal(H)).astype(f32)
            t[p + "mixer.norm.weight"] = norm(H * P)
            t[p + "mixer.out_proj.weight"] = mat(d, H * P)
        elif kind == "full_attention":
            for n, rows in [("q", 64), ("k", 32), ("v", 32)]:
                t[p + f"mixer.{n}_proj.weight"] = mat(rows, d)
            t[p + "mixer.o_proj.weight"] = mat(d, 64)
        else:
            t[p + "mixer.gate.weight"] = mat(E, d)
            t[p + "mixer.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(f32)
            for e in range(E):
                t[p + f"mixer.experts.{e}.up_proj.weight"] = mat(I, d)
                t[p + f"mixer.experts.{e}.down_proj.weight"] = mat(d, I)
            t[p + "mixer.shared_experts.up_proj.weight"] = mat(S, d)
            t[p + "mixer.shared_experts.down_proj.weight"] = mat(d, S)
    return cfg, t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/gguf"))
    a = p.parse_args()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    tensors = read_safetensors(FIXTURE / "model.safetensors")
    a.out.mkdir(parents=True, exist_ok=True)
    write(a.out / "nemotron_h_hybrid.f32.gguf", cfg, tensors, False)
    write(a.out / "nemotron_h_hybrid.q8_0.gguf", cfg, tensors, True)
    for name in ["nemotron_h_moe", "nemotron_h_latent"]:
        fixture = FIXTURES / name
        cfg = json.loads((fixture / "config.json").read_text())
        tensors = read_safetensors(fixture / "model.safetensors")
        write(a.out / f"{name}.f32.gguf", cfg, tensors, False)
    cfg, tensors = random_moe()
    write(a.out / "moe64.f32.gguf", cfg, tensors, False)
    write(a.out / "moe64.q8_0.gguf", cfg, tensors, True)
    write(a.out / "moe64.q4_0.gguf", cfg, tensors, True, gguf.GGMLQuantizationType.Q4_0)
    write(a.out / "moe64.q5_0.gguf", cfg, tensors, True, gguf.GGMLQuantizationType.Q5_0)
    write(a.out / "moe64.q4_1.gguf", cfg, tensors, True, gguf.GGMLQuantizationType.Q4_1)
    write(a.out / "moe64.q5_1.gguf", cfg, tensors, True, gguf.GGMLQuantizationType.Q5_1)
    # gguf-py's dequantization of every tensor of the quantized files (the oracle of
    # tests/gguf.rs for these block types, as oracle.json is for the k256 files).
    record = {name: dequant_record(a.out / name)
              for name in ["moe64.q8_0.gguf", "moe64.q4_0.gguf", "moe64.q5_0.gguf",
                           "moe64.q4_1.gguf", "moe64.q5_1.gguf"]}
    (a.out / "moe64.dequant.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
