"""``aidaptiv-ds site-hook install|remove|status``: activate aidaptiv_ds in every Python process of
this environment (opt-in), for scripts and launchers you cannot change.

``install`` writes ``aidaptiv_ds_autoload.pth`` into the environment's ``site-packages``; Python
runs its one ``import`` line at startup, which is cheap: it only registers a watcher that installs
the DeepSpeed hooks once ``deepspeed`` is imported (:mod:`aidaptiv_ds._autoload`). Configs without an
enabled ``"aidaptiv"`` section are unaffected. ``AIDAPTIV_DS_NO_AUTOINSTALL=1`` turns it off per
process; ``remove`` deletes the file.
"""
from __future__ import annotations

import os
import sysconfig

PTH_NAME = "aidaptiv_ds_autoload.pth"
PTH_LINE = "import aidaptiv_ds._autoload as _a; _a.activate()\n"


def pth_path() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def register(sub) -> None:
    p = sub.add_parser("site-hook", help="activate aidaptiv_ds in every Python process of this environment",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["install", "remove", "status"])
    p.set_defaults(func=run)


def run(args) -> int:
    path = pth_path()
    if args.action == "install":
        with open(path, "w") as f:
            f.write(PTH_LINE)
        print(f"installed {path}")
    elif args.action == "remove":
        if os.path.exists(path):
            os.unlink(path)
            print(f"removed {path}")
        else:
            print(f"not installed ({path} does not exist)")
    else:
        print(f"{'installed' if os.path.exists(path) else 'not installed'}: {path}")
    return 0
