"""Run every benchmark of this directory and write ``docs/benchmarks.md``.

Run: ``.venv/bin/python bench/run_all.py`` (several minutes) or ``--quick`` (fewer repeats); ``--only micro``
(repeatable) runs a subset; ``--render`` runs none; ``--output PATH`` writes elsewhere.

Each full run of a benchmark is kept in ``bench/results/<name>.json`` with the commit it measured, so that a run of
a subset (or none) still writes the whole page: the benchmarks not run keep their latest figures, and the page says
which commit and date each benchmark's figures are from. Every key figure is checked against its goal
(:func:`_common.goal_status`); missed goals are marked and listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from _common import Figure, Report, fmt_ms, goal_status, markdown_table
from micro import thp_setting

BENCH_DIR = pathlib.Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
OUTPUT = ROOT / "docs" / "benchmarks.md"
SECTIONS_DIR = ROOT / "docs" / "bench-sections"
"""Sections of long benchmarks run on their own (the soak, the integrations, the shared tier): each writes its markdown
here, and every regeneration of docs/benchmarks.md includes the latest, in file-name order."""
RESULTS_DIR = BENCH_DIR / "results"
"""The latest full run of each benchmark (``<name>.json``), and ``sections.json``: the key figures the sections of
``SECTIONS_DIR`` state in their text (those in a table with a ``goal`` column are read from the section itself),
each naming the section it comes from."""
BENCHES = ("micro", "lookup", "sharing", "branching", "chat", "speculative")
# chat.py's --json is its raw per-request record; its section for this page comes through --report-json.
REPORT_FLAG = {"chat": "--report-json"}

# ---------------------------------------------------------------------------------------------------------------------
# machine load: the machine is shared, so say how much of it other processes used while each benchmark ran


class CpuShare:
    """CPU time used by other processes over an interval, as a fraction of the machine's capacity."""

    _BUSY = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return sum(ticks[i] for i in CpuShare._BUSY if i < len(ticks)), sum(ticks[:8])

    @staticmethod
    def _own_ticks() -> float:
        t = os.times()
        return (t.user + t.system + t.children_user + t.children_system) * os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuShare:
        self._busy, self._total = self._machine()
        self._own = self._own_ticks()
        self.others = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = self._machine()
        others = (busy - self._busy) - (self._own_ticks() - self._own)
        self.others = max(0.0, others / max(total - self._total, 1))


# ---------------------------------------------------------------------------------------------------------------------
# run


@dataclass
class Section:
    name: str
    report: Report | None
    seconds: float
    others_cpu: float
    error: str = ""
    commit: str = ""  # what the figures measured: the commit, with "+ changes" where ckpt_plugin/ had uncommitted ones
    started: str = ""  # when the run started (UTC)

    def save(self, directory: pathlib.Path = RESULTS_DIR) -> None:
        """Keep this run as the benchmark's latest (``directory/<name>.json``)."""
        directory.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self)
        data["report"] = json.loads(self.report.to_json()) if self.report is not None else None
        (directory / f"{self.name}.json").write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, name: str, directory: pathlib.Path = RESULTS_DIR) -> Section | None:
        """The benchmark's latest kept run, if any."""
        path = directory / f"{name}.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        report = Report.from_json(json.dumps(data.pop("report"))) if data.get("report") else None
        return cls(report=report, **data)


