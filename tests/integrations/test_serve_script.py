"""``bash scripts/serve.sh`` sets up only what serving needs (the ``serve`` extra: no test dependencies, no
redis-server, no llama-cpp-python test sources), then runs ckpt-serve: the scripts run for real, in a copy of the
repository whose ``.venv`` programs and ``apt-get`` record how they were called instead of installing."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDER = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0") $*" >> "{log}"\n'
# .venv/bin/python: records its arguments; answers "-c ''" (the venv works) and prints a version for "-c ...".
PYTHON = '#!/bin/sh\nprintf "%s\\n" "python $*" >> "{log}"\n[ "$1" = -c ] && [ -n "$2" ] && echo 0.3.36\nexit 0\n'
TOOLS = ("bash", "sh", "dirname", "basename", "cat", "cut", "sha256sum", "printf", "mkdir", "touch", "ls", "sort",
         "tail", "grep", "head")


def fake_machine(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str], pathlib.Path]:
    """A copy of the scripts, a recording ``.venv``, and a PATH with the tools the scripts use, a recording
    ``apt-get`` and no ``redis-server``."""
    repo, log, bin_dir = tmp_path / "repo", tmp_path / "calls.log", tmp_path / "bin"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(PYTHON.format(log=log))
    (venv_bin / "ckpt-serve").write_text(RECORDER.format(log=log))
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(RECORDER.format(log=log))
    for program in [*venv_bin.iterdir(), bin_dir / "apt-get"]:
        program.chmod(0o755)
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    # The llama-cpp-python build this "venv" already has: setup skips the wheel.
    (repo / ".venv" / ".llama_cpp_cmake_args").write_text("-DGGML_NATIVE=OFF")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "CMAKE_ARGS": "-DGGML_NATIVE=OFF"}
    return repo, env, log


def test_serve_sh_installs_only_the_serve_extra_and_runs_ckpt_serve(tmp_path: pathlib.Path) -> None:
    repo, env, log = fake_machine(tmp_path)
    done = subprocess.run(["bash", "scripts/serve.sh", "--admin", "true"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    installs = [call for call in calls if " install " in call]
    assert "python -m pip install --quiet -e .[serve]" in installs
    assert not [call for call in calls if "[test]" in call or call.startswith("apt-get") or " download " in call]
    assert calls[-1] == "ckpt-serve --host 127.0.0.1 --port 8000 --n_ctx 4096 --admin true"


def test_setup_sh_still_sets_up_the_tests_by_default(tmp_path: pathlib.Path) -> None:
    repo, env, log = fake_machine(tmp_path)
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert "python -m pip install --quiet -e .[test]" in calls
    assert any(call.startswith("apt-get install") and "redis-server" in call for call in calls)
    assert any(" download " in call for call in calls)
    refused = subprocess.run(["bash", "scripts/setup.sh", "bench"], cwd=repo, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.splitlines() == [
        "setup.sh: unknown extra 'bench': give test (the default) or serve"]
