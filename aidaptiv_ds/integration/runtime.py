"""The aidaptiv_ds runtime: one I/O engine, one store, one DRAM tier per set of cache paths in a process.

DeepSpeed builds a parameter swapper per ``zero.Init`` and an optimizer swapper per engine; two of
DeepSpeed's own swappers on one ``nvme_path`` delete each other's files (``docs/deepspeed-seams.md``
§1.1, case B03). Here every swapper of a process on the same cache paths shares one :class:`Runtime`,
whose store lives in its own (host, run, rank) namespace under each cache path, so engines, ranks and
runs can share drives without ever touching each other's data.

[Note: several engines in a process] Notebooks, an evaluation engine beside a training engine, HF
hyperparameter search and DeepSpeed's own tests build several engines in one process. Engines whose
configs name the same cache paths share that paths' runtime; an engine on other paths gets a runtime of
its own beside it (:func:`get_runtime`). An engine's optimizer state (its ``opt<N>/`` and ``grad<N>/``
extents and their slices) is freed when the engine is destroyed (``engine.destroy()``) or garbage
collected (:meth:`Runtime.attach_engine`); a runtime with no engine and no parameter left is closed then
too (its files deleted unless ``keep_files``), and every runtime at exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import sys
import threading
import time
import weakref

import torch

from .. import spans
from ..io.buffers import cuda_pinning_available, current_pool, use_pool
from ..io.heap import release_free_host_memory, return_freed_host_memory, reuse_freed_host_memory
from ..io.engine import IOEngine
from ..io.errors import StorageError
from ..io.pool import POOL_GRANULE, HostBufferPool
from ..planner.auto import auto_prefetch_bytes
from ..process_group import destroy_gloo_group_at_exit
from ..store.layout import Namespace
from ..store.ledger import EnduranceRating
from ..store.store import PathSpec, SlabStore
from ..telemetry import counters
from ..telemetry.counters import dram_gauges
from ..telemetry.netinfo import processes_on_node
from ..tiers.eviction import TRAINING_KIND_RANK, AccessOrder, EvictionPolicy
from ..tiers.host_tier import HostTier
from ..torch_env import huge_pages_advice, kernel_huge_page_mode
from ..units import format_bytes
from .blas_threads import pin_blas_threads
from .config import AidaptivConfig
from .optimizer_state import state_of
from .shm_buffer import release_allreduce_buffer_at_exit

log = logging.getLogger("aidaptiv_ds")

_RUNTIMES: "dict[tuple[str, ...], Runtime]" = {}  # live runtimes by their cache paths, oldest first
_LOCK = threading.Lock()
_IDS = __import__("itertools").count()


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_run_name(name: str) -> str:
    """``name``, or for ``"auto"`` a fresh ``YYYYmmdd-HHMMSS-<hex>`` chosen by rank 0 and broadcast."""
    if name != "auto":
        return name
    fresh = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        box = [fresh]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return fresh


def local_world_size() -> int:
    """Processes of this job on this node (:func:`aidaptiv_ds.telemetry.netinfo.processes_on_node`: the larger of
    ``LOCAL_WORLD_SIZE`` and ``LOCAL_SIZE``), else 1: each rank's share of the node's ``auto`` budget."""
    return processes_on_node() or 1


def auto_dram_budget(working_set_bytes: int = 0) -> int:
    """This rank's DRAM budget for ``dram_budget: "auto"``: the planner's node budget
    (:func:`aidaptiv_ds.planner.auto.resolve_dram_budget`: available memory from ``/proc/meminfo``
    minus a safety margin) minus this rank's host working set, split over the node's ranks
    (:func:`local_world_size`, each rank subtracting its own working set)."""
    from ..planner.auto import resolve_dram_budget

    local = local_world_size()
    return resolve_dram_budget("auto", working_set_bytes=working_set_bytes * local, local_ranks=local).per_rank_bytes


class Timer:
    """Accumulates seconds the training thread spends blocked on I/O (``with rt.io_wait: ...``); each
    wait is also a span ``aidaptiv::io_wait`` (:mod:`aidaptiv_ds.spans`: the timeline, torch.profiler)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self):
        self._span = spans.span("aidaptiv::io_wait", cat="wait").__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._t0
        self._span.__exit__(*exc)
        return False


