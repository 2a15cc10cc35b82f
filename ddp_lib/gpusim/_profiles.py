"""The simulated boxes: GPU count, name, memory and compute capability (torch-free: read before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """A GPU box: how many GPUs, and what `get_device_properties` says about each."""

    count: int
    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


_H100 = dict(name="NVIDIA H100 80GB HBM3", total_memory=85_029_158_912, major=9, minor=0, multi_processor_count=132)
PROFILES = {
    "1xH100": Profile(1, **_H100),
    "8xH100": Profile(8, **_H100),
    "2xT4": Profile(2, "Tesla T4", 15_637_086_208, 7, 5, 40),
    "1xL4": Profile(1, "NVIDIA L4", 23_580_639_232, 8, 9, 58),
    # the 40 GB A100 (SXM4), as torch.cuda.get_device_properties reports it: 39.59 GiB
    "2xA100": Profile(2, "NVIDIA A100-SXM4-40GB", 42_505_273_344, 8, 0, 108),
}
