"""``aidaptiv-ds doctor``: cache paths (tmpfs, read-only, missing, ...) with their fixes, NVML absent or faked.

Read-only paths: the tests run as root, where permission bits do not stop writes. When the process
may mount (root with CAP_SYS_ADMIN), a real read-only tmpfs is mounted; the read-only and other
error branches are also driven through an injected ``/proc/mounts`` and an injected probe, which
run everywhere.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import subprocess

import pytest

from aidaptiv_ds.cli import doctor
from aidaptiv_ds.cli.main import main
from aidaptiv_ds.telemetry import nvml
from aidaptiv_ds.telemetry.nvml import FakeGpu, FakeNvml
from aidaptiv_ds.telemetry.sysinfo import mount_of

GB = 10 ** 9


def fake_mounts(tmp_path, path: str, fstype: str, opts: str) -> str:
    """A fake /proc with ``mounts`` listing ``/`` (ext4) and ``path`` (``fstype``, ``opts``)."""
    root = tmp_path / "fakeproc"
    root.mkdir(exist_ok=True)
    (root / "mounts").write_text(f"/dev/vda / ext4 rw,relatime 0 0\nsrc {path} {fstype} {opts} 0 0\n")
    (root / "meminfo").write_text("MemTotal: 1024 kB\nMemAvailable: 512 kB\n")
    return str(root)


def probe_failing(err: int):
    def probe(path):
        return {"o_direct": True, "ok": False, "errno": err, "error": f"{os.strerror(err)} ({path}/probe)"}
    return probe


def severities(r):
    return [(p["severity"], p["problem"], p["fix"]) for p in r["problems"]]


def test_missing_path_is_a_warning_as_the_run_creates_it_and_an_uncreatable_one_an_error(tmp_path):
    """As the runtime (integration/config.py create_cache_path, as DeepSpeed creates a missing nvme_path): a
    missing path a run can create is usable with a warning naming where it lands and the mkdir fix; one below a
    file cannot be created: an error (found by a new-user trial: doctor said UNUSABLE where the run went on)."""
    r = doctor.check_cache_path(str(tmp_path / "no" / "such"))
    assert r["usable"] is True and r["exists"] is False
    (sev, problem, fix), = severities(r)
    assert sev == "warning" and "does not exist: a run creates it" in problem and str(tmp_path) in problem
    assert f"mkdir -p {tmp_path}/no/such" in fix and "typo" in fix
    (tmp_path / "a_file").write_text("x")
    r = doctor.check_cache_path(str(tmp_path / "a_file" / "cache"))
    assert r["usable"] is False
    (sev, problem, fix), = severities(r)
    assert sev == "error" and "cannot be created" in problem and "not a directory" in problem


def test_good_path_probe_writes_reads_and_cleans_up(tmp_path):
    r = doctor.check_cache_path(str(tmp_path))
    assert r["probe"]["ok"] is True and r["writable"] is True
    assert r["free_bytes"] > 0 and r["total_bytes"] >= r["free_bytes"]
    assert os.listdir(tmp_path) == []                                 # probe file removed
    if r["fstype"] in ("ext4", "xfs"):
        assert r["o_direct"] is True and r["usable"] and r["problems"] == []


def _tmpfs_dir(tmp_path):
    if mount_of("/dev/shm")["fstype"] == "tmpfs" and os.access("/dev/shm", os.W_OK):
        return "/dev/shm", None
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("no writable tmpfs (/dev/shm) and this process cannot mount one")
    return str(mnt), str(mnt)


def test_tmpfs_path_is_reported_with_fix(tmp_path):
    base, to_unmount = _tmpfs_dir(tmp_path)
    d = os.path.join(base, f"aidaptiv_doctor_test.{os.getpid()}")
    os.makedirs(d)
    try:
        r = doctor.check_cache_path(d)
        assert r["fstype"] == "tmpfs" and r["probe"]["ok"]
        assert r["usable"] is True                                    # it works, but it is RAM
        (sev, problem, fix), = severities(r)
        assert sev == "warning" and "tmpfs" in problem and "host RAM" in problem
        assert "cache SSD" in fix
        assert os.listdir(d) == []
    finally:
        os.rmdir(d)
        if to_unmount:
            subprocess.run(["umount", to_unmount], check=True)


@pytest.mark.subprocess
def test_read_only_mount_real(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root with CAP_SYS_ADMIN); "
                    "test_read_only_injected covers the branch")
    try:
        r = doctor.check_cache_path(str(mnt))
        assert r["usable"] is False and r["read_only"] is True
        errs = [p for p in r["problems"] if p["severity"] == "error"]
        assert len(errs) == 1 and "read-only" in errs[0]["problem"]
        assert f"mount -o remount,rw {mnt}" in errs[0]["fix"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_read_only_injected(tmp_path):
    d = tmp_path / "cache"
    d.mkdir()
    # the mount table says ro
    r = doctor.check_cache_path(str(d), proc_root=fake_mounts(tmp_path, str(d), "xfs", "ro,relatime"))
    assert r["usable"] is False and r["fstype"] == "xfs" and r["probe"] is None
    (sev, problem, fix), = severities(r)
    assert sev == "error" and "read-only filesystem (xfs" in problem and "remount,rw" in fix
    # the mount table says rw but the write gets EROFS
    r = doctor.check_cache_path(str(d), probe=probe_failing(errno.EROFS))
    assert r["usable"] is False and r["read_only"] is True
    assert "read-only" in severities(r)[0][1] and "remount,rw" in severities(r)[0][2]


@pytest.mark.parametrize("err,words,fix", [(errno.EACCES, "not writable", "chown"),
                                            (errno.ENOSPC, "no space left", "free space"),
                                            (errno.EIO, "probe in", "dmesg")])
def test_probe_failures_each_have_a_fix(tmp_path, err, words, fix):
    r = doctor.check_cache_path(str(tmp_path), probe=probe_failing(err))
    assert r["usable"] is False and r["writable"] is False
    sev, problem, f = severities(r)[0]
    assert sev == "error" and words in problem and fix in f


def test_no_o_direct_is_a_warning(tmp_path):
    def probe(path):
        return {"o_direct": False, "ok": True, "errno": None, "error": None}
    r = doctor.check_cache_path(str(tmp_path), probe=probe,
                                proc_root=fake_mounts(tmp_path, str(tmp_path), "zfs", "rw"))
    assert r["usable"] is True
    (sev, problem, fix), = severities(r)
    assert sev == "warning" and "refuses O_DIRECT" in problem and "ext4 or xfs" in fix


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = doctor.check_cache_path(str(f))
    assert r["usable"] is False and "not a directory" in r["problems"][0]["problem"]


def test_nvml_absent_is_a_clean_status():
    st = nvml.nvml_status(FakeNvml(error="NVML Shared Library Not Found"))
    assert st == {"available": False, "status": "NVML not available: NVML Shared Library Not Found",
                  "driver_version": None, "gpus": []}
    real = nvml.nvml_status(nvml.PynvmlBackend())                    # this machine: no GPU, no crash
    assert real["status"] == "ok" if real["available"] else real["status"].startswith("NVML not available: ")
    assert nvml.vram_used_bytes(FakeNvml(error="x")) is None


def test_nvml_fake_two_gpus():
    fake = FakeNvml([FakeGpu("NVIDIA RTX PRO 6000", 96 * GB, 10 * GB), FakeGpu("NVIDIA RTX PRO 6000", 96 * GB)])
    st = nvml.nvml_status(fake)
    assert st["available"] and st["driver_version"] == "fake-550.00"
    assert [(g["index"], g["total_bytes"], g["used_bytes"], g["free_bytes"]) for g in st["gpus"]] == \
        [(0, 96 * GB, 10 * GB, 86 * GB), (1, 96 * GB, 0, 96 * GB)]
    assert nvml.vram_used_bytes(fake) == [10 * GB, 0]
    assert nvml.nvml_status(FakeNvml([]))["status"] == "ok: NVML found no GPU"
    rep = doctor.run_doctor([], nvml_backend=fake)
    text = doctor.format_report(rep)
    assert "gpus        2" in text and "gpu 1: NVIDIA RTX PRO 6000" in text


def test_versions_and_aio_report(monkeypatch):
    v = doctor.check_versions()
    assert v["supported_deepspeed"] == "0.19.8" and v["torch"]
    import deepspeed
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    bad = doctor.check_versions()
    (p,) = bad["problems"]
    assert p["severity"] == "error" and "0.18.0" in p["problem"] and p["fix"] == "pip install deepspeed==0.19.8"
    aio = doctor.check_deepspeed_aio()
    assert aio["needed"] is False and "does not need" in aio["note"]
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder
    assert aio["installed"] is bool(installed_ops.get("async_io", False))
    assert aio["jit_compatible"] is bool(AsyncIOBuilder().is_compatible(verbose=False))
    # the report follows what DeepSpeed says, and a probe that raises is a reason, not a crash
    monkeypatch.setitem(installed_ops, "async_io", not aio["installed"])
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: 1 / 0)
    flipped = doctor.check_deepspeed_aio()
    assert flipped["installed"] is (not aio["installed"])
    assert flipped["jit_compatible"] is None and flipped["jit_error"].startswith("ZeroDivisionError")


def test_cli_exit_codes_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(nvml, "_backend", FakeNvml(error="NVML Shared Library Not Found"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc_good = main(["doctor", "--cache", str(tmp_path), "--json"])
    rep = json.loads(out.getvalue())
    versions_ok = not rep["versions"]["problems"]
    assert rc_good == (0 if versions_ok else 1)
    assert rep["nvml"]["status"].startswith("NVML not available")
    assert rep["host_memory"]["total_bytes"] > 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        (tmp_path / "a_file").write_text("x")
        rc_bad = main(["doctor", "--cache", str(tmp_path), "--cache", str(tmp_path / "a_file" / "missing")])
    assert rc_bad == 1
    text = out.getvalue()
    assert "UNUSABLE" in text and "fix: mount the cache drive there or create the directory" in text
    assert "NVML not available" in text


def test_huge_pages_check_reads_the_kernel_mode(tmp_path):
    """The kernel's THP mode from /sys: "never" is a warning with the setting to change, never an error."""
    from aidaptiv_ds.cli.doctor import check_huge_pages

    mm = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    mm.mkdir(parents=True)
    (mm / "enabled").write_text("always [madvise] never\n")
    r = check_huge_pages(str(tmp_path))
    assert r["kernel_mode"] == "madvise" and r["problems"] == []
    (mm / "enabled").write_text("always madvise [never]\n")
    r = check_huge_pages(str(tmp_path))
    assert [p["severity"] for p in r["problems"]] == ["warning"]
    assert "transparent_hugepage/enabled" in r["problems"][0]["fix"]
    assert check_huge_pages(str(tmp_path / "absent"))["kernel_mode"] is None


