"""The DDP cases moved into the package (`ddp_lib.check.cases`, one copy): this name stays for old imports."""

from ddp_lib.check.cases import *  # noqa: F401,F403
from ddp_lib.check.cases import GLOBAL_BATCH, LR, STEPS  # noqa: F401  (constants, named for readers)
