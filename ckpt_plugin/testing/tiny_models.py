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

    from ckpt_plugin.testing.tiny_models import build_tiny_model
    path = build_tiny_model("gemma3", tmp_path / "gemma3.gguf", sliding_window=32)

or from the command line::

    python -m ckpt_plugin.testing.tiny_models gemma3 /tmp/gemma3.gguf

For multimodal tests, :func:`write_tiny_mmproj` writes a matching vision
projector (a llava-style MLP over a tiny CLIP encoder) that llama.cpp's mtmd
library loads next to any of these models, and :func:`tiny_png` /
:func:`image_data_uri` make deterministic images to send through it.
"""

from __future__ import annotations

import argparse
import base64
import os
import pathlib
import string
import struct
import zlib
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
    "MMPROJ_IMAGE_SIZE",
    "MMPROJ_PATCH_SIZE",
    "MODEL_KINDS",
    "ModelKind",
    "N_VOCAB",
    "UNK_ID",
    "VOCAB",
    "build_tiny_model",
    "image_data_uri",
    "mmproj_positions_per_image",
    "tiny_png",
    "write_tiny_mmproj",
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


def _write_out(writer: gguf.GGUFWriter) -> None:
    """Write a filled writer's header, key-value data and tensors to its file (the caller closes it)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()


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

        _write_out(writer)
    finally:
        writer.close()
    return out


# --------------------------------------------------------------------------
# Vision projector (mmproj) and images
# --------------------------------------------------------------------------

#: Side of the square image the projector's encoder takes (every image is resized to it).
MMPROJ_IMAGE_SIZE = 28
#: Side of one square patch; an image becomes ``(image_size // patch_size) ** 2`` positions.
MMPROJ_PATCH_SIZE = 14
#: Vision-encoder width, heads, feed-forward width and blocks.
MMPROJ_N_EMBD = 32
MMPROJ_N_HEAD = 2
MMPROJ_N_FF = 64
MMPROJ_N_LAYER = 2
#: Hidden width of the two-layer MLP projector (``mm.0`` -> GELU -> ``mm.2``).
MMPROJ_N_HIDDEN = 64
MMPROJ_LAYER_NORM_EPS = 1e-5
# Pixels are normalised to [-1, 1] before the patch convolution.
_MMPROJ_IMAGE_MEAN = (0.5, 0.5, 0.5)
_MMPROJ_IMAGE_STD = (0.5, 0.5, 0.5)
# Position embeddings stay small next to the patch embeddings, so that the image content (not only where a
# patch is) decides what the projector outputs.
_MMPROJ_POS_STD = 0.1


