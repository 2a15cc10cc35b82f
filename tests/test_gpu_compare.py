"""`make gpu-check` compares the real box with the plan and the link (issue 59, item 7), tested with fake inputs:
`nvidia-smi topo -m` matrices, NCCL_DEBUG=INFO logs, benchmark rows and lesson peaks (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from ddp_lib.course import gpu_check as gc
from ddp_lib.course import gpu_compare as cmp
from ddp_lib.course.gpu_needs import NEED_GIB

TOPO_NVLINK = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tPXB\t0-55\t0
GPU1\tNV18\t X \tPXB\t0-55\t0
NIC0\tPXB\tPXB\t X

Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""
TOPO_PCIE = """\
\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPHB\t0-7\t0
GPU1\tPHB\t X \t0-7\t0

Legend:
  NV#  = Connection traversing a bonded set of # NVLinks
"""
NCCL_LOG = """\
box:123:456 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>
box:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
box:123:456 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
box:124:457 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
box:124:457 [1] NCCL INFO Channel 02/0 : 1[1] -> 2[0] [send] via NET/IB/0
"""


def test_the_link_class_is_read_from_the_matrix_not_the_legend():
    assert cmp.link_class(TOPO_NVLINK) == "NVLink"
    assert cmp.link_class(TOPO_PCIE) == "PCIe"  # its legend names NV# too: only the GPU rows count
    assert cmp.link_class("unavailable") == "unknown"


def test_the_transports_nccl_chose_are_parsed_from_its_info_lines():
    assert cmp.nccl_transports(NCCL_LOG) == ["NET/IB", "P2P/CUMEM/read", "SHM/direct/direct"]
    assert cmp.nccl_transports("NCCL INFO Bootstrap : Using eth0") == []
    assert cmp.transport_kind(["P2P/CUMEM/read"]).startswith("GPU to GPU")
    assert "host memory" in cmp.transport_kind(["SHM/direct/direct"])
    assert cmp.transport_kind([]).startswith("no transport logged")


@pytest.mark.parametrize("busbw, link, start", [(350.0, "NVLink", "ok"), (12.0, "NVLink", "LOW"),
                                                (12.0, "PCIe", "ok"), (300.0, "PCIe", "ODD"),
                                                (None, "PCIe", "not measured")])
def test_busbw_is_judged_against_the_link_class(busbw, link, start):
    assert cmp.busbw_verdict(busbw, link).startswith(start)


def test_max_busbw_ignores_one_rank_rows():
    rows = [dict(world_size=1, busbw_GBps=0.0), dict(world_size=2, busbw_GBps=9.5), dict(world_size=2, busbw_GBps=11.0)]
    assert cmp.max_busbw(rows) == 11.0 and cmp.max_busbw(rows[:1]) is None


def test_memory_peaks_are_compared_with_the_card_and_the_plan():
    plan = {"02": 30.0, "05": 22.5}
    lessons = [dict(name="02_simple_ddp (-n 2)", peak_allocated_mb=28 * 1024, peak_reserved_mb=31 * 1024),
               dict(name="05_overlap_and_buckets (-n 2)", peak_allocated_mb=25 * 1024, peak_reserved_mb=27 * 1024),
               dict(name="07_zero1_and_memory (-n 2)", peak_allocated_mb=14 * 1024, peak_reserved_mb=16 * 1024),
               dict(name="01_collectives (-n 2)", peak_allocated_mb=1024, peak_reserved_mb=2048),
               dict(name="00_ranks (-n 2)", peak_allocated_mb=None, peak_reserved_mb=None)]
    got = {r["name"][:2]: r["verdict"] for r in cmp.memory_rows(lessons, card_gib=15.0, plan_gib=plan)}
    assert got == {"02": "over the card", "05": "over the card", "07": "over the card", "01": "no plan",
                   "00": "not measured"}
    got = {r["name"][:2]: r["verdict"] for r in cmp.memory_rows(lessons, card_gib=79.1, plan_gib=plan)}
    assert got["02"] == "within the plan" and got["05"] == "over the plan" and got["07"] == "no plan"


def test_the_report_compares_the_box_with_the_plan_and_the_link(tmp_path):
    info = dict(gpus=[dict(index=i, name="Tesla T4", memory_gib=14.6) for i in range(2)], driver="535", cuda="12.1",
                torch="2.5", nccl="2.21", topology=TOPO_PCIE)
    log, rows = tmp_path / "bench_allreduce.log", tmp_path / "allreduce.json"
    log.write_text(NCCL_LOG)
    rows.write_text(json.dumps([dict(world_size=2, busbw_GBps=6.1), dict(world_size=2, busbw_GBps=9.8)]))
    lessons = [gc.Step("05_overlap_and_buckets (-n 2)", True, 1.0, extra=dict(peak_allocated_mb=16 * 1024,
                                                                             peak_reserved_mb=17 * 1024))]
    comparison = gc.compare(info, lessons, log, rows)
    md = gc.write_report(tmp_path / "r", info, [], lessons, [], comparison=comparison).read_text()
    assert "link class (`nvidia-smi topo -m`): PCIe" in md
    assert "P2P/CUMEM/read" in md and "GPU to GPU" in md and "ok: 9.8 GB/s for PCIe" in md
    assert f"| 05_overlap_and_buckets (-n 2) | 16.0 | {NEED_GIB['05']:.1f} | 17.0 | – | 14.6 | over the card |" in md
    # nothing measured (bench skipped): said so, not invented
    md = gc.write_report(tmp_path / "s", info, [], [], [], comparison=gc.compare(info, [], None, None)).read_text()
    assert "no transport logged" in md and "busbw, best over the sizes: not measured" in md


def test_the_allreduce_benchmark_runs_with_nccl_debug_info(tmp_path, monkeypatch):
    envs = {}
    monkeypatch.setattr(gc, "require_gpus", lambda: 2)
    monkeypatch.setattr(gc, "device_info", lambda: dict(gpus=[dict(index=i, name="H100", memory_gib=79.1)
                                                               for i in range(2)], driver="x", cuda="x", torch="x",
                                                         nccl="x", topology=TOPO_NVLINK))
    monkeypatch.setattr(gc, "run_lessons", lambda numbers, out, ranks: [])
    monkeypatch.setattr(gc, "run_logged", lambda name, cmd, log, timeout_s=3600, env=None:
                        envs.__setitem__(name, env) or gc.Step(name, True, 0.0))
    gc.main(["--out", str(tmp_path / "r"), "--skip-tests"])
    assert envs["bench allreduce (nccl)"] == {"NCCL_DEBUG": "INFO"} and envs["bench ddp (nccl)"] is None
    assert "## Against the plan and the link" in (tmp_path / "r" / "README.md").read_text()


@pytest.mark.parametrize("name, count, profile", [("Tesla T4", 2, "2xT4"), ("NVIDIA L4", 1, "1xL4"),
                                                  ("NVIDIA A100-SXM4-40GB", 2, "2xA100"),
                                                  ("NVIDIA H100 80GB HBM3", 8, "8xH100"),
                                                  ("NVIDIA H100 80GB HBM3", 1, "1xH100"), ("NVIDIA L40S", 2, None),
                                                  ("NVIDIA H200", 1, None)])
def test_the_dry_plan_simulates_the_boxs_card(name, count, profile):
    assert cmp.profile_for([dict(name=name)] * count) == profile


def test_real_peaks_are_compared_with_the_dry_plan(tmp_path):
    peaks = {"profile": "2xT4", "n": 2, "lessons": {
        "02_simple_ddp": {"result": "ok", "gpu_peak_gib": {"0": 9.0, "1": 8.5}},
        "09_ddp_in_production": {"result": "ok", "gpu_peak_gib": {"0": 1.0, "1": 1.0}},
        "00_ranks_and_magics": {"result": "ok", "gpu_peak_gib": {}}}}
    assert cmp.dry_peaks(peaks) == {"02": 9.0, "09": 1.0}
    lessons = [dict(name="02_simple_ddp (-n 2)", peak_allocated_mb=9 * 1024, peak_reserved_mb=13 * 1024),
               dict(name="09_ddp_in_production (-n 2)", peak_allocated_mb=1024, peak_reserved_mb=2 * 1024)]
    rows = cmp.memory_rows(lessons, card_gib=14.6, plan_gib={"02": 30.0}, dry_gib=cmp.dry_peaks(peaks))
    # 13 GiB reserved > 9 x 1.2 + 1.5 = 12.3: the dry plan missed something; 09: 2 <= 1 x 1.2 + 1.5
    assert [r["verdict"] for r in rows] == ["over the dry plan's margin", "within the dry plan"]
    info = dict(gpus=[dict(index=i, name="Tesla T4", memory_gib=14.6) for i in range(2)], topology=TOPO_PCIE)
    (tmp_path / "peaks.json").write_text(json.dumps(peaks))
    steps = [gc.Step(s["name"], True, 1.0, extra=s) for s in lessons]
    md = "\n".join(gc.compare(info, steps, None, None, tmp_path / "peaks.json"))
    assert "| 02_simple_ddp (-n 2) | 9.0 | 30.0 | 13.0 | 9.0 | 14.6 | over the dry plan's margin |" in md
