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
"""
from __future__ import annotations

import atexit
import sys

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