class Runtime:
    """Shared state of every aidaptiv_ds swapper in this process.

    Attributes:
        cfg: the validated ``"aidaptiv"`` section.
        rank: global rank; local_rank: rank on this node; local_world: ranks on this node.
        engine: the I/O engine; store: the slab store; tier: the DRAM tier; order: the access order.
        budget: the resolved DRAM budget in bytes.
    """

    def __init__(self, cfg: AidaptivConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = _dist_rank_world()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world = local_world_size()
        pin_blas_threads()  # GEMMs on a fixed thread count: same bits as DeepSpeed's CPU offload
        destroy_gloo_group_at_exit()  # no SIGABRT at exit when the script leaves its gloo group (process_group.py)
        release_allreduce_buffer_at_exit(self.rank)  # DeepSpeed's CPU all-reduce segment ([Note] in shm_buffer.py)
        self.reuse_host_memory = cfg.io.reuse_host_memory is True and reuse_freed_host_memory()
        self._huge_pages_advised = False  # the THP_MEM_ALLOC_ENABLE advice is logged once (torch_env.py)
        self.buffer_pool: HostBufferPool | None = None  # where no heap is kept (settle_host_memory_reuse)
        if not self.reuse_host_memory:  # until the plan shows the budget can hold a reusing heap
            return_freed_host_memory()
        self.engine = IOEngine(block_size=cfg.io.block_size, threads_per_drive=cfg.io.threads_per_drive,
                               max_retries=cfg.io.max_retries, direct=cfg.io.direct)
        run = resolve_run_name(cfg.run_name)
        paths = cfg.cache_paths
        weights = cfg.path_weights or [1.0] * len(paths)
        rating = EnduranceRating(cfg.endurance.capacity, cfg.endurance.rated_dwpd, cfg.endurance.warranty_years)
        primary = self.local_rank % len(paths) if cfg.primary_path == "local_rank" else int(cfg.primary_path)
        self.namespace = Namespace(paths, run, self.rank)
        self.store = SlabStore(self.namespace, [PathSpec(p, w, None, rating) for p, w in zip(paths, weights)],
                               engine=self.engine, policy=cfg.placement, primary=primary,
                               stripe_unit=cfg.stripe_unit, checksum=cfg.checksum,
                               keep=cfg.keep_files or cfg.from_unpacked, local_ranks=self.local_world)
        self.budget = auto_dram_budget() if cfg.dram_budget == "auto" else int(cfg.dram_budget)
        wb = 512 << 20 if cfg.writeback_bytes == "auto" else int(cfg.writeback_bytes)
        self.order = AccessOrder()
        # optimizer and gradient slices before parameter slices ([Note: ranking the kinds in training])
        self.tier = HostTier(self.budget, writeback_limit=wb, policy=EvictionPolicy(self.order, TRAINING_KIND_RANK))
        self.io_wait = Timer()
        self.param_swapper = None  # this runtime's AidaptivParamSwapper, created by the first zero.Init on its paths
        self._engines: dict = {}  # engine id -> (weakref to its optimizer swapper, weakref to its stepper)
        self._boundary_stores = weakref.WeakSet()  # layer-major steps' boundary activations (activations.py)
        self._provider = "aidaptiv_ds" if next(_IDS) == 0 else f"aidaptiv_ds#{id(self)}"
        self.checkpoint_bytes_written = 0  # bytes our checkpoint saves wrote (not on the cache tier)
        self.checkpoint_bytes_cloned = 0  # bytes they shared with the slab by copy-on-write clones
        self.closed = False
        install_sigterm_handler()
        counters.register_provider(self._provider, self.counters, settle=self.flush)
        if self.rank == 0:
            log.info("aidaptiv_ds: run %s, %d cache path(s) %s (%s), DRAM budget %s", run, len(paths), paths,
                     cfg.placement, format_bytes(self.budget))

    # ------------------------------------------------------------------ engines ([Note: several engines])
    @property
    def optimizer_swappers(self) -> list:
        """The optimizer swappers of this runtime's live engines."""
        return [sw for sw in (r[0]() for r in self._engines.values()) if sw is not None]

    @property
    def steppers(self) -> list:
        """The in-backward steppers of this runtime's live engines (step counters)."""
        return [st for st in (r[1]() for r in self._engines.values() if r[1] is not None) if st is not None]

    def attach_boundary_store(self, store) -> None:
        """Count a :class:`~aidaptiv_ds.integration.activations.BoundaryStore` 's bytes (weakly)."""
        self._boundary_stores.add(store)

    def attach_engine(self, engine_id: int, swapper, stepper=None) -> None:
        """Count an engine's optimizer swapper (and in-backward stepper) as this runtime's, weakly: when the
        swapper is garbage collected, its state is freed as by :meth:`detach_engine`."""
        import weakref

        self._engines[engine_id] = (weakref.ref(swapper, lambda _r, i=engine_id: self.detach_engine(i)),
                                    weakref.ref(stepper) if stepper is not None else None)

    def detach_engine(self, engine_id: int) -> None:
        """The engine is destroyed (or gone): free its optimizer and gradient extents and slices, give back
        the parameter chunks no live parameter uses, and close this runtime when nothing of it is left."""
        if self.closed or self._engines.pop(engine_id, None) is None:
            return
        for s in [s for s in self.tier.slices() if s.key[:2] in (("opt", engine_id), ("grad", engine_id))]:
            while s.refs:
                self.tier.release(s)
            self.tier.drop(s)  # the engine's state goes away with it: never written
        self.tier.wait_writes()
        for key in [k for k in self.store.keys() if k.split("/")[0] in (f"opt{engine_id}", f"grad{engine_id}")]:
            self.store.free(key)
        if self.param_swapper is not None:
            self.param_swapper.release_dead_chunks()
        if not self._engines and (self.param_swapper is None or not self.param_swapper.live_partitions()):
            _close_runtime(self)

    def settle_host_memory_reuse(self, heap_bytes: int, budget_free_bytes: int, pool_bytes: int = 0,
                                 rides: bool = False) -> bool:
        """Decide ``io.reuse_host_memory: "auto"`` and ``io.buffer_pool`` once the plan is known; returns
        whether heap reuse is on.

        Reuse (:func:`~aidaptiv_ds.io.heap.reuse_freed_host_memory`) saves page-faulting every swap
        buffer every step, but the heap then keeps what it freed, up to the high-water mark of the
        buffers live at once: ``heap_bytes`` (the working windows: read-ahead, write-back, optimizer
        pipeline, gradient window). That retention is host memory like any other, so it must fit in the
        part of the DRAM budget the residency plan left free (``budget_free_bytes``); at a budget of 0
        reuse stays off and the freed heap is returned after every step (:meth:`end_of_step`); the advice to
        start PyTorch with huge pages is then logged once (:func:`aidaptiv_ds.torch_env.huge_pages_advice`).

        Where no heap is kept, the swap buffers come from a buffer pool instead of fresh memory each time
        (``io.buffer_pool``, :mod:`aidaptiv_ds.io.pool`) of ``pool_bytes`` (the planner's windows of those
        buffers, :func:`aidaptiv_ds.planner.auto.buffer_pool_bytes`: host memory the plan counts outside the
        budget) plus the DRAM budget (the units the tier keeps within it: resident gradient, optimizer and
        parameter slices, cached ones), so that what the budget holds is carved from the same region
        ([Note: the budget's units in the pool] in ``io/pool.py``). A second engine's plan adds its windows:
        the pool is replaced by one of the summed size (buffers of the first stay valid and return to it). With
        the updates riding the forward (``rides``) at a budget above 0, the pool carves the optimizer pipeline's
        slices at its top ([Note: the pipeline's slices at the top] in ``io/pool.py``).
        """
        if self.cfg.io.reuse_host_memory == "auto" and not self.reuse_host_memory:
            if int(heap_bytes) <= int(budget_free_bytes):
                self.reuse_host_memory = reuse_freed_host_memory()
        if int(pool_bytes) >= POOL_GRANULE and not cuda_pinning_available() and (
                self.cfg.io.buffer_pool is True or (self.cfg.io.buffer_pool == "auto" and not self.reuse_host_memory)):
            old = self.buffer_pool
            size = int(pool_bytes) + (old.capacity if old is not None else self.budget)
            # the pipeline's slices apart at the top only where they are carved among the budget's long-lived units,
            # the riding forward (io/pool.py, [Note: the pipeline's slices at the top])
            self.buffer_pool = HostBufferPool(size, pipeline_at_top=bool(rides) and self.budget > 0)
            if old is not None:  # its buffers stay valid; its pages go back as they die
                old.retire()
            use_pool(self.buffer_pool)
            if self.rank == 0:
                log.info("aidaptiv_ds: swap buffers from a host buffer pool of %s (io.buffer_pool)",
                         format_bytes(self.buffer_pool.capacity))
        advice = huge_pages_advice(self.reuse_host_memory, kernel_huge_page_mode())
        if advice and self.rank == 0 and not self._huge_pages_advised:
            log.info(advice)
            self._huge_pages_advised = True
        return self.reuse_host_memory

    def end_of_step(self) -> None:
        """After every optimizer step, and after the backward pass of an accumulation boundary: without
        heap reuse, give the free heap back to the OS. The return policy keeps freed blocks in the heap within
        a phase (activations, weight gradients, DeepSpeed's reduce buffers: ``io/heap.py`` [Note: the return
        threshold]); the backward pass frees all activations just before the optimizer step allocates its
        sub-groups, so without this the step's peak held both (2-5 B/param of retained heap measured before)."""
        if not self.reuse_host_memory:
            release_free_host_memory()

    def release_host_memory(self) -> None:
        """Wait for the write-backs in flight, then give the freed heap pages back to the OS
        (:func:`~aidaptiv_ds.io.heap.release_free_host_memory`) and the buffer pool's free pages too
        (:meth:`~aidaptiv_ds.io.pool.HostBufferPool.release_free`): after a one-time drop of many host
        buffers (a budget shrinking, initialisation), before DeepSpeed's next large allocation. The pool's
        pages touched while ``deepspeed.initialize`` streamed every sub-group through it would otherwise stay
        resident into the first step: more of them the more sub-groups went through (issue 34: step 1 started
        0.37 GiB higher at 1B than at 236M parameters, bf16, budget 0)."""
        self.tier.wait_writes()
        release_free_host_memory()
        if self.buffer_pool is not None:
            self.buffer_pool.release_free()

    def preflight_checkpoints(self, checkpoint_bytes: int) -> None:
        """With ``aidaptiv.checkpoint_dir``: refuse at start, before step 1, when one checkpoint
        (``checkpoint_bytes`` of this rank; the ranks sharing the directory's filesystem are gathered
        and added up) does not fit in its free space after the slabs' reservation -- the case of a
        checkpoint directory on the cache drive. Each save checks again (:func:`checkpointing.check_space`).

        Raises:
            CheckpointPreflightError: a :class:`StorageFullError` naming the directory, the bytes needed
                and free, the cache paths it shares the filesystem with, what their slabs hold, and
                dead stores of earlier runs there.
        """
        d = self.cfg.checkpoint_dir
        if not d:
            return
        from ..checkpoint.space import DEEPSPEED_FILES_ESTIMATE, preflight_verdict, rank_need

        os.makedirs(d, exist_ok=True)
        need = int(checkpoint_bytes) + DEEPSPEED_FILES_ESTIMATE
        mine = rank_need(d, need, self.namespace.cache_paths, [s.allocated_bytes() for s in self.store.slabs])
        ranks = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            ranks = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
        err = preflight_verdict(d, ranks)
        if err is not None:
            raise err

    def set_budget(self, budget: int) -> None:
        """Change the DRAM budget (the ``"auto"`` budget is refined once the working set is known)."""
        self.budget = int(budget)
        self.tier.budget = self.budget
        self.tier.enforce_budget()

    def prefetch_bytes(self, largest_slice: int) -> int:
        """Read-ahead window in bytes (working memory outside the DRAM budget): the configured value,
        or for ``"auto"`` ``max(2 x largest_slice, 256 MiB)`` (the current and the next fetch at
        least; 256 MiB is about 0.1 s of reads at this project's drive rates)."""
        if self.cfg.prefetch_bytes != "auto":
            return int(self.cfg.prefetch_bytes)
        return auto_prefetch_bytes(largest_slice)

    def counters(self) -> dict:
        """Cumulative counters for :mod:`aidaptiv_ds.telemetry.counters`."""
        io = self.store.io_counters()
        return {
            "bytes_read": {"cache": sum(v["bytes_read"] for v in io.values())},
            "bytes_written": {"cache": sum(v["bytes_written"] for v in io.values())},
            "per_path": io,
            "bytes_read_by_kind": self.store.read_bytes_by_kind(),
            "dram_bytes": self.tier.held_bytes,
            "dram_peak_bytes": self.tier.peak_bytes,
            **dram_gauges(self.tier, self.budget),
            "io_wait_s": self.io_wait.seconds,
            "optimizer_steps": _sum_counters(st.counters.as_dict() for st in self.steppers),
            "grad_spilled_bytes": sum(sw.gradients.spilled_bytes for sw in self.optimizer_swappers
                                      if sw.gradients is not None),
            "master_from_params_bytes": sum(sw.master_copied_bytes for sw in self.optimizer_swappers),
            "master_demand_bytes": sum(sw.master_demand_bytes for sw in self.optimizer_swappers),
            "master_held_bytes": sum(sw.master_held_bytes for sw in self.optimizer_swappers),
            "act_written_bytes": sum(b.written_bytes for b in list(self._boundary_stores)),
            "act_read_bytes": sum(b.read_bytes for b in list(self._boundary_stores)),
            "act_dram_bytes": sum(b.dram_bytes for b in list(self._boundary_stores)),
            **self._pool_counters(),
        }

    def _pool_counters(self) -> dict:
        c = self.buffer_pool.counters() if self.buffer_pool is not None else {}
        return {"buffer_pool_bytes": c.get("capacity", 0), "buffer_pool_peak_bytes": c.get("peak_in_use", 0),
                "buffer_pool_miss_bytes": c.get("miss_bytes", 0),
                "buffer_pool_released_bytes": c.get("released_bytes", 0)}

    def check(self) -> None:
        """Per-step health check: no write failed for good, and the store's files are still there.

        A write that failed after its retries has already raised where it was waited for; but its
        bytes are not on the drive, so a run that caught that error must neither go on nor save a
        checkpoint from the incomplete state (the last good checkpoint must stay the latest).

        Raises:
            StorageError: a write failed earlier (its message, with the path, offset and fix, inside).
            CachePathError: the store's directory on a cache path was removed under the run.
        """
        failed = self.engine.failed_write
        if failed is not None:
            raise StorageError(f"aidaptiv_ds: a write failed earlier, so the training state on the drive is "
                               f"incomplete; this run can neither go on nor save a checkpoint from it. The failed "
                               f"write: {failed}")
        self.store.check_files()

    def flush(self) -> None:
        """Finish every write in flight and book the ledger.

        Raises:
            StorageIOError: a write failed (path, offset, fix); StorageError, CachePathError: see :meth:`check`.
        """
        self.check()
        if self.param_swapper is not None:
            self.param_swapper.synchronize_writes()
        self.tier.wait_writes()
        self.store.flush_ledger()

    def close(self) -> None:
        """Flush, then delete the store's files (or keep them with ``keep_files``) and free the namespace."""
        if self.closed:
            return
        for sw in self.optimizer_swappers:  # optimizer updates still riding the forward (step_pipeline.py)
            opt = getattr(sw, "owner", None)
            st = state_of(opt)
            if st is not None and st.pipeline is not None:
                try:
                    st.pipeline.drain()
                except Exception as e:  # noqa: BLE001 - a failed update was raised where it ran; close anyway
                    log.warning("aidaptiv_ds: closing with an optimizer update not applied: %s", e)
        self.closed = True
        try:
            self.flush()
            if self.cfg.keep_files:
                self.tier.flush()
        finally:
            counters.unregister_provider(self._provider)
            if self.buffer_pool is not None and current_pool() is self.buffer_pool:
                use_pool(None)  # its buffers still alive keep the region; it is unmapped after the last
            try:
                self.store.close()
            finally:
                self.engine.close()


def _paths_key(paths) -> tuple[str, ...]:
    return tuple(os.path.abspath(p) for p in paths)


def get_runtime(cfg: AidaptivConfig) -> Runtime:
    """The live runtime of ``cfg``'s cache paths, created on first use ([Note: several engines in a process]).

    A config that names the cache paths of a live runtime shares it (its DRAM budget and other settings
    are the first config's); other paths get a runtime of their own.
    """
    key = _paths_key(cfg.cache_paths)
    with _LOCK:
        rt = _RUNTIMES.get(key)
        if rt is not None and not rt.closed:
            return rt
        rt = _RUNTIMES[key] = Runtime(cfg)
        return rt


def _close_runtime(rt: Runtime) -> None:
    with _LOCK:
        for k, v in list(_RUNTIMES.items()):
            if v is rt:
                del _RUNTIMES[k]
    rt.close()


def _sum_counters(dicts) -> dict:
    """Add up the steppers' ``StepCounters.as_dict()`` key by key (every key present, 0 without steppers)."""
    from .backward_step import StepCounters

    out = StepCounters().as_dict()
    for d in dicts:
        for k, v in d.items():
            out[k] += v
    return out


def current_runtime() -> Runtime | None:
    """The most recently created live runtime of the process (None without one)."""
    live = runtimes()
    return live[-1] if live else None


def runtimes() -> list[Runtime]:
    """Every live runtime of the process, oldest first."""
    with _LOCK:
        return [rt for rt in _RUNTIMES.values() if not rt.closed]


def shutdown() -> None:
    """Close every runtime (safe to call twice; see :func:`_shutdown_at_exit` for interpreter exit)."""
    with _LOCK:
        live = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    errors = []
    for rt in live:
        try:
            rt.close()
        except BaseException as e:  # noqa: BLE001 - close the others, then raise the first
            errors.append(e)
    if errors:
        raise errors[0]


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at interpreter exit.

    When the process is exiting because of an unhandled exception (``sys.last_value`` is set: the
    run failed and Python already printed its error), what the close meets on the way (typically
    the same failed write again, or a ledger that cannot be written on a full or vanished drive) is
    only logged at debug level, so the run's own error stays the last thing on stderr. The close
    still frees the drive: the store's files are deleted (or kept with ``keep_files``) either way.

    Otherwise an error of the close (a cache directory that became read-only, so the slab cannot be
    deleted) is reported in one line on stderr -- what was left where, and the command that removes
    it -- instead of an "Exception ignored in atexit callback" traceback.
    """
    if getattr(sys, "last_value", None) is None:
        try:
            shutdown()
        except Exception as e:  # noqa: BLE001 - reported in one line; the process is exiting
            msg = " ".join(str(e).split())
            print(msg if msg.startswith("aidaptiv_ds") else f"aidaptiv_ds: at exit: {type(e).__name__}: {msg}",
                  file=sys.stderr, flush=True)
        return
    import warnings
    was_disabled, log.disabled = log.disabled, True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shutdown()
    except BaseException as e:  # noqa: BLE001 - the run's own error was already reported
        log.disabled = was_disabled
        log.debug("aidaptiv_ds: closing the store after the run failed: %s", e)
    finally:
        log.disabled = was_disabled


atexit.register(_shutdown_at_exit)


# ---------------------------------------------------------------------------------------------- SIGTERM
_SIGTERM: dict = {}


def _on_sigterm(signum, frame) -> None:
    """SIGTERM without a handler of the user's: exit like Ctrl-C does -- unwind (``finally`` blocks
    run) with ``SystemExit(128 + 15)``, so :func:`_shutdown_at_exit` closes the store (its slab is
    deleted unless ``keep_files``). A handler of the user's that was installed before ours is called
    instead, and decides (one installed after ours replaces it, as Python does)."""
    prev = _SIGTERM.get("prev")
    if callable(prev):
        return prev(signum, frame)
    print(f"aidaptiv_ds: received SIGTERM (pid {os.getpid()}); closing the store and exiting with status "
          f"{128 + signum}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> bool:
    """Handle SIGTERM -- what SLURM, Kubernetes, torchrun and the ``deepspeed`` launcher send to stop a
    rank -- like SIGINT: the process unwinds and exits, and the store is closed on the way out
    (:func:`_on_sigterm`). Python's default for SIGTERM is to die at once, which left the slab on the
    drive. Only from the main thread (Python delivers signals there), once per process; an ignored
    SIGTERM (``SIG_IGN``) stays ignored. Returns whether our handler is installed.

    [Note: chaining] A user's handler found here is kept and called from ours, so a script that
    saves a checkpoint on SIGTERM (preemption) still does; if it then exits, the store is closed at
    exit as usual. A rank blocked inside a collective when the signal comes runs the handler only
    when the call returns; a launcher that kills it before (SIGKILL) leaves the store for
    ``aidaptiv-ds gc``.
    """
    import signal
    import threading

    if _SIGTERM.get("installed"):
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    prev = signal.getsignal(signal.SIGTERM)
    if prev == signal.SIG_IGN:
        return False
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        return False
    _SIGTERM.update(installed=True, prev=prev if callable(prev) else None)
    return True
