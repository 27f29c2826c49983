"""Paths a user trips on: ``aidaptiv-ds gc`` on an empty or missing path, a cache path the kernel refuses
although its mode bits allow it (/sys), and ``--cache_path`` creating a directory (say where, warn when
it is on the root or output filesystem)."""
from __future__ import annotations

import os

import pytest

from aidaptiv_ds.cli.main import main
from aidaptiv_ds.finetune.ds_config import describe_created_dir, load_ds_config, resolve
from aidaptiv_ds.store.layout import CachePathError, Namespace, check_cache_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gc_says_when_it_finds_no_store(tmp_path, capsys):
    assert main(["gc", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"no aidaptiv_ds store on {tmp_path}" in out and "does not exist" in out
    (tmp_path / "aidaptiv_ds" / "vm").mkdir(parents=True)
    (tmp_path / "aidaptiv_ds" / "vm" / "ledger.json").write_text("{}")
    assert main(["gc", "--cache", str(tmp_path), "--delete"]) == 0
    assert "no store directories under" in capsys.readouterr().out
    assert (tmp_path / "aidaptiv_ds" / "vm" / "ledger.json").exists()


def test_gc_names_a_missing_path_and_deletes_nothing(tmp_path, capsys):
    assert main(["gc", "--cache", str(tmp_path), "--cache", str(tmp_path / "typo"), "--delete"]) == 2
    err = capsys.readouterr().err
    assert "--cache" in err and "typo" in err and "does not exist" in err


def test_a_path_that_refuses_new_files_gets_the_formatted_message():
    target = "/sys/kernel"
    if not os.path.isdir(target) or not os.access(target, os.W_OK):
        pytest.skip("needs /sys/kernel with write permission bits for this user (root)")
    with pytest.raises(CachePathError, match=r"aidaptiv.cache_paths: '/sys/kernel' does not accept new files.*Fix:"):
        Namespace([target], "r", 0)
    assert not any(n.startswith(".aidaptiv_probe_") for n in os.listdir(target))


def test_the_probe_leaves_nothing_behind(tmp_path):
    assert check_cache_path(str(tmp_path)) == str(tmp_path)
    assert os.listdir(tmp_path) == []


def test_cache_path_created_is_reported_with_its_filesystem(tmp_path):
    cfg = load_ds_config(os.path.join(REPO, "ds_configs", "aidaptiv_zero3.json"))
    created: list = []
    cache = tmp_path / "cahce"                      # a typo: lands on whatever holds tmp_path
    resolve(cfg, world_size=1, cache_paths=[str(cache)], created=created)
    assert cache.is_dir() and [d for _, d in created] == [str(cache)]
    created2: list = []
    resolve(cfg, world_size=1, cache_paths=[str(cache)], created=created2)
    assert created2 == []                           # existed the second time
    where, warning = describe_created_dir(str(cache), output_dir=str(tmp_path / "out"))
    assert str(cache) in where and "filesystem mounted at" in where
    assert warning is not None and "the output directory" in warning and "--cache_path" in warning
    if os.stat("/").st_dev == os.stat(cache).st_dev:
        assert "the root filesystem /" in warning
