"""Per-budget request, latency and token metrics: Prometheus text on ``/metrics``, JSON on ``/stats``, and Ray.

Design choices:

* Ray's application metrics (:mod:`ray.util.metrics` ``Counter`` / ``Histogram``) are what a Ray
  Serve replica exports to Prometheus next to Serve's own series; they are tagged by ``budget``
  (the answering budget, the one the request named as ``model``) and ``route``. Series names start
  with ``star_elastic_``.
* The same figures are also kept in-process (counters and histograms with the same buckets) and
  served on the serving port itself: as Prometheus text by ``/metrics`` (:meth:`ServingMetrics.prometheus`,
  what a scraper pointed at the API reads; series without Ray's ``ray_`` prefix) and as JSON by
  ``/stats``, because Ray's metrics port is not exposed everywhere (a laptop, a port-forward to the
  API only) and the Ray metric objects cannot be read back. Each replica reports its own figures.
* Outside a Ray worker the Ray metric objects cannot be created; the in-process figures still work.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TOKEN_KINDS = ("prompt", "reasoning", "completion")


def _labels(**labels: str) -> str:
    """``{k="v",...}`` with Prometheus text-format escaping of the values."""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` buckets, +Inf, sum, count)."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BOUNDARIES_S) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        i = next((j for j, b in enumerate(LATENCY_BOUNDARIES_S) if v <= b), len(LATENCY_BOUNDARIES_S))
        self.buckets[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, total = [], 0
        for bound, n in zip([*LATENCY_BOUNDARIES_S, "+Inf"], self.buckets, strict=True):
            total += n
            le = bound if isinstance(bound, str) else _number(bound)
            out.append(f"{name}_bucket{_labels(**labels, le=le)} {total}")
        out.append(f"{name}_sum{_labels(**labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(**labels)} {self.count}")
        return out


class ServingMetrics:
    """Record one finished (or failed) request with :meth:`record`; read the sums with :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self._tokens: dict[tuple[str, str], int] = defaultdict(int)
        self._latency: dict[tuple[str, str], _Histogram] = defaultdict(_Histogram)
        self._ttft: dict[tuple[str, str], _Histogram] = defaultdict(_Histogram)
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
                self._latency[(budget, route)].observe(latency_s)
            if first_token_s is not None:
                self._ttft[(budget, route)].observe(first_token_s)
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
                    {"budget": b, "route": r, "count": h.count, "mean_s": h.sum / h.count if h.count else 0.0}
                    for (b, r), h in sorted(self._latency.items())
                ],
                "tokens": [{"budget": b, "kind": k, "count": n} for (b, k), n in sorted(self._tokens.items())],
            }

    def prometheus(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The figures in the Prometheus text exposition format (version 0.0.4).

        ``gauges``: extra ``name -> (help, value)`` series of this replica (e.g. running requests),
        written as unlabelled gauges; a name ending in ``_total`` is written as a counter.
        """
        lines: list[str] = []

        def head(name: str, kind: str, text: str) -> None:
            lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])

        with self._lock:
            head("star_elastic_requests_total", "counter", "Requests answered, by budget, route and HTTP status.")
            for (b, r, s), n in sorted(self._requests.items()):
                lines.append(f"star_elastic_requests_total{_labels(budget=b, route=r, status=s)} {n}")
            head("star_elastic_tokens_total", "counter", "Tokens by kind: prompt, reasoning and completion.")
            for (b, k), n in sorted(self._tokens.items()):
                lines.append(f"star_elastic_tokens_total{_labels(budget=b, kind=k)} {n}")
            for name, table, text in (
                ("star_elastic_request_latency_s", self._latency, "Seconds from arrival to the last token."),
                ("star_elastic_time_to_first_token_s", self._ttft, "Seconds from arrival to the first token."),
            ):
                head(name, "histogram", text)
                for (b, r), h in sorted(table.items()):
                    lines.extend(h.lines(name, {"budget": b, "route": r}))
        for name, (text, value) in sorted((gauges or {}).items()):
            head(name, "counter" if name.endswith("_total") else "gauge", text)
            lines.append(f"{name} {_number(value)}")
        return "\n".join(lines) + "\n"
