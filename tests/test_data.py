"""ddp_lib.kit.data and ddp_lib.apps.mrpc: MRPC with its announced offline fallback, sharding, collation, per-rank loaders."""

import os

import pytest
import torch

from ddp_lib.kit.data import shard, shard_batch
from ddp_lib.apps.mrpc import MRPC_LABELS, PairCollator, load_mrpc, make_dataloader, synthetic_mrpc

SMALL = {"train": 300, "validation": 40, "test": 20}


def test_offline_fallback_is_announced_and_keeps_mrpc_schema(capsys):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    ds = load_mrpc(SMALL)
    err = capsys.readouterr().err
    assert "GLUE MRPC unavailable" in err and "GENERATED" in err and "not MRPC" in err
    assert err.count("\n") == 1  # one line
    assert {k: len(v) for k, v in ds.items()} == SMALL
    train = ds["train"]
    assert list(train.features) == ["sentence1", "sentence2", "label", "idx"]
    assert train.features["label"].names == MRPC_LABELS == ["not_equivalent", "equivalent"]
    assert train.features["idx"].dtype == "int32"
    assert train["idx"][:5] == [0, 1, 2, 3, 4]
    assert "not MRPC" in train.info.description


def test_fallback_can_be_refused():
    with pytest.raises(ConnectionError):
        load_mrpc(SMALL, fallback=False)


def test_generated_pairs_are_deterministic_varied_and_mrpc_like():
    a, b, c = (synthetic_mrpc({"train": 600, "validation": 0, "test": 0}, seed=s)["train"] for s in (0, 0, 1))
    assert a[:] == b[:] and a["sentence1"] != c["sentence1"]
    labels = list(a["label"])
    assert 0.6 < sum(labels) / len(labels) < 0.76  # MRPC: ~68 % equivalent
    assert all(s1 != s2 for s1, s2 in zip(a["sentence1"], a["sentence2"]))
    assert len(set(a["sentence1"])) > 590  # varied, not a handful of templates repeated


def test_shard_gives_disjoint_equal_slices_and_drops_the_remainder():
    rows = list(range(11))
    for world in (1, 2, 3, 4):
        parts = [shard(rows, r, world) for r in range(world)]
        assert len({len(p) for p in parts}) == 1 and len(parts[0]) == 11 // world
        flat = [x for p in parts for x in p]
        assert len(set(flat)) == len(flat)  # disjoint
        assert set(rows) - set(flat) == set(rows[len(flat):])  # the last len % world rows are the ones dropped
    ds = synthetic_mrpc(SMALL)["validation"]
    idx = [set(shard(ds, r, 3)["idx"]) for r in range(3)]
    assert not (idx[0] & idx[1] or idx[1] & idx[2] or idx[0] & idx[2]) and all(len(i) == 13 for i in idx)
    with pytest.raises(ValueError):
        shard(rows, 2, 2)
    with pytest.raises(ValueError):
        shard(rows[:1], 0, 2)
    assert shard_batch(torch.arange(4), 1, 2).tolist() == [2, 3]  # lesson 02's helper is unchanged


def test_collation_pads_and_loaders_per_rank_are_disjoint():
    from ddp_lib.apps.smollm2 import train_pair_tokenizer

    ds = synthetic_mrpc(SMALL)
    tok = train_pair_tokenizer(ds["train"]["sentence1"], vocab_size=400)
    batch = PairCollator(tok, max_length=32)([ds["train"][i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["input_ids"].shape[1] <= 32
    assert batch["labels"].tolist() == ds["train"]["label"][:4]
    pad = batch["input_ids"][batch["attention_mask"] == 0]
    assert (pad == tok.pad_token_id).all()
    # padded up to a multiple: one shape for every batch here, the same tokens where the mask is 1
    rows = [ds["train"][i] for i in range(12)]
    plain = [PairCollator(tok, max_length=256)(rows[i:i + 4]) for i in range(0, 12, 4)]
    wide = [PairCollator(tok, max_length=256, pad_to_multiple_of=64)(rows[i:i + 4]) for i in range(0, 12, 4)]
    assert len({b["input_ids"].shape[1] for b in plain}) > 1, "the rows should give several lengths"
    for p, w in zip(plain, wide):
        assert w["input_ids"].shape[1] % 64 == 0 and w["input_ids"].shape[1] >= p["input_ids"].shape[1]
        assert w["input_ids"][w["attention_mask"] == 1].tolist() == p["input_ids"][p["attention_mask"] == 1].tolist()
        assert (w["input_ids"][w["attention_mask"] == 0] == tok.pad_token_id).all()
    for bad in (0, 100):  # 128 is not a multiple of 100: transformers would refuse the first batch
        with pytest.raises(ValueError, match="pad_to_multiple_of"):
            PairCollator(tok, max_length=128, pad_to_multiple_of=bad)
    loaders = [make_dataloader(ds["train"], tok, 8, rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == 300 // 2 // 8
    seen = [{tuple(x) for b in dl for x in b["input_ids"].tolist()} for dl in loaders]
    assert not seen[0] & seen[1]


def test_hub_branch_loads_a_local_repo_in_glue_layout(tmp_path, capsys):
    # nyu-mll/glue's layout: one folder per task, a parquet file per split, configs named in the README card
    sizes = {"train": 30, "validation": 6, "test": 4}
    rows = synthetic_mrpc(sizes, seed=7)  # generated rows only: MRPC's own may not be shipped
    for split, ds in rows.items():
        ds.to_parquet(str(tmp_path / "mrpc" / f"{split}-00000-of-00001.parquet"))
    card = ["---", "configs:", "- config_name: mrpc", "  data_files:"]
    card += [f"  - split: {s}\n    path: mrpc/{s}-*" for s in sizes] + ["---", ""]
    (tmp_path / "README.md").write_text("\n".join(card))
    capsys.readouterr()
    ds = load_mrpc(path=str(tmp_path), fallback=False)  # load_dataset(<dir>, "mrpc"), as for the Hub
    assert capsys.readouterr().err == ""  # no fallback announced
    assert {k: len(v) for k, v in ds.items()} == sizes
    assert ds["train"].features == rows["train"].features  # ClassLabel names, int32 idx
    assert ds["validation"][:] == rows["validation"][:]
    with pytest.raises(ValueError):  # a config the repository does not have is an error, not the fallback's data
        from datasets import load_dataset

        load_dataset(str(tmp_path), "sst2")


def test_no_import_cycle_data_holds_sharding_only():
    """kit/data.py is lesson 02's sharding; Hub access (hub.py) and MRPC (mrpc.py) never import the model module."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import ddp_lib.kit.data\n"
            "print(sorted(m for m in ('ddp_lib.apps.hub', 'ddp_lib.apps.mrpc', 'ddp_lib.apps.smollm2') if m in sys.modules))\n"
            "import ddp_lib.apps.mrpc\n"
            "print('ddp_lib.apps.smollm2' in sys.modules)\n"
            "import ddp_lib.kit.models\n"
            "print(hasattr(ddp_lib.kit.models, 'load_smollm2'))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["[]", "False", "False"]
