"""Per-budget request, latency and token metrics, exported through Ray and kept in-process.

Design choices:

* Ray's application metrics (:mod:`ray.util.metrics` ``Counter`` / ``Histogram``) are what a Ray
  Serve replica exports to Prometheus next to Serve's own series; they are tagged by ``budget``
  (the answering budget, the one the request named as ``model``) and ``route``. Series names start
  with ``star_elastic_``.
* The same figures are also summed in-process and served as JSON by ``/stats``, because a
  Prometheus scrape is not available everywhere (tests, ``serve_foreground`` on a laptop) and the
  Ray metric objects cannot be read back.
* Outside a Ray worker the Ray metric objects cannot be created; the in-process figures still work.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TOKEN_KINDS = ("prompt", "reasoning", "completion")


class ServingMetrics:
    """Record one finished (or failed) request with :meth:`record`; read the sums with :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self._tokens: dict[tuple[str, str], int] = defaultdict(int)
        self._latency: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # [count, sum]
        self._ray: dict[str, Any] | None = None
        try:
            import ray
            from ray.util import metrics

            if ray.is_initialized():
                keys = ("budget", "route")
                self._ray = {
                    "requests": metrics.Counter(
                        "star_elastic_requests_total",
                        description="Requests answered, by budget, route and HTTP status.",
                        tag_keys=("budget", "route", "status"),
                    ),
                    "latency": metrics.Histogram(
                        "star_elastic_request_latency_s",
                        description="Seconds from arrival to the last token.",
                        boundaries=LATENCY_BOUNDARIES_S,
                        tag_keys=keys,
                    ),
                    "ttft": metrics.Histogram(
                        "star_elastic_time_to_first_token_s",
                        description="Seconds from arrival to the first generated token.",
                        boundaries=LATENCY_BOUNDARIES_S,
                        tag_keys=keys,
                    ),
                    "tokens": metrics.Counter(
                        "star_elastic_tokens_total",
                        description="Tokens by kind: prompt, reasoning (thinking) and completion (all generated).",
                        tag_keys=("budget", "route", "kind"),
                    ),
                }
        except Exception:  # metrics are an observation, never a reason to refuse service
            self._ray = None

    @property
    def exported(self) -> bool:
        """Whether the figures also go to Ray's metrics pipeline."""
        return self._ray is not None

    def record(
        self,
        budget: str,
        route: str,
        status: int,
        latency_s: float | None = None,
        first_token_s: float | None = None,
        tokens: dict[str, int] | None = None,
    ) -> None:
        budget = budget or "none"
        with self._lock:
            self._requests[(budget, route, str(status))] += 1
            if latency_s is not None:
                cell = self._latency[(budget, route)]
                cell[0] += 1
                cell[1] += latency_s
            for kind, n in (tokens or {}).items():
                self._tokens[(budget, kind)] += n
        if self._ray is None:
            return
        try:
            tags = {"budget": budget, "route": route}
            self._ray["requests"].inc(1, tags={**tags, "status": str(status)})
            if latency_s is not None:
                self._ray["latency"].observe(latency_s, tags=tags)
            if first_token_s is not None:
                self._ray["ttft"].observe(first_token_s, tags=tags)
            for kind, n in (tokens or {}).items():
                if n:
                    self._ray["tokens"].inc(n, tags={**tags, "kind": kind})
        except Exception:
            pass

    def snapshot(self) -> dict[str, Any]:
        """``{"requests": [...], "latency": [...], "tokens": [...]}`` as plain rows."""
        with self._lock:
            return {
                "requests": [
                    {"budget": b, "route": r, "status": int(s), "count": n}
                    for (b, r, s), n in sorted(self._requests.items())
                ],
                "latency": [
                    {"budget": b, "route": r, "count": int(c), "mean_s": s / c if c else 0.0}
                    for (b, r), (c, s) in sorted(self._latency.items())
                ],
                "tokens": [{"budget": b, "kind": k, "count": n} for (b, k), n in sorted(self._tokens.items())],
            }