# ---------------------------------------------------------------------------------------------- several nodes
def _resolver(*addrs: str):
    return lambda: {"host": "node7", "addresses": list(addrs), "loopback": all(a.startswith("127.") for a in addrs),
                    "error": None if addrs else "Name or service not known"}


IFACES = [{"name": "lo", "ipv4": "127.0.0.1", "loopback": True},
          {"name": "eth1", "ipv4": "10.0.0.7", "loopback": False}]


def test_a_multi_node_job_on_a_host_name_resolving_to_loopback_gets_a_warning_with_the_flags():
    r = doctor.check_network(2, env={}, resolve=_resolver("127.0.0.1"), list_interfaces=lambda: IFACES)
    (p,) = r["problems"]
    assert p["severity"] == "warning" and "one of 2 nodes" in p["problem"] and "'node7' resolves to 127.0.0.1" \
        in p["problem"]
    for flag in ("GLOO_SOCKET_IFNAME=eth1", "--local_addr 10.0.0.7", "--rdzv_conf is_host=1", ".deepspeed_env",
                 "launch/MULTINODE.md"):
        assert flag in p["fix"], flag
    assert doctor.check_network(2, env={}, resolve=_resolver(), list_interfaces=lambda: IFACES)["problems"][0][
        "problem"].endswith("does not resolve (Name or service not known), a loopback address: torchrun's rendezvous "
                            "and gloo would advertise an address the other nodes cannot reach (the rendezvous hangs "
                            "or gloo's connect times out)")


