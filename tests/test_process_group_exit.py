"""The exit handler destroys a gloo default process group a script left (aidaptiv_ds/process_group.py)."""
from __future__ import annotations

import atexit

import torch.distributed as dist

from aidaptiv_ds import process_group


def test_destroys_a_gloo_group_left_initialized(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert dist.is_initialized()
        process_group._destroy_gloo_default_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_nothing_to_do_without_a_group():
    assert not dist.is_initialized()
    process_group._destroy_gloo_default_group()  # no error, nothing created
    assert not dist.is_initialized()


def test_registered_once(monkeypatch):
    calls = []
    monkeypatch.setattr(process_group, "_REGISTERED", False)
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(fn))
    process_group.destroy_gloo_group_at_exit()
    process_group.destroy_gloo_group_at_exit()
    assert calls == [process_group._destroy_gloo_default_group]
