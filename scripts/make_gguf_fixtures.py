#!/usr/bin/env python3
"""GGUF fixtures for tests/gguf*.rs, in llama.cpp's `mamba2` layout, written with the `gguf`
package (PyPI, gguf-py 0.19) and quantized and run by llama.cpp itself.

  pip install gguf numpy
  python3 scripts/make_gguf_fixtures.py --llama-cpp /path/to/llama.cpp/build \\
      --logits /path/to/logits --out tests/fixtures/gguf

`--llama-cpp` is a build of llama.cpp (commit 0c1e570 was used) with `bin/llama-quantize`;
`--logits` is scripts/gguf_logits.cpp built against that tree (it writes llama.cpp's CPU
logits for a prompt of token ids):
  g++ -O2 -std=c++17 scripts/gguf_logits.cpp -I$L/include -I$L/ggml/include \
      $L/build/src/libllama.a $L/build/ggml/src/libggml{,-cpu,-base}.a -lpthread -fopenmp

The layout follows llama.cpp's converter (`conversion/mamba.py`, `Mamba2Model`): names
`token_embd`, `output_norm`, `output`, `blk.N.{attn_norm, ssm_in, ssm_conv1d, ssm_dt.bias,
ssm_a, ssm_d, ssm_norm, ssm_out}`; `ssm_a = -exp(A_log)` as `[H, 1]`, `ssm_d` as `[H, 1]`,
`ssm_conv1d` squeezed to `[C, K]`, `ssm_norm` as `[G, d_inner/G]`; the vocabulary padded to a
multiple of 16 (the embedding with zero rows). Metadata: `mamba2.{context_length,
embedding_length, feed_forward_length, attention.head_count, block_count, ssm.conv_kernel,
ssm.inner_size, ssm.state_size, ssm.time_step_rank, ssm.group_count,
attention.layer_norm_rms_epsilon}`, a byte-level `gpt2` vocabulary (one token per byte
character but the last, which is `!"` with its one merge).

Made:
- `g1.f32.gguf`: tests/fixtures/hf_mamba2_g1 (whose HF oracle the test compares with).
- `k256.{q8_0,q4_0,q4_k,q5_k,q6_k}.gguf`: a random 256-wide model (seed 7; k-quant blocks
  need rows of 256), quantized by llama-quantize from its f32 GGUF (not committed).
- `k256.rows.safetensors`: the f32 source of the first rows of `blk.0.ssm_in` (32) and
  `blk.0.ssm_out` (16), the input whose llama-quantize blocks the k256 files hold (the
  quantizers' oracle in tests/gguf.rs). `--rows-only` writes just this file.
- `oracle.json`: per file, llama.cpp's logits for `prompt` (in `<file>.logits`, f32
  `[T, V]`), and for every tensor gguf-py's dequantization (`gguf.quants.dequantize`) as an
  FNV-1a 64 hash of its little-endian f32 bytes plus its first values.
"""

import argparse
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import gguf

PROMPT_K256 = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26, 43, 38, 32, 79, 50, 28, 84, 197, 169,
               39, 93, 75, 105, 82, 0, 97, 49, 44, 59, 230, 78, 164, 62, 86, 208, 99, 86, 28, 34, 82]


def read_safetensors(path):
    b = Path(path).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", name
        s, e = info["data_offsets"]
        out[name] = np.frombuffer(b[8 + n + s:8 + n + e], dtype=np.float32).reshape(info["shape"])
    return out


