"""convert_model / restore_model / register_mapping: state sharing, tree surgery, reports."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Dict, Type

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actnn_zoo.nn as qnn
from actnn_zoo.config import LayerQConfig, QuantConfig
from actnn_zoo.convert import (ConversionReport, conversion_report, convert_model,
                               default_mapping, register_mapping, restore_model)
from actnn_zoo.nn import QModule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ----------------------------------------------------------------------------- test Q classes
def make_q(float_cls: Type[nn.Module]) -> Type[nn.Module]:
    """A test-only Q class: the torch layer's own forward, a qconfig, from_float/to_float."""

    def __init__(self, *args, qconfig=None, **kwargs):
        float_cls.__init__(self, *args, **kwargs)
        self._init_q(qconfig)

    return type("T" + float_cls.__name__, (QModule, float_cls),
                {"_FLOAT_MODULE": float_cls, "__init__": __init__})


TConv2d, TBatchNorm2d, TReLU, TLinear, TLayerNorm = (
    make_q(c) for c in (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, nn.LayerNorm))
TEST_MAP: Dict[type, type] = {c._FLOAT_MODULE: c
                              for c in (TConv2d, TBatchNorm2d, TReLU, TLinear, TLayerNorm)}
TEST_MAP[nn.Softmax] = None  # type: ignore[assignment]  # whatever the real zoo has


class Scale(nn.Module):
    """A leaf with no Q-layer anywhere."""

    def forward(self, x):
        return 2 * x


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """ResNet naming: conv1 stem, layer1 (Sequential), a ModuleList/ModuleDict, fc."""

    def __init__(self, c=4, classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.extra = nn.ModuleList([nn.Conv2d(c, c, 1), nn.ReLU()])
        self.branches = nn.ModuleDict({"left": nn.Conv2d(c, c, 1), "scale": Scale()})
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        for m in self.extra:
            x = m(x)
        x = self.branches["scale"](self.branches["left"](x))
        return self.fc(x.mean((2, 3)))


def tiny(seed=0) -> TinyResNet:
    torch.manual_seed(seed)
    return TinyResNet()


def convert(model, config=None, **kw):
    """Conversion with the test-only classes; tiers 2-3 off unless asked for, so that these
    tree-surgery tests compare exact forwards (tests/test_capture.py covers capture)."""
    if not isinstance(config, (QuantConfig, str, Path)) and "capture" not in kw:
        if config is None or "capture" not in config:
            kw["capture"] = False
    return convert_model(model, config, mapping=TEST_MAP, **kw)


def q_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QModule)}


# ----------------------------------------------------------------------------- state sharing
def test_state_dict_keys_and_storage_are_unchanged():
    model = tiny()
    before = model.state_dict(keep_vars=True)
    ptrs = {k: v.data_ptr() for k, v in before.items()}
    params = list(model.parameters())
    buffers = list(model.buffers())
    out = convert(model)
    assert out is model
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] and after[k].data_ptr() == ptrs[k] for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert len(list(model.parameters())) == len(params)
    assert all(a is b for a, b in zip(model.buffers(), buffers))
    # every convertible layer converted, to the exact test class
    expected = {n: TEST_MAP[type(m)] for n, m in tiny().named_modules() if type(m) in TEST_MAP}
    assert {n: type(m) for n, m in q_layers(model).items()} == expected
    assert isinstance(model.conv1, nn.Conv2d) and isinstance(model.conv1, TConv2d)


