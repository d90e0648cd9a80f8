"""The benchmark page marks each key figure against its goal (bench/_common.py ``goal_status``), and keeps each
benchmark's latest figures with the commit they measured (bench/run_all.py), so that a partial run still writes the
whole page."""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import _common
        import run_all

        yield _common, run_all
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(("value", "goal", "status"), [
    ("1.22x", "<= 1.15", "missed"),
    ("1.03x", "<= 1.15", "met"),
    ("19.36x", ">= 15", "met"),
    ("0.00 / 0.00", "0", "met"),
    ("1.00; 1.00", "1.00", "met"),
    ("1.00; 1.02", "1.00", "missed"),
    ("0.151 ms / 0.126 ms vs 312.3 ms (LlamaRAMCache / HostPromptCache = 2,070x)", "< 0.2 ms", "met"),
    ("0.25 ms vs 312.3 ms", "< 0.2 ms", "missed"),
    ("1.78x -> 1.06x", "<= 1.1 (with plugin)", "met"),
    ("1.01x, 1.01x, 1.03x (another run: 0.98x, 0.97x, 1.02x)", "<= 1.0", "missed"),
    ("0.61x (section \"Interleaved chat\")", "<= 0.6", "missed"),
    ("46/48; 44/48", ">= 90%", "met"),
    ("38/48, 26/48", ">= 90%", "missed"),
    ("2.77x; 1.75x", "flat in the number of entries", "not checked"),
    ("not measured (no llama-server on PATH)", "<= 0.6", "not checked"),
    ("7.96x", "", ""),
    ("255 MiB (0.99x the budget)", "<= 1.1", "met"),
    ("300 MiB (1.17x the budget)", "<= 1.1", "missed"),
    ("0 B", "0", "met"),
])
def test_goal_status(bench: Any, value: str, goal: str, status: str) -> None:
    common, _ = bench
    assert common.goal_status(value, goal) == status


def test_the_summary_marks_and_lists_missed_goals(bench: Any) -> None:
    common, run_all = bench
    report = common.Report("t", [], [common.Figure("a", "1.22x", "<= 1.15"), common.Figure("b", "1.00x", "<= 1.15")])
    text = run_all.summary([run_all.Section("micro", report, 1.0, 0.0)])
    assert "| **missed** |" in text and "| met " in text
    assert text.endswith("### Goals missed (1)\n\n- micro: a: 1.22x, goal <= 1.15")


def test_the_goal_tables_of_a_section_are_its_key_figures(bench: Any, tmp_path: pathlib.Path) -> None:
    _, run_all = bench
    (tmp_path / "60-shared-tier.md").write_text(
        "## Shared tier\n\n| ratio | measured | goal | |\n| --- | --- | --- | --- |\n| moved / same | 1.14x | <= 1.5x "
        "| met |\n| moved / local | 0.73x | <= 0.25x | missed |\n\n| figure | ckpt-serve | alone | goal |\n| --- | --- | "
        "--- | --- |\n| 5xx | 0 | 43 | 0 |\n| TTFT p50 | 1.18 s | 11.99 s | |\n")
    rows = run_all.section_figures(tmp_path / "no-results", tmp_path)
    assert [(r.benchmark, r.figure.name, r.figure.value, r.figure.goal) for r in rows] == [
        ("shared tier", "moved / same", "1.14x", "<= 1.5"), ("shared tier", "moved / local", "0.73x", "<= 0.25"),
        ("shared tier", "5xx", "0", "0")]


def test_a_kept_run_is_read_back_with_its_commit(bench: Any, tmp_path: pathlib.Path) -> None:
    common, run_all = bench
    report = common.Report("Micro", ["text"], [common.Figure("a", "1.22x", "<= 1.15")])
    run_all.Section("micro", report, 12.5, 0.01, "", "abc1234", "2026-12-05 19:00").save(tmp_path)
    loaded = run_all.Section.load("micro", tmp_path)
    assert loaded is not None and loaded.report == report
    assert (loaded.commit, loaded.started, loaded.seconds) == ("abc1234", "2026-12-05 19:00", 12.5)
    assert run_all.Section.load("lookup", tmp_path) is None
