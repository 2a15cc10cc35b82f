"""python -m ddp_lib.train_mrpc offline on 2 gloo ranks: the loss falls, accuracy is measured, profiling works."""

import pytest

from ddp_lib import train_mrpc
from ddp_lib.launch import spawn


def test_two_rank_training_loss_falls_with_accumulation_and_profile(tmp_path):
    cfg = train_mrpc.TrainConfig(ddp="bucketed", max_steps=20, accum=2, batch_size=16, train_size=512,
                                 val_size=128, max_length=48, profile=2, out=str(tmp_path), packaged=False)
    r0, r1 = spawn(train_mrpc.train, world_size=2, args=(cfg,), timeout_s=240)
    losses = r0["losses"]
    assert losses == r1["losses"] and len(losses) == 20  # the global mean, agreed by both ranks
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.03, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert r0["source"] == "random-small" and r0["global_batch"] == 64 and not r0["bf16"]
    assert r0["val_pairs"] == 128 and r0["val_accuracy"] == _single_process_accuracy(tmp_path / "checkpoint.pt")
    p = r0["profile"]
    assert 0 < p["comm_share"] < 1 and p["comm_ms"] > 0 and "Self CPU" in p["operator_table"]
    assert (tmp_path / "trace_rank0.json").exists() and (tmp_path / "trace_rank1.json").exists()
    assert (tmp_path / "step_breakdown.png").exists()


def _single_process_accuracy(checkpoint) -> float:
    """The validation accuracy of rank 0's checkpoint, recomputed in this process without any collective."""
    import torch

    from ddp_lib.mrpc import PairCollator, load_mrpc
    from ddp_lib.smollm2 import load_smollm2

    model, tok = load_smollm2(packaged=False, verbose=False)
    model.load_state_dict(torch.load(checkpoint)["model"])
    rows = load_mrpc({"train": 512, "validation": 128, "test": 0}, verbose=False)["validation"]
    batch = PairCollator(tok, max_length=48)(list(rows))
    with torch.no_grad():
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    return (pred == batch["labels"]).double().mean().item()


def test_cli_flags_map_to_the_config():
    cfg = train_mrpc.parse_args(["--ddp", "flat", "--accum", "4", "--max-steps", "7", "--no-bf16", "--lr", "0.01"])
    assert (cfg.ddp, cfg.accum, cfg.max_steps, cfg.bf16, cfg.lr) == ("flat", 4, 7, False, 0.01)
    with pytest.raises(SystemExit):
        train_mrpc.parse_args(["--ddp", "torch"])
