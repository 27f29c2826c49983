"""``python launch/aidaptiv_run.py SCRIPT [ARGS...]``: run an unmodified script with aidaptiv_ds active.

The file form of ``python -m aidaptiv_ds.run`` for launchers that take a script path::

    deepspeed --num_gpus 2 launch/aidaptiv_run.py train.py --deepspeed ds_configs/aidaptiv_zero3.json
"""
import os
import sys

try:
    from aidaptiv_ds.run import main
except ModuleNotFoundError:  # a source checkout that is not pip-installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from aidaptiv_ds.run import main

if __name__ == "__main__":
    main()