def test_optimizer_built_before_conversion_updates_the_converted_model():
    model = tiny()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = convert(model)
    x = torch.randn(2, 3, 6, 6)
    w0 = model.fc.weight.detach().clone()
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert not torch.equal(model.fc.weight, w0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    assert opt.param_groups[0]["params"][0] is model.conv1.weight


def test_hooks_survive_conversion():
    model = tiny()
    calls = []
    model.conv1.register_forward_hook(lambda m, i, o: calls.append(("fwd", type(m))))
    model.fc.register_forward_pre_hook(lambda m, i: calls.append(("pre", type(m))))
    model.layer1[0].bn1.register_full_backward_hook(lambda m, gi, go: calls.append(("bwd", 0)))
    model = convert(model)
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert ("fwd", TConv2d) in calls and ("pre", TLinear) in calls and ("bwd", 0) in calls


def test_hook_dicts_are_copied_so_the_original_stays_a_torch_layer():
    """Hooks registered before conversion fire on the Q-layer; a hook registered on the
    Q-layer afterwards never fires on (nor receives) the original torch layer, which keeps
    working. Failed when the hook dicts were shared: ``lin(x)`` raised AttributeError
    ('Linear' object has no attribute 'quantizing') from the precision strategy's hook."""
    lin = nn.Linear(3, 4)
    before = []
    lin.register_forward_hook(lambda m, i, o: before.append(type(m)))
    q = convert_model(lin)
    assert isinstance(q, qnn.QLinear) and q is not lin
    after = []
    q.register_forward_hook(lambda m, i, o: after.append(type(m)))
    q.register_forward_pre_hook(lambda m, i: after.append("pre"))
    lin(torch.randn(2, 3))  # a plain torch layer again
    assert before == [nn.Linear] and after == []
    q(torch.randn(2, 3))
    assert before == [nn.Linear, qnn.QLinear] and after == ["pre", qnn.QLinear]
    assert lin._forward_hooks is not q._forward_hooks
    restored = restore_model(q)
    restored(torch.randn(2, 3))
    assert after == ["pre", qnn.QLinear, "pre", nn.Linear]  # restore keeps the Q-layer's hooks
    assert q._forward_hooks is not restored._forward_hooks


def test_training_mode_dtype_and_device_are_kept():
    model = tiny().to(torch.bfloat16)
    model.train()
    model.layer1[1].eval()
    model.fc.eval()
    modes = {n: m.training for n, m in model.named_modules()}
    model = convert(model)
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.bn1.running_mean.dtype == torch.bfloat16

    with torch.device("meta"):
        meta = TinyResNet()
    meta = convert(meta)
    assert isinstance(meta.conv1, TConv2d)
    assert all(t.device.type == "meta" for t in meta.state_dict().values())
    model.eval()  # train()/eval() on the converted tree reach the Q-layers
    assert not model.layer1[0].conv1.training


# ----------------------------------------------------------------------------- tree surgery
def test_containers_and_root_are_converted():
    model = convert(tiny())
    assert isinstance(model.layer1[0].conv2, TConv2d)         # Sequential > Module
    assert isinstance(model.extra[0], TConv2d) and isinstance(model.extra[1], TReLU)
    assert isinstance(model.branches["left"], TConv2d)        # ModuleDict
    assert type(model.branches["scale"]) is Scale             # unknown: left alone
    assert [type(m) for m in model.extra] == [TConv2d, TReLU]

    conv = nn.Conv2d(3, 3, 1)
    root = convert(conv)
    assert type(root) is TConv2d and root is not conv and type(conv) is nn.Conv2d
    assert root.weight is conv.weight
    assert conversion_report(root).converted[0].name == ""
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert convert(seq) is seq and [type(m) for m in seq] == [TLinear, TReLU]


def test_shared_modules_map_to_one_q_module():
    relu, lin = nn.ReLU(), nn.Linear(3, 3)
    model = nn.Sequential(lin, relu, lin, relu)
    holder = nn.Module()
    holder.a, holder.b, holder.seq = relu, relu, model
    holder = convert(holder)
    assert type(holder.a) is TReLU
    assert holder.a is holder.b is model[1] is model[3]
    assert model[0] is model[2] and type(model[0]) is TLinear
    report = conversion_report(holder)
    assert sorted(c.name for c in report.converted) == ["a", "seq.0"]
    assert len(list(holder.parameters())) == 2


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)


def test_a_replaced_parent_gets_the_replaced_children():
    TWrapper = make_q(Wrapper)
    mapping = {**TEST_MAP, Wrapper: TWrapper}
    model = nn.Sequential(Wrapper())
    lin = model[0].lin
    convert_model(model, mapping=mapping)
    assert type(model[0]) is TWrapper and type(model[0].lin) is TLinear
    assert model[0].lin.weight is lin.weight
    root = convert_model(Wrapper(), mapping=mapping)
    assert type(root) is TWrapper and type(root.lin) is TLinear
    assert [type(m) for m in restore_model(root).modules()] == [Wrapper, nn.Linear]


def test_never_converts_a_q_module_twice_and_reconversion_applies_the_new_config():
    model = convert(tiny())
    layers = q_layers(model)
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    model.conv1.sample_bits = torch.tensor([8, 8])
    again = convert(model, bits=4)
    assert again is model
    assert q_layers(model) == layers  # same objects, same names
    assert all(type(m).__mro__.count(QModule) == 1 for m in layers.values())
    assert all(m.qconfig == LayerQConfig(bits=4) for m in layers.values())
    assert model.conv1.sample_bits is None
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    # the result equals a fresh conversion: a skipped Q-layer goes back to torch
    convert(model, {"rules": [{"name": "fc", "skip": True}]})
    assert type(model.fc) is nn.Linear and model.fc.weight is layers["fc"].weight
    assert model.conv1.qconfig.bits == 2
    convert(model, enabled=False)
    assert not q_layers(model)
    reasons = {r.name: r.reason for r in conversion_report(model).skipped}
    assert reasons["conv1"] == "disabled; restored to torch" and reasons["fc"] == "disabled"


