"""QuantConfig: loading, round trips, validation messages, rule precedence, ready configs."""
from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from actnn_zoo.config import STRATEGIES, LayerQConfig, QuantConfig, Rule, as_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- basics
def test_defaults_are_two_bit_auto_precision():
    cfg = QuantConfig()
    assert (cfg.bits, cfg.group_size, cfg.strategy, cfg.rounding, cfg.enabled,
            cfg.update_interval, cfg.rules) == (2, 256, "actnn", "stochastic", True, 10, ())
    assert "uniform" in STRATEGIES and "actnn" in STRATEGIES
    assert cfg.resolve("conv", nn.Conv2d(1, 1, 1)) == LayerQConfig(2, 256, "stochastic", True)


def test_config_is_immutable_and_replace_validates():
    cfg = QuantConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 4  # type: ignore[misc]
    four = cfg.replace(bits=4)
    assert four.bits == 4 and cfg.bits == 2
    with pytest.raises(ValueError, match="bits"):
        cfg.replace(bits=9)
    with pytest.raises(ValueError, match="bits"):
        cfg.replace(strategy="uniform", bits=3)
    with pytest.raises(TypeError, match="'bitz'.*did you mean 'bits'"):
        cfg.replace(bitz=4)
    with_rules = cfg.replace(rules=[{"type": "Conv2d", "bits": 8}])
    assert with_rules.rules == (Rule(type=("Conv2d",), bits=8),)


def test_layer_qconfig_keeps_its_behaviour():
    lc = LayerQConfig()
    assert lc.to_dict() == {"bits": 2, "group_size": 256, "rounding": "stochastic",
                            "enabled": True, "backward_chunks": 1}
    assert lc.replace(bits=8).bits == 8
    with pytest.raises(ValueError):
        LayerQConfig(bits=3)


# ----------------------------------------------------------------------------- round trips
def test_to_dict_of_from_dict_is_the_normalised_dict():
    d = {"bits": 4.0, "rules": [{"pattern": ["layer1.*"], "bits": 8.0},
                                {"type": ["Conv2d", "torch.nn.Linear"], "skip": True},
                                {"name": "fc", "group_size": 64, "rounding": "nearest"}]}
    assert QuantConfig.from_dict(d).to_dict() == {
        "bits": 4, "group_size": 256, "strategy": "actnn", "rounding": "stochastic",
        "enabled": True, "update_interval": 10, "capture": True,
        "rules": [{"pattern": "layer1.*", "bits": 8},
                  {"type": ["Conv2d", "torch.nn.Linear"], "skip": True},
                  {"name": "fc", "group_size": 64, "rounding": "nearest"}]}
    full = QuantConfig.from_dict(d).to_dict()
    assert QuantConfig.from_dict(full).to_dict() == full
    assert QuantConfig.from_dict(None) == QuantConfig.from_dict({}) == QuantConfig()


def test_yaml_round_trip_through_file_and_stream(tmp_path):
    cfg = QuantConfig.from_dict({"bits": 8, "group_size": 128, "rounding": "nearest",
                                 "update_interval": 10,
                                 "rules": [{"pattern": "re:layer[12]\\..*", "bits": 2},
                                           {"name": ["a.b", "c"], "skip": False}]})
    text = cfg.to_yaml(tmp_path / "out.yaml")
    assert (tmp_path / "out.yaml").read_text() == text
    assert QuantConfig.from_yaml(tmp_path / "out.yaml") == cfg
    assert QuantConfig.from_yaml(str(tmp_path / "out.yaml")) == cfg
    assert QuantConfig.from_yaml(io.StringIO(text)) == cfg
    assert QuantConfig.from_yaml(io.BytesIO(text.encode())) == cfg
    assert QuantConfig.from_yaml(tmp_path / "out.yaml").source == str(tmp_path / "out.yaml")


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert QuantConfig.from_yaml(write(tmp_path, "# nothing\n")) == QuantConfig()


