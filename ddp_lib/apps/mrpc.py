"""GLUE MRPC for lesson 06: the Hub's, or sentence pairs generated in its schema when the Hub cannot be reached;
pair collation and per-rank DataLoaders."""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch

from ddp_lib.kit.data import shard
from ddp_lib.apps.hub import hub_reachable

MRPC_HUB_ID = ("nyu-mll/glue", "mrpc")  # the bare "glue" name no longer resolves on the Hub
MRPC_LABELS = ["not_equivalent", "equivalent"]
MRPC_SIZES = {"train": 3668, "validation": 408, "test": 1725}  # the real split sizes


def mrpc_features():
    """MRPC's features: sentence1, sentence2, label (ClassLabel not_equivalent/equivalent), idx."""
    from datasets import ClassLabel, Features, Value

    return Features({"sentence1": Value("string"), "sentence2": Value("string"),
                     "label": ClassLabel(names=MRPC_LABELS), "idx": Value("int32")})


def load_mrpc(sizes: dict[str, int] | None = None, seed: int = 0, fallback: bool = True, verbose: bool = True,
              path: str = MRPC_HUB_ID[0]):
    """GLUE MRPC as a DatasetDict (train/validation/test); offline, generated pairs in MRPC's schema, announced.

    `path` is the dataset repository (the Hub's, or a local folder in its layout) loaded as
    `load_dataset(path, "mrpc")`. `sizes` and `seed` only shape the generated fallback (default: MRPC's
    split sizes). With `fallback=False` a Hub failure is raised instead.
    """
    from datasets import load_dataset
    from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    # one short probe; an unreachable Hub switches this process offline, so only the local cache is tried
    online, why = (True, "") if os.path.isdir(path) else hub_reachable()
    bars = not are_progress_bars_disabled()
    disable_progress_bars()  # no "Generating train split" bars left in notebooks and logs
    try:
        return load_dataset(path, MRPC_HUB_ID[1])
    except Exception as err:  # noqa: BLE001 - offline, DNS, proxy, missing cache: all end here, and are said
        if not fallback:
            raise
        reason = why if not online else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        if bars:
            enable_progress_bars()
    ds = synthetic_mrpc(sizes, seed=seed)
    if verbose:
        n = ", ".join(f"{k} {len(v)}" for k, v in ds.items())
        print(f"[ddp_lib] GLUE MRPC unavailable ({reason}); using GENERATED sentence pairs in MRPC's schema "
              f"({n}; seed {seed}) - not MRPC, scores are not comparable", file=sys.stderr, flush=True)
    return ds


# Vocabulary of the generator: invented companies and people, real cities and weekdays.
_COMPANIES = ["Northwind Systems", "Alder Pharmaceuticals", "Bluestone Energy", "Corvane Media", "Halvorsen Foods",
              "Kestrel Airlines", "Lumen Robotics", "Marrow Bank", "Orinoco Telecom", "Pellham Motors",
              "Quarry Steel", "Redfern Insurance", "Saltmarsh Retail", "Tamberlane Software", "Verity Mining"]
