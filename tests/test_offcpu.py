"""The off-CPU (GPU) paths, run on the meta device: shapes, host reads, operator counts.

On ``torch.device("meta")`` a converted model takes every branch a GPU takes and computes
nothing (``actnn_zoo.quant.meta`` stands in for the extension's CUDA entries). That makes two
things checkable without a GPU: a default training step on the GPU path reads nothing back
from the device (a read waits for every queued kernel), and how many operators and kernel
calls a GPU step dispatches (``actnn_zoo.bench.offcpu``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import actnn_zoo as az
from actnn_zoo.bench.offcpu import answering_reads, offcpu_work
from actnn_zoo.functional import attention as attn
from actnn_zoo.quant import meta
from actnn_zoo.quant.backend import kernels

from _ext import compiled_extension

META = torch.device("meta")


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.GELU(), nn.Dropout(0.1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16), nn.LayerNorm(16), nn.SiLU(),
        nn.Linear(16, 5))


def _cnn_step(model: nn.Module, n: int = 4):
    x = torch.randn(n, 3, 8, 8, device=META)
    y = torch.randint(0, 5, (n,), device=META)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = None
    return step


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _gpt2_step(model: nn.Module):
    ids = torch.randint(0, 256, (2, 48), device=META)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def test_meta_kernels_are_the_ones_the_backend_gives_meta():
    assert kernels(META) is meta
    assert kernels("meta") is meta


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 5), d=st.integers(0, 700), bits=st.sampled_from([1, 2, 4, 8]),
       group=st.sampled_from([8, 64, 256]), data=st.data())
def test_meta_kernels_give_the_shapes_and_dtypes_of_the_compiled_ones(n, d, bits, group, data):
    """Each stand-in returns what the CPU kernel returns, in shape and dtype."""
    ext = compiled_extension("quantize_uniform")
    x = torch.randn(n, d)
    xm = x.to(META)

    def same(a, b):
        assert len(a) == len(b)
        for s, t in zip(a, b):
            assert s.device == META and s.shape == t.shape and s.dtype == t.dtype

    if n * d:
        same(meta.quantize_uniform(xm, bits, group, 1, True),
             ext.quantize_uniform(x, bits, group, 1, True))
        widths = torch.tensor(data.draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=n,
                                                 max_size=n)), dtype=torch.uint8)
        off = ext.row_offsets(d, widths)
        same([meta.row_offsets(d, widths.to(META))], [off])
        total = int(off[-1])
        same(meta.quantize(xm, widths.to(META), off.to(META), total, group, 1, True),
             ext.quantize(x, widths, off, total, group, 1, True))
    mask = x > 0
    same([meta.pack_mask(mask.reshape(-1).to(META))], [ext.pack_mask(mask.reshape(-1))])
    packed = ext.pack_mask(mask.reshape(-1))
    same([meta.unpack_mask(packed.to(META), n * d)], [ext.unpack_mask(packed, n * d)])
    same([meta.pack_compare(xm.reshape(-1), 1, 0.0, 0.0)],
         [ext.pack_compare(x.reshape(-1), 1, 0.0, 0.0)])


def test_a_converted_model_trains_on_the_meta_device():
    model = az.convert_model(_cnn().to(META), bits=2, strategy="uniform")
    model.train()
    x = torch.randn(4, 3, 8, 8, device=META)
    y = torch.randint(0, 5, (4,), device=META)
    out = model(x)
    assert out.shape == (4, 5) and out.device == META
    F.cross_entropy(out, y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


def test_a_precision_strategy_on_the_meta_device_says_why_it_stops():
    """The default strategy re-allocates from a step's values, which meta tensors lack: a
    clear error, not torch's "Cannot copy out of meta tensor"."""
    model = az.convert_model(_cnn().to(META)).train()
    step = _cnn_step(model)
    with pytest.raises(RuntimeError, match="strategy='uniform'"):
        for _ in range(25):
            step()


@pytest.mark.parametrize("build", ["cnn", "gpt2"])
def test_the_gpu_path_of_a_default_step_reads_nothing_back(build):
    """After the warm-up (one whole cycle of the strategy, re-allocation included), a default
    step on the GPU path neither waits for the device nor copies anything to the host. The
    re-allocation's deferred copy happens on its own step, not on this one. Host reads outside
    the library (transformers reads a position id before building its mask) are not ours."""
    if build == "cnn":
        model = az.convert_model(_cnn().to(META)).train()
        step = _cnn_step(model)
    else:
        model = az.convert_model(_gpt2().to(META))
        step = _gpt2_step(model)
    with answering_reads():
        for _ in range(11):
            step()
    work = offcpu_work(step, places=True)
    assert work.kernels > 0 and work.ops > 0
    ours = {k: v for k, v in work.host_reads.items() if not k[1].startswith("outside:")}
    assert ours == {}