_names = st.text(alphabet="abcxyz01._*", min_size=1, max_size=8)
_rule = st.fixed_dictionaries(
    {},
    optional={"bits": st.sampled_from([1, 2, 4, 8]), "group_size": st.sampled_from([32, 256]),
              "rounding": st.sampled_from(["stochastic", "nearest"]), "skip": st.booleans()},
).filter(bool).flatmap(lambda actions: st.one_of(
    st.builds(lambda v: {"name": v, **actions}, _names),
    st.builds(lambda v: {"pattern": v, **actions}, st.lists(_names, min_size=2, max_size=3)),
    st.builds(lambda v: {"type": v, **actions},
              st.sampled_from(["Conv2d", "torch.nn.Linear", "ReLU"]))))


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), group=st.integers(1, 64).map(lambda k: 32 * k),
       rounding=st.sampled_from(["stochastic", "nearest"]), enabled=st.booleans(),
       interval=st.integers(1, 10_000), capture=st.booleans(), rules=st.lists(_rule, max_size=4))
def test_round_trip_property(bits, group, rounding, enabled, interval, capture, rules):
    d = {"bits": bits, "group_size": group, "strategy": "uniform", "rounding": rounding,
         "enabled": enabled, "update_interval": interval, "capture": capture, "rules": rules}
    cfg = QuantConfig.from_dict(d)
    assert cfg.to_dict() == d
    assert QuantConfig.from_yaml(io.StringIO(cfg.to_yaml())) == cfg


# ----------------------------------------------------------------------------- precedence
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, 3)
        self.bn1 = nn.BatchNorm2d(2)


def resolved_bits(cfg: QuantConfig, name: str, module: nn.Module):
    lc = cfg.resolve(name, module)
    return None if lc is None else lc.bits


def test_precedence_global_type_pattern_name():
    conv = nn.Conv2d(1, 1, 1)
    rules = [{"name": "layer1.conv1", "bits": 1},      # exact name: strongest, even listed first
             {"pattern": "layer1.*", "bits": 4},
             {"type": "Conv2d", "bits": 8}]            # type: weaker than any pattern
    cfg = QuantConfig.from_dict({"bits": 2, "rules": rules})
    assert resolved_bits(cfg, "layer1.conv1", conv) == 1
    assert resolved_bits(cfg, "layer1.conv2", conv) == 4
    assert resolved_bits(cfg, "layer2.conv1", conv) == 8
    assert resolved_bits(cfg, "layer2.bn1", nn.BatchNorm2d(1)) == 2


def test_later_rule_of_the_same_kind_wins_and_fields_merge():
    conv = nn.Conv2d(1, 1, 1)
    cfg = QuantConfig.from_dict({"rules": [
        {"pattern": "layer1.*", "bits": 4, "group_size": 64},
        {"pattern": "layer1.conv*", "bits": 8},
        {"type": "torch.nn.Conv2d", "rounding": "nearest"}]})
    assert cfg.resolve("layer1.conv1", conv) == LayerQConfig(8, 64, "nearest")
    assert cfg.resolve("layer1.bn1", nn.BatchNorm2d(1)) == LayerQConfig(4, 64, "stochastic")
    swapped = QuantConfig.from_dict({"rules": [cfg.rules[1].to_dict(), cfg.rules[0].to_dict()]})
    assert swapped.resolve("layer1.conv1", conv).bits == 4


def test_skip_and_unskip_report_the_deciding_rule():
    conv = nn.Conv2d(1, 1, 1)
    cfg = QuantConfig.from_dict({"rules": [
        {"type": "Conv2d", "skip": True},
        {"name": "stem", "skip": False, "bits": 8},
        {"pattern": "re:layer\\d\\.conv", "bits": 4}]})
    assert cfg.resolve("layer1.conv", conv) is None          # a pattern without skip keeps it
    lc, why = cfg.explain("layer1.conv", conv)
    assert lc is None and why == "skipped by rule 0 (type 'Conv2d')"
    assert resolved_bits(cfg, "stem", conv) == 8
    assert resolved_bits(cfg, "head", nn.Linear(1, 1)) == 2
    assert QuantConfig(enabled=False).explain("x", conv) == (None, "disabled")


