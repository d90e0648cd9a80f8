"""``ckpt-run`` and ``CKPT_AUTO_ATTACH=1`` on real programs: a script, a ``python -m`` module, a child process, a
uvicorn app and gunicorn workers, over real HTTP on 127.0.0.1. Each program reports whether its ``Llama`` is
attached; none of them mentions ckpt-run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any, Callable

import httpx
import pytest

from support.servers import free_port, serving

BIN = pathlib.Path(sys.executable).parent

REPORT = """
import ckpt_plugin

def report(llama):
    manager = ckpt_plugin.manager_of(llama)
    return {"attached": manager is not None, "n_batch": llama.n_batch,
            "budget": manager.settings.cache_max_bytes if manager else None}
"""

CHILD = """
import json, sys
from llama_cpp import Llama
from report import report

print(json.dumps(report(Llama(sys.argv[1], n_ctx=256, verbose=False))))
"""

SCRIPT = """
import json, os, subprocess, sys
import ckpt_plugin
from llama_cpp import Llama
from report import report

llama = Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
llama.create_completion([1, *range(3, 60)], max_tokens=2, temperature=0)
embedding = Llama(sys.argv[1], n_ctx=256, embedding=True, verbose=False)
manager = ckpt_plugin.manager_of(llama)
result = {"main": report(llama), "embedding": report(embedding),
          "evaluated": manager.stats()["tokens_evaluated"] if manager else 0}
if manager is not None:
    result["detached"] = ckpt_plugin.detach(llama) is manager and ckpt_plugin.manager_of(llama) is None
child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_child.py")
done = subprocess.run([sys.executable, child, sys.argv[1]], capture_output=True, text=True, check=True)
result["child"] = json.loads(done.stdout)
result["shadowed_sitecustomize_ran"] = os.environ.get("SHADOWED_SITECUSTOMIZE") == "ran"
print(json.dumps(result))
"""


def environment(**extra: str) -> dict[str, str]:
    """This environment without any CKPT_* variable, with the venv's commands first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return {**env, **extra}


