# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The coherence gate behind llmserve.vllm.chat_check.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

Everything that decides something lives here and takes its effects as
arguments (an HTTP function, a clock, a sleep, a unit probe, a journal
reader), so the unit tests can drive the whole wait without a server, a
systemd or real time.
"""

import json
import re
import time
from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional

from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
from ansible_collections.llmserve.vllm.plugins.module_utils._http import (
    DEFAULT_URL,
    Http,
    TooLarge,
    Unreachable,
    format_seconds,
    quote,
)
from ansible_collections.llmserve.vllm.plugins.module_utils._startup_log import LINE_PATTERNS as FIGURE_PATTERNS
from ansible_collections.llmserve.vllm.plugins.module_utils._startup_log import startup_figures

DEFAULT_PROMPT = 'What is the capital of France?'
DEFAULT_EXPECT = '(?i)paris'
DEFAULT_MAX_TOKENS = 32
DEFAULT_TIMEOUT = 2700
DEFAULT_INTERVAL = 2.0
MAX_INTERVAL = 2.0
DEFAULT_REQUEST_TIMEOUT = 30
# A day: longer than any load, short enough for every timer and clock sum.
DEFAULT_JOURNAL_LINES = 20
DEFAULT_MAX_RESTARTS = 1
# Seconds without a new journal line of the unit and without a 200 from /health or /v1/models after which a start counts as
# stalled; 0 turns the check off. vLLM logs every shard it loads (its bar format ends each update with a newline),
# so a healthy load keeps writing lines; the longest silent phases (compilation, kernel autotuning on a first
# start) must fit in it.
DEFAULT_STALL_TIMEOUT = 900
# How often the journal is read for the stall check, and how many of its last lines are compared and quoted.
STALL_READ_SECONDS = 10
STALL_TAIL_LINES = 5
# How far back the journal is read to explain a failure.
JOURNAL_SCAN_LINES = 2000
# Progress lists are capped so a long load cannot flood the result.
MAX_PROGRESS_LINES = 50
# The most of an answer that is read, in bytes, so that no server can fill the memory or the result.
MAX_HEALTH_BYTES = 64 * 1024
MAX_MODELS_BYTES = 1024 * 1024
MAX_CHAT_BYTES = 4 * 1024 * 1024
# The most of an answer (its content or reasoning) that is judged and returned, in characters: the end,
# where a long answer reaches its conclusion. Python's re has no timeout and some expressions take time
# quadratic in the text (.*paris); on this length they take well under a second.
MAX_ANSWER_CHARS = 32768
# Seconds `expect` may take on the answer; more means backtracking without end, as (a+)+$ does.
MATCH_SECONDS = 5
# Seconds one `systemctl show` may take (bounded by what is left of the wait), and one journalctl.
UNIT_PROBE_SECONDS = 10
JOURNAL_SECONDS = 5
# JOURNAL_SCAN_LINES lines of a few hundred bytes; a journalctl that prints more is cut off.
MAX_JOURNAL_BYTES = 4 * 1024 * 1024
# Most of a reasoning text's end quoted in a message, where a thought that never ended stopped.
MAX_REASONING_QUOTE = 200

# Markup that a reasoning or tool-call parser takes out of the content: Kimi-K2.5's thinking tags and
# tool-call tokens. Left in the content, the server serves the model without its parser (or a template
# or tokenizer change broke the split), and clients see the model's raw output.
DEFAULT_FORBIDDEN_MARKUP = (
    '<think>',
    '</think>',
    '<|tool_calls_section_begin|>',
    '<|tool_calls_section_end|>',
    '<|tool_call_begin|>',
    '<|tool_call_argument_begin|>',
    '<|tool_call_end|>',
)
# Request fields the checks set or rely on, which extra_body may not set: the model and the question,
# one non-streamed choice, the length the messages cite, the tools of the tool gate, the reasoning the
# thinking check reads, and echo (vLLM then puts the prompt into the content).
RESERVED_REQUEST_KEYS = (
    'model',
    'messages',
    'stream',
    'stream_options',
    'n',
    'max_tokens',
    'max_completion_tokens',
    'tools',
    'tool_choice',
    'functions',
    'function_call',
    'include_reasoning',
    'echo',
)
ARGUMENTS_MATCHES = ('subset', 'exact')

UNIT_PROPERTIES = (
    'LoadState',
    'ActiveState',
    'SubState',
    'Result',
    'NRestarts',
    'ExecMainStatus',
    'ExecMainStartTimestampMonotonic',
    'InvocationID',
)

# Lines of a unit's journal that explain why vLLM did not come up.
_EXPLAIN_PATTERNS = [
    re.compile(p)
    for p in (
        r'estimated maximum model length',
        r'(?i)out of memory',
        r'(?i)\boom[- ]kill',
        # The last line of a Python traceback: "ValueError: ...", "torch.OutOfMemoryError: ...".
        r'(?:^|[\s\]:)])(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::|$)',
        # argparse refusing the command line: "api_server.py: error: unrecognized arguments: --x".
        r'^[\w.\- ]+: error: ',
        # systemd's own account of the unit.
        r'Main process exited',
        r'Failed with result',
        r'Start request repeated too quickly',
        r'restart counter is at',
    )
]

# Lines that tell how far loading has come.
_PROGRESS_PATTERNS = [
    re.compile(p)
    for p in (
        r'Starting to load model',
        r'Loading safetensors checkpoint shards',
        r'Loading weights took',
        r'Model loading took',
        r'KV cache size:',
        r'Maximum concurrency for',
        r'Capturing CUDA graphs',
        r'Graph capturing finished',
        r'init engine \(profile, create kv cache, warmup model\) took',
        r'Starting vLLM (?:API )?server',
        r'Application startup complete',
    )
] + FIGURE_PATTERNS
# Progress bars: each update is a line of its own; consecutive updates of one bar keep only the latest.
_PROGRESS_BARS = [re.compile(r'Loading safetensors checkpoint shards'), re.compile(r'Capturing CUDA graphs')]
_LOG_PREFIX = re.compile(
    r'^\s*(?:\([^)]*\)\s+)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+'
    r'\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?'
)


class CheckFailed(Exception):
    """The gate failed; msg says why, details go into the module's result."""

    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details