def test_the_gpu_path_runs_the_compiled_kernels_not_their_torch_programs():
    """Off the CPU the rounding variances, the strategy's range statistic, width greedy and row
    offsets, and attention dropout's keep-mask take the extension's kernels (their meta
    stand-ins here), one call each, and none of their torch programs runs."""
    model = az.convert_model(_cnn().to(META)).train()
    step = _cnn_step(model)
    with answering_reads():
        for _ in range(11):
            step()
    work = offcpu_work(step, places=True)
    for name in ("rounding_variance_codes", "rounding_variance_correct_", "range_statistic",
                 "allocate_widths", "row_offsets"):
        assert work.by_kernel[name] > 0, name
    torch_programs = ("_sample_torch", "_correct_torch", "_allocate_samples_torch",
                      "_range_statistic_torch", "keep_torch")
    assert not [p for p in work.by_place if p.split(":")[-1] in torch_programs]
    drop = attn._Dropout(7, 0.1, 16, 16, META)
    assert offcpu_work(lambda: drop.keep(0, 2, 0, 16)).by_kernel["attention_keep"] == 1


def test_the_counter_sees_a_read_and_where_it_happened():
    model = az.convert_model(_cnn().to(META), bits=2, strategy="uniform").train()
    step = _cnn_step(model)
    plain = offcpu_work(step)
    x = torch.randn(3, device=META)

    def reading() -> None:
        step()
        if x.sum() > 0:  # a host read of a device value
            pass
    work = offcpu_work(reading, places=True)
    assert plain.reads == 0 and work.reads == 1
    ((op, place),) = work.host_reads
    assert "_local_scalar_dense" in op or "is_nonzero" in op
    assert place.startswith("outside: test_offcpu.py:reading")
    # the same step, the same counts: they repeat exactly
    again = offcpu_work(step)
    assert (again.ops, again.kernels) == (plain.ops, plain.kernels)
    assert work.ops > plain.ops and plain.kernels > 0
    fp32 = offcpu_work(_cnn_step(_cnn().to(META).train()))
    assert fp32.kernels == 0 and fp32.ops < plain.ops


def test_an_attention_mask_tile_is_taken_without_a_host_read():
    """A mask that varies over some batch dims and not others is gathered with an index
    tensor per dim; a 0-d index would be read on the host (a GPU sync every tile)."""
    q = torch.randn(2, 3, 5, 4, device=META)
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.bool, device=META)
    m = attn._Mask(mask, torch.Size([2, 3]), 5, 5, None)
    work = offcpu_work(lambda: m.tile(0, 6, 0, 5))
    assert work.reads == 0
    assert m.tile(0, 6, 0, 5).shape == (6, 5, 5)
    # the values on the CPU: the tile is the mask of each output batch entry
    maskc = torch.rand(2, 1, 5, 5) > 0.5
    mc = attn._Mask(maskc, torch.Size([2, 3]), 5, 5, None)
    expect = maskc.expand(2, 3, 5, 5).reshape(6, 5, 5)
    assert torch.equal(mc.tile(1, 5, 1, 4), expect[1:5, 1:4])
    del q


def test_a_dropout_tile_on_the_gpu_path_costs_a_few_operators():
    """Off the CPU the keep-mask is one kernel call per tile (cpp_ext/attention_dropout_cuda.cu;
    its meta stand-in here): one operator, the output. Without the kernel (a build without
    CUDA kernels) it is a torch program: with the call's batch known its rows are hashed once
    (the first tile) and every further tile is the column mix and the compare, about 16
    operators, against ~60 when each tile hashes its rows again."""
    kernel = attn._Dropout(7, 0.1, 64, 64, META, batch=8)
    assert kernel.compiled
    assert offcpu_work(lambda: kernel.keep(4, 8, 0, 64)).ops == 1
    assert kernel.keep(4, 8, 0, 64).shape == (4, 64, 64)

    once = attn._Dropout(7, 0.1, 64, 64, META, batch=8)
    once._kernel = None  # the torch program
    first = offcpu_work(lambda: once.keep(0, 4, 0, 64))
    later = offcpu_work(lambda: once.keep(4, 8, 0, 64))
    each = attn._Dropout(7, 0.1, 64, 64, META)
    each._kernel = None
    each.keep(0, 4, 0, 64)  # its column hashes, made once either way
    per_tile = offcpu_work(lambda: each.keep(4, 8, 0, 64))
    assert later.ops <= 20 < first.ops
    assert per_tile.ops >= later.ops + 30
    assert once.keep(4, 8, 0, 64).shape == (4, 64, 64)


def test_the_script_counts_both_models_quickly():
    """scripts/bench_offcpu.py --quick: every mode of both models, fp32 with no kernel call,
    the converted modes with some and more operators, no host read of the library's."""
    import re
    import subprocess
    import sys

    from _scripts import SCRIPTS

    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(SCRIPTS / "bench_offcpu.py"), "--quick",
                          "--warmup", "3", "--models", "gpt2"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = dict(re.findall(r"== gpt2, ([\w. -]+): (\d+) operators", res.stdout))
    assert set(rows) == {"fp32", "2-bit uniform", "2-bit default", "checkpoint"}, res.stdout
    assert int(rows["2-bit default"]) > int(rows["fp32"])
    assert "gpt2, fp32: " in res.stdout and " 0 kernel calls" in res.stdout
    places = [p for line in re.findall(r"host reads: (.*)", res.stdout)
              for p in re.findall(r" at (.+?) \d+(?:, |$)", line)]
    assert places and all(p.startswith("outside: ") for p in places), places
