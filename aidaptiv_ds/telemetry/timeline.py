"""A profile of training steps N..M, per rank: what computed and what read or wrote, when.

Switch it on for one engine (any DeepSpeed engine: aidaptiv_ds's, DeepSpeed's own offloads)::

    from aidaptiv_ds.telemetry import timeline
    timeline.enable(engine, steps=(3, 4), run_dir="output/run")     # writes output/run/timeline-rank<R>.json

or from the DeepSpeed config, ``"aidaptiv": {"profile": {"steps": "3-4", "dir": "output/run"}}``
(``deepspeed.initialize`` then enables it), or ``aidaptiv-ds compare --timeline 3-4``. Draw a step with
``aidaptiv-ds timeline output/run --output step.png``; open the JSON in Perfetto
(https://ui.perfetto.dev) or ``chrome://tracing``. ``docs/profiling.md`` says how to read it.

What is recorded, into a :class:`~aidaptiv_ds.spans.Recorder`, from the first forward of step N to
the first forward after step M (or to :meth:`Timeline.close`, also called at interpreter exit);
steps count optimizer steps from 1, as ``engine.global_steps`` does. A step ends when
``engine.step()`` returns at its accumulation boundary; the time until the next step's first forward
is its *tail* (the write-back still in flight, the next step's read-ahead):

* lane ``step``: ``step k`` and its phases ``forward`` (the root module's forward), ``backward``
  (``engine.backward``), ``optimizer step`` (``engine.step``), one per micro-batch;
* lane ``compute``: ``forward <block>`` / ``backward <block>`` of each block (module hooks: a block is
  an item of an ``nn.ModuleList`` (the transformer layers), or a module with parameters of its own
  outside those: embeddings, final norm, head); ``recompute <block>`` for a forward run inside the
  backward (reentrant activation checkpointing; a non-reentrant recomputation stops early, before
  its module returns, and leaves no span). Backward of a block runs from the gradient of its output
  to the gradient of its input (tensor hooks; the gradient of its parameters for a block whose
  inputs need none, e.g. the embedding);
* the waits: ``aidaptiv::io_wait`` (the runtime's I/O wait timer) and ``aidaptiv::io_blocked`` (any
  blocking wait on an I/O request), nested in the lane of the code that waited;
* every system call of the I/O engine, per drive and worker, with its bytes (:mod:`aidaptiv_ds.io.engine`);
* whatever code marks with :func:`aidaptiv_ds.spans.span` (the optimizer's sub-groups, swaps).

Outside the window the hooks return after one comparison, and nothing is registered on tensors.

[Note: hook order] Our forward pre-hooks are registered after DeepSpeed's (which fetch the
parameters) and our forward post-hooks are prepended before DeepSpeed's (which release them), so a
block's forward span is its compute plus the fetches of its sub-modules' parameters, and the wait
spans inside it show how much of that was waiting.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time

from .. import spans
from ..errors import AidaptivConfigError
from . import timeline_trace

log = logging.getLogger("aidaptiv_ds")


def parse_steps(value, field: str = "aidaptiv.profile.steps") -> tuple[int, int]:
    """``(first, last)`` optimizer steps (1-based, inclusive) from ``3``, ``"3"``, ``"3-4"``, ``[3, 4]``.

    Raises:
        AidaptivConfigError: anything else, or ``first < 1`` or ``last < first`` (names ``field``).
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, int):
            first = last = value
        elif isinstance(value, str):
            a, _, b = value.strip().partition("-")
            first, last = int(a), int(b or a)
        elif isinstance(value, (list, tuple)) and len(value) == 2:
            first, last = (int(v) for v in value)
        else:
            raise TypeError
    except (TypeError, ValueError):
        raise AidaptivConfigError(f"{field}: {value!r} is not a step range. Fix: give a step such as 3, or a range "
                                  f"such as \"3-4\" or [3, 4] (optimizer steps, counted from 1)") from None
    if first < 1 or last < first:
        raise AidaptivConfigError(f"{field}: {value!r}: the range needs 1 <= first <= last. Fix: give steps such as "
                                  f"\"3-4\" (optimizer steps, counted from 1)")
    return first, last


def _rank() -> int:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


def _has_own_params(m) -> bool:
    return next(m.parameters(recurse=False), None) is not None


