#!/usr/bin/env python3
"""Independent float64 check of the fixtures: the MAMBA2.md formulas, token by token (sequential
scan, per-group gated norm), written from the design doc with numpy only, against the logits that
HF transformers wrote into oracle.safetensors.

Usage: python3 scripts/check_fixtures.py [tests/fixtures]
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def softplus(v):
    return np.where(v > 20, v, np.log1p(np.exp(np.minimum(v, 20))))


def silu(v):
    return v / (1 + np.exp(-v))


def rmsnorm(v, w, eps):
    return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * w


def run(folder):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    oracle = load_file(os.path.join(folder, "oracle.safetensors"))
    pre = "backbone." if "backbone.embeddings.weight" in w else "model."
    if cfg["model_type"] == "mamba2":
        d_inner = cfg["expand"] * cfg["hidden_size"]
        P, N, G, L = cfg["head_dim"], cfg["state_size"], cfg["n_groups"], cfg["num_hidden_layers"]
        dt_min = cfg["time_step_limit"][0]
    else:  # nemotron_h
        P, N, G = cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]
        d_inner = cfg["mamba_num_heads"] * P
        L = len(cfg["layers_block_type"])
        assert all(t in ("linear_attention", "mamba") for t in cfg["layers_block_type"])
        dt_min = cfg["time_step_min"]  # NemotronH clamps delta >= time_step_min in its chunked path
    H = d_inner // P
    K = cfg["conv_kernel"]
    eps = cfg["layer_norm_epsilon"]
    conv_dim = d_inner + 2 * G * N
    emb = w[pre + "embeddings.weight"]
    lm = emb if cfg.get("tie_word_embeddings") else w["lm_head.weight"]

    ids = np.concatenate([oracle["prompt_ids"], oracle["greedy_ids"]])
    T = len(oracle["prompt_ids"])
    S = [np.zeros((H, P, N)) for _ in range(L)]
    cs = [np.zeros((conv_dim, K)) for _ in range(L)]
    logits = []
    for tok in ids[: T + len(oracle["greedy_ids"]) - 1]:
        r = emb[tok].copy()
        for i in range(L):
            p = f"{pre}layers.{i}."
            h = rmsnorm(r, w[p + "norm.weight"], eps)
            zxbcdt = w[p + "mixer.in_proj.weight"] @ h
            z, xBC, dt = zxbcdt[:d_inner], zxbcdt[d_inner:d_inner + conv_dim], zxbcdt[d_inner + conv_dim:]
            cs[i] = np.roll(cs[i], -1, axis=1)
            cs[i][:, K - 1] = xBC
            u = silu(w[p + "mixer.conv1d.bias"] + np.sum(w[p + "mixer.conv1d.weight"][:, 0, :] * cs[i], 1))
            x = u[:d_inner].reshape(H, P)
            B = u[d_inner:d_inner + G * N].reshape(G, N)
            C = u[d_inner + G * N:].reshape(G, N)
            delta = np.maximum(softplus(dt + w[p + "mixer.dt_bias"]), dt_min)
            A = -np.exp(w[p + "mixer.A_log"])
            g = np.arange(H) // (H // G)
            S[i] = np.exp(delta * A)[:, None, None] * S[i] + (delta[:, None] * x)[:, :, None] * B[g][:, None, :]
            y = np.einsum("hpn,hn->hp", S[i], C[g]) + w[p + "mixer.D"][:, None] * x
            v = (y.reshape(-1) * silu(z)).reshape(G, -1)
            v = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps)
            r = r + w[p + "mixer.out_proj.weight"] @ (w[p + "mixer.norm.weight"] * v.reshape(-1))
        logits.append(lm @ rmsnorm(r, w[pre + "norm_f.weight"], eps))
    logits = np.stack(logits)
    ref = np.concatenate([oracle["prompt_logits"], oracle["greedy_logits"][1:]]).astype(np.float64)
    err = np.abs(logits - ref).max()
    nmse = np.sum((logits - ref) ** 2) / np.sum(ref ** 2)
    lp = logits[: T - 1] - np.log(np.sum(np.exp(logits[: T - 1] - logits[: T - 1].max(-1, keepdims=True)), -1,
                                         keepdims=True)) - logits[: T - 1].max(-1, keepdims=True)
    nll = -np.mean(lp[np.arange(T - 1), oracle["prompt_ids"][1:]])
    greedy_ok = np.array_equal(np.argmax(logits[T - 1:], -1), oracle["greedy_ids"])
    print(f"{folder}: max|f64 ref - HF| = {err:.3e}, NMSE = {nmse:.3e}, nll {nll:.6f} vs "
          f"{float(oracle['prompt_nll'][0]):.6f}, greedy ids equal: {greedy_ok}")
    return err < 1e-4 and greedy_ok


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    ok = all([run(os.path.join(root, n)) for n in ("hf_mamba2_g1", "nemotron_h_g2")])
    sys.exit(0 if ok else 1)
