"""A reward computed by a remote service: one JSON POST per batch, standard library only (urllib).

Request body:  {"prompts": [...], "completions": [...], "<column>": [...], ...}   (every dataset column)
Response body: [r_0, ..., r_{N-1}]  or  {"rewards": [r_0, ..., r_{N-1}]}            (numbers or null)

Connection errors, timeouts, HTTP 429 and 5xx are retried `retries` times, waiting backoff * 2**k seconds
before retry k (k = 0, 1, ...); other HTTP errors fail at once. The last failure is raised with the URL, the
number of attempts and the cause.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping, Sequence

from grpokit.rewards.contract import RESERVED_ARGUMENTS

RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


def _json_default(value: Any) -> Any:
    """Make numpy/torch values JSON-ready (arrays and tensors via .tolist()); anything else as str."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def parse_rewards_response(body: bytes, url: str) -> list:
    """The list of rewards in a response body: a JSON list, or an object with a "rewards" list."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"reward endpoint {url} answered with invalid JSON: {body[:200]!r}") from exc
    if isinstance(data, Mapping):
        data = data.get("rewards")
    if not isinstance(data, list):
        raise ValueError(
            f"reward endpoint {url} must answer a JSON list of numbers/null or {{\"rewards\": [...]}}, "
            f"got {body[:200]!r}"
        )
    return data


class HTTPRewardFunction:
    """POSTs the batch to `url` and returns the list the service answers (see the module docstring).

    timeout: seconds per attempt (connect and each read); retries: extra attempts after the first; backoff:
    base of the exponential wait between attempts; headers: extra request headers (e.g. an Authorization).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"reward endpoint {url!r} must be an http:// or https:// URL with a host")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(f"reward endpoint {url}: need timeout > 0, retries >= 0, backoff >= 0")
        self.url, self.timeout, self.retries, self.backoff = url, float(timeout), int(retries), float(backoff)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.__name__ = parsed.hostname

    def _post_once(self, body: bytes) -> list:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return parse_rewards_response(response.read(), self.url)

    def post(self, payload: Mapping[str, Any]) -> list:
        """Send `payload` with retries; the decoded list of rewards, or a ConnectionError after the last try."""
        body = json.dumps(payload, default=_json_default).encode("utf-8")
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._post_once(body)
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRIED_STATUS:
                    detail = exc.read()[:300].decode("utf-8", errors="replace")
                    raise ConnectionError(
                        f"reward endpoint {self.url} refused the request: HTTP {exc.code} {exc.reason}: {detail}. "
                        "Check the URL and the request format the service expects."
                    ) from exc
                last: Exception = exc
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as exc:
                last = exc
            if attempt + 1 < attempts:
                time.sleep(self.backoff * 2**attempt)
        raise ConnectionError(
            f"reward endpoint {self.url} failed after {attempts} attempt(s): {type(last).__name__}: {last}. "
            f"Check that the service is up and reachable; raise timeout (now {self.timeout}s) or retries "
            f"(now {self.retries}) for a slow service."
        ) from last

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list:
        columns = {k: v for k, v in kwargs.items() if k not in RESERVED_ARGUMENTS}
        return self.post({"prompts": list(prompts), "completions": list(completions), **columns})
