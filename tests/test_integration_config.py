"""The ``"aidaptiv"`` section: every bad input is refused at ``deepspeed.initialize`` / ``zero.Init``
time with a message naming the key, the value and the fix; nothing is built or written first."""
from __future__ import annotations

import copy
import os
import stat

import pytest
import torch

import aidaptiv_ds  # noqa: F401 - installs the hooks
import deepspeed
from aidaptiv_ds.integration.config import AidaptivConfigError, parse_section, validate


def good(tmp_path, **aid) -> dict:
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "nvme", "nvme_path": str(cache), "max_in_cpu": 0},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(cache)}},
        "aidaptiv": {"enabled": True, "cache_paths": [str(cache)], "dram_budget": "1GiB"},
    }
    cfg["aidaptiv"].update(aid)
    return cfg


def refused(cfg) -> str:
    """The message ``deepspeed.initialize`` and ``deepspeed.zero.Init`` raise for ``cfg`` (both must)."""
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AidaptivConfigError) as e1:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with pytest.raises(AidaptivConfigError) as e2:
        deepspeed.zero.Init(config_dict_or_path=cfg)
    assert str(e1.value) == str(e2.value)
    return str(e1.value)


def test_valid_section_parses(tmp_path):
    cfg = validate(good(tmp_path, placement="affinity", stripe_unit="2MiB", endurance={"rated_dwpd": 100,
                                                                                       "capacity": "8TB"}))
    assert cfg.dram_budget == 1 << 30 and cfg.stripe_unit == 2 << 20 and cfg.endurance.capacity == 8 * 10 ** 12


def test_cache_paths_default_to_nvme_path(tmp_path):
    cfg = good(tmp_path)
    del cfg["aidaptiv"]["cache_paths"]
    assert validate(cfg).cache_paths == [cfg["zero_optimization"]["offload_param"]["nvme_path"]]


def test_unknown_key_names_the_closest_valid_one(tmp_path):
    msg = refused(good(tmp_path, dram_budgt="4GiB"))
    assert "aidaptiv.dram_budgt: unknown key; did you mean 'dram_budget'?" in msg


def test_unknown_nested_key(tmp_path):
    msg = refused(good(tmp_path, endurance={"rated_dpwd": 3}))
    assert "aidaptiv.endurance.rated_dpwd: unknown key; did you mean 'rated_dwpd'?" in msg


@pytest.mark.parametrize("value", ["eight gigs", -5, "12XB", True])
def test_bad_size_names_key_value_and_forms(tmp_path, value):
    msg = refused(good(tmp_path, dram_budget=value))
    assert "aidaptiv.dram_budget" in msg and repr(value) in msg and "8GiB" in msg


def test_missing_path_is_created_as_deepspeed_creates_nvme_path(tmp_path, caplog):
    """DeepSpeed creates a missing ``nvme_path``; so does the section, with one warning naming it (shown by
    default: a mistyped path is created too) and, on the root filesystem, saying so with the fix."""
    import logging
    import os
    cfg = good(tmp_path, cache_paths=[str(tmp_path / "new" / "cache")])
    with caplog.at_level(logging.WARNING, logger="aidaptiv_ds"):
        validate(cfg)
    assert (tmp_path / "new" / "cache").is_dir()
    (msg,) = [r.getMessage() for r in caplog.records if "created the missing cache directory" in r.getMessage()]
    on_root = os.stat(tmp_path).st_dev == os.stat("/").st_dev
    assert ("on the root filesystem /" in msg and "fix aidaptiv.cache_paths" in msg) == on_root, msg  # one line


def test_missing_path_that_cannot_be_created(tmp_path):
    (tmp_path / "a_file").write_text("x")
    msg = refused(good(tmp_path, cache_paths=[str(tmp_path / "a_file" / "cache")]))
    assert "aidaptiv.cache_paths" in msg and "cannot be created" in msg and "mkdir -p" in msg
    # where it would be: a new-user trial's path under /proc was offered "mkdir -p" alone
    msg = refused(good(tmp_path, cache_paths=["/proc/aidaptiv_no_such_dir"]))
    assert "it would be on proc mounted at /proc" in msg, msg


def test_unwritable_path(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    real_access = os.access
    # root ignores permission bits; answer as the kernel would for an unprivileged user
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(ro) and m & os.W_OK else real_access(p, m))
    msg = refused(good(tmp_path, cache_paths=[str(ro)]))
    assert "not writable" in msg and str(ro) in msg


def test_cache_paths_must_be_a_list(tmp_path):
    msg = refused(good(tmp_path, cache_paths=str(tmp_path)))
    assert "aidaptiv.cache_paths" in msg and "give a list" in msg


def test_stage_not_3(tmp_path):
    cfg = good(tmp_path)
    cfg["zero_optimization"]["stage"] = 2
    msg = refused(cfg)
    assert "zero_optimization.stage is 2" in msg and '"stage": 3' in msg


def test_optimizer_offload_not_nvme(tmp_path):
    cfg = good(tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    msg = refused(cfg)
    assert "zero_optimization.offload_optimizer.device is 'cpu'" in msg and '"device": "nvme"' in msg


def test_max_in_cpu_left_at_default_is_accepted(tmp_path):
    """``max_in_cpu`` (default 1e9) bounds the parameter share of the DRAM budget ([Note: max_in_cpu])."""
    cfg = good(tmp_path)
    del cfg["zero_optimization"]["offload_param"]["max_in_cpu"]
    validate(cfg)


@pytest.mark.parametrize("device", ["cpu", "none"])
def test_optimizer_on_nvme_with_parameters_elsewhere_is_accepted(tmp_path, device):
    """ZeRO-Infinity's "optimizer on NVMe" setup: parameters in DRAM (or on the accelerator), the optimizer
    state through aidaptiv_ds; cache_paths default to offload_optimizer.nvme_path."""
    cfg = good(tmp_path)
    cfg["zero_optimization"]["offload_param"] = {"device": device}
    del cfg["aidaptiv"]["cache_paths"]
    assert validate(cfg).cache_paths == [cfg["zero_optimization"]["offload_optimizer"]["nvme_path"]]


def test_enum_values_are_shown_plainly(tmp_path):
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    cfg = good(tmp_path)
    cfg["zero_optimization"]["offload_optimizer"]["device"] = OffloadDeviceEnum.cpu
    with pytest.raises(AidaptivConfigError) as e:
        validate(cfg)
    assert "offload_optimizer.device is 'cpu'" in str(e.value) and "OffloadDeviceEnum" not in str(e.value)


def test_every_problem_reported_at_once(tmp_path):
    cfg = good(tmp_path)
    cfg["zero_optimization"]["stage"] = 1
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    msg = refused(cfg)
    assert "stage is 1" in msg and "offload_optimizer.device" in msg


def test_weights_must_match_paths(tmp_path):
    with pytest.raises(AidaptivConfigError, match="2 weights for 1 cache_paths"):
        parse_section({"cache_paths": [str(tmp_path)], "path_weights": [1.0, 2.0]})


def test_disabled_section_is_not_validated(tmp_path):
    cfg = good(tmp_path, enabled=False, dram_budgt="x")  # would be refused if enabled
    cfg["zero_optimization"]["stage"] = 2
    from aidaptiv_ds.integration.config import section_enabled
    from aidaptiv_ds.integration.hooks import _validate_if_enabled
    assert not section_enabled(cfg)
    _validate_if_enabled(copy.deepcopy(cfg))  # what initialize/zero.Init run first: no AidaptivConfigError


def test_unsupported_deepspeed_version_is_a_clear_error(tmp_path, monkeypatch):
    from aidaptiv_ds.integration import hooks as inst
    monkeypatch.setattr(inst, "SUPPORTED_DEEPSPEED", ("9.9.9",))
    with pytest.raises(inst.UnsupportedDeepSpeedError, match="supports DeepSpeed 9.9.9; this environment has 0.19.8"):
        deepspeed.zero.Init(config_dict_or_path=good(tmp_path))


def test_an_nvme_path_outside_the_cache_paths_is_named(tmp_path, caplog, monkeypatch):
    """``offload_*.nvme_path`` not among ``aidaptiv.cache_paths``: the state goes to the cache paths, so a warning
    names the unused directory and the fix (found by a new-user trial: it was accepted silently)."""
    import logging
    cfg = good(tmp_path)
    monkeypatch.delenv("RANK", raising=False)  # rank 0 (the one that says it)
    other = str(tmp_path / "elsewhere")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = other
    with caplog.at_level(logging.WARNING, logger="aidaptiv_ds"):
        validate(cfg)
    (msg,) = [r.getMessage() for r in caplog.records if "is not among aidaptiv.cache_paths" in r.getMessage()]
    assert "offload_optimizer.nvme_path" in msg and other in msg and "Fix:" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aidaptiv_ds"):
        validate(good(tmp_path))  # nvme_path among the cache paths: nothing to say
    assert not [r for r in caplog.records if "is not among" in r.getMessage()]
