"""Protocol v1: the event envelope, the kind registry, control messages, the codec.

Imports nothing of ours and nothing outside the standard library.
"""
from .codec import (
    MAX_DEPTH,
    MAX_EVENT_BYTES,
    MAX_FRAME_BYTES,
    MAX_KEYS,
    decode_event,
    decode_json,
    decode_reply,
    decode_request,
    encode_event,
    encode_json,
    encode_reply,
    encode_request,
)
from .control import (
    ErrorReply,
    Hello,
    HelloReply,
    Manifest,
    ManifestReply,
    Renew,
    RenewReply,
    Reply,
    Request,
    Since,
    SinceReply,
)
from .envelope import PROTOCOL_VERSION, SEVERITIES, Event, severity_rank
from .errors import ProtocolError
from .kinds import KindSpec, default_sev, is_telemetry, spec

# The package version (one source: pyproject.toml reads it from here).
__version__ = "0.1.0"
PACKAGE_VERSION = __version__

__all__ = [
    "MAX_DEPTH", "PACKAGE_VERSION", "MAX_EVENT_BYTES", "MAX_FRAME_BYTES", "MAX_KEYS", "PROTOCOL_VERSION",
    "SEVERITIES", "ErrorReply", "Event", "Hello", "HelloReply", "KindSpec", "Manifest", "ManifestReply",
    "ProtocolError", "Renew", "RenewReply",
    "Reply", "Request", "Since", "SinceReply", "decode_event", "decode_json", "decode_reply",
    "decode_request", "default_sev", "encode_event", "encode_json", "encode_reply",
    "encode_request", "is_telemetry", "severity_rank", "spec",
]
