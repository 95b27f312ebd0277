"""OpenAI completions and chat completions on a Lockstep cluster: each prompt is one submit through `AsyncClient`,
with the call's `n` (n samples of one prompt from one prefill, cluster/samples.py): choice 0 of a prompt is the
request itself, choice i its child i - 1. Answers are OpenAI's response objects, or Server-Sent Events chunks ending
with `data: [DONE]`.

A caller that goes away cancels its requests (the gateway watches the connection; a stream closed early ends its
`AsyncClient.stream`, which cancels). A seeded call's choices differ (the driver keys a child's noise by the seed
and its index) and each samples the same tokens each time; choice 0 samples what the call with n = 1 samples.
Torch-free."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any, AsyncIterator, Awaitable, Callable

from cluster.client import AsyncClient
from cluster.errors import ClientError, Code
from launch.gateway.echo_logprobs import finite, joined, prompt_logprobs
from launch.gateway.errors import MODEL_NOT_FOUND, HttpError
from launch.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from cluster.outputs import GenerationOutput
from cluster.samples import child_id


@dataclass
class Model:
    """What the gateway serves: the name OpenAI clients use, the checkpoint path, and its tokenizer (or None)."""

    name: str
    path: str | None
    tokenizer: Any = None

    def matches(self, name: str) -> bool:
        return name in (self.name, self.path)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"

    @cached_property
    def bos_text(self) -> str | None:
        """The BOS token's text when encoding a text prompt prepends it (transformers' default for Llama-style
        tokenizers, and the front door encodes with it), else None."""
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        if tok is None or not bos or tok("x")["input_ids"][:1] != [tok.bos_token_id]:
            return None
        return bos

    def prompt_source(self, prompt: str | list[int]) -> dict[str, Any]:
        """A completions prompt as its submit carries it: token ids as given; text without a leading BOS text when
        encoding prepends BOS anyway, so the prompt gets one BOS, not two. lm-evaluation-harness's text requests are
        its token requests decoded (BOS included), and its hf backend encodes such a string without adding another
        (vLLM's completions keep both)."""
        if not isinstance(prompt, str):
            return {"input_ids": prompt}
        bos = self.bos_text
        return {"text": prompt[len(bos):] if bos and prompt.startswith(bos) else prompt}


@dataclass
class Choice:
    """One choice of a call: its submit and what has been reported of its output so far."""

    index: int
    source: dict[str, Any]  # input_ids or text
    request_id: str
    group: list["Choice"]  # the choices of its prompt, one submit: group[0] is the request, the others its children
    text: str = ""
    tokens: int = 0
    last: GenerationOutput | None = None
    echo: str = ""  # the prompt's text, when the call asked for it before the completion (`echo`)
    chars: int = 0  # the running length of the reported tokens' texts (their logprobs' text_offset)

    def submit(self, params: dict[str, Any]) -> dict[str, Any]:
        """The keywords of its prompt's one submit (call it on group[0])."""
        return params | {"text": self.source.get("text"), "request_id": self.request_id, "n": len(self.group)}

    def advance(self, out: GenerationOutput) -> tuple[str, Tokens]:
        """The text and tokens (with their logprobs) new in `out` since the last call."""
        text = getattr(out, "text", None) or ""
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += delta
        start, self.tokens, self.last = self.tokens, len(out.generated_tokens), out
        top = out.top_logprobs[start:self.tokens] if out.top_logprobs is not None else None
        return delta, Tokens(out.generated_tokens[start:], list(out.logprobs[start:self.tokens]), top)


@dataclass
class Tokens:
    """Some of a choice's tokens, their logprobs and (asked for) their most probable alternatives."""

    ids: list[int]
    logprobs: list[float]
    top: list | None = None


def finish_reason(out: GenerationOutput, max_new_tokens: int | None) -> str:
    """OpenAI's finish_reason: the server's (stop string or EOS: "stop"; a limit: "length"); "abort" (a pause of mode
    abort) and "stale" (beyond max_weight_lag) pass through as vLLM passes "abort" (docs/http.md)."""
    reason = getattr(out, "finish_reason", None)
    if reason in ("stop", "length", "abort", "stale"):
        return reason
    return "length" if max_new_tokens is not None and len(out.generated_tokens) >= max_new_tokens else "stop"


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **template: Any) -> list[int]:
    """A conversation rendered by the tokenizer's chat template (`template`: add_generation_prompt, tools, the
    template's own keywords) as token ids, no special tokens added (the template writes them), as vLLM does."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise HttpError(Code.NO_TOKENIZER, "this checkpoint has no tokenizer with a chat template", "messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def until_done_or_gone(work: Awaitable[Any], gone: Callable[[], Awaitable[bool]], every_s: float = 0.25) -> Any:
    """Await `work`, cancelling it (and raising CancelledError) once `gone()` says the caller left."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            if await gone():
                task.cancel()
                raise asyncio.CancelledError("the HTTP client disconnected")
    finally:
        if not task.done():
            task.cancel()


