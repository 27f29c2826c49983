"""The engine's phase record (``integration/phase.py``, [Note: phases]): nesting as the swappers need it, and a
transition no code path makes is refused."""
from __future__ import annotations

import pytest

from aidaptiv_ds.integration.phase import EnginePhase, Phase


def test_phases_nest_and_each_question_sees_the_open_ones():
    ph = EnginePhase()
    assert ph.now is Phase.TRAINING and not ph.rebuilds_state
    with ph.during(Phase.INITIALIZING):
        assert ph.rebuilds_state and ph.open(Phase.INITIALIZING)
    ph.begin_backward()
    with ph.during(Phase.STATE_API):  # safe_get_full_grad from a backward hook
        assert ph.open(Phase.BACKWARD) and ph.open(Phase.STATE_API) and ph.now is Phase.STATE_API
        with ph.during(Phase.STATE_API):  # a state-API call made by another one
            pass
    assert ph.now is Phase.BACKWARD
    ph.end_backward()
    assert ph.now is Phase.TRAINING
    with ph.during(Phase.LOADING), ph.during(Phase.STATE_API):
        assert ph.rebuilds_state and not ph.open(Phase.INITIALIZING)
    assert ph.now is Phase.TRAINING


def test_a_backward_left_open_by_an_exception_is_closed_by_the_next():
    ph = EnginePhase()
    ph.begin_backward()  # the loss's backward raised: DeepSpeed's epilogue never ran
    with ph.during(Phase.LOADING):  # load_checkpoint to recover
        assert ph.rebuilds_state
    ph.begin_backward()
    assert ph.now is Phase.BACKWARD and ph.open(Phase.BACKWARD)
    ph.end_backward()
    ph.end_backward()  # nothing open: nothing to close
    assert ph.now is Phase.TRAINING


def test_an_impossible_transition_raises_and_leaves_the_record_as_it_was():
    ph = EnginePhase()
    with ph.during(Phase.INITIALIZING):
        with pytest.raises(RuntimeError, match="loading phase cannot open during initializing"):
            with ph.during(Phase.LOADING):
                pass
        with pytest.raises(RuntimeError, match="backward phase cannot open during initializing"):
            ph.begin_backward()
        assert ph.now is Phase.INITIALIZING
    with pytest.raises(ValueError, match="begin_backward"):
        with ph.during(Phase.BACKWARD):
            pass
    assert ph.now is Phase.TRAINING


def test_a_caller_can_ask_before_it_changes_anything():
    ph = EnginePhase()
    ph.check_opens(Phase.STATE_API)  # allowed: nothing raised, nothing opened
    assert ph.now is Phase.TRAINING
    with ph.during(Phase.INITIALIZING):
        with pytest.raises(RuntimeError, match="state_api phase cannot open during initializing"):
            ph.check_opens(Phase.STATE_API)
