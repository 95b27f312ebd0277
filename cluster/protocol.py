"""The wire format between clients and the front door: one msgpack map a ZeroMQ frame with `v`, `kind` and `mid`.
docs/protocol.md is the contract; this module its only implementation. Decoding is strict and never runs code."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from cluster.errors import Code  # noqa: F401  (the codes live with the typed errors)
from cluster.pause import PAUSE_MODES
from cluster.samples import MAX_SAMPLES

PROTOCOL_VERSION = 1
DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_MAX_FRAME_BYTES = 4 << 20

# client -> server
SUBMIT, CANCEL, PAUSE, RESUME, UPDATE_WEIGHTS, STATS, HEALTH, PING, BYE = (
    "submit", "cancel", "pause", "resume", "update_weights", "stats", "health", "ping", "bye")
RELEASE_MEMORY, RESUME_MEMORY = "release_memory", "resume_memory"  # docs/protocol.md, "Releasing memory"
WEIGHTS_GROUP = "weights_group"  # a weight-sync group the trainer owns (cluster/group_wire.py)
CLIENT_KINDS = (SUBMIT, CANCEL, PAUSE, RESUME, UPDATE_WEIGHTS, STATS, HEALTH, PING, BYE, RELEASE_MEMORY,
                RESUME_MEMORY, WEIGHTS_GROUP)
ADMIN_KINDS = (PAUSE, RESUME, UPDATE_WEIGHTS, RELEASE_MEMORY, RESUME_MEMORY, WEIGHTS_GROUP)  # admin only ("Admin")
MEMORY_TAGS = ("kv_cache", "weights")  # what release_memory / resume_memory may name
# server -> client
ACCEPTED, REJECTED, TOKENS, FINAL, REPLY, ERROR, PONG = (
    "accepted", "rejected", "tokens", "final", "reply", "error", "pong")

# a submit's `sampling` map: parameter -> wire type (the values' ranges are checked where requests are built,
# driver/api/validation.py, for the wire and the manager API alike; docs/protocol.md "Sampling parameters")
SAMPLING_FIELDS = {"do_sample": bool, "temperature": (int, float), "top_k": int, "top_p": (int, float),
                   "repetition_penalty": (int, float), "seed": int,
                   # transformers' generation options (values: driver/api/option_checks.py)
                   "min_new_tokens": int, "min_length": int, "no_repeat_ngram_size": int, "bad_words_ids": list,
                   "sequence_bias": list, "forced_bos_token_id": int, "forced_eos_token_id": (int, list),
                   "suppress_tokens": list, "begin_suppress_tokens": list,
                   # OpenAI's additive sampling controls (values: driver/api/option_checks.py, validation.py)
                   "logit_bias": list, "presence_penalty": (int, float), "frequency_penalty": (int, float),
                   # a structured output (driver/engine/structured.py): {"json_schema": {...}} | {"json_object":
                   # true} | {"regex": str} | {"grammar": Lark text}
                   "structured_output": dict}
MAX_EOS_TOKEN_IDS = 64  # ids in one request's eos_token_id list
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # a submit's `stop`: at most 16 strings of 1..256 characters
# a submit's `priority` (vLLM's meaning: lower first; docs/protocol.md "Priority and fairness"): a 32-bit integer
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1
MAX_TOP_LOGPROBS = 20  # a submit's `top_logprobs`: each token's most probable alternatives, 0..20


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, mid: Any = None, request_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.mid, self.request_id = code, message, mid, request_id


def encode(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "kind": kind, **fields}, use_bin_type=True)


def unpack_map(frame: bytes, max_frame_bytes: int, max_map_len: int = 64) -> dict[str, Any]:
    """A msgpack map under strict limits, or ProtocolError."""
    if len(frame) > max_frame_bytes:
        raise ProtocolError(Code.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {max_frame_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True,
                              max_str_len=1 << 20, max_bin_len=max_frame_bytes, max_array_len=1 << 20,
                              max_map_len=max_map_len, max_ext_len=0)
    except Exception as e:  # msgpack raises several types for bad input
        raise ProtocolError(Code.BAD_FRAME, f"not a msgpack frame: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(Code.BAD_FRAME, f"a message must be a map, got {type(msg).__name__}")
    return msg


def decode_reply(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    """A server message, as a client reads it."""
    return unpack_map(frame, max_frame_bytes, max_map_len=1 << 16)


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    """A client message, or ProtocolError naming what is wrong with the frame."""
    msg = unpack_map(frame, max_frame_bytes)
    mid = msg.get("mid")
    if not isinstance(mid, (int, str, type(None))) or isinstance(mid, bool):
        raise _bad("mid must be an integer or a string")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(Code.BAD_VERSION, f"protocol version {msg.get('v')!r}; this server speaks "
                                              f"{PROTOCOL_VERSION}", mid)
    if msg.get("kind") not in CLIENT_KINDS:
        raise ProtocolError(Code.UNKNOWN_KIND, f"unknown message kind {msg.get('kind')!r}", mid)
    return msg


@dataclass
class Submit:
    """A checked submit message (types only; the prompt's content is checked by the engine's rules)."""

    mid: Any
    request_id: str | None
    input_ids: list[int] | None
    text: str | None
    max_new_tokens: int | None
    streaming: bool
    sampling: dict[str, Any]
    eos_token_id: int | list[int] | None
    # a resume (docs/recovery.md): the tokens already delivered, their compact weight versions, the resume count
    resume_tokens: list[int] | None = None
    resume_versions: list[list[int]] | None = None
    resumes: int = 0
    stop: list[str] | None = None  # stop strings (text is on)
    return_text: bool = False  # text outputs even for an input_ids submit without stop strings
    logprobs: bool = False  # the chosen tokens' logprobs, also in streamed `tokens`
    priority: int = 0  # lower numbers are scheduled first (the range is checked where the request is built)
    top_logprobs: int = 0  # 1..MAX_TOP_LOGPROBS: each token's most probable alternatives with their logprobs
    max_weight_lag: int | None = None  # None: the preset's (values checked where the request is built)
    stale_policy: str | None = None  # "end" or "restart"; None: the preset's
    prompt_logprobs: int | None = None  # 0..MAX_TOP_LOGPROBS: the prompt's logprobs with that many alternatives
    logprobs_mode: str | None = None  # vLLM's (cluster.config.LOGPROBS_MODES); None: the preset's
    speculative: bool = True  # False: it never speculates (docs/speculative.md)
    n: int = 1  # samples of the prompt (cluster/samples.py: its children `<id>__child#<i>` and itself), one prefill

    @property
    def wants_text(self) -> bool:
        """Its outputs carry text: it was sent as text, has stop strings, or asked for text."""
        return self.text is not None or bool(self.stop) or self.return_text


def field(msg: dict, name: str, types: Any, default: Any = None, required: bool = False) -> Any:
    if name not in msg or msg[name] is None:
        if required:
            raise _bad(f"field {name!r} is required", msg.get("mid"))
        return default
    value, allowed = msg[name], types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):  # a bool is an int
        raise _bad(f"field {name!r} must be {' or '.join(t.__name__ for t in allowed)}, got {type(value).__name__}",
                   msg.get("mid"))
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(message: str, mid: Any = None, request_id: str | None = None) -> ProtocolError:
    return ProtocolError(Code.BAD_FIELD, message, mid, request_id)


def parse_submit(msg: dict) -> Submit:
    mid = msg.get("mid")
    ids = field(msg, "input_ids", list)
    text = field(msg, "text", str)
    if (ids is None) == (text is None):
        raise _bad("a submit carries exactly one of input_ids and text", mid)
    if ids is not None and not all(_is_int(t) for t in ids):
        raise _bad("input_ids must be a list of integers", mid)
    sampling = field(msg, "sampling", dict, default={})
    for k, v in sampling.items():
        if k not in SAMPLING_FIELDS:
            raise _bad(f"unknown sampling parameter {k!r}", mid)
        field(sampling | {"mid": mid}, k, SAMPLING_FIELDS[k])
    eos = msg.get("eos_token_id")
    if isinstance(eos, list) and len(eos) > MAX_EOS_TOKEN_IDS:
        raise _bad(f"eos_token_id lists {len(eos)} ids; at most {MAX_EOS_TOKEN_IDS} are allowed", mid)
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
        raise _bad("eos_token_id must be an integer or a list of integers", mid)
    rid = field(msg, "request_id", str)
    if rid is not None and len(rid) > MAX_REQUEST_ID_CHARS:
        raise _bad(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed", mid)
    resume_tokens = field(msg, "resume_tokens", list)
    if resume_tokens is not None and not all(_is_int(t) for t in resume_tokens):
        raise _bad("resume_tokens must be a list of integers", mid, rid)
    versions = field(msg, "resume_versions", list)
    if versions is not None and not all(isinstance(p, list) and len(p) == 2 and all(map(_is_int, p)) for p in versions):
        raise _bad("resume_versions must be a list of [index, version] pairs", mid, rid)
    return Submit(mid=mid, request_id=rid, input_ids=ids, text=text,
                  max_new_tokens=field(msg, "max_new_tokens", int), streaming=field(msg, "streaming", bool, False),
                  sampling=sampling, eos_token_id=eos, resume_tokens=resume_tokens, resume_versions=versions,
                  resumes=field(msg, "resumes", int, 0), stop=check_stop(msg.get("stop"), mid, rid),
                  return_text=field(msg, "return_text", bool, False), logprobs=field(msg, "logprobs", bool, False),
                  priority=field(msg, "priority", int, 0), top_logprobs=check_top_logprobs(msg, mid, rid),
                  max_weight_lag=field(msg, "max_weight_lag", int), stale_policy=field(msg, "stale_policy", str),
                  n=check_samples(msg, mid, rid), prompt_logprobs=check_prompt_logprobs(msg, mid, rid),
                  logprobs_mode=field(msg, "logprobs_mode", str), speculative=field(msg, "speculative", bool, True))


def pause_mode(msg: dict) -> str:
    """A pause message's `mode` (default "keep"): one of PAUSE_MODES (docs/protocol.md, "Client to server")."""
    mode = field(msg, "mode", str, "keep")
    if mode not in PAUSE_MODES:
        raise _bad(f"mode={mode!r}: a pause's mode must be one of {', '.join(PAUSE_MODES)}", msg.get("mid"))
    return mode


