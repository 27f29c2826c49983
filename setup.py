"""Build hooks only (the metadata is in ``setup.cfg``): ship ``aidaptiv_ds_autoload.pth`` at the top
level of ``site-packages``, in wheels and in editable installs, so that a DeepSpeed config with an
enabled ``"aidaptiv"`` section works without ``import aidaptiv_ds`` (see ``_aidaptiv_ds_autoload.py``)."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "aidaptiv_ds_autoload.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the ``.pth`` file at the root of the build (the wheel's purelib root)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

try:  # setuptools >= 64: PEP 660 editable installs build an "editable wheel" of links, without build_lib files
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - older setuptools install editables through `develop`
    editable_wheel = None
else:
    class EditableWheelWithPth(editable_wheel):
        """The editable wheel with the ``.pth`` file at its top level too (next to its path finder)."""

        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            out = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            shutil.copy(os.path.join(HERE, PTH), os.path.join(unpacked_wheel, PTH))
            return out

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