_FIRST = ["Marta", "Jonas", "Priya", "Daniel", "Ines", "Tomas", "Grace", "Omar", "Helen", "Viktor", "Aiko", "Samuel"]
_LAST = ["Ruiz", "Keller", "Nair", "Okafor", "Lindqvist", "Brennan", "Moreau", "Castillo", "Hartley", "Sato"]
_ROLES = ["chief executive", "finance director", "chairman", "spokeswoman", "general counsel", "president"]
_CITIES = ["Boston", "Chicago", "Denver", "Houston", "Seattle", "Atlanta", "Toronto", "London", "Dublin", "Sydney"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
_METRICS = ["quarterly profit", "annual revenue", "net income", "operating profit", "first-half sales"]
_UP = (["rose", "increased", "climbed", "grew"], ["risen", "increased", "climbed", "grown"])
_DOWN = (["fell", "declined", "dropped", "slipped"], ["fallen", "declined", "dropped", "slipped"])
_ACTIONS = [(["signed", "finalised"], ["signed", "finalised"]), (["announced", "unveiled"], ["announced", "unveiled"]),
            (["rejected", "turned down"], ["rejected", "turned down"]), (["approved", "backed"], ["approved", "backed"]),
            (["delayed", "postponed"], ["delayed", "postponed"])]
_OBJECTS = ["merger agreement", "takeover bid", "restructuring plan", "pay deal", "new budget", "supply contract"]
_AGENCIES = ["Police", "Fire department", "State health", "Coast guard", "Transport ministry"]
_NOUNS = [("people", ["injured", "hurt"]), ("workers", ["evacuated", "moved to safety"]),
          ("passengers", ["stranded", "left stuck"]), ("residents", ["displaced", "forced from their homes"])]
_EVENTS = ["storm", "fire", "flood", "train derailment", "power outage", "gas leak"]


def _slots(rng: random.Random, kind: int) -> dict[str, Any]:
    c = rng.choice
    if kind == 0:
        return dict(kind=0, co=c(_COMPANIES), day=c(_DAYS), metric=c(_METRICS), up=rng.random() < 0.6,
                    n=rng.randint(2, 40), amount=rng.randint(10, 990))
    if kind == 1:
        return dict(kind=1, person=f"{c(_FIRST)} {c(_LAST)}", role=c(_ROLES), co=c(_COMPANIES),
                    act=rng.randrange(len(_ACTIONS)), obj=c(_OBJECTS), city=c(_CITIES), day=c(_DAYS))
    return dict(kind=2, agency=c(_AGENCIES), n=rng.randint(3, 90), noun=rng.randrange(len(_NOUNS)),
                event=c(_EVENTS), city=c(_CITIES))


def _render(s: dict[str, Any], rng: random.Random) -> str:
    c, form = rng.choice, rng.randrange(3)  # the same facts in one of three word orders, synonyms at random
    if s["kind"] == 0:
        past, pp = _UP if s["up"] else _DOWN
        v, vpp, d = c(past), c(pp), (s["n"], s["amount"])
        return [f"{s['co']} said on {s['day']} that its {s['metric']} {v} {d[0]} percent to ${d[1]} million.",
                f"On {s['day']}, {s['co']} reported that {s['metric']} had {vpp} {d[0]} percent, to ${d[1]} million.",
                f"{s['metric'].capitalize()} at {s['co']} {v} {d[0]} percent to ${d[1]} million, "
                f"the company said {s['day']}."][form]
    if s["kind"] == 1:
        past, pp = _ACTIONS[s["act"]]
        return [f"{s['person']}, the {s['role']} of {s['co']}, {c(past)} the {s['obj']} in {s['city']} on {s['day']}.",
                f"On {s['day']} in {s['city']}, {s['co']} {s['role']} {s['person']} {c(past)} the {s['obj']}.",
                f"The {s['obj']} was {c(pp)} by {s['person']}, {s['co']}'s {s['role']}, in {s['city']} "
                f"on {s['day']}."][form]
    noun, verbs = _NOUNS[s["noun"]]
    return [f"{s['agency']} officials said {s['n']} {noun} were {c(verbs)} after the {s['event']} in {s['city']}.",
            f"At least {s['n']} {noun} were {c(verbs)} following the {s['event']} in {s['city']}, "
            f"{s['agency'].lower()} officials said.",
            f"After the {s['event']} in {s['city']}, {s['n']} {noun} were {c(verbs)}, {s['agency'].lower()} "
            f"officials said."][form]


def _mutate(s: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The same story with one fact changed: high word overlap, different meaning (MRPC's hard negatives)."""
    t, c = dict(s), rng.choice
    key = c({0: ["co", "day", "metric", "up", "n", "amount"], 1: ["person", "co", "act", "obj", "city", "day"],
             2: ["agency", "n", "noun", "event", "city"]}[s["kind"]])
    while t[key] == s[key]:
        t[key] = _slots(rng, s["kind"])[key]
    return t


def synthetic_mrpc(sizes: dict[str, int] | None = None, seed: int = 0, positive_rate: float = 0.68):
    """Sentence pairs generated by ddp_lib in MRPC's schema: deterministic in `seed`, ~68 % equivalent.

    Equivalent pairs state the same facts in different word orders and synonyms; the others change
    one fact (a number, a name, a place, a day, a direction) or pair two unrelated stories of one kind.
    No MRPC text is used (its licence forbids redistribution).
    """
    from datasets import Dataset, DatasetDict, DatasetInfo

    sizes = {**MRPC_SIZES, **(sizes or {})}
    out = {}
    for split_no, (split, n) in enumerate(sizes.items()):
        rng = random.Random(f"{seed}/{split_no}/{split}")
        rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
        for i in range(n):
            a = _slots(rng, rng.randrange(3))
            label = int(rng.random() < positive_rate)
            b = a if label else (_mutate(a, rng) if rng.random() < 0.8 else _slots(rng, a["kind"]))
            s1, s2 = _render(a, rng), _render(b, rng)
            for _ in range(50):  # an equivalent pair should not be a verbatim copy
                if s1 != s2:
                    break
                s2 = _render(b, rng)
            for k, v in zip(rows, (s1, s2, label, i)):
                rows[k].append(v)
        info = DatasetInfo(description="Generated by ddp_lib.apps.mrpc.synthetic_mrpc in GLUE MRPC's schema; not MRPC.",
                           features=mrpc_features())
        out[split] = Dataset.from_dict(rows, info=info, split=split)
    return DatasetDict(out)


class PairCollator:
    """Tokenises a list of MRPC rows as sentence pairs, pads to the longest, returns input_ids/attention_mask/labels.

    `pad_to_multiple_of=64` pads the longest up to a multiple of 64 instead (a multiple stays as it is): a few batch
    shapes instead of one per length. `max_length` must then be a multiple of it (transformers refuses truncation to
    a length that padding would pass; refused here at once). On a GPU a length not seen before cost a step several
    times a seen one (one H200, `docs/gpu.md`), so fewer shapes let a warm-up step warm what follows.
    """

    def __init__(self, tokenizer, max_length: int = 128, pad_to_multiple_of: int | None = None):
        if pad_to_multiple_of is not None and (pad_to_multiple_of < 1 or max_length % pad_to_multiple_of):
            raise ValueError(f"pad_to_multiple_of must be None or a positive divisor of max_length ({max_length}), "
                             f"not {pad_to_multiple_of!r}")
        self.tokenizer, self.max_length, self.multiple = tokenizer, max_length, pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        enc = self.tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], padding=True,
                             truncation=True, max_length=self.max_length, return_tensors="pt",
                             return_token_type_ids=False, pad_to_multiple_of=self.multiple)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "labels": torch.tensor([r["label"] for r in rows], dtype=torch.long)}


def make_dataloader(dataset, tokenizer, batch_size: int, rank: int | None = None, world_size: int | None = None,
                    shuffle: bool = True, seed: int = 0, epoch: int = 0, max_length: int = 128,
                    drop_last: bool = True) -> torch.utils.data.DataLoader:
    """This rank's DataLoader over a DistributedSampler (set to `epoch`): the same permutation on every rank
    (seed + epoch), then every world_size-th index from `rank`; pad-collated pairs.

    Training: `drop_last=True` (equal, full batches on every rank). Evaluation: `drop_last=False` keeps every
    row of this rank's shard, and `shard` (not the sampler, which would pad by repeating rows) gives the shard.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    if rank is None or world_size is None:
        live = dist.is_available() and dist.is_initialized()
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if live else (0, 1)
    collate = PairCollator(tokenizer, max_length)
    if not drop_last:
        return DataLoader(shard(dataset, rank, world_size), batch_size=batch_size, shuffle=False, collate_fn=collate)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate)
