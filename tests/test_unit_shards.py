"""CI's CUDA-build leg can run the unit suite a shard per run (`--unit-shard K/N`, tests/conftest.py): the shards
split the test files, each file in exactly one shard, the longest files spread over the shards."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import LONGEST_FILES, shard_files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_shards_split_the_files_each_once():
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    for n in (1, 2, 3, 5):
        shards = shard_files(files, n)
        flat = [f for s in shards for f in s]
        assert sorted(flat) == files and len(flat) == len(set(flat)), n
        assert all(shards), n


def test_the_longest_files_go_to_different_shards():
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    longest = [f for f in LONGEST_FILES if f in files][:3]
    shards = shard_files(files, 3)
    assert sorted(next(i for i, s in enumerate(shards) if f in s) for f in longest) == [0, 1, 2]


def _ci_selection(*overrides: str) -> list[str]:
    """The arguments `make test-cuda-build-ci` hands pytest (make -n: nothing installed, nothing run)."""
    import shlex
    import subprocess

    out = subprocess.run(["make", "-s", "-n", "test-cuda-build-ci", "JOBS=0", "VENV_CU=/nonexistent", *overrides],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = out[out.index("pytest -p no:xdist"):].replace("\\\n", " ").splitlines()[0]
    return shlex.split(line)[3:]


def test_ci_runs_the_core_and_a_fifth_and_the_five_fifths_cover_every_test_file():
    args = _ci_selection()
    assert "--unit-shard" in args and args[args.index("--unit-shard") + 1] == "auto/5"
    keep = {args[i + 1] for i, a in enumerate(args) if a == "--unit-shard-keep"}
    assert {"tests/test_gpu_simulated.py", "tests/test_gpusim.py", "tests/test_torch_range.py"} <= keep
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    rest = [f for f in files if f not in keep]
    assert sorted({f for s in shard_files(rest, 5) for f in s} | keep) == files
    assert "--unit-shard" not in _ci_selection("CUDA_CI_SHARD=core")
    assert "--unit-shard" not in _ci_selection("CUDA_CI_SHARD=all") and "tests" in _ci_selection("CUDA_CI_SHARD=all")
