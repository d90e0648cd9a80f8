"""The disk tier stores pages by id, once, with real contexts: a turn writes only the pages it adds, conversations
on one system prompt share its page files, a restart restores answers equal to a fresh context, a corrupt or deleted
page file is a miss (the entry moved aside), eviction deletes the page files nobody names, and files of the previous
format version (whole states) are still read."""

from __future__ import annotations

import os
import pathlib
import random
from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.core.errors import CorruptFileError
from ckpt_plugin.persist import FORMAT_VERSION, PAGED_VERSION, decode_entry, read_entry, read_header, write_entry
from ckpt_plugin.persist.page_files import PageFiles
from ckpt_plugin.tiers.disk import DiskTier

from support.live_pages import drop_states as forget

SETTINGS = dict(checkpoint_min_step=16, page_positions=8, load_entrypoints=False)
# 8-position pages: the tiny gemma3's window is 32 positions (Gemma-3-270M's 512 spans 16 pages of 32)


@pytest.fixture
def system(request: pytest.FixtureRequest) -> list[int]:
    """A system prompt of the test's own: no page of it is live from another test (pages of the same tokens, model
    and namespace have the same ids, and a test must read what it means to read from files)."""
    return [1, *random.Random(request.node.name).choices(range(3, 250), k=159)]


def attached(make_llama: Any, directory: pathlib.Path, kind: str = "gemma3", max_bytes: int = 1 << 30) -> Any:
    """A Llama on a disk tier of its own over ``directory`` (a new tier: what a restarted process scans)."""
    llama = make_llama(kind)
    ckpt_plugin.attach(llama, disk=DiskTier(directory, max_bytes), **SETTINGS)
    return llama


def tier_of(llama: Any) -> DiskTier:
    disk = ckpt_plugin.manager_of(llama).disk
    assert disk is not None
    return disk


def answer(llama: Any, prompt: list[int]) -> str:
    return llama.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]


def stored(llama: Any) -> None:
    """Put the slot into the cache, written through to the disk tier."""
    ckpt_plugin.manager_of(llama).flush()


def files(directory: pathlib.Path) -> dict[pathlib.Path, tuple[int, int, int]]:
    """Every file under ``directory``: its size, inode and modification time."""
    found = {}
    for path in directory.rglob("*"):
        if path.is_file():
            info = path.stat()
            found[path] = (info.st_size, info.st_ino, info.st_mtime_ns)
    return found


def written_between(before: dict[pathlib.Path, tuple[int, int, int]],
                    after: dict[pathlib.Path, tuple[int, int, int]]) -> int:
    """Bytes of the files that are new or were replaced (a rename gives a new inode)."""
    return sum(info[0] for path, info in after.items() if before.get(path) != info)


def whole_size(llama: Any, tmp: pathlib.Path) -> int:
    """What the previous format wrote for the entry of the slot's tokens: every state assembled."""
    manager = ckpt_plugin.manager_of(llama)
    tokens = manager.primary.slot.tokens
    entry = next(e for e in manager.cache.entries() if np.array_equal(e.tokens, tokens))
    return write_entry(tmp / "whole.ckpt", entry, model_fingerprint=entry.fingerprint)


def pages_named(directory: pathlib.Path) -> set[bytes]:
    """Every page id the entry files in ``directory`` name."""
    return {page_id for path in directory.glob("*.ckpt") for page_id in read_header(path, with_pages=True).pages}


def page_files(directory: pathlib.Path) -> set[bytes]:
    return set(PageFiles(directory / "pages").listing())


def one_conversation(make_llama: Any, directory: pathlib.Path, system: list[int]) -> tuple[Any, DiskTier]:
    """A Llama on a disk tier over ``directory`` that wrote one conversation on ``system``."""
    llama = attached(make_llama, directory)
    answer(llama, system + list(range(170, 180)))
    stored(llama)
    return llama, tier_of(llama)


@pytest.mark.parametrize("kind", ["gemma3", "llama", "hybrid"])
def test_a_turn_writes_only_the_pages_it_adds(make_llama: Any, tmp_path: pathlib.Path, system: list[int],
                                              kind: str) -> None:
    directory = tmp_path / "disk"
    llama = attached(make_llama, directory, kind)
    tier = tier_of(llama)
    conversation = system + list(range(170, 180))
    sizes = []
    for turn in range(4):
        answer(llama, conversation)
        before, counted = files(directory), tier.bytes_written
        stored(llama)
        after = files(directory)
        written = written_between(before, after)
        assert written == tier.bytes_written - counted > 0
        whole = whole_size(llama, tmp_path)
        sizes.append((written, whole))
        if turn:
            # the new pages and the page maps (and a hybrid's recurrent state, whole in every checkpoint)
            assert written < whole / (2 if kind == "hybrid" else 3), sizes
        conversation = list(llama._input_ids) + list(range(200 + 10 * turn, 210 + 10 * turn))
    # every turn's entry is a file; the pages they share are on disk once
    assert len(list(directory.glob("*.ckpt"))) == 4
    assert page_files(directory) == pages_named(directory)
    assert all(read_header(p).version == PAGED_VERSION for p in directory.glob("*.ckpt"))
    assert tier.resident_bytes == sum(info[0] for info in files(directory).values())


