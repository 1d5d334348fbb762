#!/usr/bin/env python3
"""A GGUF fixture in llama.cpp's `granitehybrid` layout (IBM Granite-4.0-H), written with the
`gguf` package (PyPI, gguf-py 0.19) from tests/fixtures/granite_moe_hybrid (whose HF oracle
tests/gguf_hybrid.rs compares it with).

  pip install gguf numpy
  python3 scripts/make_granite_gguf.py --out tests/fixtures/gguf

The layout follows llama.cpp's converter (`conversion/granite.py`, `GraniteHybridModel`, read
at ngxson/llama.cpp 3f545be) and loader (LLM_ARCH_GRANITE_HYBRID), with the tensor names of
gguf-py 0.19's list for the architecture:
- metadata `granitehybrid.{block_count, context_length (2^20: no rotary embedding),
  embedding_length, feed_forward_length (one expert's width), attention.head_count,
  attention.head_count_kv (per layer: the kv heads on attention layers, 0 on Mamba ones,
  which is how the loader tells them apart), attention.layer_norm_rms_epsilon,
  rope.scaling.finetuned (false: no rotary embedding), attention.scale
  (attention_multiplier), embedding_scale, residual_scale, logit_scale (logits_scaling),
  expert_count, expert_used_count, expert_shared_feed_forward_length, ssm.{conv_kernel,
  state_size, group_count, inner_size, time_step_rank}}`;
- tensors `token_embd`, `output_norm` (no `output`: tied), per layer `attn_norm`
  (input_layernorm) and `ffn_norm` (post_attention_layernorm), the Mamba layers' `ssm_*` as
  in the `mamba2` layout, the attention layers' `attn_{q,k,v,output}` (q and k rows permuted
  per head as the converter's llama-style `permute` does; without rotary embeddings q·k is
  unchanged), the router `ffn_gate_inp`, the experts' `input_linear [E, 2I, d]` split along
  its rows into `ffn_gate_exps` (first half) and `ffn_up_exps`, `output_linear` as
  `ffn_down_exps`, and the shared MLP's `input_linear` split the same way into
  `ffn_gate_shexp` / `ffn_up_shexp`, its `output_linear` as `ffn_down_shexp`;
- the byte-level `gpt2` vocabulary of scripts/make_nemotron_h_gguf.py.

Made: `granite_moe_hybrid.f32.gguf`.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import gguf

from make_gguf_fixtures import MAMBA_NAMES, mamba_layout, read_safetensors
from make_nemotron_h_gguf import add_byte_vocab, permute

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "granite_moe_hybrid"


def write(out, cfg, tensors):
    kinds = cfg["layer_types"]
    n = len(kinds)
    d = cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    H, G = cfg["mamba_n_heads"], cfg["mamba_n_groups"]
    d_inner = cfg["mamba_expand"] * d
    I, S = cfg["intermediate_size"], cfg["shared_intermediate_size"]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    w.add_name(out.stem)
    w.add_block_count(n)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(d)
    w.add_feed_forward_length(I)
    w.add_head_count(heads)
    w.add_head_count_kv([kv if k == "full_attention" else 0 for k in kinds])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_scaling_finetuned(False)
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_feed_forward_length(S)
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(G)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(H)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_byte_vocab(w, vocab)
    mamba = {f"mamba.{k.removeprefix('mixer.')}": v for k, v in MAMBA_NAMES.items()
             if k.startswith("mixer.")}
    names = {
        **mamba,
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
        "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
        "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
    }
    out_tensors = []
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            out_tensors.append(("token_embd.weight", t))
            continue
        if name == "model.norm.weight":
            out_tensors.append(("output_norm.weight", t))
            continue
        _, _, i, part = name.split(".", 3)
        blk = f"blk.{i}."
        if part == "block_sparse_moe.input_linear.weight":
            out_tensors.append((blk + "ffn_gate_exps.weight", t[:, :I, :]))
            out_tensors.append((blk + "ffn_up_exps.weight", t[:, I:, :]))
        elif part == "shared_mlp.input_linear.weight":
            out_tensors.append((blk + "ffn_gate_shexp.weight", t[:S]))
            out_tensors.append((blk + "ffn_up_shexp.weight", t[S:]))
        else:
            mixer_part = "mixer." + part.removeprefix("mamba.")
            t = mamba_layout(mixer_part, t, G, d_inner)
            if part == "self_attn.q_proj.weight":
                t = permute(t, heads)
            elif part == "self_attn.k_proj.weight":
                t = permute(t, kv)
            out_tensors.append((blk + names[part], t))
    for new, t in out_tensors:
        w.add_tensor(new, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/gguf"))
    a = p.parse_args()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    tensors = read_safetensors(FIXTURE / "model.safetensors")
    a.out.mkdir(parents=True, exist_ok=True)
    write(a.out / "granite_moe_hybrid.f32.gguf", cfg, tensors)


if __name__ == "__main__":
    main()