@dataclass(frozen=True)
class SectionFigure:
    """A key figure of a section of ``SECTIONS_DIR`` (a benchmark run on its own), for the summary."""

    benchmark: str
    figure: Figure
    source: str  # the section it comes from


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def goal_rows(markdown: str) -> list[tuple[str, str, str]]:
    """``(figure, value, goal)`` of every row with a goal in the markdown tables of a section whose header has a
    ``goal`` column; the value is the ``measured`` column's, else the second column's (the server measured)."""
    rows: list[tuple[str, str, str]] = []
    lines = markdown.splitlines()
    for i, line in enumerate(lines[:-1]):
        if not (line.startswith("|") and re.fullmatch(r"\|[\s:|-]+\|", lines[i + 1].strip())):
            continue  # not a table's header
        header = [cell.lower() for cell in _cells(line)]
        if "goal" not in header or len(header) < 3:
            continue
        goal_at = header.index("goal")
        value_at = header.index("measured") if "measured" in header else 1
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            if len(cells) == len(header) and cells[goal_at]:
                rows.append((cells[0], cells[value_at], cells[goal_at].removesuffix("x").strip()))
    return rows


def section_figures(directory: pathlib.Path = RESULTS_DIR, sections: pathlib.Path = SECTIONS_DIR
                    ) -> list[SectionFigure]:
    """The key figures of ``SECTIONS_DIR``'s sections: the rows with a goal of their tables, then those of
    ``sections.json`` (benchmark, figure, value, goal, source), figures a section states in its text."""
    figures = []
    for path in sorted(sections.glob("*.md")):
        text = path.read_text()
        title = text.splitlines()[0].lstrip("# ").strip() if text.strip() else path.stem
        benchmark = path.stem.split("-", 1)[-1].replace("-", " ")
        figures += [SectionFigure(benchmark, Figure(name, value, goal), title) for name, value, goal in goal_rows(text)]
    path = directory / "sections.json"
    if path.exists():
        figures += [SectionFigure(row["benchmark"], Figure(row["figure"], row["value"], row.get("goal", "")),
                                  row["source"]) for row in json.loads(path.read_text())]
    return figures


def current_commit() -> str:
    """HEAD's short hash, with ``+ changes`` where ckpt_plugin/ has uncommitted changes (the figures measured them)."""
    commit = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return f"{commit} + changes" if _git("status", "--porcelain", "--", "ckpt_plugin") else commit


