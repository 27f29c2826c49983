"""One error root: every kind aidaptiv_ds raises for a user derives from ``aidaptiv_ds.AidaptivError``,
keeps the builtin base its callers catch, is reachable as ``aidaptiv_ds.<Name>``, and real raises
from each layer are caught by ``except aidaptiv_ds.AidaptivError`` with the key, value and fix."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import aidaptiv_ds
from aidaptiv_ds.errors import LOCATIONS, AidaptivError, AidaptivWarning

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "aidaptiv_ds"

# the builtin base each kind had before the root existed (callers catch these)
BUILTIN_BASE = {
    "AidaptivConfigError": ValueError, "UnsupportedDeepSpeedError": ValueError, "CachePathError": ValueError,
    "DollyFormatError": ValueError, "StorageError": RuntimeError, "StorageIOError": OSError,
    "IncompleteCheckpointError": RuntimeError, "LedgerError": OSError, "DeepSpeedContractError": RuntimeError,
}


def _kind(name: str) -> type:
    return getattr(aidaptiv_ds, name)


@pytest.mark.parametrize("name", sorted(LOCATIONS))
def test_every_kind_is_under_the_root_and_keeps_its_builtin_base(name):
    cls = _kind(name)
    assert cls.__name__ == name and cls.__module__ == LOCATIONS[name]
    if issubclass(cls, Warning):
        assert issubclass(cls, AidaptivWarning) and issubclass(cls, UserWarning)
    else:
        assert issubclass(cls, AidaptivError)
    if name in BUILTIN_BASE:
        assert issubclass(cls, BUILTIN_BASE[name])


def _exception_classes_defined_in_the_package() -> dict[str, str]:
    """``{class name: module}`` of every class in aidaptiv_ds whose base names an Error/Exception/Warning."""
    found = {}
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.split(".")[-1].endswith(("Error", "Exception", "Warning", "OutOfSpace", "Unavailable"))
                       for b in bases):
                    found[node.name] = mod
    return found


def test_every_exception_class_of_the_package_is_registered_under_the_root():
    """A new error class anywhere in aidaptiv_ds must be listed in aidaptiv_ds.errors.LOCATIONS (and so
    pass the test above): nobody can add a kind outside the root by accident."""
    found = _exception_classes_defined_in_the_package()
    assert len(found) >= 15, found  # the scan itself works
    missing = {n: m for n, m in found.items() if LOCATIONS.get(n) != m}
    assert not missing, f"error classes not under aidaptiv_ds.AidaptivError / not in errors.LOCATIONS: {missing}"


def test_unknown_attribute_of_the_package_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchError"):
        aidaptiv_ds.NoSuchError  # noqa: B018


# ---------------------------------------------------------------------------- real raises, one per layer
def test_config_errors_from_every_layer_are_caught_by_the_root(tmp_path):
    from aidaptiv_ds.integration.config import parse_section
    from aidaptiv_ds.io.engine import IOEngine
    from aidaptiv_ds.planner.model_size import load_model_shape, nearest_preset
    from aidaptiv_ds.units import parse_size

    cases = [
        (lambda: parse_size("8 parsecs", "aidaptiv.dram_budget"), ["aidaptiv.dram_budget", "parsecs", "GiB"]),
        (lambda: parse_section({"enabled": True, "cache_pahts": [str(tmp_path)]}), ["cache_pahts", "cache_paths"]),
        (lambda: IOEngine(block_size=1000), ["aidaptiv.io.block_size", "1000", "4096"]),
        (lambda: nearest_preset(-5), ["--params", "-5"]),
        (lambda: load_model_shape("no-such-model"), ["--model", "no-such-model", "Fix"]),
    ]
    for raise_it, words in cases:
        with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
            raise_it()
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, aidaptiv_ds.AidaptivConfigError)
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))


def test_storage_space_ledger_and_checkpoint_errors_are_caught_by_the_root(tmp_path):
    from aidaptiv_ds.checkpoint.reader import CheckpointReader
    from aidaptiv_ds.store.allocator import ExtentAllocator
    from aidaptiv_ds.store.layout import check_cache_path
    from aidaptiv_ds.store.ledger import EnduranceLedger, EnduranceRating

    with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
        check_cache_path(str(tmp_path / "absent"), "aidaptiv.cache_paths[0]")
    assert isinstance(ei.value, aidaptiv_ds.CachePathError) and isinstance(ei.value, ValueError)
    assert "absent" in str(ei.value)

    with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
        ExtentAllocator(alignment=4096, capacity=8192).alloc(3 * 4096)
    assert isinstance(ei.value, aidaptiv_ds.OutOfSpace) and ei.value.nbytes == 3 * 4096

    node = tmp_path / "node"
    ledger = EnduranceLedger(str(node), str(tmp_path), EnduranceRating(capacity=10**12), run="r", rank=0)
    ledger.add(4096)
    node.rename(tmp_path / "gone")
    node.write_text("")  # the ledger's directory is now a file: the rewrite fails with ENOTDIR (also as root)
    with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
        ledger.flush()
    assert isinstance(ei.value, aidaptiv_ds.LedgerError) and isinstance(ei.value, OSError)

    (tmp_path / "ckpt").mkdir()
    with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
        CheckpointReader(str(tmp_path / "ckpt"))
    assert isinstance(ei.value, aidaptiv_ds.IncompleteCheckpointError)


def test_nvml_and_data_errors_are_caught_by_the_root(tmp_path):
    from aidaptiv_ds.finetune.data import read_dolly
    from aidaptiv_ds.telemetry.nvml import FakeNvml

    with pytest.raises(aidaptiv_ds.AidaptivError, match="no driver"):
        FakeNvml(error="no driver").device_count()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "x"}) + "\n")
    with pytest.raises(aidaptiv_ds.AidaptivError) as ei:
        read_dolly(bad)
    assert isinstance(ei.value, aidaptiv_ds.DollyFormatError) and "bad.jsonl" in str(ei.value)


def test_storage_io_error_is_an_oserror_with_path_offset_and_fix():
    import errno

    e = aidaptiv_ds.StorageIOError("write", "/mnt/cache0/slab", 8192, 4096, errno.ENOSPC)
    assert isinstance(e, aidaptiv_ds.AidaptivError) and isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert "/mnt/cache0/slab" in str(e) and "8192" in str(e) and "Fix:" in str(e)


def test_warnings_derive_from_the_root_warning(tmp_path):
    from aidaptiv_ds.io.engine import DirectIOFallbackWarning

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        warnings.warn("x", DirectIOFallbackWarning)
    assert issubclass(got[0].category, aidaptiv_ds.AidaptivWarning)


def test_cli_prints_an_aidaptiv_error_without_a_traceback(tmp_path, capsys):
    from aidaptiv_ds.cli.main import main

    (tmp_path / "t").mkdir()  # a tag directory without a manifest: an incomplete checkpoint
    rc = main(["export", str(tmp_path), "--tag", "t", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert err.startswith("aidaptiv-ds export: error: ") and "Traceback" not in err


@pytest.mark.subprocess
def test_import_stays_cheap_and_kinds_load_on_first_access():
    """``import aidaptiv_ds`` imports neither torch nor DeepSpeed; the root is there at once; a kind from
    a lower layer (torch behind it) loads when first named."""
    code = ("import sys, aidaptiv_ds\n"
            "heavy = sorted(m for m in ('torch', 'deepspeed', 'pydantic') if m in sys.modules)\n"
            "root = aidaptiv_ds.AidaptivError.__module__\n"
            "full = aidaptiv_ds.StorageFullError('/x', 2, 1)\n"
            "print(heavy, root, isinstance(full, aidaptiv_ds.AidaptivError))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "aidaptiv_ds.errors", "True"], out.stdout + out.stderr
