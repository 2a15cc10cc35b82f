"""ddp_lib.apps.resume's one commit point: a save killed before rank 0 renames state.pt leaves the previous
state.pt and the shards it names untouched, never a mix of two steps (a ZeRO-1 optimizer's shards here)."""

import pathlib

import torch

from ddp_lib.launch import spawn


def _save_twice_and_load(directory: str) -> dict:
    import torch.distributed as dist

    from ddp_lib.apps import resume
    from ddp_lib.zero import ShardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def train_step():
        model(torch.ones(4, 8)).sum().backward()  # the same gradient on both ranks: no wrapper needed
        opt.step()
        opt.zero_grad()

    seen = {}
    real_replace = pathlib.Path.replace

    def commit(self, target):  # rank 0's rename of state.pt.tmp: what a kill just before it would leave
        if self.name == f"{resume.STATE_FILE}.tmp":
            committed = torch.load(pathlib.Path(directory) / resume.STATE_FILE, weights_only=False)
            folder = pathlib.Path(directory) / committed["shards"]
            seen[committed["step"]] = dict(names=sorted(p.name for p in pathlib.Path(directory).iterdir()),
                                           shards=committed["shards"],
                                           own=[torch.load(folder / f"rank{r:05d}-of-00002.pt", weights_only=False)
                                                ["optimizer"]["shard"]["state"] for r in range(2)])
        return real_replace(self, target)

    train_step()
    resume.save_checkpoint(directory, model, None, opt, sched, 1)
    train_step()
    if dist.get_rank() == 0:
        pathlib.Path.replace = commit
    try:
        resume.save_checkpoint(directory, model, None, opt, sched, 2)
    finally:
        pathlib.Path.replace = real_replace
    fresh = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    state = resume.load_checkpoint(directory, model, None, fresh, torch.optim.lr_scheduler.LambdaLR(fresh, lambda s: 1.0))
    steps = [float(s["step"]) for s in fresh.state_dict()["shard"]["state"].values()]
    return dict(seen=seen, step=state["step"], shards=state["shards"], adam_steps=steps,
                names=sorted(p.name for p in pathlib.Path(directory).iterdir()))


def test_a_save_killed_before_its_commit_leaves_the_previous_checkpoint_whole(tmp_path):
    r0, r1 = spawn(_save_twice_and_load, 2, args=(str(tmp_path / "ckpt"),), timeout_s=120)
    before = r0["seen"][1]  # the folder as it stood just before step 2's commit
    assert before["shards"].startswith("step00000001-")
    assert before["shards"] in before["names"] and len([n for n in before["names"] if n.startswith("step")]) == 2
    # step 1's shards were still the ones written at step 1: AdamW had stepped once on every parameter they hold
    assert all(float(s["step"]) == 1.0 for own in before["own"] for s in own.values()) and all(before["own"])
    for r in (r0, r1):  # after the commit: step 2, its own folder, step 1's removed
        assert r["step"] == 2 and r["shards"].startswith("step00000002-") and r["adam_steps"]
        assert all(s == 2.0 for s in r["adam_steps"])
        assert r["names"] == sorted(["state.pt", r["shards"]])
