"""Host facts from ``/proc`` and ``/sys``: memory, this process's RSS, filesystems, drive write counters.

Every function returns plain dicts and never raises for a fact the OS does not expose: the value
is ``None`` and a ``"status"`` string says why. ``proc_root``/``sys_root`` parameters let tests
point at a fake tree.

Sources (Linux ``Documentation/filesystems/proc.rst`` and ``Documentation/block/stat.rst``):

* ``/proc/meminfo``: ``MemTotal``, ``MemAvailable`` in kB (= KiB, x 1024 bytes);
* ``/proc/self/status``: ``VmRSS`` (resident now) and ``VmHWM`` (peak resident) in kB;
* ``/proc/mounts``: device, mount point (octal escapes such as ``\\040``), type, options;
* ``/sys/dev/block/<major>:<minor>`` links to the block device of a filesystem; a partition has a
  ``partition`` file and its parent directory is the disk;
* ``/sys/block/<disk>/stat`` field 7 (index 6) = sectors written, in 512-byte units whatever the
  drive's sector size; bytes written = sectors x 512. Counts since boot, all writers included;
* NVMe SMART / Health log "Data Units Written" (NVMe Base Specification, Get Log Page 02h): units
  of 1000 x 512 bytes since manufacture, read with ``nvme smart-log <dev> -o json`` (nvme-cli)
  when that tool is installed.
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess

SECTOR_BYTES = 512
NVME_DATA_UNIT_BYTES = 512 * 1000


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _kb_fields(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k.strip()] = int(parts[0]) * 1024 if len(parts) > 1 and parts[1] == "kB" else int(parts[0])
    return out


def host_memory(proc_root: str = "/proc") -> dict:
    """``{"total_bytes", "available_bytes", "status"}`` from ``/proc/meminfo`` (bytes; None when absent)."""
    text = _read(os.path.join(proc_root, "meminfo"))
    if text is None:
        return {"total_bytes": None, "available_bytes": None, "status": f"{proc_root}/meminfo not readable"}
    f = _kb_fields(text)
    return {"total_bytes": f.get("MemTotal"), "available_bytes": f.get("MemAvailable"), "status": "ok"}


def process_rss(proc_root: str = "/proc") -> dict:
    """``{"rss_bytes", "peak_rss_bytes"}`` of this process (``VmRSS``/``VmHWM``; ``getrusage`` peak as fallback)."""
    f = _kb_fields(_read(os.path.join(proc_root, "self", "status")) or "")
    peak = f.get("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rss_bytes": f.get("VmRSS"), "peak_rss_bytes": peak}


def reset_peak_rss(proc_root: str = "/proc") -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS by writing ``5`` to
    ``/proc/self/clear_refs`` (Linux >= 4.0, ``Documentation/admin-guide/mm/soft-dirty.rst``), so a
    later :func:`process_rss` gives the peak of what ran in between; False where that is not possible."""
    try:
        with open(os.path.join(proc_root, "self", "clear_refs"), "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, proc_root: str = "/proc") -> dict:
    """The mount holding ``path``: ``{"mount_point", "fstype", "source", "options", "read_only"}``.

    The longest mount point that is a prefix of the resolved path wins (the last one listed on ties,
    as the kernel stacks mounts). Values are None when ``/proc/mounts`` is unreadable.
    """
    real = os.path.realpath(path)
    text = _read(os.path.join(proc_root, "mounts"))
    best = None
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mp = _unescape(parts[1])
        if real == mp or real.startswith(mp.rstrip("/") + "/") or mp == "/":
            if best is None or len(mp) >= len(best[1]):
                best = (_unescape(parts[0]), mp, parts[2], parts[3])
    if best is None:
        return {"mount_point": None, "fstype": None, "source": None, "options": [], "read_only": None}
    opts = best[3].split(",")
    return {"mount_point": best[1], "fstype": best[2], "source": best[0], "options": opts, "read_only": "ro" in opts}


def block_device(path: str, sys_root: str = "/sys") -> str | None:
    """Name of the whole disk under ``/sys/block`` holding ``path`` (``"nvme0n1"``, ``"vda"``), or None.

    None for filesystems without a block device (tmpfs, overlay, NFS: major number 0) and where
    ``/sys`` does not show the device.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return None
    link = os.path.join(sys_root, "dev", "block", f"{major}:{minor}")
    if not os.path.exists(link):
        return None
    real = os.path.realpath(link)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def device_write_counters(dev: str, sys_root: str = "/sys") -> dict:
    """``{"device", "sectors_written", "bytes_written", "status"}`` from ``/sys/block/<dev>/stat``.

    ``bytes_written`` = sectors written x 512 since boot, by every writer (not just aidaptiv_ds).
    """
    text = _read(os.path.join(sys_root, "block", dev, "stat"))
    fields = (text or "").split()
    if len(fields) < 7:
        return {"device": dev, "sectors_written": None, "bytes_written": None,
                "status": f"{sys_root}/block/{dev}/stat not exposed"}
    sectors = int(fields[6])
    return {"device": dev, "sectors_written": sectors, "bytes_written": sectors * SECTOR_BYTES, "status": "ok"}


def nvme_smart_written(dev: str, runner=subprocess.run) -> dict:
    """NVMe SMART "Data Units Written" of ``/dev/<dev>`` through nvme-cli, in bytes (x 512,000).

    Returns ``{"data_units_written", "bytes_written", "status"}``; the values are None with a status
    such as ``"not exposed: nvme-cli not installed"`` when the drive is not NVMe or the tool is absent.
    """
    none = {"data_units_written": None, "bytes_written": None}
    if not dev.startswith("nvme"):
        return {**none, "status": f"not exposed: {dev} is not an NVMe drive"}
    if runner is subprocess.run and shutil.which("nvme") is None:
        return {**none, "status": "not exposed: nvme-cli not installed (apt-get install nvme-cli)"}
    try:
        r = runner(["nvme", "smart-log", f"/dev/{dev}", "-o", "json"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as e:
        return {**none, "status": f"not exposed: nvme smart-log failed ({e})"}
    if r.returncode != 0:
        return {**none, "status": f"not exposed: nvme smart-log exited {r.returncode}: {r.stderr.strip()[:200]}"}
    try:
        units = int(json.loads(r.stdout)["data_units_written"])
    except (ValueError, KeyError, TypeError) as e:
        return {**none, "status": f"not exposed: unexpected nvme smart-log output ({e})"}
    return {"data_units_written": units, "bytes_written": units * NVME_DATA_UNIT_BYTES, "status": "ok"}


def drive_counters(path: str, sys_root: str = "/sys", runner=subprocess.run) -> dict:
    """The drive's own write counters for the filesystem holding ``path``.

    Returns ``{"device", "sysfs": device_write_counters(...), "nvme_smart": nvme_smart_written(...)}``
    with ``device`` None (and both sub-dicts carrying a status) when no block device is behind ``path``.
    """
    dev = block_device(path, sys_root)
    if dev is None:
        why = f"not exposed: no block device behind {path} (tmpfs/overlay/network filesystem or no /sys)"
        return {"device": None, "sysfs": {"bytes_written": None, "status": why},
                "nvme_smart": {"bytes_written": None, "status": why}}
    return {"device": dev, "sysfs": device_write_counters(dev, sys_root),
            "nvme_smart": nvme_smart_written(dev, runner)}
