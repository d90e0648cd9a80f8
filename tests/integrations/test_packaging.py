"""What a user installs: the sdist builds, a wheel built from that sdist installs and runs, and so does an editable
install; ``ckpt-serve`` without the ``serve`` extra says how to get it.

The ``packaging`` tests (deselect with ``-m "not packaging"``) build with build isolation, as pip does, so they need
the package index for setuptools. They run with an empty home directory (``fresh_machine_home``), as on a new
machine: pip's cache, and whatever else an earlier run left there, is not found. The wheel goes into a fresh venv made without pip whose
dependencies come from this environment's site-packages, added by a ``.pth`` file after the wheel is installed (so
that pip sees no ckpt_plugin there, and never touches this environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from typing import Any, Iterator, Sequence

import pytest

from ckpt_plugin_integrations import serve_entry

from support.home import fresh_machine_home

ROOT = pathlib.Path(__file__).resolve().parents[2]
HINT = "pip install 'ckpt_plugin[serve]'"
TIMEOUT = 300

needs_posix = pytest.mark.skipif(os.name != "posix", reason="venv layout of POSIX (bin/)")


@pytest.fixture(scope="module", autouse=True)
def fresh_home_for_the_builds() -> Iterator[pathlib.Path]:
    """An empty home directory for the whole module (the sdist and the wheel are built once, by module-scoped
    fixtures that must see it too)."""
    with fresh_machine_home() as home:
        yield home


def _build_hooks() -> Any:
    spec = importlib.util.spec_from_file_location("build_hooks", ROOT / "build_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would change which ckpt_plugin a child process imports."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "CKPT_AUTO_ATTACH") and not k.startswith("CKPT_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def run(cmd: Sequence[str | os.PathLike[str]], cwd: pathlib.Path, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(map(str, cmd))} exited with {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def purelib(python: pathlib.Path, cwd: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            cwd).stdout.strip())


def fresh_venv(path: pathlib.Path) -> pathlib.Path:
    run([sys.executable, "-m", "venv", "--without-pip", path], path.parent)
    return path / "bin" / "python"


def add_this_environment(python: pathlib.Path, cwd: pathlib.Path) -> None:
    """Make this environment's site-packages (the dependencies) importable in the venv of ``python``, after its own.

    A plain path line: the ``.pth`` files there (this checkout's editable finder) are not run. The name sorts before
    ``ckpt_plugin_autoattach.pth``, whose line imports ``wrapt`` from there when ``CKPT_AUTO_ATTACH`` is set.
    """
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib(python, cwd) / "00_ckpt_test_dependencies.pth").write_text("\n".join(paths) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """The sdist of this checkout, its unpacked tree and a wheel built from that tree."""
    pytest.importorskip("build", reason="the test extra's 'build' package builds the sdist and the wheel")
    work = tmp_path_factory.mktemp("packaging")
    out = work / "dist"
    run([sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT], work)
    (sdist,) = out.glob("ckpt_plugin-*.tar.gz")
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(work / "src", filter="data")
        else:  # Python before 3.10.12 / 3.11.4
            archive.extractall(work / "src")
    (tree,) = (work / "src").iterdir()
    run([sys.executable, "-m", "build", "--wheel", "--outdir", out, tree], work)
    (wheel,) = out.glob("ckpt_plugin-*.whl")
    return {"work": work, "sdist": sdist, "tree": tree, "wheel": wheel}


@pytest.fixture(scope="module")
def wheel_venv(dists: dict[str, pathlib.Path]) -> pathlib.Path:
    """A fresh venv with the wheel installed (``--no-deps``) and this environment's packages as dependencies."""
    work = dists["work"]
    python = fresh_venv(work / "wheel-venv")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", dists["wheel"]],
        work)
    add_this_environment(python, work)
    return python


@pytest.mark.packaging
def test_the_sdist_holds_what_a_wheel_build_needs(dists: dict[str, pathlib.Path]) -> None:
    with tarfile.open(dists["sdist"]) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    for name in ("build_hooks.py", "LICENSE", "pyproject.toml", "README.md", "ckpt_plugin/py.typed",
                 "integrations/serve_entry.py", "integrations/pytest_plugin.py", "tests/conftest.py"):
        assert name in names, f"{name} is not in {dists['sdist'].name}"
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)


