"""Faults during training (issue 6 item 6), each injected into a real training run.

Every case is a subprocess of the oracle harness (``tests/scripts/train_oracle.py``: aidaptiv
backend, the small Llama in fp32, DRAM budget 0 so all state goes through the drive), disturbed
between steps through its test-only options (``--pause_at``/``--pause_dir`` to stop before a step
and report the store's slabs and extents, ``--faults_after``/``--faults`` to arm an I/O shim at a
step, ``--progress``, ``--no_mkdir``). A failing run must end with a *clear error*: exit status
> 0 (an exception, not a signal or a C++ abort), and the last stderr line is our exception class
and its message (path, offset or numbers, and the fix) -- no second traceback after it, no bare
``OSError``/``AssertionError`` from deep inside, and no hang (every wait has a timeout).

Cases:

* drive full before step 1 (a tmpfs sized between the parameters and the whole state): the
  preflight refuses with :class:`StorageFullError` naming the path, bytes needed and bytes free,
  before any optimizer byte is written (the kept slab holds exactly the parameters' extent);
* drive filled by another writer mid-run (a real tmpfs, filled to the last byte while the run is
  paused after step 2): the run completes with the oracle's losses, because the state's space was
  reserved (``fallocate``) at start; only the endurance ledger cannot be updated, a named warning;
* the same on a filesystem without ``fallocate`` (ext2: the slab is sparse, its space checked but
  not reserved), filled after the engine started: the first write into a new block gets a real
  ENOSPC, a clear :class:`StorageIOError` naming the slab; the checkpoint saved before the fill (to
  a healthy directory) is complete and a fresh process resumes from it with the oracle's losses;
* ENOSPC on a write after step 2 (the I/O shim: what thin-provisioned or copy-on-write storage does
  to reserved space): the same clear error, and the step-2 checkpoint resumes exactly;
* after a write failed for good, a caller that caught the error can neither go on nor save a
  checkpoint from the incomplete state (in process);
* EIO on read and on write (shim armed after step 2): :class:`StorageIOError` naming the slab file,
  its cache path and the offset, after the configured retries; a transient EIO within the retry
  budget (``AIDAPTIV_FAULTS``) recovers with bit-identical results;
* a byte flipped in a slab while the run is paused (``"checksum": true``): :class:`ChecksumError`
  naming the slab and the offset of the block holding that byte;
* the store's directory removed mid-run (``rm -rf``): :class:`CachePathError` naming it, and
  nothing is re-created or deleted there afterwards, not even when a new owner re-created the same
  namespace (in process); the filesystem turned read-only mid-run
  (ext4 ``remount,abort``, what ``errors=remount-ro`` does after a media error -- a plain
  ``remount,ro`` is refused with EBUSY while the slab is open for writing);
* a missing or read-only cache path at startup: :class:`AidaptivConfigError`;
* a filesystem without ``O_DIRECT`` (``AIDAPTIV_FAULTS=op=open_direct,err=EINVAL``): one
  :class:`DirectIOFallbackWarning` naming the slab, and bit-identical results.

Mounting needs root; where it fails the case is skipped with the reason.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from _oracle import REPO, SCRIPT, assert_identical, free_port, run

from aidaptiv_ds.checkpoint.format import read_manifest

MiB = 1 << 20
ALIGN = 4096
# DeepSpeed JIT-builds its shared-memory comm op in every process; the default cache is shared by every
# Python environment of the user, which rebuild it in turn (minutes on 2 cores). One cache per environment,
# the same as tests/test_multirank.py uses.
from conftest import EXT_DIR  # noqa: E402  (one per venv, built before the first test)
FIRST_CHUNK = 4 * MiB  # PackedRegion's first chunk; each next one a quarter of the capacity so far (>= 4 MiB)
STEPS = 4
ARGS = ["--model", "llama", "--dtype", "fp32", "--budget", "0", "--steps", str(STEPS)]
TIMEOUT = 600  # seconds for one child on a loaded 2-core machine; a hang fails the test, it never blocks


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _param_chunks(nbytes: int) -> list[int]:
    """Sizes of the parameter region's chunks (4 MiB, then a quarter of the capacity so far, at least
    4 MiB: partitions here are far smaller) that hold ``nbytes`` of fp32 partitions (packed at 128-byte
    granularity: a few KiB over ``nbytes``, far from a chunk boundary here)."""
    sizes = [FIRST_CHUNK]
    while sum(sizes) < nbytes + (64 << 10):
        sizes.append(max(sum(sizes) // 4, FIRST_CHUNK))
    return sizes


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    """DeepSpeed's CPU-offload run of :data:`ARGS` (the oracle)."""
    return run("cpu", ARGS, str(tmp_path_factory.mktemp("oracle")), env={"TORCH_EXTENSIONS_DIR": EXT_DIR})


