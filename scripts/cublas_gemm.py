"""The cuBLAS anchor for `mamba2 bench --prefill`'s GEMM shapes: Y = X · Wᵀ through
torch.nn.functional.linear (tensor cores), X [T, K], W [M, K], timed with CUDA events.

    python3 scripts/cublas_gemm.py [--tokens 4096] [--dtype bf16|f16]

Prints one line per shape: median ms of 20 runs and TFLOP/s (2·T·M·K / time).
"""

import argparse

import torch

# (model, GEMM, rows M, columns K) at the presets' real shapes.
SHAPES = [
    ("codestral-7b", "in_proj", 18560, 4096),
    ("codestral-7b", "out_proj", 4096, 8192),
    ("mamba2-2.7b", "in_proj", 10576, 2560),
    ("mamba2-2.7b", "out_proj", 2560, 5120),
    ("mamba2-130m", "in_proj", 3352, 768),
    ("mamba2-130m", "out_proj", 768, 1536),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    dev = torch.device("cuda")
    print(f"cuBLAS ({torch.cuda.get_device_name(dev)}, torch {torch.__version__}), "
          f"{a.dtype}, T = {a.tokens}")
    for model, name, m, k in SHAPES:
        x = torch.randn(a.tokens, k, device=dev, dtype=dt)
        w = torch.randn(m, k, device=dev, dtype=dt)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        times = []
        for _ in range(a.runs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.nn.functional.linear(x, w)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        ms = times[len(times) // 2]
        tflops = 2 * a.tokens * m * k / (ms * 1e-3) / 1e12
        print(f"{model} {name} {m}x{k}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
