"""The simulated GPU box (ddp_lib.gpusim) catches, on purpose, each class of defect a real GPU box raises, and runs
the course's engines and torch DDP on cuda:0/cuda:1 under the simulated NCCL, matching single-process training.

One subprocess with DDP_GPU_SIM=2xT4 (the simulation must be installed before torch is imported, so never in
pytest's own process) runs tests/gpusim_cases.py: single-process checks, then 2 ranks from ddp_lib.launch.spawn.
"""

from __future__ import annotations


import pytest

from sim_box import sim_result

NCCL_CPU = "RuntimeError: No backend type associated with device type cpu"  # ProcessGroup::getBackend's text


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> dict:
    """Run the cases once on a simulated 2xT4 box; their results, as printed on the last line."""
    tmp = tmp_path_factory.mktemp("gpusim")
    code = "import ddp_lib, gpusim_cases, sys; gpusim_cases.main(sys.argv[1])"  # ddp_lib first: the sim, then torch
    return sim_result(code, str(tmp), timeout_s=400)


@pytest.mark.gpusim
def test_a_cpu_tensor_in_an_nccl_all_reduce_raises_nccls_error(sim):
    assert [r["defects"]["cpu_allreduce"] for r in sim["ranks"]] == [NCCL_CPU, NCCL_CPU]


@pytest.mark.gpusim
def test_a_cpu_model_wrapped_by_bucketed_ddp_on_cuda_1_raises(sim):
    # rank 1 computes on cuda:1; its CPU model's first collective (the broadcast of rank 0's state) is refused
    rank1 = sim["ranks"][1]["defects"]
    assert rank1["device"] == "cuda:1" and rank1["cpu_model_wrapped"] == NCCL_CPU


@pytest.mark.gpusim
def test_a_mixed_device_op_raises_as_cuda_does(sim):
    p = sim["process"]
    assert p["mixed"] == ("RuntimeError: Expected all tensors to be on the same device, but found at least two "
                          "devices, cuda:0 and cpu!")
    assert p["two_gpus"].endswith("found at least two devices, cuda:0 and cuda:1!")
    assert p["scalar_ok"] == "cuda:0"  # a 0-dim CPU tensor joins a CUDA op, as on a GPU
    assert p["deepcopy"] == [("cuda:1", True, True)]  # copy.deepcopy(model) stays on its GPU, parameters intact
    assert p["inplace_view"] == ((1, 3, 2), (1, 3, 2), "cuda:0")
    assert p["resized"] == ((6,), [0, 1, 2], (6,), "cuda:0")  # resize_ grows a CUDA tensor with its data
    # torch.Tensor.__deepcopy__ itself (new_empty([]) then set_ to a copied storage) cannot reshape the wrapper:
    # refused, never a silently 0-dim copy
    assert p["base_deepcopy"].startswith("RuntimeError: not simulated: aten.set_.source_Storage_storage_offset")


@pytest.mark.gpusim
def test_a_checkpoint_from_rank_0s_gpu_loaded_unmapped_on_rank_1_lands_on_cuda_0(sim):
    rank1 = sim["ranks"][1]["defects"]
    assert rank1["checkpoint_unmapped"].endswith("found at least two devices, cuda:0 and cuda:1!")
    assert rank1["checkpoint_mapped"] == "cuda:1"
    assert rank1["object_device"] == "cuda:0"  # broadcast_object_list unpickles onto the saving rank's GPU


@pytest.mark.gpusim
def test_setting_data_gives_the_new_data_as_on_a_gpu(sim):
    seen, p, flat, q = sim["process"]["data_set"]
    assert seen == ((5,), "cuda:0", 20.0, [2.0, 3.0, 4.0, 5.0, 6.0])  # the view's shape and data, not zeros
    assert p == [6.0, 8.0, 10.0, 12.0, 14.0] and flat == [1.0, 2.0, 6.0, 8.0, 10.0, 12.0, 14.0, 8.0, 9.0, 10.0]
    assert q == ("cuda:1", [1.0, 1.0, 1.0, 1.0])


@pytest.mark.gpusim
def test_a_collection_inside_the_memory_lock_neither_deadlocks_nor_loses_a_release(sim):
    # the tensor in the cycle (4096 B) is released: only the new one (256 floats, 1024 B) stays counted
    assert sim["collection_inside_track"] == {"deadlock": False, "held": 4096, "after": 1024}


