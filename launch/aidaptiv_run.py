"""``python launch/aidaptiv_run.py SCRIPT [ARGS...]``: run an unmodified script with aidaptiv_ds active.

The file form of ``python -m aidaptiv_ds.run`` for launchers that take a script path::

    deepspeed --num_gpus 2 launch/aidaptiv_run.py train.py --deepspeed ds_configs/aidaptiv_zero3.json
"""
import os
import sys

# this checkout's package ahead of any installed copy (an editable install of another checkout included):
# what a launch script runs and measures is the code beside it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from aidaptiv_ds.run import main  # noqa: E402

if __name__ == "__main__":
    main()