# ------------------------------------------------------------------------------------------ children
class Child:
    """One harness process: launch, wait for a pause, resume, collect the outcome."""

    def __init__(self, workdir: str, args: list[str], env: dict | None = None) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.dir = workdir
        self.out = os.path.join(workdir, "result.pt")
        e = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=REPO, TORCH_EXTENSIONS_DIR=EXT_DIR)
        e.pop("AIDAPTIV_FAULTS", None)
        e.update(env or {})
        cmd = [sys.executable, SCRIPT, "--backend", "aidaptiv", "--out", self.out, "--progress",
               "--pause_dir", workdir, *args]
        self._stdout = open(os.path.join(workdir, "stdout"), "w")
        self._stderr = open(os.path.join(workdir, "stderr"), "w")
        self.p = subprocess.Popen(cmd, env=e, stdout=self._stdout, stderr=self._stderr, cwd=REPO)
        self.rc: int | None = None

    def _tail(self) -> str:
        with open(os.path.join(self.dir, "stderr")) as f:
            return f.read()[-4000:]

    def paused(self, step: int) -> dict:
        """Wait until the run pauses before ``step``; its report (slabs, extents, cache paths)."""
        path = os.path.join(self.dir, f"paused_{step}.json")
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(path):
            if self.p.poll() is not None:
                pytest.fail(f"the run exited (rc {self.p.returncode}) before pausing at step {step}:\n{self._tail()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the run did not reach the pause before step {step} in {TIMEOUT} s")
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def resume(self, step: int) -> None:
        open(os.path.join(self.dir, f"resume_{step}"), "w").close()

    def finish(self) -> "Child":
        try:
            self.rc = self.p.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run hung: no exit {TIMEOUT} s after the fault\n{self._tail()}")
        self._stdout.close()
        self._stderr.close()
        with open(os.path.join(self.dir, "stdout")) as f:
            self.stdout = f.read()
        with open(os.path.join(self.dir, "stderr")) as f:
            self.stderr = f.read()
        return self

    def kill(self) -> None:
        """Stop the child: resume every pause and give it a minute to exit (a child killed while it
        builds DeepSpeed's op would leave the build lock behind for every later process), then SIGKILL."""
        if self.p.poll() is not None:
            self._stdout.close()
            self._stderr.close()
            return
        for step in range(STEPS + 1):
            self.resume(step)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self._stdout.close()
        self._stderr.close()

    @property
    def steps_done(self) -> int:
        return len(re.findall(r"^aidaptiv-test: step \d+ done$", self.stdout, re.M))

    def result(self) -> dict:
        assert self.rc == 0, f"the run failed (rc {self.rc}):\n{self.stderr[-4000:]}"
        return torch.load(self.out, weights_only=False)


@pytest.fixture
def launch(tmp_path):
    """``launch(name, args, env)`` starts a harness child; children still alive at the end are killed."""
    children: list[Child] = []

    def start(name: str, args: list[str], env: dict | None = None) -> Child:
        c = Child(str(tmp_path / name), args, env)
        children.append(c)
        return c

    yield start
    for c in children:
        c.kill()


# A failed asynchronous write stops the run as the StorageIOError itself where the training thread reaps
# it, or as the StorageError of the per-step check ("a write failed earlier ... The failed write: ...").
ASYNC_WRITE_ERRORS = ("StorageIOError", "StorageError")


def clear_error(child: Child, cls_name: str | tuple[str, ...]) -> str:
    """Assert the run failed with a clear ``cls_name`` error (or one of several); return its message.

    Clear: exit status > 0 (a Python exception, not a signal such as a C++ abort's SIGABRT), and
    the last stderr line (without the ``[rank0]:`` prefix) is ``<module>.<cls_name>: <message>``.
    """
    names = (cls_name,) if isinstance(cls_name, str) else tuple(cls_name)
    assert child.rc is not None and child.rc > 0, f"expected an error exit, got rc {child.rc}:\n{child.stderr[-3000:]}"
    lines = [ln for ln in child.stderr.splitlines() if ln.strip()]
    last = re.sub(r"^\[rank\d+\]:\s?", "", lines[-1]) if lines else ""
    name, _, message = last.partition(": ")
    assert name.startswith("aidaptiv_ds.") and name.rsplit(".", 1)[-1] in names, \
        f"the last stderr line is not a {cls_name}:\n{last}\n--- stderr tail ---\n{child.stderr[-3000:]}"
    assert "Fix" in message, message
    return message


