"""bench-io: the library's result (keys, table, ratios), the CLI subcommand, DeepSpeed-aio status without a build."""
from __future__ import annotations

import argparse
import json
import os

import pytest

from aidaptiv_ds.cli import bench_io as cli
from aidaptiv_ds.bench import bench_io as bench
from aidaptiv_ds.io.errors import StorageFullError
from aidaptiv_ds.store.layout import CachePathError

MiB = 1 << 20


def _parser():
    p = argparse.ArgumentParser(prog="aidaptiv-ds")
    sub = p.add_subparsers(dest="command")
    cli.register(sub)
    return p


@pytest.mark.subprocess
def test_bench_io_result_has_the_keys_and_a_table(tmp_path):
    lines = []
    r = bench.bench_io(str(tmp_path), 24 * MiB, blocks=[MiB, 4 * MiB], threads=2, repeats=1,
                       deepspeed_aio="off", progress=lines.append)
    for k in ("engine_read_gbps", "engine_write_gbps", "raw_read_gbps", "raw_write_gbps", "read_ratio", "write_ratio"):
        assert isinstance(r[k], float) and r[k] > 0, k
    assert r["headline_block_bytes"] == 4 * MiB and r["file_bytes"] == 24 * MiB
    assert [row["block_bytes"] for row in r["table"]] == [MiB, 4 * MiB]
    head = r["table"][-1]
    assert r["engine_read_gbps"] == head["engine_read_gbps"]
    assert r["raw_write_gbps"] == max(head["raw_single_write_gbps"], head["raw_parallel_write_gbps"])
    assert r["read_ratio"] == pytest.approx(r["engine_read_gbps"] / r["raw_read_gbps"])
    assert set(r["ratios"]) == {"1.00 MiB", "4.00 MiB"}
    assert r["meets_target"] == (r["read_ratio"] >= 0.9 and r["write_ratio"] >= 0.9)
    assert r["engine_direct_io"] is True and r["deepspeed_aio"].startswith("not built")
    assert len(lines) == 1 + 2 * 2 * 3                       # fill + 2 sizes x 2 directions x 3 sides
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".aidaptiv_bench_io")]   # cleaned up
    json.dumps(r)
    table = bench.format_table(r)
    assert "| 4.00 MiB |" in table and "target engine >= 0.9" in table


@pytest.mark.subprocess
def test_cli_json(tmp_path, capsys):
    args = _parser().parse_args(["bench-io", "--path", str(tmp_path), "--size", "8MiB", "--block", "1MiB",
                                 "--block", "4MiB", "--threads", "1", "--repeats", "1", "--no-deepspeed-aio", "--json"])
    assert args.func is cli.run and args.size == 8 * MiB and args.block == [MiB, 4 * MiB]
    assert cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"engine_read_gbps", "engine_write_gbps", "raw_read_gbps", "raw_write_gbps", "table", "ratios"} <= set(out)
    assert out["threads"] == 1 and out["queue_depth"] == 2
    assert out["table"][0]["raw_parallel_read_gbps"] is None            # one thread: no parallel dd


@pytest.mark.subprocess
def test_plugs_into_the_aidaptiv_ds_parser(tmp_path, capsys):
    """cli/main.py's build_parser takes our module as it takes the other subcommands."""
    from aidaptiv_ds.cli.main import build_parser

    p = build_parser(["aidaptiv_ds.cli.bench_io"])
    args = p.parse_args(["bench-io", "--path", str(tmp_path), "--size", "4MiB", "--block", "1MiB", "--block",
                         "4MiB", "--threads", "2", "--repeats", "1", "--no-deepspeed-aio"])
    assert args.command == "bench-io" and args.func(args) == 0
    out = capsys.readouterr().out
    assert "| 1.00 MiB |" in out and "| 4.00 MiB |" in out and "target engine >= 0.9 x raw at 4.00 MiB" in out


def test_cli_errors(tmp_path, capsys):
    p = _parser()
    with pytest.raises(SystemExit):
        p.parse_args(["bench-io", "--path", str(tmp_path), "--size", "lots"])
    args = p.parse_args(["bench-io", "--path", str(tmp_path / "missing"), "--size", "8MiB"])
    assert cli.run(args) == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError):
        cli.run(p.parse_args(["bench-io", "--path", str(tmp_path), "--size", "8MiB", "--threads", "0"]))
    with pytest.raises(StorageFullError, match=str(tmp_path)):
        bench.bench_io(str(tmp_path), 1 << 60, deepspeed_aio="off")
    with pytest.raises(ValueError, match="smaller than"):
        bench.bench_io(str(tmp_path), MiB, blocks=[8 * MiB], deepspeed_aio="off")
    with pytest.raises(ValueError, match="multiples of 4096"):
        bench.bench_io(str(tmp_path), 8 * MiB, blocks=[1000], deepspeed_aio="off")
    with pytest.raises(CachePathError):
        bench.bench_io(str(tmp_path / "nope"), 8 * MiB)


def test_deepspeed_aio_is_not_built_without_permission(monkeypatch):
    """Without --with-deepspeed-aio nothing is compiled: the status names the reason instead."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def no_build(self, *a, **k):
        raise AssertionError(f"bench-io started a JIT build of {self.name}")

    monkeypatch.setattr(OpBuilder, "jit_load", no_build)
    monkeypatch.delitem(OpBuilder._loaded_ops, "async_io", raising=False)
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setitem(installed_ops, "async_io", False)
    module, status = bench.load_deepspeed_aio("auto")
    assert module is None and status.startswith("not built: ") and "--with-deepspeed-aio" in status
    assert bench.load_deepspeed_aio("off") == (None, "not built: not requested (--no-deepspeed-aio)")
    # our own registered handle is never measured as "DeepSpeed's": it is stepped aside while DeepSpeed's
    # op loads, and put back afterwards
    from aidaptiv_ds.integration.aio_handle import make_op_module
    ours = make_op_module()
    monkeypatch.setitem(OpBuilder._loaded_ops, "async_io", ours)
    module, status = bench.load_deepspeed_aio("auto")
    assert (module, status[:11]) == (None, "not built: ") and OpBuilder._loaded_ops["async_io"] is ours
    compiled = object()  # stands for DeepSpeed's compiled op
    seen = []
    monkeypatch.setitem(installed_ops, "async_io", True)
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    monkeypatch.setattr(AsyncIOBuilder, "load", lambda self, verbose=False: seen.append(
        OpBuilder._loaded_ops.get("async_io")) or compiled)
    assert bench.load_deepspeed_aio("auto") == (compiled, "built")
    assert seen == [None] and OpBuilder._loaded_ops["async_io"] is ours  # aside while loading, then back
    monkeypatch.setitem(OpBuilder._loaded_ops, "async_io", compiled)
    assert bench.load_deepspeed_aio("auto") == (compiled, "loaded")


def test_parse_fio_json():
    text = 'fio-3.33\n{"jobs": [{"jobname": "raw", "read": {"bw_bytes": 2500000000}, "write": {"bw_bytes": 0}}]}'
    assert bench.parse_fio_json(text, "read") == 2.5


def test_filesystem_of(tmp_path):
    fs = bench.filesystem_of(str(tmp_path))
    assert fs["fstype"] != "unknown" and str(tmp_path).startswith(fs["mount"])
