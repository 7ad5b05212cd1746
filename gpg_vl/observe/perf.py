"""Model FLOPs utilisation (MFU) of the update: the arithmetic of scripts/gpu_check.py, kept pure so it is
tested on CPU.

Training FLOPs per token (forward + backward) follow the usual accounting (Kaplan et al.; PaLM, appendix B):
6 x the weights every token multiplies (every linear layer of the language model, its output layer
included; embeddings are lookups), plus 12 x layers x attention width x context for the score and value
products of each full-attention layer (linear-attention layers, such as Gated DeltaNet layers, have
none that grows with the context). The vision tower's work is left out, so the MFU is a lower bound.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks, in TFLOPS (the vendors' datasheets, without sparsity), by device name.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "B100": 1750.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "A10G": 70.0, "L4": 121.0,
                    "RTX 4090": 165.0}


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device, by the first table name in `device_name` (None if unknown)."""
    for name in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):  # "GH200" before "H200"
        if name.lower() in device_name.lower():
            return BF16_PEAK_TFLOPS[name] * 1e12
    return None


def linear_weights(module: torch.nn.Module, *, skip: tuple[str, ...] = ()) -> int:
    """Weights of every `nn.Linear` under `module` (modules whose name contains a `skip` part left out):
    the multiply-accumulates one token costs in them."""
    return sum(m.weight.numel() for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and not any(part in name for part in skip))


def attention_shape(text_config) -> tuple[int, int]:
    """(full-attention layers, attention width = heads x head dim) of a text config."""
    layers = text_config.num_hidden_layers
    kinds = getattr(text_config, "layer_types", None)
    if kinds:
        layers = sum(kind == "full_attention" for kind in kinds)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return layers, text_config.num_attention_heads * head_dim


def train_flops_per_token(matmul_weights: int, attention_layers: int, attention_width: int, context: int) -> float:
    """Forward + backward FLOPs of one token: 6 N + 12 layers x width x context."""
    return 6.0 * matmul_weights + 12.0 * attention_layers * attention_width * context


def mfu(flops_per_token: float, tokens: int, seconds: float, peak_flops: float) -> float:
    """The fraction of the device's peak that `tokens` tokens at `flops_per_token` in `seconds` reach."""
    return flops_per_token * tokens / seconds / peak_flops
