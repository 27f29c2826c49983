"""The one safe-file writer (:mod:`aidaptiv_ds.io.atomic`, issues 14.3 and 11.7).

* a crash (``SIGKILL``) between any two of its steps leaves the final path with its complete old
  or its complete new content (write, fsync, rename, directory fsync), for a file and a checked JSON;
* every write is checked: a short write is continued; one that makes no progress, or fails with
  ``ENOSPC`` (a fake ``pwrite``, and a real full tmpfs), raises ``FileWriteError`` naming the path
  and the bytes written of the bytes expected, and the file is never renamed into place;
* the directory is fsynced after the rename; checked JSON detects a changed value.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest
from _storage_helpers import REPO, child_env

from aidaptiv_ds.io import atomic
from aidaptiv_ds.io.atomic import (
    AtomicFile,
    ChecksumMismatch,
    atomic_write,
    dumps_checked,
    loads_checked,
    read_json_checked,
    write_json,
)
from aidaptiv_ds.io.errors import FileWriteError

OLD, NEW = b"old content " * 1000, b"NEW CONTENT! " * 3000

_WRITER = """
import sys
from aidaptiv_ds.io.atomic import atomic_write, write_json
path, kind = sys.argv[1], sys.argv[2]
if kind == "bytes":
    atomic_write(path, b"NEW CONTENT! " * 3000)
else:
    write_json(path, {"step": 9.0, "files": list(range(500))}, checked=True)
print("done")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["bytes", "json"])
@pytest.mark.parametrize("step,expect", [("atomic.written", "old"), ("atomic.synced", "old"),
                                         ("atomic.renamed", "new"), ("", "new")])
def test_a_kill_between_the_steps_leaves_old_or_new_whole(tmp_path, kind, step, expect):
    path = str(tmp_path / "f.json")
    if kind == "bytes":
        atomic_write(path, OLD)
    else:
        write_json(path, {"step": 2.0, "files": []}, checked=True)
    before = open(path, "rb").read()
    env = child_env(AIDAPTIV_TEST_KILL_AT=f"{step}:{path}" if step else "")
    p = subprocess.run([sys.executable, "-c", _WRITER, path, kind], env=env, capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert p.returncode == (-signal.SIGKILL if step else 0), p.stderr
    got = open(path, "rb").read()
    if expect == "old":
        assert got == before
    elif kind == "bytes":
        assert got == NEW
    else:
        assert read_json_checked(path) == {"step": 9.0, "files": list(range(500))}
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp." in n]
    assert leftovers == ([] if step in ("", "atomic.renamed") else [f"f.json.tmp.{leftovers[0].rsplit('.', 1)[1]}"])


def test_a_short_write_is_continued(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def halves(fd, data, off):
        calls.append(len(data))
        return real(fd, memoryview(data)[: max(len(data) // 2, 1)], off)

    monkeypatch.setattr(atomic.os, "pwrite", halves)
    atomic_write(str(tmp_path / "x"), NEW)
    assert open(tmp_path / "x", "rb").read() == NEW and len(calls) > 5


@pytest.mark.parametrize("failure", ["no progress", "ENOSPC"])
def test_a_failed_write_names_path_and_bytes_and_is_never_renamed(tmp_path, monkeypatch, failure):
    path = str(tmp_path / "sg00000.safetensors")
    atomic_write(path, OLD)
    real = os.pwrite
    budget = [5000]  # bytes the "disk" accepts

    def full_disk(fd, data, off):
        n = min(len(data), budget[0])
        if n == 0:
            if failure == "ENOSPC":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return 0
        budget[0] -= n
        return real(fd, memoryview(data)[:n], off)

    monkeypatch.setattr(atomic.os, "pwrite", full_disk)
    with pytest.raises(FileWriteError) as ei:
        with AtomicFile(path, expected=len(NEW)) as f:
            f.pwrite(NEW[:20000], 0)
            f.pwrite(NEW[20000:], 20000)
    e = ei.value
    assert e.path == path and e.written == 5000 and e.expected == len(NEW)
    assert path in str(e) and f"after 5000 of {len(NEW)} bytes" in str(e) and "Fix" in str(e)
    assert e.errno == (errno.ENOSPC if failure == "ENOSPC" else None)
    assert open(path, "rb").read() == OLD                       # the old file is untouched
    assert os.listdir(tmp_path) == ["sg00000.safetensors"]      # and the partial one removed


def test_a_file_that_came_up_short_is_not_renamed(tmp_path):
    path = str(tmp_path / "x")
    with pytest.raises(FileWriteError, match="after 4 of 10 bytes"):
        with AtomicFile(path, expected=10) as f:
            f.pwrite(b"abcd", 0)
    assert not os.path.exists(path) and not os.listdir(tmp_path)


@pytest.mark.subprocess
def test_a_real_full_filesystem(tmp_path):
    """A 1 MiB tmpfs: writing 2 MiB fails with ENOSPC naming the file; the old file stays whole."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        path = str(mnt / "ledger.json")
        atomic_write(path, OLD)
        with pytest.raises(FileWriteError) as ei:
            atomic_write(path, os.urandom(2 << 20))
        assert ei.value.errno == errno.ENOSPC and path in str(ei.value) and "of 2097152 bytes" in str(ei.value)
        assert open(path, "rb").read() == OLD and os.listdir(mnt) == ["ledger.json"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_the_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(atomic.os, "fsync", spy)
    atomic_write(str(tmp_path / "latest"), b"global_step4")
    assert synced[0].startswith(str(tmp_path / "latest.tmp.")) and synced[-1] == str(tmp_path)


def test_checked_json_detects_a_changed_value(tmp_path):
    data = dumps_checked({"step": 2.0, "subgroups": [{"numel": 10}]})
    assert loads_checked(data, "x") == {"step": 2.0, "subgroups": [{"numel": 10}]}
    changed = json.loads(data)
    changed["step"] = 9.0                                        # the trial's silent change of rank.json
    with pytest.raises(ChecksumMismatch, match="does not match its CRC32"):
        loads_checked(json.dumps(changed), "rank.json")
    with pytest.raises(ChecksumMismatch, match="no self_crc32"):
        loads_checked(json.dumps({"step": 2.0}), "rank.json")
    assert loads_checked(json.dumps({"step": 2.0}), "old.json", required=False) == {"step": 2.0}
    with pytest.raises(ChecksumMismatch, match="not valid JSON"):
        loads_checked(data[:-5], "rank.json")