def expect_problem(expect: str) -> Optional[str]:
    """Why expect cannot judge an answer, or None."""
    try:
        pattern = re.compile(expect)
    except re.error as exc:
        return "expect '%s' is not a valid regular expression: %s" % (expect, exc)
    if pattern.search('') is not None:
        return (
            "expect '%s' matches an empty answer, so it cannot tell an answer from none; give text that the "
            'right answer must contain' % expect
        )
    return None


def extra_body_problem(extra_body: dict[str, Any]) -> Optional[str]:
    """Why extra_body cannot be merged into the check's requests, or None."""
    reserved = [key for key in RESERVED_REQUEST_KEYS if key in extra_body]
    if reserved:
        return (
            'extra_body sets %s, which the check sets or relies on itself; use the options model, prompt, '
            'max_tokens and tool_call instead' % ', '.join(reserved)
        )
    return None


def markup_problem(markup: list[str]) -> Optional[str]:
    """Why forbidden_markup cannot judge a content, or None."""
    for position, token in enumerate(markup, 1):
        if not isinstance(token, str) or not token:
            return 'forbidden_markup has an empty entry at position %d; every content contains it' % position
    return None


def tool_call_problem(tool_call: Optional[dict[str, Any]]) -> Optional[str]:
    """Why tool_call cannot be the tool gate, or None."""
    if tool_call is None:
        return None
    tool = tool_call.get('tool')
    function = tool.get('function') if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get('type') != 'function'
        or not isinstance(function, dict)
        or not isinstance(function.get('name'), str)
        or not function['name']
    ):
        return (
            'tool_call.tool must be an OpenAI tools entry, {"type": "function", "function": {"name": ..., '
            '"parameters": ...}}, got %s' % quote(_json(tool), 200)
        )
    name = tool_call.get('name')
    if name is not None and name != function['name']:
        return "tool_call.name '%s' is not the name of the function that tool_call.tool offers ('%s')" % (
            name,
            function['name'],
        )
    if not isinstance(tool_call.get('prompt'), str) or not tool_call['prompt'].strip():
        return 'tool_call.prompt must be a question that the tool answers'
    if not isinstance(tool_call.get('arguments') or {}, dict):
        return 'tool_call.arguments must be a JSON object, got %s' % quote(_json(tool_call['arguments']), 200)
    if tool_call.get('arguments_match', 'subset') not in ARGUMENTS_MATCHES:
        return 'tool_call.arguments_match must be one of %s, got %s' % (
            ', '.join(ARGUMENTS_MATCHES),
            tool_call['arguments_match'],
        )
    return None


