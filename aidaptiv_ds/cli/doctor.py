"""``aidaptiv-ds doctor``: is this machine ready for aidaptiv_ds? Versions, cache paths, GPUs, memory.

Per cache path it checks: exists, is a directory, writable, the filesystem (``/proc/mounts``),
read-only mounts, free space, and a probe: create a file, open it with ``O_DIRECT``, write 4 KiB
from a page-aligned buffer at offset 0, read it back, compare, delete the file. Each problem comes
with a fix. Severity ``error`` makes the path unusable (exit code 1); ``warning`` (tmpfs, no
``O_DIRECT``, a network filesystem) leaves it usable but not what a cache drive should be.

Also: torch and DeepSpeed versions against what aidaptiv_ds supports, NVML (absent NVML or no GPU
is a plain status line), host memory, and whether DeepSpeed's compiled ``async_io`` op is
installed or JIT-buildable (aidaptiv_ds does not need it: its I/O engine is pure Python).

In a multi-node job (``--nnodes N`` with N > 1, or the launcher's variables when doctor runs inside
one, :func:`aidaptiv_ds.telemetry.netinfo.nodes_in_job`): a warning when this machine's host name
resolves to a loopback address, with the flags that fix the launch (``launch/MULTINODE.md``), and
when ``GLOO_SOCKET_IFNAME`` names an interface this node does not have or that has no address.
"""
from __future__ import annotations

import errno
import json
import mmap
import os

from ..telemetry.netinfo import interfaces, nodes_in_job, resolve_host
from ..telemetry.nvml import nvml_status
from ..telemetry.sysinfo import host_memory, mount_of
from ..units import format_bytes

SUPPORTED_DEEPSPEED = "0.19.8"
MIN_TORCH = (2, 4)
PROBE_BYTES = 4096
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "9p", "fuse", "fuse.sshfs", "lustre", "gpfs", "ceph",
                       "overlay")


def _problem(severity: str, problem: str, fix: str) -> dict:
    return {"severity": severity, "problem": problem, "fix": fix}


