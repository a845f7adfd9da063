"""What the probe model says and what the server sends: the bytes of a reply as the client sees them —
a complete JSON body of each endpoint, an SSE stream (whole or chunk-split: cumulative ``text`` on
``/generate``, deltas on the OpenAI endpoints), an error body of every shape."""

from __future__ import annotations

import json
import random

from kvchaos import canary
from kvchaos.probe import COMMITTED

ROUTER = "http://127.0.0.1:30000"
PREFILL = "http://127.0.0.1:30100"
DECODE = "http://127.0.0.1:30200"
BOOTSTRAP_PORT = 8998
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
TIMEOUT_S = 60.0
VOCAB = json.loads((COMMITTED / "tokenizer.json").read_text())["model"]["vocab"]  # char -> id (probe tokenizer)
EOS = 2
MODEL = "default"
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError", 413: "BadRequestError",
               422: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError",
               503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
ERROR_STATUSES = tuple(ERROR_TYPES)
# the experiment header's "layout" (Experiment's _layout: the CPU profile's cluster spec, its endpoints)
LAYOUT = {"kv_layout": "mha",
          "spec": {"name": "cpu", "model": "probe", "device": "cpu", "dtype": "float32", "pool_tokens": 2048,
                   "context_length": 4096, "page_size": 1, "transfer_backend": "mooncake_tcp",
                   "router": "sglang-router", "network_proxy": "embedded", "agent": True},
          "endpoints": {"router": ROUTER, "prefill": PREFILL, "decode": DECODE, "bootstrap_port": BOOTSTRAP_PORT,
                        "router_direct": None, "proxies": {}}}


# --------------------------------------------------------------------------- what the probe model says
def order(cs):
    """The probe model recites in ascending order of the first payload character (ALPHABET order)."""
    return sorted(cs, key=lambda c: canary.ALPHABET.index(c[1]))


def recite(cs) -> str:
    """The probe model's reply to a prompt holding ``cs`` (it ends in the trigger ``[``)."""
    return "".join(canary.payload(c) + "][" for c in order(cs))


def ids_of(text: str) -> list[int]:
    return [VOCAB.get(ch, 3) for ch in text]


def twin_payload(rng: random.Random) -> str:
    """Lower-case stand-in for a leaked payload in the leak-free twin (same length)."""
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(canary.PAYLOAD_LEN))


# --------------------------------------------------------------------------- what the server sends
def _compact(d) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def complete_body(endpoint: str, rid: str, text: str, n_prompt: int, finish: str = "stop", meta_extra=None) -> bytes:
    """A complete 200 JSON body of ``endpoint`` (SGLang's shapes)."""
    n_out = len(text) + (1 if finish == "stop" else 0)
    fr = {"type": "stop", "matched": EOS} if finish == "stop" else {"type": "length", "length": len(text)}
    if endpoint == "generate":
        meta = {"id": rid, "finish_reason": fr, "prompt_tokens": n_prompt, "weight_version": "default",
                "completion_tokens": n_out, "cached_tokens": 0, "e2e_latency": 0.41}
        if meta_extra:
            meta.update(meta_extra)
        ids = ids_of(text) + ([EOS] if finish == "stop" else [])
        return json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode()
    usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out,
             "prompt_tokens_details": None}
    if endpoint == "completions":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                  "matched_stop": EOS if finish == "stop" else None}
        return json.dumps({"id": f"cmpl-{rid}", "object": "text_completion", "created": 1780000000, "model": MODEL,
                           "choices": [choice], "usage": usage}).encode()
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                      "tool_calls": None}, "logprobs": None, "finish_reason": finish,
              "matched_stop": EOS if finish == "stop" else None}
    return json.dumps({"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1780000000, "model": MODEL,
                       "choices": [choice], "usage": usage}).encode()


def pieces(text: str, rng: random.Random, must_cut=(), max_piece: int = 7) -> list[str]:
    """``text`` in stream chunks of 1..max_piece characters, with a chunk boundary at every offset in
    ``must_cut``."""
    cuts, at = set(x for x in must_cut if 0 < x < len(text)), 0
    while at < len(text):
        at += rng.randint(1, max_piece)
        if at < len(text):
            cuts.add(at)
    bounds = [0] + sorted(cuts) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [""]


def sse_events(endpoint: str, rid: str, parts: list[str], n_prompt: int, finish: str | None = "stop",
               done: bool = True) -> list[bytes]:
    """The SSE events (each ``data: ...\\n\\n``) of a 200 stream whose reply comes in ``parts``:
    ``/generate`` streams the cumulative text (and output ids); the OpenAI endpoints stream deltas
    (``choices[0].text``; chat: a role chunk, then ``choices[0].delta.content``). ``finish`` None:
    the stream ends without a finish reason (cut, aborted); ``done``: ``data: [DONE]`` at the end."""
    out, sofar = [], ""
    for i, p in enumerate(parts):
        sofar += p
        last = i == len(parts) - 1 and finish is not None
        if endpoint == "generate":
            fr = ({"type": "stop", "matched": EOS} if finish == "stop" else {"type": "length", "length": len(sofar)}) \
                if last else None
            # SGLang's last chunk of a reply that ended by EOS counts and lists the EOS token (measured: a
            # 12-character reply's last chunk says completion_tokens 13, output_ids ending in 2)
            eos = [EOS] if last and finish == "stop" else []
            ev = {"text": sofar, "output_ids": ids_of(sofar) + eos, "meta_info": {
                "id": rid, "finish_reason": fr, "prompt_tokens": n_prompt, "weight_version": "default",
                "completion_tokens": len(sofar) + len(eos), "cached_tokens": 0}, "index": 0}
        elif endpoint == "completions":
            ev = {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1780000000, "model": MODEL,
                  "choices": [{"index": 0, "text": p, "logprobs": None, "finish_reason": finish if last else None,
                               "matched_stop": (EOS if finish == "stop" else None) if last else None}], "usage": None}
        else:
            if i == 0:
                out.append(b"data: " + _compact({
                    "id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1780000000, "model": MODEL,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "usage": None}) + b"\n\n")
            ev = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1780000000, "model": MODEL,
                  "choices": [{"index": 0, "delta": {"role": None, "content": p, "reasoning_content": None,
                                                     "tool_calls": None}, "logprobs": None,
                               "finish_reason": finish if last else None,
                               "matched_stop": (EOS if finish == "stop" else None) if last else None}], "usage": None}
        out.append(b"data: " + _compact(ev) + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def error_body(shape: str, status: int, message: str) -> bytes:
    """An error reply body: SGLang's ErrorResponse, the router's / OpenAI's nested error, FastAPI's
    validation detail, a proxy's plain text or HTML page."""
    if shape == "sglang":
        return json.dumps({"object": "error", "message": message, "type": ERROR_TYPES.get(status, "Error"),
                           "param": None, "code": status}).encode()
    if shape == "nested":
        return json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                                     "code": status}}).encode()
    if shape == "detail":
        return json.dumps({"detail": [{"type": "value_error", "loc": ["body"], "msg": message,
                                       "input": None}]}).encode()
    if shape == "html":
        return (f"<html><head><title>{status}</title></head><body><h1>{status}</h1><p>{message}</p>"
                "</body></html>").encode()
    return message.encode()  # plain


ERROR_SHAPES = ("sglang", "nested", "detail", "html", "plain")
