"""One training run of one backend, in its own process (DeepSpeed keeps process-global state).

Usage (the runner does this; by hand only for debugging)::

    python -m aidaptiv_ds.bench.worker SPEC.json RESULT.json

``SPEC.json`` keys: ``backend``, ``shape`` (:class:`~aidaptiv_ds.bench.models.LlamaShape` fields),
``settings`` (:class:`~aidaptiv_ds.bench.backends.TrainSettings` fields), ``steps``, ``seed``,
``cache_dir``, ``aio`` (``"compiled"``/``"python"``, native only), ``build``: ``"whole"`` (below),
``"zero_init"`` (built inside ``deepspeed.zero.Init``, for models whose whole fp32 weights would not fit in RAM;
``zero.Init`` takes the model dtype from the config's ``bf16`` section; ``build_under_zero_init`` true says the
same), ``"from_pretrained"`` (``spec["model_dir"]`` loaded by ``from_pretrained`` under ZeRO-3, through
``HfDeepSpeedConfig``) or ``"unpacked"`` (zero.Init with ``aidaptiv.from_unpacked`` and ``run_name =
spec["run_name"]``: the weights come from the store ``aidaptiv-ds unpack`` filled), ``native_dedup`` (native only,
default true: :func:`aidaptiv_ds.integration.bench_patches.dedup_native_swap_in`), ``t_launch`` (``time.time()``
when the runner started the process), optional ``profile`` (a path: cProfile of the steps after
``profile_after`` steps) and ``profile_after``, optional ``timeline`` (``[first, last]``: those steps'
timeline into ``timeline-rank0.json`` beside ``RESULT.json``, :mod:`aidaptiv_ds.telemetry.timeline`).

The model is a HF ``LlamaForCausalLM`` built and initialised (HF init, ``torch.manual_seed(seed)``)
*before* partitioning, then converted with ``deepspeed.zero.Init(module=model)`` (no ``dtype``
argument: DeepSpeed 0.19.8 on a CPU accelerator would otherwise hand its swapper bf16 for an fp32
model). A *step* is one optimizer step: ``settings.gradient_accumulation`` (``N``) micro-batches, each
forward, ``engine.backward`` and ``engine.step()`` (DeepSpeed's convention: it steps the optimizer on the
last micro-batch of each ``N``). Micro-batch ``j`` of step ``i`` (both from 0) trains on
``randint(vocab, (micro_batch, seq))`` from a generator seeded with ``seed * 1000 + i * N + j``, labels =
inputs, so every backend sees the same batches (with ``N`` 1, step ``i``'s batch is seed ``seed * 1000 + i``).

``RESULT.json`` is rewritten after every phase and step (a killed run leaves what it got to): ``phase``,
``ok``, ``error``, ``n_params``, ``setup_s`` (launch to the first step's start), ``first_step_s`` (launch to
the end of step 1), ``steps`` (per optimizer step, every figure over its ``N`` micro-batches: ``wall_s``,
``loss`` (the mean of the micro-batches' losses), ``micro_batch_losses`` (each micro-batch's, in order),
``micro_batches`` (micro-batches run), ``ds_global_steps`` / ``ds_micro_steps`` (the engine's own counts of
optimizer steps and micro-batches after the step: ``i + 1`` and ``(i + 1) * N`` when DeepSpeed accumulated
as configured), ``io_wait_s``, ``rt_io_wait_s``, ``cpu_user_s`` / ``cpu_sys_s`` / ``minor_faults``
(``getrusage`` of the whole process, every thread: the host work behind the step, and the fresh pages it
touched), ``proc_read_bytes``, ``proc_write_bytes``, ``cache_read_bytes``,
``cache_written_bytes``, ``dram_tier_bytes`` (aidaptiv_ds's DRAM tier after the step), ``optimizer_steps``
(aidaptiv_ds: sub-group steps per path in this step, ``StepCounters``), ``master_bytes`` (aidaptiv_ds, fp32:
the master-weight bytes of steps inside backward taken ``from_params``, of those ``held``, and read on
``demand``), ``buffer_pool`` (aidaptiv_ds: the host buffer pool's ``bytes``, the ``peak_bytes`` handed out so
far, the ``miss_bytes`` of this step it had no room for), ``rss_bytes``, ``peak_rss_bytes`` (peak so far),
``phase_peak_rss_bytes`` / ``phase_start_rss_bytes`` (per phase of the step: forward, backward, step, each
the micro-batch whose phase peaked highest; :class:`PhasePeaks`), ``phase_s`` (wall seconds per phase, summed
over the step's micro-batches)), ``peak_rss_steps_bytes`` (``VmHWM`` reset
before step 1, the maximum of the phases' peaks), ``peak_rss_process_bytes`` (the whole process: the setup's
peak and the steps', since resetting
``VmHWM`` resets what ``ru_maxrss`` reads too), ``aio`` (native), ``plan`` and ``budget_bytes`` (aidaptiv_ds),
``setup_phase_peak_rss_bytes`` / ``setup_phase_end_rss_bytes`` (per setup phase: import, build, partition,
initialize; :class:`ResultFile`), ``rss_trace`` (``[t_s, rss_bytes, phase]`` samples: :class:`.probes.RssTrace`),
``tail`` (aidaptiv_ds: the write-back still in flight after the last step), ``timeline`` (the timeline file,
when one was asked for), ``device`` (the engine's, e.g. ``cuda:0``).

On a GPU the batches go to the engine's device and each step's wall time ends with a device
synchronize (the step is done on the GPU too, not only queued); each step record then also holds
:func:`~aidaptiv_ds.bench.probes.gpu_memory` (peak allocated/reserved device memory of the step so
far, NVML's used device memory, pinned host memory), with torch's peaks reset after setup.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

#: a single rank's launcher environment, where the runner gave none (set in :func:`main`, not at import: a test
#: importing this module must not leave a fixed port in its process's environment)
_SINGLE_RANK_ENV = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                    ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29631"))


class ResultFile:
    """The worker's result dict, rewritten atomically on every :meth:`update`.

    Until the first step, each phase change closes the phase before it: its peak RSS (``VmHWM``, reset
    as the next phase starts) into ``setup_phase_peak_rss_bytes`` and the RSS it ended at into
    ``setup_phase_end_rss_bytes`` (import, build, partition, initialize: where a process peak outside
    the steps comes from).
    """

    def __init__(self, path: str, **init) -> None:
        self.path = path
        self.data: dict = {"ok": False, "error": None, "phase": "start", "steps": [], "setup_phase_peak_rss_bytes": {},
                           "setup_phase_end_rss_bytes": {}, **init}
        self._setup = True
        self.write()

    def update(self, **kw) -> None:
        from .probes import peak_rss_bytes, reset_peak_rss, rss_bytes

        new, old = kw.get("phase"), self.data.get("phase")
        if self._setup and new is not None and new != old:
            now = rss_bytes()
            peaks = self.data["setup_phase_peak_rss_bytes"]
            peaks[old] = max(peaks.get(old, 0), peak_rss_bytes(), now)
            self.data["setup_phase_end_rss_bytes"][old] = now
            reset_peak_rss()
            self._setup = not str(new).startswith("step")
        self.data.update(kw)
        self.data["rss_bytes"] = rss_bytes()
        self.write()

    def setup_peak(self) -> int:
        """The largest of the setup phases' peaks (bytes)."""
        return max(self.data["setup_phase_peak_rss_bytes"].values(), default=0)

    def write(self) -> None:
        from ..io.atomic import atomic_write

        atomic_write(self.path, json.dumps(self.data, indent=1).encode())


