"""Typed frames: msgpack `[type name, fields]` over a closed set of msgspec structs, checked on decode.

The engine's messages (`meshserve.wire`) and the pool's (`meshserve.pool.messages`) share this
codec; each turns a bad frame into its own error type.
"""
from __future__ import annotations

from collections.abc import Iterable

import msgspec


class FrameCodec:
    def __init__(self, types: Iterable[type[msgspec.Struct]], error: type[ValueError], kind: str) -> None:
        self.types = {cls.__name__: cls for cls in types}
        self._error, self._kind = error, kind
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._decoders = {name: msgspec.msgpack.Decoder(cls) for name, cls in self.types.items()}

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode((type(message).__name__, message))

    def open(self, data: bytes) -> tuple[str, msgspec.Raw]:
        """The frame's type name and undecoded fields; the codec's error for anything but a known type."""
        try:
            name, fields = self._envelope.decode(data)
        except msgspec.ValidationError:
            raise self._error(f"not a [{self._kind} type, fields] pair") from None
        except Exception as exc:  # noqa: BLE001 - bad bytes must only ever be the codec's error
            raise self._error(f"not msgpack: {type(exc).__name__}: {exc}") from None
        if name not in self._decoders:
            raise self._error(f"unknown {self._kind} type {name[:64]!r}")
        return name, fields

    def decode_fields(self, name: str, fields: msgspec.Raw) -> msgspec.Struct:
        """The struct `name` from its fields (msgspec.ValidationError / DecodeError when they do not fit)."""
        return self._decoders[name].decode(fields)
