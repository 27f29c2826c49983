"""Session-wide test environment.

Child processes (training runs, launchers) find the venv's tools first: DeepSpeed JIT-builds a
small comm op per process into the shared torch-extensions cache, and two ``ninja`` versions (the
venv's and the system's) treat each other's build log as stale and rebuild it in turn (about a
minute each), so every process must see the same one.
"""
import os
import sys

_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
