"""The import path earlier releases documented for speculative decoding with a draft model: :mod:`ckpt_plugin.hosts.llama_cpp.speculative`."""

from ckpt_plugin.hosts.llama_cpp.speculative import *  # noqa: F401,F403
