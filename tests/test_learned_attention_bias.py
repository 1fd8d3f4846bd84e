"""Learned additive attention masks through capture (tier 2 routes F.scaled_dot_product_attention
to actnn_zoo.functional.attention): Hugging Face T5 (its relative position bias is the mask)
and a small model with a learned ALiBi-style bias (a slope per head times a distance matrix).

Each converted model is compared with the same unconverted model: the forward equal, the
gradients of every parameter (the bias's included) close to exact fp32 autograd at 8 bits,
training at the default config on a fixed batch, and what the learned mask costs in saved
bytes (nothing in attention). 8-bit thresholds: each q/k-side gradient reads three
independently rounded 8-bit tensors (q, k, v; ~0.7% noise each with round-to-nearest, ~1%
stochastic), so a whole model's per-parameter cosine is ~0.9999 with round-to-nearest and
~0.9997-0.9999 stochastic (the numbers measured are in each test).
"""
from __future__ import annotations

import copy
import math
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az
from actnn_zoo.memory import saved_activation_bytes

def cos(a: Tensor, b: Tensor) -> float:
    return F.cosine_similarity(a.detach().double().flatten(), b.detach().double().flatten(),
                               dim=0).item()


def param_grads(model: nn.Module, loss_fn) -> Tuple[float, Dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def train(model: nn.Module, loss_fn, steps: int, lr: float = 1e-2) -> List[float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_8bit_close(ref: nn.Module, loss_fn, bias_name: str, nearest: float,
                      stochastic: float, bias_bound: float = 0.0) -> None:
    """Forward equal, every parameter's gradient (``bias_name``'s included) with cosine >=
    ``nearest`` / ``stochastic`` against the plain model's at 8 bits, the bias's >=
    ``bias_bound`` with either rounding."""
    loss_r, g_r = param_grads(ref, loss_fn)
    assert any(bias_name in n for n in g_r)
    for rounding, bound in (("nearest", nearest), ("stochastic", stochastic)):
        torch.manual_seed(0)
        q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform", rounding=rounding)
        loss_q, g_q = param_grads(q, loss_fn)
        assert az.capture_report(q).routed.get("scaled_dot_product_attention", 0) > 0
        assert math.isclose(loss_q, loss_r, rel_tol=1e-5)  # the forward is exact
        assert g_q.keys() == g_r.keys()
        worst = min((cos(g_q[n], g_r[n]), n) for n in g_r)
        assert worst[0] >= bound, (rounding, worst)
        for n in g_r:
            if bias_name in n:
                assert cos(g_q[n], g_r[n]) >= bias_bound, (rounding, n, cos(g_q[n], g_r[n]))


# ----------------------------------------------------------------------------- ALiBi-style
class AlibiLM(nn.Module):
    """A one-block causal LM whose attention bias is learned: ``slope[h] * -(i - j)`` for key
    j <= query i, -inf above the diagonal, passed to SDPA as a float (H, T, T) attn_mask (the
    batch dim broadcast: its gradient sums over B)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, T: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)
        self.slope = nn.Parameter(2.0 ** -torch.arange(1.0, heads + 1))  # ALiBi's start
        i = torch.arange(T)
        dist = -(i[:, None] - i[None, :]).float()
        self.register_buffer("dist", dist.masked_fill(dist > 0, 0.0))
        self.register_buffer("future", torch.zeros(T, T).masked_fill(dist > 0, float("-inf")))

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        x = self.emb(ids)
        bias = self.slope[:, None, None] * self.dist[:t, :t] + self.future[:t, :t]
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln3(x))


def _alibi_batch() -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)


def _alibi_loss(ids: Tensor, y: Tensor):
    return lambda m: F.cross_entropy(m(ids).flatten(0, 1), y.flatten())


def test_alibi_learned_bias_matches_at_8_bits():
    """Measured over three rounding seeds: worst parameter cosine 0.99997 (round-to-nearest)
    and 0.99988-0.99994 (stochastic, a LayerNorm weight); the slopes' gradient 0.999996
    (nearest) and 0.99995-0.99999 (stochastic)."""
    torch.manual_seed(0)
    ref = AlibiLM().train()
    assert_8bit_close(ref, _alibi_loss(*_alibi_batch()), "slope", 0.9999, 0.9997,
                      bias_bound=0.9999)


def test_only_the_bias_learned_is_still_routed():
    """Everything frozen but the slopes: q, k, v need no gradient, the mask does; capture still
    routes attention (compressed q, k, v instead of torch's saved probabilities) and the slopes'
    gradient matches."""
    torch.manual_seed(0)
    ref = AlibiLM().train()
    for n, p in ref.named_parameters():
        p.requires_grad_(n == "slope")
    loss_fn = _alibi_loss(*_alibi_batch())
    _, g_r = param_grads(ref, loss_fn)
    q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform", rounding="nearest")
    _, g_q = param_grads(q, loss_fn)
    assert az.capture_report(q).routed.get("scaled_dot_product_attention") == 1
    assert list(g_q) == ["slope"] and cos(g_q["slope"], g_r["slope"]) >= 0.9999

def test_alibi_trains_at_the_default_and_the_bias_costs_no_saved_bytes():
    torch.manual_seed(0)
    ref = AlibiLM().train()
    ids, y = _alibi_batch()
    q = az.convert_model(copy.deepcopy(ref))
    losses = train(q, _alibi_loss(ids, y), 8)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0] and losses[-1] < min(losses[:-1]), losses
    assert not torch.equal(q.slope.detach(), ref.slope.detach())  # the slopes learned
    # Saved bytes with learned slopes == with frozen ones: attention keeps compressed q, k, v
    # either way, and the bias's own op saves only the distance buffer (excluded as model
    # state). Measured on a uniform 2-bit conversion: the default strategy re-allocates the
    # Q-layers' bits between forwards, which would move bytes unrelated to attention.
    u = az.convert_model(copy.deepcopy(ref), bits=2, strategy="uniform")
    sizes = {}
    for learned in (True, False):
        u.slope.requires_grad_(learned)
        sizes[learned] = saved_activation_bytes(u, ids, warmup=1).total_bytes
    assert sizes[True] == sizes[False], sizes


# ----------------------------------------------------------------------------- T5
def _t5():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                     dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T.T5ForConditionalGeneration(cfg).train()  # random init, nothing downloaded
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (8, 24), generator=g)
    labels = torch.randint(1, 100, (8, 20), generator=g)
    return model, ids, labels


def _t5_loss(ids: Tensor, labels: Tensor):
    return lambda m: m(input_ids=ids, labels=labels).loss


def test_t5_gradients_match_at_8_bits():
    """T5's relative position bias (one Embedding per stack, shared by its layers) reaches
    attention as a learned (B, H, T, S) mask. Measured over three rounding seeds (batch 8,
    24 / 20 tokens): worst parameter cosine 0.99985 with round-to-nearest (the encoder's
    relative_attention_bias weight; the decoder's 0.99994) and 0.99977-0.9998 stochastic (a
    k weight, a LayerNorm weight; the encoder's bias 0.99983-0.99991). Not 0.9999: each of
    those gradients reads q, k and v rounded independently, and the bias's gradient sums dS
    over each bucket, where the exact terms largely cancel (dS sums to zero over a row) and
    the rounding noise does not. Thresholds 0.9998 / 0.9995."""
    model, ids, labels = _t5()
    assert model.config._attn_implementation == "sdpa"
    assert_8bit_close(model, _t5_loss(ids, labels), "relative_attention_bias", 0.9998, 0.9995)


def test_t5_trains_at_the_default_and_attention_saves_nothing_for_the_bias():
    model, ids, labels = _t5()
    q = az.convert_model(copy.deepcopy(model))
    losses = train(q, _t5_loss(ids, labels), 6)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0] and losses[-1] < min(losses[:-1]), losses
    assert az.capture_report(q).routed["scaled_dot_product_attention"] == 6
    rel = [m.relative_attention_bias.weight for m in q.modules()
           if getattr(m, "has_relative_attention_bias", False)]
    assert len(rel) == 2 and all(w.grad is not None and w.grad.abs().sum() > 0 for w in rel)
    # A learned bias against a frozen one: every floating or compressed (uint8 / bf16) byte
    # saved is the same; what differs is T5's own building of the bias, the int64 bucket
    # indices its Embedding saves (T x T per stack) and bool conditions of its causal mask.
    # (a uniform 2-bit conversion: the default strategy re-allocates bits between forwards)
    u = az.convert_model(copy.deepcopy(model), bits=2, strategy="uniform")
    rel = [m.relative_attention_bias.weight for m in u.modules()
           if getattr(m, "has_relative_attention_bias", False)]
    reports = {}
    for learned in (True, False):
        for w in rel:
            w.requires_grad_(learned)
        reports[learned] = saved_activation_bytes(u, input_ids=ids, labels=labels,
                                                  loss_fn=lambda o: o.loss, warmup=1)
    a, b = reports[True].dtype_bytes, reports[False].dtype_bytes
    assert {k: v for k, v in a.items() if k not in ("int64", "bool")} == {
        k: v for k, v in b.items() if k not in ("int64", "bool")}, (a, b)
    assert a["int64"] - b.get("int64", 0) == 8 * (ids.shape[1] ** 2 + labels.shape[1] ** 2)
