"""Tier 1 beyond exact types: same-forward subclasses, third-party classes by dotted path,
QRMSNorm / QHardswish / QHardsigmoid / QMish.

For every mapping: the output equals the original class's (bitwise where the Q-layer runs the
same ops; else within float32 rounding, ``ROUNDING``), input and parameter gradients match
exact fp32 autograd at 8 bits (relative error ``REL_8BIT``) and at 2 bits (cosine ``COS_2BIT``),
conversion keeps every parameter and buffer, and restore gives the original class back.
"""
from __future__ import annotations

import copy
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _scripts import load_script

import actnn_zoo as az
import actnn_zoo.nn as qnn
from actnn_zoo.config import LayerQConfig
from actnn_zoo.convert import conversion_report, convert_model, register_mapping, restore_model
from actnn_zoo.nn import QModule
from actnn_zoo.nn.third_party import THIRD_PARTY, find_rule

ROUNDING = dict(rtol=1e-6, atol=1e-6)  # a different float32 formula for the same function
REL_8BIT = 0.03   # ||g_q - g|| / ||g|| with 8-bit saved tensors
COS_2BIT = 0.5    # cosine(g_q, g) with 2-bit saved tensors, one draw
COS_2BIT_MEAN = 0.95  # cosine of the mean of K_DRAWS 2-bit draws (unbiased: noise averages out)
K_DRAWS = 16

def _convert(mod: nn.Module, bits: int) -> nn.Module:
    """Convert ``mod`` inside a Sequential (so the report lives on the root); capture off, so
    only tier 1 compresses and the gradients test the Q-layer alone."""
    root = convert_model(nn.Sequential(mod), bits=bits, strategy="uniform", capture=False)
    return root


def _run(mod: nn.Module, x: torch.Tensor, gout_seed: int = 1
         ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    y = mod(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(gout_seed)).to(y.dtype)
    y.backward(g)
    grads = [x.grad] + [p.grad for p in mod.parameters()]
    return y.detach(), [t.detach().float() for t in grads]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def check_mapping(make: Callable[[], nn.Module], shape: Tuple[int, ...], q_cls: type,
                  bitwise: bool = True, dtype: torch.dtype = torch.float32) -> None:
    """The whole contract for one mapping (see the module docstring)."""
    torch.manual_seed(0)
    ref = make().to(dtype).train()
    x = (torch.randn(shape) * 2).to(dtype)
    out_ref, g_ref = _run(ref, x)
    for bits in (8, 2):
        orig = copy.deepcopy(ref)
        for p in orig.parameters():
            p.grad = None
        sd = {k: v for k, v in orig.state_dict(keep_vars=True).items()}
        root = _convert(orig, bits)
        q = root[0]
        assert type(q) is q_cls, conversion_report(root)
        assert isinstance(q, QModule) and q.qconfig.bits == bits
        after = q.state_dict(keep_vars=True)
        assert list(after) == list(sd) and all(after[k] is sd[k] for k in sd)
        out_q, g_q = _run(q, x)
        if bits == 2:
            draws = [g_q] + [_run(q, x)[1] for _ in range(K_DRAWS - 1)]
            g_mean = [torch.stack(gs).mean(0) for gs in zip(*draws)]
            assert all(_cos(a, b) > COS_2BIT_MEAN for a, b in zip(g_mean, g_ref)), [
                _cos(a, b) for a, b in zip(g_mean, g_ref)]
        if bitwise:
            assert torch.equal(out_q, out_ref)
        else:
            torch.testing.assert_close(out_q, out_ref, **ROUNDING)
        assert len(g_q) == len(g_ref)
        for a, b in zip(g_q, g_ref):
            if bits == 8:
                assert (a - b).norm() <= REL_8BIT * b.norm() + 1e-6, (a - b).norm() / b.norm()
            else:
                assert _cos(a, b) > COS_2BIT, _cos(a, b)
        q.eval()
        with torch.no_grad():  # the plain path is the original class's own forward
            assert torch.equal(q(x), ref.eval()(x))
        ref.train()
        back = restore_model(root)[0]
        assert type(back) is type(ref)
        assert back.__dict__.keys() == ref.__dict__.keys()
        assert all(back.state_dict(keep_vars=True)[k] is sd[k] for k in sd)


# ----------------------------------------------------------------------------- torch classes
@pytest.mark.parametrize("make,q_cls", [
    (lambda: nn.Hardswish(), qnn.QHardswish),
    (lambda: nn.Hardsigmoid(), qnn.QHardsigmoid),
    (lambda: nn.Mish(), qnn.QMish),
], ids=["Hardswish", "Hardsigmoid", "Mish"])
def test_new_torch_activations(make, q_cls):
    check_mapping(make, (4, 8, 16, 16), q_cls)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("op", ["hardswish", "hardsigmoid", "mish"])
def test_new_activations_in_place(op, inplace):
    cls = {"hardswish": nn.Hardswish, "hardsigmoid": nn.Hardsigmoid, "mish": nn.Mish}[op]
    q = getattr(qnn, "Q" + cls.__name__).from_float(cls(inplace), LayerQConfig(bits=8))
    x = torch.randn(4, 300) * 3
    a = x.clone().requires_grad_()
    y = q(a.clone())
    y.backward(torch.ones_like(y))
    b = x.clone().requires_grad_()
    z = cls()(b)
    z.backward(torch.ones_like(z))
    assert torch.equal(y, z)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0.05)