def test_reconversion_with_another_mapping_swaps_the_class():
    TConv2dB = make_q(nn.Conv2d)
    model = convert(tiny())
    w = model.conv1.weight
    convert_model(model, mapping={**TEST_MAP, nn.Conv2d: TConv2dB}, bits=8)
    assert type(model.conv1) is TConv2dB and model.conv1.weight is w
    assert model.conv1.qconfig.bits == 8
    convert_model(model, mapping={**TEST_MAP, nn.Conv2d: None})
    assert type(model.conv1) is nn.Conv2d and model.conv1.weight is w


def test_restore_model_round_trip():
    model = tiny()
    x = torch.randn(2, 3, 6, 6)
    model.eval()
    y0 = model(x)
    before = model.state_dict(keep_vars=True)
    types = {n: type(m) for n, m in model.named_modules()}
    params = list(model.parameters())
    model = restore_model(convert(model))
    assert {n: type(m) for n, m in model.named_modules()} == types
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert not hasattr(model, "actnn_zoo_report")
    torch.testing.assert_close(model(x), y0, rtol=0, atol=0)
    conv = nn.Conv2d(1, 1, 1)
    back = restore_model(convert(conv))
    assert type(back) is nn.Conv2d and back.weight is conv.weight
    assert not hasattr(back, "actnn_zoo_report")


# ----------------------------------------------------------------------------- isolation
def test_two_models_with_different_configs_do_not_interact():
    a, b = tiny(), tiny()
    a = convert(a, bits=2)
    b = convert(b, CONFIGS / "8bit.yaml")
    assert {m.qconfig.bits for m in q_layers(a).values()} == {2}
    assert {m.qconfig.bits for m in q_layers(b).values()} == {8}
    convert(a, bits=4)
    restore_model(a)
    assert {m.qconfig.bits for m in q_layers(b).values()} == {8}
    assert conversion_report(b).config.bits == 8
    assert not set(map(id, a.parameters())) & set(map(id, b.parameters()))


def test_register_mapping_is_explicit_and_local():
    baseline = default_mapping()
    TScale = make_q(Scale)
    early = convert(tiny())
    mapping = register_mapping(Scale, TScale, TEST_MAP)
    assert mapping is not TEST_MAP and Scale not in TEST_MAP
    assert default_mapping() == baseline  # nothing global changed
    assert Scale not in default_mapping()
    assert type(early.branches["scale"]) is Scale  # an earlier conversion: untouched
    later = convert_model(tiny(), mapping=mapping)
    assert type(later.branches["scale"]) is TScale
    plain = convert(tiny())  # a conversion not given the mapping ignores it
    assert type(plain.branches["scale"]) is Scale
    opted_out = register_mapping(nn.ReLU, None, TEST_MAP)
    assert type(convert_model(tiny(), mapping=opted_out).relu) is nn.ReLU
    full = register_mapping(Scale, TScale)
    assert all(full[k] is v for k, v in baseline.items())
    with pytest.raises(ValueError, match="_FLOAT_MODULE is Conv2d"):
        register_mapping(nn.Linear, TConv2d)
    with pytest.raises(TypeError, match="not a QModule"):
        register_mapping(nn.Linear, nn.Linear)
    with pytest.raises(TypeError, match="nn.Module classes"):
        convert_model(tiny(), mapping={"Linear": TLinear})


# ----------------------------------------------------------------------------- config forms
def test_config_forms_and_overrides(tmp_path):
    assert {m.qconfig.bits for m in q_layers(convert(tiny())).values()} == {2}
    for cfg in (CONFIGS / "4bit.yaml", str(CONFIGS / "4bit.yaml"), {"bits": 4},
                QuantConfig(bits=4)):
        assert {m.qconfig.bits for m in q_layers(convert(tiny(), cfg)).values()} == {4}
    m = convert(tiny(), CONFIGS / "8bit.yaml", bits=1, group_size=64, rounding="nearest")
    assert {m.qconfig for m in q_layers(m).values()} == {LayerQConfig(1, 64, "nearest")}
    with pytest.raises(TypeError, match="'bitz'.*did you mean 'bits'"):
        convert(tiny(), bitz=4)
    with pytest.raises(ValueError, match="bits"):
        convert(tiny(), bits=9)
    with pytest.raises(ValueError, match="bits"):
        convert(tiny(), strategy="uniform", bits=3)
    bad = tmp_path / "bad.yaml"
    bad.write_text("bits: 2\ngroup_size: 100\n")
    with pytest.raises(ValueError, match=r"bad\.yaml', line 2: group_size"):
        convert(tiny(), bad)
    with pytest.raises(TypeError):
        convert_model(object())  # type: ignore[arg-type]


