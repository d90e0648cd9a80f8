"""Host-cache semantics: Llamas that share one host cache object share one prompt cache; LlamaDiskCache maps onto
the disk tier in its directory."""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np
import pytest

import ckpt_plugin

PROMPT = [1, *range(10, 150)]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba"])
def test_llamas_sharing_a_ram_cache_share_entries(make_llama: Any, kind: str) -> None:
    fresh = make_llama(kind)
    expected = fresh.create_completion(PROMPT, max_tokens=3, temperature=0)["choices"][0]["text"]
    cache = llama_cpp.LlamaRAMCache(capacity_bytes=1 << 30)
    writer, reader = make_llama(kind), make_llama(kind)
    writer_manager = ckpt_plugin.attach(writer, load_entrypoints=False)
    reader_manager = ckpt_plugin.attach(reader, load_entrypoints=False)
    writer.set_cache(cache)
    reader.set_cache(cache)
    assert writer_manager.cache is reader_manager.cache
    writer.create_completion(PROMPT, max_tokens=3, temperature=0)
    loads = [0]
    original = reader.load_state

    def counting_load_state(state: Any) -> None:
        loads[0] += 1
        original(state)

    reader.load_state = counting_load_state
    evaluated = reader_manager.counters.tokens_evaluated
    actual = reader.create_completion(PROMPT, max_tokens=3, temperature=0)["choices"][0]["text"]
    assert loads[0] == 1  # the host found the other Llama's entry in the shared cache and loaded it
    assert actual == expected
    assert reader_manager.counters.tokens_evaluated - evaluated <= 1 + 3


def test_disk_cache_maps_onto_the_disk_tier(make_llama: Any, tmp_path: Any) -> None:
    pytest.importorskip("diskcache")
    directory = tmp_path / "host-disk-cache"
    first = make_llama("gemma3")
    manager = ckpt_plugin.attach(first, load_entrypoints=False)
    first.set_cache(llama_cpp.LlamaDiskCache(str(directory), capacity_bytes=1 << 30))
    first.create_completion(PROMPT, max_tokens=3, temperature=0)
    assert manager.disk is not None and len(manager.disk) >= 1
    assert list((directory / "ckpt_plugin").glob("*.ckpt"))
    # a new process (here: a new Llama and a new host cache object on the same directory) starts warm
    second = make_llama("gemma3")
    later = ckpt_plugin.attach(second, load_entrypoints=False)
    second.set_cache(llama_cpp.LlamaDiskCache(str(directory), capacity_bytes=1 << 30))
    second.create_completion(np.asarray(PROMPT).tolist() + [5], max_tokens=3, temperature=0)
    assert later.counters.disk_hits == 1
