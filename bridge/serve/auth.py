"""Signatures of the signal webhook: HMAC-SHA256 over a timestamp and the body, stale and replayed requests refused.

A sender signs each request with the shared secret (``serve.signal_secret`` / ``POLLBRIDGE_SIGNAL_SECRET``)::

    X-Pollbridge-Timestamp: 1718000000                     (Unix seconds, when it was signed)
    X-Pollbridge-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body bytes>")>

The server refuses (401, nothing recorded):

* a missing or malformed header, a timestamp that is not an integer;
* a **stale** timestamp: more than ``max_clock_skew`` seconds away from the server's clock, either way;
* a **wrong** signature (compared in constant time with :func:`hmac.compare_digest`);
* a **replayed** one: every accepted signature is remembered until its timestamp leaves the skew
  window (after that the timestamp alone refuses it), so each signed request is accepted once.

The memory is per process and bounded (``max_remembered``); when it is full of signatures still inside
the window, new requests are refused with 503 rather than forgetting one early (which would let it be
replayed). Several ``serve`` processes behind a load balancer each remember their own: a replay sent to
another process within the window gets through the signature check, and then meets the signal's own
guard (a task takes one signal: "already received", 409), so it changes nothing.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import threading
import time
from collections.abc import Callable

TIMESTAMP_HEADER = "X-Pollbridge-Timestamp"
SIGNATURE_HEADER = "X-Pollbridge-Signature"
SCHEME = "v1"
DEFAULT_MAX_REMEMBERED = 100_000


class Unauthorized(Exception):
    """The request is not signed right (401); the message says why."""


class TooManyRequests(Exception):
    """The replay memory is full of signatures still inside the skew window (503)."""


def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    """The header value a sender puts in ``X-Pollbridge-Signature``: ``v1=<hex digest>``."""
    return f"{SCHEME}={_digest(secret, str(timestamp), body)}"


def _digest(secret: str, timestamp: str, body: bytes) -> str:
    return hmac.new(secret.encode("utf-8"), timestamp.encode("ascii") + b"." + body, hashlib.sha256).hexdigest()


class SignatureVerifier:
    """Checks signatures and remembers the accepted ones for the skew window. Thread-safe."""

    def __init__(self, secret: str, max_clock_skew: float, *, clock: Callable[[], float] = time.time,
                 max_remembered: int = DEFAULT_MAX_REMEMBERED) -> None:
        if not secret:
            raise ValueError("the signal secret must not be empty")
        self._secret = secret
        self.max_clock_skew = float(max_clock_skew)
        self._clock = clock
        self._max = max_remembered
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget at, digest)

    def __repr__(self) -> str:
        return f"SignatureVerifier(max_clock_skew={self.max_clock_skew:g}, remembered={len(self._seen)})"

    def verify(self, timestamp: str | None, signature: str | None, body: bytes) -> None:
        """Accept the request once, or raise :class:`Unauthorized` (or :class:`TooManyRequests`)."""
        if not timestamp:
            raise Unauthorized(f"missing {TIMESTAMP_HEADER} header")
        if not signature:
            raise Unauthorized(f"missing {SIGNATURE_HEADER} header")
        text = timestamp.strip()
        if not text.isdigit() or len(text) > 12:
            raise Unauthorized(f"{TIMESTAMP_HEADER} must be Unix seconds (an integer)")
        signed_at = int(text)
        now = self._clock()
        if abs(now - signed_at) > self.max_clock_skew:
            raise Unauthorized(f"stale timestamp: {now - signed_at:+.0f} s from the server's clock "
                               f"(at most {self.max_clock_skew:g} s either way)")
        offered = [part.strip()[len(SCHEME) + 1:] for part in signature.split(",")
                   if part.strip().startswith(f"{SCHEME}=")]
        if not offered:
            raise Unauthorized(f"{SIGNATURE_HEADER} must be '{SCHEME}=<hex HMAC-SHA256>'")
        expected = _digest(self._secret, text, body)
        # Every candidate is compared (constant time each), so timing does not tell which one matched.
        matched = False
        for candidate in offered:
            matched |= hmac.compare_digest(candidate.lower().encode("ascii", "replace"), expected.encode("ascii"))
        if not matched:
            raise Unauthorized("signature mismatch")
        with self._lock:
            self._forget_expired(now)
            if expected in self._seen:
                raise Unauthorized("replayed request: this signature was already accepted")
            if len(self._seen) >= self._max:
                raise TooManyRequests(f"more than {self._max} signed requests inside the {self.max_clock_skew:g} s "
                                      "window; retry later")
            self._seen.add(expected)
            heapq.heappush(self._expiry, (signed_at + self.max_clock_skew, expected))

    def remembered(self) -> int:
        with self._lock:
            self._forget_expired(self._clock())
            return len(self._seen)

    def _forget_expired(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, digest = heapq.heappop(self._expiry)
            self._seen.discard(digest)
