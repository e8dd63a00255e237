# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The performance gate behind llmserve.vllm.load_probe.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

A bounded load: `concurrency` clients send streamed chat completions one after
another for `duration` seconds; a request that began in time may finish. From
the streamed events come the figures vLLM's own benchmark reports: output
tokens per second over the probe's wall time, time to first token, and the
gaps between tokens. The verdict compares the throughput with a floor and with
the figure the previous release measured on the same host.

The HTTP stream, the clock and the thread start are passed in, so the unit
tests drive all of it without a server or real time.
"""

import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from http.client import HTTPException
from typing import Any, Callable, Optional
from urllib.error import HTTPError, URLError

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    describe_unreachable,
    endpoint_context,
    mask,
    open_endpoint,
    quote_masked,
    read_body,
    url_secrets,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import error_message

DEFAULT_PROMPT = 'Write a long story about a lighthouse keeper and the sea.'
DEFAULT_MAX_TOKENS = 128
DEFAULT_CONCURRENCY = 4
DEFAULT_DURATION = 30
DEFAULT_REQUEST_TIMEOUT = 120
DEFAULT_MAX_REGRESSION_PERCENT = 20.0
MAX_CONCURRENCY = 1024
# One event of a stream, and all of one request's stream, in bytes: no server fills the memory.
MAX_LINE_BYTES = 1024 * 1024
MAX_STREAM_BYTES = 64 * 1024 * 1024
# The longest error text kept per failed request.
MAX_ERROR_CHARS = 300
# The most of an error answer's body that is read for its message.
MAX_ERROR_BODY_BYTES = MAX_ERROR_CHARS * 4
# The most completion tokens a request's usage may count when the request itself sets no bound: more than any
# model's context, and few enough that the throughput computed from them stays a finite float.
MAX_USAGE_TOKENS = 2**53
# Clients that are still inside a request this long after the last one may have ended are abandoned.
JOIN_GRACE_SECONDS = 5.0

# stream(payload, timeout) -> the response's lines as bytes; raises StreamError.
Stream = Callable[[dict[str, Any], float], Iterable[bytes]]


class StreamError(Exception):
    """A request that got no usable stream: refused, an HTTP error status, a cut connection."""


class Request:
    """What one streamed request showed: when it began, when each token arrived, how it ended."""

    def __init__(self, began: float) -> None:
        self.began = began
        self.ended = began
        self.token_times: list[float] = []
        # The last chunk of a token, with text or without (ignore_eos past the end, a token that ends no character).
        self.last_token: Optional[float] = None
        self.usage_tokens: Optional[int] = None
        self.done = False
        self.error: Optional[str] = None

    @property
    def output_tokens(self) -> int:
        """Completion tokens as the server counted them (usage), else the streamed chunks that carried text."""
        if self.usage_tokens is not None:
            return self.usage_tokens
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done and self.output_tokens > 0


def parse_event(line: bytes) -> Optional[Any]:
    """The JSON of one server-sent `data:` line; 'DONE' for the end marker; None for any other line.

    StreamError quotes the line whole: stream_request masks the secrets in it before it shortens it.
    """
    text = to_text(line, errors='replace').strip()
    if not text.startswith('data:'):
        return None
    data = text[len('data:') :].strip()
    if data == '[DONE]':
        return 'DONE'
    try:
        return json.loads(data)
    except ValueError:
        raise StreamError('an event that is not JSON: %s' % data) from None
    except RecursionError:
        raise StreamError('an event nested too deeply to be read as JSON: %s' % data) from None


def carries_text(event: dict[str, Any]) -> bool:
    """Whether a chunk delivers generated text (answer or reasoning), which is what a token arrival is."""
    choices = event.get('choices')
    if not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get('delta') if isinstance(choice, dict) else None
        if isinstance(delta, dict) and any(delta.get(key) for key in ('content', 'reasoning_content', 'reasoning')):
            return True
    return False


def error_text(text: str, secrets: Sequence[Optional[str]]) -> str:
    """An error as the results keep it: the secrets masked first, then shortened, so that no cut leaves part of one."""
    return quote_masked(text, MAX_ERROR_CHARS, *secrets)


def completion_token_limit(payload: dict[str, Any]) -> int:
    """The most completion tokens the request allows: vLLM's max_completion_tokens, else max_tokens, for each of
    its n choices; MAX_USAGE_TOKENS where extra_body made them something other than counts."""

    def count(value: Any) -> Optional[int]:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    per_choice = count(payload.get('max_completion_tokens')) or count(payload.get('max_tokens'))
    if per_choice is None:
        return MAX_USAGE_TOKENS
    return min(MAX_USAGE_TOKENS, per_choice * (count(payload.get('n')) or 1))


def _shown_number(value: int) -> str:
    """An integer for a message: one of hundreds of digits by its first digits and how many it has."""
    digits = str(value)
    return digits if len(digits) <= 24 else '%s... (%d digits)' % (digits[:20], len(digits.lstrip('-')))


def usage_tokens(usage: Any, limit: int) -> Optional[int]:
    """usage.completion_tokens when it is a number; StreamError when it is no count the request allows.

    A count past the request's max_tokens is a server that lies, and one of hundreds of digits would overflow
    the throughput.
    """
    if not isinstance(usage, dict):
        return None
    tokens = usage.get('completion_tokens')
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return None
    if not 0 <= tokens <= limit:
        raise StreamError(
            'usage.completion_tokens is %s, not a count from 0 to %d (the most the request allows)'
            % (_shown_number(tokens), limit)
        )
    return tokens


def stream_request(
    stream: Stream,
    payload: dict[str, Any],
    timeout: float,
    clock: Callable[[], float],
    secrets: Sequence[Optional[str]] = (),
) -> Request:
    """Send one request and follow its stream to the end marker, recording token arrival times.

    secrets: masked in the error, which may quote what the server sent.
    """
    request = Request(clock())
    limit = completion_token_limit(payload)
    try:
        for line in stream(payload, timeout):
            event = parse_event(line)
            if event is None:
                continue
            if event == 'DONE':
                request.done = True
                break
            if not isinstance(event, dict):
                raise StreamError('an event that is not a JSON object: %s' % to_text(line, errors='replace'))
            if 'error' in event:
                raise StreamError('the server reported an error: %s' % json.dumps(event['error']))
            if carries_text(event):
                request.token_times.append(clock())
                request.last_token = request.token_times[-1]
            elif request.token_times and isinstance(event.get('choices'), list) and event['choices']:
                request.last_token = clock()
            counted = usage_tokens(event.get('usage'), limit)
            if counted is not None:
                request.usage_tokens = counted
        if not request.done:
            request.error = 'the stream ended without its [DONE] marker'
    except StreamError as exc:
        request.error = error_text(to_text(exc), secrets)
    request.ended = clock()
    return request


def percentile(values: list[float], fraction: float) -> Optional[float]:
    """Nearest-rank percentile (fraction 0.5 for p50); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, int(math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def _latency(values: list[float]) -> dict[str, Optional[float]]:
    summary = {'p50': percentile(values, 0.5), 'p95': percentile(values, 0.95), 'max': max(values) if values else None}
    return {key: (round(value, 4) if value is not None else None) for key, value in summary.items()}


def summarize(requests: list[Request], unfinished: int = 0) -> dict[str, Any]:
    """The probe's figures from its requests. Throughput counts only requests that completed."""
    completed = [request for request in requests if request.ok]
    failed = [request for request in requests if not request.ok]
    figures: dict[str, Any] = {
        'requests': len(completed),
        'failed_requests': len(failed) + unfinished,
        'errors': sorted(set(request.error or 'no tokens' for request in failed))[:5],
        'output_tokens': sum(request.output_tokens for request in completed),
    }
    if completed:
        wall = max(request.ended for request in completed) - min(request.began for request in completed)
    else:
        wall = 0.0
    figures['seconds'] = round(wall, 3)
    figures['output_tokens_per_second'] = round(figures['output_tokens'] / wall, 3) if wall > 0 else 0.0
    figures['time_to_first_token'] = _latency([request.token_times[0] - request.began for request in completed])
    gaps = [
        later - earlier for request in completed for earlier, later in zip(request.token_times, request.token_times[1:])
    ]
    figures['inter_token_latency'] = _latency(gaps)
    # Robust to a server that sends several events in one write, where most gaps are 0. From the first text to the
    # last token's chunk, text or not, as vllm bench serve counts it: with ignore_eos the text may end long before.
    figures['time_per_output_token'] = _latency(
        [
            ((request.last_token or request.token_times[-1]) - request.token_times[0]) / (request.output_tokens - 1)
            for request in completed
            if request.output_tokens > 1 and len(request.token_times) > 1
        ]
    )
    return figures


def verdict(
    figures: dict[str, Any],
    min_tokens_per_second: float = 0.0,
    baseline_tokens_per_second: Optional[float] = None,
    max_regression_percent: float = DEFAULT_MAX_REGRESSION_PERCENT,
) -> tuple[Optional[str], Optional[float]]:
    """(why the figures fail the gate or None, percent below the baseline or None)."""
    measured = figures['output_tokens_per_second']
    regression = None
    baseline = baseline_tokens_per_second or 0.0
    if baseline:
        regression = round(100.0 * (baseline - measured) / baseline, 1)
    if figures['failed_requests']:
        return (
            '%d of %d requests of the load probe failed: %s'
            % (
                figures['failed_requests'],
                figures['failed_requests'] + figures['requests'],
                '; '.join(figures['errors']) or 'still unfinished at the deadline',
            ),
            regression,
        )
    if not figures['requests']:
        return 'no request of the load probe completed', regression
    if measured < min_tokens_per_second:
        return (
            'output throughput %.1f tokens/s is below min_tokens_per_second %s'
            % (measured, _number(min_tokens_per_second)),
            regression,
        )
    if regression is not None and regression > max_regression_percent:
        return (
            "output throughput %.1f tokens/s is %.1f %% below the previous release's %.1f tokens/s on this host "
            '(max_regression_percent %s)' % (measured, regression, baseline, _number(max_regression_percent)),
            regression,
        )
    return None, regression


def _number(value: float) -> str:
    return '%d' % value if float(value) == int(value) else '%s' % value


class LoadProbe:
    """concurrency clients, each sending one streamed request after another until duration has passed.

    start_thread(target) starts target on a daemon thread and returns it, so that a client a
    server holds forever is abandoned at the deadline (duration + request_timeout + a grace)
    and counted as unfinished, instead of holding the module.

    secrets: the API key and the URL's credentials (probe_secrets), masked in every error kept.
    """

    def __init__(
        self,
        stream: Stream,
        model: str,
        prompt: str = DEFAULT_PROMPT,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        concurrency: int = DEFAULT_CONCURRENCY,
        duration: float = DEFAULT_DURATION,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        extra_body: Optional[dict[str, Any]] = None,
        clock: Callable[[], float] = time.monotonic,
        start_thread: Optional[Callable[[Callable[[], None]], threading.Thread]] = None,
        secrets: Sequence[Optional[str]] = (),
    ) -> None:
        self.stream = stream
        self.payload: dict[str, Any] = {
            'model': model,
            'messages': [{'role': 'user', 'content': prompt}],
            'max_tokens': max_tokens,
            'temperature': 0,
            'stream': True,
            'stream_options': {'include_usage': True},
        }
        self.payload.update(extra_body or {})
        self.concurrency = concurrency
        self.duration = duration
        self.request_timeout = request_timeout
        self.clock = clock
        self.start_thread = start_thread or _daemon_thread
        self.secrets = tuple(secrets)
        self.requests: list[Request] = []
        self.lock = threading.Lock()

    def _client(self, until: float) -> None:
        while self.clock() < until:
            began = self.clock()
            try:
                request = stream_request(
                    self.stream, dict(self.payload), self.request_timeout, self.clock, self.secrets
                )
            except Exception as exc:  # a request that broke the client must still be counted, never vanish
                request = Request(began)
                request.error = error_text(
                    'the request failed unexpectedly: %s: %s' % (type(exc).__name__, to_text(exc)), self.secrets
                )
                request.ended = self.clock()
            with self.lock:
                self.requests.append(request)
            if request.error:
                return  # one failure fails the gate; repeating a refused request only floods the figures

    def run(self) -> dict[str, Any]:
        until = self.clock() + self.duration
        threads = [self.start_thread(lambda: self._client(until)) for client in range(self.concurrency)]
        give_up = until + self.request_timeout + JOIN_GRACE_SECONDS
        for thread in threads:
            thread.join(max(0.0, give_up - self.clock()))
        unfinished = sum(1 for thread in threads if thread.is_alive())
        with self.lock:
            return summarize(list(self.requests), unfinished)


def _daemon_thread(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def probe_secrets(base_url: str, api_key: Optional[str]) -> tuple[str, ...]:
    """What no text of the probe may show: the API key, and the credentials in the URL (see url_secrets)."""
    return tuple(secret for secret in (api_key,) + url_secrets(base_url) if secret)


def refusal(exc: HTTPError, secrets: tuple[str, ...]) -> str:
    """What a server's answer other than 200 says, its body read within MAX_ERROR_BODY_BYTES, the secrets masked."""
    try:
        body = to_text(read_body(exc, MAX_ERROR_BODY_BYTES), errors='replace')
    except Exception:  # the status alone says enough
        body = ''
    finally:
        exc.close()
    # error_message shortens what it quotes: the body is masked before.
    reason = error_message(mask(body, *secrets)) if body else to_text(exc.reason)
    return mask('answered %d: %s' % (exc.code, reason), *secrets)


def bounded_lines(response: Any) -> Iterator[bytes]:
    """The lines of a stream, each at most MAX_LINE_BYTES and all of them at most MAX_STREAM_BYTES."""
    read = 0
    while True:
        line = response.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        read += len(line)
        if len(line) > MAX_LINE_BYTES or read > MAX_STREAM_BYTES:
            raise StreamError(
                'a stream with a line over %d bytes or over %d bytes in all' % (MAX_LINE_BYTES, MAX_STREAM_BYTES)
            )
        yield line


def make_stream(
    base_url: str,
    api_key: Optional[str] = None,
    validate_certs: bool = True,
    use_proxy: bool = True,
    ca_path: Optional[str] = None,
    unix_socket: Optional[str] = None,
) -> Stream:
    """Return stream(payload, timeout): POST /v1/chat/completions and yield the answer's lines.

    timeout bounds each socket operation; the probe's deadline bounds the whole. A status
    other than 200, a line over MAX_LINE_BYTES or a stream over MAX_STREAM_BYTES raises
    StreamError; texts that could quote the api_key or the URL's credentials have them masked
    before anything shortens them.

    The TLS context is built here, once for all the requests. Built per request, as open_url
    does, it cost each request tens of milliseconds of CPU with the GIL held, before the
    request was sent: the clients that started together waited on each other, the server
    sat idle meanwhile, and the other clients' tokens piled up unread.

    ca_path: a PEM file of the CA certificates that an https server's certificate must chain to, instead of
    the host's; ignored when validate_certs is false.
    unix_socket: the path of the Unix socket the server listens on, or None for the URL's host and port.
    """
    url = base_url.rstrip('/') + '/v1/chat/completions'
    headers = {'Accept': 'text/event-stream', 'Content-Type': 'application/json'}
    if api_key:
        headers['Authorization'] = 'Bearer %s' % api_key
    context = endpoint_context(validate_certs, ca_path)
    secrets = probe_secrets(base_url, api_key)

    def stream(payload: dict[str, Any], timeout: float) -> Iterator[bytes]:
        try:
            try:
                response = open_endpoint(
                    url,
                    json.dumps(payload),
                    headers,
                    'POST',
                    timeout,
                    validate_certs,
                    use_proxy,
                    context,
                    unix_socket=unix_socket,
                )
            except HTTPError as exc:
                raise StreamError(refusal(exc, secrets)) from None
            try:
                yield from bounded_lines(response)
            finally:
                response.close()
        except (URLError, HTTPException, OSError) as exc:
            raise StreamError(mask(describe_unreachable(exc, timeout), *secrets)) from None

    return stream
