"""Config fuzzing (issue 6 item 7): malformed ``"aidaptiv"`` sections and malformed DeepSpeed offload
combinations never end in a traceback from deep inside.

Properties (hypothesis):

* :func:`parse_section` and :func:`validate` either return a config or raise
  :class:`AidaptivConfigError`; never ``TypeError``/``KeyError``/``AttributeError``/``OverflowError``
  or a bare pydantic ``ValidationError``;
* every problem in the message names its key (``aidaptiv.<key>`` or a DeepSpeed key such as
  ``zero_optimization.offload_param.max_in_cpu``) and says how to fix it ("Fix", "did you mean",
  "e.g.", "such as" or the list of valid keys);
* what :func:`validate` accepts, DeepSpeed's own ZeRO config model accepts too, and a section that
  parses as ``"enabled": false`` is also treated as disabled by :func:`section_enabled`;
* for a sample, ``deepspeed.zero.Init`` and ``deepspeed.initialize`` refuse the config in process
  with the very same :class:`AidaptivConfigError` (they validate before building anything).

Which errors we accept: for the DeepSpeed keys aidaptiv_ds depends on (``zero_optimization``,
its ``stage`` and ``sub_group_size``, ``offload_param`` / ``offload_optimizer``, their ``device``,
``nvme_path``, ``max_in_cpu`` and ``ratio``) our validation answers first, with our message. Other
keys inside DeepSpeed's sections (``buffer_count``, ``pin_memory``, ...) are DeepSpeed's business:
its pydantic ``ValidationError`` names them, and this file does not fuzz them.
"""
from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import aidaptiv_ds  # noqa: F401 - installs the hooks
import deepspeed
from aidaptiv_ds.integration.config import (AidaptivConfig, AidaptivConfigError, EnduranceConfig, IOConfig,
                                            parse_section, section_enabled, validate)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
FIX_MARKERS = ("Fix", "did you mean", "e.g.", "such as", "valid keys")
KEY_RE = re.compile(r"\b(aidaptiv|zero_optimization)(\.[A-Za-z_]\w*|\[[^\]]+\])*")

# ------------------------------------------------------------------------------------------ strategies
WEIRD_STRINGS = st.sampled_from([
    "", " ", "auto", "AUTO", "8GiB", " 8 GiB ", "-1", "1e400", "1e400GiB", "9" * 400, "nan", "inf", "NaN GiB",
    "\uff18GiB", "\x00", "\ud800", "1.5.3MB", "12XB", "0x10", "1_000", "\U0001f642", "/", "..", "a/b", "local_rank",
    "striped", "affinity", "nvme", "NVMe", "cpu", "none", "true", "false", "0", "1", "yes", "off"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10), WEIRD_STRINGS)
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                       max_leaves=6)

#: plausible values per field (the fuzz mixes them with garbage so that several fields are valid at once)
PLAUSIBLE = {
    "enabled": st.sampled_from([True, False, 1, 0, "false", "true"]),
    "dram_budget": st.sampled_from(["auto", "1GiB", 0, 1 << 30, "48GiB", 1e9]),
    "run_name": st.sampled_from(["auto", "run1", "a.b-c_d"]),
    "placement": st.sampled_from(["striped", "affinity"]),
    "path_weights": st.lists(st.floats(min_value=0.1, max_value=10), min_size=1, max_size=2),
    "primary_path": st.sampled_from(["local_rank", 0, 1, -1]),
    "stripe_unit": st.sampled_from([4096, "1MiB", "2MiB", 1 << 20]),
    "prefetch_bytes": st.sampled_from(["auto", "64MiB", 0]),
    "writeback_bytes": st.sampled_from(["auto", "512MiB"]),
    "min_swap_bytes": st.sampled_from([0, "1MiB"]),
    "checksum": st.booleans(), "keep_files": st.booleans(), "from_unpacked": st.booleans(),
    "endurance.capacity": st.sampled_from([None, "8TB", 10 ** 12]),
    "endurance.rated_dwpd": st.sampled_from([1, 100, 0.3]),
    "endurance.warranty_years": st.sampled_from([5, 3.0]),
    "io.block_size": st.sampled_from(["8MiB", 1 << 20, 4096]),
    "io.threads_per_drive": st.sampled_from([1, 4, 64]),
    "io.direct": st.booleans(),
    "io.max_retries": st.sampled_from([0, 3, 20]),
}


