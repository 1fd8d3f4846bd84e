"""Small reference architectures for the demo, the benchmarks and the tests.

They are chosen to exercise every layer family the converter handles (conv, conv transpose,
batch/layer norm, ReLU/GELU, pooling, upsampling, dropout, softmax, linear, residual adds,
concatenation) at sizes that train in seconds on two CPU cores. Each model can checkpoint its
stages with ``torch.utils.checkpoint`` (``set_checkpointing``), the baseline we compare against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "BasicBlock", "DigitsResNet", "UNet", "Conv1dNet", "MatMul", "SelfAttention",
    "TransformerBlock", "CharTransformer", "GPT2LM", "Workload", "WORKLOADS", "build_model",
    "example_batch", "set_checkpointing", "workload",
]


class CheckpointedStages(nn.Module):
    """Base for models whose forward runs a list of stages, optionally checkpointed.

    ``checkpoint_stages`` is a per-model flag (not global): when set, each stage in training
    with grad enabled runs under non-reentrant ``torch.utils.checkpoint`` and only its input is
    kept for backward.
    """

    checkpoint_stages: bool = False

    def run_stage(self, stage: nn.Module, *args: Tensor) -> Tensor:
        if self.checkpoint_stages and self.training and torch.is_grad_enabled():
            return checkpoint(stage, *args, use_reentrant=False)
        return stage(*args)


# --------------------------------------------------------------------------------- CNNs ----
class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 conv-BN, residual add, ReLU) with a 1x1 projection shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels))
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class DigitsResNet(CheckpointedStages):
    """ResNet-style classifier for 8x8 images: stem, residual stages, max-pool, avg-pool, fc.

    The first conv is named ``conv1`` and the classifier ``fc`` so that configs can keep them
    at higher precision by name. With checkpointing each residual block is one segment (the
    finest natural unit, hence the strongest memory baseline).
    """

    def __init__(self, width: int = 32, blocks: Tuple[int, ...] = (2, 2), num_classes: int = 10,
                 in_channels: int = 1, dropout: float = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        stages = []
        channels = width
        for i, count in enumerate(blocks):
            out = width * 2 ** i
            layers = [BasicBlock(channels, out)] + [BasicBlock(out, out) for _ in range(count - 1)]
            stages.append(nn.Sequential(*layers))
            channels = out
        self.stages = nn.ModuleList(stages)
        # One 2x2 max-pool between the first and second stage (8x8 -> 4x4).
        self.pool = nn.MaxPool2d(2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for i, stage in enumerate(self.stages):
            if i == 1:
                x = self.pool(x)
            for block in stage:  # checkpointing unit: each residual block
                x = self.run_stage(block, x)
        return self.fc(self.dropout(self.flatten(self.avgpool(x))))


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels), nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels), nn.ReLU())


class UNet(CheckpointedStages):
    """Two-level U-Net: max-pool down, one ConvTranspose2d up and one Upsample+1x1 conv up,
    skip connections by concatenation. Input sides must be divisible by 4."""

    def __init__(self, in_channels: int = 1, out_channels: int = 1, base: int = 16) -> None:
        super().__init__()
        b = base
        self.enc1 = _double_conv(in_channels, b)
        self.pool1 = nn.MaxPool2d(2)
        self.enc2 = _double_conv(b, 2 * b)
        self.pool2 = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(2 * b, 4 * b)
        self.up2 = nn.ConvTranspose2d(4 * b, 2 * b, 2, stride=2)
        self.dec2 = _double_conv(4 * b, 2 * b)
        self.up1 = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                 nn.Conv2d(2 * b, b, 1))
        self.dec1 = _double_conv(2 * b, b)
        self.head = nn.Conv2d(b, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.run_stage(self.enc1, x)
        e2 = self.run_stage(self.enc2, self.pool1(e1))
        mid = self.run_stage(self.bottleneck, self.pool2(e2))
        d2 = self.run_stage(self.dec2, torch.cat([self.up2(mid), e2], dim=1))
        d1 = self.run_stage(self.dec1, torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


class Conv1dNet(CheckpointedStages):
    """1-D conv classifier (conv-BN-ReLU-maxpool stages, global average pool, linear)."""

    def __init__(self, in_channels: int = 1, width: int = 32, num_classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()

        def stage(cin: int, cout: int, pool: bool) -> nn.Sequential:
            layers = [nn.Conv1d(cin, cout, 5, padding=2, bias=False), nn.BatchNorm1d(cout),
                      nn.ReLU()]
            return nn.Sequential(*(layers + [nn.MaxPool1d(2)] if pool else layers))

        self.stages = nn.ModuleList([stage(in_channels, width, True),
                                     stage(width, 2 * width, True),
                                     stage(2 * width, 2 * width, False)])
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.flatten = nn.Flatten()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        for stage in self.stages:
            x = self.run_stage(stage, x)
        return self.fc(self.dropout(self.flatten(self.avgpool(x))))


# -------------------------------------------------------------------------- transformer ----
class MatMul(nn.Module):
    """``torch.matmul`` as a module, so that a converter can swap in a version that saves its
    operands compressed (attention's q/k and probabilities/v are a large share of what a
    transformer saves, and a plain function call is invisible to a module converter)."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.matmul(a, b)


