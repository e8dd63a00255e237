# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The coherence gate behind llmserve.vllm.chat_check.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

The wait and its verdicts live here; what it reads lives beside it: the
server's answers in _openai, the unit's state in _systemd, its journal in
_journal. The wait takes its effects as arguments (an HTTP function, a clock,
a sleep, a unit probe, a journal reader), so the unit tests can drive the
whole of it without a server, a systemd or real time.
"""

import re
import time
from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    DEFAULT_URL,
    Http,
    TooLarge,
    Unreachable,
    format_seconds,
    quote,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import (
    DEFAULT_JOURNAL_LINES,
    JOURNAL_SCAN_LINES,
    explaining_lines,
    journal_lines,
    progress_lines,
    timed_lines,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._long_prompt import (
    SizingFailed,
    compose,
    fill_repeats,
    greedy_problem,
    greedy_tokens,
    long_prompt_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import (
    DEFAULT_FORBIDDEN_MARKUP,
    answer_matches,
    assemble_stream,
    error_message,
    expect_problem,
    extra_body_problem,
    judge_tool_calls,
    markup_problem,
    parse_chat,
    parse_models,
    parse_tokenize,
    served_max_model_len,
    stream_events,
    tool_call_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import (
    api_ready_seconds,
    startup_figures,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import (
    UNIT_PROBE_SECONDS,
    UnitUnreadable,
    describe_unit,
    judge_unit,
    unit_number,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._vllm_log import quotable_lines

DEFAULT_PROMPT = 'What is the capital of France?'
DEFAULT_EXPECT = '(?i)paris'
DEFAULT_MAX_TOKENS = 32
DEFAULT_TIMEOUT = 2700
DEFAULT_INTERVAL = 2.0
MAX_INTERVAL = 2.0
DEFAULT_REQUEST_TIMEOUT = 30
DEFAULT_MAX_RESTARTS = 1
# Seconds without a new journal line of the unit and without a 200 from /health or /v1/models after which a start counts as
# stalled; 0 turns the check off. vLLM logs every shard it loads (its bar format ends each update with a newline),
# so a healthy load keeps writing lines; the longest silent phases (compilation, kernel autotuning on a first
# start) must fit in it.
DEFAULT_STALL_TIMEOUT = 900
# How often the journal is read for the stall check, and how many of its last lines are compared and quoted.
STALL_READ_SECONDS = 10
STALL_TAIL_LINES = 5
# last_state before the server showed anything.
NOTHING_YET = 'nothing yet'
# The most of an answer that is read, in bytes, so that no server can fill the memory or the result.
MAX_HEALTH_BYTES = 64 * 1024
MAX_MODELS_BYTES = 1024 * 1024
MAX_CHAT_BYTES = 4 * 1024 * 1024
# /tokenize lists every token's id: a prompt of a million tokens of up to seven digits each.
MAX_TOKENIZE_BYTES = 16 * 1024 * 1024
# Seconds `expect` may take on the answer; more means backtracking without end, as (a+)+$ does.
MATCH_SECONDS = 5
# Most of a reasoning text's end quoted in a message, where a thought that never ended stopped.
MAX_REASONING_QUOTE = 200


class CheckFailed(Exception):
    """The gate failed; msg says why, details go into the module's result."""

    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details


def quote_end(text: str, limit: int = MAX_REASONING_QUOTE) -> str:
    """The end of text for a message, marked '...' where its beginning was cut."""
    if len(text) > limit:
        return '...' + text[-limit:]
    return text


def unauthorized_message(what: str, status: int, url: str, api_key_set: bool) -> str:
    if api_key_set:
        cause = 'the api_key is wrong (it was sent as a Bearer token and refused)'
    else:
        cause = 'the server requires an API key; set api_key'
    return '%s at %s answered %d: %s' % (what, url, status, cause)


class _NotYet(Exception):
    """The server asked to wait (502, 503, 504) while the long prompt was sized; last_state says so."""