@pytest.mark.packaging
def test_the_wheel_from_the_sdist_holds_the_license_the_types_and_the_pth_file(
        dists: dict[str, pathlib.Path]) -> None:
    with zipfile.ZipFile(dists["wheel"]) as archive:
        names = set(archive.namelist())
        (dist_info,) = {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")}
        pth = archive.read("ckpt_plugin_autoattach.pth").decode()
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    assert "ckpt_plugin/py.typed" in names
    assert f"{dist_info}/licenses/LICENSE" in names
    assert pth == _build_hooks().PTH_LINE
    assert "License-Expression: MIT" in metadata
    assert "Project-URL: Issues, https://github.com/ckpt-plugin/ckpt_plugin/issues" in metadata
    assert "ckpt-serve = ckpt_plugin_integrations.serve_entry:main" in entry_points
    assert "ckpt_plugin = ckpt_plugin_integrations.pytest_plugin" in entry_points
    # The README on PyPI: no link into the repository that only resolves next to it.
    assert "](docs/" not in metadata


@needs_posix
@pytest.mark.packaging
def test_the_installed_wheel_serves_and_attaches(dists: dict[str, pathlib.Path], wheel_venv: pathlib.Path) -> None:
    work = dists["work"]
    venv = wheel_venv.parent.parent
    site = purelib(wheel_venv, work)
    assert (site / "ckpt_plugin_autoattach.pth").read_text() == _build_hooks().PTH_LINE

    serve = run([venv / "bin" / "ckpt-serve", "--help"], work)
    assert "--cache-max-bytes" in serve.stdout

    script = (
        "import json, sys\n"
        "import llama_cpp, ckpt_plugin, ckpt_plugin_integrations\n"
        "from ckpt_plugin.testing.tiny_models import build_tiny_model\n"
        "path = build_tiny_model('llama', sys.argv[1])\n"
        "llama = llama_cpp.Llama(str(path), n_ctx=256, verbose=False)\n"
        "auto = ckpt_plugin.manager_of(llama) is not None\n"
        "manager = ckpt_plugin.manager_of(llama) or ckpt_plugin.attach(llama)\n"
        "tokens = []\n"
        "for token in llama.generate([1, *range(3, 40)], temp=0.0, top_k=1, repeat_penalty=1.0):\n"
        "    tokens.append(int(token))\n"
        "    if len(tokens) == 2:\n"
        "        break\n"
        "print(json.dumps({'files': [ckpt_plugin.__file__, ckpt_plugin_integrations.__file__], 'auto': auto,\n"
        "                  'tokens': tokens, 'evaluated': manager.stats()['tokens_evaluated']}))\n"
    )
    model = work / "tiny-llama.gguf"
    plain = json.loads(run([wheel_venv, "-c", script, model], work).stdout.splitlines()[-1])
    # The package of the wheel, not this checkout.
    assert all(pathlib.Path(f).is_relative_to(site) for f in plain["files"]), plain["files"]
    assert plain["auto"] is False
    assert len(plain["tokens"]) == 2
    assert plain["evaluated"] > 0

    # The installed .pth file turns auto-attach on at interpreter start.
    auto = json.loads(run([wheel_venv, "-c", script, model], work, clean_env(CKPT_AUTO_ATTACH="1"))
                      .stdout.splitlines()[-1])
    assert auto["auto"] is True
    assert auto["tokens"] == plain["tokens"]


@needs_posix
@pytest.mark.packaging
def test_the_installed_ckpt_serve_without_the_server_extra(dists: dict[str, pathlib.Path],
                                                           wheel_venv: pathlib.Path) -> None:
    script = wheel_venv.parent / "ckpt-serve"
    code = ("import runpy, sys\n"
            "sys.modules['fastapi'] = None\n"
            f"sys.argv = [{str(script)!r}, '--help']\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    proc = run([wheel_venv, "-c", code], dists["work"], check=False)
    assert proc.returncode == 2, proc.stderr
    assert HINT in proc.stderr


@needs_posix
@pytest.mark.packaging
def test_an_editable_install_of_the_sdist_tree_installs_the_pth_file(dists: dict[str, pathlib.Path]) -> None:
    work = dists["work"]
    python = fresh_venv(work / "editable-venv")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-e", dists["tree"]], work)
    assert (purelib(python, work) / "ckpt_plugin_autoattach.pth").read_text() == _build_hooks().PTH_LINE
    where = run([python, "-c", "import ckpt_plugin_integrations.serve_entry as m; print(m.__file__)"], work)
    assert pathlib.Path(where.stdout.strip()).is_relative_to(dists["tree"])


@pytest.mark.parametrize("module", ["fastapi", "sse_starlette", "starlette_context"])
def test_ckpt_serve_without_the_server_extra_says_how_to_install_it(module: str, tmp_path: pathlib.Path) -> None:
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from ckpt_plugin_integrations.serve_entry import main\n"
            "main(['--help'])\n")
    proc = run([sys.executable, "-c", code], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert HINT in line and module in line


def test_other_missing_modules_are_not_blamed_on_the_server_extra() -> None:
    assert serve_entry.missing_serve_module(ModuleNotFoundError("x", name="uvicorn.workers")) == "uvicorn"
    assert serve_entry.missing_serve_module(ModuleNotFoundError("x", name="numpy")) is None
    assert serve_entry.missing_serve_module(ModuleNotFoundError("x")) is None
