"""Seeds of stochastic rounding: one generator read per captured forward, then a counter.

Reading torch's generator per compressed tensor cost a tensor op and a read each (~2-3 us of
host time); inside a capture session the seeds come from a stream keyed by one read, and a read
is the extension's (``_C.draw_seed``): torch.randint's value and generator step, without the
tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import actnn_zoo as az
import actnn_zoo.quant.seeds as seeds_mod
from actnn_zoo.quant import dequantize, quantize
from actnn_zoo.quant.hash32 import fmix32_int
from actnn_zoo.quant.seeds import draw_seed, seed_stream


class _CountDraws(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("randint", "random_", "rand", "randn"):
            self.draws += 1
        return func(*args, **(kwargs or {}))


def _state_after_one_read(seed: int) -> torch.Tensor:
    """torch's CPU generator state after ``manual_seed(seed)`` and one torch.randint read."""
    torch.manual_seed(seed)
    torch.randint(0, 2 ** 31 - 1, (1,))
    return torch.get_rng_state()


def test_a_read_is_torch_randints_value_and_step():
    """``_C.draw_seed`` returns what ``int(torch.randint(0, 2**31 - 1, (1,)).item())`` would
    and advances the generator as it would (so seeds and every later draw are as before), over
    many seeds and several reads in a row; the torch fallback gives the same."""
    assert seeds_mod._DRAW is not None
    for seed in range(0, 3000, 7):
        torch.manual_seed(seed)
        ours = [seeds_mod._read_generator() for _ in range(3)]
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        torchs = [int(torch.randint(0, 2 ** 31 - 1, (1,)).item()) for _ in range(3)]
        assert ours == torchs and torch.equal(state, torch.get_rng_state()), seed
    torch.manual_seed(11)
    ours = draw_seed()  # outside a stream: one read
    saved, seeds_mod._DRAW = seeds_mod._DRAW, None
    try:
        torch.manual_seed(11)
        assert draw_seed() == ours
    finally:
        seeds_mod._DRAW = saved


def test_stream_seeds_are_distinct_reproducible_and_one_read():
    torch.manual_seed(3)
    spy = _CountDraws()
    with spy, seed_stream():
        seeds = [draw_seed() for _ in range(5000)]
    assert spy.draws == 0  # read by the extension, not a tensor op
    assert torch.equal(torch.get_rng_state(), _state_after_one_read(3))  # one read
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2 ** 31 for s in seeds)
    torch.manual_seed(3)
    with seed_stream():
        assert [draw_seed() for _ in range(5000)] == seeds
    with seed_stream():  # a new stream: new seeds
        assert draw_seed() not in seeds[:1]
    assert isinstance(draw_seed(), int)  # outside a stream: the generator


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2 ** 31 - 2), st.integers(1, 2 ** 40))
def test_the_compiled_stream_mix_is_the_python_one(key, k):
    """``_C.stream_seed`` (SeedStream.next's mix in one call) equals the Python form the
    stream falls back to, on the low 32 bits of the counter too."""
    assert seeds_mod._MIX is not None
    assert seeds_mod._MIX(key, k) == fmix32_int(key ^ fmix32_int(k)) & 0x7FFFFFFF


def test_stream_rounding_stays_unbiased():
    """Codes quantized with consecutive stream seeds average to the input (the seeds decorrelate
    the rounding as independent draws do): mean of 400 2-bit copies within 5 standard errors."""
    torch.manual_seed(0)
    x = torch.randn(4, 512)
    with seed_stream():
        mean = torch.stack([dequantize(quantize(x, 2)) for _ in range(400)]).mean(0)
    q = quantize(x, 2)
    step = q.step.float().repeat_interleave(256, dim=1)  # per value, group size 256
    se = (step / 2) / 20  # rounding error <= step, std <= step / 2; 400 draws
    assert ((mean - x).abs() <= 5 * se + 1e-6).float().mean() > 0.999


def test_captured_forward_reads_the_generator_once():
    torch.manual_seed(0)
    model = az.convert_model(nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128),
                                           nn.GELU(), nn.Linear(128, 10)).train(),
                             bits=2, strategy="uniform")
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    F.cross_entropy(model(x), y).backward()  # warm-up (first-forward probes)
    spy = _CountDraws()
    torch.manual_seed(5)
    with spy:
        out = model(x)
    stats = az.capture_report(model)
    assert spy.draws == 0, spy.draws  # no tensor op draws
    assert torch.equal(torch.get_rng_state(), _state_after_one_read(5))  # one generator read
    F.cross_entropy(out, y).backward()
    assert stats is not None  # the forward was captured
