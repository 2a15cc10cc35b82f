"""ddp_lib.bench.timing off Linux: it imports without `resource` (Windows), reads macOS's ru_maxrss in
bytes, and returns NaN with a warning where no memory source exists, by simulating the missing pieces here."""

from __future__ import annotations

import builtins
import math
import subprocess
import sys
import types
import warnings

import pytest
import torch

from ddp_lib.bench import timing

CPU = torch.device("cpu")


@pytest.fixture
def no_proc(monkeypatch):
    """No /proc filesystem, as on macOS and Windows."""
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(timing, "_note", lambda message, _said=None: warnings.warn(message, RuntimeWarning),
                        raising=False)  # every note warns, not only the first of the process


def test_imports_and_measures_without_resource_and_proc():
    """Windows has no `resource` module and no /proc: import and call everything in a fresh interpreter."""
    code = """
import builtins, math, sys, warnings
sys.modules["resource"] = None  # `import resource` now raises ImportError, as on Windows
sys.modules["psutil"] = None    # and no psutil either
real_open = builtins.open
def fake_open(path, *a, **k):
    if str(path).startswith("/proc"):
        raise FileNotFoundError(path)
    return real_open(path, *a, **k)
builtins.open = fake_open
import torch
from ddp_lib.bench import timing
cpu = torch.device("cpu")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    timing.reset_peak_memory(cpu)
    peak, now = timing.peak_memory_mb(cpu), timing.current_memory_mb(cpu)
assert math.isnan(peak) and math.isnan(now), (peak, now)
assert any("psutil" in str(w.message) for w in caught), [str(w.message) for w in caught]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_macos_peak_is_read_in_bytes(no_proc, monkeypatch):
    """macOS: no /proc, and getrusage's ru_maxrss is in bytes (Linux: KiB)."""
    fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**30))
    monkeypatch.setattr(timing, "resource", fake)
    monkeypatch.setattr(timing.sys, "platform", "darwin")
    with pytest.warns(RuntimeWarning, match="since the process started"):
        timing.reset_peak_memory(CPU)
    assert timing.peak_memory_mb(CPU) == pytest.approx(3 * 1024)  # 3 GiB, not 3 TiB
    monkeypatch.setattr(timing.sys, "platform", "linux")
    assert timing.peak_memory_mb(CPU) == pytest.approx(3 * 2**30 / 1024)  # KiB there


def test_psutil_is_used_where_it_is_the_only_source(no_proc, monkeypatch):
    """Windows with psutil: its peak working set and resident set size, in MB."""
    info = types.SimpleNamespace(rss=200 * 2**20, peak_wset=300 * 2**20)
    fake_psutil = types.SimpleNamespace(Process=lambda: types.SimpleNamespace(memory_info=lambda: info))
    monkeypatch.setattr(timing, "resource", None)
    monkeypatch.setitem(sys.modules, "psutil", fake_psutil)
    assert timing.peak_memory_mb(CPU) == pytest.approx(300)
    assert timing.current_memory_mb(CPU) == pytest.approx(200)


def test_linux_reads_proc():
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only: reads /proc/self/status")
    peak, now = timing.peak_memory_mb(CPU), timing.current_memory_mb(CPU)
    assert 0 < now <= peak and not math.isnan(peak)


class _Cycle:
    """An object that only the cycle collector frees (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def test_free_memory_collects_only_what_reference_counting_left(monkeypatch):
    import gc
    import weakref

    calls = []
    collect = gc.collect
    monkeypatch.setattr(timing.gc, "collect", lambda *a: calls.append(a) or collect(*a))
    gc.disable()  # no automatic collection may free the cycle before free_memory is asked to
    try:
        plain, cyclic = torch.nn.Linear(2, 2), _Cycle()
        gone, held = [weakref.ref(plain)], [weakref.ref(cyclic)]
        del plain, cyclic
        timing.free_memory(torch.device("cpu"), gone)  # freed by reference counting: nothing to collect
        assert calls == [] and gone[0]() is None
        assert held[0]() is not None
        timing.free_memory(torch.device("cpu"), held)  # a cycle holds it: collected
        assert len(calls) == 1 and held[0]() is None
        timing.free_memory(torch.device("cpu"))  # nothing named: always collects, as before
        assert len(calls) == 2
    finally:
        gc.enable()


def test_tf32_matmuls_turns_cublas_tf32_on_for_a_cuda_device_only_and_restores_it():
    flag = torch.backends.cuda.matmul
    assert flag.allow_tf32 is False  # torch's default: fp32 matmuls in full fp32
    with timing.tf32_matmuls(CPU) as on:  # a CPU run: nothing changes
        assert on is False and flag.allow_tf32 is False
    with timing.tf32_matmuls(torch.device("cuda", 0)) as on:  # reads only the device's type: no GPU needed
        assert on is True and flag.allow_tf32 is True
        with timing.tf32_matmuls(torch.device("cuda", 0)):
            pass
        assert flag.allow_tf32 is True  # a nested timing leaves the outer one's setting
    assert flag.allow_tf32 is False
    # the CPU's own matmul precision is never touched (torch.set_float32_matmul_precision would reach it)
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"


def test_on_tf32_wraps_a_benchmark_in_tf32_matmuls_on_the_groups_device(monkeypatch):
    seen = []
    monkeypatch.setattr(timing.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(timing, "comm_device", lambda: torch.device("cuda", 0))
    bench = timing.on_tf32(lambda x: seen.append(torch.backends.cuda.matmul.allow_tf32) or x)
    assert bench(3) == 3 and seen == [True] and torch.backends.cuda.matmul.allow_tf32 is False
    monkeypatch.setattr(timing, "comm_device", lambda: CPU)
    bench(4)
    assert seen == [True, False]
