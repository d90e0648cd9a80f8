"""Names renamed so that each has one meaning (docs/design.md, "Words") keep working for one release: each use warns
with a ``DeprecationWarning`` naming the new name, and does what the new name does (docs/hooks.md, "Deprecated
names")."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from ckpt_plugin.engine.slot_memory import SlotMemory
from ckpt_plugin.http.admission_queue import AdmissionQueue
from ckpt_plugin.policy.plan import Plan, Reuse
from ckpt_plugin.testing import fake_manager


def test_manager_slots_is_the_controllers() -> None:
    manager = fake_manager("swa")
    with pytest.warns(DeprecationWarning, match=r"CheckpointManager\.controllers"):
        slots = manager.slots
    assert slots is manager.controllers


def test_plan_shared_and_share_are_n_shared_and_peer() -> None:
    peer = object()
    plan: Plan[object] = Plan(n_keep=2, entry=None, tier=None, checkpoint=None, restore_state=False, park_live=False,
                              live=Reuse(0, None, 0), n_shared=5, peer=peer)
    with pytest.warns(DeprecationWarning, match=r"Plan\.n_shared"):
        assert plan.shared == 5
    with pytest.warns(DeprecationWarning, match=r"Plan\.peer"):
        assert plan.share is peer


class _OfferingBackend:
    """A backend that lets other sequences share its cells: it is told what they hold."""

    def __init__(self) -> None:
        self.offers: list[tuple[str, list[int]]] = []

    def offer_cells(self, namespace: str, tokens: np.ndarray) -> None:
        self.offers.append((namespace, [int(t) for t in tokens]))


def test_slot_memory_publish_offers_the_cells() -> None:
    memory: SlotMemory = fake_manager("plain").primary.memory
    memory.slot.append(np.array([7, 8, 9], dtype=np.int32))
    memory.backend = backend = _OfferingBackend()  # type: ignore[assignment]  # only offer_cells is called
    with pytest.warns(DeprecationWarning, match=r"SlotMemory\.offer_cells"):
        memory.publish()
    assert backend.offers == [(memory.slot.namespace, [7, 8, 9])]


def test_the_admission_queue_under_its_old_name() -> None:
    module = importlib.import_module("ckpt_plugin.admission")
    with pytest.warns(DeprecationWarning, match=r"AdmissionQueue"):
        assert module.Admission is AdmissionQueue
    with pytest.warns(DeprecationWarning, match=r"AdmissionQueue"):
        from ckpt_plugin.admission import Admission
    assert Admission is AdmissionQueue
    assert "Admission" not in module.__all__


def test_sequence_backend_publish_and_published_are_its_offer() -> None:
    pytest.importorskip("llama_cpp")
    from ckpt_plugin.hosts.llama_cpp.parallel.sequences import SequenceBackend

    backend = SequenceBackend.__new__(SequenceBackend)
    woken: list[bool] = []
    backend.offered, backend.on_offer = None, lambda: woken.append(True)
    with pytest.warns(DeprecationWarning, match=r"SequenceBackend\.offer_cells"):
        backend.publish("ns", np.array([1, 2], dtype=np.int32))
    assert woken == [True]
    with pytest.warns(DeprecationWarning, match=r"SequenceBackend\.offered"):
        published = backend.published
    assert published is backend.offered and published[0] == "ns" and list(published[1]) == [1, 2]
