"""check_meta_init's mutation suite on 2 gloo ranks: FSDP built on the meta device written right (three ways) passes,
a stub reads "not written yet", and each mistake lesson 08 warns about fails one property, with its diagnosis."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from ddp_lib.torch_fsdp.meta_device import seeded_init_, sharded_on_meta
from ddp_lib.launch import spawn

SHARDED = "sharded, allocated on the device"
NO_FULL = "no rank allocated a full parameter"
EQUAL = "equal to the seeded full initialisation"


def _shard(model: nn.Module, mesh) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _meta(make):
    with torch.device("meta"):
        return make()


# ---------------------------------------------------------------- right answers
def right(make, mesh, seed):
    return sharded_on_meta(make, mesh, seed)


def right_root_only(make, mesh, seed):  # one group for every parameter: still Shard(0), still never full
    model = _meta(make)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=torch.device(mesh.device_type))
    return seeded_init_(model, seed)


def right_per_module_to_empty(make, mesh, seed):  # allocate module by module, keep gathered weights after forward
    model = _meta(make)
    for m in reversed(list(model.modules())):
        if isinstance(m, nn.Linear) or m is model:
            fully_shard(m, mesh=mesh, reshard_after_forward=m is not model)
    for m in model.children():
        m.to_empty(device="cpu")
    seeded_init_(model, seed)
    return model


# ---------------------------------------------------------------- planted mistakes
def materialised_first(make, mesh, seed):  # the habit this step replaces: the full model on every rank
    model = make()
    _shard(model, mesh)
    return seeded_init_(model, seed)


def to_empty_before_shard(make, mesh, seed):
    model = _meta(make).to_empty(device="cpu")
    _shard(model, mesh)
    return seeded_init_(model, seed)


def no_init(make, mesh, seed):
    model = _meta(make)
    _shard(model, mesh)
    return model.to_empty(device="cpu")


def reset_parameters_on_shards(make, mesh, seed):  # torch's recipe, on CPU: every rank draws the same numbers
    model = _meta(make)
    _shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    return model


def seed_plus_rank(make, mesh, seed):  # other numbers on each rank, still not the full model's
    return reset_parameters_on_shards(make, mesh, seed + dist.get_rank())


def seed_ignored(make, mesh, seed):
    model = _meta(make)
    _shard(model, mesh)
    return seeded_init_(model.to_empty(device="cpu"), 0)


def never_sharded(make, mesh, seed):
    return seeded_init_(_meta(make).to_empty(device="cpu"), seed)


def left_on_meta(make, mesh, seed):
    model = _meta(make)
    _shard(model, mesh)
    return seeded_init_(model, seed)


def stub(make, mesh, seed):
    raise NotImplementedError("your turn")


CASES = {  # name: (function, the property it fails, words of its diagnosis)
    "right: the package": (right, None, ""), "right: root only": (right_root_only, None, ""),
    "right: module by module": (right_per_module_to_empty, None, ""),
    "materialised first": (materialised_first, NO_FULL, "a full parameter existed here"),
    "to_empty before fully_shard": (to_empty_before_shard, NO_FULL, "a full parameter existed here"),
    "no init after to_empty": (no_init, EQUAL, "never written after they were allocated"),
    "reset_parameters on the shards": (reset_parameters_on_shards, EQUAL, "this rank's generator"),
    "reset_parameters, seed + rank": (seed_plus_rank, EQUAL, "this rank's generator"),
    "seed ignored": (seed_ignored, EQUAL, "pass `seed`"),
    "never sharded": (never_sharded, SHARDED, "not a DTensor"),
    "left on the meta device": (left_on_meta, SHARDED, "still on the meta device"),
}


def run_suite() -> dict:
    from ddp_lib.check.meta_init import check_meta_init

    out, seconds = {}, {}
    for name, (fn, _, _) in list(CASES.items()) + [("stub", (stub, None, ""))]:
        t0 = time.monotonic()
        res = check_meta_init(fn, timeout_s=20)
        seconds[name] = time.monotonic() - t0
        out[name] = {r.name: (r.status, r.detail, r.hint) for r in res.rows}
    out["seconds"] = seconds
    return out


def test_mutations_on_two_ranks():
    from _mutations import assert_one_diagnosis, assert_suites_big_enough

    ranks = spawn(run_suite, world_size=2, timeout_s=240)
    mistakes = [("meta", name) for name, (_, prop, _) in CASES.items() if prop is not None]
    assert_suites_big_enough({"meta": list(CASES)}, mistakes)
    for out in ranks:
        for name, (_, prop, words) in CASES.items():
            rows = out[name]
            if prop is None:
                assert {s for s, _, _ in rows.values()} == {"PASS"}, (name, rows)
            else:
                table = "\n".join(f"{k}: {v}" for k, v in rows.items())
                assert_one_diagnosis({"rows": rows, "table": f"{name}\n{table}"}, prop, words)
        assert {s for s, _, _ in out["stub"].values()} == {"not written yet", "not checked"}
        assert max(out["seconds"].values()) < 60, out["seconds"]  # a check ends within a minute


# ---------------------------------------------------------------- tied embeddings (check_meta_init(tied=True))
TIED = "tied weights: one parameter, one FSDP group"
APART = "already managed by another FSDP group"  # fully_shard's own words, 2.13 and 2.15 alike


def tied_by_hand(make, mesh, seed):  # the tied pair as one group, then the other Linear, then the root
    model = _meta(make)
    fully_shard([model.embed, model.out], mesh=mesh)
    fully_shard(model.mid, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=torch.device(mesh.device_type))
    return seeded_init_(model, seed)


def tied_each_linear(make, mesh, seed):  # the untied recipe: out (a Linear) gets a group, embed goes to the root
    model = _meta(make)
    _shard(model, mesh)
    return seeded_init_(model.to_empty(device="cpu"), seed)


def tied_each_module_apart(make, mesh, seed):
    model = _meta(make)
    for m in (model.embed, model.out, model.mid, model):
        fully_shard(m, mesh=mesh)
    return seeded_init_(model.to_empty(device="cpu"), seed)


TIED_CASES = {
    "right: the package": (right, None), "right: root only": (right_root_only, None),
    "right: the pair by hand": (tied_by_hand, None),
    "each Linear apart": (tied_each_linear, TIED), "each module apart": (tied_each_module_apart, TIED),
}


def run_tied_suite() -> dict:
    from ddp_lib.check.meta_init import check_meta_init

    return {name: {r.name: (r.status, r.detail, r.hint) for r in check_meta_init(fn, timeout_s=20, tied=True).rows}
            for name, (fn, _) in TIED_CASES.items()}


def test_tied_embeddings_pass_grouped_and_fail_apart_with_torchs_words():
    from _mutations import assert_one_diagnosis

    for out in spawn(run_tied_suite, world_size=2, timeout_s=240):
        for name, (_, prop) in TIED_CASES.items():
            rows = out[name]
            if prop is None:
                assert {s for s, _, _ in rows.values()} == {"PASS"}, (name, rows)
            else:
                table = "\n".join(f"{k}: {v}" for k, v in rows.items())
                assert_one_diagnosis({"rows": rows, "table": f"{name}\n{table}"}, prop, APART)


def test_tied_weights_side_by_side_fsdp_and_fully_shard_on_this_torch():
    from ddp_lib.torch_fsdp.tied import tied_side_by_side

    for out in spawn(tied_side_by_side, world_size=2, backend="gloo", timeout_s=240):
        assert out["tied"] == {"ours": True, "fully_shard": True}, out
        assert max(abs(a - b) for a, b in zip(out["ours"], out["fully_shard"])) < 1e-4, out
        assert out["ours"][-1] < out["ours"][0] and out["max_param_diff"] < 1e-5, out
        assert out["apart_error"] and APART in out["apart_error"] and "fully_shard([module_a, module_b])" in \
            out["apart_error"], out


def test_tied_groups_finds_the_shared_modules_once():
    from ddp_lib.torch_fsdp.tied import tied_groups
    from ddp_lib.kit.models import TiedModel, TransformerLM, ToyModel

    m = TiedModel()
    assert tied_groups(m) == [[m.embed, m.out]]
    lm = TransformerLM("tiny")
    assert tied_groups(lm) == [[lm.tok, lm.lm_head]]
    assert tied_groups(ToyModel(4, 8, 2)) == []
