"""The engine's phase: one record per ZeRO-3 optimizer that the swappers and the mixins read.

[Note: phases] What a swap-in or swap-out means depends on who calls it. DeepSpeed calls the same
swapper methods to build the optimizer state (``initialize_optimizer_states``), our checkpoint load calls
them to re-derive the parameter partitions from loaded masters, a DeepSpeed state-API call (``safe_get_*``,
``safe_set_*``) calls them to read or edit one sub-group, and training calls them to step. The phases:

* ``TRAINING``: the forward, the optimizer step, everything outside the others;
* ``BACKWARD``: between DeepSpeed's ``backward_prologue`` and ``backward_epilogue`` (``stage3.py:3050-3068``):
  published parameters start their sub-groups' reads and keep bytes for master slots
  (``backward_step.py``);
* ``INITIALIZING``: DeepSpeed's ``initialize_optimizer_states``: the state is made, not stepped (no
  gradient is bound or consumed, nothing is marked dirty), and the partitions DeepSpeed writes back are
  the bytes they were made from (the parameter swapper skips those writes);
* ``LOADING``: a checkpoint's masters installed (``checkpointing.py``): the state is rebuilt as in
  ``INITIALIZING``, but the partitions written are new (cast from the loaded masters) and are written; the
  optimizer state a swap-out releases was written when it was installed, unless the caller changed it while it was
  swapped in and said so (``optimizer_swapper.mark_changed``: a weights-only load's new masters);
* ``STATE_API``: a state-API call (``state_api.py``): a swap-out writes changed state back but is no
  optimizer step, so it consumes no gradient.

Phases nest (a state-API call inside backward, a load after a backward that raised): the record is a stack
and each question is "is this phase open", so every swapper sees what it saw when these were separate flags.
Which phase may open inside which is the table :data:`OPENS_IN`; anything else is a bug and raises.
"""
from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


class Phase(enum.Enum):
    TRAINING = "training"
    BACKWARD = "backward"
    INITIALIZING = "initializing"
    LOADING = "loading"
    STATE_API = "state_api"


#: the phases each phase may open inside (the one on top of the stack); a backward left open by an exception
#: (its epilogue never ran) is closed by the next ``backward_prologue``
OPENS_IN: dict[Phase, frozenset[Phase]] = {
    Phase.BACKWARD: frozenset({Phase.TRAINING, Phase.BACKWARD}),
    Phase.INITIALIZING: frozenset({Phase.TRAINING}),
    Phase.LOADING: frozenset({Phase.TRAINING, Phase.BACKWARD}),
    Phase.STATE_API: frozenset({Phase.TRAINING, Phase.BACKWARD, Phase.STATE_API, Phase.LOADING}),
}


class EnginePhase:
    """The phase stack of one engine (see [Note: phases]); starts in ``TRAINING``."""

    def __init__(self) -> None:
        self._stack: list[Phase] = [Phase.TRAINING]

    @property
    def now(self) -> Phase:
        return self._stack[-1]

    def open(self, phase: Phase) -> bool:
        """Whether ``phase`` is open (anywhere on the stack)."""
        return phase in self._stack

    @property
    def rebuilds_state(self) -> bool:
        """The optimizer state is being made or installed, not stepped (``INITIALIZING`` or ``LOADING``)."""
        return Phase.INITIALIZING in self._stack or Phase.LOADING in self._stack

    def check_opens(self, phase: Phase) -> None:
        """Raise (a ``RuntimeError`` naming both phases) if ``phase`` may not open now (:data:`OPENS_IN`); for a
        caller that must know before it changes anything."""
        if self.now not in OPENS_IN[phase]:
            raise RuntimeError(f"aidaptiv_ds: the {phase.value} phase cannot open during {self.now.value} "
                               f"(phases open: {[p.value for p in self._stack]}); this is a bug, please report it")

    def _push(self, phase: Phase) -> None:
        self.check_opens(phase)
        self._stack.append(phase)

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Open ``phase`` for the ``with`` block (not ``BACKWARD``: :meth:`begin_backward`)."""
        if phase is Phase.BACKWARD:
            raise ValueError("the backward phase is opened by begin_backward and closed by end_backward")
        self._push(phase)
        try:
            yield
        finally:
            self._stack.pop()

    def begin_backward(self) -> None:
        """DeepSpeed's ``backward_prologue``: a backward left open by an exception is closed first."""
        if self.now is Phase.BACKWARD:
            self._stack.pop()
        self._push(Phase.BACKWARD)

    def end_backward(self) -> None:
        """DeepSpeed's ``backward_epilogue`` (nothing to close when no backward is open)."""
        if self.now is Phase.BACKWARD:
            self._stack.pop()