def test_conversations_on_one_system_prompt_share_its_page_files(make_llama: Any, tmp_path: pathlib.Path,
                                                                  system: list[int]) -> None:
    directory = tmp_path / "disk"
    llama, tier = one_conversation(make_llama, directory, system)
    first, first_pages = tier.bytes_written, tier.pages_written
    answer(llama, system + list(range(180, 190)))  # another user, the same system prompt
    stored(llama)
    assert tier.bytes_written - first < first / 3
    assert tier.pages_written - first_pages < first_pages / 3
    one, other = (read_header(p, with_pages=True).pages for p in directory.glob("*.ckpt"))
    assert len(set(one) & set(other)) >= len(system) // 8 - 1  # the base cache's pages of the system prompt
    assert page_files(directory) == set(one) | set(other)


@pytest.mark.parametrize("kind", ["gemma3", "llama", "hybrid", "mamba"])
def test_a_restart_restores_answers_equal_to_a_fresh_context(make_llama: Any, tmp_path: pathlib.Path,
                                                             system: list[int], kind: str) -> None:
    directory = tmp_path / "disk"
    a = attached(make_llama, directory, kind)
    answer(a, system + list(range(170, 180)))
    stored(a)
    answer(a, system + list(range(180, 190)))
    stored(a)
    forget(a)

    b = attached(make_llama, directory, kind)  # a new process: a new tier scans the directory
    tier = tier_of(b)
    assert len(tier) == 2 and tier.corrupt_files == 0
    fresh = make_llama(kind)
    prompt = system + list(range(180, 190)) + [7, 8, 9]
    assert answer(b, prompt) == answer(fresh, prompt)
    manager = ckpt_plugin.manager_of(b)
    assert manager.counters.disk_hits == 1 and manager.counters.tokens_reused_from_disk > len(system)
    if kind == "mamba":  # no cells by position: states are whole, as before pages
        assert tier.stats()["page_files"] == 0 and tier.page_files.pages_read == 0
        assert all(read_header(p).version == FORMAT_VERSION for p in directory.glob("*.ckpt"))
        return
    assert tier.page_files.pages_read > 0 and tier.page_files.pages_held == 0
    # the other conversation: the system prompt's pages, live now, are not read again
    fresh.reset()
    read_before = tier.page_files.pages_read
    prompt = system + list(range(170, 180)) + [7, 8, 9]
    assert answer(b, prompt) == answer(fresh, prompt)
    assert manager.counters.disk_hits == 2 and tier.page_files.pages_held >= len(system) // 8 - 1
    assert tier.page_files.pages_read - read_before < read_before


def test_a_corrupt_or_deleted_page_file_is_a_miss_and_its_entry_moved_aside(make_llama: Any, tmp_path: pathlib.Path,
                                                                             system: list[int]) -> None:
    directory = tmp_path / "disk"
    prompt = system + list(range(170, 180))
    forget(one_conversation(make_llama, directory, system)[0])
    (entry_file,) = directory.glob("*.ckpt")
    victim = PageFiles(directory / "pages").path_of(sorted(pages_named(directory))[0])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: the scan cannot tell, the read's digest check does
    victim.write_bytes(bytes(data))

    fresh = make_llama("gemma3")
    follow_up = prompt + [5, 6]
    b = attached(make_llama, directory)
    tier = tier_of(b)
    assert len(tier) == 1
    assert answer(b, follow_up) == answer(fresh, follow_up)
    assert ckpt_plugin.manager_of(b).counters.disk_hits == 0 and tier.corrupt_files == 1
    assert entry_file.with_suffix(".corrupt").exists() and not entry_file.exists()
    assert not victim.exists()  # the corrupt page went: the next entry holding it writes it anew
    stored(b)  # the follow-up's entry: its pages are written again, the one found corrupt among them
    assert victim.exists() and page_files(directory) == pages_named(directory)
    forget(b)

    # a page file deleted after the scan: the read misses, the entry is moved aside
    c = attached(make_llama, directory)
    (entry_file,) = directory.glob("*.ckpt")
    victim.unlink()
    fresh.reset()
    assert answer(c, follow_up + [7]) == answer(fresh, follow_up + [7])
    tier = tier_of(c)
    assert ckpt_plugin.manager_of(c).counters.disk_hits == 0 and tier.corrupt_files == 1
    assert entry_file.with_suffix(".corrupt").exists()
    stored(c)
    forget(c)

    # a page file deleted before the scan: the scan moves its entry aside, and the pages nobody names then go
    (entry_file,) = directory.glob("*.ckpt")
    PageFiles(directory / "pages").path_of(sorted(pages_named(directory))[-1]).unlink()
    d = attached(make_llama, directory)
    tier = tier_of(d)
    assert len(tier) == 0 and tier.corrupt_files == 1 and entry_file.with_suffix(".corrupt").exists()
    assert page_files(directory) == set() and tier.resident_bytes == 0
    fresh.reset()
    assert answer(d, follow_up + [8]) == answer(fresh, follow_up + [8])