def _value(name: str) -> st.SearchStrategy:
    good = PLAUSIBLE.get(name)
    return st.one_of(good, GARBAGE) if good is not None else GARBAGE


def _object(model, prefix: str) -> st.SearchStrategy:
    """Dicts with any subset of ``model``'s fields (plausible or garbage values) plus unknown keys."""
    fields = {n: _value(prefix + n) for n in model.model_fields}
    return st.builds(lambda known, extra: {**extra, **known},
                     st.fixed_dictionaries({}, optional=fields),
                     st.dictionaries(st.text(min_size=1, max_size=10), GARBAGE, max_size=2))


@st.composite
def sections(draw, cache: str):
    """A random ``"aidaptiv"`` section: every field of :class:`AidaptivConfig` (also ones added later)
    may appear, plausible or garbage, with nested garbage and unknown keys."""
    sec = draw(_object(AidaptivConfig, ""))
    paths = st.one_of(GARBAGE, st.just([cache]), st.just(cache),
                      st.lists(st.one_of(st.just(cache), st.text(max_size=8), GARBAGE), max_size=3))
    if draw(st.booleans()):
        sec["cache_paths"] = draw(paths)
    if draw(st.booleans()):
        sec["endurance"] = draw(st.one_of(GARBAGE, _object(EnduranceConfig, "endurance.")))
    if draw(st.booleans()):
        sec["io"] = draw(st.one_of(GARBAGE, _object(IOConfig, "io.")))
    return sec


def good_ds(cache: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                              "offload_param": {"device": "nvme", "nvme_path": cache, "max_in_cpu": 0},
                              "offload_optimizer": {"device": "nvme", "nvme_path": cache}},
        "aidaptiv": {"enabled": True, "cache_paths": [cache], "dram_budget": "1GiB"},
    }


DEVICES = st.one_of(st.sampled_from(["nvme", "NVMe", "cpu", "none", "", "gpu"]), GARBAGE)
NUMBERS = st.one_of(st.sampled_from([0, 1, 0.5, 1.0, 1e9, 2.5, -1, float("nan"), float("inf"), True]), GARBAGE)


@st.composite
def ds_configs(draw, cache: str):
    """A DeepSpeed config with the aidaptiv-relevant ZeRO keys malformed (or left good) at random."""
    ds = good_ds(cache)
    zero = ds["zero_optimization"]
    for key, strat in (("stage", st.one_of(st.sampled_from([0, 1, 2, 3, "3", 3.0, 4]), GARBAGE)),
                       ("sub_group_size", NUMBERS)):
        if draw(st.booleans()):
            zero[key] = draw(strat)
    for which, keys in (("offload_param", ("device", "nvme_path", "max_in_cpu")),
                        ("offload_optimizer", ("device", "nvme_path", "ratio"))):
        choice = draw(st.sampled_from(["keep", "mutate", "drop", "garbage"]))
        if choice == "drop":
            del zero[which]
        elif choice == "garbage":
            zero[which] = draw(GARBAGE)
        elif choice == "mutate":
            for k in keys:
                move = draw(st.sampled_from(["keep", "drop", "set"]))
                if move == "drop":
                    zero[which].pop(k, None)
                elif move == "set":
                    zero[which][k] = draw({"device": DEVICES, "nvme_path": st.one_of(
                        st.just(cache), st.just([cache]), st.integers(), st.just(""), GARBAGE)}.get(k, NUMBERS))
    zchoice = draw(st.sampled_from(["keep", "keep", "keep", "garbage", "drop"]))
    if zchoice == "garbage":
        ds["zero_optimization"] = draw(GARBAGE)
    elif zchoice == "drop":
        del ds["zero_optimization"]
    achoice = draw(st.sampled_from(["keep", "no_paths", "random"]))
    if achoice == "no_paths":  # the cache path then comes from offload_param.nvme_path
        del ds["aidaptiv"]["cache_paths"]
    elif achoice == "random":
        ds["aidaptiv"] = draw(sections(cache))
    return ds


