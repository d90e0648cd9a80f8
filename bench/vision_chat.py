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


def main() -> None:
    args = cli(__doc__).parse_args()
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
