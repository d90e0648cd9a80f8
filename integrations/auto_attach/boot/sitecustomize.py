"""Python runs this at start in every process ckpt-run starts (ckpt-run puts this directory first on PYTHONPATH,
as ``opentelemetry-instrument`` does): it turns auto-attach on, then runs the ``sitecustomize`` this one shadows,
if there is one further along the path."""

import importlib.machinery
import importlib.util
import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    from ckpt_plugin_integrations.auto_attach.startup import start_quietly
except ImportError as exc:  # ckpt_plugin is not installed for this interpreter
    print(f"ckpt_plugin: auto-attach is off: {exc}", file=sys.stderr)
else:
    start_quietly()
_run_shadowed_sitecustomize()
