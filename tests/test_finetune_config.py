"""DeepSpeed config resolution from the command line, and the CLI's argument handling (no engine built)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from aidaptiv_ds.finetune.ds_config import find_auto, load_ds_config, model_dtype, resolve, uses_nvme

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "ds_configs")


def _cfg(**extra):
    base = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    base.update(extra)
    return base


def test_auto_values_take_hf_defaults_and_leave_the_input_untouched():
    raw = _cfg()
    cfg = resolve(raw, world_size=2, total_steps=10)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (8, 1, 16)
    assert cfg["optimizer"]["params"]["lr"] == 5e-5
    assert cfg["bf16"]["enabled"] is False            # CPU accelerator: no bf16
    assert find_auto(cfg) == []
    assert raw["train_batch_size"] == "auto" and raw["bf16"]["enabled"] == "auto"


def test_flags_override_config_numbers_and_batch_size_follows():
    raw = _cfg(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, train_batch_size=8)
    raw["optimizer"]["params"]["lr"] = 1e-4
    kept = resolve(raw, world_size=1, total_steps=1)
    assert (kept["train_micro_batch_size_per_gpu"], kept["gradient_accumulation_steps"]) == (4, 2)
    assert kept["optimizer"]["params"]["lr"] == 1e-4
    cfg = resolve(raw, world_size=3, micro_batch=2, grad_accum=5, learning_rate=3e-4, bf16="true", total_steps=1)
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (2, 5, 30)
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    assert cfg["bf16"]["enabled"] is True and model_dtype(cfg) == torch.bfloat16
    assert model_dtype(resolve(raw, world_size=1, bf16="false")) == torch.float32
    assert model_dtype({"fp16": {"enabled": True}}) == torch.float16


def test_scheduler_auto_values_are_filled_from_the_run():
    raw = _cfg(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto",
                                                               "warmup_min_lr": "auto", "warmup_num_steps": "auto"}})
    assert find_auto(resolve(raw, world_size=1)) == ["scheduler.params.total_num_steps"]   # not known yet: kept
    cfg = resolve(raw, world_size=1, learning_rate=2e-4, total_steps=123)
    assert cfg["scheduler"]["params"] == {"total_num_steps": 123, "warmup_max_lr": 2e-4, "warmup_min_lr": 0.0,
                                          "warmup_num_steps": 0}


def test_leftover_auto_and_bad_values_raise_naming_the_key_or_flag():
    with pytest.raises(ValueError, match="zero_optimization.stage3_prefetch_bucket_size"):
        resolve(_cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": "auto"}), world_size=1, total_steps=1)
    with pytest.raises(ValueError, match="--per_device_train_batch_size 0"):
        resolve(_cfg(), world_size=1, micro_batch=0)
    with pytest.raises(ValueError, match="--learning_rate"):
        resolve(_cfg(), world_size=1, learning_rate=-1.0)
    with pytest.raises(ValueError, match="both bf16 and fp16"):
        resolve(_cfg(fp16={"enabled": True}), world_size=1, bf16="true")
    no_opt = _cfg()
    del no_opt["optimizer"]
    with pytest.raises(ValueError, match="no 'optimizer' section"):
        resolve(no_opt, world_size=1, learning_rate=1e-3)


def test_cache_path_sets_nvme_paths_and_aidaptiv_cache_paths(tmp_path):
    a, b = tmp_path / "c0", tmp_path / "c1"
    a.mkdir()
    b.mkdir()
    raw = _cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/placeholder"},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/placeholder"}},
               aidaptiv={"enabled": True, "cache_paths": ["/placeholder"]})
    assert uses_nvme(raw)
    cfg = resolve(raw, world_size=1, cache_paths=[str(a), str(b)])
    z = cfg["zero_optimization"]
    assert z["offload_param"]["nvme_path"] == z["offload_optimizer"]["nvme_path"] == str(a)
    assert cfg["aidaptiv"]["cache_paths"] == [str(a), str(b)]
    missing = tmp_path / "new" / "cache"
    cfg = resolve(raw, world_size=1, cache_paths=[str(missing)])
    assert missing.is_dir()  # a missing cache directory is created (mkdir -p)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"offload_param.nvme_path = .* cannot be created"):
        resolve(raw, world_size=1, cache_paths=[str(blocker / "sub")])
    with pytest.raises(ValueError, match="--cache_path .* no cache path to set"):
        resolve(_cfg(), world_size=1, cache_paths=[str(a)])


def test_config_file_errors_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--deepspeed"):
        load_ds_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ValueError, match="line 2"):
        load_ds_config(bad)


@pytest.mark.parametrize("name", ["cpu_offload.json", "native_nvme.json"])
def test_shipped_configs_resolve_with_no_auto_left(tmp_path, name):
    raw = load_ds_config(os.path.join(CONFIGS, name))
    cache = [str(tmp_path)] if uses_nvme(raw) else None
    cfg = resolve(raw, world_size=1, cache_paths=cache, total_steps=5)
    assert find_auto(cfg) == [] and cfg["zero_optimization"]["stage"] == 3
    assert cfg["optimizer"]["params"]["torch_adam"] is True          # no cpu_adam compile
    devices = {cfg["zero_optimization"][s]["device"] for s in ("offload_param", "offload_optimizer")}
    assert devices == ({"nvme"} if name == "native_nvme.json" else {"cpu"})


def _cli():
    spec = importlib.util.spec_from_file_location("finetune_cli", os.path.join(REPO, "launch", "finetune.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_accepts_hf_flags_and_the_launchers_local_rank():
    from aidaptiv_ds.finetune.job import FinetuneArgs, parse_args

    args = parse_args(["--local_rank=0", "--model_name_or_path", "m", "--data_path", "d.jsonl", "--max_steps", "3",
                       "--cache_path", "/a", "--cache_path", "/b", "--save_steps", "3", "--save_total_limit", "2",
                       "--resume_from_checkpoint", "latest"])
    assert isinstance(args, FinetuneArgs)
    assert args.max_steps == 3 and args.cache_path == ["/a", "/b"] and args.local_rank == 0
    assert (args.save_steps, args.save_total_limit, args.resume_from_checkpoint) == (3, 2, "latest")
    assert args.deepspeed.endswith(os.path.join("ds_configs", "aidaptiv_zero3.json")) and os.path.isfile(args.deepspeed)
    assert parse_args(["--cache_path", "/a", "/b"]).cache_path == ["/a", "/b"]    # HfArgumentParser's list form too
    with pytest.raises(SystemExit):
        parse_args(["--bf16", "maybe"])


def test_flags_are_defined_once_on_the_dataclass():
    """launch/finetune.py has no argparse of its own: every flag and default comes from FinetuneArgs."""
    import dataclasses

    from aidaptiv_ds.finetune.job import FinetuneArgs, parse_args

    with open(os.path.join(REPO, "launch", "finetune.py"), encoding="utf-8") as f:
        src = f.read()
    assert "add_argument" not in src and "argparse" not in src
    assert _cli().main is not None
    defaults = parse_args([])
    for f in dataclasses.fields(FinetuneArgs):
        assert getattr(defaults, f.name) == f.default, f.name     # HF's defaults: save_steps 500, 3 epochs, ...
    assert (defaults.save_strategy, defaults.save_steps, defaults.num_train_epochs) == ("steps", 500, 3.0)


def test_model_and_data_flags_go_together_or_not_at_all(tmp_path):
    from aidaptiv_ds.finetune.job import FinetuneArgs, _inputs

    with pytest.raises(ValueError, match="--model_name_or_path is given but --data_path is not"):
        _inputs(FinetuneArgs(str(tmp_path), "x.json", model_name_or_path="m"))
    with pytest.raises(ValueError, match="--demo runs the embedded model and data; drop --data_path"):
        _inputs(FinetuneArgs(str(tmp_path), "x.json", data_path="d", demo=True))
    assert _inputs(FinetuneArgs(str(tmp_path), "x.json", model_name_or_path="m", data_path="d")) == ("m", "d", False)


def test_model_source_classification(tmp_path):
    from aidaptiv_ds.finetune.model_io import resolve_source

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({}))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    assert resolve_source(str(tmp_path / "hf")).kind == "local"
    g = resolve_source(str(tmp_path / "m.gguf"))
    assert (g.kind, g.path, g.gguf_file) == ("gguf", str(tmp_path), "m.gguf")
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_source(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_source(str(tmp_path / "x.gguf"))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_source(str(tmp_path / "missing"))


@pytest.mark.parametrize("name", ["aidaptiv_zero3.json", "aidaptiv_zero3_multi.json", "aidaptiv_inference.json"])
def test_shipped_aidaptiv_sections_hold_no_auto_for_accelerate(name):
    """HF Trainer's accelerate refuses every ``"auto"`` it does not fill itself (``DeepSpeedPlugin.fill_match``:
    "`aidaptiv.dram_budget` not found in kwargs"), our section's too: the shipped configs leave such keys out
    (each ``"auto"`` is its default), so they run under Trainer unchanged (found by a new-user trial)."""
    with open(os.path.join(REPO, "ds_configs", name)) as f:
        section = json.load(f)["aidaptiv"]

    def autos(d, prefix="aidaptiv"):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from autos(v, f"{prefix}.{k}")
            elif v == "auto":
                yield f"{prefix}.{k}"
    assert not list(autos(section)), name