def _json(value: Any) -> str:
    """value as compact JSON for a message, or its repr when it is no JSON."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def quote_end(text: str, limit: int = MAX_REASONING_QUOTE) -> str:
    """The end of text for a message, marked '...' where its beginning was cut."""
    if len(text) > limit:
        return '...' + text[-limit:]
    return text


def parse_unit_show(text: Any) -> dict[str, str]:
    """Parse `systemctl show -p A,B unit` output into a dict of strings."""
    state = {}
    for line in to_text(text).splitlines():
        key, sep, value = line.partition('=')
        if sep:
            state[key.strip()] = value.strip()
    return state


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def describe_unit(state: dict[str, str]) -> str:
    """One parenthesis that tells the unit's state, e.g. '(ActiveState=failed, ...)'."""
    parts = []
    for key in ('ActiveState', 'SubState', 'Result', 'ExecMainStatus', 'NRestarts'):
        if state.get(key, '') != '':
            parts.append('%s=%s' % (key, state[key]))
    return '(%s)' % ', '.join(parts)


def judge_unit(unit: str, state: dict[str, str], baseline_restarts: int, max_restarts: int) -> Optional[str]:
    """Decide whether waiting on a unit still makes sense.

    Returns None while the unit may still come up, otherwise the reason to
    stop waiting at once.  The rule:
      - the unit is not loaded (no such unit) -> stop;
      - ActiveState is failed -> stop (crashed, or StartLimit reached);
      - ActiveState is inactive -> stop (stopped, or never started);
      - NRestarts grew by more than max_restarts since the wait began -> stop:
        systemd keeps restarting a crashing service (a restart loop).
    activating, deactivating, reloading and active keep the wait going, and
    so does a restart count within max_restarts: one restart after a crash or
    a deliberate kill -9 is what Restart= is for.
    """
    load = state.get('LoadState', '')
    active = state.get('ActiveState', '')
    if load and load not in ('loaded',):
        return 'The unit %s is not loaded (LoadState=%s)' % (unit, load)
    if active == 'failed':
        return 'The unit %s failed %s' % (unit, describe_unit(state))
    if active == 'inactive':
        return 'The unit %s is not running %s' % (unit, describe_unit(state))
    restarts = _int(state.get('NRestarts')) - baseline_restarts
    if restarts > max_restarts:
        return (
            'The unit %s is in a restart loop: systemd restarted it %d times while waiting '
            '(more than max_restarts=%d) %s' % (unit, restarts, max_restarts, describe_unit(state))
        )
    return None


def journal_lines(text: Any) -> list[str]:
    """Split journal text into lines; a carriage return (progress bars) also ends a line."""
    lines = []
    for line in to_text(text).splitlines():
        for part in line.split('\r'):
            part = part.rstrip()
            if part.strip():
                lines.append(part)
    return lines


def strip_log_prefix(line: str) -> str:
    """Drop vLLM's log prefix: '(EngineCore pid=7) ERROR 11-30 03:50:07 [core.py:1510] '."""
    return _LOG_PREFIX.sub('', line, count=1).strip()


def explaining_lines(lines: list[str], limit: int = DEFAULT_JOURNAL_LINES) -> list[str]:
    """Pick the journal lines that explain a failure: the last `limit`, each once.

    vLLM logs a failure twice (the engine process, then the API server), with
    and without its log prefix; lines are compared and quoted without it.
    """
    picked: list[str] = []
    for line in lines:
        if any(p.search(line) for p in _EXPLAIN_PATTERNS):
            line = strip_log_prefix(line)
            if line in picked:
                picked.remove(line)
            picked.append(line)
    if limit <= 0:
        return []
    return picked[-limit:]