@pytest.mark.parametrize("make,shape", [
    (lambda: nn.RMSNorm(64), (4, 10, 64)),
    (lambda: nn.RMSNorm([8, 40], eps=1e-3), (4, 3, 8, 40)),
    (lambda: nn.RMSNorm(300, elementwise_affine=False), (6, 300)),
], ids=["last-dim", "two-dims", "no-affine"])
def test_rmsnorm(make, shape):
    check_mapping(make, shape, qnn.QRMSNorm)


def test_rmsnorm_saves_normalized_input_and_rstd():
    q = qnn.QRMSNorm.from_float(nn.RMSNorm(512), LayerQConfig(bits=2))
    x = torch.randn(16, 512, requires_grad=True) * 50
    y = q(x)
    saved = y.grad_fn.saved_tensors
    nbytes = sum(t.numel() * t.element_size() for t in saved if t is not q.weight)
    assert nbytes < x.numel() * 4 / 8  # 2-bit codes + group bounds + 16 rstd, vs fp32 x
    assert any(t.shape == (16, 1) and t.dtype == torch.float32 for t in saved)  # exact rstd


def test_same_forward_subclass_converts_like_its_base():
    lin = nn.modules.linear.NonDynamicallyQuantizableLinear(300, 16)
    check_mapping(lambda: copy.deepcopy(lin), (8, 300), qnn.QLinear)
    mha = nn.MultiheadAttention(32, 4)
    root = convert_model(nn.Sequential(mha), capture=False)
    assert type(root[0].out_proj) is qnn.QLinear
    assert root[0].out_proj.float_class() is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(root[0].out_proj, nn.Linear)


class ScaledLinear(nn.Linear):
    """A subclass that changes the computation: must not become a QLinear."""

    def forward(self, x):
        return 2 * super().forward(x)


class PlainSubLinear(nn.Linear):
    pass


def test_custom_forward_subclass_is_not_converted_and_the_report_says_why():
    model = nn.Sequential(ScaledLinear(4, 4), PlainSubLinear(4, 4), nn.Linear(4, 4))
    model = convert_model(model, capture=False)
    assert type(model[0]) is ScaledLinear
    assert type(model[1]) is qnn.QLinear and model[1].float_class() is PlainSubLinear
    assert type(model[2]) is qnn.QLinear
    skipped = {s.name: s for s in conversion_report(model).skipped}
    assert "overrides forward" in skipped["0"].reason and "Linear" in skipped["0"].reason
    assert "capture" in skipped["0"].reason and skipped["0"].type == "ScaledLinear"
    with pytest.raises(TypeError, match="overrides forward"):
        qnn.QLinear.from_float(ScaledLinear(4, 4))
    assert type(restore_model(model)[1]) is PlainSubLinear


