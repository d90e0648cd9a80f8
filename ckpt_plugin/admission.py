"""The import path earlier releases documented for the admission queue of parallel slots: :mod:`ckpt_plugin.http.admission_queue`."""

from ckpt_plugin.http.admission_queue import *  # noqa: F401,F403
from ckpt_plugin.http.admission_queue import AdmissionQueue as Admission  # noqa: F401  (its earlier name)
