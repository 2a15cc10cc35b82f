"""The DDP engines of lessons 02-05; those of 04-05 are the front of ddp_lib.contract, each given a sync strategy."""

from ddp_lib.ddp.bucketed import BucketedDDP
from ddp_lib.ddp.flat import FlatDDP
from ddp_lib.ddp.naive import NaiveDDP
from ddp_lib.ddp.overlap import OverlapDDP
from ddp_lib.ddp.simple import SimpleDistributedDataParallelism

ENGINES = {
    "simple": SimpleDistributedDataParallelism,
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": BucketedDDP,
}

__all__ = [
    "SimpleDistributedDataParallelism",
    "NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP", "ENGINES",
]