# ------------------------------------------------------------------------------------------ checks
def problems(msg: str) -> list[str]:
    """The individual problems of one error message (the header lines list several)."""
    if msg.startswith('invalid "aidaptiv" section:'):
        return [ln.strip() for ln in msg.split("\n")[1:]]
    if msg.startswith('DeepSpeed config cannot run with "aidaptiv" enabled:'):
        return [p.strip() for p in msg.split("\n  - ")[1:]]
    return [msg]


def assert_clear(msg: str) -> None:
    items = problems(msg)
    assert items, msg
    for item in items:
        assert KEY_RE.search(item), f"problem names no aidaptiv or DeepSpeed key: {item!r}"
        assert any(m in item for m in FIX_MARKERS), f"problem gives no fix or suggestion: {item!r}"


def parse_or_refuse(section) -> AidaptivConfig | None:
    try:
        return parse_section(section)
    except AidaptivConfigError as e:
        assert_clear(str(e))
        return None


def validate_or_refuse(ds: dict) -> tuple[AidaptivConfig | None, str]:
    try:
        return validate(copy.deepcopy(ds)), ""
    except AidaptivConfigError as e:
        assert_clear(str(e))
        return None, str(e)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fuzz_cache"))


# ------------------------------------------------------------------------------------------ tests
@settings(max_examples=400, **SETTINGS)
@given(data=st.data())
def test_random_sections_parse_or_are_refused_clearly(cache, data):
    section = data.draw(st.one_of(sections(cache), GARBAGE), label="section")
    cfg = parse_or_refuse(section)
    if cfg is not None:
        # a section that parses as disabled must be disabled for the hooks too (DeepSpeed's own swappers)
        assert section_enabled({"aidaptiv": section}) == cfg.enabled, section
        assert isinstance(cfg.stripe_unit, int) and cfg.stripe_unit % 4096 == 0
        for w in cfg.path_weights or []:
            assert math.isfinite(w) and w > 0


@settings(max_examples=400, **SETTINGS)
@given(data=st.data())
def test_malformed_deepspeed_combinations_are_refused_clearly(cache, data):
    ds = data.draw(ds_configs(cache), label="ds_config")
    cfg, msg = validate_or_refuse(ds)
    if cfg is not None:
        # what we accept, DeepSpeed's own ZeRO config model accepts too (its error would come later)
        DeepSpeedZeroConfig(**ds["zero_optimization"])
        assert cfg.cache_paths and all(isinstance(p, str) for p in cfg.cache_paths)


@pytest.mark.parametrize("section, key", [
    ({"dram_budget": float("inf")}, "aidaptiv.dram_budget"),
    ({"dram_budget": "1e400GiB"}, "aidaptiv.dram_budget"),
    ({"stripe_unit": "9" * 400}, "aidaptiv.stripe_unit"),
    ({"endurance": {"capacity": float("inf")}}, "aidaptiv.endurance.capacity"),
    ({"primary_path": 1.5}, "aidaptiv.primary_path"),
    ({"path_weights": [float("nan")]}, "aidaptiv.path_weights"),
    ({"path_weights": [1e308, 1e308]}, "aidaptiv.path_weights"),
    ({"path_weights": "1,2"}, "aidaptiv.path_weights"),
    ({"io": {"threads_per_drive": "four"}}, "aidaptiv.io.threads_per_drive"),
    ({"run_name": 7}, "aidaptiv.run_name"),
    ({"endurance": []}, "aidaptiv.endurance"),
    ({"cache_paths": "\n"}, "aidaptiv.cache_paths"),  # the example list once spelled the newline out raw
])
def test_examples_found_by_the_fuzz(section, key):
    """Inputs that once crashed or read badly, kept as fixed regression cases."""
    with pytest.raises(AidaptivConfigError) as e:
        parse_section(section)
    assert_clear(str(e.value))
    assert key in str(e.value)


