"""A streaming chat request against the OpenAI-compatible server, timed on this side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from bigmoe.errors import BigmoeError


class ChatError(BigmoeError):
    """The server refused or broke off a chat request."""


@dataclass(frozen=True)
class ChatResult:
    """One answer and how fast it came."""

    text: str
    """The answer."""
    tokens: int
    """Completion tokens the server counted."""
    ttft_ms: float
    """Time from sending the request to the first token (ms)."""
    tpot_ms: float
    """Mean time per output token after the first (ms); 0 when only one token came."""


def answers_health(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether the server at `endpoint` answers /health with 200 within `timeout_s` (vLLM does once its model is
    loaded and its graphs captured; before that the port is closed or the request waits)."""
    try:
        return httpx.get(endpoint + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def chat(
    endpoint: str,
    model: str,
    prompt: str,
    max_tokens: int = 64,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    temperature: float = 0.0,
) -> ChatResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    parts: list[str] = []
    token_times: list[float] = []
    usage_tokens = 0
    start = time.perf_counter()
    try:
        with httpx.stream(
            "POST", endpoint + "/v1/chat/completions", json=body, headers=headers, timeout=timeout_s
        ) as r:
            if r.status_code != 200:
                raise ChatError(f"chat request failed: HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        parts.append(piece)
                        token_times.append(time.perf_counter())
    except httpx.HTTPError as e:
        raise ChatError(f"chat request to {endpoint} failed: {e}") from None
    if not token_times:
        raise ChatError("the server answered with no tokens")
    tokens = usage_tokens or len(token_times)
    ttft = (token_times[0] - start) * 1e3
    # Chunks can carry several tokens; the server's usage count is the truth for the divisor.
    tpot = (token_times[-1] - token_times[0]) * 1e3 / (tokens - 1) if tokens > 1 else 0.0
    return ChatResult("".join(parts), tokens, ttft, tpot)
