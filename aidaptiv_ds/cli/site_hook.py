"""``aidaptiv-ds site-hook status|install|remove``: the hook that activates aidaptiv_ds in every Python
process of this environment whose DeepSpeed config has an ``"aidaptiv"`` section.

``pip install`` (wheel or editable) puts ``aidaptiv_ds_autoload.pth`` into ``site-packages``; its one
line, ``import _aidaptiv_ds_autoload``, costs nothing until ``deepspeed`` is imported, and imports
aidaptiv_ds only for a config with the section (:mod:`_aidaptiv_ds_autoload`). ``status`` shows
whether it is there; ``install`` writes it where an installer left it out (e.g. a copy of the package
on ``PYTHONPATH``); ``remove`` deletes it (the next ``pip install`` puts it back). Per process,
``AIDAPTIV_DS_NO_AUTOINSTALL=1`` turns it off.
"""
from __future__ import annotations

import os
import sysconfig

PTH_NAME = "aidaptiv_ds_autoload.pth"
PTH_LINE = "import _aidaptiv_ds_autoload\n"


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def register(sub) -> None:
    p = sub.add_parser("site-hook", help="the hook that activates aidaptiv_ds for configs with an \"aidaptiv\" "
                       "section, without an import", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["status", "install", "remove"])
    p.set_defaults(func=run)


def run(args) -> int:
    path = pth_path()
    if args.action == "install":
        from ..io.atomic import atomic_write
        atomic_write(path, PTH_LINE.encode())
        print(f"installed {path}")
    elif args.action == "remove":
        if os.path.exists(path):
            os.unlink(path)
            print(f"removed {path} (`pip install` of aidaptiv_ds puts it back; AIDAPTIV_DS_NO_AUTOINSTALL=1 turns the "
                  f"hook off per process)")
        else:
            print(f"not installed ({path} does not exist)")
    else:
        there = os.path.exists(path)
        off = os.environ.get("AIDAPTIV_DS_NO_AUTOINSTALL") == "1"
        print(f"{'installed' if there else 'not installed'}: {path}"
              + (" (turned off in this shell: AIDAPTIV_DS_NO_AUTOINSTALL=1)" if there and off else ""))
    return 0