@pytest.mark.parametrize("edit, key", [
    (lambda z: z.__setitem__("offload_param", "nvme"), "zero_optimization.offload_param"),
    (lambda z: z["offload_optimizer"].__setitem__("ratio", "half"), "zero_optimization.offload_optimizer.ratio"),
    (lambda z: z["offload_optimizer"].__setitem__("ratio", None), "zero_optimization.offload_optimizer.ratio"),
    (lambda z: z["offload_param"].__setitem__("nvme_path", ["/a", "/b"]), "zero_optimization.offload_param.nvme_path"),
    (lambda z: z["offload_param"].__setitem__("nvme_path", 5), "zero_optimization.offload_param.nvme_path"),
    (lambda z: z["offload_param"].__setitem__("max_in_cpu", False), "zero_optimization.offload_param.max_in_cpu"),
    (lambda z: z.__setitem__("sub_group_size", 1.5), "zero_optimization.sub_group_size"),
    (lambda z: z.__setitem__("sub_group_size", "1e9"), "zero_optimization.sub_group_size"),
    (lambda z: z.__setitem__("sub_group_size", 2.0 ** 63), "zero_optimization.sub_group_size"),  # found by the fuzz
    # keys DeepSpeed's own ZeRO config model refuses (extra="forbid"): refused by us before any data is touched
    (lambda z: z.__setitem__("offload_param", {"": None}), "zero_optimization.offload_param."),  # found by the fuzz
    (lambda z: z["offload_optimizer"].__setitem__("pin_memroy", True), "did you mean 'pin_memory'"),
    (lambda z: z.__setitem__("stage3_prefetch_bucket_size", "big"), "zero_optimization.stage3_prefetch_bucket_size"),
])
def test_deepspeed_examples_found_by_the_fuzz(cache, edit, key):
    ds = good_ds(cache)
    del ds["aidaptiv"]["cache_paths"]
    edit(ds["zero_optimization"])
    with pytest.raises(AidaptivConfigError) as e:
        validate(ds)
    assert_clear(str(e.value))
    assert key in str(e.value)


def test_weights_without_cache_paths_are_checked_against_nvme_path(cache):
    """``path_weights`` for two paths while the one cache path comes from ``nvme_path``."""
    ds = good_ds(cache)
    ds["aidaptiv"] = {"path_weights": [1.0, 2.0], "primary_path": 3}
    with pytest.raises(AidaptivConfigError) as e:
        validate(ds)
    assert_clear(str(e.value))
    assert "aidaptiv.path_weights" in str(e.value)


@pytest.mark.parametrize("flag", [False, 0, "false", "False", "off", "no", "0"])
def test_enabled_false_spelled_any_way_disables_the_section(flag):
    ds = {"aidaptiv": {"enabled": flag}}
    assert parse_section(ds["aidaptiv"]).enabled is False
    assert section_enabled(ds) is False


@settings(max_examples=12, **SETTINGS)
@given(data=st.data())
def test_deepspeed_refuses_malformed_configs_in_process(cache, data):
    """``deepspeed.zero.Init`` and ``deepspeed.initialize`` raise the same AidaptivConfigError, before
    building anything (only refused configs are tried: an accepted one would start training)."""
    ds = data.draw(ds_configs(cache), label="ds_config")
    assume(section_enabled(ds))  # a disabled section leaves DeepSpeed alone, bad config and all
    _, msg = validate_or_refuse(ds)
    assume(msg)
    with pytest.raises(AidaptivConfigError) as e1:
        deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(ds))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AidaptivConfigError) as e2:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(ds))
    assert str(e1.value) == str(e2.value) == msg
