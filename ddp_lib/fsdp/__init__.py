"""Lesson 08: FSDP (ZeRO-3) from scratch. `FSDP` wraps a module; units, the backward path, state dicts and
guards each live in a module of their own here."""

from ddp_lib.fsdp.wrapper import FSDP

__all__ = ["FSDP"]
