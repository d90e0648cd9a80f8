"""Speculative decoding with parallel slots: a draft sequence per slot, drafting steps batched across slots, the draft's
state stored with each slot's checkpoints and restored into whichever slot resumes the conversation."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ckpt_plugin.core.errors import UnsupportedHostError
from ckpt_plugin.hosts.llama_cpp.parallel import ParallelLlama
from ckpt_plugin.hosts.llama_cpp.speculative import NgramDraft

from test_parallel_slots import prompts

PROMPTS = prompts(8)


def complete(llama: Any, prompt: str) -> str:
    return llama.create_completion(prompt, max_tokens=16, temperature=0.0)["choices"][0]["text"]


def answers(parallel: ParallelLlama, prompts: list[str]) -> list[str]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda prompt: complete(parallel.view(), prompt), prompts))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_four_concurrent_slots_with_a_draft_answer_as_without_one(make_llama: Callable[..., Any], kind: str) -> None:
    plain = make_llama(kind)
    want = [complete(plain, prompt) for prompt in PROMPTS]
    # The draft is the target's own model: every drafted token is the target's, so a draft out of step with its
    # slot (another slot's sequence, a stale state) shows as rejected tokens.
    parallel = ParallelLlama(make_llama(kind), 4, draft=make_llama(kind), n_draft=4, load_entrypoints=False,
                             checkpoint_min_step=16, plan_by_cost=False)
    try:
        assert answers(parallel, PROMPTS) == want
        drafts = parallel.drafts
        assert drafts is not None and drafts.drafted > 0
        assert drafts.acceptance > 0.9, (drafts.drafted, drafts.accepted)
        assert drafts.scheduler.shared_steps > 0, vars(drafts.scheduler)  # drafting steps of several slots at once

        # Again, in another order: conversations land on other slots, restored from the cache with their draft state.
        states = parallel.manager.plugins.get_plugin("ckpt_plugin.draft")
        evaluated = drafts.engine.counters.tokens_evaluated
        assert answers(parallel, PROMPTS[::-1]) == want[::-1]
        assert states.restored > 0
        prompt_tokens = sum(len(plain.tokenize(prompt.encode())) for prompt in PROMPTS)
        assert drafts.engine.counters.tokens_evaluated - evaluated < prompt_tokens
        assert drafts.acceptance > 0.9
    finally:
        parallel.close()


def test_prompt_lookup_decoding_gets_a_decoder_per_slot(make_llama: Callable[..., Any]) -> None:
    plain = make_llama("llama")
    want = [complete(plain, prompt) for prompt in PROMPTS[:4]]
    host = make_llama("llama", draft_model=LlamaPromptLookupDecoding(num_pred_tokens=3))
    parallel = ParallelLlama(host, 2, load_entrypoints=False)
    try:
        assert parallel.lookups is not None and parallel.lookups[0] is not parallel.lookups[1]
        assert answers(parallel, PROMPTS[:4]) == want
    finally:
        parallel.close()


def test_a_stateful_draft_model_of_the_host_is_refused(make_llama: Callable[..., Any]) -> None:
    host = make_llama("llama", draft_model=NgramDraft())
    with pytest.raises(UnsupportedHostError, match="draft="):
        ParallelLlama(host, 2, load_entrypoints=False)