def test_unmatched_rules_warn_and_matched_ones_do_not():
    cfg = {"rules": [{"pattern": "layer9.*", "bits": 8}, {"name": "fc", "bits": 8},
                     {"type": ["GRU", "LSTM"], "skip": True}]}
    with pytest.warns(UserWarning, match=r"rules\[0\] pattern 'layer9\.\*'.*"
                                         r"rules\[2\] type \['GRU', 'LSTM'\]") as rec:
        model = convert(tiny(), cfg)
    assert "rules[1]" not in str(rec[0].message)
    assert [(u.index, u.rule) for u in conversion_report(model).unmatched_rules] == [
        (0, "pattern 'layer9.*'"), (2, "type ['GRU', 'LSTM']")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        convert(tiny(), {"rules": [{"pattern": ["nothing", "layer1.*"], "bits": 4},
                                   {"type": "Scale", "skip": True}]})


def test_report_contents_and_table():
    cfg = {"rules": [{"name": "fc", "bits": 8}, {"pattern": "layer1.1.*", "skip": True}]}
    model = convert(tiny(), cfg)
    report = model.actnn_zoo_report
    assert isinstance(report, ConversionReport) and conversion_report(model) is report
    conv = {c.name: c for c in report.converted}
    assert (conv["fc"].from_type, conv["fc"].to_type, conv["fc"].bits) == ("Linear", "TLinear", 8)
    assert (conv["conv1"].bits, conv["conv1"].group_size) == (2, 256)
    assert "layer1.1.conv1" not in conv and "layer1.0.conv1" in conv
    skipped = {s.name: (s.type, s.reason) for s in report.skipped}
    assert skipped["branches.scale"] == ("Scale", "no Q layer for this type")
    assert skipped["layer1.1.conv1"] == ("Conv2d", "skipped by rule 1 (pattern 'layer1.1.*')")
    assert "layer1" not in skipped and "" not in skipped  # containers are not listed
    assert report.unmatched_rules == []
    text = str(report)
    assert text.splitlines()[0] == (f"actnn_zoo conversion: {len(report.converted)} converted, "
                                    f"{len(report.skipped)} skipped, 0 unmatched rule(s)")
    assert any(line.split()[:5] == ["fc", "Linear", "TLinear", "8", "256"]
               for line in text.splitlines())
    assert "skipped by rule 1" in text
    disabled = convert(tiny(), enabled=False)
    assert not q_layers(disabled)
    assert {s.reason for s in conversion_report(disabled).skipped} == {
        "disabled", "no Q layer for this type"}
    with pytest.raises(ValueError, match="not converted"):
        conversion_report(tiny())


# ----------------------------------------------------------------------------- ready configs
def test_cnn_first_last_8bit_on_a_resnet():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = convert(tiny(), CONFIGS / "cnn_first_last_8bit.yaml")
    bits = {n: m.qconfig.bits for n, m in q_layers(model).items()}
    assert bits.pop("conv1") == 8 and bits.pop("fc") == 8
    assert set(bits.values()) == {2} and "layer1.0.conv1" in bits


class TinyViT(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, d, 2, stride=2)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.norm1, blk.qkv, blk.softmax = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Softmax(-1)
            blk.norm2, blk.fc1, blk.act, blk.fc2 = (nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(),
                                                    nn.Linear(d, d))
            self.blocks.append(blk)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)


def test_transformer_config_on_a_vit():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = convert_model(TinyViT(), CONFIGS / "transformer.yaml",
                              mapping={**TEST_MAP, nn.GELU: None})
    bits = {n: m.qconfig.bits for n, m in q_layers(model).items()}
    assert bits == {"patch_embed.proj": 8, "head": 8, "norm": 4,
                    **{f"blocks.{i}.{n}": 4 for i in (0, 1) for n in ("norm1", "norm2")},
                    **{f"blocks.{i}.{n}": 2 for i in (0, 1) for n in ("qkv", "fc1", "fc2")}}