def byte_tokens(n):
    """The first n characters of GPT-2's byte-to-unicode alphabet."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return [chr(c) for c in cs][:n]


# llama.cpp's names of a Mamba2 layer's tensors after `blk.N.`, from HF's after `layers.N.`.
MAMBA_NAMES = {
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
}


def mamba_layout(part, t, groups, d_inner):
    """HF tensor `part` of a Mamba2 layer as llama.cpp's converter stores it: the conv
    squeezed to [C, K], A = -exp(A_log) and D as [H, 1], the gated norm as [G, d_inner/G]."""
    if part == "mixer.conv1d.weight":
        return t.squeeze()
    if part == "mixer.A_log":
        return (-np.exp(t)).reshape(-1, 1)
    if part == "mixer.D":
        return t.reshape(-1, 1)
    if part == "mixer.norm.weight":
        return t.reshape(groups, d_inner // groups)
    return t


def write_gguf(out, cfg, tensors):
    d = cfg["hidden_size"]
    d_inner = int(cfg.get("expand", 2) * d)
    head_dim = cfg["head_dim"]
    groups = cfg.get("n_groups", 1)
    vocab = tensors["backbone.embeddings.weight"].shape[0]
    padded = -(vocab // -16) * 16
    w = gguf.GGUFWriter(str(out), "mamba2")
    w.add_name(out.stem)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(d)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_ssm_conv_kernel(cfg.get("conv_kernel", 4))
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(cfg.get("state_size", 128))
    w.add_ssm_time_step_rank(d_inner // head_dim)
    w.add_ssm_group_count(groups)
    w.add_layer_norm_rms_eps(cfg.get("layer_norm_epsilon", 1e-5))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    # One merge (llama.cpp requires the key): the last byte token gives way to "!" + '"'.
    tokens = byte_tokens(padded - 1) + ['!"']
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * padded)
    w.add_token_merges(['! "'])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        rest = name.removeprefix("backbone.")
        if rest == "embeddings.weight":
            t = np.concatenate([t, np.zeros((padded - vocab, d), np.float32)])
            new = "token_embd.weight"
        elif rest == "norm_f.weight":
            new = "output_norm.weight"
        elif name == "lm_head.weight":
            t = np.concatenate([t, np.zeros((padded - vocab, d), np.float32)])
            new = "output.weight"
        else:
            _, i, part = rest.split(".", 2)
            new = f"blk.{i}.{MAMBA_NAMES[part]}"
            t = mamba_layout(part, t, groups, d_inner)
        w.add_tensor(new, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def k256_model(seed=7):
    """A random HF-mamba2-shaped model 256 wide (d_inner 512, 8 heads of 64, N 16)."""
    rng = np.random.default_rng(seed)
    d, d_inner, h, n, k, layers, vocab = 256, 512, 8, 16, 4, 2, 256
    conv = d_inner + 2 * n
    cfg = {"hidden_size": d, "expand": 2, "head_dim": 64, "n_groups": 1, "state_size": n,
           "conv_kernel": k, "num_hidden_layers": layers, "layer_norm_epsilon": 1e-5}
    t = {"backbone.embeddings.weight": rng.normal(0, 1, (vocab, d)),
         "backbone.norm_f.weight": rng.uniform(0.5, 1.5, d)}
    for i in range(layers):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = rng.uniform(0.5, 1.5, d)
        t[p + "mixer.in_proj.weight"] = rng.normal(0, d ** -0.5, (2 * d_inner + 2 * n + h, d))
        t[p + "mixer.conv1d.weight"] = rng.normal(0, 0.5, (conv, 1, k))
        t[p + "mixer.conv1d.bias"] = rng.normal(0, 0.3, conv)
        t[p + "mixer.dt_bias"] = rng.uniform(-1.5, 1.0, h)
        t[p + "mixer.A_log"] = np.log(rng.uniform(1, 16, h))
        t[p + "mixer.D"] = rng.normal(1, 0.3, h)
        t[p + "mixer.norm.weight"] = rng.uniform(0.5, 1.5, d_inner)
        t[p + "mixer.out_proj.weight"] = rng.normal(0, d_inner ** -0.5, (d, d_inner))
    return cfg, {k: v.astype(np.float32) for k, v in t.items()}


def fnv64(data: bytes) -> str:
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def dequant_record(path):
    r = gguf.GGUFReader(str(path))
    rec = {}
    for t in r.tensors:
        v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        rec[t.name] = {"type": t.tensor_type.name, "n": int(v.size),
                       "fnv64": fnv64(v.tobytes()), "first": [float(x) for x in v[:8]]}
    return rec


def write_rows(out):
    """The quantizers' oracle input: the first rows of two k256 matrices as F32 safetensors."""
    _, t = k256_model()
    rows = {"blk.0.ssm_in.weight": t["backbone.layers.0.mixer.in_proj.weight"][:32],
            "blk.0.ssm_out.weight": t["backbone.layers.0.mixer.out_proj.weight"][:16]}
    header, blobs, off = {}, [], 0
    for name, v in rows.items():
        b = np.ascontiguousarray(v, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    Path(out).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    if "--rows-only" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        write_rows(out / "k256.rows.safetensors")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, type=Path)
    ap.add_argument("--logits", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    src = root / "tests/fixtures/hf_mamba2_g1"
    oracle = {"gguf_py": gguf.__version__ if hasattr(gguf, "__version__") else "0.19", "files": {}}

    g1_prompt = [int(x) for x in np.frombuffer(read_oracle_ids(src / "oracle.safetensors"), dtype=np.int64)]
    write_gguf(a.out / "g1.f32.gguf", json.loads((src / "config.json").read_text()),
               read_safetensors(src / "model.safetensors"))
    files = [("g1.f32.gguf", g1_prompt)]

    write_rows(a.out / "k256.rows.safetensors")
    cfg, tensors = k256_model()
    f32 = Path("/tmp") / "k256.f32.gguf"
    write_gguf(f32, cfg, tensors)
    for ty in ["Q8_0", "Q4_0", "Q4_K_S", "Q5_K_S", "Q6_K"]:
        name = f"k256.{ty.lower().removesuffix('_s')}.gguf"
        subprocess.run([str(a.llama_cpp / "bin/llama-quantize"), str(f32), str(a.out / name), ty],
                       check=True, capture_output=True)
        files.append((name, PROMPT_K256))
    for name, prompt in files:
        logits = a.out / f"{name}.logits"
        subprocess.run([str(a.logits), str(a.out / name), str(logits)] + [str(i) for i in prompt],
                       check=True, capture_output=True)
        oracle["files"][name] = {"prompt": prompt, "dequant": dequant_record(a.out / name)}
        print(name, {t["type"] for t in oracle["files"][name]["dequant"].values()}, file=sys.stderr)
    (a.out / "oracle.json").write_text(json.dumps(oracle, indent=1))


def read_oracle_ids(path):
    b = Path(path).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    info = json.loads(b[8:8 + n])["prompt_ids"]
    s, e = info["data_offsets"]
    return b[8 + n + s:8 + n + e]


if __name__ == "__main__":
    main()
