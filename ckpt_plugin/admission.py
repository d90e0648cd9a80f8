"""The import path earlier releases documented for the admission queue of parallel slots: :mod:`ckpt_plugin.http.admission_queue`."""

from ckpt_plugin.http import admission_queue as _home
from ckpt_plugin.http.admission_queue import AdmissionQueue, ServerBusy
from ckpt_plugin.http.admission_queue import AdmissionQueue as Admission  # its earlier name

# The names its home exports, no more (the home module is the one list of them).
__all__ = [*_home.__all__, "Admission"]
