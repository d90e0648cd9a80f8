"""Build step: install ``ckpt_plugin_autoattach.pth`` at the top of site-packages, with regular and editable installs.

Python runs ``import`` lines of ``.pth`` files in site-packages at start, so ``CKPT_AUTO_ATTACH=1`` works without
changing a program's command (``docs/ckpt-run.md``). The line imports nothing unless the variable is set.
setuptools has no option for a file at the top of site-packages (``data-files`` go under ``sys.prefix``), so
``build_py`` writes it: into the build directory for a wheel, into the editable wheel's root for ``pip install -e``.

setuptools loads this module by its path in the project root (``[tool.setuptools.cmdclass]`` in pyproject.toml), so
it is no package of the distribution: MANIFEST.in puts it in the sdist, for wheels built from the sdist.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py

PTH_NAME = "ckpt_plugin_autoattach.pth"
PTH_LINE = (
    "import os; 'CKPT_AUTO_ATTACH' in os.environ and "
    "__import__('ckpt_plugin_integrations.auto_attach.startup').auto_attach.startup.start_quietly()\n"
)


class BuildPyWithPth(build_py):
    """``build_py`` that also writes :data:`PTH_NAME`."""

    def run(self) -> None:
        super().run()
        target = self._pth_dir()
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), "w", encoding="utf-8") as handle:
            handle.write(PTH_LINE)

    def _pth_dir(self) -> str:
        if getattr(self, "editable_mode", False):
            # An editable wheel holds only what is in its root (install_lib) besides the import finder.
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs
