"""Optimizer swapper: DeepSpeed's ``PartitionedOptimizerSwapper`` contract on our store and tier.

Per optimizer sub-group (``docs/deepspeed-seams.md`` §2):

* **One extent, one transfer.** The fp32 master weights and every per-element optimizer state
  tensor (Adam's ``exp_avg``, ``exp_avg_sq``) are slots of one extent, read and written as one
  sequential transfer into one host slice; the tensors are views of that slice (no copies). Where
  the slots lie and in which dtype is the sub-group's :class:`~aidaptiv_ds.tiers.unit.UnitLayout`:
  Adam's moments in the dtype the user picks (``optimizer_state.moments``, [Note: moment dtype]).
* **Pipelined.** ``swap_in_optimizer_state(i, async_parameter=i+1)`` waits for sub-group *i* and
  starts reading *i+1*; ``swap_out_optimizer_state(i)`` issues the write-back of *i* at write-back
  priority and returns, so reading *i+1*, updating *i* and writing *i-1* overlap.
* **Never write clean data.** A sub-group is dirty only after the optimizer stepped on it (the
  Stage-3 subclass brackets DeepSpeed's initialisation, which swaps sub-groups in and out
  unchanged); a clean swap-out is a drop.
* **DRAM first.** The residency plan (:mod:`aidaptiv_ds.planner.residency`) keeps gradients,
  parameters and whole sub-groups in DRAM as the budget allows; resident sub-groups are never
  written per step, resident gradients never leave DRAM. Everything else is written and counted.
* **Gradients** come from the engine's :class:`~aidaptiv_ds.integration.gradients.GradientStore`
  (one accumulation slice per sub-group, in DRAM within the budget, on the drive beyond it): the
  swap-in binds the sub-group's fp32 ``.grad`` to it (the slice itself in fp32 accumulation, an exact
  ``Tensor.to`` widening otherwise, zeros for a sub-group that got no gradient) and prefetches the
  next sub-group's with its state; the swap-out after the step drops it unwritten.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import torch

from ..io.buffers import alloc_aligned, byte_view, round_down, round_up
from ..io.engine import READ_DEMAND, READ_PREFETCH, WRITE_BACK
from ..planner.residency import ResidencyPlan
from ..spans import spanned
from ..tiers.unit import MOMENT_FORMATS, MomentFormat, TieredUnit, UnitLayout, optimizer_layout
from ..errors import AidaptivConfigError
from .errors import DeepSpeedContractError
from .gradients import GradientStore
from .host_step import is_torch_adam
from .master_links import Fill, MasterLinks
from .phase import EnginePhase, Phase
from .runtime import Runtime

log = logging.getLogger("aidaptiv_ds")

#: Optimizer classes whose per-element state is two tensors (first and second moment).
_TWO_STATE = ("Adam", "AdamW", "DeepSpeedCPUAdam", "FusedAdam", "DeepSpeedCPUAdagrad")


def expected_state_slots(optimizer) -> int:
    """Per-element state tensors the optimizer will create (2 for Adam-type, else 0: grown on demand)."""
    name = type(optimizer).__name__
    return 2 if any(name == n or name.endswith(n) for n in _TWO_STATE) else 0


@dataclasses.dataclass(frozen=True)
class SubgroupFormat:
    """How a sub-group's extent is laid out: the master weights' dtype, the moments' format and how many
    per-element states the optimizer keeps. Known before any sub-group exists, so the plan is made from it
    before the swapper is built (``stage3.py``).

    Raises (at construction):
        AidaptivConfigError: the moments are stored narrower than the master and the optimizer is not torch's
            Adam or AdamW (``host_step.is_torch_adam``), or they are wider than the master.
    """
    dtype: torch.dtype
    moments: MomentFormat
    expected_states: int

    @classmethod
    def of(cls, optimizer, dtype: torch.dtype, moments: MomentFormat | str | None = None) -> SubgroupFormat:
        """The format for ``optimizer`` with ``dtype`` masters and ``moments`` (a format, its name, or None:
        plain ``dtype``), checked ([Note: moment dtype])."""
        if isinstance(moments, str):
            moments = MOMENT_FORMATS[moments]
        fmt = cls(dtype, moments if moments is not None else MomentFormat(str(dtype)[6:], dtype),
                  expected_state_slots(optimizer))
        if fmt.narrow and (fmt.moments.bytes_per_element > dtype.itemsize or not is_torch_adam(optimizer)):
            raise AidaptivConfigError(
                f"aidaptiv.optimizer_state.moments is {fmt.moments.name!r}, but the optimizer is "
                f"{type(optimizer).__module__}.{type(optimizer).__name__} with {str(dtype)[6:]} master weights; "
                f"narrow moments need torch's Adam or AdamW (stepped in tiles that widen them). Fix: set "
                f"\"torch_adam\": true in the optimizer's params (with \"type\": \"Adam\" or \"AdamW\"), or "
                f"\"moments\": \"fp32\"")
        return fmt

    @property
    def elsize(self) -> int:
        return self.dtype.itemsize

    @property
    def narrow(self) -> bool:
        """The moments are stored in another format than the master weights (bf16 or int8)."""
        return self.moments.dtype != self.dtype or self.moments.block > 0

    def layout(self, numel: int, slots: int) -> UnitLayout:
        """A sub-group's layout (:func:`~aidaptiv_ds.tiers.unit.optimizer_layout`; :attr:`expected_states` of the
        slots are Adam's moments)."""
        return optimizer_layout(numel, self.dtype, self.moments, slots, self.expected_states)


