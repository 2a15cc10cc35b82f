"""The C++ shim: a device guard for `DeviceType::CUDA`, so libtorch believes CUDA devices exist.

A CPU build of torch registers no guard for CUDA; autograd, `DeviceGuard` and the DDP reducer ask for one and abort
the process with "PyTorch is not linked with support for cuda devices" (c10/core/impl/DeviceGuardImplInterface.h,
`getDeviceGuardImpl`). This guard (modelled on c10/core/impl/FakeGuardImpl.h) keeps a current device per thread,
reports the profile's device count, and treats every stream and event as complete; and a timer for torch DDP's
reducer on CUDA (torch/csrc/distributed/c10d/reducer_timer.hpp), which a CPU build lacks. It includes c10 headers only
(no torch/extension.h), is compiled once with the system C++ compiler into a cache folder, and loaded with ctypes
before torch is imported. It also registers CUDA hooks (ATen/detail/CUDAHooksInterface.h) that say CUDA is present:
`at::getAccelerator`, which autograd asks, reads them, and `getCUDAHooks()` keeps the first hooks it finds. The hooks
also hand out "pinned" host memory (CPU memory whose blocks are remembered, so `is_pinned()` is true for it only):
torch DDP's reducer on CUDA with find_unused_parameters or static_graph allocates pinned memory and asserts it.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>
#include <torch/csrc/profiler/stubs/base.h>
#include <c10/util/ApproximateClock.h>
#include <chrono>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
namespace {
using namespace c10;
using namespace c10::impl;
std::atomic<int> g_count{0};
thread_local DeviceIndex g_current = 0;
thread_local std::array<StreamId, 64> g_streams{};
struct SimCudaGuard final : public DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, g_current); g_current = d.index(); return old; }
  Device getDevice() const override { return Device(DeviceType::CUDA, g_current); }
  void setDevice(Device d) const override { g_current = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { g_current = d.index(); }
  Stream getStream(Device d) const noexcept override { return Stream(Stream::UNSAFE, d, g_streams[d.index()]); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override {
    auto old = g_streams[s.device_index()]; g_streams[s.device_index()] = s.id();
    return Stream(Stream::UNSAFE, s.device(), old); }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(g_count.load()); }
  void record(void**, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};
// "pinned" host memory: CPU memory whose blocks are remembered, so that is_pinned() answers true for them (and for
// pointers inside them, as cudaPointerGetAttributes does) and false for any other CPU memory
std::mutex g_pinned_mutex;
std::map<std::uintptr_t, size_t> g_pinned;  // start -> size of each live block
void pinned_free(void* p) {
  { std::lock_guard<std::mutex> lock(g_pinned_mutex); g_pinned.erase(reinterpret_cast<std::uintptr_t>(p)); }
  c10::free_cpu(p);
}
bool pinned_contains(const void* data) {
  auto a = reinterpret_cast<std::uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(a);
  if (it == g_pinned.begin()) return false;
  --it;
  return a < it->first + (it->second ? it->second : 1);
}
struct SimPinnedAllocator final : public c10::Allocator {
  DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) { std::lock_guard<std::mutex> lock(g_pinned_mutex); g_pinned[reinterpret_cast<std::uintptr_t>(p)] = n; }
    return {p, p, &pinned_free, Device(DeviceType::CPU)};
  }
  DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
SimPinnedAllocator g_pinned_allocator;
}
namespace at {
namespace gpusim {
// at::hasCUDA() and the accelerator queries of autograd read these hooks (ATen/detail/CUDAHooksInterface.h)
struct CUDAHooks final : public CUDAHooksInterface {
  CUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return g_count.load() > 0; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_count.load() > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return static_cast<DeviceIndex>(g_count.load()); }
  int getNumGPUs() const override { return g_count.load(); }
  DeviceIndex current_device() const override { return g_current; }
  DeviceIndex getCurrentDevice() const override { return g_current; }
  void setCurrentDevice(DeviceIndex d) const override { g_current = d; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override { auto old = g_current; g_current = d; return old; }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  // torch DDP's reducer on CUDA (find_unused_parameters, static_graph) allocates its used-parameter map pinned and
  // asserts is_pinned(); pin_memory() and torch.empty(pin_memory=True) come here too
  bool isPinnedPtr(const void* data) const override { return pinned_contains(data); }
  Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  const Generator& getDefaultGenerator(DeviceIndex) const override { return detail::getDefaultCPUGenerator(); }
  void deviceSynchronize(DeviceIndex) const override {}
};
}  // namespace gpusim
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, gpusim::CUDAHooks)
}  // namespace at

namespace c10d {
namespace {
// torch DDP's reducer times each iteration with the timer registered for its device type; a CPU build has none
// for CUDA (CudaTimer lives in libtorch_cuda): host-clock times, as the CPU timer keeps
struct SimCudaTimer final : public Timer {
  explicit SimCudaTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto s = getTimestamp(start), e = getTimestamp(end);
    if (!s || !e || *e < *s) return std::nullopt;
    return *e - *s;
  }
};
}  // namespace
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kCUDA, SimCudaTimer)
}  // namespace c10d

namespace {
// the profiler's CUDA methods (torch/csrc/profiler/stubs/base.h): a CPU build's kineto cannot trace CUDA, so
// torch.profiler asked for ProfilerActivity.CUDA takes its legacy path of CUDA events around every op
// (ProfilerState::KINETO_GPU_FALLBACK, torch/autograd/profiler.py), as a CUDA build without CUPTI does. A CPU build's
// default methods throw there: every op then built a symbolized backtrace and logged "Failed to record CUDA event"
// (tens of ms per op). These events are host-clock stamps, as torch.cuda.Event's are in the simulation.
struct SimProfilerStubs final : public torch::profiler::impl::ProfilerStubs {
  void record(DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event, int64_t* cpu_ns)
      const override {
    if (device) *device = g_current;
    auto now = std::chrono::steady_clock::now().time_since_epoch();
    *event = std::make_shared<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count());
    if (cpu_ns) *cpu_ns = c10::getTime();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* a,
                const torch::profiler::impl::ProfilerVoidEventStub* b) const override {
    // microseconds, as the CUDA methods answer (cudaEventElapsedTime's ms * 1000)
    return static_cast<float>(*static_cast<int64_t*>(b->get()) - *static_cast<int64_t*>(a->get())) / 1000.0f;
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    for (int d = 0; d < g_count.load(); ++d) op(d);
  }
  void synchronize() const override {}
};
SimProfilerStubs g_profiler_stubs;
}  // namespace

extern "C" void ddp_gpusim_register(int n) {
  static bool registered = false;
  g_count = n;
  if (!registered) {
    static DeviceGuardImplRegistrar reg(DeviceType::CUDA, new SimCudaGuard());
    torch::profiler::impl::registerCUDAMethods(&g_profiler_stubs);
    registered = true;
  }
}
extern "C" int ddp_gpusim_current_device() { return g_current; }
// a simulated tensor's storage (a wrapper's: no data) sized to `nbytes`, so that its shape may grow with its data's
// (resize_ of a CUDA tensor, as scatter_object_list does); Python cannot resize a CUDA storage on a CPU build
extern "C" void ddp_gpusim_set_storage_nbytes(void* storage_impl, int64_t nbytes) {
  static_cast<c10::StorageImpl*>(storage_impl)->set_nbytes(static_cast<size_t>(nbytes));
}
"""


