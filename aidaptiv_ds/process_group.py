"""Destroy a gloo default process group at interpreter exit, so a script that never calls
``torch.distributed.destroy_process_group()`` does not die with SIGABRT after its last step.

[Note: why a finished run could exit with "terminate called without an active exception"]
An HF ``Trainer`` script (and most training scripts) ends without ``destroy_process_group()``. The
gloo backend's C++ worker threads then still own their last ``AsyncWork`` objects when Python tears
down the interpreter; destroying them drops tensors that need the GIL of a dying interpreter, and
the process aborts (exit status -6) after the run's work is done -- now and then, by timing
(pytorch/pytorch#190489, the abandoned fix pytorch/pytorch#179291). Seen here once in the CI: the
DeepSpeed CPU-offload reference run of ``tests/test_hf_trainer.py`` printed its losses, then aborted.
Destroying the group in an ``atexit`` handler, while the interpreter is still whole, is what PyTorch
documents as the clean shutdown (``docs/source/distributed.rst``, "Shutdown"). Only gloo groups are
destroyed here: an NCCL group's destroy may wait on peers, and NCCL does not have this abort.
The handler is registered once per process, by ``python -m aidaptiv_ds.run``, by the runtime, and by
aidaptiv_ds's own training scripts (the benchmark worker, the fine-tuning job, the tests' scripts: a
DeepSpeed reference run of ``tests/test_gradient_semantics.py`` with two ranks aborted the same way in 1 of
13 runs); it does nothing when the user destroyed the group already or never made one.

[Note: harness processes skip finalization]
Destroying the default group does not free every gloo group: DeepSpeed's engine keeps Python references to
its sub-groups (data-parallel, sequence-parallel), and those C++ objects, with their worker threads and last
``AsyncWork``, die only when finalization clears the module globals -- the same abort, rarer (the CI's
DeepSpeed CPU-offload oracle of ``tests/test_drop_in.py`` aborted once, rank 0, exit status -6, with no error
line, at stop 43). A process whose every output is written by its own code -- the fuzzer's and the
benchmark's workers, the tests' scripts -- ends through :func:`run_worker`: the ``atexit`` handlers run (the
runtime's shutdown, the timeline's close, the group's destroy), stdio is flushed, and ``os._exit`` ends the
process before finalization, where nothing of ours is left to do. A user's script is not ended that way:
finalization also flushes and closes the user's own files.
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Callable, NoReturn

_REGISTERED = False


def _destroy_gloo_default_group() -> None:
    """The ``atexit`` handler: ``destroy_process_group()`` when the default group's backend is gloo."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if "gloo" not in str(dist.get_backend()).lower():
            return
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is exiting; an unclean teardown is what we tried to avoid
        pass


def destroy_gloo_group_at_exit() -> None:
    """Register (once per process) the exit handler that destroys a gloo default process group.

    Idempotent and cheap: imports nothing; torch is looked up in ``sys.modules`` at exit.
    """
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_destroy_gloo_default_group)
        _REGISTERED = True


def run_worker(main: Callable[[], int | None]) -> NoReturn:
    """Run a harness process's ``main`` and end the process without interpreter finalization.

    ``main()`` runs with the gloo exit handler registered; an exception it raises propagates as usual (a
    traceback, exit status 1). When it returns, the ``atexit`` handlers run in their usual order, stdout and
    stderr are flushed, and ``os._exit`` ends the process with ``main``'s return value (``None`` is 0)
    ([Note: harness processes skip finalization]). For aidaptiv_ds's own workers and test scripts only: a
    user's script needs finalization to close its files.
    """
    destroy_gloo_group_at_exit()
    code = main()
    atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own exit path, called while the interpreter is whole
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(int(code or 0))
