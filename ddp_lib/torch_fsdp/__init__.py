"""Helpers about torch's own `fully_shard` (FSDP2), which lesson 08 sets beside the course's FSDP: distributed
checkpoints that change world size (dcp.py) and a model built on the meta device, initialised shard by shard
(meta_device.py)."""
