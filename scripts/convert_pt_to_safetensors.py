#!/usr/bin/env python3
"""Converts a PyTorch checkpoint (pytorch_model.bin, as state-spaces/mamba2-* ship) to
model.safetensors next to it, so mamba2-wgpu can memory-map it.

    python3 scripts/convert_pt_to_safetensors.py path/to/mamba2-130m

Tied heads (lm_head.weight sharing the embedding's storage) are dropped: the engine ties
them again from config.json (`tie_embeddings`). Needs torch and safetensors.
"""
import os
import sys

import torch
from safetensors.torch import save_file


def main(directory: str) -> None:
    src = os.path.join(directory, "pytorch_model.bin")
    dst = os.path.join(directory, "model.safetensors")
    state = torch.load(src, map_location="cpu", weights_only=True)
    emb = next((v for k, v in state.items() if k.endswith("embedding.weight") or k.endswith("embeddings.weight")), None)
    out = {}
    for name, tensor in state.items():
        if name.endswith("lm_head.weight") and emb is not None and tensor.data_ptr() == emb.data_ptr():
            continue
        out[name] = tensor.contiguous()
    save_file(out, dst)
    print(f"wrote {dst}: {len(out)} tensors")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
