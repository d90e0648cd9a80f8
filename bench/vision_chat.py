"""Vision chat: time to first token of turn 2, attached against the host alone, through llama-cpp-python's own
multimodal chat handler (``Llava15ChatHandler``) and a real projector loaded by libmtmd.

No vision model ships in a package here, so the projector is a random-weight llava-1.5 MLP projector written by
``ckpt_plugin.testing.tiny_models.write_tiny_mmproj`` with the text model's width (Gemma-3-270M: 640) and llava-1.5's
image grid: a 336x336 input in 14-pixel patches, 576 positions an image. Its encoder is small (width 32, 2 blocks),
so the image's cost here is mostly the 576 positions the text model decodes; a real CLIP encoder adds its own
encoding time to every turn of the host alone, and nothing to a turn the plugin serves from a stored state.

A conversation: turn 1 asks about an image, turn 2 follows up (the image, turn 1 and its answer, a new question).
The host's handler clears the memory and evaluates the whole conversation, image included, on every turn; with the
plugin, turn 2 evaluates only what is new. Each round runs the conversation on a fresh ``Llama`` of each kind, the
order alternating; streamed, the first content chunk's arrival is the time to first token.

``--parallel N``: N clients at once instead, each with its own image (two turns, the follow-up about the same
image), on ``ParallelLlama(llama, N)`` (what ``ckpt-serve --parallel N`` serves; each client on a view of its own)
against one attached slot that serves them in turn (``--parallel 1``: a request waits for the one before it, as under
llama_cpp.server's lock). Time to first token counted from when each client sends its request, so one slot's
figures include the wait; images encoded read from the ``media_chunks`` counter (one per image on both: turn 2
reuses it, on whichever slot it lands).
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time
from typing import Any

from _common import GEMMA_OPTIONS, Report, cli, emit, fmt_ratio, gemma_path

IMAGE_SIZE = 336
PATCH_SIZE = 14


def open_vision(projector: pathlib.Path, attached: bool) -> tuple[Any, Any]:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Llava15ChatHandler

    import ckpt_plugin

    handler = Llava15ChatHandler(clip_model_path=str(projector), verbose=False)
    llama = Llama(model_path=gemma_path(), chat_handler=handler, **{**GEMMA_OPTIONS, "n_ctx": 2048})
    manager = ckpt_plugin.attach(llama, load_entrypoints=False) if attached else None
    return llama, manager


def first_token_seconds(llama: Any, messages: list[dict[str, Any]]) -> tuple[float, str]:
    started = time.perf_counter()
    first = None
    text = []
    for chunk in llama.create_chat_completion(messages=messages, temperature=0.0, max_tokens=16, stream=True):
        content = chunk["choices"][0]["delta"].get("content")
        if content:
            if first is None:
                first = time.perf_counter() - started
            text.append(content)
    return (first if first is not None else time.perf_counter() - started), "".join(text)


def conversation(llama: Any, image: str) -> tuple[float, float, str]:
    turn1 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                          {"type": "text", "text": "Describe the picture."}]}]
    ttft1, answer = first_token_seconds(llama, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Which colours?"}]
    ttft2, _ = first_token_seconds(llama, turn2)
    return ttft1, ttft2, answer


def clients_round(projector: pathlib.Path, images: list[str],
                  parallel: bool) -> tuple[list[tuple[float, float]], float, int]:
    """Every client's conversation at once, on ``len(images)`` slots or on one; per client ``(ttft1, ttft2)``, the
    wall time of the round and the images the projector encoded."""
    import threading

    from ckpt_plugin.hosts.llama_cpp.parallel.parallel_llama import ParallelLlama

    llama, manager = open_vision(projector, attached=not parallel)
    slots = ParallelLlama(llama, len(images), load_entrypoints=False) if parallel else None
    counters = (slots.manager if slots is not None else manager).counters
    one_slot = threading.Lock()  # one slot serves one request at a time, the others wait their turn
    results: list[tuple[float, float]] = [(0.0, 0.0)] * len(images)

    def turn(messages: list[dict[str, Any]]) -> tuple[float, str]:
        if slots is None:
            sent = time.perf_counter()
            with one_slot:
                waited = time.perf_counter() - sent
                seconds, text = first_token_seconds(llama, messages)
            return waited + seconds, text
        view = slots.view()
        try:
            return first_token_seconds(view, messages)
        finally:
            view.close()

    def client(index: int) -> None:
        turn1 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images[index]}},
                                              {"type": "text", "text": "Describe the picture."}]}]
        ttft1, answer = turn(turn1)
        ttft2, _ = turn(turn1 + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": "Which colours?"}])
        results[index] = (ttft1, ttft2)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    encoded = int(counters.media_chunks)
    if slots is not None:
        slots.close()
    llama.close()
    return results, wall, encoded


def main_parallel(args: Any) -> None:
    """``--parallel N``: N concurrent clients on N slots against the same on one slot (see the module docstring)."""
    from ckpt_plugin.testing.tiny_models import image_data_uri, mmproj_positions_per_image, tiny_png, write_tiny_mmproj

    n, size, rounds = args.parallel, args.image_size, 1 if args.quick else 3
    directory = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_vision_"))
    projector = write_tiny_mmproj(directory / "mmproj.gguf", text_n_embd=640, image_size=size, patch_size=PATCH_SIZE)
    images = [image_data_uri(tiny_png(seed, width=size)) for seed in range(1, n + 1)]
    kinds = {"one slot": False, f"{n} slots": True}
    ttfts: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
    walls: dict[str, list[float]] = {name: [] for name in kinds}
    encoded: dict[str, set[int]] = {name: set() for name in kinds}
    for index in range(rounds + 1):  # round 0 warms up
        order = list(kinds) if index % 2 == 0 else list(reversed(kinds))
        for name in order:
            results, wall, chunks = clients_round(projector, images, kinds[name])
            if index:
                ttfts[name].extend(results)
                walls[name].append(wall)
                encoded[name].add(chunks)

    def median(name: str, turn: int) -> float:
        return statistics.median(t[turn] for t in ttfts[name])

    report = Report(f"Vision chat: {n} clients on `--parallel {n}` (`bench/vision_chat.py --parallel {n}`)")
    report.text(
        f"Gemma-3-270M Q4_K_M, `n_ctx` 2048 a slot, `n_batch` 512, 2 threads, `Llava15ChatHandler` and a random "
        f"llava-1.5 projector ({size}x{size} input, {PATCH_SIZE}-pixel patches: "
        f"{mmproj_positions_per_image(size, PATCH_SIZE)} positions an image). {n} clients at once, each with its "
        f"own image, two turns (the follow-up about the same image); one slot serves them in turn, `ParallelLlama` "
        f"on {n} slots at once. Time to first streamed token from when each client sent its request (medians over "
        f"the clients of {rounds} rounds after a warm-up round), wall time of a round (median). Command: "
        f"`.venv/bin/python bench/vision_chat.py --parallel {n}`."
    )
    rows = [[name, f"{median(name, 0) * 1e3:.0f} ms", f"{median(name, 1) * 1e3:.0f} ms",
             f"{statistics.median(walls[name]):.2f} s", ", ".join(str(c) for c in sorted(encoded[name]))]
            for name in kinds]
    report.table(["", "turn 1 TTFT", "turn 2 TTFT", "round wall time", "images encoded a round"], rows)
    ratio = statistics.median(walls[f"{n} slots"]) / statistics.median(walls["one slot"])
    report.text(f"Wall time of a round, {n} slots / one slot: {fmt_ratio(ratio)}. Images encoded a round: {n} on "
                "both means turn 2 reused every image.")
    report.figure(f"vision chats, {n} slots / one slot, wall time", fmt_ratio(ratio))
    emit(report, args.json)


def main() -> None:
    parser = cli(__doc__)
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="N concurrent clients on N slots against the same on one slot")
    parser.add_argument("--image-size", type=int, default=IMAGE_SIZE, metavar="PIXELS",
                        help=f"the projector's input size with --parallel (default {IMAGE_SIZE}: 576 positions)")
    args = parser.parse_args()
    if args.parallel > 1:
        main_parallel(args)
        return
    from ckpt_plugin.testing.tiny_models import image_data_uri, mmproj_positions_per_image, tiny_png, write_tiny_mmproj

    rounds = 2 if args.quick else 5
    directory = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_vision_"))
    projector = write_tiny_mmproj(directory / "mmproj.gguf", text_n_embd=640, image_size=IMAGE_SIZE,
                                  patch_size=PATCH_SIZE)
    image = image_data_uri(tiny_png(1, width=IMAGE_SIZE))
    times: dict[str, list[tuple[float, float]]] = {"host alone": [], "attached": []}
    answers: dict[str, set[str]] = {"host alone": set(), "attached": set()}
    evaluated: list[int] = []
    for index in range(rounds + 1):  # round 0 warms up
        order = ["host alone", "attached"] if index % 2 == 0 else ["attached", "host alone"]
        for name in order:
            llama, manager = open_vision(projector, name == "attached")
            before = manager.stats()["tokens_evaluated"] if manager is not None else 0
            ttft1, ttft2, answer = conversation(llama, image)
            if manager is not None and index:
                evaluated.append(manager.stats()["tokens_evaluated"] - before)
            llama.close()
            if index:
                times[name].append((ttft1, ttft2))
                answers[name].add(answer)

    def median(name: str, turn: int) -> float:
        return statistics.median(t[turn] for t in times[name])

    report = Report("Vision chat: turn 2 (`bench/vision_chat.py`)")
    report.text(
        f"Gemma-3-270M Q4_K_M, `n_ctx` 2048, `n_batch` 512, 2 threads, with `Llava15ChatHandler` and a random "
        f"llava-1.5 projector ({IMAGE_SIZE}x{IMAGE_SIZE} input, {PATCH_SIZE}-pixel patches: "
        f"{mmproj_positions_per_image(IMAGE_SIZE, PATCH_SIZE)} positions an image, a small encoder). Turn 1 asks "
        f"about the image, turn 2 follows up; time to first streamed token, medians of {rounds} rounds after a "
        f"warm-up round, a fresh `Llama` of each kind per round, the order alternating. Command: "
        f"`.venv/bin/python bench/vision_chat.py`."
    )
    rows = []
    for name in ("host alone", "attached"):
        rows.append([name, f"{median(name, 0) * 1e3:.0f} ms", f"{median(name, 1) * 1e3:.0f} ms",
                     ", ".join(f"{t[1]:.2f}" for t in times[name])])
    report.table(["", "turn 1 TTFT", "turn 2 TTFT", "turn 2 per round (s)"], rows)
    ratio = median("attached", 1) / median("host alone", 1)
    report.text(
        f"Turn 2, attached / host alone: {fmt_ratio(ratio)}. Turn 1, attached / host alone: "
        f"{fmt_ratio(median('attached', 0) / median('host alone', 0))}. Tokens the attached model evaluated for both "
        f"turns (image positions included, generated tokens included): {evaluated[-1] if evaluated else 0}. "
        f"Same turn-1 answers on both: {answers['host alone'] == answers['attached']}."
    )
    report.text(
        "The answers are compared only loosely here: Gemma-3-270M's Q4_K_M kernels give logits that depend on how a "
        "prompt is split into batches (docs/correctness.md, \"Batch boundaries\"), the plugin splits a prompt where "
        "it takes checkpoints, and the random projector's embeddings, far from a trained one's, amplify the "
        "difference until greedy replies part after a few tokens. The same flow on the F32 tiny models gives equal "
        "replies on both turns (tests/hosts/test_multimodal.py), and with a 16-position image so does Gemma-3-270M."
    )
    report.figure("vision chat turn-2 TTFT, attached / host alone", fmt_ratio(ratio))
    emit(report, args.json)


if __name__ == "__main__":
    main()