def test_no_warning_on_one_node_or_with_a_routable_host_name():
    assert doctor.check_network(1, env={}, resolve=_resolver("127.0.0.1"), list_interfaces=lambda: IFACES)[
        "problems"] == []
    assert doctor.check_network(None, env={}, resolve=_resolver("127.0.0.1"), list_interfaces=lambda: IFACES)[
        "problems"] == []  # outside a job, without --nnodes: one node
    assert doctor.check_network(4, env={}, resolve=_resolver("10.0.0.7"), list_interfaces=lambda: IFACES)[
        "problems"] == []


def test_the_node_count_comes_from_the_launchers_variables():
    from aidaptiv_ds.telemetry.netinfo import nodes_in_job
    assert nodes_in_job({"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "8"}) == 3  # torchrun
    assert nodes_in_job({"WORLD_SIZE": "16", "LOCAL_SIZE": "8"}) == 2  # the deepspeed launcher
    assert nodes_in_job({"SLURM_JOB_NUM_NODES": "4"}) == 4
    assert nodes_in_job({}) is None
    r = doctor.check_network(None, env={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"},
                             resolve=_resolver("127.0.1.1"), list_interfaces=lambda: IFACES)
    assert r["nnodes"] == 2 and len(r["problems"]) == 1


def test_a_gloo_interface_this_node_lacks_is_named():
    r = doctor.check_network(2, env={"GLOO_SOCKET_IFNAME": "ib0"}, resolve=_resolver("10.0.0.7"),
                             list_interfaces=lambda: IFACES)
    (p,) = r["problems"]
    assert "GLOO_SOCKET_IFNAME=ib0, but this node has no such interface" in p["problem"] and "eth1 10.0.0.7" in p["fix"]
    assert doctor.check_network(2, env={"GLOO_SOCKET_IFNAME": "eth1"}, resolve=_resolver("10.0.0.7"),
                                list_interfaces=lambda: IFACES)["problems"] == []


def test_this_machines_interfaces_and_host_name_are_read():
    from aidaptiv_ds.telemetry.netinfo import interfaces, resolve_host
    ifs = interfaces()
    assert any(i["name"] == "lo" and i["loopback"] for i in ifs)
    r = resolve_host()
    assert r["host"] and (r["addresses"] or r["error"])
    text = doctor.format_report(doctor.run_doctor([], nnodes=2))
    assert "network     one of 2 nodes; host name" in text