def run_bench(name: str, quick: bool) -> Section:
    """Run ``bench/<name>.py`` in a process of its own (so that allocator state, buffer pools and loaded models of one
    benchmark cannot change the figures of the next) and collect its report."""
    print(f"== {name} ...", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, CpuShare() as share:
        out = pathlib.Path(tmp) / f"{name}.json"
        flag = REPORT_FLAG.get(name, "--json")
        command = [sys.executable, str(BENCH_DIR / f"{name}.py"), flag, str(out), *(["--quick"] if quick else [])]
        done = subprocess.run(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        report = Report.from_json(out.read_text()) if done.returncode == 0 and out.exists() else None
    error = "" if report is not None else f"exit status {done.returncode}\n{done.stderr[-4000:]}"
    if error:
        print(error, file=sys.stderr, flush=True)
    return Section(name, report, time.perf_counter() - started, share.others, error, current_commit(),
                   f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")


# ---------------------------------------------------------------------------------------------------------------------
# environment


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_total() -> str:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    return "unknown"


def environment() -> list[tuple[str, str]]:
    import llama_cpp
    import numpy

    import ckpt_plugin

    commit = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = _git("status", "--porcelain", "--", "ckpt_plugin")
    changed = ", ".join(line[3:] for line in dirty.splitlines()) if dirty else "none"
    return [
        ("CPUs (nproc)", str(len(os.sched_getaffinity(0)))),
        ("CPU model", cpu_model()),
        ("memory", memory_total()),
        ("kernel", platform.release()),
        ("transparent huge pages", thp_setting()),
        ("python", platform.python_version()),
        ("llama-cpp-python", llama_cpp.__version__),
        ("llama.cpp system info", llama_cpp.llama_print_system_info().decode().strip().rstrip("|").strip()),
        ("numpy", numpy.__version__),
        ("ckpt_plugin", f"{ckpt_plugin.__version__} (git {commit}; uncommitted changes in ckpt_plugin/: {changed})"),
    ]


# ---------------------------------------------------------------------------------------------------------------------
# markdown

INTRO = """\
# Benchmarks

Generated by `bench/run_all.py`; do not edit by hand. Workloads and goals: `bench/README.md`.
The machine is small and shared, so every figure is a ratio of two things measured side by side in the same run
(cases of a comparison run in interleaved rounds, medians over the rounds); absolute times are only context. The
share of the machine's CPU time that other processes used while each benchmark ran is listed below: under load the
absolute times grow and the ratios get noisier."""




def _status_cell(status: str) -> str:
    return "**missed**" if status == "missed" else status


def summary(sections: list[Section], extra: list[SectionFigure] | None = None) -> str:
    """The key figures of every benchmark, each with its goal and whether it is met; then the goals missed."""
    rows, missed = [], []
    figures = [(s.name, f) for s in sections if s.report is not None for f in s.report.figures]
    figures += [(row.benchmark, row.figure) for row in extra or []]
    for section in sections:
        if section.report is None:
            rows.append([section.name, "FAILED (see below)", "", "", ""])
    for benchmark, figure in figures:
        status = goal_status(figure.value, figure.goal)
        rows.append([benchmark, figure.name, figure.value, figure.goal, _status_cell(status)])
        if status == "missed":
            missed.append(f"- {benchmark}: {figure.name}: {figure.value}, goal {figure.goal}")
    table = markdown_table(["benchmark", "figure", "measured", "goal (bench/README.md)", "goal met"], rows)
    if not missed:
        return table + "\n\nEvery goal checked is met."
    return "\n\n".join([table, f"### Goals missed ({len(missed)})", "\n".join(missed)])


def render(sections: list[Section], command: str, quick: bool, started: datetime.datetime, seconds: float,
           extra: list[SectionFigure] | None = None) -> str:
    env_rows = [[k, v.replace("|", "/")] for k, v in environment()]
    load_rows = [[s.name, s.commit or "unknown", s.started or "unknown", fmt_ms(s.seconds), f"{s.others_cpu:.0%}"]
                 for s in sections]
    parts = [
        INTRO,
        "## This run",
        f"Command: `{command}`{' (quick: fewer repeats)' if quick else ''}; started {started:%Y-%m-%d %H:%M} UTC, "
        f"took {fmt_ms(seconds)}. Benchmarks not run by it keep their latest figures (`bench/results/`): the table "
        "below says which commit and run each benchmark's figures are from.",
        markdown_table(["machine / software", "this run"], env_rows),
        markdown_table(["benchmark", "figures of commit", "run started (UTC)", "wall time",
                        "CPU used by other processes"], load_rows),
        "## Key figures",
        summary(sections, extra),
    ]
    for section in sections:
        if section.report is not None:
            parts.append(section.report.markdown().rstrip())
        else:
            parts.append(f"## {section.name}: FAILED\n\n```\n{section.error.strip()}\n```")
    parts += [path.read_text().rstrip() for path in sorted(SECTIONS_DIR.glob("*.md"))]
    return "\n\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Run the benchmarks and write docs/benchmarks.md.")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", action="append", choices=BENCHES, help="run only this benchmark (repeatable); "
                        "the others keep their latest figures")
    parser.add_argument("--render", action="store_true", help="run nothing: write the page from the latest figures")
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT, help="markdown file to write")
    args = parser.parse_args()
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    to_run = () if args.render else tuple(args.only or BENCHES)
    sections = []
    for name in BENCHES:
        if name in to_run:
            section = run_bench(name, args.quick)
            if section.report is not None and not args.quick:  # a quick run does not replace a full one
                section.save()
        else:
            section = Section.load(name)
        if section is not None:
            sections.append(section)
    command = " ".join([".venv/bin/python", "bench/run_all.py", *sys.argv[1:]])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(sections, command, args.quick, started, time.perf_counter() - t0,
                                  section_figures()))
    print(f"wrote {args.output}")
    return 1 if any(s.report is None for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