def cache_dir() -> Path:
    """Where the compiled shim lives: $DDP_GPU_SIM_CACHE, else ~/.cache/ddp_lib/gpusim."""
    return Path(os.environ.get("DDP_GPU_SIM_CACHE") or Path.home() / ".cache" / "ddp_lib" / "gpusim")


def _torch_dir() -> Path:
    # found without importing torch: the shim must be loaded first (see install)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("ddp_lib.gpusim needs torch installed")
    return Path(spec.submodule_search_locations[0])


def cpu_build() -> bool:
    """Whether the installed torch is a CPU build (its version.py says `cuda = None`), read without importing it."""
    text = (_torch_dir() / "version.py").read_text()
    return re.search(r"^cuda(: [^=]*)? = None", text, re.M) is not None


def shim_path(torch_dir: Path) -> Path:
    """Where the shim for the torch in `torch_dir` is cached (keyed by that folder, its version file, the source)."""
    # the folder is in the key: the shim finds libc10 through an rpath to it, so a shim built by another venv (a
    # worktree or clone since deleted) fails to load with "libc10.so: cannot open shared object file"
    key = hashlib.sha256((str(torch_dir.resolve()) + (torch_dir / "version.py").read_text() + SOURCE
                          + sys.version).encode()).hexdigest()[:16]
    return cache_dir() / f"guard_{key}.so"


def build() -> Path:
    """Compile the shim for this torch once and return its path."""
    torch_dir = _torch_dir()
    lib = shim_path(torch_dir)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # one compile per machine: processes that start together (CI's simulated lessons beside the suite's test_gpusim,
    # a kernel and its ranks) wait for the first one's build instead of each compiling it (about 30 s of CPU)
    with open(lib.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            _compile(torch_dir, lib)
    return lib


def _compile(torch_dir: Path, lib: Path) -> None:
    """Compile the shim against the torch in `torch_dir` into `lib`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "guard.cpp"
        src.write_text(SOURCE)
        out = Path(tmp) / lib.name  # built aside, renamed into place: concurrent ranks never load half a file
        cmd = [os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O1", "-std=c++17", f"-I{torch_dir / 'include'}",
               str(src), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}",
               "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ddp_lib.gpusim: compiling the CUDA guard shim failed:\n{done.stderr[-3000:]}")
        os.replace(out, lib)


_lib: ctypes.CDLL | None = None


def install(device_count: int) -> None:
    """Load the shim (building it on first use) and register the CUDA guard with `device_count` devices."""
    global _lib
    if _lib is None:
        if "torch" in sys.modules:  # getCUDAHooks() caches the hooks it finds first: ours must be registered by then
            raise RuntimeError("DDP_GPU_SIM: torch was imported before ddp_lib; import ddp_lib first (the simulated "
                               "CUDA hooks must be loaded before torch)")
        _lib = ctypes.CDLL(str(build()))
    _lib.ddp_gpusim_register(int(device_count))
    _lib.ddp_gpusim_set_storage_nbytes.argtypes = [ctypes.c_void_p, ctypes.c_int64]


def set_storage_nbytes(storage, nbytes: int) -> None:
    """Size a simulated tensor's own (data-less) storage to `nbytes`, so that its shape can grow in place."""
    _lib.ddp_gpusim_set_storage_nbytes(storage._cdata, int(nbytes))
