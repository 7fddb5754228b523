"""The decoder: bytes from a walsender into typed, immutable messages. Pure, no I/O."""

from applier.decoder.framing import Frame, encode_standby_status, read_frame
from applier.decoder.messages import *  # noqa: F403
from applier.decoder.messages import Keepalive, XLogData
from applier.decoder.pgoutput import DecodeError, Decoder, decode_message
from applier.decoder.render import render_message

__all__ = [
    "DecodeError", "Decoder", "Frame", "Keepalive", "XLogData",
    "decode_message", "encode_standby_status", "read_frame", "render_message",
]