class ChatCheck:
    """Wait for /health, then /v1/models, then judge one chat completion.

    http(method, path, payload, timeout, limit) -> (status, text), raising
    Unreachable, or TooLarge for a body of more than limit bytes.
    probe_unit(timeout) -> dict of unit properties (only when unit is set),
    raising UnitUnreadable when systemd does not answer within timeout seconds.
    read_journal(since=None, lines=None, invocation=None, timestamps=False) -> text of the unit's journal (from
    since, epoch seconds; its last lines only; only the run with that systemd invocation ID; each line led by its
    time on CLOCK_MONOTONIC with timestamps, as journalctl's short-monotonic output).
    clock() -> seconds on CLOCK_MONOTONIC (time.monotonic on Linux, the clock of
    systemd's *TimestampMonotonic properties): deadlines and durations;
    epoch() -> seconds since 1970, only to tell journalctl where to start;
    sleep(seconds).
    The one effect not passed in: expect is matched under a real-time deadline
    (MATCH_SECONDS, by SIGALRM), since no clock read can interrupt a regex.
    """

    def __init__(
        self,
        http: Http,
        url: str = DEFAULT_URL,
        model: Optional[str] = None,
        max_model_len: Optional[int] = None,
        prompt: str = DEFAULT_PROMPT,
        expect: str = DEFAULT_EXPECT,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        timeout: float = DEFAULT_TIMEOUT,
        interval: float = DEFAULT_INTERVAL,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        api_key_set: bool = False,
        extra_body: Optional[dict[str, Any]] = None,
        judge_reasoning: bool = False,
        expect_reasoning: Optional[bool] = None,
        forbidden_markup: Sequence[str] = DEFAULT_FORBIDDEN_MARKUP,
        tool_call: Optional[dict[str, Any]] = None,
        long_prompt: Optional[dict[str, Any]] = None,
        stream: bool = False,
        unit: Optional[str] = None,
        probe_unit: Optional[Callable[[float], dict[str, str]]] = None,
        read_journal: Optional[Callable[..., str]] = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        journal_lines: int = DEFAULT_JOURNAL_LINES,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        epoch: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.http = http
        self.url = url.rstrip('/')
        self.model = model
        self.max_model_len = max_model_len
        self.prompt = prompt
        self.long_prompt = long_prompt
        self.expect = expect
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.interval = interval
        self.request_timeout = request_timeout
        self.api_key_set = api_key_set
        self.extra_body = extra_body or {}
        self.judge_reasoning = judge_reasoning
        self.expect_reasoning = expect_reasoning
        self.forbidden_markup = list(forbidden_markup)
        self.tool_call = tool_call
        self.stream = stream
        self.unit = unit
        self.probe_unit = probe_unit
        self.read_journal = read_journal
        self.max_restarts = max_restarts
        self.journal_lines = journal_lines
        self.stall_timeout = stall_timeout
        self.clock = clock
        self.epoch = epoch
        self.sleep = sleep
        self._clear_run_state()

    def _clear_run_state(self) -> None:
        """What run() finds out as it goes, before it begins."""
        self.start = 0.0
        self.start_epoch = 0.0
        self.baseline_restarts: Optional[int] = None
        self.unit_state: dict[str, str] = {}
        self.last_state = NOTHING_YET
        self.healthy_after: Optional[float] = None
        # When /health first answered 200 (clock), and whether it did at the wait's first question: then the API was
        # up before the wait began, and only the journal dates its start.
        self.healthy_at: Optional[float] = None
        self.answered_at_once = False
        self.health_asked = False
        # The stall check: the last journal lines seen (None until the journal showed one, which proves it is
        # readable), when they were last read, and when the start last made progress.
        self.stall_tail: Optional[list[str]] = None
        self.stall_read_at = 0.0
        self.progress_at = 0.0
        # The long prompt's filler count: as given, or once sized to target_tokens by the server's own count; and that
        # count, and what the chat phase asks, for the state a failed request leaves.
        self.long_repeats: Optional[int] = self.long_prompt.get('repeats') if self.long_prompt else None
        self.tokenized: Optional[int] = None
        self.asking = '/v1/chat/completions'
        # The context /v1/models reports for the model asked, once it listed it.
        self.served_max_model_len: Optional[int] = None

    # -- helpers ---------------------------------------------------------

    def _elapsed(self) -> float:
        return round(self.clock() - self.start, 3)

    def _remaining(self) -> float:
        return self.start + self.timeout - self.clock()

    def _details(self) -> dict[str, Any]:
        details = {
            'elapsed': self._elapsed(),
            'url': self.url,
            'last_state': self.last_state,
            'healthy_after': self.healthy_after,
        }
        if self.unit:
            details['restarts'] = self._restarts()
            details['unit_state'] = dict(self.unit_state)
            lines = self._journal(**self._current_run())
            details['progress'] = progress_lines(lines)
            details['startup'] = dict(startup_figures(lines), **self._start_ledger())
        else:
            details['progress'] = []
            details['startup'] = {}
        return details

    def _restarts(self) -> int:
        if self.baseline_restarts is None:
            return 0
        return max(0, unit_number(self.unit_state, 'NRestarts') - self.baseline_restarts)

    def _journal(self, parse: Callable[[str], list[Any]] = journal_lines, **kwargs: Any) -> list[Any]:
        if not self.read_journal:
            return []
        try:
            return parse(self.read_journal(**kwargs))
        except Exception:  # the journal only adds detail; never let it hide the verdict
            # Nor delay it twice: a journalctl that hung once is not asked again.
            self.read_journal = None
            return []

    def _main_start_epoch(self) -> Optional[int]:
        """When the unit's main process last started (epoch seconds), or None."""
        started = unit_number(self.unit_state, 'ExecMainStartTimestampMonotonic')
        if started <= 0:
            return None
        return int(self.epoch() - (self.clock() - started / 1e6))

    def _start_ledger(self) -> dict[str, float]:
        """When the unit's current run answered /health and when this wait began, both in seconds from the run's
        start (systemd's ExecMainStartTimestampMonotonic; without it, the run's first journal line), never from the
        wait's: a wait that began after the start (a gate asked on its own, a rerun) dates it all the same.

        api_ready_seconds: the first 200 of /health where the wait saw the start; where the API already answered the
        wait's first question, the journal's line of it (_vllm_log.is_api_ready); absent where neither tells.
        gate_began_seconds: the wait's start, where systemd told the run's and the run began before the wait.
        """
        started = unit_number(self.unit_state, 'ExecMainStartTimestampMonotonic')
        started_at = started / 1e6 if started > 0 else None
        ledger: dict[str, float] = {}
        if started_at is not None and self.start >= started_at:
            ledger['gate_began_seconds'] = round(self.start - started_at, 3)
        if self.healthy_at is None:
            return ledger
        if started_at is not None and not self.answered_at_once and self.healthy_at >= started_at:
            ledger['api_ready_seconds'] = round(self.healthy_at - started_at, 3)
            return ledger
        timed = self._journal(parse=timed_lines, timestamps=True, **self._current_run())
        ready = api_ready_seconds(timed, started_at)
        if ready is not None:
            ledger['api_ready_seconds'] = ready
        return ledger

    def _current_run(self) -> dict[str, Any]:
        """How to read the journal of the unit's current run: by its invocation ID, which every line of the run
        carries, else by time from its main process's start (a second's resolution, and the previous run's
        last lines may share that second)."""
        invocation = self.unit_state.get('InvocationID', '')
        if re.match(r'^[0-9a-f]{32}$', invocation):
            return {'invocation': invocation}
        since = self._main_start_epoch()
        return {'since': since if since is not None else int(self.start_epoch)}

    def _progress(self) -> list[str]:
        """Progress of the unit's current run."""
        return progress_lines(self._journal(**self._current_run()))

    def _fail(self, msg: str, explain: bool = False) -> NoReturn:
        details = self._details()
        if explain and self.unit:
            # The runs that matter: those during the wait, or the one that failed just before it.
            since = self._main_start_epoch()
            if since is not None:
                since = min(since, int(self.start_epoch))
            lines = explaining_lines(self._journal(since=since, lines=JOURNAL_SCAN_LINES), self.journal_lines)
            details['journal'] = lines
            if lines:
                msg = '%s. From its journal:\n%s' % (msg.rstrip('.'), '\n'.join('  ' + line for line in lines))
        raise CheckFailed(msg, **details)

    def _check_unit(self) -> None:
        probe, unit = self.probe_unit, self.unit
        if probe is None or unit is None:
            return  # no unit to watch
        try:
            self.unit_state = probe(max(1.0, min(UNIT_PROBE_SECONDS, self._remaining())))
        except UnitUnreadable as exc:
            self._fail(exc.msg)
        if self.baseline_restarts is None:
            self.baseline_restarts = unit_number(self.unit_state, 'NRestarts')
        reason = judge_unit(unit, self.unit_state, self.baseline_restarts, self.max_restarts)
        if reason:
            self._fail(
                '%s while waiting %s s for %s to answer' % (reason, format_seconds(self._elapsed()), self.url),
                explain=True,
            )

    def _check_stall(self) -> None:
        """Fail when the start made no progress for stall_timeout seconds: no new journal line of the unit's
        current run and no 200 from /health or /v1/models. Off without a unit or a journal, and until the journal showed a
        line (a journal the check may not read shows none, and must not pass for a stalled start)."""
        if not self.stall_timeout or not self.unit or self.read_journal is None:
            return
        now = self.clock()
        if now - self.stall_read_at < STALL_READ_SECONDS:
            return
        self.stall_read_at = now
        tail = self._journal(lines=STALL_TAIL_LINES, **self._current_run())
        if tail and tail != self.stall_tail:
            self.stall_tail = tail
            self.progress_at = now
            return
        if self.stall_tail is None or now - self.progress_at < self.stall_timeout:
            return
        # Never a client's words that look like vLLM's (uvicorn's access lines): vLLM's own lines and the start's.
        quoted = [quote(line, 300) for line in quotable_lines(self.stall_tail)]
        msg = (
            'No progress for %s s (stall_timeout): no new journal line of %s and no 200 from %s/health or '
            '/v1/models, after '
            'waiting %s s; the unit is %s. The last lines of %s were:\n%s'
            % (
                format_seconds(now - self.progress_at),
                self.unit,
                self.url,
                format_seconds(self._elapsed()),
                describe_unit(self.unit_state),
                self.unit,
                '\n'.join('  ' + line for line in quoted),
            )
        )
        details = self._details()
        details['journal'] = quoted
        raise CheckFailed(msg, **details)

    # -- the phases --------------------------------------------------------

    def _health(self) -> bool:
        first = not self.health_asked
        self.health_asked = True
        status, text = self.http(
            'GET', '/health', None, max(1.0, min(self.request_timeout, self._remaining())), MAX_HEALTH_BYTES
        )
        if status == 200:
            self.healthy_after = self._elapsed()
            if self.healthy_at is None:
                self.healthy_at = self.clock()
                self.answered_at_once = first
            self.progress_at = self.clock()
            return True
        self.last_state = '/health answered %d' % status
        return False

    def _models(self) -> Optional[str]:
        status, text = self.http(
            'GET', '/v1/models', None, max(1.0, min(self.request_timeout, self._remaining())), MAX_MODELS_BYTES
        )
        if status in (401, 403):
            self._fail(unauthorized_message('/v1/models', status, self.url, self.api_key_set))
        if status != 200:
            self.last_state = '/v1/models answered %d: %s' % (status, error_message(text))
            return None
        self.progress_at = self.clock()
        try:
            ids = parse_models(text)
        except ValueError as exc:
            self.last_state = '/v1/models answered with %s' % exc
            return None
        if not ids:
            self.last_state = 'the model list of /v1/models is empty'
            return None
        if self.model is not None and self.model not in ids:
            self._fail(
                "The server at %s does not serve the model '%s'; /v1/models lists: %s"
                % (self.url, self.model, ', '.join(ids))
            )
        model = self.model or ids[0]
        self.served_max_model_len = served_max_model_len(text, model)
        if self.max_model_len is not None and self.served_max_model_len != self.max_model_len:
            served = 'no max_model_len' if self.served_max_model_len is None else self.served_max_model_len
            self._fail(
                "/v1/models at %s reports %s for '%s', where %d was planned: what serves was started with other "
                'settings than the plan' % (self.url, served, model, self.max_model_len)
            )
        return model

    def _user_message(self, question: str) -> str:
        """The question; with long_prompt, its fact, then its filler, before it."""
        if self.long_prompt is None:
            return question
        return compose(self.long_prompt, self.long_repeats or 0, question)

    def _chat(self, model: str) -> Optional[dict[str, Any]]:
        """The coherence request: the prompt, nothing else (a long prompt sized first where it has a target)."""
        if self.long_prompt is not None and self.long_repeats is None and not self._size(model, self.long_prompt):
            return None
        self.asking = '/v1/chat/completions'
        payload = {
            'model': model,
            'messages': [{'role': 'user', 'content': self._user_message(self.prompt)}],
            'max_tokens': self.max_tokens,
            'temperature': 0,
        }
        return self._post(model, payload, 'chat completion')

    def _tool_request(self, model: str, tool_call: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The tool gate's request: its prompt with its one tool, tool_choice left to vLLM's default (auto)."""
        payload = {
            'model': model,
            'messages': [{'role': 'user', 'content': tool_call['prompt']}],
            'tools': [tool_call['tool']],
            'max_tokens': self.max_tokens,
            'temperature': 0,
        }
        return self._post(model, payload, 'tool-call')

    def _size(self, model: str, long_prompt: dict[str, Any]) -> bool:
        """Fill the long prompt to its target_tokens by the server's own count (/tokenize); False to wait on."""
        self.asking = '/tokenize'
        try:
            self.long_repeats, self.tokenized = fill_repeats(
                long_prompt['target_tokens'],
                lambda repeats: self._count_tokens(model, long_prompt, repeats),
                long_prompt['filler'],
            )
        except _NotYet:
            return False
        except SizingFailed as exc:
            self._fail('The long prompt to %s at %s cannot be sized: %s' % (model, self.url, exc))
        return True

    def _count_tokens(self, model: str, long_prompt: dict[str, Any], repeats: int) -> int:
        """The prompt's tokens with the filler repeats times, as the server counts them (its chat template's
        included, with extra_body's chat_template_kwargs); raises _NotYet where the server asks to wait."""
        payload: dict[str, Any] = {
            'model': model,
            'messages': [{'role': 'user', 'content': compose(long_prompt, repeats, self.prompt)}],
        }
        if 'chat_template_kwargs' in self.extra_body:
            payload['chat_template_kwargs'] = self.extra_body['chat_template_kwargs']
        try:
            status, text = self.http('POST', '/tokenize', payload, max(1.0, self._remaining()), MAX_TOKENIZE_BYTES)
        except TooLarge as exc:
            self._fail('/tokenize at %s got %s for the long prompt; a check reads no more' % (self.url, exc.reason))
        if status in (401, 403):
            self._fail(unauthorized_message('/tokenize', status, self.url, self.api_key_set))
        if status in (502, 503, 504):
            self.last_state = '/tokenize answered %d: %s' % (status, error_message(text))
            raise _NotYet()
        counted = parse_tokenize(text) if status == 200 else None
        if counted is None:
            self._fail(
                '/tokenize at %s answered %d for %s without a count of tokens, so the long prompt cannot be sized '
                'to long_prompt.target_tokens: %s' % (self.url, status, model, error_message(text))
            )
        count, served_len = counted
        return self._fits(model, long_prompt['target_tokens'], count, served_len)

    def _fits(self, model: str, target: int, count: int, served_len: int) -> int:
        """count, once the target and the answer are known to fit the context the server serves."""
        wanted = target + self.max_tokens
        if wanted > served_len:
            self._fail(
                'long_prompt.target_tokens (%d) and max_tokens (%d) come to %d tokens, more than the max_model_len '
                'that %s at %s serves (%d)' % (target, self.max_tokens, wanted, model, self.url, served_len)
            )
        return count

    def _greedy_replies(self, model: str, long_prompt: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
        """The greedy-equivalence probe's replies, its short prompt alone and after the long prompt's fact and
        filler, each cut at greedy_tokens at temperature 0 whatever extra_body says; None to wait on."""
        question = long_prompt['greedy_prompt']
        overrides = {'max_tokens': greedy_tokens(long_prompt), 'temperature': 0}
        replies = []
        for content in (question, compose(long_prompt, self.long_repeats or 0, question)):
            self.asking = 'the greedy-equivalence request to /v1/chat/completions'
            payload = {'model': model, 'messages': [{'role': 'user', 'content': content}]}
            reply = self._post(model, payload, 'greedy-equivalence', overrides)
            if reply is None:
                return None
            replies.append(reply)
        return replies

    def _post(
        self, model: str, payload: dict[str, Any], what: str, overrides: Optional[dict[str, Any]] = None
    ) -> Optional[dict[str, Any]]:
        """POST one chat completion (payload, extra_body, then overrides); the parsed reply, or None to wait on."""
        payload.update(self.extra_body)
        payload.update(overrides or {})
        if self.stream:
            # As agents ask: the answer in deltas, which vLLM's parsers make on a path of their own.
            payload.update(stream=True, stream_options={'include_usage': True})
        began = self.clock()
        # The first request after a load can be slow; it may use what is left of the wait.
        try:
            status, text = self.http(
                'POST', '/v1/chat/completions', payload, max(1.0, self._remaining()), MAX_CHAT_BYTES
            )
        except TooLarge as exc:
            self._fail(
                'The %s request to %s for %s got %s; a check reads no more' % (what, self.url, model, exc.reason)
            )
        took = self.clock() - began
        if status in (401, 403):
            self._fail(unauthorized_message('/v1/chat/completions', status, self.url, self.api_key_set))
        if status in (502, 503, 504):
            self.last_state = '/v1/chat/completions answered %d: %s' % (status, error_message(text))
            return None
        if status != 200:
            self._fail(
                'The %s request to %s for %s answered %d: %s' % (what, self.url, model, status, error_message(text)),
                explain=status >= 500,
            )
        try:
            reply = parse_chat(assemble_stream(text) if self.stream else text)
        except ValueError as exc:
            self._fail('The %s from %s at %s answered with %s' % (what, model, self.url, exc))
        reply['stream_events'] = stream_events(text) if self.stream else None
        tokens = reply['completion_tokens']
        reply['tokens_per_second'] = round(tokens / took, 3) if tokens and took > 0 else 0.0
        reply['request_seconds'] = round(took, 3)
        return reply

    # -- the wait ----------------------------------------------------------

    def run(self) -> dict[str, Any]:
        problem = (
            expect_problem(self.expect)
            or extra_body_problem(self.extra_body)
            or markup_problem(self.forbidden_markup)
            or tool_call_problem(self.tool_call)
            or long_prompt_problem(self.long_prompt, self.tool_call)
        )
        if problem:
            raise CheckFailed(problem)
        self.start = self.clock()
        self.start_epoch = self.epoch()
        self.progress_at = self.stall_read_at = self.start
        phase = 'health'
        model: Optional[str] = None
        # The coherence verdict, once it passed: a tool or greedy-equivalence request that gets no answer is asked
        # again alone.
        coherent: Optional[dict[str, Any]] = None
        while True:
            if self.unit:
                self._check_unit()
            try:
                if phase == 'health' and self._health():
                    phase = 'models'
                if phase == 'models':
                    model = self._models()
                    if model is not None:
                        phase = 'chat'
                if phase == 'chat' and model is not None:
                    if coherent is None:
                        reply = self._chat(model)
                        if reply is not None:
                            coherent = self._judge(model, reply)
                    if coherent is not None:
                        verdict = self._after_coherent(model, coherent)
                        if verdict is not None:
                            return verdict
                    phase = 'health'
            except (Unreachable, TooLarge) as exc:
                if getattr(exc, 'timed_out', False) and self._remaining() <= 0 and self.last_state != NOTHING_YET:
                    # The wait's own deadline cut this request short, which says nothing of the server: the
                    # message quotes what the server showed before.
                    self._timeout(phase)
                where = {'health': '/health', 'models': '/v1/models', 'chat': self.asking}[phase]
                self.last_state = '%s (%s)' % (exc.reason, where)
                phase = 'health'
            if coherent is None:
                self._check_stall()
            remaining = self._remaining()
            if remaining <= 0:
                self._timeout(phase)
            self.sleep(min(self.interval, remaining))

    def _after_coherent(self, model: str, coherent: dict[str, Any]) -> Optional[dict[str, Any]]:
        """What follows a coherent answer: the tool gate, or the greedy-equivalence probe, or nothing; the verdict,
        or None to wait on."""
        if self.tool_call is not None:
            self.asking = 'the tool_call request to /v1/chat/completions'
            tool_reply = self._tool_request(model, self.tool_call)
            if tool_reply is None:
                return None
            return self._judge_tool(model, coherent, tool_reply, self.tool_call)
        if self.long_prompt is None or not self.long_prompt.get('greedy_prompt'):
            return coherent
        replies = self._greedy_replies(model, self.long_prompt)
        if replies is None:
            return None
        return self._judge_greedy(model, self.long_prompt, coherent, replies)

    def _judge_greedy(
        self, model: str, long_prompt: dict[str, Any], coherent: dict[str, Any], replies: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The greedy-equivalence verdict on the replies alone and after the prefix; the coherence result with the
        probe's, or CheckFailed."""
        alone, after = replies
        question, tokens = long_prompt['greedy_prompt'], greedy_tokens(long_prompt)
        source = 'The greedy-equivalence probe of %s at %s' % (model, self.url)
        msg = greedy_problem(source, question, tokens, alone, after, after['prompt_tokens'])
        result = dict(coherent, elapsed=self._elapsed())
        result['greedy'] = {
            'prompt': question,
            'tokens': tokens,
            'alone': {'content': alone['content'], 'reasoning': alone['reasoning']},
            'after': {'content': after['content'], 'reasoning': after['reasoning']},
            'prompt_tokens': after['prompt_tokens'],
        }
        if msg:
            raise CheckFailed(msg, **result)
        return result

    def _timeout(self, phase: str) -> NoReturn:
        waited_for = {
            'health': '/health to answer 200',
            'models': '/v1/models to list a model',
            'chat': 'a chat completion',
        }[phase]
        msg = 'Timed out after %s s waiting for %s at %s; last seen: %s' % (
            format_seconds(self.timeout),
            waited_for,
            self.url,
            self.last_state,
        )
        if self.unit:
            msg += '. The unit %s is %s' % (self.unit, describe_unit(self.unit_state))
            progress = self._progress()
            if progress:
                msg += "; its last loading progress: '%s'" % progress[-1]
        self._fail(msg, explain=True)

    def _judge(self, model: str, reply: dict[str, Any]) -> dict[str, Any]:
        """The coherence verdict on content alone (see _coherence_problem); the result, or CheckFailed."""
        answer = reply['content'] or ''
        from_reasoning = self.judge_reasoning and not answer.strip() and bool((reply['reasoning'] or '').strip())
        if from_reasoning:
            answer = reply['reasoning']
        msg = self._coherence_problem(model, reply, answer, from_reasoning)
        result = self._details()
        result.update(
            {
                'model': model,
                'max_model_len': self.served_max_model_len,
                'answer': answer,
                'content': reply['content'],
                'reasoning': reply['reasoning'],
                'finish_reason': reply['finish_reason'],
                'completion_tokens': reply['completion_tokens'],
                'prompt_tokens': reply['prompt_tokens'],
                'tokens_per_second': reply['tokens_per_second'],
                'request_seconds': reply['request_seconds'],
                'stream_events': reply['stream_events'],
            }
        )
        result.pop('last_state', None)
        if self.long_prompt is not None:
            result['long_prompt'] = {
                'repeats': self.long_repeats,
                'target_tokens': self.long_prompt.get('target_tokens'),
                'tokenized': self.tokenized,
            }
        msg = msg or self._long_prompt_problem(model, reply)
        if msg:
            raise CheckFailed(msg, **result)
        return result

    def _long_prompt_problem(self, model: str, reply: dict[str, Any]) -> Optional[str]:
        """Why a long prompt's answer does not prove its length (the server's own count of its tokens), or None."""
        if self.long_prompt is None or not self.long_prompt.get('min_tokens'):
            return None
        counted = reply['prompt_tokens']
        if counted is None:
            return (
                'The long prompt to %s at %s got no prompt_tokens in its usage, so its length is unproven; the check '
                'needs a server that reports usage' % (model, self.url)
            )
        if counted < self.long_prompt['min_tokens']:
            raise_this = 'target_tokens' if self.long_prompt.get('target_tokens') is not None else 'repeats'
            return (
                'The long prompt to %s at %s came to %d tokens, fewer than long_prompt.min_tokens (%d): raise long_prompt.%s'
                % (model, self.url, counted, self.long_prompt['min_tokens'], raise_this)
            )
        return None

    def _coherence_problem(self, model: str, reply: dict[str, Any], answer: str, from_reasoning: bool) -> Optional[str]:
        """Why the answer is not coherent, or None. In order: an answer at all, in the content (unless
        judge_reasoning), without parser markup; the reasoning that expect_reasoning asks for; expect;
        and an answer that finished (finish_reason stop; length too where the reasoning is judged)."""
        source = 'The answer from %s at %s' % (model, self.url)
        content, reasoning = reply['content'] or '', reply['reasoning'] or ''
        if not from_reasoning and not content.strip():
            if reasoning.strip():
                return "%s never left the reasoning: %s, content empty, reasoning ends '%s'" % (
                    source,
                    self._finish(reply),
                    quote_end(reasoning),
                )
            return '%s is empty: %s, no content and no reasoning' % (source, self._finish(reply))
        problem = self._markup_problem(source, content)
        if problem:
            return problem
        if self.expect_reasoning is True and not reasoning.strip():
            return "%s has no reasoning though expect_reasoning is true: %s, content '%s'" % (
                source,
                self._finish(reply),
                quote(content),
            )
        if self.expect_reasoning is False and reasoning.strip():
            return "%s has reasoning though expect_reasoning is false (%d characters, ending '%s'); content '%s'" % (
                source,
                len(reasoning),
                quote_end(reasoning),
                quote(content),
            )
        try:
            with deadline(MATCH_SECONDS):
                matched = answer_matches(self.expect, answer)
        except DeadlinePassed:
            return (
                "expect '%s' took more than %s s to match the answer from %s at %s (%d characters); simplify it: "
                'nested repetition such as (a+)+ backtracks without end'
                % (self.expect, format_seconds(MATCH_SECONDS), model, self.url, len(answer))
            )
        judged = ' (the reasoning, as judge_reasoning asks: the content is empty)' if from_reasoning else ''
        if not matched:
            msg = "%s did not match '%s'%s: '%s'" % (source, self.expect, judged, quote(answer))
            if reply['finish_reason'] == 'length':
                msg += ' (cut at max_tokens=%d)' % self.max_tokens
            return msg
        finished = ('stop', 'length') if from_reasoning else ('stop',)
        if reply['finish_reason'] not in finished:
            return "%s matched '%s' but did not finish: %s; content '%s'" % (
                source,
                self.expect,
                self._finish(reply),
                quote(content),
            )
        return None

    def _finish(self, reply: dict[str, Any]) -> str:
        """'finish_reason length after 32 tokens (max_tokens=32)', as the messages tell how an answer ended."""
        finish = reply['finish_reason']
        text = 'finish_reason %s' % finish if finish is not None else 'no finish_reason'
        tokens = reply['completion_tokens']
        text += ' after %d tokens' % tokens if tokens is not None else ' (no token count)'
        if finish == 'length':
            text += ' (max_tokens=%d)' % self.max_tokens
        return text

    def _markup_problem(self, source: str, content: str) -> Optional[str]:
        found = [token for token in self.forbidden_markup if token in content]
        if not found:
            return None
        return (
            "%s has reasoning or tool-call markup left in its content (%s): the server's reasoning or tool-call "
            "parser did not take it out; content '%s'" % (source, ', '.join("'%s'" % t for t in found), quote(content))
        )

    def _judge_tool(
        self, model: str, coherent: dict[str, Any], reply: dict[str, Any], tool_call: dict[str, Any]
    ) -> dict[str, Any]:
        """The tool gate's verdict; the coherence result with the tool_call result, or CheckFailed."""
        name = tool_call.get('name') or tool_call['tool']['function']['name']
        expected = tool_call.get('arguments') or {}
        match = tool_call.get('arguments_match', 'subset')
        source = 'The tool-call answer from %s at %s' % (model, self.url)
        content = reply['content'] or ''
        arguments, msg = judge_tool_calls(reply['tool_calls'], name, expected, match)
        if msg:
            # Raw tool-call tokens in the content say more than a missing call: no parser took them out.
            markup = self._markup_problem(source, content)
            if markup:
                msg = markup
            elif reply['tool_calls']:
                msg = '%s %s' % (source, msg)
            else:
                msg = "%s %s: %s, content '%s'" % (source, msg, self._finish(reply), quote(content))
        else:
            msg = self._markup_problem(source, content)
        if not msg and reply['finish_reason'] != 'tool_calls':
            msg = '%s called %s but did not finish with finish_reason tool_calls: %s' % (
                source,
                name,
                self._finish(reply),
            )
        result = dict(coherent, elapsed=self._elapsed())
        result['tool_call'] = {
            'name': name,
            'arguments': arguments,
            'tool_calls': reply['tool_calls'],
            'content': reply['content'],
            'reasoning': reply['reasoning'],
            'finish_reason': reply['finish_reason'],
            'completion_tokens': reply['completion_tokens'],
            'request_seconds': reply['request_seconds'],
            'stream_events': reply['stream_events'],
        }
        if msg:
            raise CheckFailed(msg, **result)
        return result