def mmproj_positions_per_image(image_size: int = MMPROJ_IMAGE_SIZE, patch_size: int = MMPROJ_PATCH_SIZE) -> int:
    """The positions (and embeddings) one image takes in the text model's context with a tiny projector.

    The llava MLP projector emits one embedding per patch, without class token or row separators, and mtmd places
    them at consecutive positions: ``n_pos == n_tokens`` for an image chunk.
    """
    return (image_size // patch_size) ** 2


def write_tiny_mmproj(
    path: str | os.PathLike[str],
    text_n_embd: int = N_EMBD,
    *,
    seed: int = 0,
    image_size: int = MMPROJ_IMAGE_SIZE,
    patch_size: int = MMPROJ_PATCH_SIZE,
    n_layer: int = MMPROJ_N_LAYER,
) -> pathlib.Path:
    """Write a tiny random-weight vision projector (mmproj GGUF) that llama.cpp's mtmd library loads.

    The file has projector type ``"mlp"`` (LLaVA-1.5): a CLIP-style ViT (patch convolution with bias, learned
    position embeddings, pre-layernorm, ``n_layer`` pre-norm blocks with biased attention and a GELU feed-forward)
    and a two-layer MLP (``mm.0``, GELU, ``mm.2``) into the text model's embedding space.  Like LLaVA, mtmd reads
    the features of the second-to-last block, so of ``n_layer`` blocks the first ``n_layer - 1`` run (with
    ``n_layer=1`` the image goes through the patch embedding, pre-layernorm and MLP only).

    Every image, whatever its size, is resized to ``image_size`` x ``image_size`` and becomes
    :func:`mmproj_positions_per_image` embeddings (4 with the defaults).  The projector's output width must equal
    the text model's ``n_embd`` (mtmd refuses the pair otherwise): the default, :data:`N_EMBD` (64), pairs with
    every model :func:`build_tiny_model` writes (llama, gemma3, mamba, hybrid).  Weights are F32 from
    ``numpy.random.default_rng(seed)``; same arguments, same bytes.  The file is about 170 KB.

    Args:
        path: output file; parent directories are created.
        text_n_embd: embedding width of the text model it feeds.
        seed: seed for the weights.
        image_size: side of the square image the encoder takes; a multiple of ``patch_size``.
        patch_size: side of one patch.
        n_layer: encoder blocks written (at least 1).

    Returns:
        The path of the written file.
    """
    if gguf is None:
        raise ModuleNotFoundError("tiny models are written with the gguf package: pip install 'ckpt_plugin[test]'")
    if text_n_embd < 1:
        raise ValueError(f"text_n_embd must be >= 1, got {text_n_embd}")
    if patch_size < 1 or image_size < patch_size or image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a positive multiple of patch_size ({patch_size})")
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_embd, n_ff, n_hidden = MMPROJ_N_EMBD, MMPROJ_N_FF, MMPROJ_N_HIDDEN
    n_pos = mmproj_positions_per_image(image_size, patch_size)

    writer = gguf.GGUFWriter(out, "clip")
    try:
        writer.add_name("tiny-mmproj")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        # Keys as mtmd's clip loader reads them (clip-impl.h), spelled out rather than through the writer's
        # helpers, whose names have changed between gguf releases.
        writer.add_string("clip.projector_type", "mlp")
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_bool("clip.has_audio_encoder", False)
        writer.add_uint32("clip.vision.image_size", image_size)
        writer.add_uint32("clip.vision.patch_size", patch_size)
        writer.add_uint32("clip.vision.embedding_length", n_embd)
        writer.add_uint32("clip.vision.feed_forward_length", n_ff)
        writer.add_uint32("clip.vision.block_count", n_layer)
        writer.add_uint32("clip.vision.projection_dim", text_n_embd)
        writer.add_uint32("clip.vision.attention.head_count", MMPROJ_N_HEAD)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", MMPROJ_LAYER_NORM_EPS)
        writer.add_array("clip.vision.image_mean", list(_MMPROJ_IMAGE_MEAN))
        writer.add_array("clip.vision.image_std", list(_MMPROJ_IMAGE_STD))

        t = _Tensors(writer, np.random.default_rng(seed))
        # The patch convolution's kernel: ggml {patch, patch, 3, n_embd}.
        t.normal("v.patch_embd.weight", (n_embd, 3, patch_size, patch_size), 1.0 / np.sqrt(3 * patch_size**2))
        t.normal("v.patch_embd.bias", (n_embd,), 0.1)
        t.normal("v.position_embd.weight", (n_pos, n_embd), _MMPROJ_POS_STD)
        t.ones("v.pre_ln.weight", n_embd)
        t.add("v.pre_ln.bias", np.zeros(n_embd))
        for il in range(n_layer):
            p = f"v.blk.{il}"
            for norm in ("ln1", "ln2"):
                t.ones(f"{p}.{norm}.weight", n_embd)
                t.add(f"{p}.{norm}.bias", np.zeros(n_embd))
            for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
                t.linear(f"{p}.{proj}.weight", n_embd, n_embd)
                t.normal(f"{p}.{proj}.bias", (n_embd,), 0.02)
            # n_ff != n_embd, so the loader's fix-up for old files with swapped up/down does not apply.
            t.linear(f"{p}.ffn_up.weight", n_ff, n_embd)
            t.normal(f"{p}.ffn_up.bias", (n_ff,), 0.02)
            t.linear(f"{p}.ffn_down.weight", n_embd, n_ff)
            t.normal(f"{p}.ffn_down.bias", (n_embd,), 0.02)
        t.linear("mm.0.weight", n_hidden, n_embd)
        t.normal("mm.0.bias", (n_hidden,), 0.02)
        # GELU roughly halves the variance: the gain brings the output back to RMS ~1, the scale of the tiny
        # text models' (scaled) token embeddings.
        t.linear("mm.2.weight", text_n_embd, n_hidden, gain=np.sqrt(2.0))
        t.normal("mm.2.bias", (text_n_embd,), 0.02)

        _write_out(writer)
    finally:
        writer.close()
    return out


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def tiny_png(seed: int, width: int = MMPROJ_IMAGE_SIZE, height: int | None = None) -> bytes:
    """A deterministic RGB PNG of random pixels (8 bits per channel), as file bytes.

    Pixels are uniform in 0..255 from ``numpy.random.default_rng(seed)``: different seeds give images that differ
    everywhere, the same seed the same bytes.  The default size is the tiny projector's input size, so mtmd does not
    resize it.  Encoded with :mod:`zlib` only (no imaging library needed).

    Args:
        seed: seed for the pixels.
        width: image width in pixels.
        height: image height in pixels; defaults to ``width``.
    """
    height = width if height is None else height
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    # Each scanline starts with its filter type (0: none).
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw, 9))
        + _png_chunk(b"IEND", b"")
    )


def image_data_uri(png: bytes) -> str:
    """A ``data:image/png;base64,...`` URI of PNG bytes, as chat requests carry images (``image_url.url``)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


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
