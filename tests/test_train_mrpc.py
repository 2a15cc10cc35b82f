"""python -m ddp_lib.apps.train_mrpc offline on 2 gloo ranks: the loss falls, accuracy is measured, profiling works,
a stopped job resumes bit for bit, and the flags come from the config's annotations and ENGINES."""

import random

import pytest
import torch

from ddp_lib.apps import train_mrpc
from ddp_lib.launch import spawn

STEPS, MAX_LEN = 12, 32  # the random-small model's loss falls by about 0.07 over 12 steps of 32 token pairs


def _train_then_resumes(cfg, resume_cfgs):
    """On the same 2 ranks: the profiled training run, then the resume runs (`_all_final_params`). One spawn
    instead of two: each rank's first run imports transformers and datasets (about 5 CPU s a rank)."""
    return train_mrpc.train(cfg), _all_final_params(resume_cfgs)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' (train result, resume results), and the training run's output folder."""
    out = tmp_path_factory.mktemp("train")
    cfg = train_mrpc.TrainConfig(ddp="bucketed", max_steps=STEPS, accum=2, batch_size=16, train_size=512,
                                 val_size=128, max_length=MAX_LEN, profile=2, out=str(out), packaged=False)
    runs = spawn(_train_then_resumes, world_size=2, args=(cfg, _resume_configs(tmp_path_factory.mktemp("resume"))),
                 timeout_s=600, backend="gloo")
    return runs, out


def test_two_rank_training_loss_falls_with_accumulation_and_profile(ranks):
    (r0, _), (r1, _) = ranks[0]
    tmp_path = ranks[1]
    losses = r0["losses"]
    assert losses == r1["losses"] and len(losses) == STEPS  # the global mean, agreed by both ranks
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.03, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert r0["source"] == "random-small" and r0["global_batch"] == 64 and not r0["bf16"]
    state = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=False)
    assert state["step"] == STEPS and state["optimizer"]["state"]  # resumable: the AdamW moments are in it
    assert r0["val_pairs"] == 128 and r0["val_accuracy"] == _single_process_accuracy(state["model"])
    p = r0["profile"]
    assert 0 < p["comm_share"] < 1 and p["comm_ms"] > 0 and "Self CPU" in p["operator_table"]
    assert (tmp_path / "trace_rank0.json").exists() and (tmp_path / "trace_rank1.json").exists()
    assert (tmp_path / "step_breakdown.png").exists()


def _single_process_accuracy(weights) -> float:
    """The validation accuracy of rank 0's checkpoint, recomputed in this process without any collective."""
    from ddp_lib.apps.mrpc import PairCollator, load_mrpc
    from ddp_lib.apps.smollm2 import load_smollm2

    model, tok = load_smollm2(packaged=False, verbose=False)
    model.load_state_dict(weights)
    rows = load_mrpc({"train": 512, "validation": 128, "test": 0}, verbose=False)["validation"]
    batch = PairCollator(tok, max_length=MAX_LEN)(list(rows))
    with torch.no_grad():
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    return (pred == batch["labels"]).double().mean().item()


def _final_params(cfg):
    """Run train(cfg) on this rank, then return the losses and this rank's parameters (for comparison)."""
    import torch.distributed as dist

    out = train_mrpc.train(cfg)
    state = torch.load(f"{cfg.out}/checkpoint/state.pt", weights_only=False)
    own = None
    if state["optimizer"] is None:  # ZeRO-1: this rank's shard is in its own file
        own = torch.load(f"{cfg.out}/checkpoint/{state['shards']}/rank{dist.get_rank():05d}-of-00002.pt",
                         weights_only=False)  # in the folder this save's state.pt names
    return out["losses"], state["model"], own, torch.get_rng_state(), random.getstate()


def _resume_configs(root) -> list:
    """For AdamW and ZeRO-1: a straight run of 6 steps, and the same run stopped at step 3 then resumed."""
    runs = []
    for zero1 in (False, True):
        kw = dict(ddp="bucketed", max_steps=6, accum=2, batch_size=4, train_size=48, val_size=8, max_length=32,
                  packaged=False, zero1=zero1, warmup=0.5)
        name = "zero1" if zero1 else "adamw"
        runs += [train_mrpc.TrainConfig(**kw, out=str(root / name / "straight")),
                 train_mrpc.TrainConfig(**kw, out=str(root / name / "split"), stop_at=3),
                 train_mrpc.TrainConfig(**kw, out=str(root / name / "split"), resume=True)]
    # then resumes the checkpoint must refuse (after the ZeRO-1 split run, which ended at step 6): other settings
    # would replay or skip batches; a --stop-at before its step would overwrite it with a wrong step
    kw.update(zero1=True, out=str(root / "zero1" / "split"), resume=True)
    runs += [train_mrpc.TrainConfig(**{**kw, "accum": 1}), train_mrpc.TrainConfig(**kw, stop_at=2)]
    return runs


