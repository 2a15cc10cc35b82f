"""Median round trip of an empty `%%distributed` cell, measured from a Jupyter client.

    python -m ddp_lib.notebook.roundtrip [-n 2] [--cells 60] [--ext ddp_lib.notebook|nbdistributed] [--json]

Starts a real kernel with this interpreter, `%dist_init -n N` (CPU: gloo), and times execute request
-> reply of empty cells (Jupyter's own messaging included). `--ext nbdistributed` measures the vanilla
0.1.0 magics for comparison (its workers are ended by PID here, never with its pkill-based shutdown).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ddp_lib.launch import descendants


def start_kernel(workdir: Path, env: dict | None = None):
    """A KernelManager + started client for a kernel running `sys.executable`."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    from ddp_lib.notebook.kernels import on_ipc

    d = workdir / "kernels" / "ddp-nb-bench"
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ddp_lib bench", "language": "python"}))
    km = on_ipc(KernelManager)(kernel_name="ddp-nb-bench",
                               kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(d.parent)]))
    km.start_kernel(cwd=str(workdir), env={**os.environ, **(env or {})})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return km, kc


def execute(kc, code: str, timeout: float = 120.0) -> tuple[str, float]:
    """Run `code`; return (status, seconds from request to reply)."""
    t0 = time.perf_counter()
    reply = kc.execute(code, reply=True, timeout=timeout)
    return reply["content"]["status"], time.perf_counter() - t0


def median_round_trip_ms(kc, cells: int = 60, warmup: int = 5, code: str = "%%distributed\npass\n") -> dict:
    """Time `cells` empty distributed cells after `warmup` ones; median and quartiles in ms."""
    for _ in range(warmup):
        execute(kc, code)
    times = []
    for _ in range(cells):
        status, dt = execute(kc, code)
        if status != "ok":
            raise RuntimeError(f"benchmark cell failed: {status}")
        times.append(dt * 1000)
    q = statistics.quantiles(times, n=4)
    return {"median_ms": statistics.median(times), "p25_ms": q[0], "p75_ms": q[2], "cells": cells}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-processes", type=int, default=2)
    ap.add_argument("--cells", type=int, default=60)
    ap.add_argument("--ext", default="ddp_lib.notebook", choices=["ddp_lib.notebook", "nbdistributed"])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    env = {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        km, kc = start_kernel(Path(tmp), env)
        kpid = km.provisioner.process.pid
        workers: list[int] = []
        try:
            execute(kc, f"%load_ext {args.ext}")
            status, init_s = execute(kc, f"%dist_init -n {args.num_processes}")
            if args.ext == "nbdistributed":
                time.sleep(3)  # its first cells after %dist_init get lost while workers connect
            workers = descendants(kpid)
            res = median_round_trip_ms(kc, args.cells)
            res.update(ext=args.ext, ranks=args.num_processes, init_s=round(init_s, 2), cpus=os.cpu_count())
            if args.ext == "ddp_lib.notebook":
                execute(kc, "%dist_shutdown")
        finally:
            workers += descendants(kpid)
            kc.stop_channels()
            km.shutdown_kernel(now=args.ext == "nbdistributed")
            for pid in set(workers):  # by PID only
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{args.ext}: empty %%distributed cell round trip with {args.num_processes} CPU ranks: "
              f"median {res['median_ms']:.1f} ms (p25 {res['p25_ms']:.1f}, p75 {res['p75_ms']:.1f}, "
              f"{res['cells']} cells, {res['cpus']} cores)")
    return res


if __name__ == "__main__":
    main()