def test_reconversion_keeps_third_party_layers_and_opt_out_by_mapping():
    model = nn.Sequential(PlainSubLinear(4, 4), nn.Hardswish())
    model = convert_model(model, bits=2, capture=False)
    q0 = model[0]
    model = convert_model(model, bits=4, capture=False)
    assert model[0] is q0 and q0.qconfig.bits == 4 and q0.float_class() is PlainSubLinear
    model = convert_model(model, mapping=register_mapping(nn.Hardswish, None), capture=False)
    assert type(model[1]) is nn.Hardswish
    model = convert_model(model, mapping=register_mapping(nn.Linear, None), capture=False)
    assert type(model[0]) is PlainSubLinear  # the base's opt-out applies to the subclass


def test_hooks_are_copied_not_shared():
    lin = nn.Linear(3, 4)
    root = convert_model(nn.Sequential(lin))
    lin(torch.randn(2, 3))  # the original still works as a torch layer
    calls = []
    root[0].register_forward_hook(lambda m, i, o: calls.append(type(m)))
    lin(torch.randn(2, 3))
    assert calls == []


# ----------------------------------------------------------------------------- transformers
def _tf():
    return pytest.importorskip("transformers")


def test_third_party_table_imports_nothing():
    import subprocess
    import sys
    code = ("import sys, torch, actnn_zoo as az\n"
            "m = az.convert_model(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU()))\n"
            "print(any(k.split('.')[0] in ('transformers', 'timm', 'torchvision')"
            " for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "False", out.stderr


def test_hf_conv1d():
    _tf()
    from transformers.pytorch_utils import Conv1D
    check_mapping(lambda: Conv1D(64, 300), (4, 7, 300), qnn.QHFConv1D)


@pytest.mark.parametrize("name,approx,bitwise", [
    ("NewGELUActivation", "tanh", False),
    ("FastGELUActivation", "tanh", False),
    ("GELUActivation", "none", True),
    ("GELUTanh", "tanh", True),
])
def test_hf_gelus(name, approx, bitwise):
    _tf()
    import transformers.activations as acts
    cls = getattr(acts, name)
    check_mapping(cls, (4, 8, 300), qnn.QGELU, bitwise=bitwise)
    q = _convert(cls(), 2)[0]
    assert q.approximate == approx


def test_hf_silu_and_mish():
    _tf()
    import transformers.activations as acts
    check_mapping(acts.SiLUActivation, (4, 8, 300), qnn.QSiLU)
    check_mapping(acts.MishActivation, (4, 8, 300), qnn.QMish)


@pytest.mark.parametrize("name", ["GELUActivation", "GELUTanh"])
def test_hf_python_formula_variants_are_not_converted(name):
    _tf()
    import transformers.activations as acts
    kw = {"GELUActivation": {"use_gelu_python": True},
          "GELUTanh": {"use_gelu_tanh_python": True}}[name]
    root = convert_model(nn.Sequential(getattr(acts, name)(**kw)), capture=False)
    assert type(root[0]) is getattr(acts, name)
    (skip,) = conversion_report(root).skipped
    assert "its act is not" in skip.reason


@pytest.mark.parametrize("path,dtype", [
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", torch.float32),
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", torch.bfloat16),
    ("transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm", torch.float32),  # a code twin
    ("transformers.models.t5.modeling_t5.T5LayerNorm", torch.float32),
    ("transformers.models.t5.modeling_t5.T5LayerNorm", torch.bfloat16),
])
def test_hf_rmsnorms(path, dtype):
    _tf()
    import importlib
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    check_mapping(lambda: cls(64, eps=1e-5), (4, 10, 64), qnn.QRMSNorm, dtype=dtype)


def test_hf_rmsnorm_with_another_formula_is_not_a_twin():
    _tf()
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    assert find_rule(GemmaRMSNorm) == (None, None)  # (1 + weight): not Llama's code


def test_third_party_opt_out_by_dotted_path():
    _tf()
    from transformers.pytorch_utils import Conv1D
    path = "transformers.pytorch_utils.Conv1D"
    assert path in THIRD_PARTY
    root = convert_model(nn.Sequential(Conv1D(4, 4)), mapping={path: None}, capture=False)
    assert type(root[0]) is Conv1D
    assert "opted out" in conversion_report(root).skipped[0].reason
    with pytest.raises(TypeError, match="dotted class paths"):
        register_mapping("Conv1D", qnn.QLinear)


def _tiny(kind: str):
    tf = _tf()
    torch.manual_seed(0)
    common = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=2)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=2,
                                                vocab_size=128, n_positions=64, resid_pdrop=0,
                                                embd_pdrop=0, attn_pdrop=0))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=64, intermediate_size=128,
                                                  max_position_embeddings=64, **common))
    return tf.BertForMaskedLM(tf.BertConfig(hidden_size=64, intermediate_size=128,
                                            max_position_embeddings=64, hidden_dropout_prob=0,
                                            attention_probs_dropout_prob=0, **common))


