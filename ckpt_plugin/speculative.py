"""The import path earlier releases documented for speculative decoding with a draft model:
:mod:`ckpt_plugin.hosts.llama_cpp.speculative.drafts`."""

from ckpt_plugin.hosts.llama_cpp.speculative import drafts as _home
from ckpt_plugin.hosts.llama_cpp.speculative.drafts import (
    DRAFT_ENGINE_SETTINGS,
    DraftModel,
    DraftStatePlugin,
    HEADER,
    KeptInStep,
    NgramDraft,
    NgramStatePlugin,
    accepted_prefix,
    check_draft_pair,
    draft_buffer,
    enable_speculative,
    parse_draft_header,
)

# The names its home exports, no more (the home module is the one list of them).
__all__ = list(_home.__all__)
