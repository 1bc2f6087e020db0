"""What every message shares: the base struct (unknown fields refused) and Shutdown, which every
process that takes orders understands (a master from its client, a worker from its master, a spare
worker from its warm TE)."""
from __future__ import annotations

import msgspec


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every message: a frame naming a field the receiver's struct lacks is refused."""


class Shutdown(Message):
    pass