def progress_lines(lines: list[str], limit: int = MAX_PROGRESS_LINES) -> list[str]:
    """Pick the loading-progress lines; consecutive updates of one progress bar keep only the latest."""
    picked: list[str] = []
    for line in lines:
        if not any(p.search(line) for p in _PROGRESS_PATTERNS):
            continue
        line = strip_log_prefix(line)
        if picked and any(shown.search(line) and shown.search(picked[-1]) for shown in _PROGRESS_BARS):
            picked[-1] = line
        else:
            picked.append(line)
    return picked[-limit:]


def parse_json(text: str) -> tuple[Any, Optional[str]]:
    """Parse a JSON body; return (value, None) or (None, reason)."""
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, 'a body that is not JSON (%s): %s' % (to_text(exc), quote(text, 200))
    except RecursionError:
        return None, 'a body that is not JSON (nested too deeply): %s' % quote(text, 200)


def parse_models(text: str) -> list[str]:
    """Return the model ids that /v1/models lists, or raise ValueError with the reason."""
    doc, error = parse_json(text)
    if error:
        raise ValueError(error)
    data = doc.get('data') if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ValueError('a body without a "data" list: %s' % quote(text, 200))
    return [
        entry['id'] for entry in data if isinstance(entry, dict) and isinstance(entry.get('id'), str) and entry['id']
    ]


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body, else the body itself (shortened)."""
    doc, error = parse_json(text)
    if not error and isinstance(doc, dict):
        err = doc.get('error', doc)
        if isinstance(err, dict) and err.get('message'):
            return quote(err['message'], 300)
        if isinstance(err, str):
            return quote(err, 300)
        if doc.get('detail'):
            return quote(to_text(doc['detail']), 300)
    return quote(text, 300)


def parse_chat(text: str) -> dict[str, Any]:
    """Read one chat completion.

    Returns a dict with answer (the content, '' when there is none), content,
    reasoning (vLLM's `reasoning`, formerly `reasoning_content`), tool_calls
    (each with id, name and arguments as the server sent them), finish_reason
    and completion_tokens. Content and reasoning keep their last
    MAX_ANSWER_CHARS characters.
    Raises ValueError when the body is not a chat completion.
    """
    doc, error = parse_json(text)
    if error:
        raise ValueError(error)
    choices = doc.get('choices') if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError('a body without choices: %s' % quote(text, 200))
    choice = choices[0]
    message = choice.get('message') or {}
    if not isinstance(message, dict):
        raise ValueError('a choice without a message: %s' % quote(text, 200))
    content = message.get('content')
    reasoning = message.get('reasoning')
    if reasoning is None:
        reasoning = message.get('reasoning_content')
    for name, value in (('content', content), ('reasoning', reasoning)):
        if value is not None and not isinstance(value, str):
            raise ValueError('a message whose %s is not text: %s' % (name, quote(text, 200)))
    content = _answer_end(content)
    reasoning = _answer_end(reasoning)
    usage = doc.get('usage') if isinstance(doc.get('usage'), dict) else {}
    tokens = usage.get('completion_tokens')
    finish_reason = choice.get('finish_reason')
    return {
        'answer': content or '',
        'content': content,
        'reasoning': reasoning,
        'tool_calls': parse_tool_calls(message.get('tool_calls'), text),
        'finish_reason': finish_reason if isinstance(finish_reason, str) else None,
        'completion_tokens': _count(tokens),
    }


def parse_tool_calls(calls: Any, text: str) -> list[dict[str, Any]]:
    """The tool calls of a message as [{'id', 'name', 'arguments'}]; the arguments stay the server's text.

    vLLM leaves tool_calls out when there are none. Raises ValueError for calls of the wrong shape.
    """
    if calls is None:
        return []
    parsed = []
    if isinstance(calls, list):
        for call in calls:
            function = call.get('function') if isinstance(call, dict) else None
            if not isinstance(function, dict):
                break
            name, arguments, call_id = function.get('name'), function.get('arguments'), call.get('id')
            if (
                not isinstance(name, str)
                or not isinstance(arguments, str)
                or not isinstance(call_id, (str, type(None)))
            ):
                break
            parsed.append({'id': call_id, 'name': name, 'arguments': arguments[-MAX_ANSWER_CHARS:]})
        else:
            return parsed
    raise ValueError(
        'a message whose tool_calls are not calls of a function by name with text arguments: %s' % quote(text, 200)
    )


def _count(value: Any) -> Optional[int]:
    """value when it is a count, else None: an int (a bool is one to Python) that is not negative."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _answer_end(text: Optional[str]) -> Optional[str]:
    """The last MAX_ANSWER_CHARS characters of text, which the check judges and returns."""
    if text is None:
        return None
    return text[-MAX_ANSWER_CHARS:]


def answer_matches(expect: str, answer: Optional[str]) -> bool:
    """True when the regular expression finds a match anywhere in the answer."""
    return re.search(expect, answer or '') is not None


def unauthorized_message(what: str, status: int, url: str, api_key_set: bool) -> str:
    if api_key_set:
        cause = 'the api_key is wrong (it was sent as a Bearer token and refused)'
    else:
        cause = 'the server requires an API key; set api_key'
    return '%s at %s answered %d: %s' % (what, url, status, cause)


class ChatCheck:
    """Wait for /health, then /v1/models, then judge one chat completion.

    http(method, path, payload, timeout, limit) -> (status, text), raising
    Unreachable, or TooLarge for a body of more than limit bytes.
    probe_unit(timeout) -> dict of unit properties (only when unit is set),
    raising CheckFailed when systemd does not answer within timeout seconds.
    read_journal(since=None, lines=None, invocation=None) -> text of the unit's journal (from since, epoch
    seconds; its last lines only; only the run with that systemd invocation ID).
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
        self.prompt = prompt
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
        self.unit = unit
        self.probe_unit = probe_unit
        self.read_journal = read_journal
        self.max_restarts = max_restarts
        self.journal_lines = journal_lines
        self.stall_timeout = stall_timeout
        self.clock = clock
        self.epoch = epoch
        self.sleep = sleep
        # Set when run() begins.
        self.start = 0.0
        self.start_epoch = 0.0
        self.baseline_restarts: Optional[int] = None
        self.unit_state: dict[str, str] = {}
        self.last_state = 'nothing yet'
        self.healthy_after: Optional[float] = None
        # The stall check: the last journal lines seen (None until the journal showed one, which proves it is
        # readable), when they were last read, and when the start last made progress.
        self.stall_tail: Optional[list[str]] = None
        self.stall_read_at = 0.0
        self.progress_at = 0.0

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
            details['startup'] = startup_figures(lines)
        else:
            details['progress'] = []
            details['startup'] = {}
        return details

    def _restarts(self) -> int:
        if self.baseline_restarts is None:
            return 0
        return max(0, _int(self.unit_state.get('NRestarts')) - self.baseline_restarts)

    def _journal(self, **kwargs: Any) -> list[str]:
        if not self.read_journal:
            return []
        try:
            return journal_lines(self.read_journal(**kwargs))
        except Exception:  # the journal only adds detail; never let it hide the verdict
            # Nor delay it twice: a journalctl that hung once is not asked again.
            self.read_journal = None
            return []

    def _main_start_epoch(self) -> Optional[int]:
        """When the unit's main process last started (epoch seconds), or None."""
        started = _int(self.unit_state.get('ExecMainStartTimestampMonotonic'))
        if started <= 0:
            return None
        return int(self.epoch() - (self.clock() - started / 1e6))

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
        except CheckFailed as exc:
            self._fail(exc.msg)
        if self.baseline_restarts is None:
            self.baseline_restarts = _int(self.unit_state.get('NRestarts'))
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
        quoted = [quote(line, 300) for line in self.stall_tail]
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
        status, text = self.http(
            'GET', '/health', None, max(1.0, min(self.request_timeout, self._remaining())), MAX_HEALTH_BYTES
        )
        if status == 200:
            self.healthy_after = self._elapsed()
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
        if self.model is None:
            return ids[0]
        if self.model not in ids:
            self._fail(
                "The server at %s does not serve the model '%s'; /v1/models lists: %s"
                % (self.url, self.model, ', '.join(ids))
            )
        return self.model

    def _chat(self, model: str) -> Optional[dict[str, Any]]:
        """The coherence request: the prompt, nothing else."""
        payload = {
            'model': model,
            'messages': [{'role': 'user', 'content': self.prompt}],
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

    def _post(self, model: str, payload: dict[str, Any], what: str) -> Optional[dict[str, Any]]:
        """POST one chat completion (payload and extra_body); the parsed reply, or None to wait on."""
        payload.update(self.extra_body)
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
            reply = parse_chat(text)
        except ValueError as exc:
            self._fail('The %s from %s at %s answered with %s' % (what, model, self.url, exc))
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
        )
        if problem:
            raise CheckFailed(problem)
        self.start = self.clock()
        self.start_epoch = self.epoch()
        self.progress_at = self.stall_read_at = self.start
        phase = 'health'
        model: Optional[str] = None
        # The coherence verdict, once it passed: a tool request that gets no answer is asked again alone.
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
                        if self.tool_call is None:
                            return coherent
                        tool_reply = self._tool_request(model, self.tool_call)
                        if tool_reply is not None:
                            return self._judge_tool(model, coherent, tool_reply, self.tool_call)
                    phase = 'health'
            except (Unreachable, TooLarge) as exc:
                where = {'health': '/health', 'models': '/v1/models', 'chat': '/v1/chat/completions'}[phase]
                if phase == 'chat' and coherent is not None:
                    where = 'the tool_call request to /v1/chat/completions'
                self.last_state = '%s (%s)' % (exc.reason, where)
                phase = 'health'
            if coherent is None:
                self._check_stall()
            remaining = self._remaining()
            if remaining <= 0:
                self._timeout(phase)
            self.sleep(min(self.interval, remaining))

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
                'answer': answer,
                'content': reply['content'],
                'reasoning': reply['reasoning'],
                'finish_reason': reply['finish_reason'],
                'completion_tokens': reply['completion_tokens'],
                'tokens_per_second': reply['tokens_per_second'],
                'request_seconds': reply['request_seconds'],
            }
        )
        result.pop('last_state', None)
        if msg:
            raise CheckFailed(msg, **result)
        return result

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
        exact = tool_call.get('arguments_match', 'subset') == 'exact'
        source = 'The tool-call answer from %s at %s' % (model, self.url)
        content = reply['content'] or ''
        arguments, msg = judge_tool_calls(reply['tool_calls'], name, expected, exact)
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
        }
        if msg:
            raise CheckFailed(msg, **result)
        return result


