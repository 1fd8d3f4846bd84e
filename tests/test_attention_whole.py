"""The attention Function's compiled whole-call path (``_C.attention_whole_forward`` /
``attention_whole_backward``, cpp_ext/attention_dropout_cpu.cpp): where one tile holds the
call, the same ops as the tile loop in the same order, so outputs and gradients are the
loop's bit for bit (with and without dropout, causal or not); other calls keep the loop."""
from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import actnn_zoo.functional.attention as attn
from actnn_zoo.config import LayerQConfig

pytestmark = pytest.mark.skipif(attn._WHOLE_FORWARD is None, reason="no compiled extension")


class _Spy:
    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.calls = {"_WHOLE_FORWARD": 0, "_WHOLE_BACKWARD": 0}
        for name in self.calls:
            real = getattr(attn, name)

            def counted(*args, _real=real, _name=name):
                self.calls[_name] += 1
                return _real(*args)
            mp.setattr(attn, name, counted)


def _run(q, k, v, grads, mask=None, **kw) -> list:
    """Output and input gradients of the Function at a fixed seed."""
    q, k, v = (t.detach().clone().requires_grad_(g) for t, g in zip((q, k, v), grads))
    torch.manual_seed(5)
    out = attn.scaled_dot_product_attention(q, k, v, mask, qconfig=LayerQConfig(bits=4), **kw)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
    return [out.detach()] + [t.grad for t in (q, k, v)]


def _both(q, k, v, grads, mask=None, **kw) -> dict:
    # the Function's paths (the compiled node, which runs the same two calls, is
    # tests/test_qlayer_nodes.py's)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "_QATTENTION", None)
        spy = _Spy(mp)
        got = _run(q, k, v, grads, mask, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "_QATTENTION", None)
        mp.setattr(attn, "_WHOLE_FORWARD", None)
        want = _run(q, k, v, grads, mask, **kw)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and torch.equal(a, b)
    return spy.calls


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), L=st.integers(1, 12), S=st.integers(1, 12),
       e=st.integers(1, 9), ev=st.integers(1, 9), causal=st.booleans(),
       dropout=st.sampled_from([0.0, 0.3]), transposed=st.booleans(),
       grads=st.sampled_from([(True, True, True), (True, False, False), (False, True, False),
                              (False, False, True)]))
def test_whole_call_equals_the_tile_loop(b, h, L, S, e, ev, causal, dropout, transposed, grads):
    assume(not causal or S <= L)  # a causal call holds every key in its one tile
    g = torch.Generator().manual_seed(1)
    if transposed:  # (B, L, H, E) transposed, as transformers pass q
        q = torch.randn(b, L, h, e, generator=g).transpose(1, 2)
    else:
        q = torch.randn(b, h, L, e, generator=g)
    k, v = torch.randn(b, h, S, e, generator=g), torch.randn(b, h, S, ev, generator=g)
    calls = _both(q, k, v, grads, dropout_p=dropout, is_causal=causal)
    assert calls == {"_WHOLE_FORWARD": 1, "_WHOLE_BACKWARD": 1}


@pytest.mark.parametrize("case", ["mask", "float64", "broadcast", "tiles", "causal S > L"])
def test_other_calls_keep_the_tile_loop(case, monkeypatch):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    mask, kw = None, {}
    if case == "mask":
        mask = torch.randn(6, 6, generator=g)
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "broadcast":
        k, v = k[:1], v[:1]  # one batch of keys for both queries' batches
    elif case == "tiles":
        monkeypatch.setattr(attn, "BLOCK_ELEMENTS", 12)  # two rows of 6 keys a tile
    else:
        q, kw = q[:, :, :3], {"is_causal": True}
    calls = _both(q, k, v, (True, True, True), mask, **kw)
    assert calls == {"_WHOLE_FORWARD": 0, "_WHOLE_BACKWARD": 0}


def test_whole_call_arguments_are_checked():
    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="float32"):
        attn._WHOLE_FORWARD(q.double(), q, q, 0.5, False, -1, 0, 0, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        attn._WHOLE_FORWARD(q, q[:1], q[:1], 0.5, False, -1, 0, 0, 1.0)
    with pytest.raises(ValueError, match="need v"):
        attn._WHOLE_BACKWARD(q, q, q, None, 0.5, False, -1, 0, 0, 1.0, True, False, False)