def test_type_matching_forms():
    conv = nn.Conv2d(1, 1, 1)

    class MyConv(nn.Conv2d):
        pass

    for spec, module, hit in [("Conv2d", conv, True), ("torch.nn.Conv2d", conv, True),
                              ("torch.nn.modules.conv.Conv2d", conv, True),
                              ("nn.Conv2d", conv, False), ("Conv1d", conv, False),
                              ("Conv2d", MyConv(1, 1, 1), False), ("MyConv", MyConv(1, 1, 1), True),
                              ("torch.nn.Linear", conv, False)]:
        cfg = QuantConfig.from_dict({"rules": [{"type": spec, "bits": 8}]})
        assert (resolved_bits(cfg, "m", module) == 8) is hit, spec


def test_pattern_glob_regex_and_lists():
    r = Rule(pattern=("layer1.*", "re:fc|head", "stem?"), bits=8)
    conv = nn.Conv2d(1, 1, 1)
    assert r.matches("layer1.0.conv1", conv)      # '*' crosses dots
    assert r.matches("fc", conv) and r.matches("head", conv)
    assert not r.matches("fc2", conv)              # regex must match the whole name
    assert r.matches("stem1", conv) and not r.matches("layer10", conv)
    cfg = QuantConfig(rules=(r,))
    assert cfg.unmatched_rules([("a", conv)]) == [0]
    assert cfg.unmatched_rules([("a", conv), ("head", conv)]) == []


# ----------------------------------------------------------------------------- errors
def raises_with(match_parts, fn, *args):
    with pytest.raises(ValueError) as info:
        fn(*args)
    msg = str(info.value)
    for part in match_parts:
        assert part in msg, (part, msg)
    return msg


@pytest.mark.parametrize("text, line, parts", [
    ("bits: 2\nbitz: 4\n", 2, ["'bitz'", "did you mean 'bits'"]),
    ("group_sise: 64\n", 1, ["'group_sise'", "did you mean 'group_size'"]),
    ("bits: 2\nrules:\n  - pattern: a\n    bitz: 4\n", 4, ["rules[0].bitz", "did you mean 'bits'"]),
    ("rules:\n  - {type: Conv2d, bits: 8}\n  - patern: x\n    bits: 4\n", 3,
     ["rules[1].patern", "did you mean 'pattern'"]),
    ("strategy: uniform\nbits: 3\n", 2, ["bits", "(1, 2, 4, 8)", "got 3"]),
    ("bits: 9\n", 1, ["bits", "[1, 8]", "got 9"]),
    ("bits: 2\ngroup_size: 48\n", 2, ["group_size", "multiple of 32", "48"]),
    ("group_size: 0\n", 1, ["group_size", "multiple of 32"]),
    ("rules:\n  - name: fc\n    bits: 16\n", 3, ["rules[0].bits", "got 16"]),
    ("rules:\n  - name: fc\n    group_size: 16\n", 3, ["rules[0].group_size", "32"]),
    ("rules:\n  - bits: 8\n", 2, ["rules[0]", "needs one matcher"]),
    ("rules:\n  - {name: a, bits: 8}\n  - pattern: fc\n", 3, ["rules[1]", "no action"]),
    ("rules:\n  - name: fc\n    pattern: fc\n    bits: 4\n", 2,
     ["rules[0]", "exactly one matcher"]),
    ("rules:\n  - pattern: 're:('\n    bits: 4\n", 2, ["rules[0].pattern", "regular expression"]),
    ("rules:\n  - type: 'nn Conv'\n    bits: 4\n", 2, ["rules[0].type", "dotted path"]),
    ("strategy: gactt\n", 1, ["strategy", "'gactt'", "known strategies: uniform, actnn"]),
    ("rounding: up\n", 1, ["rounding", "'up'"]),
    ("enabled: 1\n", 1, ["enabled", "true or false"]),
    ("update_interval: 0\n", 1, ["update_interval", ">= 1"]),
    ("rules: {pattern: x}\n", 1, ["rules", "list of rules"]),
    ("bits: 2\nbits: 4\n", 2, ["duplicate key 'bits'"]),
])
def test_errors_name_key_file_and_line(tmp_path, text, line, parts):
    path = write(tmp_path, text, "bad.yaml")
    raises_with([*parts, str(path), f"line {line}"], QuantConfig.from_yaml, path)


