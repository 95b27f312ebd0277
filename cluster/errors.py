"""Typed errors with codes, one catalogue for the engine, the wire and the clients: callers branch on the type or
the `code`, never on message text. Torch-free."""

from __future__ import annotations


class Code:
    """Error codes of `rejected` and `error` replies (docs/protocol.md lists when each is sent)."""

    BAD_FRAME = "bad_frame"  # not msgpack, or not a map
    FRAME_TOO_LARGE = "frame_too_large"
    BAD_VERSION = "bad_version"
    UNKNOWN_KIND = "unknown_kind"
    BAD_FIELD = "bad_field"  # a field missing, of the wrong type, or out of its range
    EMPTY_PROMPT = "empty_prompt"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    PROMPT_TOO_LONG = "prompt_too_long"
    BAD_MAX_NEW_TOKENS = "bad_max_new_tokens"
    EXCEEDS_KV_CACHE = "exceeds_kv_cache"  # prompt + max_new_tokens can never fit the whole cache
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    UNKNOWN_REQUEST = "unknown_request"
    QUEUE_FULL = "queue_full"
    CLIENT_LIMIT = "client_limit"  # this client has max_inflight_per_client requests in flight
    NO_TOKENIZER = "no_tokenizer"
    UNSUPPORTED = "unsupported"
    ADMIN_REQUIRED = "admin_required"  # pause/resume/update_weights from a client that is not an admin
    ADMIN_DISABLED = "admin_disabled"  # the preset turned admin operations off
    NOT_PAUSE_OWNER = "not_pause_owner"  # another client holds the pause
    SLOW_CLIENT = "slow_client"  # (in `error`) the client stopped reading; its requests were cancelled
    SAMPLING_FAILED = "sampling_failed"  # (in `error`) sampling this request's token failed; others go on
    STOPPED = "stopped"  # the manager is stopping or stopped: no new requests
    RANK_FAILED = "rank_failed"  # (in `error`) a rank died or stopped answering; the message names it
    DRIVER_FAILED = "driver_failed"  # (in `error`) the driver's own loop failed (no other rank did)
    WEIGHT_UPDATE_FAILED = "weight_update_failed"
    WEIGHTS_DIVERGED = "weights_diverged"  # a rank failed while copying new weights: ranks now differ
    NOT_PAUSED = "not_paused"  # release_memory on an engine that is not paused (docs/weights.md, "Releasing memory")
    WEIGHTS_NOT_RESTORED = "weights_not_restored"  # resume_memory("weights") with no host copy and no update since
    MEMORY_RESTORE_FAILED = "memory_restore_failed"  # a rank could not take its memory back (out of memory ...)
    # why a weight update was refused (WeightUpdateError.reason_code; the refusing rank's WeightRefused.code)
    MISSING_TENSOR = "missing_tensor"  # a full update lacks a tensor of the model (partial=True allows it)
    UNKNOWN_TENSOR = "unknown_tensor"  # a partial update names a tensor the model does not have
    SHAPE_MISMATCH = "shape_mismatch"  # a tensor's shape (or dtype kind) is not the model's
    PUSH_TIMEOUT = "push_timeout"  # a member of a push went silent for push_timeout_s (`phase` says where)
    PUSH_FAILED = "push_failed"  # a member of a push failed or went away (`phase` says where)
    # a weight-sync group the trainer owns (docs/weights.md, "A weight-sync group the trainer owns")
    UNKNOWN_GROUP = "unknown_group"  # a call names a group this engine has not joined
    GROUP_EXISTS = "group_exists"  # init of a group name this engine has joined already
    GROUP_JOIN_FAILED = "group_join_failed"  # a rank could not join the trainer's group (or make its backend)
    SERVER_GONE = "server_gone"  # client side: the server stopped answering
    CLIENT_FAILED = "client_failed"  # client side: the client's own I/O thread failed
    CLIENT_CLOSED = "client_closed"  # client side: the client was closed while the call was outstanding
    INTERNAL = "internal"


