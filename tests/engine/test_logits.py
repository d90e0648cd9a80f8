"""Logits on demand: prompt and completion logprobs equal a fresh ``logits_all=True`` context, and a request that
reads no logits neither computes nor keeps them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ckpt_plugin
from ckpt_plugin.hosts.llama_cpp.seam.context import clear_memory

KINDS = ["llama", "gemma3", "mamba", "hybrid"]
TOLERANCE = 1e-3
rng = np.random.default_rng(11)
SYSTEM = [1, *rng.integers(3, 300, 150).tolist()]
CONVERSATION_A = SYSTEM + rng.integers(3, 300, 60).tolist()
CONVERSATION_B = SYSTEM + rng.integers(3, 300, 50).tolist()
FOLLOW_UP_A = CONVERSATION_A + rng.integers(3, 300, 7).tolist()


def as_text(llama: Any, tokens: list[int]) -> str:
    """The prompt as text (``echo`` needs a text prompt); the same tokens up to the tokenizer's merges."""
    return llama.detokenize(tokens[1:]).decode("utf-8", errors="ignore")


def fresh(reference: Any, **request: Any) -> dict[str, Any]:
    reference.reset()
    clear_memory(reference)
    return reference.create_completion(**request)


def assert_logprobs_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    g, w = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
    assert g["tokens"] == w["tokens"]
    assert len(g["token_logprobs"]) == len(w["token_logprobs"]) > 0
    for a, b in zip(g["token_logprobs"], w["token_logprobs"]):
        assert (a is None and b is None) or abs(a - b) <= TOLERANCE, (a, b)
    for a, b in zip(g["top_logprobs"], w["top_logprobs"]):
        if a is None or b is None:
            assert a is None and b is None
            continue
        shared = set(a) & set(b)
        assert shared and all(abs(a[k] - b[k]) <= TOLERANCE for k in shared)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logprobs_after_a_restore_equal_a_fresh_context(make_llama: Any, kind: str) -> None:
    llama = make_llama(kind, logits_all=True)
    reference = make_llama(kind, logits_all=True)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    for prompt in (CONVERSATION_A, CONVERSATION_B):
        llama.create_completion(as_text(llama, prompt), max_tokens=2, temperature=0)
    request = dict(prompt=as_text(llama, FOLLOW_UP_A), max_tokens=1, temperature=0, echo=True, logprobs=3)
    assert_logprobs_equal(llama.create_completion(**request), fresh(reference, **request))
    # the same request again reuses the rows it computed: exact, and nothing but the last token evaluated
    before = manager.counters.tokens_evaluated
    assert_logprobs_equal(llama.create_completion(**request), fresh(reference, **request))
    assert manager.counters.tokens_evaluated - before <= 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_a_fresh_context_and_prompts_still_reuse(make_llama: Any, kind: str,
                                                                           stream: bool) -> None:
    llama = make_llama(kind, logits_all=True)
    reference = make_llama(kind, logits_all=True)
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    llama.create_completion(CONVERSATION_A, max_tokens=2, temperature=0)
    llama.create_completion(CONVERSATION_B, max_tokens=2, temperature=0)
    before = manager.counters.tokens_evaluated
    request = dict(prompt=FOLLOW_UP_A, max_tokens=4, temperature=0, logprobs=2)
    if stream:
        chunks = [c for c in llama.create_completion(**request, stream=True) if c["choices"][0]["logprobs"]]
        got_tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
        got_logprobs = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
        want = fresh(reference, **request)["choices"][0]["logprobs"]
        assert got_tokens == want["tokens"]
        assert all(abs(a - b) <= TOLERANCE for a, b in zip(got_logprobs, want["token_logprobs"]))
    else:
        assert_logprobs_equal(llama.create_completion(**request), fresh(reference, **request))
    # completion logprobs need no prompt rows: the shared prefix was still restored, not evaluated again
    assert manager.counters.tokens_evaluated - before < len(FOLLOW_UP_A) - len(SYSTEM)


