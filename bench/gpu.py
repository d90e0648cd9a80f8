"""GPU checks and figures, for a CUDA build of llama-cpp-python (every layer offloaded, ``n_gpu_layers=-1``).

1. Equivalence: on the four tiny model kinds (llama, gemma3 with a sliding window, mamba, hybrid), a branching
   sequence of requests (a prompt, a regeneration, an edit inside it, a return to it with a continuation) answered by
   an attached ``Llama`` and by a fresh unattached context give the same greedy tokens (a near tie of the reference,
   where batch-size rounding alone may flip the choice, is allowed: ``ckpt_plugin.testing.assert_same_answer``).
2. A ~1B-parameter llama model with random F16 weights, written with ``gguf`` at TinyLlama-1.1B's dimensions
   (n_embd 2048, 22 layers, 32 heads, 4 KV heads, n_ff 5632, 32,000 tokens), with a 6,000-token prompt:
   - host alone vs attached on a branching sequence (the prompt; an edit at 5,000; an edit at 3,000; back to the
     prompt with a continuation; a regeneration of that), in interleaved rounds: time and tokens evaluated per
     request;
   - cold-prompt overhead: a new 6,000-token prompt, attached / plain (goal <= 1.05 on a GPU);
   - the raw state calls (``llama_state_seq_get_data_ext`` / ``set_data_ext`` of the full state) against evaluating
     the same tokens: what a restore costs in evaluated tokens, which is what plans by cost weigh;
   - the rates the attached engine measured (``stats()["costs"]``).

Without a CUDA build this prints that it needs one and runs a tiny dry run of every step on the CPU (tiny
dimensions, a 300-token prompt, one round), then exits 0.

Run: ``.venv/bin/python bench/gpu.py`` (on a GPU machine: ``CMAKE_ARGS="-DGGML_CUDA=on" bash scripts/setup.sh``
first), ``--rounds N`` (3), ``--markdown PATH`` (write the section there, e.g. ``docs/bench-sections/75-gpu.md``),
``--dry-run`` (the CPU dry run even with a GPU).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import TINY_VOCAB, Report, fmt_ratio, random_tokens  # noqa: E402

import ckpt_plugin  # noqa: E402
from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory  # noqa: E402
from ckpt_plugin.testing import assert_same_answer, fresh_greedy_tokens, greedy_tokens  # noqa: E402
from ckpt_plugin.testing.tiny_models import MODEL_KINDS, build_tiny_model  # noqa: E402

NEEDS_GPU = ("bench/gpu.py needs a CUDA build of llama-cpp-python (llama_supports_gpu_offload() is false here):\n"
             '  CMAKE_ARGS="-DGGML_CUDA=on" bash scripts/setup.sh   # or: CMAKE_ARGS="-DGGML_CUDA=on" pip install '
             "--no-cache-dir 'llama-cpp-python[server]>=0.3.36,<0.4'\n"
             "Running a tiny dry run of every step on the CPU instead.")
_U8 = ctypes.POINTER(ctypes.c_uint8)


@dataclass(frozen=True)
class Dims:
    """A llama model's dimensions and the run's sizes."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    prompt: int
    n_ctx: int
    n_batch: int

    @property
    def parameters(self) -> int:
        head = self.n_embd // self.n_head
        attention = 2 * self.n_embd * self.n_embd + 2 * self.n_embd * self.n_head_kv * head
        return 2 * self.n_vocab * self.n_embd + self.n_layer * (attention + 3 * self.n_embd * self.n_ff)


BIG = Dims(2048, 22, 32, 4, 5632, 32000, prompt=6000, n_ctx=8192, n_batch=2048)
DRY = Dims(64, 2, 4, 2, 128, 512, prompt=300, n_ctx=1024, n_batch=64)