@pytest.mark.parametrize("text, line", [
    ("bits: 2\nrules: [\n  - pattern: a\n", 3),
    ("bits: 2\n  group_size: 4\n", 2),
    ("bits: [1, 2\n", 2),
])
def test_malformed_yaml_has_the_line_number(tmp_path, text, line):
    path = write(tmp_path, text, "broken.yaml")
    msg = raises_with([str(path), "malformed YAML"], QuantConfig.from_yaml, path)
    assert re.search(rf"line {line}\b", msg), msg


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "- 1\n", "list.yaml")
    raises_with([str(path), "mapping"], QuantConfig.from_yaml, path)


def test_dict_errors_name_the_key_without_a_file():
    raises_with(["QuantConfig", "rules[0].skip", "true or false"], QuantConfig.from_dict,
                {"rules": [{"name": "x", "skip": "yes"}]})
    raises_with(["'grop_size'", "did you mean 'group_size'"], QuantConfig.from_dict,
                {"grop_size": 64})
    raises_with(["bits", "True"], QuantConfig.from_dict, {"bits": True})
    with pytest.raises(ValueError, match="exactly one matcher"):
        Rule(name=("a",), type=("Conv2d",), bits=2)
    with pytest.raises(ValueError, match="no action"):
        Rule(name="a")


def test_budget_strategies_read_bits_as_an_average():
    """Strategies other than 'uniform' (added later to STRATEGIES) take a budget in [1, 8]."""
    from actnn_zoo.config import _check_budget

    assert _check_budget("some_budget_strategy", 2.5) == 2.5
    assert _check_budget("some_budget_strategy", 3) == 3
    for bad in (0.5, 9, True, "2"):
        with pytest.raises(ValueError, match=r"\[1, 8\]"):
            _check_budget("some_budget_strategy", bad)
    with pytest.raises(ValueError, match="'uniform'"):
        _check_budget("uniform", 2.5)
    for name in STRATEGIES:
        if name != "uniform":
            cfg = QuantConfig(strategy=name, bits=2.5)
            assert cfg.layer_bits() == 2


