# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of load_probe's masks, over any key, any URL password and any text a server may send.

Whatever a server quotes of the API key or of the URL's credentials (all of it or a piece, escaped or
encoded, among any other text), no error the probe keeps, and no text that names the URL, shows a run of
PART characters of them, as they are or as a server's encoder writes them.
"""

import base64
import contextlib
import html
import io
import json
import re
from unittest import mock
from urllib.error import HTTPError, URLError
from urllib.parse import quote as percent_encode
from urllib.parse import quote_plus
from urllib.parse import unquote as percent_decode

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint import _load_probe
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    MASK,
    credentials_problem,
    mask,
    quote,
    quote_masked,
    url_problem,
    without_credentials,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._load_probe import (
    LoadProbe,
    make_stream,
    stream_request,
)

QUICK = settings(max_examples=100, deadline=None, derandomize=True, database=None)
# Any run of this many characters of a secret counts as a leak.
PART = 8
# Printable ASCII, as api_key must be, but no '*': the mask is made of it, and a key of stars is not
# told apart from it.
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters='*')
KEYS = st.text(alphabet=PRINTABLE, min_size=PART, max_size=40)

# How servers write a text: as it is, JSON (once or twice), Python's repr (either quote), percent-encoded
# (Python, lowercase hex, forms, JavaScript), HTML (Python's, MarkupSafe's).
SPELLINGS = (
    str,
    lambda text: json.dumps(text)[1:-1],
    lambda text: json.dumps(json.dumps(text)[1:-1])[1:-1],
    lambda text: text.replace('\\', '\\\\'),
    lambda text: text.replace('\\', '\\\\').replace("'", "\\'"),
    lambda text: percent_encode(text, safe=''),
    lambda text: re.sub('%[0-9A-F]{2}', lambda code: code.group().lower(), percent_encode(text, safe='')),
    lambda text: quote_plus(text, safe=''),
    lambda text: percent_encode(text, safe="!'()*~"),
    html.escape,
    lambda text: html.escape(text).replace('&quot;', '&#34;').replace('&#x27;', '&#39;'),
)


def echoing(*secrets):
    """Texts a server may send: pieces of the secrets (all of one or any slice, in any of SPELLINGS) among
    any other text."""
    pieces = [
        st.tuples(st.integers(0, len(secret)), st.integers(0, len(secret)), st.sampled_from(SPELLINGS)).map(
            lambda drawn, secret=secret: drawn[2](secret[min(drawn[:2]) : max(drawn[:2])])
        )
        for secret in secrets
    ]
    return st.lists(st.one_of(st.text(max_size=30), *pieces), min_size=1, max_size=6).map(''.join)


def shown_runs(text, *secrets):
    """The runs of PART characters of the secrets that text shows, as they are or as SPELLINGS write them."""
    return sorted(
        set(
            spelled
            for secret in secrets
            for start in range(len(secret) - PART + 1)
            for spell in SPELLINGS
            for spelled in [spell(secret[start : start + PART])]
            if spelled in text
        )
    )


KEY_AND_TEXT = KEYS.flatmap(lambda key: st.tuples(st.just(key), echoing(key)))


@QUICK
@given(KEY_AND_TEXT)
def test_mask_leaves_no_run_of_the_key(drawn):
    key, text = drawn
    masked = mask(text, key)
    assert not shown_runs(masked, key)
    if shown_runs(text, key):
        assert MASK in masked


@QUICK
@given(KEY_AND_TEXT, st.integers(1, 120))
def test_quote_masked_masks_before_it_cuts(drawn, limit):
    key, text = drawn
    shown = quote_masked(text, limit, key)
    assert not shown_runs(shown, key)
    # It shows what masking the whole text and cutting it shows: the bounded search misses nothing.
    masked = mask(text, key)
    assert shown[:limit] == masked[:limit]
    assert (shown == masked) == (len(masked) <= limit)
    # With nothing to mask, it is quote.
    assert quote_masked(text, limit) == quote(text, limit)


def replay(lines):
    return lambda payload, timeout: iter(lines)


def clock():
    return 0.0


# How a server's text reaches an error of the stream: as an event that is not JSON, in an event that is no
# object, as an error event's message or whole error.
EVENTS = (
    lambda text: b'data: ' + text.encode(),
    lambda text: b'data: ' + json.dumps([text]).encode(),
    lambda text: b'data: ' + json.dumps({'error': {'message': text}}).encode(),
    lambda text: b'data: ' + json.dumps({'error': text}).encode(),
)


@QUICK
@given(KEY_AND_TEXT, st.sampled_from(EVENTS))
def test_no_stream_error_shows_a_run_of_the_key(drawn, event):
    key, text = drawn
    request = stream_request(replay([event(text), b'data: [DONE]\n']), {}, 5, clock, (key,))
    assert not shown_runs(request.error or '', key)


@QUICK
@given(KEY_AND_TEXT)
def test_no_unexpected_failure_shows_a_run_of_the_key(drawn):
    key, text = drawn

    def broken(payload, timeout):
        raise RuntimeError(text)

    figures = LoadProbe(broken, model='m', concurrency=1, duration=1, clock=clock, secrets=(key,)).run()
    assert figures['errors'] and not shown_runs(json.dumps(figures['errors']), key)


# Shorter than PART: a user name shows, and one that held the password would show it.
USERS = st.text(alphabet='abcdefghijklmnopqrstuvwxyz', min_size=1, max_size=PART - 1)
# A password as a URL holds it: no @, /, ?, # or space raw (credentials_problem and url_problem refuse those),
# percent-encoded where it has them.
PASSWORDS = st.text(alphabet=PRINTABLE, min_size=PART, max_size=24).map(lambda text: percent_encode(text, safe=':'))


@st.composite
def probes(draw):
    """(url with a user and password, api key, a server's text that quotes both and the Basic credentials)."""
    user, password, key = draw(USERS), draw(PASSWORDS), draw(KEYS)
    basic = base64.b64encode(('%s:%s' % (user, percent_decode(password))).encode()).decode()
    text = draw(echoing(key, password, percent_decode(password), basic))
    return 'http://%s:%s@127.0.0.1:9' % (user, password), key, text, (key, password, basic)


@contextlib.contextmanager
def offline(error):
    """make_stream's requests raise error, and it builds no TLS context (tens of milliseconds each)."""
    with (
        mock.patch.object(_load_probe, 'endpoint_context'),
        mock.patch.object(_load_probe, 'open_endpoint', side_effect=error),
    ):
        yield


@QUICK
@given(probes(), st.sampled_from([400, 401, 403, 500, 503]), st.booleans())
def test_no_http_error_shows_a_run_of_the_key_or_the_urls_password(drawn, status, as_reason):
    url, key, text, secrets = drawn
    body = b'' if as_reason else json.dumps({'error': {'message': text}}).encode()
    refusal = HTTPError(url, status, text if as_reason else 'X', {}, io.BytesIO(body))
    with offline(refusal):
        request = stream_request(make_stream(url, api_key=key), {}, 5, clock)
    assert request.error.startswith('answered %d: ' % status)
    assert not shown_runs(request.error, *secrets)


@QUICK
@given(probes())
def test_no_unreachable_error_shows_a_run_of_the_key_or_the_urls_password(drawn):
    url, key, text, secrets = drawn
    with offline(URLError(text)):
        request = stream_request(make_stream(url, api_key=key), {}, 5, clock)
    assert not shown_runs(request.error, *secrets)


# Any password, raw: with an @, /, ? or # in it where a parser takes it for the end of the credentials.
RAW_PASSWORDS = st.text(alphabet=PRINTABLE, min_size=PART, max_size=24)


@QUICK
@given(USERS, RAW_PASSWORDS, st.sampled_from(['', '/', '/vllm', '/v1', ':99999', ':8000/x?q']))
def test_no_text_that_names_the_url_shows_its_password(user, password, rest):
    url = 'http://%s:%s@127.0.0.1%s' % (user, password, rest)
    # A password that the rest of the URL spells (127.0.0.) is shown by the host, whatever the masking.
    assume(not shown_runs('http://%s:@127.0.0.1%s' % (user, rest), password))
    for text in (without_credentials(url), url_problem(url) or '', credentials_problem(url) or ''):
        assert not shown_runs(text, password)
