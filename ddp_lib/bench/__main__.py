"""CLI: `python -m ddp_lib.bench {allreduce,ddp,sweep} ...` (spawns local ranks, or runs as-is under torchrun).

  allreduce  time, algbw = size/time and busbw = algbw·2(n-1)/n per size and world size, α–β fit, plot
             (--fit-json saves the fit for lessons 04/05; the README figure and the committed reference fit:
              python -m ddp_lib.bench allreduce --min-size 4K --max-size 64M --world-sizes 2,4 --iters 30
                  --json assets/bench_allreduce_cpu.json --fit-json assets/alphabeta_fit_cpu.json)
  ddp        the race: nocomm baseline, naive, flat, overlap, bucketed:<MB>, torch DDP on one model
  sweep      ddp with BucketedDDP at several bucket sizes next to the α–β model's predicted best size
Under torchrun (RANK set) the existing ranks are used: `torchrun --nproc-per-node 2 -m ddp_lib.bench ddp`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


import torch.distributed as dist

from ddp_lib.bench.allreduce import DEFAULT_SIZES, format_allreduce, machine_label, run_allreduce_bench
from ddp_lib.bench.alphabeta import fit_by_group, load_fit, residuals, save_fits
from ddp_lib.bench.ddp_step import DEFAULT_VARIANTS, run_ddp_bench
from ddp_lib.bench.overlap_probe import run_overlap_probe
from ddp_lib.bench.race import add_predictions, format_race, format_round_ratios
from ddp_lib.bench.workloads import MODELS

UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
         "G": 2**30, "GB": 2**30, "GIB": 2**30}
COLUMNS_DDP = """table columns (ms; each step maxed over ranks, then the median over timed steps; ddp_lib.bench.race):
  step      whole step (zero_grad, forward, backward, finish, optimizer.step): median, then its spread
  exposed   step - step of nocomm (the same model trained locally, no communication)
  finish    time inside finish_gradient_synchronization, after backward returned (torch DDP has none: '-')
  total     the variant's own all-reduces issued back to back with nothing else running (un-hidden cost)
  hidden    share of the gradient bytes already reduced when backward returned (bench.overlap_probe)
  bwd+      backward - backward of nocomm: what backward lost to the communication running beside it
  calls     all-reduces per synchronized step (torch DDP: its buckets); peak_MB: CUDA peak alloc / CPU peak RSS
  tok/s     tokens trained on per second over all ranks at the median step (smp/s: samples, for workloads without
            tokens); MFU: model FLOPs per second (6N per token, or torch's FlopCounterMode) over the GPUs' datasheet
            peak (TF32 on sm_80+, where the race turns it on; else FP32); '-' on a CPU, with the reason below the table
  param_diff  max |final params - first variant's| over ranks (all variants must agree, 1e-5)
sweep: the α–β model's E(b) predicts `finish`; it uses the fit saved by `allreduce --fit-json` (runs/, else assets/)"""


def parse_size(text: str) -> int:
    """'64KB' -> 65536, '1GB' -> 2**30 (binary units; a bare number is bytes)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 64KB, 1MB, 1GB")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])


def csv_list(kind):
    """argparse type: a comma-separated list of `kind`."""
    return lambda text: [kind(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the three subcommands."""
    p = argparse.ArgumentParser(prog="python -m ddp_lib.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce", help="all-reduce time/algbw/busbw vs size; α–β fit; plot",
                       description=run_allreduce_bench.__module__ and sys.modules["ddp_lib.bench.allreduce"].__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--sizes", type=csv_list(parse_size), help="explicit sizes, e.g. 1MB,4MB,16MB")
    a.add_argument("--min-size", type=parse_size, default=DEFAULT_SIZES[0], help="default 1MB")
    a.add_argument("--max-size", type=parse_size, default=DEFAULT_SIZES[-1], help="default 1GB (also capped by memory)")
    a.add_argument("--world-sizes", type=csv_list(int), default=[2], help="e.g. 2,4 (ignored under torchrun)")
    a.add_argument("--iters", type=int, default=10)
    a.add_argument("--warmup", type=int, default=3)
    a.add_argument("--budget-s", type=float, default=5.0, help="max seconds of timed calls per size")
    a.add_argument("--fit-json", default=None, help="also save the α–β fits and their points (lessons 04/05 read "
                   "runs/alphabeta_fit.json, else assets/alphabeta_fit_cpu.json)")
    a.add_argument("--machine", default=None, help="how to name this machine in the fit file and the figure "
                   "(default: CPU count and architecture, or the GPU's name)")
    for name, help_ in (("ddp", "race the DDP engines and torch DDP"), ("sweep", "bucket-size sweep vs α–β")):
        d = sub.add_parser(name, help=help_, epilog=COLUMNS_DDP, formatter_class=argparse.RawDescriptionHelpFormatter)
        d.add_argument("--model", default="blocks", choices=MODELS)
        d.add_argument("--variants", type=csv_list(str), default=None,
                       help=f"default {','.join(DEFAULT_VARIANTS)}; also simple, bucketed:<MB>, bucketed-pergrad "
                            "(one gradient hook per gradient at every step), torch:<MB>, torch-view")
        d.add_argument("--bucket-mb", type=float, default=None,
                       help="cap of bucketed and torch (default: the workload's, 0.5 MB for lesson 05's blocks)")
        d.add_argument("--link", type=csv_list(float), default=None, metavar="ALPHA_US,GBPS",
                       help="run on a labelled simulated link: each all-reduce ends no sooner than α + bytes/bandwidth")
        d.add_argument("--sweep", type=csv_list(float), default=[1, 4, 16, 64] if name == "sweep" else None,
                       help="add bucketed:<MB> for each size and the α–β prediction")
        d.add_argument("--steps", type=int, default=20)
        d.add_argument("--warmup", type=int, default=5)
        d.add_argument("--rounds", type=int, default=1,
                       help="repeat the race, each round starting one variant later (steadier on a drifting machine)")
        d.add_argument("--interleave", action="store_true",
                       help="all variants at once, one step each in turn: each step a round (pairs steps closest "
                            "in time; every model copy is alive together, so no peak memory)")
        d.add_argument("--batch-size", type=int, default=None, help="global batch (split across ranks)")
        d.add_argument("--world-size", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
        d.add_argument("--seed", type=int, default=0)
    for s in sub.choices.values():
        s.add_argument("--backend", default=None, help="gloo or nccl (default: nccl if every rank has a GPU)")
        s.add_argument("--json", default=None, help="rows as JSON (CSV next to it); default bench_results/<cmd>.json")
        s.add_argument("--plot", default=None, help="PNG path; default: the JSON path with .png")
        s.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps: seconds")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    """Run one subcommand; rank 0 prints the table and writes JSON, CSV and PNG. Returns the rows."""
    args = build_parser().parse_args(argv)
    if args.cmd == "allreduce":
        sizes = args.sizes or [args.min_size * 2**i for i in range(64)
                               if args.min_size * 2**i <= args.max_size]  # powers of two, min..max
        if args.smoke:
            sizes, args.iters, args.warmup = [2**12, 2**14, 2**16], 3, 1
        rows = run_allreduce_bench(sizes, args.world_sizes, args.backend, iters=args.iters,
                                   warmup=args.warmup, budget_s=args.budget_s)
    else:
        variants = list(args.variants or DEFAULT_VARIANTS)
        if args.link is not None and len(args.link) != 2:
            raise SystemExit(f"--link takes ALPHA_US,GBPS (two numbers), got {args.link}")
        link = tuple(args.link) if args.link else None
        variants += [f"bucketed:{mb:g}" for mb in args.sweep or [] if f"bucketed:{mb:g}" not in variants]
        if args.smoke:
            args.model, args.steps, args.warmup = ("toy" if args.model == "blocks" else args.model), 3, 1
        rows = run_ddp_bench(args.model, variants, args.world_size, args.backend, bucket_mb=args.bucket_mb,
                             steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, seed=args.seed,
                             rounds=args.rounds, link=link, interleave=args.interleave)
        shares = run_overlap_probe(args.model, variants, args.world_size, args.backend, bucket_mb=args.bucket_mb,
                                   batch_size=args.batch_size, seed=args.seed, steps=2 if args.smoke else 5, link=link)
        if args.sweep:  # the α–β fit saved by lesson 01 / `allreduce --fit-json`, not a new one
            add_predictions(rows, load_fit(rows[0]["backend"], rows[0]["world_size"])[0])
    if dist.is_initialized() and dist.get_rank() != 0:
        return rows
    from ddp_lib.bench.plots import plot_allreduce, plot_ddp, save_rows  # matplotlib: rank 0 only

    json_path = args.json or os.path.join("bench_results", f"{args.cmd}.json")
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    if args.cmd == "allreduce":
        machine = args.machine or machine_label()
        print(format_allreduce(rows))
        for (backend, ws), fit in fit_by_group(rows).items():
            alpha = (f"{fit.alpha_us:.1f} µs" if fit.alpha_resolved else
                     "not resolved at these sizes (below the timing noise; add small sizes, e.g. --min-size 4K)")
            mine = [r for r in rows if (r["backend"], r["world_size"]) == (backend, ws)]
            print(f"α–β fit {backend} x{ws}: α = {alpha}, bandwidth 1/β = {fit.bandwidth_GBps:.3f} GB/s; "
                  "measured/model per size: " + " ".join(f"{r['ratio']:.2f}" for r in residuals(fit, mine)))
        if args.fit_json:
            print(f"wrote {save_fits(rows, args.fit_json, machine)}")
        plot_allreduce(rows, plot_path, title=f"{machine}, {rows[0]['backend']}, float32; median of up to "
                                              f"{args.iters} calls per size, bars: interquartile range")
    else:
        print(format_race(rows, shares))
        for engine in ("bucketed", "bucketed-pergrad"):  # each against torch DDP with bucket views, if raced
            if (line := format_round_ratios(rows, engine)) is not None:
                print(line)
        if (line := format_round_ratios(rows, "bucketed", "bucketed-pergrad")) is not None:
            print(line)
        agree = all(r["param_diff"] is None or r["param_diff"] <= 1e-5 for r in rows)
        print(f"final parameters of all variants agree (atol 1e-5): {'yes' if agree else 'NO'}")
        if rows[0].get("predicted_best_bucket_mb") is not None:
            r = rows[0]
            print(f"α–β (saved fit): α = {r['alpha_us']:.1f} µs, 1/β = {r['bandwidth_GBps']:.3f} GB/s, backward of "
                  f"nocomm {rows[0]['bwd_ms']:.1f} ms -> predicted best bucket {r['predicted_best_bucket_mb']:.3g} MB")
        plot_ddp(rows, plot_path, shares)
        for r in rows:
            r["hidden_share"] = shares.get(r["variant"])  # kept in the JSON/CSV next to ddp_step's columns
    paths = save_rows(rows, json_path)
    print(f"wrote {paths[0]}, {paths[1]}, {plot_path}")
    return rows


if __name__ == "__main__":
    main()