@pytest.mark.parametrize("kind,expected", [
    ("gpt2", {"Conv1D": "QHFConv1D", "NewGELUActivation": "QGELU"}),
    ("llama", {"LlamaRMSNorm": "QRMSNorm", "SiLUActivation": "QSiLU"}),
    ("bert", {"GELUActivation": "QGELU", "Linear": "QLinear", "LayerNorm": "QLayerNorm"}),
])
def test_real_hf_models_convert_and_train(kind, expected):
    model = _tiny(kind).train()  # dropout off: the training losses must agree
    ref = copy.deepcopy(model)
    sd = model.state_dict()
    ids = torch.randint(0, 128, (2, 16))
    model = az.convert_model(model)
    got = {c.from_type: c.to_type for c in conversion_report(model).converted}
    assert all(got.get(k) == v for k, v in expected.items()), got
    assert not any(s.type in expected for s in conversion_report(model).skipped)
    assert model.state_dict().keys() == sd.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        ref_loss = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters() if p.requires_grad and p.grad is not None)
    opt.step()
    restored = restore_model(model)
    assert {type(m).__name__ for m in restored.modules()} == {
        type(m).__name__ for m in ref.modules()}


# ----------------------------------------------------------------------------- timm / torchvision
def _vision():
    tv, timm, why = load_script("third_party.py").import_vision()
    return tv, timm, why


def test_timm_and_torchvision_norms():
    tv, timm, why = _vision()
    if timm is None or tv is None:
        pytest.skip(why)
    from timm.layers.norm import LayerNorm, LayerNorm2d
    from timm.layers.norm_act import BatchNormAct2d
    from torchvision.models.convnext import LayerNorm2d as TvLayerNorm2d
    check_mapping(lambda: LayerNorm(64), (4, 10, 64), qnn.QLayerNorm)
    check_mapping(lambda: LayerNorm2d(16), (2, 16, 8, 8), qnn.QLayerNorm2d)
    check_mapping(lambda: TvLayerNorm2d(16, eps=1e-6), (2, 16, 8, 8), qnn.QLayerNorm2d)
    torch.manual_seed(0)
    bn = BatchNormAct2d(16, act_layer=nn.SiLU)
    ref = copy.deepcopy(bn)
    root = _convert(bn, 8)
    assert type(root[0]) is qnn.QBatchNormAct2d and type(root[0].act) is qnn.QSiLU
    x = torch.randn(4, 16, 8, 8)
    out_q, g_q = _run(root[0], x)
    out_r, g_r = _run(ref, x)
    assert torch.equal(out_q, out_r)
    assert torch.equal(root[0].running_mean, ref.running_mean)
    for a, b in zip(g_q, g_r):
        assert (a - b).norm() <= REL_8BIT * b.norm()
    back = restore_model(root)[0]
    assert type(back) is BatchNormAct2d and type(back.act) is nn.SiLU