class SelfAttention(nn.Module):
    """Multi-head self-attention from modules: Linear q/k/v, MatMul, Softmax, Dropout, Linear.

    The softmax is an ``nn.Softmax`` module (converted to one that saves its output
    compressed); ``causal=True`` masks future positions with a non-persistent buffer.
    """

    def __init__(self, d_model: int, n_heads: int, context: int, dropout: float = 0.1,
                 causal: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.scores = MatMul()
        self.softmax = nn.Softmax(dim=-1)
        self.attn_drop = nn.Dropout(dropout)
        self.mix = MatMul()
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.ones(context, context, dtype=torch.bool).triu(1)
        self.register_buffer("future", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4).unbind(0)
        q = q * (1.0 / math.sqrt(c // h))  # scaling by a constant saves nothing for backward
        att = self.scores(q, k.transpose(-2, -1))
        if self.causal:
            att = att.masked_fill(self.future[:t, :t], float("-inf"))
        att = self.attn_drop(self.softmax(att))
        y = self.mix(att, v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)) with a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, context: int, d_ff: Optional[int] = None,
                 dropout: float = 0.1, causal: bool = True) -> None:
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, context, dropout, causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(CheckpointedStages):
    """Character-level transformer: token + position embeddings, blocks, LayerNorm, head.

    ``causal=True`` is a decoder (language model); ``causal=False`` an encoder. Input (B, T)
    int64 with T <= context; output logits (B, T, vocab_size).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 2, context: int = 64, d_ff: Optional[int] = None,
                 dropout: float = 0.1, causal: bool = True) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([TransformerBlock(d_model, n_heads, context, d_ff, dropout,
                                                      causal) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = self.run_stage(block, x)
        return self.head(self.ln_f(x))


class GPT2LM(nn.Module):
    """``transformers``' GPT-2 (random init, nothing downloaded) returning plain logits.

    Checkpointing goes through the library's own ``gradient_checkpointing_enable``.
    """

    def __init__(self, vocab_size: int = 256, n_embd: int = 128, n_layer: int = 2,
                 n_head: int = 4, context: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=n_embd,
                         n_layer=n_layer, n_head=n_head, resid_pdrop=dropout,
                         embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                         bos_token_id=0, eos_token_id=0)
        self.context = context
        self.gpt2 = GPT2LMHeadModel(cfg)

    def forward(self, idx: Tensor) -> Tensor:
        return self.gpt2(input_ids=idx).logits


def set_checkpointing(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Turn per-stage activation checkpointing on or off for a model from this file."""
    if isinstance(model, GPT2LM):
        lm = model.gpt2
        # transformers >= 5 renamed gradient_* to activation_checkpointing_*.
        if enabled and hasattr(lm, "activation_checkpointing_enable"):
            lm.activation_checkpointing_enable({"use_reentrant": False})
        elif enabled:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(lm, "activation_checkpointing_disable"):
            lm.activation_checkpointing_disable()
        else:
            lm.gradient_checkpointing_disable()
        return model
    if not isinstance(model, CheckpointedStages):
        raise TypeError(f"{type(model).__name__} has no checkpointed stages")
    model.checkpoint_stages = enabled
    return model


# ---------------------------------------------------------------------------- workloads ----
def _ce(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _mse(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target)


@dataclass(frozen=True)
class Workload:
    """A model family with the synthetic batch and loss used to benchmark it."""

    build: Callable[..., nn.Module]
    batch: Callable[[int, Dict[str, Any], torch.Generator], Tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    description: str


def _image_batch(n: int, kw: Dict[str, Any], g: torch.Generator) -> Tuple[Tensor, Tensor]:
    x = torch.randn(n, kw.get("in_channels", 1), 8, 8, generator=g)
    return x, torch.randint(0, kw.get("num_classes", 10), (n,), generator=g)


def _unet_batch(n: int, kw: Dict[str, Any], g: torch.Generator) -> Tuple[Tensor, Tensor]:
    side = kw.get("side", 32)
    x = torch.randn(n, kw.get("in_channels", 1), side, side, generator=g)
    return x, torch.randn(n, kw.get("out_channels", 1), side, side, generator=g)


def _seq_batch(n: int, kw: Dict[str, Any], g: torch.Generator) -> Tuple[Tensor, Tensor]:
    x = torch.randn(n, kw.get("in_channels", 1), kw.get("length", 64), generator=g)
    return x, torch.randint(0, kw.get("num_classes", 10), (n,), generator=g)


def _token_batch(n: int, kw: Dict[str, Any], g: torch.Generator) -> Tuple[Tensor, Tensor]:
    vocab, t = kw.get("vocab_size", 256), kw.get("context", 64)
    tokens = torch.randint(0, vocab, (n, t + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _drop(kw: Dict[str, Any], *names: str) -> Dict[str, Any]:
    return {k: v for k, v in kw.items() if k not in names}


WORKLOADS: Mapping[str, Workload] = MappingProxyType({
    "resnet": Workload(lambda **kw: DigitsResNet(**kw), _image_batch, _ce,
                       "ResNet-style CNN, 8x8 inputs"),
    "unet": Workload(lambda **kw: UNet(**_drop(kw, "side")), _unet_batch, _mse,
                     "U-Net-style, 32x32 inputs"),
    "conv1d": Workload(lambda **kw: Conv1dNet(**_drop(kw, "length")), _seq_batch, _ce,
                       "1-D conv net, length 64"),
    "transformer": Workload(lambda **kw: CharTransformer(**kw), _token_batch, _ce,
                            "char transformer decoder (causal LM)"),
    "transformer_encoder": Workload(lambda **kw: CharTransformer(**{**kw, "causal": False}),
                                    _token_batch, _ce, "char transformer encoder"),
    "gpt2": Workload(lambda **kw: GPT2LM(**kw), _token_batch, _ce,
                     "transformers GPT-2 (small config, random init)"),
})


def workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(WORKLOADS)}") from None


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a reference model by name (``WORKLOADS``); kwargs go to its constructor."""
    return workload(name).build(**kwargs)


def example_batch(name: str, batch_size: int, model_kwargs: Optional[Dict[str, Any]] = None,
                  seed: int = 0) -> Tuple[Tensor, Tensor]:
    """A deterministic synthetic (inputs, targets) batch shaped for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    return workload(name).batch(batch_size, dict(model_kwargs or {}), g)