# ------------------------------------------------------------------------------------------ filesystems
@contextlib.contextmanager
def mounted(tmp_path, kind: str, size_mib: int):
    """A ``kind`` filesystem (``tmpfs``, or ``ext4``/``ext2`` on a loop device, no blocks reserved for
    root) of ``size_mib`` MiB, unmounted afterwards. Skips with the reason where it cannot be made (not
    root, no mkfs, mount refused)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / f"mnt_{kind}"
    mnt.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)]
    else:
        mkfs = shutil.which(f"mkfs.{kind}")
        if mkfs is None:
            pytest.skip(f"mkfs.{kind} is not installed")
        img = tmp_path / f"{kind}.img"
        with open(img, "wb") as f:
            f.truncate(size_mib * MiB)
        r = subprocess.run([mkfs, "-q", "-F", "-m", "0", str(img)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"mkfs.{kind} failed: {r.stderr.strip()}")
        cmd = ["mount", "-o", "loop", str(img), str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a {kind} here ({' '.join(cmd)}): {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: str) -> str:
    """Fill the filesystem to the last byte with another file (1 MiB writes, then 4 KiB ones)."""
    path = os.path.join(mnt, "someone_elses_file")
    with open(path, "wb", buffering=0) as f:
        for chunk in (b"\xa5" * MiB, b"\xa5" * 4096):
            try:
                while True:
                    f.write(chunk)
            except OSError as e:
                assert e.errno == 28, e  # ENOSPC
    assert shutil.disk_usage(mnt).free < 4096
    return path


# ------------------------------------------------------------------------------------------ drive full
@pytest.mark.subprocess
def test_drive_too_small_is_refused_before_step_1(tmp_path, launch, ref):
    """A tmpfs with room for the parameters' extents but not for the optimizer state: no room for the
    second copy that steps inside backward need, so ("auto") the steps would run after backward, which
    stores the gradients too (budget 0); the refusal names that need."""
    n = ref["nparams"]
    chunks = _param_chunks(n * 4)
    params = sum(chunks)
    state = _round(n * 4 * 3)  # fp32 master & 2 moments
    needed = params + state + _round(n * 4)  # params extents + the state + the fp32 gradients
    size_mib = (params + state // 2) // MiB + 6  # the store keeps 2% in reserve
    with mounted(tmp_path, "tmpfs", size_mib) as mnt:
        st = os.statvfs(mnt)
        total = st.f_blocks * st.f_frsize
        # what the store may use (SlabStore._phys_caps): free space at open minus 2% of the filesystem, whole
        # MiB; at open the owner lock (a page or so on tmpfs) is already there
        cap_hi = (st.f_bavail * st.f_frsize - total // 50) // MiB * MiB
        cap_lo = (st.f_bavail * st.f_frsize - 16384 - total // 50) // MiB * MiB
        assert params <= cap_lo and cap_hi < needed, "the filesystem must hold the parameters, not the state"
        cache = os.path.join(mnt, "cache")
        # built under zero.Init: the parameters are on the drive before deepspeed.initialize sees the model
        c = launch("small", ARGS + ["--zinit", "--cache", cache,
                                    "--extra", json.dumps({"keep_files": True, "run_name": "r"})])
        c.finish()
        msg = clear_error(c, "StorageFullError")
        assert c.steps_done == 0
        m = re.fullmatch(rf"aidaptiv_ds: cache path {re.escape(cache)} needs \S+ \S+ \((\d+) bytes\) for the optimizer "
                         r"state and the gradients but has \S+ \S+ \((\d+) bytes\) free\. Fix: .*", msg)
        assert m, msg
        assert int(m.group(1)) == needed and cap_lo <= int(m.group(2)) <= cap_hi, (needed, cap_lo, cap_hi, msg)
        # nothing of the optimizer was allocated: the index holds the parameters' chunks only, and the slab
        # (grown in steps, never past the path's capacity) was not grown for the state
        rank_dir = os.path.join(cache, "aidaptiv_ds", os.listdir(os.path.join(cache, "aidaptiv_ds"))[0], "r", "rank0")
        assert params <= os.path.getsize(os.path.join(rank_dir, "slab.bin")) <= cap_hi
        with open(os.path.join(rank_dir, "index.json")) as f:
            extents = json.load(f)["extents"]
        assert extents == {f"params/float32/{k}": [sum(chunks[:k]), size] for k, size in enumerate(chunks)}, extents


@pytest.mark.subprocess
def test_drive_too_small_for_a_model_built_whole_names_the_jobs_need(tmp_path, launch, ref):
    """The model built whole, then partitioned by ``deepspeed.initialize``: the whole job's need on the cache
    path is checked before anything is partitioned or written (``integration/startup.py``), and the refusal
    names it (parameters, bytes per parameter, the budget), not the first extent that did not fit."""
    from aidaptiv_ds.integration.startup import job_need

    n = ref["nparams"]
    need = job_need(n, {}, budget=0, world=1)["need"]
    assert need == 16 * n  # fp32: gradients 4 + master 4 + moments 8 (the parameters are their master slots)
    with mounted(tmp_path, "tmpfs", need // 2 // MiB + 6) as mnt:
        cache = os.path.join(mnt, "cache")
        c = launch("whole", ARGS + ["--cache", cache, "--extra", json.dumps({"keep_files": True, "run_name": "w"})])
        c.finish()
        msg = clear_error(c, "StorageFullError")
        assert c.steps_done == 0
        m = re.fullmatch(rf"aidaptiv_ds: cache path {re.escape(cache)} needs \S+ \S+ \((\d+) bytes\) for the training "
                         rf"state of this job \({n:,} parameters, 16 B/param of parameters, fp32 master weights, Adam "
                         r"moments and gradients: \S+ \S+ for this rank, DRAM budget 0 B\) but has .* Fix: .*", msg)
        assert m and int(m.group(1)) == need, msg
        rank_dir = os.path.join(cache, "aidaptiv_ds", os.listdir(os.path.join(cache, "aidaptiv_ds"))[0], "w", "rank0")
        assert not os.path.exists(os.path.join(rank_dir, "slab.bin")) or \
            os.path.getsize(os.path.join(rank_dir, "slab.bin")) < need // 4  # nothing partitioned yet


@pytest.mark.subprocess
def test_drive_filled_by_another_writer_mid_run_does_not_stop_training(tmp_path, launch, ref):
    with mounted(tmp_path, "tmpfs", 320) as mnt:
        cache = os.path.join(mnt, "cache")
        c = launch("filled", ARGS + ["--cache", cache, "--pause_at", "2"])
        c.paused(2)
        filler = fill(mnt)
        c.resume(2)
        c.finish()
        assert_identical(ref, c.result())
        ledger = re.findall(r"LedgerWarning: aidaptiv_ds: cannot update the endurance ledger (\S+) of cache path "
                            r"(\S+): No space left on device\. Fix: free space on the drive", c.stderr)
        assert ledger and ledger[0][1] == cache and ledger[0][0].startswith(os.path.join(cache, "aidaptiv_ds")), \
            c.stderr[-3000:]
        assert len(ledger) == 1  # once per path and error, not once per step
        node = os.path.join(cache, "aidaptiv_ds", os.listdir(os.path.join(cache, "aidaptiv_ds"))[0])
        assert sorted(os.listdir(node)) == ["ledger.json", "ledger.json.lock"]  # the slab went with the run
        os.unlink(filler)


@pytest.mark.subprocess
def test_filesystem_without_fallocate_filled_mid_run_stops_and_the_checkpoint_resumes(tmp_path, launch, ref):
    """ext2 has no ``fallocate``: the slab is extended sparsely (free space checked, not reserved), so
    another writer filling the drive after start makes the first write into a new block fail with a
    real ENOSPC (the Adam moments are first written in step 0)."""
    ck = str(tmp_path / "ckpt")
    with mounted(tmp_path, "ext2", 400) as mnt:
        cache = os.path.join(mnt, "cache")
        c = launch("ext2", ARGS + ["--cache", cache, "--ckpt_dir", ck, "--save_at", "0", "--pause_at", "0"])
        info = c.paused(0)
        slab = info["slabs"][0]
        assert os.stat(slab).st_blocks * 512 < os.path.getsize(slab) // 2  # sparse: the space is not reserved
        fill(mnt)
        c.resume(0)
        c.finish()
        msg = clear_error(c, ASYNC_WRITE_ERRORS)
        assert c.steps_done == 0
        assert re.search(rf"write of \d+ bytes at offset \d+ in {re.escape(slab)} failed after 1 attempt\(s\): No "
                         r"space left on device\. Fix: free space on this drive", msg), msg
    read_manifest(os.path.join(ck, "global_step0"))  # the checkpoint saved before the fill is complete
    resumed = launch("ext2_resume", ARGS + ["--cache", str(tmp_path / "cache2"), "--ckpt_dir", ck, "--resume"])
    assert resumed.finish().result()["losses"] == ref["losses"]


@pytest.mark.subprocess
def test_enospc_mid_run_stops_and_the_earlier_checkpoint_resumes(tmp_path, launch, ref):
    cache, ck = str(tmp_path / "cache"), str(tmp_path / "ckpt")
    c = launch("enospc", ARGS + ["--cache", cache, "--ckpt_dir", ck, "--save_at", "2", "--faults_after", "3",
                                 "--faults", "op=write,err=ENOSPC,path_contains=slab.bin,count=-1"])
    c.finish()
    # the first write after the fault is an optimizer write-back (asynchronous; gradients are not written
    # on CPU ranks): the run stops with it where it is reaped, or with the per-step check that names it
    msg = clear_error(c, ASYNC_WRITE_ERRORS)
    assert c.steps_done == 3
    m = re.search(r"write of \d+ bytes at offset \d+ in (\S+/slab\.bin) failed after 1 attempt\(s\): No space left "
                  r"on device\. Fix: free space on this drive", msg)
    assert m and m.group(1).startswith(cache + "/aidaptiv_ds/"), msg  # ENOSPC is not retried
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == "global_step2"
    read_manifest(os.path.join(ck, "global_step2"))  # complete
    resumed = launch("resume", ARGS + ["--cache", str(tmp_path / "cache2"), "--ckpt_dir", ck, "--resume"]).finish()
    assert resumed.result()["losses"] == ref["losses"][2:]


def test_after_a_failed_write_the_run_can_neither_go_on_nor_checkpoint(tmp_path):
    """A caller that catches the write's error must not carry on, or save a checkpoint, from a state
    whose bytes never reached the drive: the per-step check and the flush that every checkpoint save
    starts with refuse, naming the failed write (in process: fast)."""
    import errno

    from aidaptiv_ds.integration.config import parse_section
    from aidaptiv_ds.integration.runtime import Runtime
    from aidaptiv_ds.io.errors import StorageError, StorageIOError
    from aidaptiv_ds.io.syscalls import FaultRule, FaultyIO

    rt = Runtime(parse_section({"cache_paths": [str(tmp_path)], "dram_budget": 0, "run_name": "failed-write",
                                "io": {"max_retries": 1, "reuse_host_memory": False}}))  # no mallopt in pytest
    try:
        rt.check()
        rt.engine.sysio = FaultyIO([FaultRule("write", err=errno.EIO, count=2)])  # 2 = the request's 2 attempts
        with pytest.raises(StorageIOError) as first:
            rt.store.put("x", torch.ones(4096)).wait()
        rt.store.put("y", torch.ones(4096)).wait()  # the drive works again ...
        for call in (rt.check, rt.flush):  # ... but the lost write is not forgotten
            with pytest.raises(StorageError, match="a write failed earlier") as e:
                call()
            assert str(first.value) in str(e.value) and "neither go on nor save a checkpoint" in str(e.value)
    finally:
        with pytest.raises(StorageError, match="a write failed earlier"):
            rt.close()  # refuses to flush, but still closes and deletes the store
    assert not os.path.exists(rt.namespace.rank_dir(0))


# ------------------------------------------------------------------------------------------ EIO
def test_a_failed_write_waited_for_several_times_keeps_one_traceback(tmp_path):
    """A write-back error is met by several waiters (the store's ordering wait, the tier's reap, the
    flush); each must show the failed transfer and its own wait, not every earlier waiter's frames
    (in process: fast)."""
    import errno
    import traceback

    from aidaptiv_ds.io import IOEngine, StorageIOError, alloc_aligned
    from aidaptiv_ds.io.syscalls import FaultRule, FaultyIO

    eng = IOEngine(sysio=FaultyIO([FaultRule("write", err=errno.EIO)]), max_retries=0)
    try:
        fh = eng.open(str(tmp_path / "f.bin"))
        fut = eng.write(fh, 0, alloc_aligned(4096))
        depths = []
        for _ in range(3):
            with pytest.raises(StorageIOError) as e:
                fut.wait()
            frames = traceback.extract_tb(e.value.__traceback__)
            assert frames[-1].name == "_run"  # where the transfer failed
            depths.append(len(frames))
        assert depths[0] == depths[1] == depths[2], depths
        fh.close()
    finally:
        eng.close()


@pytest.mark.subprocess
@pytest.mark.parametrize("op", ["write", "read"])
def test_eio_fails_after_the_retries_naming_slab_offset_and_drive(tmp_path, launch, op):
    cache = str(tmp_path / "cache")
    c = launch(f"eio_{op}", ARGS + ["--cache", cache, "--pause_at", "2", "--faults_after", "2",
                                    "--faults", f"op={op},err=EIO,path_contains=slab.bin,count=-1",
                                    "--extra", json.dumps({"io": {"max_retries": 2}})])
    info = c.paused(2)
    c.resume(2)
    c.finish()
    msg = clear_error(c, ASYNC_WRITE_ERRORS if op == "write" else "StorageIOError")
    assert c.steps_done == 2
    slab = info["slabs"][0]
    m = re.search(rf"{op} of (\d+) bytes at offset (\d+) in (\S+) failed after 3 attempt\(s\): Input/output error\. "
                  r"Fix: the drive reported a media error; check `dmesg`", msg)
    assert m and m.group(3) == slab and slab.startswith(cache + os.sep), msg
    off, n = int(m.group(2)), int(m.group(1))
    assert any(a <= off < a + size for a, size in info["extents"].values()) and n > 0  # an offset of our data


@pytest.mark.subprocess
@pytest.mark.parametrize("op", ["write", "read"])
def test_transient_eio_within_the_retry_budget_recovers(tmp_path, launch, ref, op):
    c = launch(f"transient_{op}", ARGS + ["--cache", str(tmp_path / "cache")],
               env={"AIDAPTIV_FAULTS": f"op={op},err=EIO,path_contains=slab.bin,skip=1,count=3"}).finish()
    res = c.result()
    assert res["io_retries"] == 3  # the default budget is 3 retries: all 3 faults were met and absorbed
    assert_identical(ref, res)


# ------------------------------------------------------------------------------------------ corruption
@pytest.mark.subprocess
def test_flipped_byte_in_a_slab_is_a_checksum_error_naming_path_and_offset(tmp_path, launch):
    c = launch("crc", ARGS + ["--cache", str(tmp_path / "cache"), "--pause_at", "2",
                              "--extra", json.dumps({"checksum": True})])
    info = c.paused(2)
    key = next(k for k in info["extents"] if k.startswith("opt"))  # the optimizer state: read at step 2
    start, size = info["extents"][key]
    bad = start + size // 3 + 12345
    slab = info["slabs"][0]
    with open(slab, "r+b") as f:
        f.seek(bad)
        old = f.read(1)
        f.seek(bad)
        f.write(bytes([old[0] ^ 0x20]))
        os.fsync(f.fileno())
    c.resume(2)
    c.finish()
    msg = clear_error(c, "ChecksumError")
    m = re.search(r"checksum mismatch for extent '([^']+)' \((\d+) bytes at offset (\d+) in (\S+)\)", msg)
    assert m and m.group(1) == key and m.group(4) == slab, msg
    n, off = int(m.group(2)), int(m.group(3))
    assert off <= bad < off + n


# ------------------------------------------------------------------------------------------ the path goes away
@pytest.mark.subprocess
def test_store_directory_removed_mid_run(tmp_path, launch):
    cache = str(tmp_path / "cache")
    c = launch("removed", ARGS + ["--cache", cache, "--pause_at", "2"])
    info = c.paused(2)
    shutil.rmtree(os.path.join(cache, "aidaptiv_ds"))
    c.resume(2)
    c.finish()
    msg = clear_error(c, "CachePathError")
    assert f"{info['rank_dir']} on cache path {cache} was removed" in msg and "aidaptiv-ds gc" in msg
    assert os.listdir(cache) == []  # nothing re-created there, and (had someone re-created it) nothing deleted


def test_a_store_removed_and_re_created_by_another_owner_is_not_deleted_at_close(tmp_path):
    """After ``rm -rf``, a new owner may re-create the same namespace (our lock went with the old
    directory); closing the old store must delete nothing of the new owner's (in process: fast)."""
    from aidaptiv_ds.io import IOEngine
    from aidaptiv_ds.store import CachePathError, Namespace, PathSpec, SlabStore

    eng = IOEngine()
    cache = tmp_path / "cache"
    cache.mkdir()

    def store() -> SlabStore:
        return SlabStore(Namespace([str(cache)], "same-run", 0), [PathSpec(str(cache), capacity=64 * MiB)], engine=eng)

    try:
        ours = store()
        ours.put("x", torch.ones(1024)).wait()
        shutil.rmtree(cache / "aidaptiv_ds")
        with pytest.raises(CachePathError, match="was removed while this run was using it"):
            ours.check_files()
        theirs = store()  # the new owner: its lock is a new file, so it gets the namespace
        theirs.put("y", torch.arange(1024.0)).wait()
        ours.close()
        out = torch.empty(1024)
        theirs.get("y", out).wait()
        assert torch.equal(out, torch.arange(1024.0)) and os.path.exists(theirs.slabs[0].path)
        theirs.check_files()
        theirs.close()
        assert not os.path.exists(theirs.ns.rank_dir(0))
    finally:
        eng.close()