@pytest.mark.gpusim
def test_an_allocation_past_a_t4s_memory_raises_out_of_memory(sim):
    p = sim["process"]
    assert p["oom"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB. GPU 1")
    assert p["props"] == ("Tesla T4", (7, 5)) and p["count"] == 2
    assert p["bf16"] == (True, False)  # torch.cuda.is_bf16_supported on sm_75: emulated only
    # the CUDA generator as DTensor's RNG tracker reads it: (seed, offset), 16 bytes; the offset moves by 8 (6 draws,
    # rounded up to 4), restoring the state repeats the draws (it once returned the CPU generator's 5056 bytes)
    assert p["rng"] == ((16,), [7, 0], [7, 8], True, "cuda:1")
    assert p["distinct"] and p["compile"] == (True, True)  # compiling torch DDP once stopped lesson 05 (cell 50)


@pytest.mark.gpusim
def test_the_profiler_records_cuda_events_per_op(sim):
    # a CPU build's profiler asked for CUDA takes the legacy CUDA-event path (torch/autograd/profiler.py,
    # KINETO_GPU_FALLBACK); its default CUDA methods throw per op (lesson 08's profiled FSDP step seemed to hang)
    assert sim["process"]["profiler"] == (True, True)


@pytest.mark.gpusim
def test_nccl_semantics_of_the_collectives(sim):
    for rank, r in enumerate(sim["ranks"]):
        d = r["defects"]
        assert d["avg"] == [1.5] * 4  # AVG of 1 and 2
        assert (d["completed_after_wait"], d["completed_after_sync"]) == (False, True)
        assert d["gather_scatter"] == ([0.0, 0.0, 1.0, 1.0], [2 * 2.0 * rank, 2 * (2.0 * rank + 1)])
        assert d["p2p"] == [float(1 - rank)] * 2
        assert d["monitored_barrier"] == "ValueError: monitored_barrier is only implemented for GLOO backend."
        assert d["bound"] == (f"cuda:{rank}", [])  # %dist_init's device_id, kept: barrier does not warn
        assert d["mesh"] == (True, [2.0, 2.0], 1, f"cuda:{rank}")  # split from the bound group, as NCCL splits
        assert d["memory"]
        # all_reduce, broadcast and barrier: three collectives on the default group, as %%rank's check counts them
        assert d["issued"] == {"the default group": 3}


@pytest.mark.gpusim
def test_engines_and_torch_ddp_train_on_cuda_under_nccl_sim_as_one_process(sim):
    for r in sim["ranks"]:
        # torch DDP also with find_unused_parameters=True and static_graph=True (pinned host memory in the reducer)
        assert set(r["engines"]) == {"naive", "bucketed", "fsdp", "torch", "torch_unused", "torch_static"}
        assert all(diff < 1e-5 for diff in r["engines"].values()), r["engines"]


@pytest.mark.gpusim
def test_bucketed_ddp_keeps_one_hook_per_bucket_on_a_simulated_gpu(sim):
    """A view of a simulated CUDA buffer shares its version counter too: the count adds up, no fallback."""
    for r in sim["ranks"]:
        hooks = r["bucket_hooks"]
        assert hooks["per_bucket"] and hooks["hooks"] == hooks["buckets"], hooks


def test_the_shim_is_cached_per_torch_folder(tmp_path, monkeypatch):
    # the shim reaches libc10 through an rpath to the torch that built it: one built by another venv (a deleted
    # worktree or clone) failed to load with "libc10.so: cannot open shared object file"
    from ddp_lib.gpusim import _guard

    monkeypatch.setenv("DDP_GPU_SIM_CACHE", str(tmp_path / "cache"))
    folders = [tmp_path / "a" / "torch", tmp_path / "b" / "torch"]
    for folder in folders:
        folder.mkdir(parents=True)
        (folder / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda = None\n")
    a, b = (_guard.shim_path(f) for f in folders)
    assert a != b and a.parent == b.parent == tmp_path / "cache"
    assert _guard.shim_path(folders[0]) == a  # stable for one folder: built once


def test_processes_starting_together_compile_the_shim_once(tmp_path, monkeypatch):
    # CI runs the simulated lessons beside the suite's test_gpusim, and a kernel starts its ranks at once: the first
    # build is awaited, not repeated (a fake compiler counts its runs and takes its time, so the others do arrive)
    import threading

    from ddp_lib.gpusim import _guard

    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda = None\n")
    fake = tmp_path / "c++"
    fake.write_text('#!/bin/sh\necho run >> "$(dirname "$0")/runs"\nsleep 1\n'
                    'while [ "$1" != -o ]; do shift; done\necho so > "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("DDP_GPU_SIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_guard, "_torch_dir", lambda: folder)
    built: list = []
    threads = [threading.Thread(target=lambda: built.append(_guard.build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 3 and len(set(built)) == 1 and built[0].read_text() == "so\n"
    assert (tmp_path / "runs").read_text() == "run\n"


@pytest.mark.gpusim
def test_the_race_times_its_steps_with_tf32_matmuls_and_reports_mfu_against_the_cards_peak(sim):
    for r in sim["ranks"]:
        race = r["race"]
        # on for the race's steps on a CUDA device, off again after it (torch's default; a CPU run never turns it on)
        assert race["tf32_in_steps"] == [True] and race["tf32_after"] is False
        # a T4 is sm_75, without TF32: its FP32 datasheet peak; toy's 2.29 MFLOP a step (tests/test_bench.py)
        assert race["peak_flops"] == 8.1e12 and race["flops_per_step"] == 2_293_760
        head, *lines = race["table"].splitlines()
        assert head.split()[-3:] == ["smp/s", "MFU", "param_diff"]
        assert lines[-1] == "MFU against each rank's T4 fp32 dense datasheet peak, 8.1 TFLOP/s"
        assert all(line.split()[-2].endswith("%") for line in lines[:-1])  # a number for every variant