def judge_tool_calls(
    calls: list[dict[str, Any]], name: str, expected: dict[str, Any], exact: bool
) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(the arguments of the first call of name that match, None) or (None, what is wrong, after 'The answer ...')."""
    if not calls:
        return None, 'has no tool call, where it should call %s' % name
    named = [call for call in calls if call['name'] == name]
    if not named:
        return None, 'called %s, not %s' % (', '.join(call['name'] for call in calls), name)
    problems = []
    for call in named:
        try:
            arguments = json.loads(call['arguments'])
        except ValueError as exc:
            problems.append("with arguments that are not JSON (%s): '%s'" % (to_text(exc), quote(call['arguments'])))
            continue
        except RecursionError:
            problems.append("with arguments that are not JSON (nested too deeply): '%s'" % quote(call['arguments']))
            continue
        if not isinstance(arguments, dict):
            problems.append("with arguments that are not a JSON object: '%s'" % quote(call['arguments']))
        elif not arguments_match(arguments, expected, exact):
            problems.append(
                "with arguments '%s', which %s %s"
                % (quote(call['arguments']), 'are not exactly' if exact else 'do not contain', quote(_json(expected)))
            )
        else:
            return arguments, None
    return None, 'called %s %s' % (name, problems[0])


def arguments_match(arguments: dict[str, Any], expected: dict[str, Any], exact: bool) -> bool:
    """Whether the call's arguments hold every expected key with an equal value (and no other key when exact)."""
    if exact and set(arguments) != set(expected):
        return False
    return all(key in arguments and same_json(arguments[key], value) for key, value in expected.items())


def same_json(a: Any, b: Any) -> bool:
    """Equality of JSON values as JSON means it: true is not 1, 1 is 1.0, objects and arrays compare whole."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same_json(a[key], b[key]) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