@dataclasses.dataclass(frozen=True)
class SwapperLinks:
    """What the swapper works with besides DeepSpeed's calls, fixed when the engine's plan is made and handed to
    the swapper at its construction (``stage3.py`` ``_aidaptiv_plan``).

    Attributes:
        plan: which sub-groups stay in DRAM (indexed in creation order); None: none.
        gradients: the gradient store (each sub-group's fp32 gradient); None: DeepSpeed binds its own.
        wanted: ``fn(index) -> bool``: the sub-group is still to be stepped (worth reading ahead); None: all.
        holds_master: ``fn(index) -> bool``: keep a dropped partition's bytes for that sub-group's master slot
            ([Note: master weights from the parameter reads]); None: never.
        master_hold_limit: bytes of parameter slices kept alive for that at most.
    """
    plan: ResidencyPlan | None = None
    gradients: GradientStore | None = None
    wanted: Callable[[int], bool] | None = None
    holds_master: Callable[[int], bool] | None = None
    master_hold_limit: int = 0


@dataclasses.dataclass
class _Group:
    key: str
    numel: int
    layout: UnitLayout  # where the master and each state slot lie, and their dtypes (capacity: every slot)
    index: int  # the sub-group's index (DeepSpeed's sub_group_id: creation order)
    state_names: list = dataclasses.field(default_factory=list)
    resident: bool = False
    slice: TieredUnit | None = None
    speculating: bool = False  # a speculative step's new state goes to the shadow extent
    keep_gradient: bool = False  # its gradient outlives the speculative step (a redo may need it)
    changed: bool = False  # edited outside a step while the state is rebuilt: the next swap-out writes it

    @property
    def valid_slots(self) -> int:
        return 1 + len(self.state_names)

    @property
    def slots(self) -> int:
        """Capacity of the extent in slots (master + states)."""
        return len(self.layout.slots)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the master slot (slot 0: ``numel`` x the master dtype's size)."""
        return self.layout.slots[0].nbytes


class AidaptivOptimizerSwapper:
    """Holds every swappable sub-group of one DeepSpeed Stage-3 optimizer.

    Args:
        runtime: the process runtime.
        optimizer: the wrapped torch/DeepSpeed optimizer (its ``state`` dict is read and rebound).
        dtype: master-weight dtype (fp32 unless DeepSpeed runs bf16 master weights).
        engine_id: distinguishes the sub-group keys of several engines in one process.
        phase: the engine's phase record (a fresh one, ``TRAINING``, when not given).
        moments: how Adam's two moments are stored on the tiers (a :class:`~aidaptiv_ds.tiers.unit.MomentFormat`
            or its name, ``"fp32"``/``"bf16"``/``"int8"``; default: plain ``dtype``); see [Note: moment dtype].

    Raises:
        AidaptivConfigError: the moments are stored narrower than ``dtype`` and the optimizer is not torch's
            Adam or AdamW (``host_step.is_torch_adam``), or they are wider than ``dtype``.

    [Note: moment dtype]
    With ``"optimizer_state": {"moments": "bf16"}`` Adam's ``exp_avg`` and ``exp_avg_sq`` are bf16 slots
    after the fp32 master: 8 bytes per parameter instead of 12 read and written per step. The optimizer
    works on views of those slots as usual; the tiled host step widens each tile to fp32, steps it with
    torch's arithmetic and rounds it back (round-to-nearest-even), so the update of the master weights is
    torch's fp32 update from moments that were rounded after the previous step: not bit-identical with fp32
    moments, and the default stays fp32. The first step's moments are created by torch in fp32 and rounded
    into the slots when the step ends (``_adopt_states``). Checkpoints store them widened to fp32 (exact), so
    a resume in bf16 continues bit-exactly and a checkpoint can be resumed with either setting.

    With ``"int8"`` each moment slot holds uint8 codes and an fp32 scale per block of 256 (``tiers/blockwise.py``,
    [Note: quantized slots] in ``tiers/unit.py``): 2.03 bytes per parameter for both. The optimizer's
    ``exp_avg``/``exp_avg_sq`` are views of the codes between steps; the tiled step dequantizes each tile, steps it
    and quantizes it back (:meth:`moment_slots` hands it the slots). Adam's state names sort as ``exp_avg``,
    ``exp_avg_sq``: the first slot takes the signed map, the second (never negative) the unsigned one. A checkpoint
    keeps the codes beside the dequantized fp32 rows, so a resume on the same ranks continues bit-exactly.
    """

    def __init__(self, runtime: Runtime, optimizer, dtype: torch.dtype, engine_id: int,
                 phase: EnginePhase | None = None, moments: MomentFormat | str | None = None,
                 links: SwapperLinks | None = None, owner=None, fmt: SubgroupFormat | None = None) -> None:
        self.rt = runtime
        self.optimizer = optimizer
        self._owner = owner  # weakref to the Stage-3 optimizer that built this swapper
        #: the extent layout (master dtype, moments' format, states), checked ([Note: moment dtype]); the Stage-3
        #: subclass passes the one it planned with
        self.format = fmt if fmt is not None else SubgroupFormat.of(optimizer, dtype, moments)
        if self.format.dtype != dtype:
            raise ValueError(f"the sub-group format's master dtype {self.format.dtype} is not the swapper's {dtype}")
        self.engine_id = engine_id
        self.groups: dict[str, _Group] = {}
        self.order: list[str] = []
        #: the engine's phase ([Note: phases] in ``phase.py``; the Stage-3 subclass passes its own)
        self.phase = phase if phase is not None else EnginePhase()
        links = links if links is not None else SwapperLinks()
        self.plan = links.plan
        self.gradients = links.gradients
        self.wanted = links.wanted
        self.master_copied_bytes = 0  # master bytes filled from parameter slices instead of read
        self.master_demand_bytes = 0  # master bytes read on demand because no parameter slice had them
        self.master_held_bytes = 0  # of the copied bytes, those kept from a dropped slice until the slice came
        # [Note: master weights from the parameter reads]: which partition fills which master slot, how far each
        # fill is, and the kept buffers' bound; whether a sub-group waits for its slice
        self.master_links = MasterLinks(links.master_hold_limit)
        self.holds_master = links.holds_master
        self.swap_folder = os.path.join(runtime.namespace.rank_dir(0), f"optimizer{engine_id}")
        os.makedirs(self.swap_folder, exist_ok=True)

    @property
    def owner(self):
        """The Stage-3 optimizer this swapper serves (None once it is gone)."""
        return self._owner() if self._owner is not None else None

    # ------------------------------------------------------------------ helpers
    def _group(self, parameter) -> _Group:
        g = self.groups.get(str(parameter.ds_id))
        if g is None:
            raise DeepSpeedContractError(f"aidaptiv_ds: optimizer sub-group {parameter.ds_id} was never initialised")
        return g

    def _extent_key(self, g: _Group) -> str:
        return f"opt{self.engine_id}/{g.key}"

    def _shadow_key(self, g: _Group) -> str:
        return f"opt{self.engine_id}/{g.key}~"

    @property
    def dtype(self) -> torch.dtype:
        """The master weights' dtype."""
        return self.format.dtype

    @property
    def elsize(self) -> int:
        return self.format.elsize

    @property
    def moments(self) -> MomentFormat:
        """How Adam's moments are stored (plain :attr:`dtype` unless ``optimizer_state.moments`` narrows them)."""
        return self.format.moments

    @property
    def expected_states(self) -> int:
        return self.format.expected_states

    @property
    def narrow(self) -> bool:
        """The moments are stored in another format than the master weights (bf16 or int8)."""
        return self.format.narrow

    def layout(self, numel: int, slots: int) -> UnitLayout:
        """A sub-group's layout (:meth:`SubgroupFormat.layout`)."""
        return self.format.layout(numel, slots)

    def moment_slots(self, index: int) -> dict:
        """``{state name: (Slot, buf)}`` of the sub-group created ``index``-th while its slice is in DRAM, for its
        states stored in another format than the master (the tiled step decodes and encodes them tile by tile);
        empty otherwise."""
        if not self.narrow or not 0 <= index < len(self.order):
            return {}
        g = self.groups[self.order[index]]
        if g.slice is None:
            return {}
        out = {}
        for j, name in enumerate(g.state_names, start=1):
            sl = g.layout.slots[j]
            if sl.quantized or sl.dtype != self.dtype:
                out[name] = (sl, g.slice.buf)
        return out

    def state_dtype(self, g: _Group, name: str) -> torch.dtype:
        """The dtype of the slot holding state ``name`` of ``g``."""
        return g.layout.slots[1 + g.state_names.index(name)].dtype

    def _span(self, g: _Group, slots: int) -> int:
        """Bytes of the first ``slots`` slots, rounded up to the I/O alignment (slots are packed
        end to end, so only the extent's tail is padding)."""
        return round_up(g.layout.prefix_bytes(slots), self.rt.store.alignment)

    def _slot(self, g: _Group, s: TieredUnit, j: int) -> torch.Tensor:
        return g.layout.slots[j].view(s.buf)

    def _writeback(self, g: _Group):
        def write(s: TieredUnit):
            key = self._shadow_key(g) if g.speculating else self._extent_key(g)
            return self.rt.store.write(key, s.buf[: self._span(g, g.valid_slots)], 0, WRITE_BACK)
        return write

    def _new_slice(self, g: _Group, buf: torch.Tensor) -> TieredUnit:
        """Make ``buf`` the sub-group's host slice, holding new bytes (dirty: never dropped unwritten)."""
        s = TieredUnit(("opt", self.engine_id, g.key), buf, kind="opt", resident=g.resident, dirty=True,
                       layout=g.layout, writeback=self._writeback(g), on_drop=lambda sl, g=g: self._dropped(g, sl))
        g.slice = s
        return self.rt.tier.add(s)

    def _dropped(self, g: _Group, s: TieredUnit) -> None:
        if g.slice is s:
            g.slice = None
            self.master_links.forget_waiting(g)
            self.release_held(g)

    # [Note: master weights from the parameter reads]
    #
    # In fp32 a sub-group's parameters are read from its master slot (``set_alias``), so backward has
    # just read the master weights its step inside backward needs. The slice's read then starts past the
    # master slot and the slot is filled partition by partition from the parameter swapper's host slices:
    #
    # * at once, for the partitions a host slice holds when the slice is created (``_fill_from_params``);
    # * when a host slice leaves DRAM, for those backward reads later (``take_master_bytes``, a drop
    #   listener of the parameter swapper: a WAITING link, ``master_links.py``);
    # * from a kept slice (a HELD link), for those backward read and left *before* the sub-group had a
    #   slice: the in-backward window ([Note: the in-backward window] in ``backward_step.py``) holds two
    #   optimizer slices, and while both are taken (one stepping, one being written back) backward goes
    #   on through the next sub-group's layers. Without the hold their bytes were read again on demand
    #   (148M fp32 Llama, budget 0: ~280 MB per step, 1.9 B/param, ~0.3 s of waiting in 5 demand reads).
    #   A kept slice is the parameter swapper's own buffer (no copy), kept only for a sub-group still to
    #   be stepped in this backward (``holds_master``) and only up to ``master_hold_limit`` bytes of
    #   buffers (one master slot: the planner's ``master_hold_bytes``); kept bytes are released as they
    #   are copied, when the slice is dropped, and at the end of every backward (``release_held``);
    # * on demand, for what no slice supplied (``wait_slice``: ``master_demand_bytes``).
    #
    # The bytes are the master slot's own in every case, so the step is bit-identical with one that
    # read the slot (the parameters of a sub-group not yet stepped are its current master weights).

    def _load(self, g: _Group, priority: int, master_from_params: bool = False) -> TieredUnit:
        """The host slice of ``g``, reading it (master + valid state slots) if not in DRAM; with
        ``master_from_params`` (and master links for ``g``) the master slot's first blocks come from the parameter
        swapper instead (see [Note: master weights from the parameter reads])."""
        if g.slice is not None:
            return g.slice
        n = self._span(g, g.valid_slots)
        # a slice the plan does not keep: at the pool's top (io/pool.py, [Note: the pipeline's slices at the top])
        buf = alloc_aligned(self._span(g, g.slots), pipeline=not g.resident)
        psw = self.rt.param_swapper
        links = self.master_links.of(g)
        if master_from_params and psw is not None and not all(psw.is_master_alias(k.ds_id) for k in links):
            master_from_params = False  # a parameter was edited away from its master: read the slot itself
        start = round_down(g.slot_bytes, self.rt.store.alignment) if master_from_params and links and psw else 0
        fut = self.rt.store.read(self._extent_key(g), buf[start:n], start, priority) if n > start else None
        s = TieredUnit(("opt", self.engine_id, g.key), buf, kind="opt", resident=g.resident, ready=fut,
                       prefetched=True, layout=g.layout, writeback=self._writeback(g),
                       on_drop=lambda sl, g=g: self._dropped(g, sl))
        g.slice = s
        if start:
            self._fill_from_params(g, buf, start)
        self.release_held(g)  # a slice read whole (or filled above) needs no kept bytes
        self.rt.tier.add(s)
        return s

    def _copy_param_bytes(self, buf: torch.Tensor, ds_id: int, off: int, n: int, src=None) -> bool:
        """Copy the first ``n`` bytes of partition ``ds_id`` (``src``, or what the parameter swapper holds in
        DRAM now) to ``buf[off:]``; False when no host slice has them."""
        if src is None:
            src = self.rt.param_swapper.host_bytes(ds_id)
            if src is None:
                return False
        buf[off:off + n].copy_(src[:n])
        self.master_copied_bytes += n
        return True

    def _fill_from_params(self, g: _Group, buf: torch.Tensor, end: int) -> None:
        """Copy the master bytes below ``end`` from the parameter partitions in DRAM now; the others' links wait
        (filled by :meth:`take_master_bytes` or :meth:`wait_slice`)."""
        for link in self.master_links.of(g):
            n = min(link.nbytes, end - link.offset)
            if n <= 0:
                continue
            if link.fill is Fill.HELD:
                self._copy_param_bytes(buf, link.ds_id, link.offset, n, self.master_links.unhold(link))
                self.master_held_bytes += n
            elif not self._copy_param_bytes(buf, link.ds_id, link.offset, n):
                self.master_links.wait(link, n)
        self.release_held(g)  # bytes kept past the slot's filled part (none in practice)

    def take_master_bytes(self, ds_id: int, src: torch.Tensor) -> None:
        """The parameter swapper lets go of partition ``ds_id`` 's host bytes ``src`` (uint8): copy them
        into the master slot that waits for them, or keep them for a sub-group still to be stepped in
        this backward that has no slice yet (a drop listener; [Note: master weights from the parameter
        reads])."""
        link = self.master_links.get(ds_id)
        if link is None:
            return
        g: _Group = link.group  # type: ignore[assignment]
        if link.fill is Fill.WAITING:
            n = link.waiting
            self.master_links.filled(link)
            if g.slice is not None:
                self._copy_param_bytes(g.slice.buf, ds_id, link.offset, n, src)
                return
        if g.slice is None and self.holds_master is not None and self.holds_master(g.index):
            self.master_links.hold(link, src)  # within the hold limit, else read on demand later

    def held_bytes(self) -> int:
        """Host bytes of parameter slices kept alive for master slots now (whole buffers, each once)."""
        return self.master_links.held_bytes()

    def release_held(self, g: _Group | None = None) -> None:
        """Let go of the parameter bytes kept for ``g`` 's master slot (every sub-group's when None): the
        end of a backward, a dropped slice."""
        self.master_links.release(g)

    def wait_slice(self, g: _Group) -> TieredUnit:
        """Wait for ``g`` 's slice to hold all its bytes and return it: its read, then the master ranges no
        parameter slice supplied (from a parameter slice now in DRAM, else the parameter swapper reads
        those partitions on demand, coalesced)."""
        s = g.slice
        with self.rt.io_wait:
            s.wait_ready()
        waiting = self.master_links.waiting(g)
        if waiting:
            missing = [(k.ds_id, k.offset, k.waiting) for k in waiting
                       if not self._copy_param_bytes(s.buf, k.ds_id, k.offset, k.waiting)]
            self.master_links.forget_waiting(g)
            psw = self.rt.param_swapper
            edited = [m for m in missing if not psw.is_master_alias(m[0])]  # the parameter no longer is its master
            missing = [m for m in missing if psw.is_master_alias(m[0])]
            if missing:
                data = psw.read_partitions([d for d, _, _ in missing])
                for (_, off, n), t in zip(missing, data, strict=True):
                    s.buf[off:off + n].copy_(byte_view(t)[:n])
                    self.master_demand_bytes += n
            for _, off, n in edited:  # from the master slot itself
                a = round_down(off, self.rt.store.alignment)
                tmp = alloc_aligned(round_up(off + n, self.rt.store.alignment) - a)
                with self.rt.io_wait:
                    self.rt.store.read(self._extent_key(g), tmp, a, READ_DEMAND).wait()
                s.buf[off:off + n].copy_(tmp[off - a:off - a + n])
                self.master_demand_bytes += n
        return s

    def set_alias(self, g: _Group, entries) -> None:
        """``entries``: ``(ds_id, byte offset, bytes)`` of the fp32 partitions read from ``g`` 's master slot."""
        self.master_links.set(g, entries)

    # ------------------------------------------------------------------ DeepSpeed API
    def init_timers(self) -> None:
        """DeepSpeed resets its swap timers here; our per-step figures come from the counters."""

    def log_timers(self) -> None:
        """Debug log of this swapper's DRAM and store figures (DeepSpeed logs its timers here, after every
        optimizer step), and the store's per-step health check (:meth:`Runtime.check`).

        Raises:
            CachePathError: the store's directory was removed under the run.
        """
        self.rt.check()
        self.rt.end_of_step()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("aidaptiv_ds optimizer swapper: %s", self.rt.counters())

    def pre_backward(self) -> None:
        """Backward is about to start: nothing to do (gradients arrive at the boundary)."""

    def post_backward(self) -> None:
        """Backward finished: the first sub-group is needed next, so start reading it."""
        g = self._next_wanted(0)
        if g is not None:
            self._load(g, READ_PREFETCH)
            if self.gradients is not None:
                self.gradients.prefetch(g.index)

    def _next_wanted(self, index: int) -> _Group | None:
        """The first sub-group from ``index`` on (step order) that is still to be stepped."""
        for key in self.order[index:]:
            g = self.groups[key]
            if self.wanted is None or self.wanted(g.index):
                return g
        return None

    def is_swappable_tensor(self, tensor=None, numel=None) -> bool:
        """Every sub-group is ours (resident ones just never leave DRAM); honours ``tensor.swappable``."""
        if tensor is not None and not getattr(tensor, "swappable", True):
            return False
        return True

    def initialize_parameters(self, parameters, src_tensors) -> None:
        """Create each sub-group's extent and store its initial fp32 master weights (synchronous)."""
        futs = []
        for param, src in zip(parameters, src_tensors):
            key = str(param.ds_id)
            numel = src.numel()
            g = _Group(key, numel, self.layout(numel, 1 + self.expected_states), index=len(self.order))
            if self.plan is not None:  # the residency plan indexes sub-groups in creation order
                g.resident = g.index in self.plan.resident_subgroups
            self.groups[key] = g
            self.order.append(key)
            self.rt.store.allocate(self._extent_key(g), self._span(g, g.slots))
            buf = alloc_aligned(self._span(g, g.slots), pipeline=not g.resident)
            buf[: g.slot_bytes].view(self.dtype).copy_(src.reshape(-1))
            s = self._new_slice(g, buf)
            if not g.resident:
                futs.append(self.rt.tier.write_back(s))
        with self.rt.io_wait:
            for f in futs:
                if f is not None:
                    f.wait()
        self.rt.tier.wait_writes()

    def initialize_from_swapped_fp16_params(self, fp16_partitions_info, fp16_num_elems, fp16_pinned_buffers,
                                            fp32_parameters) -> None:
        """``fast_init``: build each sub-group's fp32 master from its partitions in our param store.

        ``fp16_partitions_info`` holds ``[(ds_tensor, numel, path or None), ...]`` per sub-group
        (``stage3.py:1054-1064``); swapped partitions are read through the parameter swapper.
        """
        swapper = self.rt.param_swapper
        for info, numel, param in zip(fp16_partitions_info, fp16_num_elems, fp32_parameters):
            flat = torch.empty(int(numel), dtype=self.dtype)
            swapped = [t for t, _, path in info if path is not None]
            data = iter(swapper.read_partition_tensors(swapped)) if swapped else iter(())
            off = 0
            for tensor, n, path in info:
                src = next(data) if path is not None else tensor.data
                flat[off:off + n].copy_(src.reshape(-1)[:n])
                off += n
            self.initialize_parameters([param], [flat])

    @spanned("aidaptiv::optimizer_swap_in", lane="optimizer")
    def swap_in_optimizer_state(self, parameter, async_parameter=None) -> None:
        """Bind ``parameter`` (fp32 master), its state tensors and ``.grad`` to host buffers; prefetch the next."""
        g = self._group(parameter)
        s = self._load(g, READ_DEMAND)
        if async_parameter is not None:  # start the next sub-group's read before waiting for ours
            nxt = self.groups.get(str(async_parameter.ds_id))
            if nxt is not None:
                nxt = self._next_wanted(nxt.index)  # skipping sub-groups stepped inside backward
            if nxt is not None:
                self._load(nxt, READ_PREFETCH)
                if self.gradients is not None:
                    self.gradients.prefetch(nxt.index)
        self.wait_slice(g)
        self.rt.tier.acquire_to_update(s)  # the step changes it in place: not under its last write-back
        parameter.data = self._slot(g, s, 0)
        state = self.optimizer.state.get(parameter, {})
        for j, name in enumerate(g.state_names, start=1):
            if name in state:
                state[name].data = self._slot(g, s, j)
        if self.phase.rebuilds_state or self.gradients is None:  # DeepSpeed binds a zero buffer itself there
            parameter.grad = None
        else:
            parameter.grad = self.gradients.fp32_grad(g.index)

    def _adopt_states(self, g: _Group, parameter, s: TieredUnit) -> TieredUnit:
        """Move per-element state tensors the optimizer created into slots of the extent (once)."""
        state = self.optimizer.state.get(parameter, {})
        names = sorted(k for k, v in state.items()
                       if torch.is_tensor(v) and v.numel() == g.numel and getattr(v, "swappable", True))
        new = [n for n in names if n not in g.state_names]
        if not new:
            return s
        names = g.state_names + new
        if 1 + len(names) > g.slots:  # more state than planned: grow the extent (one-time)
            g.layout = self.layout(g.numel, 1 + len(names))
            self.rt.store.allocate(self._extent_key(g), self._span(g, g.slots))
            bigger = alloc_aligned(self._span(g, g.slots))
            bigger[: s.buf.numel()].copy_(s.buf)
            parameter.data = bigger[: g.numel * self.elsize].view(self.dtype)
            self.rt.tier.release(s)
            self.rt.tier.drop(s)
            s = self._new_slice(g, bigger)
            self.rt.tier.acquire(s)
            for j, n in enumerate(g.state_names, start=1):
                state[n].data = self._slot(g, s, j)
        for j, n in enumerate(names, start=1):
            if n in new:
                g.layout.slots[j].write(s.buf, state[n].data.reshape(-1))  # rounded or quantized when narrow
                state[n].data = self._slot(g, s, j)
        g.state_names = names
        return s

    @spanned("aidaptiv::optimizer_swap_out", lane="optimizer")
    def swap_out_optimizer_state(self, parameter, async_swap: bool = False) -> None:
        """Release the sub-group's views; write it back (async) if it changed and is not resident."""
        g = self._group(parameter)
        s = g.slice
        if s is None:
            return
        s = self._adopt_states(g, parameter, s)
        if not self.phase.rebuilds_state or g.changed:
            self.rt.tier.mark_dirty(s)
            g.changed = False
        if not g.resident:  # issue the write while the slice is still referenced: releasing a dirty slice
            self.rt.tier.write_back(s)  # first would evict it, and a dirty eviction writes and waits
        self._release(g, parameter, consumed=not self.phase.rebuilds_state and not g.keep_gradient
                      and not self.phase.open(Phase.STATE_API))
        self.rt.tier.enforce_budget()

    def slice_bytes(self, g: _Group) -> int:
        """Host bytes of ``g`` 's slice (master weights and every state slot, aligned)."""
        return self._span(g, g.slots)

    @spanned("aidaptiv::optimizer_prefetch", lane="optimizer")
    def prefetch(self, g: _Group, master_from_params: bool = False, demand: bool = False) -> None:
        """Start reading ``g`` 's master weights and state if they are not in DRAM; ``master_from_params``:
        backward is reading its parameters, take the master bytes from them ([Note: master weights from
        the parameter reads]); ``demand``: the step waits for it next (demand priority)."""
        self._load(g, READ_DEMAND if demand else READ_PREFETCH, master_from_params)

    # ------------------------------------------------------------------ speculative steps
    def can_speculate(self, g: _Group) -> bool:
        """A sub-group's step can run speculatively: not resident (a DRAM sub-group is stepped in place)
        and its per-element state layout is known in advance (Adam-type: no extent growth mid-step)."""
        return not g.resident and self.expected_states > 0 and g.slots == 1 + self.expected_states

    def shadow_bytes(self) -> int:
        """Drive bytes the shadow extents of the non-resident sub-groups take (2x their state)."""
        return sum(self._span(g, g.slots) for g in self.groups.values() if not g.resident)

    def begin_speculation(self, g: _Group, parameter, keep_gradient: bool) -> dict:
        """Write ``g`` 's next state beside its current one until :meth:`commit` or :meth:`discard`;
        returns the optimizer's per-parameter scalars (Adam's ``step``) and state names to restore on
        a discard. The shadow extent is allocated once and kept (a sub-group's two extents alternate)."""
        self.rt.store.allocate(self._shadow_key(g), self._span(g, g.slots))
        g.speculating = True
        g.keep_gradient = keep_gradient
        state = self.optimizer.state.get(parameter)
        scalars = None if state is None else {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()
                                               if k not in g.state_names}
        return {"state": scalars, "names": list(g.state_names)}

    def commit(self, g: _Group) -> None:
        """Accept the speculative step: its shadow becomes the current extent (no I/O)."""
        if g.speculating:
            g.speculating = False
            self.rt.store.swap_extents(self._extent_key(g), self._shadow_key(g))
        g.keep_gradient = False

    def discard(self, g: _Group, parameter, snapshot: dict) -> None:
        """Reject the speculative step: the current extent still holds the state before it; host copies
        of the new state are dropped and the optimizer's scalars and state names restored."""
        g.speculating = False
        g.keep_gradient = False
        if g.slice is not None:
            while g.slice is not None and g.slice.refs:
                self.rt.tier.release(g.slice)
            if g.slice is not None:  # its bytes are the rejected state: never written below
                self.rt.tier.drop(g.slice)
        g.state_names = list(snapshot["names"])
        if snapshot["state"] is None:
            self.optimizer.state.pop(parameter, None)
        else:
            state = self.optimizer.state.setdefault(parameter, {})
            for k in [k for k in state if k not in g.state_names]:
                del state[k]
            state.update(snapshot["state"])
            for n in g.state_names:
                state.setdefault(n, torch.empty(0, dtype=self.state_dtype(g, n)))

    def _release(self, g: _Group, parameter, consumed: bool = False) -> None:
        """Unbind the sub-group's views; ``consumed``: the optimizer stepped on its gradient (drop it)."""
        empty = torch.empty(0, dtype=self.dtype)
        parameter.data = empty
        state = self.optimizer.state.get(parameter, {})
        for n in g.state_names:
            if n in state:
                state[n].data = torch.empty(0, dtype=self.state_dtype(g, n))
        if g.slice is not None and g.slice.refs:
            self.rt.tier.release(g.slice)
        if self.gradients is not None:
            if consumed:
                self.gradients.consume(g.index)
            else:
                self.gradients.release(g.index)
        parameter.grad = None

    def refs(self, parameter) -> int:
        """How many holders ``parameter``'s sub-group slice has now (0: not in DRAM or not held)."""
        g = self._group(parameter)
        return g.slice.refs if g.slice is not None else 0

    def release_swap_buffers(self, parameter) -> None:
        """Drop the in-memory views without writing (read-only access is over)."""
        g = self._group(parameter)
        self._release(g, parameter)
        self.rt.tier.enforce_budget()

    def mark_changed(self, parameter) -> None:
        """The caller changed ``parameter``'s swapped-in state while the state is rebuilt (a weights-only load
        sets the masters in ``Phase.LOADING``): its next swap-out writes it back, where a rebuild's swap-out
        writes nothing ([Note: phases] in ``phase.py``).

        Raises:
            RuntimeError: the sub-group is not swapped in (there is nothing of the caller's to write).
        """
        g = self._group(parameter)
        if g.slice is None:
            raise RuntimeError(f"aidaptiv_ds: mark_changed on sub-group {g.index}, which is not swapped in; "
                               f"this is a bug, please report it")
        g.changed = True

    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state: bool, write_gradients: bool
                                                ) -> None:
        """Persist the state and/or ``parameter.grad`` (DeepSpeed's ``safe_set`` APIs), then release."""
        g = self._group(parameter)
        if write_gradients and parameter.grad is not None and self.gradients is not None:
            self.gradients.replace(g.index, parameter.grad)
        if write_opt_state and g.slice is not None:
            s = self._adopt_states(g, parameter, g.slice)
            self.rt.tier.mark_dirty(s)
            if not g.resident:
                self.rt.tier.write_back(s)
        self._release(g, parameter)
        self.rt.tier.enforce_budget()

    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors) -> None:
        """Set gradient fragments (offsets in elements within the sub-group) in the gradient store
        (DeepSpeed's ``_swap_out_offload_fp32_gradients``; the Stage-3 subclass accumulates into the
        store directly, so only DeepSpeed code paths outside it arrive here)."""
        g = self._group(parameter)
        rec = self.gradients.open(g.index)
        for off, t in zip(gradient_offsets, gradient_tensors):
            self.gradients.view(rec, int(off), t.numel()).copy_(t.reshape(-1))
        self.gradients.close(g.index)

    def install_subgroup(self, g: _Group, parameter, buf: torch.Tensor, state_names: list, step) -> None:
        """Make ``buf`` (slots packed as in :meth:`_slot`, master first) the sub-group's bytes, with
        ``state_names`` for the slots after the master and Adam's ``step`` restored (checkpoint load).

        Args:
            step: ``(value, type)`` as saved (``"tensor:float32"``, ``"int"``, ``"float"``), or None for
                a fresh optimizer state.
        """
        old = g.slice
        if old is not None:  # a release may evict the slice (g.slice None after it): hold on to it here
            while old.refs:
                self.rt.tier.release(old)
            self.rt.tier.drop(old)
        g.state_names = list(state_names)
        s = self._new_slice(g, buf)
        state = {}
        if step is not None and step[0] is not None:
            value, typ = step
            if typ.startswith("tensor:"):
                state["step"] = torch.tensor(value, dtype=getattr(torch, typ[len("tensor:"):]))
            else:
                state["step"] = int(value) if typ == "int" else float(value)
        for n in state_names:
            state[n] = torch.empty(0, dtype=self.state_dtype(g, n))
        if state:
            self.optimizer.state[parameter] = state
        else:
            self.optimizer.state.pop(parameter, None)
        if not g.resident:
            self.rt.tier.write_back(s)

    def purge_state(self) -> None:
        """Forget per-element state (DeepSpeed calls this before loading optimizer state)."""
        for g in self.groups.values():
            g.state_names = []

    def flush(self) -> None:
        """Write back every dirty sub-group (resident ones too) and wait: the store is then current."""
        for g in self.groups.values():
            if g.slice is not None and g.slice.dirty:
                self.rt.tier.write_back(g.slice)
        self.rt.tier.wait_writes()