def run(command: list[str], cwd: pathlib.Path, **extra: str) -> dict[str, Any]:
    done = subprocess.run(command, cwd=cwd, env=environment(**extra), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def program(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory holding ``report_llama.py``, a program that knows nothing of ckpt-run, and its child."""
    (tmp_path / "report.py").write_text(REPORT)
    (tmp_path / "report_child.py").write_text(CHILD)
    (tmp_path / "report_llama.py").write_text(SCRIPT)
    # the program's own sitecustomize, which ckpt-run's must not hide
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE'] = 'ran'\n")
    return tmp_path


def _attached_everywhere(result: dict[str, Any], budget: int) -> None:
    assert result["main"] == {"attached": True, "n_batch": 32, "budget": budget}
    assert result["embedding"]["attached"] is False  # skipped, and the program runs on
    assert result["evaluated"] > 0 and result["detached"] is True
    assert result["child"] == {"attached": True, "n_batch": 32, "budget": budget}  # children inherit it


@pytest.mark.parametrize("form", ["script", "module"])
def test_ckpt_run_attaches_every_llama_of_a_script_and_its_children(
    program: pathlib.Path, tiny_model: Callable[[str], pathlib.Path], form: str
) -> None:
    target = ["report_llama.py"] if form == "script" else ["-m", "report_llama"]
    pythonpath = os.pathsep.join([str(program), str(program / "site")])
    result = run(["ckpt-run", "--cache-max-bytes", "64MiB", "--llama", "n_batch=32", "--", "python", *target,
                  str(tiny_model("llama"))], program, PYTHONPATH=pythonpath)
    _attached_everywhere(result, 64 << 20)
    assert result["shadowed_sitecustomize_ran"]


def test_the_environment_variable_alone_attaches_without_changing_the_command(
    program: pathlib.Path, tiny_model: Callable[[str], pathlib.Path]
) -> None:
    """``CKPT_AUTO_ATTACH=1`` works through the ``.pth`` file the package installs (no ckpt-run, no PYTHONPATH)."""
    model = str(tiny_model("llama"))
    result = run([sys.executable, "report_llama.py", model], program, CKPT_AUTO_ATTACH="1",
                 CKPT_CACHE_MAX_BYTES="32MiB", CKPT_LLAMA_OVERRIDES='{"n_batch": 32}')
    _attached_everywhere(result, 32 << 20)
    plain = run([sys.executable, "report_llama.py", model], program)
    assert plain["main"]["attached"] is False and plain["child"]["attached"] is False


def test_ckpt_run_refuses_bad_settings_before_starting_the_program(program: pathlib.Path) -> None:
    done = subprocess.run(["ckpt-run", "--cache-max-bytes", "lots", "--", "python", "-c", "print('ran')"],
                          cwd=program, env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ran" not in done.stdout
    assert "--cache-max-bytes: not a byte size: 'lots'" in done.stderr


APP = """
import ckpt_plugin, os
from llama_cpp import Llama
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

llama = Llama(os.environ["APP_MODEL"], n_ctx=512, n_threads=1, verbose=False)

async def complete(request):
    words = int(request.query_params.get("n", "60"))
    out = llama.create_completion([1, *range(3, 3 + words)], max_tokens=4, temperature=0)
    manager = ckpt_plugin.manager_of(llama)
    return JSONResponse({"pid": os.getpid(), "text": out["choices"][0]["text"], "attached": manager is not None,
                         "evaluated": manager.stats()["tokens_evaluated"] if manager else None})

app = Starlette(routes=[Route("/complete", complete)])

def wsgi(environ, start_response):
    manager = ckpt_plugin.manager_of(llama)
    start_response("200 OK", [("Content-Type", "application/json")])
    return [('{"pid": %d, "attached": %s}' % (os.getpid(), "true" if manager else "false")).encode()]
"""


@pytest.fixture
def app_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "app.py").write_text(APP)
    return tmp_path


def serve(command: list[str], cwd: pathlib.Path, url: str, model: pathlib.Path) -> Any:
    """Run a server of ``app.py`` (on ``model``) until ``url`` answers."""
    ready = lambda: httpx.get(url, timeout=5).status_code == 200  # noqa: E731
    return serving(command, ready, environment(APP_MODEL=str(model)), cwd=cwd, timeout=60)


def test_ckpt_run_on_a_uvicorn_app_with_a_metrics_port(
    app_dir: pathlib.Path, tiny_model: Callable[[str], pathlib.Path]
) -> None:
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}/complete"
    command = ["ckpt-run", "--metrics-port", str(metrics_port), "--", "uvicorn", "app:app", "--host", "127.0.0.1",
               "--port", str(port)]
    with serve(command, app_dir, url, tiny_model("llama")) as (process, log):
        first = httpx.get(url, params={"n": 80}, timeout=30).json()
        second = httpx.get(url, params={"n": 90}, timeout=30).json()  # extends the first prompt
        assert first["attached"] and second["attached"]
        assert second["evaluated"] - first["evaluated"] < 90  # the shared 80 tokens were not evaluated again
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert f'ckpt_tokens_evaluated_total{{model="llama.gguf"}} {float(second["evaluated"])}' in metrics
    # uvicorn shuts down gracefully on SIGTERM, then exits by that signal; the metrics thread does not hold it
    assert process.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in "".join(log)


def test_ckpt_run_on_gunicorn_workers(app_dir: pathlib.Path, tiny_model: Callable[[str], pathlib.Path]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    command = ["ckpt-run", "--", "gunicorn", "--workers", "2", "--bind", f"127.0.0.1:{port}", "app:wsgi"]
    with serve(command, app_dir, url, tiny_model("llama")):
        answers = [httpx.get(url, timeout=30).json() for _ in range(6)]
        assert all(answer["attached"] for answer in answers)


STATS_PROGRAM = """
import sys
from llama_cpp import Llama

llama = Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
prompt = [1, *range(3, 80)]
llama.create_completion(prompt, max_tokens=2, temperature=0)
llama.create_completion(prompt + [90, 91], max_tokens=2, temperature=0)
print("{}")
"""


def test_ckpt_run_prints_the_reuse_summary_at_exit(tmp_path: pathlib.Path,
                                                  tiny_model: Callable[[str], pathlib.Path]) -> None:
    (tmp_path / "two_turns.py").write_text(STATS_PROGRAM)
    done = subprocess.run(["ckpt-run", "--stats-at-exit", "--", "python", "two_turns.py", str(tiny_model("llama"))],
                          cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("ckpt_plugin: ")]
    assert len(lines) == 1, done.stderr
    reused = int(lines[0].split(" prompts, ")[1].split(" tokens reused")[0].replace(",", ""))
    assert " 2 prompts, " in lines[0] and reused >= 77  # the second turn reused the first one's prompt
    quiet = subprocess.run(["ckpt-run", "--", "python", "two_turns.py", str(tiny_model("llama"))],
                           cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=120)
    assert "ckpt_plugin: " not in quiet.stderr


def test_ckpt_run_runs_python_on_its_own_interpreter(tmp_path: pathlib.Path) -> None:
    """A ckpt-run started by path from outside its environment: ``python`` is the one ckpt_plugin is installed in,
    not whichever is first on PATH."""
    elsewhere = tmp_path / "bin"
    elsewhere.mkdir()
    (elsewhere / "python").write_text("#!/bin/sh\necho 'the python of PATH'\n")
    (elsewhere / "python").chmod(0o755)
    env = {**environment(), "PATH": os.pathsep.join([str(elsewhere), "/usr/bin", "/bin"])}
    done = subprocess.run([str(BIN / "ckpt-run"), "--", "python", "-c", "import sys; print(sys.executable)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == sys.executable


def test_ckpt_run_stops_with_one_line_on_a_python_without_ckpt_plugin(tmp_path: pathlib.Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    script = tmp_path / "tool"
    script.write_text(f"#!{bare / 'bin' / 'python'}\nprint('ran')\n")
    script.chmod(0o755)
    for command, via in (([str(bare / "bin" / "python"), "-c", "print('ran')"], ""),
                         ([str(script)], f" (through {script})")):
        done = subprocess.run([str(BIN / "ckpt-run"), "--", *command], cwd=tmp_path, env=environment(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "ran" not in done.stdout
        assert done.stderr.splitlines() == [
            f"ckpt-run: {bare / 'bin' / 'python'}{via} is a Python without ckpt_plugin, so nothing would be "
            f"attached: run ckpt-run with that Python's environment, or the command with {sys.executable}"
        ]
