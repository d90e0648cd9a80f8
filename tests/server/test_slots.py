"""Slot files and the disk tier: round trips across processes, the HTTP API, hostile input, warm restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import httpx
import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.persist import CorruptFileError

from support.servers import model_args, run_server

HTTP = httpx.Client(timeout=120)
PROMPT = [1, *range(20, 180)]
CONTINUATION = [5, 6, 7, 8]
KINDS = ["llama", "gemma3", "mamba", "hybrid"]
OPTIONS = dict(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, seed=0, verbose=False)


def greedy(llama: Any, prompt: list[int], n: int = 6) -> list[int]:
    out = []
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(int(token))
        if len(out) == n:
            break
    return out


SAVER = textwrap.dedent("""
    import json, sys
    from llama_cpp import Llama
    import ckpt_plugin
    path, kind_options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llama = Llama(path, **kind_options)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    prompt = json.loads(sys.argv[4])
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        break
    print(json.dumps(manager.save_slot(out)))
""")


@pytest.mark.parametrize("kind", KINDS)
def test_slot_round_trip_across_processes(make_llama: Any, tiny_model: Any, tmp_path: Any, kind: str) -> None:
    path = tiny_model(kind)
    slot_file = tmp_path / "slot.bin"
    options = {**OPTIONS, **({"swa_full": False} if kind == "gemma3" else {})}
    done = subprocess.run([sys.executable, "-c", SAVER, str(path), json.dumps(options), str(slot_file),
                           json.dumps(PROMPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    saved = json.loads(done.stdout.strip().splitlines()[-1])
    assert saved["n_saved"] == len(PROMPT) and saved["n_written"] == slot_file.stat().st_size

    restored = make_llama(kind)
    manager = ckpt_plugin.attach(restored, checkpoint_min_step=32, load_entrypoints=False)
    result = manager.restore_slot(slot_file)
    assert result["n_restored"] == len(PROMPT)
    assert manager.primary.slot.checkpoints or kind == "llama"  # checkpoints came back with the state
    uninterrupted = make_llama(kind)
    prompt = PROMPT + CONTINUATION
    before = manager.counters.tokens_evaluated
    assert greedy(restored, prompt) == greedy(uninterrupted, prompt)
    assert manager.counters.tokens_evaluated - before <= len(CONTINUATION) + 6  # continued, not re-processed


def test_refused_files_leave_the_slot_unchanged(make_llama: Any, tmp_path: Any) -> None:
    llama = make_llama("gemma3")
    other = make_llama("llama")
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    other_manager = ckpt_plugin.attach(other, load_entrypoints=False)
    greedy(llama, PROMPT)
    greedy(other, PROMPT)
    good, foreign = tmp_path / "good.bin", tmp_path / "foreign.bin"
    manager.save_slot(good)
    other_manager.save_slot(foreign)
    data = bytearray(good.read_bytes())
    truncated, flipped = tmp_path / "truncated.bin", tmp_path / "flipped.bin"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    data[len(data) // 3] ^= 0x40
    flipped.write_bytes(bytes(data))
    primary = manager.primary
    before = (primary.slot.tokens.copy(), list(primary.slot.checkpoints), primary.backend.pos_max())
    for bad, error in ((truncated, CorruptFileError), (flipped, CorruptFileError),
                       (foreign, ckpt_plugin.IncompatibleStateError)):
        with pytest.raises(error):
            manager.restore_slot(bad)
        assert np.array_equal(manager.primary.slot.tokens, before[0])
        assert manager.primary.slot.checkpoints == before[1] and manager.primary.backend.pos_max() == before[2]


def test_slot_http_api(tiny_model: Any, tmp_path: Any) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    os.symlink(outside, slots / "link.bin")
    args = model_args(tiny_model("llama")) + ["--slot-save-path", str(slots)]
    with run_server(args) as server:
        messages = [{"role": "user", "content": "the cat and the dog " * 10}]
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        first = HTTP.post(f"{server.url}/v1/chat/completions", json=body).json()
        saved = HTTP.post(f"{server.url}/slots/0?action=save", json={"filename": "conv.bin"}).json()
        assert saved["id_slot"] == 0 and saved["n_saved"] > 0 and saved["n_written"] > 0 and "save_ms" in saved["timings"]
        erased = HTTP.post(f"{server.url}/slots/0?action=erase").json()
        assert erased == {"id_slot": 0, "n_erased": saved["n_saved"]}
        restored = HTTP.post(f"{server.url}/slots/0?action=restore", json={"filename": "conv.bin"}).json()
        assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] > 0
        again = HTTP.post(f"{server.url}/v1/chat/completions", json=body).json()
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        for name in ("../x.bin", "/etc/passwd", "a/b.bin", ".hidden", "link.bin"):
            for action in ("save", "restore"):
                response = HTTP.post(f"{server.url}/slots/0?action={action}", json={"filename": name})
                assert response.status_code == 400, (name, action, response.text)
        assert outside.read_bytes() == b"x"
        assert HTTP.post(f"{server.url}/slots/0?action=restore", json={"filename": "nope.bin"}).status_code == 404
        assert HTTP.post(f"{server.url}/slots/3?action=save", json={"filename": "a.bin"}).status_code == 404
        assert HTTP.post(f"{server.url}/slots/0?action=fly", json={"filename": "a.bin"}).status_code == 400


def test_slot_api_is_off_without_a_directory(tiny_model: Any) -> None:
    with run_server(model_args(tiny_model("llama"))) as server:
        response = HTTP.post(f"{server.url}/slots/0?action=save", json={"filename": "a.bin"})
        assert response.status_code == 404 and "slot-save-path" in response.json()["error"]["message"]


def test_restarted_server_starts_warm_from_the_disk_tier(tiny_model: Any, tmp_path: Any) -> None:
    args = model_args(tiny_model("gemma3")) + ["--checkpoint-disk-dir", str(tmp_path / "disk"),
                                               "--checkpoint-min-step", "32"]
    body = {"messages": [{"role": "system", "content": "one two three four " * 20},
                         {"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
    with run_server(args) as server:
        first = HTTP.post(f"{server.url}/v1/chat/completions", json=body).json()
    assert list((tmp_path / "disk").glob("*.ckpt")), "the live slot was not flushed at shutdown"
    with run_server(args) as server:
        body["messages"] += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "and then"}]
        warm = HTTP.post(f"{server.url}/v1/chat/completions", json=body).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        assert server.metric("disk_hits_total") == 1