def direct_io_probe(path: str) -> dict:
    """Write and read back 4 KiB with ``O_DIRECT`` in directory ``path`` (buffered if ``O_DIRECT`` is refused).

    Returns ``{"o_direct": bool, "ok": bool, "errno": int | None, "error": str | None}``. The probe
    file (``.aidaptiv_doctor_probe.<pid>``) is removed whatever happens.
    """
    f = os.path.join(path, f".aidaptiv_doctor_probe.{os.getpid()}")
    buf = mmap.mmap(-1, PROBE_BYTES)  # page-aligned anonymous memory, as O_DIRECT needs
    back = mmap.mmap(-1, PROBE_BYTES)
    buf.write(os.urandom(PROBE_BYTES))
    fd, direct = None, True
    try:
        try:
            fd = os.open(f, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            direct = False
            fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            n = os.pwritev(fd, [buf], 0)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = False  # opened but the write was refused: retry buffered
            os.close(fd)
            fd = os.open(f, os.O_RDWR, 0o600)
            n = os.pwritev(fd, [buf], 0)
        if n != PROBE_BYTES:
            return {"o_direct": direct, "ok": False, "errno": None, "error": f"short write: {n} of {PROBE_BYTES} bytes"}
        os.fsync(fd)
        m = os.preadv(fd, [back], 0)
        if m != PROBE_BYTES or back[:] != buf[:]:
            return {"o_direct": direct, "ok": False, "errno": None,
                    "error": f"read back {m} bytes that differ from what was written"}
        return {"o_direct": direct, "ok": True, "errno": None, "error": None}
    except OSError as e:
        return {"o_direct": direct, "ok": False, "errno": e.errno, "error": f"{e.strerror or e} ({f})"}
    finally:
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(f)
        except OSError:
            pass
        buf.close()
        back.close()


def check_cache_path(path: str, probe=direct_io_probe, proc_root: str = "/proc") -> dict:
    """Everything doctor knows about one cache path, with problems and fixes.

    Args:
        path: the cache path as the user wrote it.
        probe: the I/O probe (tests inject one to exercise branches the machine cannot produce).
        proc_root: where ``mounts`` is read from.

    Returns:
        ``{"path", "abspath", "exists", "is_dir", "writable", "fstype", "mount_point", "read_only",
        "free_bytes", "total_bytes", "o_direct", "probe", "problems": [{"severity", "problem", "fix"}],
        "usable"}``.
    """
    ap = os.path.abspath(os.path.expanduser(path))
    r: dict = {"path": path, "abspath": ap, "exists": os.path.exists(ap), "is_dir": os.path.isdir(ap),
               "writable": None, "fstype": None, "mount_point": None, "read_only": None, "free_bytes": None,
               "total_bytes": None, "o_direct": None, "probe": None, "problems": []}
    probs = r["problems"]
    if not r["exists"]:
        # the runtime creates a missing cache path as DeepSpeed creates a missing nvme_path
        # (integration/config.py create_cache_path): usable where it can be created, and said so
        parent = ap
        while parent != "/" and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        mnt = mount_of(parent, proc_root)
        where = f"the nearest existing parent is {parent}, on {mnt['fstype']} at {mnt['mount_point']}"
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            probs.append(_problem("error", f"{path} does not exist and cannot be created ({where}, "
                                           f"{'not a directory' if not os.path.isdir(parent) else 'not writable'})",
                                  f"mount the cache drive there or create the directory: mkdir -p {ap}"))
            r["usable"] = False
            return r
        on_root = os.stat(parent).st_dev == os.stat("/").st_dev
        r.update(fstype=mnt["fstype"], mount_point=mnt["mount_point"], writable=True)
        probs.append(_problem("warning", f"{path} does not exist: a run creates it ({where}"
                                         f"{'; the root filesystem, not a cache drive of its own' if on_root else ''})",
                              f"check the path for a typo; mount the cache drive there or create the directory: "
                              f"mkdir -p {ap}"))
        r["usable"] = True
        return r
    if not r["is_dir"]:
        probs.append(_problem("error", f"{path} is not a directory",
                              "give the directory on the cache drive (its mount point or a folder below it)"))
        r["usable"] = False
        return r
    mnt = mount_of(ap, proc_root)
    r.update(fstype=mnt["fstype"], mount_point=mnt["mount_point"], read_only=mnt["read_only"])
    st = os.statvfs(ap)
    r["free_bytes"], r["total_bytes"] = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if mnt["read_only"] or st.f_flag & os.ST_RDONLY:
        r["read_only"] = True
        probs.append(_problem("error", f"{path} is on a read-only filesystem ({mnt['fstype']} at {mnt['mount_point']})",
                              f"remount it read-write (mount -o remount,rw {mnt['mount_point']}) or choose a "
                              f"path on a writable cache drive"))
    else:
        p = probe(ap)
        r["probe"] = p
        r["o_direct"] = p["o_direct"] if p["ok"] else None
        if p["ok"]:
            r["writable"] = True
        elif p["errno"] == errno.EROFS:
            r["read_only"], r["writable"] = True, False
            probs.append(_problem("error", f"{path} is read-only: the probe write failed ({p['error']})",
                                  f"remount it read-write (mount -o remount,rw {mnt['mount_point']}) or choose a "
                                  f"path on a writable cache drive"))
        elif p["errno"] in (errno.EACCES, errno.EPERM):
            r["writable"] = False
            probs.append(_problem("error", f"{path} is not writable by uid {os.getuid()} ({p['error']})",
                                  f"chown/chmod it (e.g. chown $USER {ap}) or choose a writable directory"))
        elif p["errno"] in (errno.ENOSPC, errno.EDQUOT):
            r["writable"] = False
            probs.append(_problem("error", f"{path} has no space left ({p['error']})",
                                  "free space on the drive (see aidaptiv-ds plan for what the run needs) or use "
                                  "another drive"))
        else:
            r["writable"] = False
            probs.append(_problem("error", f"the 4 KiB write/read probe in {path} failed: {p['error']}",
                                  "check the drive and the kernel log (dmesg) before training on it"))
    if mnt["fstype"] in RAM_FILESYSTEMS:
        probs.append(_problem("warning", f"{path} is on {mnt['fstype']}, which lives in host RAM: the training state "
                                         f"there takes memory from the DRAM tier and is lost at reboot",
                              "put the cache path on the cache SSD (an ext4 or xfs filesystem on the NVMe drive, "
                              "e.g. mkfs.xfs /dev/nvme0n1 && mount /dev/nvme0n1 /mnt/cache0)"))
    elif r["o_direct"] is False:
        probs.append(_problem("warning", f"{path} ({mnt['fstype']}) refuses O_DIRECT; aidaptiv_ds falls back to "
                                         f"buffered I/O there, which costs page cache and throughput",
                              "use ext4 or xfs on the cache drive"))
    if mnt["fstype"] in NETWORK_FILESYSTEMS or (mnt["fstype"] or "").startswith("fuse"):
        probs.append(_problem("warning", f"{path} is on {mnt['fstype']}, not a local drive",
                              "use a local cache SSD; network and overlay filesystems are slow and may not honour "
                              "O_DIRECT"))
    r["usable"] = not any(p["severity"] == "error" for p in probs)
    return r


def check_versions() -> dict:
    """torch and DeepSpeed versions against the supported ones, with problems and fixes."""
    out: dict = {"python": None, "torch": None, "deepspeed": None, "supported_deepspeed": SUPPORTED_DEEPSPEED,
                 "problems": []}
    import platform
    out["python"] = platform.python_version()
    try:
        import torch
        out["torch"] = torch.__version__
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        if (major, minor) < MIN_TORCH:
            out["problems"].append(_problem("error", f"torch {torch.__version__} is older than "
                                                     f"{'.'.join(map(str, MIN_TORCH))}",
                                            f"pip install 'torch>={'.'.join(map(str, MIN_TORCH))}'"))
    except ImportError as e:
        out["problems"].append(_problem("error", f"torch is not importable ({e})", "pip install torch"))
    try:
        import deepspeed
        out["deepspeed"] = deepspeed.__version__
        if deepspeed.__version__ != SUPPORTED_DEEPSPEED:
            out["problems"].append(_problem("error", f"deepspeed {deepspeed.__version__} is not the supported "
                                                     f"{SUPPORTED_DEEPSPEED}; aidaptiv_ds patches DeepSpeed internals "
                                                     f"that change between releases",
                                            f"pip install deepspeed=={SUPPORTED_DEEPSPEED}"))
    except ImportError as e:
        out["problems"].append(_problem("error", f"deepspeed is not importable ({e})",
                                        f"pip install deepspeed=={SUPPORTED_DEEPSPEED}"))
    return out


def check_deepspeed_aio() -> dict:
    """Whether DeepSpeed's compiled ``async_io`` op is installed or JIT-buildable (informational only)."""
    out = {"installed": None, "jit_compatible": None, "needed": False,
           "note": "aidaptiv_ds does not need DeepSpeed's async_io op: its own I/O engine replaces it"}
    from ..integration.aio_ops import async_io_buildable, async_io_installed

    try:
        out["installed"] = async_io_installed()
    except Exception as e:  # DeepSpeed missing or broken: already reported by check_versions
        out["installed_error"] = f"{type(e).__name__}: {e}"
    try:
        out["jit_compatible"] = async_io_buildable()
    except Exception as e:
        out["jit_error"] = f"{type(e).__name__}: {e}"
    return out


def check_huge_pages(sys_root: str = "/sys") -> dict:
    """The kernel's transparent-huge-page mode, with a warning when it is off: aidaptiv_ds's fresh host
    buffers then page-fault in 4 KiB at a time (slower steps at a small DRAM budget, no failure;
    :func:`aidaptiv_ds.io.buffers.advise_huge_pages`), and whether this environment starts PyTorch with its
    own huge pages (``torch_thp``: ``THP_MEM_ALLOC_ENABLE``, worth setting at DRAM budget 0;
    :mod:`aidaptiv_ds.torch_env`)."""
    from ..torch_env import kernel_huge_page_mode, torch_huge_pages_on

    mode = kernel_huge_page_mode(sys_root)
    out = {"kernel_mode": mode, "torch_thp": torch_huge_pages_on(), "problems": []}
    if mode == "never":
        out["problems"].append(_problem("warning", "transparent huge pages are off in the kernel: fresh host "
                                                   "buffers page-fault in 4 KiB at a time (slower steps at a small "
                                                   "DRAM budget)",
                                        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root)"))
    return out


def check_network(nnodes: int | None = None, env=None, resolve=resolve_host, list_interfaces=interfaces) -> dict:
    """Whether this node can take part in a multi-node launch as documented (launch/MULTINODE.md).

    Args:
        nnodes: the job's node count (``--nnodes``); None: from the launcher's variables, if any.
        env: the environment (default ``os.environ``); resolve / list_interfaces: injected by tests.

    Returns:
        ``{"nnodes", "host", "addresses", "loopback", "interfaces", "gloo_socket_ifname", "problems"}``.
    """
    env = os.environ if env is None else env
    n = nnodes if nnodes is not None else nodes_in_job(env)
    r = resolve()
    ifs = list_interfaces()
    gloo = env.get("GLOO_SOCKET_IFNAME") or None
    out = {"nnodes": n, "host": r["host"], "addresses": r["addresses"], "loopback": r["loopback"],
           "interfaces": ifs, "gloo_socket_ifname": gloo, "problems": []}
    if not n or n <= 1:
        return out
    usable = [i for i in ifs if i["ipv4"] and not i["loopback"]]
    example = usable[0] if usable else {"name": "eth1", "ipv4": "10.0.0.1"}
    names = ", ".join(f"{i['name']} {i['ipv4']}" for i in usable) or "none with an IPv4 address"
    if r["loopback"]:
        where = f"resolves to {', '.join(r['addresses'])}" if r["addresses"] else f"does not resolve ({r['error']})"
        out["problems"].append(_problem(
            "warning", f"this is one of {n} nodes, and its host name {r['host']!r} {where}, a loopback address: "
                       f"torchrun's rendezvous and gloo would advertise an address the other nodes cannot reach "
                       f"(the rendezvous hangs or gloo's connect times out)",
            f"name this node's interface and address (interfaces here: {names}): "
            f"GLOO_SOCKET_IFNAME={gloo or example['name']} (and NCCL_SOCKET_IFNAME on GPUs); with torchrun also "
            f"--local_addr {example['ipv4']} and --rdzv_conf is_host=1 on the node of --rdzv_endpoint "
            f"(is_host=0 on the others); with `deepspeed --hostfile` put GLOO_SOCKET_IFNAME in .deepspeed_env; "
            f"or make {r['host']!r} resolve to this node's address (/etc/hosts). See launch/MULTINODE.md"))
    if gloo:
        mine = next((i for i in ifs if i["name"] == gloo), None)
        if mine is None or not mine["ipv4"]:
            out["problems"].append(_problem(
                "warning", f"GLOO_SOCKET_IFNAME={gloo}, but this node has "
                           + ("no such interface" if mine is None else "no IPv4 address on it"),
                f"set it to the interface that reaches the other nodes (here: {names})"))
    return out


def run_doctor(paths: list[str], probe=direct_io_probe, nvml_backend=None, proc_root: str = "/proc",
               nnodes: int | None = None) -> dict:
    """The full report; ``ok`` is False when a path or the versions have an ``error``."""
    versions = check_versions()
    cache = [check_cache_path(p, probe, proc_root) for p in paths]
    report = {"versions": versions, "cache_paths": cache, "nvml": nvml_status(nvml_backend),
              "host_memory": host_memory(proc_root), "deepspeed_aio": check_deepspeed_aio(),
              "huge_pages": check_huge_pages(), "network": check_network(nnodes)}
    errors = [p for p in versions["problems"] if p["severity"] == "error"]
    report["ok"] = not errors and all(c["usable"] for c in cache)
    return report


def _fmt(n) -> str:
    return format_bytes(n) if n is not None else "?"


def format_report(rep: dict) -> str:
    """The report as text, one line per fact, problems indented with their fixes."""
    v = rep["versions"]
    lines = [f"python      {v['python']}", f"torch       {v['torch'] or 'missing'}",
             f"deepspeed   {v['deepspeed'] or 'missing'} (supported: {v['supported_deepspeed']})"]
    for p in v["problems"]:
        lines += [f"  {p['severity'].upper()}: {p['problem']}", f"    fix: {p['fix']}"]
    for c in rep["cache_paths"]:
        state = "usable" if c["usable"] else "UNUSABLE"
        if c["exists"] and c["is_dir"]:
            lines.append(f"cache path  {c['path']}: {state}; {c['fstype']} at {c['mount_point']}, free "
                         f"{_fmt(c['free_bytes'])} of {_fmt(c['total_bytes'])}, O_DIRECT "
                         f"{ {True: 'yes', False: 'no', None: 'not probed'}[c['o_direct']] }, probe "
                         f"{'ok' if c['probe'] and c['probe']['ok'] else 'not run' if not c['probe'] else 'FAILED'}")
        else:
            lines.append(f"cache path  {c['path']}: {state}")
        for p in c["problems"]:
            lines += [f"  {p['severity'].upper()}: {p['problem']}", f"    fix: {p['fix']}"]
    n = rep["nvml"]
    if n["available"]:
        lines.append(f"gpus        {len(n['gpus'])} (driver {n['driver_version']}); {n['status']}")
        for g in n["gpus"]:
            lines.append(f"  gpu {g['index']}: {g['name']}, {_fmt(g['used_bytes'])} used of {_fmt(g['total_bytes'])}")
    else:
        lines.append(f"gpus        {n['status']}")
    m = rep["host_memory"]
    lines.append(f"host memory {_fmt(m['available_bytes'])} available of {_fmt(m['total_bytes'])}")
    h = rep.get("huge_pages")
    if h is not None:
        torch_thp = "on" if h.get("torch_thp") else "off (THP_MEM_ALLOC_ENABLE=1 speeds up DRAM budget 0)"
        lines.append(f"huge pages  kernel mode {h['kernel_mode'] or 'unknown'} (aidaptiv_ds advises its buffers); "
                     f"PyTorch's {torch_thp}")
        for p in h["problems"]:
            lines += [f"  {p['severity'].upper()}: {p['problem']}", f"    fix: {p['fix']}"]
    net = rep.get("network")
    if net is not None:
        nodes = (f"one of {net['nnodes']} nodes" if net["nnodes"] and net["nnodes"] > 1 else
                 "single node (--nnodes N checks a multi-node launch)")
        addrs = ", ".join(net["addresses"]) or "nothing"
        lines.append(f"network     {nodes}; host name {net['host']} resolves to {addrs}"
                     + (" (loopback)" if net["loopback"] else "")
                     + (f"; GLOO_SOCKET_IFNAME={net['gloo_socket_ifname']}" if net["gloo_socket_ifname"] else ""))
        for p in net["problems"]:
            lines += [f"  {p['severity'].upper()}: {p['problem']}", f"    fix: {p['fix']}"]
    a = rep["deepspeed_aio"]
    lines.append(f"ds async_io installed: {a['installed']}, JIT-buildable: {a['jit_compatible']} ({a['note']})")
    lines.append("result      " + ("OK" if rep["ok"] else "PROBLEMS: fix the errors above"))
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add ``doctor`` to the ``aidaptiv-ds`` subcommands."""
    p = subparsers.add_parser("doctor", help="check versions, cache paths, GPUs and memory",
                              description=__doc__)
    p.add_argument("--cache", action="append", default=[], metavar="PATH", help="a cache path to check (repeatable)")
    p.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="this machine is one of N nodes of a job: check the multi-node launch settings")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    """Print the report; exit code 0 when everything is usable, 1 otherwise. With ``--json`` stdout holds
    the JSON alone: what libraries print while the report is made (DeepSpeed logs its accelerator to
    stdout when imported) goes to stderr."""
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        rep = run_doctor(args.cache, nnodes=args.nnodes)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0 if rep["ok"] else 1


__all__ = ["direct_io_probe", "check_cache_path", "check_versions", "check_deepspeed_aio", "check_network",
           "run_doctor", "format_report", "register", "run", "SUPPORTED_DEEPSPEED"]
