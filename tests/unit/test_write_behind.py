"""The write-behind queue: bounded, drops its oldest job when full, releases every job once, never dies of a job."""

from __future__ import annotations

import threading

from ckpt_plugin.tiers.shared.write_behind import Job, WriteBehind


def test_a_full_queue_drops_the_oldest_and_every_job_is_released_once() -> None:
    gate = threading.Event()
    ran: list[int] = []
    released: list[int] = []
    started = threading.Event()
    queue = WriteBehind(2, idle_interval=0.01)
    # the first job occupies the thread until the gate opens
    queue.submit(Job(lambda: (started.set(), gate.wait()), lambda: released.append(-1)))
    assert started.wait(5)
    for i in range(4):
        assert queue.submit(Job(lambda i=i: ran.append(i), lambda i=i: released.append(i)))
    assert queue.drops == 2 and queue.depth == 3
    gate.set()
    assert queue.drain(5)
    assert ran == [2, 3] and sorted(released) == [-1, 0, 1, 2, 3]


def test_a_failing_job_does_not_stop_the_thread_and_idle_runs_between_jobs() -> None:
    idle = threading.Event()
    ran: list[str] = []
    queue = WriteBehind(4, idle=idle.set, idle_interval=0.01)

    def boom() -> None:
        raise RuntimeError("the server went away")

    queue.submit(Job(boom))
    queue.submit(Job(lambda: ran.append("after")))
    assert queue.drain(5) and ran == ["after"] and queue.done == 2
    assert idle.wait(5)
    queue.close(1)
    released: list[int] = []
    assert not queue.submit(Job(lambda: ran.append("late"), lambda: released.append(1)))
    assert released == [1] and ran == ["after"]