class LockstepError(Exception):
    """Base of Lockstep's typed errors; `code` is one of `Code`."""

    code = Code.INTERNAL

    def __init__(self, message: str, code: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message, self.request_id = message, request_id
        if code is not None:
            self.code = code


class RequestRejected(LockstepError, ValueError):
    """A request (or one of its values) that cannot be accepted; raised before anything runs."""

    code = Code.BAD_FIELD


class UnsupportedModel(LockstepError, ValueError):
    """A checkpoint's config asks for something Lockstep does not serve exactly (an architecture, a rope type, an
    activation, a size that does not split over the ranks); the message names it. Raised at load."""

    code = Code.UNSUPPORTED


class SpeculativeConfigError(LockstepError, ValueError):
    """A `speculative` setting that cannot work (an unknown method, a count out of its range); `field` names it."""

    code = Code.BAD_FIELD

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFull(LockstepError, RuntimeError):
    code = Code.QUEUE_FULL


class ManagerStopped(LockstepError, RuntimeError):
    """The manager's loop has stopped or died: it takes no new requests."""

    code = Code.STOPPED


class ClientError(LockstepError, RuntimeError):
    """The server rejected a message or failed a request; `code` is one of `Code`."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        LockstepError.__init__(self, message, code, request_id)
        self.args = (f"{code}: {message}",)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class ServerGone(ClientError):
    """The server stopped answering (driver dead, network gone): every outstanding call ends with this."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(Code.SERVER_GONE, message, request_id)


class WeightRefused(LockstepError, ValueError):
    """One rank's reason to refuse a weight update (its vote): `code` says which (missing_tensor, unknown_tensor,
    shape_mismatch, push_timeout, push_failed; weight_update_failed otherwise), `tensor` the name it is about,
    `phase` where a push gave up (handshake, group, bucket i/n, agree)."""

    code = Code.WEIGHT_UPDATE_FAILED

    def __init__(self, message: str, code: str | None = None, tensor: str | None = None, phase: str | None = None):
        super().__init__(message, code)
        self.tensor, self.phase = tensor, phase


class ModelRefused(LockstepError, ValueError):
    """A checkpoint Lockstep cannot serve, refused at load before any weight is read: `model_type`, the `layer` it is
    about (a module path or layer index; None: the model as a whole) and the `reason` (docs/models.md, "The generic
    path")."""

    code = Code.UNSUPPORTED

    def __init__(self, model_type: str, layer: str | None, reason: str):
        super().__init__(f"model_type {model_type!r}: {layer + ': ' if layer else ''}{reason}")
        self.model_type, self.layer, self.reason = model_type, layer, reason


class WeightUpdateError(ClientError):
    """A weight update was refused; nothing changed on any rank. `rank`: the first that refused, `reason` its word;
    `reason_code`, `tensor`, `phase`: that rank's WeightRefused fields (from the result map)."""

    def __init__(self, reason: str, rank: int | None = None, result: dict | None = None):
        where = f"rank {rank}: " if rank is not None and not reason.startswith("rank ") else ""
        super().__init__(Code.WEIGHT_UPDATE_FAILED, f"weight update refused: {where}{reason}")
        self.rank, self.reason, self.result = rank, reason, result or {}
        self.reason_code: str = self.result.get("reason_code") or Code.WEIGHT_UPDATE_FAILED
        self.tensor: str | None = self.result.get("tensor")
        self.phase: str | None = self.result.get("phase")


class CallRefused(ClientError):
    """An admin call every rank refused alike (nothing changed): `code` says why, `rank` the first rank that
    refused, `result` the whole answer."""

    def __init__(self, code: str, message: str, rank: int | None = None, result: dict | None = None):
        super().__init__(code, message)
        self.rank, self.result = rank, result or {}


class MemoryCallRefused(CallRefused):
    """A `release_memory` / `resume_memory` that was refused (or could not restore) on every rank alike; `code` says
    why (not_paused, weights_not_restored, memory_restore_failed, bad_field), `rank` the first rank that refused."""


class WeightsGroupError(CallRefused):
    """A `weights_group` call (init, destroy) refused on every rank alike: `code` says why (unknown_group,
    group_exists, group_join_failed, bad_field), `rank` the first rank that refused; nothing is left joined."""


class RequestLost(ClientError):
    """The server lost a request and the client did not resume it. `code` is the failure's; `reason` why there was
    no resume (one of the names below); `tokens_delivered` and `resumes` what this client received and made."""

    RESUME_OFF = "resume_off"  # the client was made with resume=False
    MAX_RESUMES = "max_resumes"  # it was lost again after max_resumes resumes
    NO_SERVER = "no_healthy_server"  # no healthy server answered within resume_timeout_s
    CLIENT_CLOSED = "client_closed"  # the client itself gave up (closed) while the request was lost
    REFUSED = "refused"  # the server refused the resume (the message says why)

    def __init__(self, code: str, message: str, request_id: str | None, reason: str, tokens_delivered: int,
                 resumes: int):
        super().__init__(code, f"{message} [not resumed: {reason}; {tokens_delivered} token(s) delivered, "
                               f"{resumes} resume(s)]", request_id)
        self.reason, self.tokens_delivered, self.resumes = reason, tokens_delivered, resumes
