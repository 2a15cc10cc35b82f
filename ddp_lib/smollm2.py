"""SmolLM2-360M-Instruct for sequence classification, from the Hub or, offline, randomly initialised in its shape.

The real path is `AutoModelForSequenceClassification.from_pretrained("HuggingFaceTB/SmolLM2-360M-Instruct")`
and is always tried first. Where the Hub cannot be reached (set HF_HUB_OFFLINE=1 to fail at once) the
fallback is announced on stderr: a randomly initialised LlamaForSequenceClassification with SmolLM2's
architecture (full 360M shape, or a scaled-down one) and a byte-level BPE tokenizer trained on the fly.
"""

from __future__ import annotations

import sys
from typing import Iterable, Literal

import torch

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-360M-Instruct"

# SmolLM2-360M's config.json as published on the Hub (LlamaForCausalLM): 32 layers of GQA with
# 15 query heads sharing 5 key/value heads (3:1, head_dim 64), SwiGLU MLP, RoPE, tied embeddings.
SMOLLM2_360M = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                    num_key_value_heads=5, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, tie_word_embeddings=True)
# Scaled down for CPU lessons and tests: the same 3:1 query/kv-head ratio and ~2.67x MLP ratio,
# head_dim 16 instead of 64, 4 layers instead of 32; the vocabulary is the trained tokenizer's.
SMOLLM2_SMALL = dict(SMOLLM2_360M, hidden_size=96, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
SHAPES = {"full": SMOLLM2_360M, "small": SMOLLM2_SMALL}

# SmolLM2's first three special tokens and their ids; the Instruct tokenizer pads with <|im_end|> (id 2).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, SEP_TOKEN = "<|im_end|>", "<|endoftext|>"
LABELS = ["not_equivalent", "equivalent"]


def pair_template():
    """`A <|endoftext|>` and `A <|endoftext|> B <|endoftext|>`: a separator between the sentences and a last,
    non-pad token for the classifier to pool (LlamaForSequenceClassification pools the last non-pad token)."""
    from tokenizers.processors import TemplateProcessing

    sep_id = SPECIAL_TOKENS.index(SEP_TOKEN)
    return TemplateProcessing(single=f"$A:0 {SEP_TOKEN}:0", pair=f"$A:0 {SEP_TOKEN}:0 $B:1 {SEP_TOKEN}:1",
                              special_tokens=[(SEP_TOKEN, sep_id)])


def _default_corpus() -> list[str]:
    from ddp_lib.data import synthetic_mrpc

    ds = synthetic_mrpc({"train": 1500, "validation": 0, "test": 0}, seed=12345)["train"]
    return list(ds["sentence1"]) + list(ds["sentence2"])


def train_pair_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained now on `texts` (default: generated MRPC-style sentences), with
    SmolLM2's special tokens at ids 0-2, <|im_end|> as pad/eos, and the pair template above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(list(texts) if texts is not None else _default_corpus(), trainer=trainer)
    assert [raw.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2], "special tokens must keep SmolLM2's ids"
    raw.post_processor = pair_template()
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token=PAD_TOKEN, unk_token="<|endoftext|>", model_max_length=8192,
                                   model_input_names=["input_ids", "attention_mask"])


def smollm2_config(shape: Literal["small", "full"] = "small", vocab_size: int | None = None, num_labels: int = 2):
    """A LlamaConfig with SmolLM2-360M's architecture ("full") or its scaled-down CPU shape ("small")."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    kw = dict(SHAPES[shape])
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    return LlamaConfig(**kw, pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN), bos_token_id=1, eos_token_id=2,
                       initializer_range=0.02, num_labels=num_labels, problem_type="single_label_classification",
                       id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})


def random_smollm2(shape: Literal["small", "full"] = "small", vocab_size: int | None = None, seed: int = 0,
                   dtype: torch.dtype | None = None, num_labels: int = 2):
    """LlamaForSequenceClassification in SmolLM2's shape with random weights (same `seed`, same weights)."""
    from transformers import LlamaForSequenceClassification

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(smollm2_config(shape, vocab_size, num_labels))
    return model.to(dtype) if dtype is not None else model


def load_smollm2(model_id: str = SMOLLM2_ID, num_labels: int = 2, fallback_shape: Literal["small", "full"] = "small",
                 fallback: bool = True, dtype: torch.dtype | None = None, seed: int = 0, vocab_size: int = 1024,
                 verbose: bool = True):
    """(model, tokenizer) for sequence-pair classification: the Hub's SmolLM2 first; offline, the announced fallback.

    The Hub tokenizer gets `pad_token` (<|im_end|> if missing) and the same pair template as the fallback's.
    `fallback_shape`, `seed` and `vocab_size` only shape the fallback ("full" keeps SmolLM2's 49152-row
    embedding even though the trained tokenizer uses only `vocab_size` of it, so profiles keep its cost).
    `model.ddp_lib_source` says which one you got: "hub" or "random-<shape>".
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_id)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_id, num_labels=num_labels, dtype=dtype, id2label=dict(enumerate(LABELS[:num_labels])),
            label2id={n: i for i, n in enumerate(LABELS[:num_labels])})
    except Exception as err:  # noqa: BLE001 - offline, no cache, proxy, gated: each is said, then we fall back
        if not fallback:
            raise
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:
        if tok.pad_token is None:
            tok.pad_token = PAD_TOKEN
        model.config.pad_token_id = tok.pad_token_id
        tok.backend_tokenizer.post_processor = pair_template() if tok.convert_tokens_to_ids(SEP_TOKEN) == 0 \
            else tok.backend_tokenizer.post_processor  # only a SmolLM2-style vocabulary gets our template
        model.ddp_lib_source = "hub"
        return model, tok
    tok = train_pair_tokenizer(vocab_size=vocab_size)
    model = random_smollm2(fallback_shape, None if fallback_shape == "full" else len(tok), seed, dtype, num_labels)
    model.ddp_lib_source = f"random-{fallback_shape}"
    if verbose:
        c = model.config
        n = sum(p.numel() for p in model.parameters())
        print(f"[ddp_lib] {model_id} unavailable ({reason}); using a RANDOMLY INITIALISED "
              f"LlamaForSequenceClassification in SmolLM2's {fallback_shape!r} shape (hidden {c.hidden_size}, "
              f"{c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, {n / 1e6:.1f}M "
              f"params) and a byte-level BPE tokenizer trained just now (vocab {len(tok)}) - no pretrained weights",
              file=sys.stderr, flush=True)
    return model, tok