def batch(seed: int, index: int, micro: int, seq: int, vocab: int):
    """The token batch (``micro`` sequences of ``seq`` tokens) of micro-batch ``index`` of the run, counted
    from 0 over all optimizer steps (step ``i``'s micro-batch ``j`` is ``i * gradient_accumulation + j``):
    the same for every backend."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randint(0, vocab, (micro, seq), generator=g)


def _counters():
    from ..telemetry import counters

    return counters.snapshot()


def build_engine(spec: dict, out: ResultFile, clock) -> tuple:
    """Set up the backend's I/O probes, build and initialise the model, partition it, build the
    engine. Returns ``(engine, settings, shape)``."""
    from ..integration.bench_patches import dedup_native_swap_in, skip_shm_comm_build
    from ..integration.zero_params import full_numel
    from .aio import install_native_aio
    from .backends import TrainSettings, ds_config
    from .models import LlamaShape
    from .probes import time_future_waits

    backend = spec["backend"]
    t_launch = float(spec["t_launch"])
    shape = LlamaShape(**spec["shape"])
    settings = TrainSettings(**spec["settings"])
    cfg = ds_config(backend, settings, spec["cache_dir"], shape.largest_tensor(), shape.n_params())
    out.update(phase="import", ds_config=cfg)
    import torch

    from ..integration.blas_threads import pin_blas_threads

    # every backend's GEMMs on a fixed thread count, the references too: with MKL's dynamic mode DeepSpeed's
    # CPU offload itself is not reproducible run to run on a loaded machine (docs/profiling.md)
    out.update(blas_threads_pinned=pin_blas_threads())
    if backend == "native":
        out.update(aio=install_native_aio(spec.get("aio", "compiled"), clock))
        if spec.get("native_dedup", True):
            dedup_native_swap_in()
        out.update(native_dedup=bool(spec.get("native_dedup", True)))
    elif backend.startswith("aidaptiv"):
        time_future_waits(clock)
    import deepspeed
    from transformers import LlamaForCausalLM

    skip_shm_comm_build()
    if backend.startswith("aidaptiv"):
        from ..integration.hooks import is_installed
        if not is_installed():
            raise RuntimeError("aidaptiv_ds hooks are not installed (AIDAPTIV_DS_NO_AUTOINSTALL=1 in the environment?)")
    dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
    out.update(phase="build", import_s=time.time() - t_launch)
    torch.manual_seed(int(spec["seed"]))
    build = spec.get("build") or ("zero_init" if spec.get("build_under_zero_init") else "whole")
    if build == "unpacked":  # zero.Init as below; the partitions' bytes come from the store `unpack` filled
        if not backend.startswith("aidaptiv"):
            raise ValueError(f"build 'unpacked' needs an aidaptiv_ds backend, not {backend!r}")
        cfg["aidaptiv"].update(run_name=spec["run_name"], from_unpacked=True)
        build = "zero_init"
    if build == "from_pretrained":  # transformers builds it under zero.Init and loads the weights into the partitions
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(cfg)  # noqa: F841 - transformers keeps only a weak reference
        model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
        out.update(phase="initialize", n_params=sum(full_numel(p) for p in model.parameters()),
                   build_s=time.time() - t_launch, partition_s=time.time() - t_launch)
    elif build == "zero_init":  # each parameter is partitioned as it is created (no whole fp32 model)
        # no dtype argument: DeepSpeed 0.19.8 on a CPU accelerator turns any dtype given into bf16
        # (partition_parameters.py:409, an operator precedence slip); from the config it takes the right one
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = LlamaForCausalLM(shape.hf_config())
        out.update(phase="initialize", n_params=sum(full_numel(p) for p in model.parameters()),
                   build_s=time.time() - t_launch, partition_s=time.time() - t_launch)
    else:
        model = LlamaForCausalLM(shape.hf_config())  # HF init runs here, before any partitioning
        if dtype != torch.float32:
            model = model.to(dtype)
        out.update(phase="partition", n_params=sum(p.numel() for p in model.parameters()),
                   build_s=time.time() - t_launch)
        with deepspeed.zero.Init(module=model, config_dict_or_path=cfg):
            pass
    out.update(phase="initialize", partition_s=time.time() - t_launch)
    if settings.activation_checkpointing:  # non-reentrant: reentrant checkpointing and steps inside backward clash
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    return engine, settings, shape


def _engine_info(engine, backend: str) -> dict:
    """The swapper classes DeepSpeed ended up with and, for aidaptiv_ds, the budget and residency plan."""
    from ..integration.zero_params import optimizer_swapper_of, swapper_of

    info = {}
    if backend.startswith("aidaptiv"):
        from ..integration.runtime import current_runtime

        plan = getattr(engine.optimizer, "aidaptiv_plan", None)
        info = {"budget_bytes": current_runtime().budget, "plan": plan.as_dict() if plan is not None else None}
    swapper = swapper_of(next(engine.module.parameters()))
    info["swapper"] = type(swapper).__name__ if swapper is not None else None
    info["optimizer_swapper"] = type(optimizer_swapper_of(engine.optimizer)).__name__
    return info


#: the per-step ``master_bytes`` record: its key -> the runtime's counter
_MASTER_COUNTERS = {"from_params": "master_from_params_bytes", "held": "master_held_bytes",
                    "demand": "master_demand_bytes"}


def _step_record(i: int, wall: float, losses: list[float], before: dict, after: dict, wait_s: float,
                 cpu: tuple[tuple[float, float, int], tuple[float, float, int]]) -> dict:
    """The record of optimizer step ``i`` (from 0): ``losses`` are its micro-batches' (in order), ``wall`` its
    seconds, ``before`` / ``after`` the counters around it, ``wait_s`` the I/O wait seconds within it."""
    (u0, s0, f0), (u1, s1, f1) = cpu  # probes.cpu_times() before and after the step
    return {"step": i + 1, "wall_s": wall, "loss": sum(losses) / len(losses), "micro_batch_losses": list(losses),
            "micro_batches": len(losses), "io_wait_s": wait_s,
            "cpu_user_s": u1 - u0, "cpu_sys_s": s1 - s0, "minor_faults": f1 - f0,
            "rt_io_wait_s": after["io_wait_s"] - before["io_wait_s"],
            "proc_read_bytes": after["proc_read_bytes"] - before["proc_read_bytes"],
            "proc_write_bytes": after["proc_write_bytes"] - before["proc_write_bytes"],
            "cache_read_bytes": after["bytes_read"].get("cache", 0) - before["bytes_read"].get("cache", 0),
            "cache_written_bytes": after["bytes_written"].get("cache", 0) - before["bytes_written"].get("cache", 0),
            "dram_tier_bytes": after["dram_bytes"],
            "optimizer_steps": {k: v - before.get("optimizer_steps", {}).get(k, 0)
                                for k, v in after.get("optimizer_steps", {}).items()},
            "master_bytes": {k: after.get(c, 0) - before.get(c, 0) for k, c in _MASTER_COUNTERS.items()},
            "buffer_pool": {"bytes": after.get("buffer_pool_bytes", 0), "peak_bytes": after.get("buffer_pool_peak_bytes", 0),
                            **{k: after.get(f"buffer_pool_{k}", 0) - before.get(f"buffer_pool_{k}", 0)
                               for k in ("miss_bytes", "released_bytes")}}}


class PhasePeaks:
    """Peak RSS of each phase of one training step (forward, backward, optimizer step), bytes.

    ``VmHWM`` is reset to the current RSS as each phase starts (:func:`.probes.reset_peak_rss`) and read
    as it ends, so each phase's figure is its own high-water mark, and :attr:`peak` their maximum (the
    step's). Where the reset is not allowed (``reset_ok`` False) the figures are peaks since the last
    successful reset, i.e. upper bounds, and the record says so (``phase_peaks_exact``). A phase closed
    more than once (one per micro-batch under gradient accumulation) keeps the occurrence that peaked
    highest: its peak and the RSS it started at (a pair), and the largest swap-buffer peak of any.
    """

    def __init__(self, reset_ok: bool) -> None:
        from .probes import reset_peak_rss, rss_bytes

        self.exact = bool(reset_ok) and reset_peak_rss()
        self.start: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.pool_peaks: dict[str, int] = {}  # aidaptiv_ds's swap buffers (buffer pool and its misses) per phase
        self.seconds: dict[str, float] = {}  # wall seconds per phase, summed over its occurrences
        self._at = rss_bytes()
        self._t = time.perf_counter()
        self._pool = _buffer_pool()
        if self._pool is not None:
            self._pool.reset_peak_live()

    def end(self, phase: str) -> None:
        """Close ``phase``: record the RSS it started at and its peak, and start the next one."""
        from .probes import peak_rss_bytes, reset_peak_rss, rss_bytes

        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._t)
        self._t = now
        peak = max(peak_rss_bytes(), self._at)
        if peak >= self.peaks.get(phase, -1):  # the first occurrence, or one that peaked higher
            self.start[phase] = self._at
            self.peaks[phase] = peak
        if self._pool is not None:
            self.pool_peaks[phase] = max(self.pool_peaks.get(phase, 0), self._pool.reset_peak_live())
        self._at = rss_bytes()
        if self.exact:
            reset_peak_rss()

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)

    def record(self) -> dict:
        """``{"phase_peak_rss_bytes": {phase: bytes}, "phase_start_rss_bytes": {...}, "phase_peaks_exact",
        "phase_s": {phase: wall seconds, summed over the phase's occurrences (one per micro-batch)}}``."""
        return {"phase_s": dict(self.seconds), "phase_peak_rss_bytes": dict(self.peaks),
                "phase_start_rss_bytes": dict(self.start), "phase_peaks_exact": self.exact,
                "phase_peak_swap_buffer_bytes": dict(self.pool_peaks)}


def _buffer_pool():
    """aidaptiv_ds's host buffer pool of this process, if one is in use (budget 0 on a CPU rank)."""
    from ..io.buffers import current_pool

    return current_pool()


def run(spec: dict, out: ResultFile) -> None:
    """Build, partition, train ``spec["steps"]`` optimizer steps (each ``gradient_accumulation`` micro-batches)
    and record everything into ``out``."""
    import torch

    from . import probes
    from .probes import WaitClock, peak_rss_bytes, process_peak_rss_bytes, reset_peak_rss, rss_bytes

    from .backends import LAYER_MAJOR_BACKENDS

    backend = spec["backend"]
    t_launch = float(spec["t_launch"])
    clock = WaitClock()
    engine, settings, shape = build_engine(spec, out, clock)
    device = engine.device
    cuda = device.type == "cuda"
    probes.reset_gpu_peaks(device)
    setup_peak = probes.process_peak_rss_bytes()
    # closing the last setup phase resets VmHWM, and with it what ru_maxrss reads: keep the setup's peak
    out.update(phase="step 1", device=str(device), setup_s=time.time() - t_launch, **_engine_info(engine, backend))
    setup_peak = max(setup_peak, out.setup_peak())
    reset_ok = reset_peak_rss()
    out.update(peak_rss_setup_bytes=setup_peak, peak_rss_reset=reset_ok)
    steps_peak = rss_bytes()
    tl = None
    if spec.get("timeline"):
        from ..telemetry.timeline import enable

        tl = enable(engine, steps=spec["timeline"], run_dir=os.path.dirname(os.path.abspath(out.path)))
    prof = None
    steps = int(spec["steps"])
    ga = int(settings.gradient_accumulation)
    for i in range(steps):
        if spec.get("profile") and i == int(spec.get("profile_after", 2)):
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        # the step's micro-batches, made before its clock starts (a few KiB of token ids each)
        xs = [batch(int(spec["seed"]), i * ga + j, settings.micro_batch, settings.seq, shape.vocab).to(device)
              for j in range(ga)]
        if cuda:
            torch.cuda.synchronize(device)
        before, w0 = _counters(), clock.seconds
        phases = PhasePeaks(reset_ok)
        cpu0 = probes.cpu_times()
        t0 = time.perf_counter()
        losses = []
        if backend in LAYER_MAJOR_BACKENDS:  # one engine.train_batch per optimizer step: a single phase
            engine.train_batch(iter([{"input_ids": x, "labels": x} for x in xs]))
            phases.end("step")
            losses = list(engine.aidaptiv_losses)
        for x in (() if backend in LAYER_MAJOR_BACKENDS else xs):
            # DeepSpeed's convention: engine.step() after every micro-batch, the optimizer on the last
            loss = engine(input_ids=x, labels=x).loss
            phases.end("forward")
            engine.backward(loss)
            phases.end("backward")
            engine.step()
            phases.end("step")
            losses.append(loss.detach().float())
        losses_v = [float(v) for v in losses]  # after the step: no device sync between its micro-batches
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        rec = _step_record(i, wall, losses_v, before, _counters(), clock.seconds - w0, (cpu0, probes.cpu_times()))
        rec.update(ds_global_steps=int(getattr(engine, "global_steps", -1)),
                   ds_micro_steps=int(getattr(engine, "micro_steps", -1)))
        steps_peak = max(steps_peak, phases.peak)
        rec.update(rss_bytes=rss_bytes(), peak_rss_bytes=steps_peak, **phases.record(), **probes.gpu_memory(device))
        out.data["steps"].append(rec)
        extra = {"first_step_s": time.time() - t_launch} if i == 0 else {}
        out.update(phase=f"step {i + 2}" if i + 1 < steps else "finish", peak_rss_steps_bytes=steps_peak,
                   **extra)
    if prof is not None:
        prof.disable()
        prof.dump_stats(spec["profile"])
    if backend.startswith("aidaptiv"):
        from ..integration.runtime import current_runtime

        before, t0 = _counters(), time.perf_counter()
        current_runtime().flush()
        after = _counters()
        out.data["tail"] = {"wall_s": time.perf_counter() - t0,
                            "proc_write_bytes": after["proc_write_bytes"] - before["proc_write_bytes"],
                            "cache_written_bytes": (after["bytes_written"].get("cache", 0)
                                                    - before["bytes_written"].get("cache", 0))}
    if tl is not None:  # after the flush: a last recorded step's write-back is in its tail
        tl.close()
        out.data["timeline"] = tl.written
    steps_peak = max(steps_peak, peak_rss_bytes())
    out.update(ok=True, phase="done", peak_rss_steps_bytes=steps_peak,
               peak_rss_process_bytes=max(setup_peak, steps_peak, process_peak_rss_bytes()), wait_calls=clock.calls)


def memory_detail() -> dict:
    """Where the bytes are now (``spec["trace_detail"]``, for :class:`.probes.RssTrace`): the C heap
    (:func:`.probes.heap_bytes`), aidaptiv_ds's DRAM tier by slice kind and its host buffer pool's bytes in use."""
    from .probes import heap_bytes, smaps_rss

    d = heap_bytes()
    ranges = {}
    rt = None
    try:
        from ..integration.runtime import current_runtime

        rt = current_runtime()
    except Exception:  # noqa: BLE001 - no runtime yet (or not aidaptiv_ds)
        pass
    if rt is not None:
        by_kind: dict = {}
        for sl in rt.tier.slices():
            k = (sl.kind or "?") + ("/ref" if sl.refs else "/pre" if sl.prefetched else "")
            by_kind[k] = by_kind.get(k, 0) + sl.nbytes
        d["tier"] = by_kind
        pool = getattr(rt, "buffer_pool", None)
        if pool is not None:
            d["pool_used"] = pool.capacity - pool.free_bytes()
            ranges["pool"] = (pool._start, pool._start + pool.capacity)
    d["rss_by"] = smaps_rss(ranges)
    d["py_blocks"] = sys.getallocatedblocks()  # pymalloc's blocks (its arenas are anonymous mappings)
    return d


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m aidaptiv_ds.bench.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    for k, v in _SINGLE_RANK_ENV:
        os.environ.setdefault(k, v)
    with open(argv[0]) as f:
        spec = json.load(f)
    out = ResultFile(argv[1], backend=spec["backend"], pid=os.getpid())
    from ..process_group import destroy_gloo_group_at_exit
    from .probes import RssTrace

    destroy_gloo_group_at_exit()  # every backend, DeepSpeed's too: no abort at exit (process_group.py)
    detail = bool(spec.get("trace_detail"))  # smaps costs ~50 ms a read: sample less often then
    trace = RssTrace(lambda: out.data.get("phase"), every_s=0.25 if detail else 0.05,
                     detail=memory_detail if detail else None).start()
    try:
        run(spec, out)
    except BaseException as e:  # noqa: BLE001 - recorded for the report, then re-raised as an exit code
        from .probes import process_peak_rss_bytes

        trace.stop()
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:],
                   rss_trace=trace.samples(),
                   peak_rss_process_bytes=max(process_peak_rss_bytes(), out.setup_peak(),
                                              out.data.get("peak_rss_setup_bytes") or 0,
                                              out.data.get("peak_rss_steps_bytes") or 0))
        print(traceback.format_exc(), file=sys.stderr)
        return 1
    trace.stop()
    out.update(rss_trace=trace.samples())
    return 0


if __name__ == "__main__":
    from ..process_group import run_worker

    run_worker(main)  # no abort in finalization after the result is written (process_group.py)
