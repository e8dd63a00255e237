# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Constant streaming load from the official `openai` client, and what each client saw.

Each of `streams` clients asks for one streamed answer of exactly `tokens` tokens (ignore_eos) after another, `pause`
seconds apart (a second after a refusal), with no retries, until stopped. Each request's raw server-sent events are
read to the end, so a stream is complete only when it brought every token, a finish reason, its usage and
`data: [DONE]`; one that ends sooner was cut. A request that got no stream at all is an error, with its status (a 502,
a 503) or its exception (a reset, a refused connection).

BalancerWatch samples what HAProxy's statistics page says of each replica meanwhile. The fleet's rolling change
(tests/integration/fleet/test_rolling.py) is judged by both; bench/streaming_restart.py prints what clients of one
host see through a restart or a change.
"""

import json
import ssl
import threading
import time

import httpx2
import openai
import requests

QUESTION = 'What is the capital of France?'
ERROR_BACKOFF_SECONDS = 1.0


class StreamingLoad:
    def __init__(self, base_url, api_key, model, ca, streams=2, tokens=48, pause=0.2):
        self.base_url, self.api_key, self.model, self.ca = base_url, api_key, model, ca
        self.streams, self.tokens, self.pause = streams, tokens, pause
        self.requests = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for number in range(streams)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for thread in self.threads:
            thread.join(300)

    def _client(self):
        client = openai.OpenAI(
            base_url=self.base_url,
            api_key=self.api_key,
            http_client=httpx2.Client(verify=ssl.create_default_context(cafile=self.ca), timeout=120),
            max_retries=0,
        )
        while not self.stopping.is_set():
            record = {'start': time.time()}
            try:
                record.update(self._one_stream(client))
            except openai.APIStatusError as error:
                record.update(outcome='error', error='HTTP %d' % error.status_code)
            except (openai.APIError, httpx2.HTTPError, OSError) as error:
                record.update(outcome='error', error='%s: %s' % (type(error).__name__, error))
            record['end'] = time.time()
            with self.lock:
                self.requests.append(record)
            # A user reads an answer before asking again, and a client that was refused backs off, as the official
            # clients do, instead of looping against the door.
            self.stopping.wait(self.pause if record['outcome'] != 'error' else max(self.pause, ERROR_BACKOFF_SECONDS))

    def _one_stream(self, client):
        seen = {'tokens': 0, 'finish_reason': None, 'usage': None, 'done': False}
        with client.chat.completions.with_streaming_response.create(
            model=self.model,
            temperature=0,
            messages=[{'role': 'user', 'content': QUESTION}],
            max_tokens=self.tokens,
            stream=True,
            stream_options={'include_usage': True},
            extra_body={'ignore_eos': True, 'min_tokens': self.tokens},
        ) as response:
            for line in response.iter_lines():
                self._read_event(line, seen)
        complete = (
            seen['done']
            and seen['finish_reason'] == 'length'
            and (seen['usage'] or {}).get('completion_tokens') == self.tokens
        )
        return dict(seen, outcome='complete' if complete else 'cut')

    @staticmethod
    def _read_event(line, seen):
        if not line.startswith('data: '):
            return
        data = line[len('data: ') :]
        if data == '[DONE]':
            seen['done'] = True
            return
        chunk = json.loads(data)
        for choice in chunk.get('choices') or []:
            delta = choice.get('delta') or {}
            # A model that thinks sends its first tokens as reasoning.
            if delta.get('content') or delta.get('reasoning_content') or delta.get('reasoning'):
                seen['tokens'] += 1
            if choice.get('finish_reason'):
                seen['finish_reason'] = choice['finish_reason']
        if chunk.get('usage'):
            seen['usage'] = chunk['usage']

    def summary(self):
        """Requests by outcome, the errors by kind, and the longest time without a complete stream ending."""
        with self.lock:
            requests = sorted(self.requests, key=lambda record: record['end'])
        outcomes = {}
        errors = {}
        for record in requests:
            outcomes[record['outcome']] = outcomes.get(record['outcome'], 0) + 1
            if record['outcome'] == 'error':
                errors[record['error']] = errors.get(record['error'], 0) + 1
        ends = [record['end'] for record in requests if record['outcome'] == 'complete']
        gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
        return {
            'requests': len(requests),
            'outcomes': outcomes,
            'errors': errors,
            'longest_gap_seconds': round(max(gaps), 2) if gaps else None,
            'seconds': round(requests[-1]['end'] - requests[0]['start'], 1) if requests else 0,
        }


class Sampler(threading.Thread):
    """Keeps what sample() returns every `every` seconds, from the start of a with block to its end."""

    def __init__(self, every):
        super().__init__(daemon=True)
        self.every = every
        self.samples = []
        self.stop = threading.Event()

    def sample(self):
        raise NotImplementedError

    def run(self):
        while not self.stop.is_set():
            self.samples.append(self.sample())
            self.stop.wait(self.every)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.join(10)


class BalancerWatch(Sampler):
    """Samples (time, {replica: (status, sessions)}) of HAProxy's backend every second, from its statistics page."""

    def __init__(self, stats_url, backend='vllm'):
        super().__init__(every=1)
        self.stats_url, self.backend = stats_url, backend

    def sample(self):
        try:
            lines = requests.get(self.stats_url, timeout=3).text.lstrip('# ').splitlines()
        except requests.RequestException:
            lines = []
        rows = [dict(zip(lines[0].split(','), line.split(','))) for line in lines[1:]] if lines else []
        servers = {
            row['svname']: (row['status'], int(row['scur'] or 0))
            for row in rows
            if row.get('pxname') == self.backend and row['svname'] not in ('FRONTEND', 'BACKEND')
        }
        return time.time(), servers