def test_as_config_accepts_every_form(tmp_path):
    path = write(tmp_path, "bits: 8\n")
    assert as_config(None) == QuantConfig()
    assert as_config(path).bits == 8 and as_config(str(path)).bits == 8
    assert as_config({"bits": 4}).bits == 4
    assert as_config(QuantConfig(bits=1), bits=2) == QuantConfig(bits=2)
    with pytest.raises(TypeError, match="config must be"):
        as_config(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- ready configs
@pytest.mark.parametrize("name, bits", [("2bit", 2), ("4bit", 4), ("8bit", 8)])
def test_uniform_configs(name, bits):
    cfg = QuantConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert (cfg.bits, cfg.group_size, cfg.strategy, cfg.rules) == (bits, 256, "uniform", ())
    assert cfg.resolve("anything", nn.Linear(1, 1)).bits == bits
    if name == "2bit":
        assert cfg == QuantConfig(strategy="uniform")  # the default budget, one width


def test_auto_precision_configs():
    l3 = QuantConfig.from_yaml(CONFIGS / "actnn_l3.yaml")
    assert l3 == QuantConfig()  # the default config, written out
    low = QuantConfig.from_yaml(CONFIGS / "actnn_1.5bit.yaml")
    assert (low.strategy, low.bits, low.layer_bits()) == ("actnn", 1.5, 1)


def test_cnn_first_last_config_resolves_resnet_names():
    cfg = QuantConfig.from_yaml(CONFIGS / "cnn_first_last_8bit.yaml")
    conv, lin = nn.Conv2d(1, 1, 1), nn.Linear(1, 1)
    assert resolved_bits(cfg, "conv1", conv) == 8
    assert resolved_bits(cfg, "fc", lin) == 8
    assert resolved_bits(cfg, "layer1.0.conv1", conv) == 2  # only the stem's conv1
    assert resolved_bits(cfg, "features.0", conv) == 8      # VGG
    assert resolved_bits(cfg, "classifier.6", lin) == 8
    assert resolved_bits(cfg, "features.3", conv) == 2


def test_transformer_config_resolves_vit_names():
    cfg = QuantConfig.from_yaml(CONFIGS / "transformer.yaml")
    assert resolved_bits(cfg, "blocks.0.norm1", nn.LayerNorm(4)) == 4
    assert resolved_bits(cfg, "blocks.0.attn.softmax", nn.Softmax(-1)) == 4
    assert resolved_bits(cfg, "blocks.0.mlp.fc1", nn.Linear(1, 1)) == 2
    assert resolved_bits(cfg, "patch_embed.proj", nn.Conv2d(1, 1, 1)) == 8
    assert resolved_bits(cfg, "bert.embeddings.LayerNorm", nn.LayerNorm(4)) == 8
    assert resolved_bits(cfg, "head", nn.Linear(1, 1)) == 8


def test_rule_type_matches_the_float_class_of_a_q_layer():
    from actnn_zoo.nn import QModule

    class QC(QModule, nn.Conv2d):
        _FLOAT_MODULE = nn.Conv2d

    q = QC.from_float(nn.Conv2d(1, 1, 1))
    cfg = QuantConfig.from_dict({"rules": [{"type": "Conv2d", "bits": 8}]})
    assert resolved_bits(cfg, "c", q) == 8
    assert torch.is_tensor(q.weight)


# ----------------------------------------------------------------------------- configs by name
def test_every_shipped_config_loads_by_name_equal_to_its_file():
    from actnn_zoo.config import shipped_configs

    names = shipped_configs()
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == list(names)
    for name in names:
        by_name = as_config(name)
        assert by_name == QuantConfig.from_yaml(CONFIGS / f"{name}.yaml") == \
            QuantConfig.from_name(name)
        assert by_name.source == f"actnn_zoo/configs/{name}.yaml"
    assert as_config("4bit").bits == 4 and as_config("actnn_1.5bit").bits == 1.5
    assert as_config("actnn_l3") == QuantConfig()  # the default, written out
    assert as_config("8bit", bits=2).bits == 2      # overrides apply on top of a name


def test_convert_model_takes_a_shipped_name():
    from actnn_zoo import convert_model

    model = convert_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "8bit")
    assert model[0].qconfig.bits == 8


@pytest.mark.parametrize("bad", ["4bits", "no_such_config", "transformers"])
def test_unknown_name_lists_the_shipped_names(bad):
    from actnn_zoo.config import shipped_configs

    with pytest.raises(ValueError, match=f"unknown config name '{bad}'") as e:
        as_config(bad)
    assert all(name in str(e.value) for name in shipped_configs())
    with pytest.raises(ValueError, match="unknown config name"):
        QuantConfig.from_name(bad)


def test_a_name_suggests_the_closest_shipped_one():
    with pytest.raises(ValueError, match=r"did you mean '4bit'\?"):
        as_config("4bits")


def test_paths_still_work_and_a_missing_path_points_at_the_names(tmp_path, monkeypatch):
    from actnn_zoo.config import is_config_name

    path = write(tmp_path, "bits: 8\nstrategy: uniform\n", "mine.yml")
    assert as_config(str(path)).bits == 8 and as_config(path).bits == 8
    assert as_config(str(CONFIGS / "4bit.yaml")).bits == 4
    # a relative path with a suffix is a path, also without a directory part
    monkeypatch.chdir(tmp_path)
    assert as_config("mine.yml").bits == 8
    # a file named like a shipped config does not shadow it: names never read the disk
    write(tmp_path, "bits: 1\nstrategy: uniform\n", "4bit")
    assert as_config("4bit").bits == 4
    with pytest.raises(FileNotFoundError, match="shipped configs are available by name") as e:
        as_config("configs/4bit.yaml")  # no configs/ in this folder (as outside a clone)
    assert "4bit" in str(e.value)
    assert is_config_name("4bit") and is_config_name("actnn_1.5bit")
    assert not is_config_name("4bit.yaml") and not is_config_name("a/4bit")
    assert not is_config_name("CFG.YML")