def test_eviction_deletes_the_page_files_nobody_names(make_llama: Any, tmp_path: pathlib.Path,
                                                      system: list[int]) -> None:
    directory = tmp_path / "disk"
    llama, tier = one_conversation(make_llama, directory, system)
    tier.max_bytes = int(tier.resident_bytes * 2.2)
    evicted_pages = False
    for user in range(6):  # conversations on the shared prompt, then on prompts of their own
        prefix = system if user < 3 else [1, *random.Random(f"own-{user}").choices(range(3, 250), k=100)]
        answer(llama, prefix + list(range(180 + 10 * user, 190 + 10 * user)))
        before = page_files(directory)
        stored(llama)
        on_disk = files(directory)
        # the budget counts every file once, page files included, and holds
        assert tier.resident_bytes == sum(info[0] for info in on_disk.values()) <= tier.max_bytes
        # a page file lives exactly as long as an entry file names it
        assert page_files(directory) == pages_named(directory)
        evicted_pages |= bool(before - page_files(directory))
    assert evicted_pages and len(tier) < 6


def test_files_of_the_previous_version_are_still_read(make_llama: Any, tmp_path: pathlib.Path,
                                                      system: list[int]) -> None:
    directory = tmp_path / "disk"
    prompt = system + list(range(170, 180))
    a = attached(make_llama, directory)
    answer(a, prompt)
    manager = ckpt_plugin.manager_of(a)
    entry = manager.primary.save_to_cache()
    assert entry is not None and entry.state.paged
    (paged_file,) = directory.glob("*.ckpt")
    # what the previous version wrote for this entry: a 2.0 file of whole states, in place of the paged one
    paged = read_entry(paged_file, pages=tier_of(a).page_files)
    write_entry(paged_file, entry, model_fingerprint=entry.fingerprint)
    assert read_header(paged_file).version == FORMAT_VERSION == (2, 0)
    old = read_entry(paged_file)
    assert np.array_equal(old.state.target_bytes(), paged.state.target_bytes())
    del manager, entry, paged, old
    forget(a)

    b = attached(make_llama, directory)
    tier = tier_of(b)
    assert len(tier) == 1 and tier.corrupt_files == 0
    assert page_files(directory) == set()  # the 2.0 file names no page: the paged file's pages were garbage
    fresh = make_llama("gemma3")
    assert answer(b, prompt + [4]) == answer(fresh, prompt + [4])
    assert ckpt_plugin.manager_of(b).counters.disk_hits == 1
    stored(b)  # the new turn's entry is written as pages, next to the old file
    versions = sorted(read_header(p).version for p in directory.glob("*.ckpt"))
    assert versions == [FORMAT_VERSION, PAGED_VERSION]


def test_a_paged_file_is_refused_without_its_pages(make_llama: Any, tmp_path: pathlib.Path,
                                                   system: list[int]) -> None:
    """Slot files and the shared tier's manifests never hold page maps: a paged file given to them is refused with
    a message, never handed to llama.cpp."""
    directory = tmp_path / "disk"
    llama, tier = one_conversation(make_llama, directory, system)
    (path,) = directory.glob("*.ckpt")
    with pytest.raises(CorruptFileError, match="paged"):
        read_entry(path)
    with pytest.raises(CorruptFileError, match="unknown required file flags 0x0002"):
        decode_entry(path.read_bytes())
    with pytest.raises(CorruptFileError, match="unknown required file flags"):
        decode_entry(path.read_bytes(), blob_refs=True)
    assert os.path.getsize(path) < tier.resident_bytes / 4  # page maps, not states


def test_without_xxhash_states_are_written_whole_and_paged_files_wait(make_llama: Any, tmp_path: pathlib.Path,
                                                                       system: list[int],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without the ``redis`` extra cannot seal pages: its disk tier writes whole states (2.0), and a
    paged file another install wrote is a miss there, left in place for an install that reads it."""
    from ckpt_plugin.persist import page_map

    directory = tmp_path / "disk"
    forget(one_conversation(make_llama, directory, system)[0])
    (paged_file,) = directory.glob("*.ckpt")
    monkeypatch.setattr(page_map, "xxhash", None)
    llama = attached(make_llama, directory)
    tier = tier_of(llama)
    assert not tier.paged and len(tier) == 1
    prompt = system + list(range(170, 180)) + [4]
    fresh = make_llama("gemma3")
    assert answer(llama, prompt) == answer(fresh, prompt)
    assert ckpt_plugin.manager_of(llama).counters.disk_hits == 0 and tier.corrupt_files == 0
    assert paged_file.exists() and page_files(directory) == pages_named(directory)
    stored(llama)
    (whole_file,) = set(directory.glob("*.ckpt")) - {paged_file}
    assert read_header(whole_file).version == FORMAT_VERSION and read_entry(whole_file).state.n_tokens > len(prompt)