def _draw(module, args) -> None:
    """A forward pre-hook on every module: one draw from torch's and one from Python's generator, as dropout or
    augmentation would make (the random-small model has no dropout: without draws a lost RNG state never shows)."""
    torch.rand(1)
    random.random()


def _all_final_params(cfgs):
    """Every run one after another in the same ranks (one spawn instead of six). Before each, the RNGs are moved
    somewhere else, as a fresh process would find them, and every step draws from them, so a resume that forgot to
    restore one ends with other states than the straight run."""
    out = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(_draw)
    try:
        for i, cfg in enumerate(cfgs):
            random.seed(1000 + i)
            torch.manual_seed(1000 + i)
            try:
                out.append(_final_params(cfg))
            except ValueError as err:  # the refused resumes: every rank raises the same, after the same collectives
                out.append(str(err))
    finally:
        handle.remove()
    return out


@pytest.fixture(scope="module")
def resumed(ranks):
    runs = [resume for _, resume in ranks[0]]  # run by `ranks`, after its training run, on the same 2 ranks
    # per rank: straight, first, second; then the two refused resumes
    return {"adamw": [r[:3] for r in runs], "zero1": [r[3:6] for r in runs], "refused": [r[6:] for r in runs]}


def test_a_resume_under_other_settings_or_before_its_step_is_refused(resumed):
    for other_accum, early_stop in resumed["refused"]:
        assert "written with other settings (accum 2 -> 1)" in other_accum, other_accum
        assert "--stop-at 2 is before the step" in early_stop and "(6)" in early_stop, early_stop


@pytest.mark.parametrize("zero1", [False, True], ids=["adamw", "zero1"])
def test_stop_and_resume_equals_one_straight_run_bit_for_bit(resumed, zero1):
    for rank, (a, b, c) in enumerate(resumed["zero1" if zero1 else "adamw"]):
        assert b[0] + c[0] == a[0] and len(a[0]) == 6  # the same losses, step by step
        assert a[1].keys() == c[1].keys()
        assert all(torch.equal(a[1][k], c[1][k]) for k in a[1]), "weights differ after resume"
        assert not all(torch.equal(b[1][k], c[1][k]) for k in b[1])  # it did train on
        if zero1:  # each rank's optimizer shard, equal to the straight run's
            sa, sc = a[2]["optimizer"]["shard"]["state"], c[2]["optimizer"]["shard"]["state"]
            assert sa.keys() == sc.keys() and sa
            assert all(torch.equal(sa[i][k], sc[i][k]) for i in sa for k in sa[i])
        assert torch.equal(a[3], c[3]), "torch's RNG stream did not go on where it was"
        assert a[4] == c[4], "Python's RNG stream did not go on where it was"


def test_clip_uses_the_engines_own_clip_grad_norm_when_it_has_one(tmp_path, monkeypatch):
    from ddp_lib.ddp import ENGINES, BucketedDDP

    class ClippingDDP(BucketedDDP):
        calls = 0

        def clip_grad_norm_(self, max_norm):  # FSDP's kind: the norm over all ranks' shards
            type(self).calls += 1
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    monkeypatch.setitem(ENGINES, "clipping", ClippingDDP)
    cfg = train_mrpc.TrainConfig(ddp="clipping", max_steps=2, batch_size=4, train_size=32, val_size=8,
                                 max_length=32, packaged=False, out=str(tmp_path), checkpoint=False)
    torch_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: pytest.fail("per-rank torch clip used although the engine clips"))
    monkeypatch.setattr(ClippingDDP, "clip_grad_norm_",
                        lambda self, max_norm: (setattr(type(self), "calls", type(self).calls + 1),
                                                torch_clip(self.module.parameters(), max_norm))[1])
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train_mrpc.train(cfg)
    finally:
        dist.destroy_process_group()
    assert ClippingDDP.calls == 2


def test_cli_flags_map_to_the_config():
    cfg = train_mrpc.parse_args(["--ddp", "flat", "--accum", "4", "--max-steps", "7", "--no-bf16", "--lr", "0.01",
                                 "--resume", "--save-every", "5", "--zero1"])
    assert (cfg.ddp, cfg.accum, cfg.max_steps, cfg.bf16, cfg.lr) == ("flat", 4, 7, False, 0.01)
    assert (cfg.resume, cfg.save_every, cfg.zero1, cfg.model_id) == (True, 5, True, None)
    with pytest.raises(SystemExit):
        train_mrpc.parse_args(["--ddp", "torch"])


def test_cli_reads_engines_and_never_evals_types(monkeypatch):
    import builtins

    from ddp_lib.ddp import ENGINES, NaiveDDP

    monkeypatch.setattr(builtins, "eval", lambda *a, **k: pytest.fail("parse_args called eval"))
    monkeypatch.setitem(ENGINES, "my-engine", NaiveDDP)
    assert train_mrpc.parse_args(["--ddp", "my-engine"]).ddp == "my-engine"