def test_chat_logprobs_and_top_logprobs_equal_a_fresh_context(make_llama: Any) -> None:
    llama = make_llama("gemma3", logits_all=True, chat_format="chatml")
    reference = make_llama("gemma3", logits_all=True, chat_format="chatml")
    ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    messages = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hello there"}]
    llama.create_chat_completion(messages=messages, max_tokens=3, temperature=0)
    follow = messages + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and then?"}]
    got = llama.create_chat_completion(messages=follow, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    reference.reset()
    clear_memory(reference)
    want = reference.create_chat_completion(messages=follow, max_tokens=3, temperature=0, logprobs=True,
                                            top_logprobs=2)
    g, w = got["choices"][0]["logprobs"]["content"], want["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in g] == [t["token"] for t in w] and g
    for a, b in zip(g, w):
        assert abs(a["logprob"] - b["logprob"]) <= TOLERANCE
        assert len(a["top_logprobs"]) == len(b["top_logprobs"]) == 2


def test_requests_without_logprobs_keep_no_rows_and_compute_only_last_logits(make_llama: Any) -> None:
    llama = make_llama("llama", logits_all=True)
    assert llama.scores.shape[0] == llama.n_ctx()  # what the host allocates with logits_all=True
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    assert llama.scores.shape == (1, llama.n_vocab())  # released on attach
    outputs: list[int] = []
    real_decode = llama._ctx.decode

    def counting_decode(batch: Any) -> None:
        outputs.append(sum(bool(batch.batch.logits[i]) for i in range(batch.batch.n_tokens)))
        real_decode(batch)

    llama._ctx.decode = counting_decode
    llama.create_completion(CONVERSATION_A, max_tokens=3, temperature=0)
    # one output per decoded batch (its last token): 211 prompt tokens in batches of 64, then 2 generated
    assert outputs == [1] * len(outputs) and len(outputs) >= 4
    assert llama.scores.shape == (1, llama.n_vocab())
    outputs.clear()
    text = as_text(llama, CONVERSATION_A)
    llama.create_completion(text, max_tokens=1, temperature=0, echo=True, logprobs=1)
    # prompt logprobs: every prompt token's logits, all of them evaluated again (no rows were kept before)
    assert llama.scores.shape[0] == llama.n_ctx() and sum(outputs) == len(llama.tokenize(text.encode()))
    llama.create_completion(CONVERSATION_B, max_tokens=1, temperature=0)
    assert llama.scores.shape == (1, llama.n_vocab())  # given back once nobody reads the rows
    ckpt_plugin.detach(llama)
    assert llama.scores.shape[0] == llama.n_ctx()
    assert manager.counters.tokens_evaluated > 0


def test_direct_eval_keeps_every_row_as_logits_all_promises(make_llama: Any) -> None:
    llama = make_llama("llama", logits_all=True)
    reference = make_llama("llama", logits_all=True)
    ckpt_plugin.attach(llama, load_entrypoints=False)
    llama.eval(CONVERSATION_A)
    reference.eval(CONVERSATION_A)
    assert np.allclose(llama.scores[: len(CONVERSATION_A)], reference.scores[: len(CONVERSATION_A)], atol=TOLERANCE)


def test_a_stopping_criterion_reads_the_latest_logits(make_llama: Any) -> None:
    """It gets the logits its token was sampled from (llama-cpp-python 0.3.36 alone passes ``_scores[0]`` there, the
    first prompt position's row: an off-by-one the plugin does not copy, see docs/server.md)."""
    from llama_cpp import StoppingCriteriaList

    from ckpt_plugin.hosts.llama_cpp.seam.context import last_logits

    llama = make_llama("llama", logits_all=True)
    reference = make_llama("llama", logits_all=True)
    ckpt_plugin.attach(llama, load_entrypoints=False)
    seen: list[float] = []

    def criterion(input_ids: Any, logits: Any) -> bool:
        seen.append(float(np.max(logits)))
        return False

    want: list[float] = []
    for _ in zip(range(3), reference.generate(CONVERSATION_A, temp=0.0, top_k=1)):
        want.append(float(np.max(last_logits(reference))))
    for _ in zip(range(3), llama.generate(CONVERSATION_A, temp=0.0, top_k=1,
                                          stopping_criteria=StoppingCriteriaList([criterion]))):
        pass
    assert len(seen) == 3 and np.allclose(seen, want, atol=TOLERANCE)


@pytest.mark.parametrize("reader", ["logprobs", "draft"])
def test_a_stopping_criterion_reads_the_latest_logits_with_logprobs_or_a_draft(make_llama: Any, reader: str) -> None:
    """Where the generation keeps rows (completion logprobs, a draft model's batches) the criterion still gets the
    logits llama.cpp computed for the position it is asked about, never an unwritten (zero) row."""
    from llama_cpp import StoppingCriteriaList
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ckpt_plugin.hosts.llama_cpp.seam.context import last_logits

    extra = {"draft_model": LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=4)} if reader == "draft" else {}
    llama = make_llama("llama", logits_all=True, **extra)
    reference = make_llama("llama", logits_all=True)
    ckpt_plugin.attach(llama, load_entrypoints=False)
    calls: list[tuple[np.ndarray, int, np.ndarray]] = []

    def criterion(input_ids: Any, logits: Any) -> bool:
        calls.append((np.array(llama.input_ids[: llama.n_tokens]), len(input_ids), np.array(logits, copy=True)))
        return False

    # A repetitive prompt, so that prompt lookup drafts (and llama.cpp evaluates batches of generated tokens).
    prompt = CONVERSATION_A[:40] + CONVERSATION_A[1:40]
    llama.create_completion(prompt, max_tokens=10, temperature=0.0, top_k=1,
                            logprobs=2 if reader == "logprobs" else None,
                            stopping_criteria=StoppingCriteriaList([criterion]))
    assert len(calls) >= 10
    inside_a_batch = sum(n_ids < len(evaluated) for evaluated, n_ids, _ in calls)
    assert inside_a_batch > 0 if reader == "draft" else inside_a_batch == 0
    for evaluated, n_ids, logits in calls:
        # llama-cpp-python passes the row of the position after ``input_ids`` inside a batch, and at its end the row
        # the last token was sampled from.
        n_context = n_ids if n_ids == len(evaluated) else n_ids + 1
        reference.reset()
        clear_memory(reference)
        reference.eval(evaluated[:n_context].tolist())
        assert np.allclose(logits, last_logits(reference), atol=TOLERANCE)


def test_a_chat_without_logprobs_computes_one_prompt_logit_per_batch(make_llama: Any) -> None:
    llama = make_llama("gemma3", logits_all=True, chat_format="chatml")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    outputs: list[tuple[int, int]] = []
    real_decode = llama._ctx.decode

    def counting_decode(batch: Any) -> None:
        flags = [bool(batch.batch.logits[i]) for i in range(batch.batch.n_tokens)]
        outputs.append((sum(flags), len(flags)))
        real_decode(batch)

    llama._ctx.decode = counting_decode
    messages = [{"role": "system", "content": "be brief " * 60}, {"role": "user", "content": "hello there"}]
    llama.create_chat_completion(messages=messages, max_tokens=3, temperature=0)
    # prompt batches end at n_batch (64) and at the checkpoint pauses; each computes its last token's logits only
    assert outputs and all(n == 1 for n, _ in outputs)
    assert sum(size for _, size in outputs) == manager.counters.tokens_evaluated > 64
