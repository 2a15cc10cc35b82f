"""Lesson 08: FSDP (ZeRO-3) from scratch. `FSDP` (fully_sharded.py) wraps a module; each unit's lifecycle lives on
its `UnitGroup` (unit_group.py); flat buffers and collectives, layout, state dicts and guards each in their own
module here. Helpers about torch's own `fully_shard` (DCP checkpoints, meta-device init) are in ddp_lib.torch_fsdp."""

from ddp_lib.fsdp.fully_sharded import FSDP

__all__ = ["FSDP"]