def check_samples(msg: dict, mid: Any = None, rid: str | None = None) -> int:
    """A submit's `n`: an integer in [1, MAX_SAMPLES] (the samples' ids derive from the request's: `accepted`'s)."""
    n = field(msg, "n", int, 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise _bad(f"n={n}; it must be an integer in [1, {MAX_SAMPLES}]", mid, rid)
    return n


def check_top_logprobs(msg: dict, mid: Any = None, rid: str | None = None) -> int:
    """A submit's `top_logprobs`: an integer in [0, MAX_TOP_LOGPROBS]."""
    k = field(msg, "top_logprobs", int, 0)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs={k}; it must be an integer in [0, {MAX_TOP_LOGPROBS}]", mid, rid)
    return k


def check_prompt_logprobs(msg: dict, mid: Any = None, rid: str | None = None) -> int | None:
    """A submit's `prompt_logprobs` (vLLM's): absent, or an integer in [0, MAX_TOP_LOGPROBS]."""
    k = field(msg, "prompt_logprobs", int)
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise _bad(f"prompt_logprobs={k}; it must be an integer in [0, {MAX_TOP_LOGPROBS}]", mid, rid)
    return k


def check_stop(value: Any, mid: Any = None, rid: str | None = None) -> list[str] | None:
    """A submit's stop strings: a list of at most MAX_STOP_STRINGS strings of 1..MAX_STOP_CHARS characters."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and 1 <= len(v) <= MAX_STOP_CHARS for v in value):
        raise _bad(f"stop must be a list of strings of 1 to {MAX_STOP_CHARS} characters", mid, rid)
    if len(value) > MAX_STOP_STRINGS:
        raise _bad(f"stop lists {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed", mid, rid)
    return value or None


def check_memory_tags(value: Any, mid: Any = None) -> list[str]:
    """A release_memory / resume_memory's `tags` (absent: both): a non-empty list of MEMORY_TAGS."""
    if value is None:
        return list(MEMORY_TAGS)
    if not isinstance(value, list) or not value or not all(v in MEMORY_TAGS for v in value):
        raise _bad(f"tags must be a non-empty list of {list(MEMORY_TAGS)}", mid)
    return value


# ---------------------------------------------------------------- update_weights (push source)
PUSH_DTYPES = ("float32", "float16", "bfloat16")
_HOST_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def _is_host(host: str) -> bool:
    """A hostname (RFC 1123 labels) or an IP literal (IPv6 in brackets)."""
    try:
        if host.startswith("[") and host.endswith("]"):
            return ipaddress.ip_address(host[1:-1]).version == 6
        ipaddress.ip_address(host)
        return True
    except ValueError:  # brackets are no hostname's
        return 0 < len(host) <= 253 and all(_HOST_LABEL.match(label) for label in host.split("."))


def check_store(value: Any, mid: Any = None) -> str:
    """`host:port` of a trainer's store, every rank dials it: a hostname or IP literal and a port in 1..65535."""
    if not isinstance(value, str) or value.count(":") < 1:
        raise _bad("store must be 'host:port'", mid)
    host, port = value.rsplit(":", 1)
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535 and len(port) <= 5):
        raise _bad("store: the port must be a number in 1..65535", mid)
    if not _is_host(host):
        raise _bad("store: the host must be a hostname or an IP literal", mid)
    return value


def check_buckets(value: Any, mid: Any = None) -> list[list[list[Any]]]:
    """Buckets of a push: non-empty lists of [name, shape (ints >= 0), dtype], one dtype of PUSH_DTYPES a bucket."""
    if not isinstance(value, list) or not value:
        raise _bad("buckets must be a non-empty list of buckets", mid)
    for b, bucket in enumerate(value):
        if not isinstance(bucket, list) or not bucket:
            raise _bad(f"bucket {b} must be a non-empty list of [name, shape, dtype]", mid)
        for entry in bucket:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]
                    and isinstance(entry[1], list) and isinstance(entry[2], str)):
                raise _bad(f"bucket {b}: every entry is [name, shape, dtype]", mid)
            if not all(_is_int(d) and 0 <= d < 1 << 40 for d in entry[1]):
                raise _bad(f"bucket {b}: a shape is a list of non-negative integers", mid)
            if entry[2] not in PUSH_DTYPES or entry[2] != bucket[0][2]:
                raise _bad(f"bucket {b}: dtype must be one of {PUSH_DTYPES}, one per bucket", mid)
    return value