@pytest.mark.subprocess
def test_filesystem_turning_read_only_mid_run(tmp_path, launch):
    with mounted(tmp_path, "ext4", 400) as mnt:
        cache = os.path.join(mnt, "cache")
        c = launch("readonly", ARGS + ["--cache", cache, "--pause_at", "2"])
        info = c.paused(2)
        r = subprocess.run(["mount", "-o", "remount,abort", mnt], capture_output=True, text=True)
        if r.returncode:
            c.kill()
            pytest.skip(f"cannot force ext4 read-only here (mount -o remount,abort): {r.stderr.strip()}")
        c.resume(2)
        c.finish()
        msg = clear_error(c, ASYNC_WRITE_ERRORS)
        assert f"in {info['slabs'][0]} failed after 1 attempt(s): Read-only file system" in msg
        assert "remount it read-write" in msg


@pytest.mark.subprocess
@pytest.mark.parametrize("case", ["uncreatable", "read-only"])
def test_bad_cache_path_at_startup_is_the_config_error(tmp_path, launch, case):
    """A missing cache path is created (as DeepSpeed creates nvme_path); one that cannot be, or a read-only
    one, is the config error before step 1."""
    cache = str(tmp_path / "cache")
    if case == "uncreatable":
        (tmp_path / "a_file").write_text("x")
        cache = str(tmp_path / "a_file" / "cache")
    if case == "read-only":
        os.makedirs(cache)
        if os.geteuid() != 0:
            pytest.skip("a read-only bind mount needs root")
        for cmd in (["mount", "--bind", cache, cache], ["mount", "-o", "remount,ro,bind", cache]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                subprocess.run(["umount", cache], capture_output=True)
                pytest.skip(f"cannot make a read-only bind mount here ({' '.join(cmd)}): {r.stderr.strip()}")
    try:
        c = launch(case, ARGS + ["--cache", cache, "--no_mkdir"]).finish()
    finally:
        if case == "read-only":
            subprocess.run(["umount", cache], capture_output=True)
    msg = clear_error(c, "AidaptivConfigError")
    assert msg.startswith(f"aidaptiv.cache_paths[0]: {cache!r} ")
    assert ("cannot be created" in msg and f"mkdir -p {cache}" in msg) if case == "uncreatable" else \
        ("read-only filesystem" in msg and "remount" in msg)
    assert c.steps_done == 0


# ------------------------------------------------------------------------------------------ no O_DIRECT
@pytest.mark.subprocess
def test_filesystem_without_o_direct_falls_back_with_one_warning(tmp_path, launch, ref):
    c = launch("no_direct", ARGS + ["--cache", str(tmp_path / "cache")],
               env={"AIDAPTIV_FAULTS": "op=open_direct,err=EINVAL"}).finish()
    res = c.result()
    warned = re.findall(r"DirectIOFallbackWarning: aidaptiv_ds: (\S+): the filesystem refuses O_DIRECT", c.stderr)
    assert len(warned) == 1 and warned[0].endswith("/slab.bin") and list(res["direct_fallback"]) == warned, \
        c.stderr[-3000:]
    assert_identical(ref, res)
