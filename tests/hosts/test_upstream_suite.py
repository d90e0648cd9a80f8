"""llama-cpp-python's own tests/test_llama.py (from the sdist of the installed version, fetched by pip in setup),
with local models, run without and with every Llama attached: every test that passes without the plugin passes
with it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SDIST_DIR = ROOT / ".cache" / "upstream"


def outcomes(report: pathlib.Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        result[case.get("name", "")] = "failed" if failed else "skipped" if skipped else "passed"
    return result


def test_llama_cpp_python_suite_passes_with_the_plugin(tiny_model: Any, gemma_path: Any, tmp_path: Any) -> None:
    import llama_cpp

    sdists = sorted(SDIST_DIR.glob(f"llama_cpp_python-{llama_cpp.__version__}.tar.gz"))
    if not sdists:
        pytest.skip(f"no sdist in {SDIST_DIR} (scripts/setup.sh downloads it with pip)")
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("scipy")
    root = tmp_path / "upstream"
    prefix = f"llama_cpp_python-{llama_cpp.__version__}/"
    with tarfile.open(sdists[0]) as archive:
        members = [m for m in archive.getmembers()
                   if m.name.startswith(prefix + "tests/test_llama.py")
                   or m.name == prefix + "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"]
        archive.extractall(root, members=members, filter="data")
    base = root / prefix
    shutil.copy(ROOT / "tests" / "upstream" / "conftest.py", base / "tests" / "conftest.py")
    models = {
        "default": str(gemma_path),
        "ggml-org/models/tinyllamas/stories15M-q4_0.gguf": str(gemma_path),
        "QuantFactory/mamba-130m-hf-GGUF/mamba-130m-hf.Q2_K.gguf": str(tiny_model("mamba")),
        "tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF/Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf": str(tiny_model("hybrid")),
    }
    results = {}
    for attach in ("0", "1"):
        report = tmp_path / f"report-{attach}.xml"
        env = {**os.environ, "CKPT_UPSTREAM_MODELS": json.dumps(models), "CKPT_UPSTREAM_ATTACH": attach}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:ckpt_plugin",
                        "tests/test_llama.py", f"--junitxml={report}"], cwd=base, env=env, timeout=1200,
                       capture_output=True, text=True)
        results[attach] = outcomes(report)
    without, with_plugin = results["0"], results["1"]
    print(json.dumps({"without": without, "with": with_plugin}, indent=1))
    assert sum(v == "passed" for v in without.values()) >= 5
    regressions = [name for name, outcome in without.items() if outcome == "passed" and with_plugin.get(name) != "passed"]
    assert not regressions, regressions
