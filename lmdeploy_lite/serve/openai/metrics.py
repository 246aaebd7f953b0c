"""Prometheus metrics of the server: per-request figures measured here (timings, tokens, the
prefix-cache token counters from each request's responses), engine-wide ones read at scrape time
from `Pipeline.stats()` (every DP rank's scheduler, KV blocks and speculative counters, aborted
requests' included, as its ranks last reported them). With several front-end processes
(`--api-workers`, workers.py sets PROMETHEUS_MULTIPROC_DIR) the per-request figures are
prometheus_client's multiprocess files, summed over the workers at each scrape."""
from __future__ import annotations

import os
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, multiprocess)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmdeploy_lite.messages import Response

PREFIX = 'lmdeploy_lite_'
OUTCOMES = ('stop', 'length', 'abort', 'error', 'invalid')
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
ENGINE_GAUGES = {'num_requests_running': ('num_running', 'Sequences holding KV blocks'),
                 'num_requests_waiting': ('num_waiting', 'Sequences queued for prefill'),
                 'kv_blocks_used': ('kv_blocks_used', 'KV cache blocks allocated'),
                 'kv_blocks_total': ('kv_blocks_total', 'KV cache blocks usable by sequences')}
SPEC_COUNTERS = {'num_drafts': 'Verify steps with drafts', 'num_draft_tokens':
                 'Draft tokens proposed', 'num_accepted_tokens': 'Draft tokens accepted'}


class ServerMetrics:
    """Its registry's collector too: `collect` reads the engine-wide figures at scrape time."""

    def __init__(self, pipe, num_spec_tokens: int = 0):
        self.pipe, self.num_spec_tokens = pipe, num_spec_tokens
        disable_created_metrics()                    # no `_created` series next to each counter
        self.registry = CollectorRegistry()

        def metric(kind, name: str, text: str, **kwargs):
            return kind(PREFIX + name, text, registry=self.registry, **kwargs)
        self.requests = metric(Counter, 'requests', 'Finished requests by outcome (stop, length, '
                               'abort: client left or server shut down, error: engine failure, '
                               'invalid: rejected with 400)', labelnames=['outcome'])
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = metric(Counter, 'prompt_tokens', 'Prompt tokens of admitted requests')
        self.generation_tokens = metric(Counter, 'generation_tokens', 'Generated tokens sent '
                                        '(counted as each request ends)')
        self.prefix_queried_tokens = metric(Counter, 'prefix_cache_queried_tokens', 'Prompt '
                                            'tokens looked up in the prefix cache (counted at '
                                            "each request's first token)")
        self.prefix_hit_tokens = metric(Counter, 'prefix_cache_hit_tokens',
                                        'Prompt tokens served from the prefix cache')
        self.ttft = metric(Histogram, 'time_to_first_token_seconds', 'Request arrival to first '
                           'generated token', buckets=TTFT_BUCKETS)
        self.tpot = metric(Histogram, 'time_per_output_token_seconds', 'Mean time per output '
                           'token after the first, per request', buckets=TPOT_BUCKETS)
        self.e2e = metric(Histogram, 'e2e_request_latency_seconds', 'Request arrival to its last '
                          'token', buckets=TTFT_BUCKETS)
        self.in_flight = metric(Gauge, 'num_requests_in_flight', 'Requests admitted and not '
                                'finished', multiprocess_mode='livesum')
        self.registry.register(self)
        if os.environ.get('PROMETHEUS_MULTIPROC_DIR'):      # what /metrics reads: every worker's
            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry)
            self.registry.register(self)

    def track(self, num_prompt_tokens: int) -> 'RequestTracker':
        """One request, or one choice of n (the others' num_prompt_tokens: 0)."""
        return RequestTracker(self, num_prompt_tokens)

    def collect(self):
        """The gauges and counters read from the engine."""
        engine = self.pipe.stats()                       # every DP rank, as last reported
        for name, (attr, text) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, text, value=getattr(engine, attr))
        yield GaugeMetricFamily(PREFIX + 'prefix_cache_cached_blocks', 'KV blocks in the prefix '
                                'cache', value=engine.num_cached_blocks)
        yield CounterMetricFamily(PREFIX + 'prefill_tokens', 'Tokens the engine fed in prefill '
                                  'rows (prompts less what the prefix cache and forked choices '
                                  'share; recomputes after preemption)',
                                  value=engine.num_prefill_tokens)
        stats, per_position = engine.spec, engine.spec.accepted_per_position
        per_position += [0] * (self.num_spec_tokens - len(per_position))   # one per position to k
        for attr, text in SPEC_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + 'spec_decode_' + attr, text,
                                      value=getattr(stats, attr))
        accepted = CounterMetricFamily(PREFIX + 'spec_decode_num_accepted_tokens_per_pos', 'Draft '
                                       'tokens accepted at each draft position (0-based)',
                                       labels=['position'])
        for position, count in enumerate(per_position):
            accepted.add_metric([str(position)], count)
        yield accepted
        yield GaugeMetricFamily(PREFIX + 'spec_decode_mean_accepted_length', 'Tokens emitted per '
                                'verify step, bonus included (1 + accepted / drafts; 0 before the '
                                'first draft)', value=stats.mean_accepted_length)


class RequestTracker:
    """One admitted request: its timing and token counts."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self.metrics, self.arrival = metrics, time.perf_counter()
        self.first_token_time: float | None = None
        self.num_generated, self.done = 0, False
        self.counts_prompt = num_prompt_tokens > 0
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.in_flight.inc()

    def observe(self, r: Response):
        """A response (a streamed chunk): two attribute writes; the counters move at `finish`."""
        if r.generate_token_len > self.num_generated:
            now = self.last_token_time = time.perf_counter()
            if self.first_token_time is None:    # prefilled: its cache hit is final
                self.first_token_time = now
                self.metrics.ttft.observe(now - self.arrival)
                if self.counts_prompt:
                    self.metrics.prefix_queried_tokens.inc(r.input_token_len)
                    self.metrics.prefix_hit_tokens.inc(r.num_cached_tokens)
            self.num_generated = r.generate_token_len

    def finish(self, outcome: str):
        if self.done:
            return
        self.done = True
        m = self.metrics
        m.requests.labels(outcome).inc()
        m.generation_tokens.inc(self.num_generated)
        m.in_flight.dec()
        if self.first_token_time is not None:
            m.e2e.observe(self.last_token_time - self.arrival)
            if self.num_generated > 1:
                m.tpot.observe((self.last_token_time - self.first_token_time)
                               / (self.num_generated - 1))
