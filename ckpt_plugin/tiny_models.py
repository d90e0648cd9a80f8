"""Tiny random-weight GGUF models for tests.

This module writes small (0.4-1.1 MB), deterministic GGUF files with
random F32 weights that llama.cpp (as bundled with llama-cpp-python 0.3.36)
loads and runs.  They exercise the different memory types llama.cpp uses
for its prompt cache / sequence state:

* ``"llama"``  - plain attention model, unified KV cache.
* ``"gemma3"`` - gemma3 with interleaved sliding-window attention (iSWA);
  with the default 6 layers llama.cpp's gemma3 pattern gives 5 SWA layers
  and 1 full-attention layer.
* ``"mamba"``  - Mamba (v1), a purely recurrent model.
* ``"hybrid"`` - LFM2 (short-conv recurrent layers + attention layers),
  which llama.cpp treats as a hybrid (``llama_model_is_hybrid``) model.

All models share one small SentencePiece-style ("llama") vocabulary: the
special tokens ``<unk>``/``<s>``/``</s>``, the 256 byte-fallback tokens
``<0x00>``..``<0xFF>`` and some lowercase letters, digits, punctuation and
word pieces such as ``"▁the"`` / ``"▁hello"``.

Weights are drawn from ``numpy.random.default_rng(seed)`` (fan-in scaled
normal initialisation).  The untied output matrix is shaped so that greedy
generation yields varied tokens that depend on the whole context rather than
one token repeated forever (see ``OUTPUT_GAIN``), and it never picks special
tokens or non-ASCII byte tokens (see ``Vocab.suppressed``), so greedy
completions always run to ``max_tokens`` and decode to valid UTF-8.

Usage::

    from ckpt_plugin.tiny_models import build_tiny_model
    path = build_tiny_model("gemma3", tmp_path / "gemma3.gguf", sliding_window=32)

or from the command line::

    python -m ckpt_plugin.tiny_models gemma3 /tmp/gemma3.gguf
"""

from __future__ import annotations

import argparse
import os
import pathlib
import string
from dataclasses import dataclass
from collections.abc import Callable
from typing import Literal, get_args

import numpy as np

try:  # test support: ``gguf`` comes with the ``test`` extra, and importing this module must not need it
    import gguf
except ImportError:  # pragma: no cover - exercised only without the extra
    gguf = None

__all__ = [
    "ARCHITECTURES",
    "BOS_ID",
    "DEFAULT_N_LAYER",
    "EOS_ID",
    "MODEL_KINDS",
    "ModelKind",
    "N_VOCAB",
    "UNK_ID",
    "VOCAB",
    "build_tiny_model",
]

ModelKind = Literal["llama", "gemma3", "mamba", "hybrid"]
MODEL_KINDS: tuple[str, ...] = get_args(ModelKind)

#: GGUF ``general.architecture`` written for each kind.
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "gemma3": "gemma3",
    "mamba": "mamba",
    "hybrid": "lfm2",
}

# Shared model dimensions.
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
CONTEXT_LENGTH = 2048
RMS_EPS = 1e-6

# Output projection = (OUTPUT_GAIN * noise + PERM_GAIN * P @ E - SELF_PENALTY * E)
# / sqrt(n_embd), with E the (unit-variance) token embeddings and P a random
# permutation.  The last two terms make the current token unlikely and a
# random "successor" token likely to come next, which keeps greedy decoding
# from collapsing into one repeated token, while the noise term (passing
# through the layers) keeps the prediction dependent on the whole context.
OUTPUT_GAIN = 3.0
PERM_GAIN = 2.0
SELF_PENALTY = 1.0

# Mamba (v1) dimensions; llama.cpp only supports d_inner == 2 * n_embd.
SSM_D_CONV = 4
SSM_D_INNER = 2 * N_EMBD
SSM_D_STATE = 16
SSM_DT_RANK = 4
# Slow decay (|A| in [0.01, 0.5]) and large steps (dt in [0.1, 1]) rather than
# Mamba's training init, so tokens dozens of positions back still change the
# greedy continuation; small D so the skip connection does not dominate.
SSM_A_RANGE = (0.01, 0.5)
SSM_DT_RANGE = (0.1, 1.0)
SSM_D_SKIP = 0.1

# LFM2 short-conv cache length (kernel size).
SHORTCONV_L_CACHE = 3