@pytest.mark.parametrize("name, bits", [("2bit", 2), ("4bit", 4), ("8bit", 8)])
def test_uniform_configs_convert(name, bits):
    model = convert(tiny(), CONFIGS / f"{name}.yaml")
    assert {m.qconfig for m in q_layers(model).values()} == {LayerQConfig(bits=bits)}


# ----------------------------------------------------------------------------- the real zoo
def test_default_mapping_discovers_every_exported_q_class():
    mapping = default_mapping()
    for obj in vars(qnn).values():
        if isinstance(obj, type) and issubclass(obj, QModule) and hasattr(obj, "_FLOAT_MODULE"):
            assert mapping[obj._FLOAT_MODULE]._FLOAT_MODULE is obj._FLOAT_MODULE
    assert all(issubclass(q, QModule) and q._FLOAT_MODULE is f for f, q in mapping.items())
    assert default_mapping() is not default_mapping()


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(self.relu(self.bn1(self.conv1(x))).flatten(1))


def test_real_layers_convert_train_and_restore():
    torch.manual_seed(0)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    model = convert_model(model, bits=8, strategy="uniform")
    assert [type(m) for m in (model.conv1, model.bn1, model.relu, model.fc)] == [
        qnn.QConv2d, qnn.QBatchNorm2d, qnn.QReLU, qnn.QLinear]
    assert isinstance(model.conv1, nn.Conv2d) and isinstance(model.bn1, nn.BatchNorm2d)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    x = torch.randn(4, 3, 4, 4)
    model.eval(), ref.eval()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)  # eval: plain torch
    model.train(), ref.train()
    w0 = model.conv1.weight.detach().clone()
    opt.zero_grad()
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    # 8-bit saved tensors: cosine >= 0.9999 with fp32 autograd, as in the layer tests;
    # conv1's bias feeds BatchNorm, so its exact gradient is zero up to rounding
    scale = max(q.grad.norm() for q in ref.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None
        if q.grad.norm() < 1e-5 * scale:
            assert p.grad.norm() < 1e-3 * scale
        else:
            assert F.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) >= 0.9999
    opt.step()
    assert not torch.equal(model.conv1.weight, w0)
    assert model.bn1.num_batches_tracked.item() == 1
    restored = restore_model(model)
    assert [type(m) for m in (restored.conv1, restored.bn1, restored.relu, restored.fc)] == [
        nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear]
    assert {k: v.data_ptr() for k, v in restored.state_dict().items()} == state


def test_real_layers_with_the_cnn_config():
    model = convert_model(TinyResNet(), CONFIGS / "cnn_first_last_8bit.yaml")
    assert type(model.conv1) is qnn.QConv2d and model.conv1.qconfig.bits == 8
    assert type(model.fc) is qnn.QLinear and model.fc.qconfig.bits == 8
    assert type(model.layer1[0].bn1) is qnn.QBatchNorm2d and model.layer1[0].bn1.qconfig.bits == 2
    assert type(model.layer1[0].relu) is qnn.QReLU


def test_every_exported_q_layer_with_a_default_constructor_round_trips():
    """Whatever layers actnn_zoo.nn exports today: convert -> exact Q class -> restore."""
    layers = []
    for float_cls in default_mapping():
        try:
            layers.append(float_cls())
        except TypeError:  # needs arguments (conv, pools, norms): covered elsewhere
            continue
    assert layers, "actnn_zoo.nn exports no Q-layer whose torch class has a default constructor"
    model = nn.Sequential(*layers)
    model = convert_model(model, bits=4)
    mapping = default_mapping()
    assert [type(m) for m in model] == [mapping[type(m)] for m in layers]
    assert all(m.qconfig == LayerQConfig(bits=4) for m in model)
    restored = restore_model(model)
    assert [type(m) for m in restored] == [type(m) for m in layers]


def test_real_layers_with_the_transformer_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = convert_model(TinyViT(), CONFIGS / "transformer.yaml")
    blk = model.blocks[0]
    assert [type(m) for m in (blk.norm1, blk.qkv, blk.softmax, blk.act)] == [
        qnn.QLayerNorm, qnn.QLinear, qnn.QSoftmax, qnn.QGELU]
    assert (blk.norm1.qconfig.bits, blk.softmax.qconfig.bits, blk.qkv.qconfig.bits,
            blk.act.qconfig.bits) == (4, 4, 2, 2)
    assert model.patch_embed.proj.qconfig.bits == 8 and model.head.qconfig.bits == 8
