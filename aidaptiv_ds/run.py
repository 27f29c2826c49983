"""Run an unmodified training script with aidaptiv_ds active: ``python -m aidaptiv_ds.run SCRIPT [ARGS...]``.

The script runs as ``__main__`` (``runpy``) after ``import aidaptiv_ds`` installed the DeepSpeed
hooks, so a script that never mentions aidaptiv_ds -- an HF ``Trainer`` with ``--deepspeed
cfg.json``, a plain ``deepspeed.initialize`` loop -- uses our swappers whenever its config has an
enabled ``"aidaptiv"`` section. Works under every launcher::

    python -m aidaptiv_ds.run train.py --deepspeed ds_config.json
    torchrun --nproc_per_node 8 -m aidaptiv_ds.run train.py --deepspeed ds_config.json
    deepspeed --num_gpus 8 --module aidaptiv_ds.run train.py --deepspeed ds_config.json

(``launch/aidaptiv_run.py`` is the same as a file, for launchers that want a script path.) Run by ``python``
alone, with no launcher's rank variables (``RANK``, ``WORLD_SIZE``; nor an MPI or SLURM world of several), it
is one process of a world of one, as the ``deepspeed`` launcher would start it: ``RANK=0``, ``LOCAL_RANK=0``,
``WORLD_SIZE=1``, ``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, each where the
environment lacks it (without them DeepSpeed looks for MPI and fails on a missing ``mpi4py``). At exit,
a gloo default process group the script left is destroyed, so it cannot abort the finished process
(:mod:`aidaptiv_ds.process_group`). The alternative for every process of an
environment is the opt-in site hook, ``aidaptiv-ds site-hook install``.
"""
from __future__ import annotations

import os
import runpy
import sys

import aidaptiv_ds  # noqa: F401 - installs the hooks (now, or when the script imports deepspeed)
from aidaptiv_ds.process_group import destroy_gloo_group_at_exit


#: variables by which torch's and DeepSpeed's launchers give this process its rank
LAUNCHER_RANK_VARS = ("RANK", "WORLD_SIZE")
#: the world size MPI and SLURM give: a world of more than one is theirs to set up (DeepSpeed's MPI discovery)
MPI_WORLD_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def single_process_env(env=os.environ) -> dict:
    """The variables a world of one process needs, where no launcher set a rank (module docstring); ``{}`` under
    torch's or DeepSpeed's launcher or in an MPI or SLURM world of several (``srun -n1`` is one process: it gets
    them). Sets only what ``env`` lacks (``LOCAL_RANK``, ``MASTER_PORT`` ... already there are kept) and returns
    what it set."""
    if any(k in env for k in LAUNCHER_RANK_VARS):
        return {}
    for k in MPI_WORLD_VARS:
        try:
            if int(env.get(k, "1")) > 1:
                return {}
        except ValueError:
            return {}  # a launcher's variable we cannot read: leave the process to it
    from .ports import free_port

    want = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    out = {k: v for k, v in want.items() if k not in env}
    if not env.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(free_port())
    env.update(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its arguments.

    Raises:
        SystemExit: usage error (no script given, or the script does not exist).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("--local_rank"):  # the deepspeed launcher passes it before the script
        argv = argv[1:] + [argv[0]]
    if not argv or not os.path.isfile(argv[0]):
        raise SystemExit(f"usage: python -m aidaptiv_ds.run SCRIPT [ARGS...]\n"
                         f"{'no script given' if not argv else repr(argv[0]) + ' is not a file'}")
    script = os.path.abspath(argv[0])
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(script))
    single_process_env()
    destroy_gloo_group_at_exit()  # a script without destroy_process_group() exits cleanly (process_group.py)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