class OpenAIServing:
    def __init__(self, client: AsyncClient, model: Model):
        self.client, self.model = client, model

    # ------------------------------------------------------------------ requests -> choices
    def parts(self, body: CompletionRequest | ChatCompletionRequest, chat: bool) -> tuple[list[Choice], dict[str, Any]]:
        """The call's choices (n per prompt: the prompt's request and its children) and their submit keywords."""
        if not self.model.matches(body.model):
            raise HttpError(MODEL_NOT_FOUND, f"the model {body.model!r} does not exist; this server serves "
                                             f"{self.model.name!r}", "model")
        params = body.params(self.model.tokenizer is not None)
        prompts = [] if chat else body.prompts()
        sources = ([{"input_ids": self.chat_prompt(body)}] if chat else [self.model.prompt_source(p) for p in prompts])
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echo = [""] if chat else [self.prompt_text(p) if body.echo else "" for p in prompts]
        choices: list[Choice] = []
        for p, src in enumerate(sources):
            rid = f"{base}-{p}"
            group: list[Choice] = []
            group += [Choice(p * body.n + i, src, child_id(rid, i - 1) if i else rid, group, echo=echo[p])
                      for i in range(body.n)]
            choices += group
        return choices, params

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt's text (`echo`): as sent, or its token ids decoded (empty without a tokenizer)."""
        if isinstance(prompt, str):
            return prompt
        tok = self.model.tokenizer
        return tok.decode(prompt, skip_special_tokens=True) if tok is not None else ""

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        return chat_ids(self.model.tokenizer, [m.for_template() for m in body.messages],
                        add_generation_prompt=body.add_generation_prompt)

    # ------------------------------------------------------------------ running choices
    def _cancel(self, choices: list[Choice]) -> None:
        """Best effort: tell the server to drop these requests (nobody waits for the replies)."""
        for c in choices:
            if c.last is None or not c.last.is_finished():
                fut = asyncio.ensure_future(self.client.cancel(c.request_id))
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _run(self, choices: list[Choice], params: dict[str, Any]) -> None:
        """Every choice to its final output (a non-streaming call); cancelled: the server drops them."""
        async def one(lead: Choice) -> None:
            try:
                outs = await self.client.generate(lead.source.get("input_ids"), **lead.submit(params))
            except ClientError as e:
                raise HttpError.of(e) from None
            by_id = {o.request_id: o for o in (outs if isinstance(outs, list) else [outs])}
            for c in lead.group:
                c.advance(by_id[c.request_id])
        try:
            await asyncio.gather(*(one(c) for c in choices if c is c.group[0]))
        except BaseException:
            self._cancel(choices)
            raise

    async def _open_stream(self, c: Choice, params: dict[str, Any]
                           ) -> tuple[AsyncIterator[GenerationOutput], GenerationOutput]:
        """A prompt's stream (its n samples' outputs) and its first output (so a refusal comes before any byte of
        the answer)."""
        stream = self.client.stream(c.source.get("input_ids"), **c.submit(params))
        try:
            return stream, await stream.__anext__()
        except ClientError as e:
            await stream.aclose()
            raise HttpError.of(e) from None

    async def _stream(self, choices: list[Choice], params: dict[str, Any]
                      ) -> AsyncIterator[tuple[Choice, GenerationOutput] | None]:
        """None once every choice was accepted (or a refusal raises), then every output as it comes."""
        leads = [c for c in choices if c is c.group[0]]
        opened = await asyncio.gather(*(self._open_stream(c, params) for c in leads), return_exceptions=True)
        failed = [o for o in opened if isinstance(o, BaseException)]
        if failed:
            for o in opened:
                if not isinstance(o, BaseException):
                    await o[0].aclose()
            raise failed[0]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(lead: Choice, stream: AsyncIterator[GenerationOutput], first: GenerationOutput) -> None:
            by_id = {c.request_id: c for c in lead.group}
            try:
                await queue.put((by_id[first.request_id], first))
                if len(lead.group) > 1 or not first.is_finished():
                    async for out in stream:
                        await queue.put((by_id[out.request_id], out))
            except Exception as e:  # handed to the reader
                await queue.put((lead, e))
            finally:
                await stream.aclose()  # ends (and, unfinished, cancels) the requests on the server

        tasks = [asyncio.ensure_future(pump(c, *o)) for c, o in zip(leads, opened)]
        try:
            yield None
            left = len(choices)
            while left:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise HttpError.of(item) if isinstance(item, ClientError) else item
                left -= item.is_finished()
                yield c, item
        finally:
            for t in tasks:
                t.cancel()

    # ------------------------------------------------------------------ answers
    def _usage(self, choices: list[Choice]) -> dict[str, int]:
        prompt = sum({id(c.source): len(c.last.prompt_ids) for c in choices if c.last is not None}.values())
        done = sum(c.tokens for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprobs(self, body: Any, chat: bool, c: Choice, tokens: Tokens) -> Any:
        """OpenAI's logprobs of these tokens of choice `c` (their text_offset from the running length of its tokens'
        texts, after the echoed prompt), None when the call asked none."""
        if (not body.logprobs) if chat else body.logprobs is None:
            return None
        text = self.model.token_text
        texts = [text(t) for t in tokens.ids]
        logprobs = [finite(lp) for lp in tokens.logprobs]
        tops = [[(text(t), finite(lp)) for t, lp in alts] for alts in tokens.top] if tokens.top is not None \
            else [[] for _ in texts]
        if chat:
            def entry(s: str, lp: float) -> dict[str, Any]:
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [entry(s, lp) | {"top_logprobs": [entry(*a) for a in alts]}
                                for s, lp, alts in zip(texts, logprobs, tops)]}
        offsets = list(accumulate(map(len, texts), initial=c.chars + len(c.echo)))
        c.chars = offsets.pop() - len(c.echo)
        # OpenAI's and vLLM's: the top `logprobs` tokens and the chosen one (logprobs=0: the chosen one alone)
        return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets,
                "top_logprobs": [dict(alts) | {s: lp} for s, lp, alts in zip(texts, logprobs, tops)]}

    def _head(self, choices: list[Choice], chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" + ".chunk" * chunk) if chat else "text_completion"
        return {"id": choices[0].request_id.rsplit("-", 1)[0], "created": int(time.time()), "model": self.model.name,
                "object": kind, "system_fingerprint": None}

    async def respond(self, body: Any, chat: bool, choices: list[Choice], params: dict[str, Any]) -> dict:
        """The whole answer of a non-streaming call."""
        await self._run(choices, params)
        limit = params.get("max_new_tokens")
        score_only = not chat and body.max_tokens == 0  # one prefill: its one sampled token is not reported
        out_choices = []
        for c in choices:
            out = c.last
            if score_only:
                c.text, c.tokens = "", 0
            lp = self._logprobs(body, chat, c, Tokens([], []) if score_only else
                                Tokens(out.generated_tokens, out.logprobs, out.top_logprobs))
            if not chat and body.scores_prompt():
                lp = joined(prompt_logprobs(out, self.model.token_text), lp)
            d: dict[str, Any] = {"index": c.index, "logprobs": lp, "finish_reason": finish_reason(c.last, limit)}
            d |= {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.echo + c.text}
            if body.return_token_ids:  # vLLM's: the prompt's and the completion's token ids
                d |= {"prompt_token_ids": list(out.prompt_ids), "token_ids": out.generated_tokens[:c.tokens]}
            out_choices.append(d)
        answer = self._head(choices, chat, False) | {"choices": out_choices, "usage": self._usage(choices)}
        if chat and body.return_token_ids:  # vLLM's chat answer carries them at the top too
            answer["prompt_token_ids"] = out_choices[0]["prompt_token_ids"]
        return answer

    async def stream_events(self, body: Any, chat: bool, choices: list[Choice], params: dict[str, Any]
                            ) -> AsyncIterator[str]:
        """The SSE chunks of a streaming call, ending with `data: [DONE]` (after one `error` chunk, on an error)."""
        limit = params.get("max_new_tokens")
        usage_on = body.include_usage()
        head = self._head(choices, chat, True)
        extra = {"usage": None} if usage_on else {}
        outputs = self._stream(choices, params)
        await outputs.__anext__()  # every choice accepted (a refusal raises here, before any chunk)
        if chat:
            for c in choices:
                yield sse(head | {"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]} | extra)
        try:
            echoed: set[int] = set()
            ids_sent: set[int] = set()
            async for c, out in outputs:
                delta, new = c.advance(out)
                reason = finish_reason(out, limit) if out.is_finished() else None
                if not (delta or new.ids or reason):
                    continue
                lp = self._logprobs(body, chat, c, new) if new.ids else None
                if c.echo and c.index not in echoed:  # the prompt's text comes first, in the choice's first chunk
                    echoed.add(c.index)
                    delta = c.echo + delta
                d: dict[str, Any] = {"index": c.index, "logprobs": lp, "finish_reason": reason}
                d |= {"delta": {"content": delta} if delta or not reason else {}} if chat else {"text": delta}
                if body.return_token_ids:  # the prompt's ids in a choice's first chunk, then each chunk's new ids
                    d |= {"token_ids": new.ids} | ({} if c.index in ids_sent else {"prompt_token_ids": out.prompt_ids})
                    ids_sent.add(c.index)
                yield sse(head | {"choices": [d]} | extra)
            if usage_on:
                yield sse(head | {"choices": [], "usage": self._usage(choices)})
        except HttpError as e:
            yield sse(e.body())
        finally:
            await outputs.aclose()
        yield sse("[DONE]")