def select_blocks(root, modules="blocks") -> list[tuple[str, str, object]]:
    """``(label, qualified name, module)`` of the modules to time, in registration order.

    Args:
        root: the model (``engine.module``).
        modules: ``"blocks"`` (items of every outermost ``nn.ModuleList``/``nn.Sequential``, and modules
            with parameters of their own outside them), ``"all"`` (every module with parameters of its
            own), or a callable ``(name, module) -> bool``.

    Raises:
        AidaptivConfigError: ``modules`` is none of these.
    """
    import torch

    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    named = [(n, m) for n, m in root.named_modules() if n]
    if callable(modules):
        picked = [(n, m) for n, m in named if modules(n, m)]
    elif modules == "all":
        picked = [(n, m) for n, m in named if _has_own_params(m)]
    elif modules == "blocks":
        lists, picked, inside = set(), [], []
        for n, m in named:
            if any(n.startswith(p + ".") for p in inside):
                continue
            parent = n.rsplit(".", 1)[0] if "." in n else ""
            if isinstance(m, containers):
                lists.add(n)
                continue
            if parent in lists or _has_own_params(m):
                picked.append((n, m))
                inside.append(n)
    else:
        raise AidaptivConfigError(f"aidaptiv.profile.modules: {modules!r}; use \"blocks\" or \"all\"")

    def label(n):
        parts = n.split(".")
        return ".".join(parts[-2:]) if len(parts) > 1 and parts[-1].isdigit() else parts[-1]
    return [(label(n), n, m) for n, m in picked]


def _tensors(x, out: list) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    return out


