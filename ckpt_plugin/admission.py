"""The import path earlier releases documented for the admission queue of parallel slots: :mod:`ckpt_plugin.http.admission_queue`."""

from typing import Any

from ckpt_plugin.core.renamed import warn_renamed
from ckpt_plugin.http import admission_queue as _home
from ckpt_plugin.http.admission_queue import AdmissionQueue, ServerBusy

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)


def __getattr__(name: str) -> Any:
    # ``Admission`` is the tier protocol's word (ckpt_plugin.tiers.protocol.Admission): the queue's old name warns.
    if name == "Admission":
        warn_renamed("ckpt_plugin.admission.Admission", "ckpt_plugin.http.admission_queue.AdmissionQueue")
        return AdmissionQueue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
