# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of chat_check's readers, over whatever a server, a journal or a user may hand them.

Each reader either returns a value within its invariants or raises the one error it documents
(ValueError for the body readers, CheckFailed for the wait); nothing else ever escapes.
"""

import json
from urllib.parse import urlsplit

from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._chat_check import ChatCheck, CheckFailed
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    MASK,
    api_key_problem,
    mask,
    url_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import (
    explaining_lines,
    journal_lines,
    progress_lines,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._openai import (
    MAX_ANSWER_CHARS,
    error_message,
    parse_chat,
    parse_models,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import parse_unit_show

QUICK = settings(max_examples=200, deadline=None, derandomize=True, database=None)

# JSON values of any shape, with the odd numbers JSON allows Python to write.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
ANY = JSON | st.sampled_from(['', 'null', 'x' * 10, 'Paris'])
# Documents shaped like a chat completion, with any type in any field.
CALL = st.fixed_dictionaries(
    {},
    optional={
        'id': ANY,
        'type': ANY,
        'function': st.fixed_dictionaries({}, optional={'name': ANY, 'arguments': ANY}) | ANY,
    },
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        'content': ANY,
        'reasoning': ANY,
        'reasoning_content': ANY,
        'tool_calls': st.lists(CALL | ANY, max_size=3) | ANY,
    },
)
CHOICE = st.fixed_dictionaries({}, optional={'message': MESSAGE | ANY, 'finish_reason': ANY})
CHAT = st.fixed_dictionaries(
    {},
    optional={
        'choices': st.lists(CHOICE | ANY, max_size=3) | ANY,
        'usage': st.fixed_dictionaries({}, optional={'completion_tokens': ANY}) | ANY,
    },
)
MODELS = st.fixed_dictionaries(
    {}, optional={'data': st.lists(st.fixed_dictionaries({}, optional={'id': ANY}) | ANY, max_size=4) | ANY}
)


def body(documents):
    """Bodies as a server sends them: the documents as JSON, cut short, or any text at all."""
    return (
        documents.map(json.dumps)
        | documents.map(json.dumps).flatmap(lambda text: st.integers(0, len(text)).map(lambda n: text[:n]))
        | st.text(max_size=300)
    )


def quoted_length_ok(text, limit):
    # quote() keeps `limit` characters and adds a note of what it cut.
    return len(text) <= limit + len('... (%d more characters)' % 10**9)


@QUICK
@given(body(CHAT) | st.sampled_from(['[' * 5000, '{"choices": [' * 3000]))
def test_parse_chat_returns_a_bounded_reply_or_says_why_not(text):
    try:
        reply = parse_chat(text)
    except ValueError as exc:
        assert str(exc).startswith(
            ('a body that is not JSON', 'a body without choices', 'a choice without a message', 'a message whose')
        )
        assert len(str(exc)) < 600
        return
    assert isinstance(reply['answer'], str) and len(reply['answer']) <= MAX_ANSWER_CHARS
    for key in ('content', 'reasoning'):
        assert reply[key] is None or (isinstance(reply[key], str) and len(reply[key]) <= MAX_ANSWER_CHARS)
    assert reply['answer'] in (reply['content'] or '', reply['reasoning'] or '')
    assert reply['finish_reason'] is None or isinstance(reply['finish_reason'], str)
    for call in reply['tool_calls']:
        assert set(call) == {'id', 'name', 'arguments'}
        assert isinstance(call['name'], str) and isinstance(call['arguments'], str)
        assert len(call['arguments']) <= MAX_ANSWER_CHARS
    tokens = reply['completion_tokens']
    assert tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0)
    json.dumps(reply)


@QUICK
@given(st.text(max_size=20), st.integers(MAX_ANSWER_CHARS - 40, MAX_ANSWER_CHARS + 40), st.text(max_size=20))
def test_a_long_answer_keeps_its_end(head, filler, tail):
    content = head + 'x' * filler + tail
    reply = parse_chat(json.dumps({'choices': [{'message': {'content': content}}]}))
    assert reply['content'] == content[-MAX_ANSWER_CHARS:]


@QUICK
@given(body(MODELS))
def test_parse_models_returns_names_or_says_why_not(text):
    try:
        ids = parse_models(text)
    except ValueError as exc:
        assert str(exc).startswith(('a body that is not JSON', 'a body without a "data" list'))
        return
    assert all(isinstance(name, str) and name for name in ids)


ERROR = st.fixed_dictionaries(
    {}, optional={'error': ANY | st.fixed_dictionaries({}, optional={'message': ANY}), 'detail': ANY}
)


@QUICK
@given(body(JSON | ERROR))
def test_error_message_is_short_text(text):
    message = error_message(text)
    assert isinstance(message, str) and quoted_length_ok(message, 300)


JOURNAL = st.lists(
    st.sampled_from(
        [
            'Loading safetensors checkpoint shards:  45% Completed | 54/119',
            'ValueError: boom',
            '\r',
            '\n',
            ' ',
            '(EngineCore pid=1) ERROR 11-30 03:51:22 [core.py:1] ',
            'Application startup complete',
            '\x00',
            '\ufffd',
            "vllm.service: Failed with result 'exit-code'.",
            'Model loading took 1 GiB',
        ]
    )
    | st.text(max_size=20),
    max_size=40,
).map(''.join)


@QUICK
@given(JOURNAL, st.integers(-3, 60))
def test_journal_readers_split_and_bound(text, limit):
    lines = journal_lines(text)
    assert all(line.strip() and '\n' not in line and '\r' not in line for line in lines)
    explained = explaining_lines(lines, limit)
    assert len(explained) <= max(limit, 0) and len(set(explained)) == len(explained)
    assert len(progress_lines(lines, max(limit, 1))) <= max(limit, 1)


@QUICK
@given(st.text(max_size=200))
def test_parse_unit_show_reads_any_text(text):
    state = parse_unit_show(text)
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in state.items())


SECRET = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters='*'), min_size=1, max_size=16
)


@QUICK
@given(st.lists(st.text(max_size=20) | SECRET, max_size=6), SECRET)
def test_mask_leaves_no_spelling_of_the_secret(parts, secret):
    text = ' '.join(parts + [secret, json.dumps(secret), repr(secret)])
    masked = mask(text, secret)
    assert secret not in masked
    assert MASK in masked


@QUICK
@given(st.text(max_size=40))
def test_api_key_problem_never_quotes_the_key(key):
    problem = api_key_problem(key)
    printable_ascii = all(' ' <= char <= '~' for char in key)
    assert (problem is None) == printable_ascii
    if problem:
        # The key holds a character that is not printable ASCII, which no message does.
        assert key not in problem


URL = st.sampled_from(['http://', 'https://', 'ftp://', '', 'HTTP://']).flatmap(
    lambda scheme: st.text(alphabet='abc.-:[]@/?#%1 \n\x00\u00e9', max_size=30).map(lambda rest: scheme + rest)
)


@QUICK
@given(URL)
def test_url_problem_accepts_only_urls_that_open_url_can_use(url):
    problem = url_problem(url)
    if problem is None:
        parts = urlsplit(url)
        assert parts.scheme in ('http', 'https') and parts.hostname
        assert parts.port is None or 1 <= parts.port <= 65535
        assert not (parts.query or parts.fragment)
    else:
        assert isinstance(problem, str)


class Server:
    """A fake server whose every answer is drawn; the clock moves one second per request."""

    def __init__(self, answers):
        self.answers = answers
        self.now = 0.0

    def http(self, method, path, payload, timeout, limit):
        self.now += 1
        return self.answers[path]

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


STATUS = st.sampled_from([200, 200, 200, 400, 401, 404, 500, 503])


@QUICK
@given(
    st.tuples(STATUS, st.text(max_size=20)),
    st.tuples(STATUS, body(MODELS)),
    st.tuples(STATUS, body(CHAT)),
    st.sampled_from(['(?i)paris', r'\d', 'x']),
)
def test_the_wait_ends_in_a_result_or_a_check_failure(health, models, chat, expect):
    server = Server({'/health': health, '/v1/models': models, '/v1/chat/completions': chat})
    check = ChatCheck(
        server.http, expect=expect, timeout=10, clock=server.clock, epoch=server.clock, sleep=server.sleep
    )
    try:
        result = check.run()
    except CheckFailed as exc:
        assert exc.msg and exc.details['elapsed'] <= 11
        json.dumps(exc.details)
        return
    assert result['elapsed'] <= 11 and len(result['answer']) <= MAX_ANSWER_CHARS
    json.dumps(result)
