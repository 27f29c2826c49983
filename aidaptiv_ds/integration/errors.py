"""Errors of the DeepSpeed adapter (kinds of :class:`aidaptiv_ds.AidaptivError`).

Config problems are :class:`aidaptiv_ds.errors.AidaptivConfigError` (re-exported by
:mod:`.config`); another DeepSpeed release is :class:`.hooks.UnsupportedDeepSpeedError`.
"""
from __future__ import annotations

from ..errors import AidaptivError


class DeepSpeedContractError(AidaptivError, RuntimeError):
    """DeepSpeed called a swapper, the Stage-3 subclass or the aio handle outside the contract the
    adapter is built on (``docs/deepspeed-seams.md`` §1.3-1.5, §2, §3.4): a call order, a size or a
    state that DeepSpeed 0.19.8 never produces. Causes, most likely first: a model changed after
    ZeRO partitioned it (e.g. a parameter resized), a DeepSpeed patched or newer than 0.19.8 in
    ways the version check cannot see, or a bug in aidaptiv_ds (please report it with the message).

    The message names the parameter (``ds_id``) or sub-group, what was asked and what the
    bookkeeping holds. Raised before any data is written for that request.
    """


class GradientConsumedError(AidaptivError, RuntimeError):
    """DeepSpeed's state API (``safe_get_full_grad``, ``safe_set_full_fp32_param``, ...) was called between
    backward and ``step()`` on an optimizer sub-group whose step already ran inside the backward pass and
    consumed its gradient (gradient clipping off, the first use of the state API in the process): the step
    cannot be redone after the call. Raised before anything is changed; gradients are kept from the next
    step on (``integration/state_api.py``, [Note: the state API])."""


class PipelineError(AidaptivError, RuntimeError):
    """An optimizer update riding the next forward failed (``integration/step_pipeline.py``, [Note: a failure
    in the pipeline]): raised where it ran and by every later wait (a gather, the state API, a checkpoint
    save, the next step), naming the sub-group; the run can neither go on nor save a checkpoint."""
