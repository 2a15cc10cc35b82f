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
