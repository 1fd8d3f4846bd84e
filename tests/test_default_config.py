"""The model-aware default (issue 31): attention models get a larger budget spent first on the
head's input and attention's operands, every other model the plain 2-bit average, a budget the
user sets is used as given, and the realised average over everything compressed (Q-layers and
capture tiers) stays within the budget."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo as az
from actnn_zoo.config import (TRANSFORMER_BITS, QuantConfig, Rule, default_config,
                              has_attention)
from actnn_zoo.convert import precision_strategy
from actnn_zoo.models import CharTransformer, DigitsResNet

from _spy import CompressionSpy  # tests/_spy.py


def small_transformer() -> CharTransformer:
    torch.manual_seed(0)
    return CharTransformer(vocab_size=40, d_model=32, n_heads=2, n_layers=2, context=16)


class MHA(nn.Module):
    """torch's MultiheadAttention and a classifier: attention without an nn.Softmax module."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.norm = nn.LayerNorm(32)
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.attn(x, x, x, need_weights=False)[0]))


def test_models_without_attention_keep_the_plain_default():
    cnn = DigitsResNet()
    assert not has_attention(cnn)
    assert default_config(cnn) == QuantConfig() == default_config(None)
    assert QuantConfig().bits == 2 and QuantConfig().strategy == "actnn"
    model = az.convert_model(DigitsResNet())
    assert model.actnn_zoo_report.config == QuantConfig()
    strategy = precision_strategy(model)
    assert strategy.budget == 2.0
    # counting tier 3 changes nothing here: its width is the budget's, so after the
    # re-allocations the layers without a sensitivity model keep exactly 2 bits (the ladder)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(16, 1, 8, 8)), torch.randint(0, 10, (16,))).backward()
        opt.step()
    assert strategy.updates >= 1 and az.capture_report(model) is not None
    assert all(w.budget == 2.0 for w in strategy.watched if not w.kind.modelled)


def test_attention_models_get_the_transformer_default():
    model = small_transformer()
    assert has_attention(model) and has_attention(MHA())
    cfg = default_config(model)
    assert cfg.bits == TRANSFORMER_BITS == 3.375 and cfg.strategy == "actnn"
    assert cfg.capture_bits == 4
    attention = tuple(f"blocks.{i}.attn.{n}" for i in (0, 1) for n in ("qkv", "proj"))
    norms = tuple(f"blocks.{i}.{n}" for i in (0, 1) for n in ("ln1", "ln2")) + ("ln_f",)
    assert cfg.rules == (Rule(type=("Softmax",), bits=4), Rule(name=attention, bits=4),
                         Rule(name=norms, bits=4), Rule(name=("head",), bits=4))
    # no Softmax module: no softmax rule (a rule that matched nothing would warn); the
    # MultiheadAttention's out_proj is a Linear inside attention
    assert default_config(MHA()).rules == (Rule(name=("attn.out_proj",), bits=4),
                                           Rule(name=("norm",), bits=4),
                                           Rule(name=("fc",), bits=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unmatched-rule warning from the default
        converted = az.convert_model(model)
    assert converted.actnn_zoo_report.config == cfg
    assert converted.head.qconfig.bits == converted.ln_f.qconfig.bits == 4
    assert converted.blocks[0].attn.softmax.qconfig.bits == 4
    attn = converted.blocks[1].attn
    assert attn.qkv.qconfig.bits == attn.proj.qconfig.bits == 4
    assert converted.blocks[1].mlp[0].qconfig.bits == 2  # free: the strategy's (<= budget)
    assert precision_strategy(converted).budget == TRANSFORMER_BITS
    # a converted model (Q-layers) is still recognised: re-conversion gives the same config
    assert has_attention(converted) and default_config(converted) == cfg
    assert az.convert_model(converted).actnn_zoo_report.config == cfg


@pytest.mark.parametrize("overrides", [{"bits": 2}, {"strategy": "uniform"},
                                       {"capture_bits": 2}, {"rules": []}])
def test_a_user_choice_replaces_the_model_aware_default(overrides):
    model = small_transformer()
    cfg = az.convert_model(model, **overrides).actnn_zoo_report.config
    assert cfg == QuantConfig(**overrides)
    # an explicit config is used as given, too
    assert az.convert_model(small_transformer(), {}).actnn_zoo_report.config == QuantConfig()


def test_other_overrides_keep_the_model_aware_default():
    cfg = az.convert_model(small_transformer(), group_size=128).actnn_zoo_report.config
    assert cfg == default_config(small_transformer()).replace(group_size=128)


def test_realised_average_with_capture_tiers_stays_within_the_budget(monkeypatch):
    """Every value compressed in a step after the first re-allocation -- the Q-layers' (through
    the spy) and tier 3's (``capture_report``: fp32 bytes / 4, at the tiers' 4 bits, and the
    dropout outputs it derives at 0 bits) -- averages within the budget. The tiers compress a
    sixth or more of the values at 4 bits and the attention matmuls' probability operands are
    derived from the softmax's payload (``test_dropout_derived.py``), so the Q-layers get what
    the budget leaves them. The exception, stated in the README: tier 2's routed calls (here
    the loss's logits, which the capture tail compresses at ``capture_bits``) are not counted
    yet; they are measured here apart."""
    model = az.convert_model(small_transformer())
    spy = CompressionSpy(monkeypatch, sparse=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        tokens = torch.randint(0, 40, (16, 17), generator=g)
        opt.zero_grad()
        out = model(tokens[:, :-1])
        loss = F.cross_entropy(out.reshape(-1, 40), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        calls = spy.take()
        logits = [c for c in calls if c[0] == out.numel()]
        assert len(logits) == 1 and logits[0][1] == 4 * out.numel()  # routed, at 4 bits
        q_values = sum(c[0] for c in calls) - out.numel()
        q_bits = sum(c[1] for c in calls) - 4 * out.numel()
        report = az.capture_report(model)
        tier_values = report.compressed_bytes / 4
        derived_values = report.derived_bytes / 4  # saved at no cost of their own: 0 bits
        average = (q_bits + 4 * tier_values) / (q_values + tier_values + derived_values)
        if step >= 2:  # re-allocated at step 2, applied from step 3
            assert tier_values > 0.15 * (q_values + tier_values)
            assert derived_values > 0
            assert 0.9 * TRANSFORMER_BITS <= average <= TRANSFORMER_BITS + 1e-9, average


def test_the_measured_config_is_the_default_on_the_text_transformer():
    """scripts/default_fidelity.py's 1000-step runs of 't3.375_ln4_head4' (types, patterns)
    measure the default: on the demo's transformer it pins the same layers at the same
    widths, with the same budget and tier width; every candidate there is a valid config."""
    import sys
    from pathlib import Path

    from actnn_zoo.config import as_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import default_fidelity

    for name, cfg in default_fidelity.CANDIDATES.items():
        if isinstance(cfg, dict):
            as_config(cfg)
    model = CharTransformer()  # the demo's sizes but the vocabulary
    measured = as_config(default_fidelity.CANDIDATES["t3.375_ln4_head4"])
    default = default_config(model)
    assert (measured.bits, measured.capture_bits, measured.strategy) == (
        default.bits, default.capture_bits, default.strategy)
    for name, module in model.named_modules():
        assert measured.pinned_bits(name, module) == default.pinned_bits(name, module), name
