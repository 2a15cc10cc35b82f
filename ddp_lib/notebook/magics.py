"""nbdistributed 0.1.0's magics, same names and arguments, on a safe and reliable engine."""

from __future__ import annotations

import re
import shlex
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from nbdistributed.magic import DistributedMagic as _Vanilla

from ddp_lib.notebook._cluster import Cluster, WorkerStartError
from ddp_lib.notebook._devices import gpu_without_cuda_note, nccl_available, plan_devices, visible_gpus
from ddp_lib.notebook._execute import default_timeout, run_cell

_RANK_NOSPACE = re.compile(r"^(\s*)%%rank\[")
NAMES = "rank, world_size, device, gpu_id, dist, torch, get"


@magics_class
class DistributedMagics(Magics):
    """`%dist_init`, `%%distributed`, `%%rank`, `%sync`, `%dist_status`, `%dist_mode`, `%dist_shutdown`, `%dist_reset`,
    `%dist_export`."""

    def __init__(self, shell=None) -> None:
        super().__init__(shell)
        self.cluster: Cluster | None = None
        self.timeout_s: float | None = None
        self._auto = False
        self._rank_hint = False
        self._ran: list[str] = []  # every cell run since the extension loaded, raw, in order (for %dist_export)
        if shell is not None:
            shell.input_transformers_cleanup.insert(0, self._rank_nospace_transformer)
            shell.events.register("pre_run_cell", self._note_cell)
            # the cell loading the extension (often `%load_ext` and `%dist_init` together) started before the record
            # did: under ipykernel its request names it
            get_parent = getattr(shell, "get_parent", None)
            current = (get_parent() or {}).get("content", {}).get("code") if callable(get_parent) else None
            if current:
                self._ran.append(current)

    def _note_cell(self, info) -> None:
        """Keep each cell's raw text as it starts: clients that run cells with store_history=False (nbval, some
        front ends) leave the kernel's history empty, and %dist_export must still see what ran."""
        self._ran.append(info.raw_cell)

    def _export_cells(self) -> list:
        """The cells this kernel ran, in order: its history, or this extension's own record where the history holds
        fewer (cells run without storing history)."""
        from ddp_lib.notebook.export import Cell

        raw = self.shell.history_manager.input_hist_raw  # this session's cells; index = execution count
        stored = [Cell(src, n) for n, src in enumerate(raw) if n and src.strip()]
        ran = [Cell(src, n) for n, src in enumerate(self._ran, 1) if src.strip()]
        return stored if len(stored) >= len(ran) else ran

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def _num_processes(self) -> int:
        return self.cluster.n if self.cluster else 0

    def _require(self) -> Cluster:
        if self.cluster is None:
            raise UsageError("No distributed workers running. Use %dist_init first.")
        return self.cluster

    def _auto_transformer(self, lines: list[str]) -> list[str]:
        """nbdistributed's own rule: plain (non-magic, non-comment) cells become `%%distributed` cells."""
        return _Vanilla._distributed_transformer(self, lines)

    def _rank_nospace_transformer(self, lines: list[str]) -> list[str]:
        """IPython reads `%%rank[0]` as a magic named `rank[0]`; run it as `%%rank [0]` and say so."""
        if lines and _RANK_NOSPACE.match(lines[0]):
            self._rank_hint = True
            lines = [_RANK_NOSPACE.sub(r"\1%%rank [", lines[0], count=1)] + lines[1:]
        return lines

    def _set_auto(self, on: bool) -> None:
        tl = self.shell.input_transformers_cleanup if self.shell is not None else []
        if on and not self._auto:
            tl.append(self._auto_transformer)
        elif not on and self._auto and self._auto_transformer in tl:
            tl.remove(self._auto_transformer)
        self._auto = on

    def _stop(self, grace_s: float) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(grace_s)
            self.cluster = None
        self._set_auto(False)

    def _execution_count(self) -> int | None:
        """The number the notebook shows beside the running cell (`[3]`), for the ranks' tracebacks.

        Read from the running cell's ExecutionResult: `shell.execution_count` is already the next
        cell's number during execution in IPython 9, and still this one's in IPython 8.
        """
        result = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        return getattr(result, "execution_count", None)

    @staticmethod
    def _cell_timeout(argv: list[str], default: float | None) -> float | None:
        if not argv:
            return default
        if len(argv) == 2 and argv[0] == "--timeout":
            t = float(argv[1])
            return t if t > 0 else None
        raise UsageError(f"unexpected arguments {' '.join(argv)!r}; the only option is --timeout SECONDS")

    # -- magics -----------------------------------------------------------------------------------
    @line_magic
    @magic_arguments()
    @argument("--num-processes", "-n", type=int, default=2, help="Number of ranks (worker processes)")
    @argument("--master-addr", "-a", type=str, default="127.0.0.1", help="Address of rank 0's TCP store")
    @argument("--gpu-ids", "-g", type=str, default=None,
              help="Comma-separated GPU ids, one per rank (default: GPUs 0..N-1 with NCCL when N are visible)")
    @argument("--cpu", action="store_true", help="gloo on the CPU even where GPUs are visible")
    @argument("--master-port", type=int, default=None, help="Port of rank 0's TCP store (default: a free one)")
    @argument("--timeout", type=float, default=None,
              help="Default limit in seconds for each cell (default: $DDP_NB_TIMEOUT, else none)")
    def dist_init(self, line: str) -> None:
        """Start the ranks and return once every one of them is ready; plain cells then run on all ranks."""
        args = parse_argstring(self.dist_init, line)
        if args.num_processes < 1:
            raise UsageError("--num-processes must be at least 1")
        if self.cluster is not None and not self.cluster.broken and all(
                self.cluster.alive(r) for r in range(self.cluster.n)):
            print("Distributed workers already running. Use %dist_shutdown to stop them first.")
            return
        replaced = self.cluster is not None
        if replaced:
            print(f"Ending the previous workers ({self.cluster.broken or 'a rank exited'})...")
            self._stop(0.5)
        visible = visible_gpus()
        if not visible and (mismatch := gpu_without_cuda_note()):
            print(mismatch, file=sys.stderr)
        plan = plan_devices(args.num_processes, args.gpu_ids, args.cpu, visible, visible > 0 and nccl_available())
        if plan.note and plan.gpu_ids is None and visible:
            # GPUs present but the ranks go to the CPU (too few for one per rank, or no NCCL): say it loudly,
            # since every figure of the lesson is then a CPU figure
            # one warning sign: the plan's note carries its own
            note = plan.note.removeprefix("⚠️").strip()
            # the note says why, what -n would use the GPUs (and, with one GPU, that the lessons need 2 ranks)
            print(f"⚠️  CPU ranks, not GPUs: {note}", file=sys.stderr)
        elif plan.note:
            print(plan.note)
        self.timeout_s = args.timeout if args.timeout and args.timeout > 0 else None
        print(f"Starting {args.num_processes} distributed workers...")
        try:
            self.cluster = Cluster(args.num_processes, plan.gpu_ids, args.master_addr, args.master_port,
                                   backend=plan.backend)
        except WorkerStartError as e:
            raise UsageError(str(e)) from None
        st = self.cluster.status
        backend = st[0].get("backend")
        devices = ", ".join(f"rank {r} -> {st[r]['device']}" for r in sorted(st))
        print(f"✓ {args.num_processes} ranks ready ({backend}): {devices}")
        print(f"Plain cells now run on every rank (%dist_mode -d to stop); on the ranks: {NAMES}")
        if replaced:  # else the next cell's NameError on the ranks is the first sign that their state went with them
            print("These ranks are new: what earlier cells defined on the old ones is gone. Run the cells after "
                  "%dist_init again, from the first, before the one you were at.")
        self._set_auto(True)

    @cell_magic
    def distributed(self, line: str, cell: str):
        """Run the cell on every rank (`%%distributed --timeout S` limits this cell)."""
        cluster = self._require()
        timeout = self._cell_timeout(shlex.split(line), self.timeout_s or default_timeout())
        return run_cell(cluster, list(range(cluster.n)), cell, timeout, self._execution_count())

    @cell_magic
    def rank(self, line: str, cell: str):
        """Run the cell on the listed ranks only: `%%rank [0]`, `%%rank [0,2]`, `%%rank [0-2]`."""
        hint, self._rank_hint = self._rank_hint, False
        cluster = self._require()
        m = re.match(r"\s*\[([^\]]*)\](.*)$", line)
        if not m:
            raise UsageError("Invalid rank specification. Use: %%rank [0,1,2] or %%rank [0-2]")
        ranks = self._parse_ranks(m.group(1), cluster.n)
        timeout = self._cell_timeout(shlex.split(m.group(2)), self.timeout_s or default_timeout())
        try:
            return run_cell(cluster, ranks, cell, timeout, self._execution_count())
        finally:
            if hint:
                print("Hint: write `%%rank [0]` with a space: IPython reads `%%rank[0]` as a magic named "
                      "`rank[0]`, which plain nbdistributed does not know.", file=sys.stderr)

    @staticmethod
    def _parse_ranks(spec: str, n: int) -> list[int]:
        from ddp_lib.notebook.export import rank_list

        try:
            ranks = rank_list(spec)
        except ValueError:
            raise UsageError(f"Invalid rank specification [{spec}]. Use: %%rank [0,1,2] or %%rank [0-2]") from None
        bad = [r for r in ranks if not 0 <= r < n]
        if not ranks or bad:
            raise UsageError(f"ranks {bad or '[]'} do not exist: there are {n} ranks (0-{n - 1})")
        return sorted(set(ranks))

    @line_magic
    def sync(self, line: str) -> None:  # noqa: ARG002
        """Barrier: return once every rank has reached it."""
        cluster = self._require()
        if cluster.broken:
            raise UsageError(f"the workers are not usable ({cluster.broken}); run %dist_init to start new ones")
        replies = cluster.request("sync", timeout_s=self.timeout_s or default_timeout() or 3600)
        missing = sorted(set(range(cluster.n)) - replies.keys())
        if missing:
            raise UsageError(f"ranks {missing} did not reach the barrier")
        print(f"✓ Synchronized {len(replies)} ranks")

    @line_magic
    def dist_status(self, line: str) -> None:  # noqa: ARG002
        """Each rank's PID, device, backend and whether it is alive."""
        if self.cluster is None:
            print("No distributed workers running")
            return
        cluster = self.cluster
        live = cluster.request("status", [r for r in range(cluster.n) if cluster.alive(r)], timeout_s=5) \
            if not cluster.broken else {}
        print(f"Distributed cluster status ({cluster.n} processes):")
        print("=" * 60)
        for r in range(cluster.n):
            st = live.get(r, {}).get("status") or cluster.status.get(r, {})
            ok = cluster.alive(r)
            print(f"Rank {r}: {'✓' if ok else '✗'} PID {cluster.procs[r].pid}")
            dev = st.get("device", "?")
            if st.get("gpu_name"):
                dev += f" ({st['gpu_name']}, {st['mem_allocated_gb']:.1f} / {st['mem_total_gb']:.1f} GB allocated)"
            print(f"  ├─ Device: {dev}, backend {st.get('backend')}")
            state = "Running" if ok else f"Stopped (exit code: {cluster.procs[r].returncode})"
            if ok and r not in live:
                state = "Running, not answering" if not cluster.broken else f"Running, unusable ({cluster.broken})"
            print(f"  └─ Status: {state}")
        if cluster.broken:
            print(f"\nThe workers are not usable ({cluster.broken}): run %dist_init to restart them.")

    @line_magic
    @magic_arguments()
    @argument("--enable", "-e", action="store_true", help="Enable distributed mode")
    @argument("--disable", "-d", action="store_true", help="Disable distributed mode")
    def dist_mode(self, line: str) -> None:
        """Whether plain cells run on the ranks (enabled by `%dist_init`) or in this kernel."""
        args = parse_argstring(self.dist_mode, line)
        self._require()
        if args.enable and args.disable:
            raise UsageError("Cannot specify both --enable and --disable")
        if args.enable or args.disable:
            self._set_auto(args.enable)
            print("Distributed mode enabled: plain cells run on the ranks" if args.enable
                  else "Distributed mode disabled: plain cells run in this kernel")
        else:
            print(f"Distributed mode is currently {'enabled' if self._auto else 'disabled'}")
            print("Use %dist_mode --enable or %dist_mode --disable to toggle")

    @line_magic
    def dist_shutdown(self, line: str) -> None:  # noqa: ARG002
        """End the ranks (asked first, then terminated/killed by PID) and run plain cells locally again."""
        if self.cluster is None:
            print("No distributed workers running")
            return
        n = self.cluster.n
        self._stop(3.0)
        print(f"Distributed workers shut down ({n} processes ended)")

    @line_magic
    @magic_arguments()
    @argument("--nuclear", "-n", action="store_true", help="Kill this kernel's ranks at once (SIGKILL)")
    def dist_reset(self, line: str) -> None:
        """End this kernel's ranks (only them, by PID) and clear all state."""
        args = parse_argstring(self.dist_reset, line)
        n = self.cluster.n if self.cluster else 0
        self._stop(0.0 if args.nuclear else 1.0)
        print(f"Distributed state reset ({n} processes ended); run %dist_init to start fresh")

    @line_magic
    def dist_debug(self, line: str) -> None:  # noqa: ARG002
        """Internal state, for bug reports."""
        c = self.cluster
        print(f"workers: {c.n if c else 0}, auto mode: {self._auto}, default timeout: {self.timeout_s}")
        if c:
            print(f"control port: 127.0.0.1:{c.port}, pids: {c.pids()}, broken: {c.broken}, "
                  f"rejected messages: {c.rejected}")

    @line_magic
    def dist_export(self, line: str) -> None:
        """Write this kernel's rank cells, in the order they ran, as a script (`%dist_export train.py`)."""
        from ddp_lib.notebook.export import ExportError, write

        out = line.strip() or "train.py"
        try:
            paths = write(self._export_cells(), out, "this kernel's history")
        except ExportError as e:
            raise UsageError(str(e)) from None
        print("wrote " + ", ".join(map(str, paths)))