def write_llama(path: pathlib.Path, dims: Dims, seed: int = 0) -> pathlib.Path:
    """A llama-architecture GGUF with random F16 weights (F32 norms) and a SentencePiece-style vocabulary of
    ``dims.n_vocab`` tokens (the specials, 256 byte tokens, then ``▁t<i>`` pieces)."""
    import gguf

    rng = np.random.default_rng(seed)
    # One pool of random values; every tensor is a slice of it at a random offset (generating 1B fresh values
    # would take longer than the benchmark, and the figures do not depend on the values).
    largest = max(dims.n_vocab * dims.n_embd, dims.n_ff * dims.n_embd)
    pool = rng.standard_normal(2 * largest, dtype=np.float32).astype(np.float16)
    head = dims.n_embd // dims.n_head

    def weight(rows: int, cols: int, std: float) -> np.ndarray:
        start = int(rng.integers(0, len(pool) - rows * cols + 1))
        return (pool[start : start + rows * cols] * np.float16(std)).reshape(rows, cols)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("random-llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(dims.n_ctx)
    writer.add_embedding_length(dims.n_embd)
    writer.add_block_count(dims.n_layer)
    writer.add_feed_forward_length(dims.n_ff)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head_kv)
    writer.add_rope_dimension_count(head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(dims.n_vocab)
    specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(dims.n_vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (dims.n_vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(dims.n_vocab - 259)])
    writer.add_token_types([int(t) for t in types])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", weight(dims.n_vocab, dims.n_embd, 1.0))
    writer.add_tensor("output_norm.weight", np.ones(dims.n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(dims.n_vocab, dims.n_embd, 1.0 / np.sqrt(dims.n_embd)))
    for il in range(dims.n_layer):
        p = f"blk.{il}"
        writer.add_tensor(f"{p}.attn_norm.weight", np.ones(dims.n_embd, dtype=np.float32))
        writer.add_tensor(f"{p}.attn_q.weight", weight(dims.n_embd, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.attn_k.weight", weight(dims.n_head_kv * head, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.attn_v.weight", weight(dims.n_head_kv * head, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.attn_output.weight", weight(dims.n_embd, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.ffn_norm.weight", np.ones(dims.n_embd, dtype=np.float32))
        writer.add_tensor(f"{p}.ffn_gate.weight", weight(dims.n_ff, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.ffn_up.weight", weight(dims.n_ff, dims.n_embd, 1 / np.sqrt(dims.n_embd)))
        writer.add_tensor(f"{p}.ffn_down.weight", weight(dims.n_embd, dims.n_ff, 1 / np.sqrt(dims.n_ff)))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def open_model(path: pathlib.Path, gpu_layers: int, dims: Dims, **options: Any) -> Llama:
    return Llama(model_path=str(path), n_gpu_layers=gpu_layers, n_ctx=dims.n_ctx, n_batch=dims.n_batch,
                 n_ubatch=min(dims.n_batch, 512), verbose=False, seed=0, **options)


def empty(llama: Llama) -> None:
    clear_memory(llama)
    llama.reset()


# ---------------------------------------------------------------------------------------------------------------------
# 1. equivalence


def equivalence(report: Report, workdir: pathlib.Path, gpu_layers: int, kinds: tuple[str, ...]) -> bool:
    rng = np.random.default_rng(5)
    rows, ok = [], True
    for kind in kinds:
        path = build_tiny_model(kind, workdir / f"{kind}.gguf")
        options: dict[str, Any] = dict(n_gpu_layers=gpu_layers, n_ctx=1024, n_batch=64, n_ubatch=64, verbose=False,
                                       seed=0)
        if kind == "gemma3":
            options["swa_full"] = False
        attached, reference = Llama(str(path), **options), Llama(str(path), **options)
        manager = ckpt_plugin.attach(attached, checkpoint_min_step=32, load_entrypoints=False)
        prompt = [1, *random_tokens(rng, 299, TINY_VOCAB)]
        sequence = [prompt, prompt, prompt[:200] + random_tokens(rng, 20, TINY_VOCAB),
                    prompt + random_tokens(rng, 30, TINY_VOCAB)]
        same = 0
        for index, request in enumerate(sequence):
            gaps: list[float] = []
            want = fresh_greedy_tokens(reference, request, 8, gaps)
            got = greedy_tokens(attached, request, 8)
            try:
                assert_same_answer(got, want, gaps, f"{kind} request {index}")
                same += 1
            except AssertionError as exc:
                print(f"  {exc}", file=sys.stderr)
                ok = False
        stats = manager.stats()
        rows.append([kind, f"{same}/{len(sequence)}", stats["tokens_evaluated"], stats["tokens_reused"],
                     stats["checkpoints_restored"] + stats["cache_hits"]])
        ckpt_plugin.detach(attached)
        attached.close()
        reference.close()
    report.text(f"### Equivalence, `n_gpu_layers={gpu_layers}`\n\nA prompt of 300 tokens, its regeneration, an edit "
                "at 200, a return to it with a continuation; 8 greedy tokens each, attached against a fresh context.")
    report.table(["kind", "same answers", "tokens evaluated", "tokens reused", "restores"], rows)
    report.figure(f"equivalence, n_gpu_layers={gpu_layers}", "all equal" if ok else "DIFFERENT", "all equal")
    return ok


# ---------------------------------------------------------------------------------------------------------------------
# 2. the ~1B model


def branching(report: Report, llama: Llama, dims: Dims, rounds: int) -> dict[str, Any]:
    """The branching sequence host alone and attached; returns the attached engine's last ``stats()["costs"]``."""
    rng = np.random.default_rng(9)
    n = dims.prompt
    prompt = [1, *random_tokens(rng, n - 1, (259, dims.n_vocab))]
    more = random_tokens(rng, 64, (259, dims.n_vocab))
    sequence = {
        f"prompt ({n:,} tokens)": prompt,
        f"edit at {n * 5 // 6:,}": prompt[: n * 5 // 6] + random_tokens(rng, 32, (259, dims.n_vocab)),
        f"edit at {n // 2:,}": prompt[: n // 2] + random_tokens(rng, 32, (259, dims.n_vocab)),
        "back to the prompt, continued": prompt + more,
        "regeneration": prompt + more,
    }
    times: dict[tuple[str, str], list[float]] = {(c, r): [] for c in ("host alone", "attached") for r in sequence}
    evaluated: dict[tuple[str, str], int] = {}
    costs: dict[str, Any] = {}
    for index in range(rounds):
        configs = ("host alone", "attached") if index % 2 == 0 else ("attached", "host alone")
        for config in configs:
            empty(llama)
            manager = ckpt_plugin.attach(llama, load_entrypoints=False) if config == "attached" else None
            for name, request in sequence.items():
                before = manager.counters.tokens_evaluated if manager is not None else 0
                started = time.perf_counter()
                llama.create_completion(request, max_tokens=4, temperature=0.0)
                times[config, name].append(time.perf_counter() - started)
                if manager is not None:
                    evaluated[config, name] = manager.counters.tokens_evaluated - before
            if manager is not None:
                costs = manager.stats()["costs"]
                ckpt_plugin.detach(llama)
    rows = []
    for name in sequence:
        alone, attached = (statistics.median(times[c, name]) for c in ("host alone", "attached"))
        rows.append([name, f"{alone * 1000:.0f} ms", f"{attached * 1000:.0f} ms", fmt_ratio(attached / alone),
                     evaluated.get(("attached", name), "")])
    total = {c: sum(statistics.median(times[c, r]) for r in sequence) for c in ("host alone", "attached")}
    report.text(f"### Branching sequence, {dims.parameters / 1e6:,.0f}M-parameter random F16 llama\n\n"
                f"{rounds} rounds, the order of host alone and attached alternating; 4 tokens generated per request.")
    report.table(["request", "host alone", "attached", "attached / alone", "tokens evaluated (attached)"], rows)
    report.figure("branching sequence, attached / host alone (total)",
                  fmt_ratio(total["attached"] / total["host alone"]))
    return costs


def cold(report: Report, llama: Llama, dims: Dims, rounds: int) -> None:
    rng = np.random.default_rng(13)
    times: dict[str, list[float]] = {"attached": [], "plain": []}
    for index in range(rounds + 1):
        order = ("attached", "plain") if index % 2 == 0 else ("plain", "attached")
        for config in order:
            empty(llama)
            manager = ckpt_plugin.attach(llama, load_entrypoints=False) if config == "attached" else None
            prompt = [1, *random_tokens(rng, dims.prompt - 1, (259, dims.n_vocab))]
            started = time.perf_counter()
            llama.create_completion(prompt, max_tokens=1, temperature=0.0)
            if index:
                times[config].append(time.perf_counter() - started)
            if manager is not None:
                ckpt_plugin.detach(llama)
    ratio = statistics.median(times["attached"]) / statistics.median(times["plain"])
    report.text(f"### Cold prompt\n\nA new {dims.prompt:,}-token prompt on an empty context, one token generated: "
                f"attached {statistics.median(times['attached']) * 1000:.0f} ms, plain "
                f"{statistics.median(times['plain']) * 1000:.0f} ms (medians of {rounds}).")
    report.figure(f"new {dims.prompt:,}-token prompt, attached / plain", fmt_ratio(ratio), "<= 1.05x")


def state_calls(report: Report, llama: Llama, dims: Dims) -> None:
    rng = np.random.default_rng(17)
    empty(llama)
    prompt = [1, *random_tokens(rng, dims.prompt - 1, (259, dims.n_vocab))]
    started = time.perf_counter()
    llama.eval(prompt)
    evaluation = time.perf_counter() - started
    ctx = llama.ctx
    size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, 0, 0))
    buffer = np.empty(size, dtype=np.uint8)
    pointer = buffer.ctypes.data_as(_U8)
    gets, sets = [], []
    for _ in range(5):
        started = time.perf_counter()
        written = int(llama_cpp.llama_state_seq_get_data_ext(ctx, pointer, size, 0, 0))
        gets.append(time.perf_counter() - started)
        started = time.perf_counter()
        read = int(llama_cpp.llama_state_seq_set_data_ext(ctx, pointer, size, 0, 0))
        sets.append(time.perf_counter() - started)
        assert written == read == size, (written, read, size)
    get, put = statistics.median(gets), statistics.median(sets)
    per_token = evaluation / len(prompt)
    report.text(f"### Raw state calls against evaluation\n\nAfter a {len(prompt):,}-token prompt (evaluated in "
                f"{evaluation * 1000:.0f} ms, {per_token * 1e6:.0f} us a token): the full state is "
                f"{size / 2**20:.1f} MiB; `get` {get * 1000:.2f} ms ({size / get / 1e9:.2f} GB/s), `set` "
                f"{put * 1000:.2f} ms ({size / put / 1e9:.2f} GB/s). A restore costs what evaluating "
                f"{put / per_token:.0f} tokens costs; a restore of that state pays only for prompts sharing more.")
    report.figure("restore of the full state, in evaluated tokens", f"{put / per_token:.0f}")


def rates(report: Report, costs: dict[str, Any]) -> None:
    if not costs:
        return
    measured = {batch: seconds for batch, seconds in costs["eval_seconds_per_token"].items() if seconds is not None}
    eval_rates = ", ".join(f"{batch}+: {seconds * 1e6:.0f} us" for batch, seconds in measured.items())
    transfers = "; ".join(f"{name} {v['latency_seconds'] * 1e6:.0f} us + {v['bytes_per_second'] / 1e9:.2f} GB/s"
                          for name, v in costs["transfers"].items() if v["latency_observations"]
                          or v["bandwidth_observations"])
    report.text(f"Rates the attached engine measured: evaluation per token by batch size {eval_rates}; transfers "
                f"{transfers or 'none measured'}; plans {costs['plans']}, {costs['plans_by_cost']} by cost, actual / "
                f"estimated time {costs['actual_seconds'] / max(costs['estimated_seconds'], 1e-9):.2f}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", type=pathlib.Path)
    parser.add_argument("--dry-run", action="store_true", help="the tiny CPU run, even with a GPU")
    args = parser.parse_args(argv)
    gpu = bool(llama_cpp.llama_supports_gpu_offload()) and not args.dry_run
    if not gpu:
        print(NEEDS_GPU, flush=True)
    dims, gpu_layers, rounds = (BIG, -1, args.rounds) if gpu else (DRY, 0, 1)
    kinds = tuple(MODEL_KINDS) if gpu else ("llama",)
    report = Report("GPU (`bench/gpu.py`)" if gpu else "GPU dry run on the CPU (`bench/gpu.py`)")
    with tempfile.TemporaryDirectory(prefix="ckpt-gpu-") as tmp:
        workdir = pathlib.Path(tmp)
        ok = equivalence(report, workdir, gpu_layers, kinds)
        started = time.perf_counter()
        path = write_llama(workdir / "random-llama.gguf", dims)
        print(f"wrote {dims.parameters / 1e6:,.1f}M parameters in {time.perf_counter() - started:.1f} s", flush=True)
        llama = open_model(path, gpu_layers, dims)
        rates(report, branching(report, llama, dims, rounds))
        cold(report, llama, dims, rounds)
        state_calls(report, llama, dims)
        llama.close()
    report.table(["figure", "measured", "goal"], [[f.name, f.value, f.goal] for f in report.figures])
    print(report.markdown(), flush=True)
    if args.markdown is not None and gpu:
        args.markdown.write_text(report.markdown())
    return 0 if ok or not gpu else 1


if __name__ == "__main__":
    sys.exit(main())