class Timeline:
    """Records steps ``first..last`` of ``engine`` into ``run_dir/timeline-rank<R>.json``, written when
    the step after ``last`` begins (the last step's tail: its write-back, the next read-ahead) or at
    :meth:`close` (also at interpreter exit).

    Args:
        engine: a DeepSpeed engine (``.module``, ``.backward``, ``.step``, ``.global_steps``) or any
            object with ``.module``; a bare ``nn.Module`` works too (then call :meth:`end_step` after
            each optimizer step).
        steps: ``(first, last)`` or anything :func:`parse_steps` takes.
        run_dir: where the file goes (default: the current directory).
        modules: which modules are timed (:func:`select_blocks`).
        rank: the file's rank (default: ``torch.distributed``'s, else ``$RANK``, else 0).

    Raises:
        AidaptivConfigError: bad ``steps`` or ``modules``.
    """

    def __init__(self, engine, steps, run_dir: str | None = None, modules="blocks", rank: int | None = None) -> None:
        import torch

        self.first, self.last = parse_steps(steps)
        self.engine = engine
        inner = getattr(engine, "module", None)
        self.root = inner if isinstance(inner, torch.nn.Module) and inner is not engine else engine
        if not isinstance(self.root, torch.nn.Module):
            raise TypeError(f"timeline: {type(engine).__name__} is neither an nn.Module nor has one as .module")
        self.run_dir = os.path.abspath(run_dir or ".")
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise AidaptivConfigError(f"aidaptiv.profile.dir: {self.run_dir!r} cannot be created ({e.strerror}). Fix: "
                                      f"give a writable directory such as \"output/run\"") from None
        if not os.access(self.run_dir, os.W_OK | os.X_OK):
            raise AidaptivConfigError(f"aidaptiv.profile.dir: {self.run_dir!r} is not writable. Fix: give a writable "
                                      f"directory such as \"output/run\"")
        self.rank = _rank() if rank is None else int(rank)
        self.path = os.path.join(self.run_dir, timeline_trace.FILE_PATTERN.format(rank=self.rank))
        self.step = int(getattr(engine, "global_steps", 0) or 0) + 1  # the step the next forward belongs to
        self.rec: spans.Recorder | None = None
        self.written: str | None = None
        self.closed = False
        self._steps: list[dict] = []
        self._step_start: float | None = None
        self._micro = 0
        self._in_backward = False
        self._fwd_start: dict[int, list[float]] = {}
        self._bwd: dict[tuple[int, int], list] = {}
        self._param_handles: list = []
        self._lock = threading.Lock()
        self.blocks = select_blocks(self.root, modules)
        self._handles = [self.root.register_forward_pre_hook(self._root_pre),
                         self.root.register_forward_hook(self._root_post)]
        for k, (_, _, m) in enumerate(self.blocks):
            self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre, k), with_kwargs=True))
            self._handles.append(m.register_forward_hook(functools.partial(self._post, k), prepend=True))
        self._wrapped: dict[str, object] = {}
        if self.root is not engine:
            for name, wrap in (("backward", self._wrap_backward), ("step", self._wrap_step)):
                orig = getattr(engine, name, None)
                if callable(orig):
                    self._wrapped[name] = engine.__dict__.get(name)
                    setattr(engine, name, wrap(orig))
        atexit.register(self.close)

    # ------------------------------------------------------------------ window
    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._steps and self._steps[-1]["until"] is None:
            self._steps[-1]["until"] = now  # the previous step's tail ends here
        if self.rec is not None and self.step > self.last:
            self._finish(complete=True)  # the last step's tail ended: step last+1 is not recorded
        if self.rec is None and self.first <= self.step <= self.last and not self.closed:
            self.rec = spans.start()
        self._step_start = time.perf_counter()
        self._micro = 0

    def end_step(self) -> None:
        """Close the current optimizer step (the wrapped ``engine.step`` calls this at each boundary)."""
        t1 = time.perf_counter()
        if self.rec is not None and self._step_start is not None:
            self._flush_backward()
            self.rec.add(f"step {self.step}", "step", "step", self._step_start, t1, {"step": self.step})
            self._steps.append({"step": self.step, "start": self._step_start, "end": t1, "until": None})
        self._clear_param_hooks()
        self._fwd_start.clear()  # pre-hooks of recomputations stopped early (non-reentrant checkpointing)
        self._step_start = None
        self._in_backward = False
        self.step += 1
        # [Note: the tail] after the last step the recording goes on until the next forward (or close()):
        # the step's write-back, which the engine finishes after engine.step() returned, and the
        # read-ahead for the next step are part of what the step costs, so they are in the file

    def _finish(self, complete: bool) -> None:
        rec = self.rec
        self.rec = None
        if spans.ACTIVE is rec:
            spans.stop()
        if rec is None:
            return
        self._flush_backward()
        stop = time.perf_counter()
        meta = {"rank": self.rank, "pid": os.getpid(), "wall_origin": rec.wall_origin,
                "requested": [self.first, self.last], "complete": complete,
                "steps": [{"step": s["step"], "start_s": s["start"] - rec.origin, "end_s": s["end"] - rec.origin,
                           "until_s": (s["until"] or stop) - rec.origin} for s in self._steps],
                "blocks": [label for label, _, _ in self.blocks]}
        self.written = timeline_trace.write(self.path, timeline_trace.to_chrome(rec.events, rec.origin, meta))
        log.info("aidaptiv_ds: timeline of steps %d-%d written to %s", self.first, self.last, self.written)

    def close(self) -> None:
        """Remove the hooks; write what was recorded if the file is not written yet (``complete`` false
        if a requested step is missing)."""
        if self.closed:
            return
        self.closed = True
        if self.rec is not None:
            self._finish(complete=self.step > self.last)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._clear_param_hooks()
        for name, prev in self._wrapped.items():
            if prev is None:
                self.engine.__dict__.pop(name, None)
            else:
                setattr(self.engine, name, prev)
        self._wrapped = {}
        atexit.unregister(self.close)

    # ------------------------------------------------------------------ engine methods
    def _wrap_backward(self, orig):
        @functools.wraps(orig)
        def backward(*a, **kw):
            if self.rec is None:
                return orig(*a, **kw)
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self._in_backward = False
                rec = self.rec
                if rec is not None:
                    self._flush_backward()
                    rec.add("backward", "phase", "step", t0, time.perf_counter(), {"micro": self._micro - 1})
        return backward

    def _wrap_step(self, orig):
        @functools.wraps(orig)
        def step(*a, **kw):
            before = getattr(self.engine, "global_steps", None)
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                after = getattr(self.engine, "global_steps", None)
                boundary = before is None or after != before
                if self.rec is not None:
                    self.rec.add("optimizer step" if boundary else "optimizer step (accumulating)", "phase", "step",
                                 t0, time.perf_counter(), {"boundary": boundary})
                if boundary:
                    self.end_step()
        return step

    # ------------------------------------------------------------------ module hooks
    def _root_pre(self, module, args):
        self._in_backward = False  # a new micro-batch (recomputation runs blocks, never the root)
        if self._step_start is None:
            self._begin_step()
        if self.rec is not None:
            spans.set_thread_lane()
            self._root_t0 = time.perf_counter()

    def _root_post(self, module, args, output):
        rec = self.rec
        if rec is not None and not self._in_backward:
            rec.add("forward", "phase", "step", self._root_t0, time.perf_counter(), {"micro": self._micro})
            self._micro += 1

    def _pre(self, k, module, args, kwargs):
        if self.rec is None:
            return None
        spans.set_thread_lane()
        self._fwd_start.setdefault(k, []).append(time.perf_counter())
        import torch

        if torch.is_grad_enabled():  # also in a recomputation: a checkpointed block's backward follows it
            inputs = _tensors(args, _tensors(kwargs, []))
            key = (k, self._micro)
            if inputs:
                for x in inputs:
                    x.register_hook(functools.partial(self._bwd_end, key))
            else:
                for p in module.parameters():
                    if p.requires_grad:
                        self._param_handles.append(p.register_hook(functools.partial(self._bwd_end, key)))
        return None

    def _post(self, k, module, args, output):
        rec = self.rec
        starts = self._fwd_start.get(k)
        if rec is None or not starts:
            return None
        t0 = starts.pop()
        label, name, _ = self.blocks[k]
        kind = "recompute" if self._in_backward else "forward"
        rec.add(f"{kind} {label}", kind, "compute", t0, time.perf_counter(),
                {"block": k, "module": name, "micro": self._micro})
        import torch

        if torch.is_grad_enabled():
            key = (k, self._micro)
            for x in _tensors(output, []):
                x.register_hook(functools.partial(self._bwd_start, key))
        return None

    def _bwd_start(self, key, grad):
        t = time.perf_counter()
        self._in_backward = True
        spans.set_thread_lane()
        with self._lock:
            e = self._bwd.setdefault(key, [t, None])
            e[0] = t if e[0] is None else min(e[0], t)
        return None

    def _bwd_end(self, key, grad):
        t = time.perf_counter()
        with self._lock:
            e = self._bwd.setdefault(key, [None, t])
            e[1] = t if e[1] is None else max(e[1], t)
        return None

    def _flush_backward(self) -> None:
        """Record the backward spans seen so far; one without an end ends where the next one starts."""
        rec = self.rec
        with self._lock:
            pending, self._bwd = self._bwd, {}
        if rec is None or not pending:
            return
        # [Note: touching ends] the gradient of block k's input is the gradient of block k-1's output:
        # both hooks fire on that one tensor, k-1's first, so each span ends where the next one starts
        # (spans of one Chrome-trace lane must nest, never overlap)
        todo = sorted((e[0], e[1], key) for key, e in pending.items() if e[0] is not None)
        now = time.perf_counter()
        for i, (t0, t1, (k, micro)) in enumerate(todo):
            nxt = todo[i + 1][0] if i + 1 < len(todo) else None
            if t1 is None or t1 < t0:
                t1 = nxt if nxt is not None else now
            elif nxt is not None:
                t1 = min(t1, nxt)
            label, name, _ = self.blocks[k]
            rec.add(f"backward {label}", "backward", "compute", t0, t1, {"block": k, "module": name, "micro": micro})

    def _clear_param_hooks(self) -> None:
        for h in self._param_handles:
            h.remove()
        self._param_handles = []


_TIMELINES: dict[int, Timeline] = {}


def enable(engine, steps, run_dir: str | None = None, modules="blocks", rank: int | None = None) -> Timeline:
    """Record steps ``steps`` of ``engine`` into ``run_dir/timeline-rank<R>.json`` (see :class:`Timeline`).

    One timeline per engine: enabling again replaces the previous one (closed first). Returns the
    :class:`Timeline`; its ``path`` is the file, ``written`` is set once the file is written.

    Raises:
        AidaptivConfigError: bad ``steps`` or ``modules``.
    """
    disable(engine)
    tl = Timeline(engine, steps, run_dir=run_dir, modules=modules, rank=rank)
    _TIMELINES[id(engine)] = tl
    return tl


def disable(engine) -> str | None:
    """Stop the engine's timeline; returns the file written (a partial one if the window was still open)."""
    tl = _TIMELINES.pop(id(engine), None)
    if tl is None:
        return None
    tl.close()
    return tl.written
