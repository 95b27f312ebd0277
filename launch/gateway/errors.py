"""The HTTP gateway's errors: every Lockstep error code (or the gateway's own, below) mapped to an HTTP status, in
OpenAI's error body. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import Code, LockstepError

# the gateway's own codes (never sent by the driver)
MODEL_NOT_FOUND = "model_not_found"
UNAUTHORIZED = "unauthorized"  # an admin route without the right bearer token
ADMIN_TOKEN_UNSET = "admin_token_unset"  # an admin route on a gateway that has no token configured
# a route that only works with vLLM's own NCCL communicator (TRL's weight sync: launch/gateway/trl_routes.py)
VLLM_COMMUNICATOR_UNSUPPORTED = "vllm_communicator_unsupported"

STATUS: dict[str, int] = {
    Code.BAD_FRAME: 400, Code.BAD_VERSION: 400, Code.UNKNOWN_KIND: 400, Code.BAD_FIELD: 400,
    Code.EMPTY_PROMPT: 400, Code.TOKEN_OUT_OF_VOCAB: 400, Code.PROMPT_TOO_LONG: 400, Code.BAD_MAX_NEW_TOKENS: 400,
    Code.EXCEEDS_KV_CACHE: 400, Code.NO_TOKENIZER: 400, Code.UNSUPPORTED: 400, Code.WEIGHT_UPDATE_FAILED: 400,
    Code.MISSING_TENSOR: 400, Code.UNKNOWN_TENSOR: 400, Code.SHAPE_MISMATCH: 400,
    Code.FRAME_TOO_LARGE: 413,
    UNAUTHORIZED: 401,
    Code.ADMIN_REQUIRED: 403, Code.ADMIN_DISABLED: 403, ADMIN_TOKEN_UNSET: 403,
    MODEL_NOT_FOUND: 404, Code.UNKNOWN_REQUEST: 404,
    Code.DUPLICATE_REQUEST_ID: 409, Code.NOT_PAUSE_OWNER: 409, Code.NOT_PAUSED: 409, Code.WEIGHTS_NOT_RESTORED: 409,
    Code.QUEUE_FULL: 429, Code.CLIENT_LIMIT: 429,
    Code.SAMPLING_FAILED: 500, Code.INTERNAL: 500, Code.CLIENT_FAILED: 500,
    Code.STOPPED: 503, Code.SERVER_GONE: 503, Code.RANK_FAILED: 503, Code.DRIVER_FAILED: 503,
    VLLM_COMMUNICATOR_UNSUPPORTED: 501,
    Code.PUSH_FAILED: 502, Code.PUSH_TIMEOUT: 504, Code.UNKNOWN_GROUP: 404, Code.GROUP_EXISTS: 409,
    Code.GROUP_JOIN_FAILED: 502,
    Code.WEIGHTS_DIVERGED: 503, Code.SLOW_CLIENT: 503, Code.CLIENT_CLOSED: 503, Code.MEMORY_RESTORE_FAILED: 503,
}

# the OpenAI field a driver's bad_field names (its message says `name=value`): the wire's name -> OpenAI's
PARAMS = {"seed": "seed", "temperature": "temperature", "top_p": "top_p", "logit_bias": "logit_bias",
          "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "priority": "priority",
          "structured_output": "response_format", "stale_policy": "stale_policy"}

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def status_of(code: str) -> int:
    return STATUS.get(code, 500)


@dataclass
class HttpError(Exception):
    """An error the gateway answers with `status_of(code)` and OpenAI's body."""

    code: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: LockstepError) -> "HttpError":
        """The driver's error; a bad_field names its OpenAI field in `param` where the message names it."""
        param = next((p for name, p in PARAMS.items() if f"{name}=" in error.message), None) \
            if error.code == Code.BAD_FIELD else None
        return cls(error.code, error.message, param)

    @property
    def status(self) -> int:
        return status_of(self.code)

    def body(self) -> dict:
        kind = _TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