DEFAULT_N_LAYER: dict[str, int] = {
    "llama": 2,
    "gemma3": 6,  # gemma3 SWA pattern is 6: layers 0-4 sliding, layer 5 full
    "mamba": 2,
    "hybrid": 4,  # conv, attn, conv, attn
}
# The hybrid needs at least one recurrent and one attention layer (llama.cpp
# aborts on a hybrid memory without attention layers).
MIN_N_LAYER: dict[str, int] = {"llama": 1, "gemma3": 1, "mamba": 1, "hybrid": 2}

# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

_SPM_SPACE = "\u2581"  # "▁"
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_WORDS = (
    "the", "a", "and", "of", "to", "in", "is", "it", "that", "this",
    "hello", "world", "you", "for", "on", "cat", "dog", "one", "two",
)
_CHARS = string.ascii_lowercase + string.digits + ".,!?'-:;"
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class Vocab:
    """Token strings, SPM scores and gguf token types, indexed by token id."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    #: ids whose output logits are pinned to 0: special tokens (so greedy
    #: generation does not stop at EOS) and byte tokens other than printable
    #: ASCII and newline (so generated text is valid UTF-8 - llama-cpp-python
    #: keeps generating past ``max_tokens`` while the text is incomplete UTF-8).
    suppressed: frozenset[int]


def _build_vocab() -> Vocab:
    """SentencePiece-style vocab with byte fallback (~340 tokens).

    Every prefix of every word piece is itself a token, so llama.cpp's SPM
    bigram merging can always reach the full word.
    """
    tokens: list[str] = list(_SPECIAL_TOKENS)
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
    ]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256

    pieces: dict[str, None] = dict.fromkeys([_SPM_SPACE, *_CHARS])
    for word in _WORDS:
        piece = _SPM_SPACE + word
        pieces.update(dict.fromkeys(piece[:n] for n in range(2, len(piece) + 1)))
    tokens += list(pieces)
    types += [gguf.TokenType.NORMAL] * len(pieces)

    # Byte/special tokens score 0; normal pieces get decreasing scores.
    n_fixed = len(_SPECIAL_TOKENS) + 256
    scores = [0.0] * n_fixed + [-float(i) for i in range(len(pieces))]
    printable_bytes = {ord("\n"), *range(0x20, 0x7F)}
    suppressed = frozenset(range(len(_SPECIAL_TOKENS))) | frozenset(
        len(_SPECIAL_TOKENS) + b for b in range(256) if b not in printable_bytes
    )
    return Vocab(tokens=tokens, scores=scores, types=[int(t) for t in types], suppressed=suppressed)


VOCAB = _build_vocab()
N_VOCAB = len(VOCAB.tokens)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(VOCAB.tokens)
    writer.add_token_scores(VOCAB.scores)
    writer.add_token_types(VOCAB.types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(_CHAT_TEMPLATE)


# --------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------


class _Tensors:
    """Adds random F32 tensors to a writer.

    Shapes are given numpy-style (rows, cols); GGUF stores them reversed, so
    a ``(n_out, n_in)`` matrix appears to llama.cpp as ``{n_in, n_out}``.
    """

    def __init__(self, writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        self.writer = writer
        self.rng = rng

    def add(self, name: str, data: np.ndarray) -> None:
        self.writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.add(name, self.rng.normal(0.0, std, size=shape))

    def linear(self, name: str, n_out: int, n_in: int, gain: float = 1.0) -> None:
        """Weight matrix for ``y = W @ x`` with fan-in scaled init."""
        self.normal(name, (n_out, n_in), gain / np.sqrt(n_in))

    def ones(self, name: str, n: int) -> None:
        self.add(name, np.ones(n))


def _add_embeddings(t: _Tensors, *, embd_std: float, output_norm: str = "output_norm") -> None:
    """Token embedding, final norm and an untied output projection.

    See :data:`OUTPUT_GAIN` for how the output matrix is built (a tied or
    purely random one tends to make greedy decoding repeat one token).  Rows
    of tokens in ``VOCAB.suppressed`` are zeroed (logit exactly 0 while the
    other logits have std ~3), so greedy decoding practically never emits them.
    """
    embd = t.rng.normal(0.0, 1.0, size=(N_VOCAB, N_EMBD))
    t.add("token_embd.weight", embd_std * embd)
    t.ones(f"{output_norm}.weight", N_EMBD)
    output = OUTPUT_GAIN * t.rng.normal(0.0, 1.0, size=(N_VOCAB, N_EMBD)) - SELF_PENALTY * embd
    output[t.rng.permutation(N_VOCAB)] += PERM_GAIN * embd
    output /= np.sqrt(N_EMBD)  # the final hidden state has RMS ~1
    output[sorted(VOCAB.suppressed)] = 0.0
    t.add("output.weight", output)


def _add_attention(
    t: _Tensors, il: int, *, n_head_kv: int = N_HEAD_KV, qk_norm: bool = False, post_norm: bool = False
) -> None:
    p = f"blk.{il}"
    t.ones(f"{p}.attn_norm.weight", N_EMBD)
    t.linear(f"{p}.attn_q.weight", N_HEAD * HEAD_DIM, N_EMBD)
    t.linear(f"{p}.attn_k.weight", n_head_kv * HEAD_DIM, N_EMBD)
    t.linear(f"{p}.attn_v.weight", n_head_kv * HEAD_DIM, N_EMBD)
    t.linear(f"{p}.attn_output.weight", N_EMBD, N_HEAD * HEAD_DIM)
    if qk_norm:
        t.ones(f"{p}.attn_q_norm.weight", HEAD_DIM)
        t.ones(f"{p}.attn_k_norm.weight", HEAD_DIM)
    if post_norm:
        t.ones(f"{p}.post_attention_norm.weight", N_EMBD)


def _add_ffn(t: _Tensors, il: int, *, post_norm: bool = False) -> None:
    p = f"blk.{il}"
    t.ones(f"{p}.ffn_norm.weight", N_EMBD)
    t.linear(f"{p}.ffn_gate.weight", N_FF, N_EMBD)
    t.linear(f"{p}.ffn_up.weight", N_FF, N_EMBD)
    t.linear(f"{p}.ffn_down.weight", N_EMBD, N_FF)
    if post_norm:
        t.ones(f"{p}.post_ffw_norm.weight", N_EMBD)


def _add_attention_hparams(w: gguf.GGUFWriter, head_count_kv: int | list[int] = N_HEAD_KV) -> None:
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(head_count_kv)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_feed_forward_length(N_FF)
    w.add_rope_freq_base(10000.0)


# --------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _BuildArgs:
    writer: gguf.GGUFWriter
    tensors: _Tensors
    n_layer: int
    sliding_window: int


def _build_llama(a: _BuildArgs) -> None:
    _add_attention_hparams(a.writer)
    a.writer.add_rope_dimension_count(HEAD_DIM)
    _add_embeddings(a.tensors, embd_std=1.0)
    for il in range(a.n_layer):
        _add_attention(a.tensors, il)
        _add_ffn(a.tensors, il)


def _build_gemma3(a: _BuildArgs) -> None:
    _add_attention_hparams(a.writer)
    a.writer.add_sliding_window(a.sliding_window)
    a.writer.add_rope_freq_base_swa(10000.0)
    # gemma3 multiplies embeddings by sqrt(n_embd) -> unit-RMS residual stream.
    # Norm weights are stored as (1 + w) by convert_hf_to_gguf, hence ones.
    _add_embeddings(a.tensors, embd_std=1.0 / np.sqrt(N_EMBD))
    for il in range(a.n_layer):
        _add_attention(a.tensors, il, qk_norm=True, post_norm=True)
        _add_ffn(a.tensors, il, post_norm=True)


def _build_mamba(a: _BuildArgs) -> None:
    w, t = a.writer, a.tensors
    w.add_ssm_conv_kernel(SSM_D_CONV)
    w.add_ssm_inner_size(SSM_D_INNER)
    w.add_ssm_state_size(SSM_D_STATE)
    w.add_ssm_time_step_rank(SSM_DT_RANK)
    _add_embeddings(t, embd_std=1.0)

    # llama.cpp wants A itself (convert_hf_to_gguf stores -exp(A_log)).
    a_row = -np.geomspace(*SSM_A_RANGE, num=SSM_D_STATE)
    a_matrix = np.tile(a_row, (SSM_D_INNER, 1))
    for il in range(a.n_layer):
        p = f"blk.{il}"
        t.ones(f"{p}.attn_norm.weight", N_EMBD)
        t.linear(f"{p}.ssm_in.weight", 2 * SSM_D_INNER, N_EMBD)
        t.normal(f"{p}.ssm_conv1d.weight", (SSM_D_INNER, SSM_D_CONV), 1.0 / np.sqrt(SSM_D_CONV))
        t.normal(f"{p}.ssm_conv1d.bias", (SSM_D_INNER,), 0.1)
        t.linear(f"{p}.ssm_x.weight", SSM_DT_RANK + 2 * SSM_D_STATE, SSM_D_INNER)
        t.linear(f"{p}.ssm_dt.weight", SSM_D_INNER, SSM_DT_RANK)
        # dt bias = softplus^-1(dt) with dt log-uniform in SSM_DT_RANGE.
        dt = np.exp(t.rng.uniform(*np.log(SSM_DT_RANGE), size=SSM_D_INNER))
        t.add(f"{p}.ssm_dt.bias", dt + np.log(-np.expm1(-dt)))
        t.add(f"{p}.ssm_a", a_matrix)  # no ".weight" suffix in llama.cpp
        t.add(f"{p}.ssm_d", np.full(SSM_D_INNER, SSM_D_SKIP))
        t.linear(f"{p}.ssm_out.weight", N_EMBD, SSM_D_INNER)


def _lfm2_is_attention(il: int) -> bool:
    return il % 2 == 1


def _build_hybrid(a: _BuildArgs) -> None:
    """LFM2: odd layers are attention, even layers gated short convolutions."""
    w, t = a.writer, a.tensors
    # llama.cpp marks a layer recurrent (short-conv) iff its n_head_kv is 0.
    _add_attention_hparams(w, [N_HEAD_KV if _lfm2_is_attention(il) else 0 for il in range(a.n_layer)])
    w.add_shortconv_l_cache(SHORTCONV_L_CACHE)
    # LFM2's final norm is (mis)named token_embd_norm in GGUF files.
    _add_embeddings(t, embd_std=1.0, output_norm="token_embd_norm")
    for il in range(a.n_layer):
        if _lfm2_is_attention(il):
            _add_attention(t, il, qk_norm=True)
        else:
            p = f"blk.{il}"
            t.ones(f"{p}.attn_norm.weight", N_EMBD)
            t.normal(f"{p}.shortconv.conv.weight", (N_EMBD, SHORTCONV_L_CACHE), 1.0 / np.sqrt(SHORTCONV_L_CACHE))
            t.linear(f"{p}.shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
            t.linear(f"{p}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
        _add_ffn(t, il)


_BUILDERS: dict[str, Callable[[_BuildArgs], None]] = {
    "llama": _build_llama,
    "gemma3": _build_gemma3,
    "mamba": _build_mamba,
    "hybrid": _build_hybrid,
}


def build_tiny_model(
    kind: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    sliding_window: int = 32,
    n_layer: int | None = None,
) -> pathlib.Path:
    """Write a tiny random-weight GGUF model of the given kind to ``path``.

    Args:
        kind: one of :data:`MODEL_KINDS` (``"llama"``, ``"gemma3"``,
            ``"mamba"``, ``"hybrid"``).
        path: output file; parent directories are created.
        seed: seed for ``numpy.random.default_rng``; same seed, same bytes.
        sliding_window: SWA window written to ``gemma3.attention.sliding_window``
            (only used for ``"gemma3"``).
        n_layer: number of blocks; defaults to :data:`DEFAULT_N_LAYER` for
            the kind.  For gemma3 every 6th layer is full attention, for the
            hybrid every odd layer is attention.

    Returns:
        The path of the written file.
    """
    if gguf is None:
        raise ModuleNotFoundError("tiny models are written with the gguf package: pip install 'ckpt_plugin[test]'")
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {MODEL_KINDS}")
    n_layer = DEFAULT_N_LAYER[kind] if n_layer is None else n_layer
    if n_layer < MIN_N_LAYER[kind]:
        raise ValueError(f"{kind!r} needs n_layer >= {MIN_N_LAYER[kind]}, got {n_layer}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = ARCHITECTURES[kind]

    writer = gguf.GGUFWriter(out, arch)
    try:
        writer.add_name(f"tiny-{kind}")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(CONTEXT_LENGTH)
        writer.add_embedding_length(N_EMBD)
        writer.add_block_count(n_layer)
        writer.add_layer_norm_rms_eps(RMS_EPS)
        writer.add_vocab_size(N_VOCAB)
        _add_tokenizer(writer)

        tensors = _Tensors(writer, np.random.default_rng(seed))
        _BUILDERS[kind](_BuildArgs(writer, tensors, n_layer, sliding_window))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight GGUF model for tests.")
    parser.add_argument("kind", choices=MODEL_KINDS)
    parser.add_argument("path", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sliding-window", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=None)
    args = parser.parse_args(argv)
    out = build_tiny_model(
        args.kind, args.path, seed=args.seed, sliding_window=args.sliding_window, n_layer=args.n_layer
    )
    print(f"{out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    _main()
