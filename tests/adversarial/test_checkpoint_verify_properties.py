# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of checkpoint_verify's readers over any input Hypothesis makes up.

Whatever a manifest, a revision, a repo id or a digest cache holds, the pure functions raise
only their own error (ManifestError) and what they accept keeps its invariants: safe relative
names, byte counts, lowercase hex digests of the right length. And whatever is done to a
checkpoint, the problems name exactly the files that were changed. Whatever the Hub quotes of the
token or of the endpoint's password, no message and no returned text shows a run of PART characters of them.
"""

import base64
import io
import json
import os
import re
import struct
import tempfile
from typing import ClassVar
from unittest import mock
from urllib.error import HTTPError, URLError
from urllib.parse import quote as percent_encode

from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint_verify import (
    fingerprint,
    masked_result,
    printable,
    verify,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import DigestCache
from ansible_collections.llmserve.vllm.plugins.module_utils.hub import _hub_manifest
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    ManifestError,
    fetch_manifest,
    model_info_url,
    name_problem,
    parse_manifest,
    repo_id_problem,
    revision_problem,
)
from ansible_collections.llmserve.vllm.tests.adversarial.test_load_probe_properties import PART, echoing, shown_runs
from ansible_collections.llmserve.vllm.tools import fake_hub

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)
HEX = '0123456789abcdefABCDEF'

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8,
)
NAMES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ['config.json', 'a/b.safetensors', '../x', '/etc/passwd', 'a//b', './a', 'a/.', '\udcff', 'a\0b', '']
    ),
)
SIZES = st.one_of(st.integers(-1, 2**64), st.sampled_from([0, True, 1.5, '3', None, 2**63 - 1, 2**63]))
DIGESTS = st.one_of(st.text(alphabet=HEX, min_size=38, max_size=66), st.sampled_from(['', None, 5, 'g' * 40]))
LFS = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={'sha256': DIGESTS, 'size': SIZES, 'pointerSize': SIZES}),
    JSON_SCALARS,
)
SIBLINGS = st.one_of(
    st.fixed_dictionaries({}, optional={'rfilename': NAMES, 'size': SIZES, 'blobId': DIGESTS, 'lfs': LFS}), JSON_VALUES
)
DOCS = st.fixed_dictionaries(
    {},
    optional={
        'sha': st.one_of(DIGESTS, JSON_SCALARS),
        'siblings': st.one_of(st.lists(SIBLINGS, max_size=4), JSON_VALUES),
    },
)


@SETTINGS
@given(st.one_of(DOCS, JSON_VALUES))
def test_parse_manifest_raises_only_its_own_error_and_keeps_its_invariants(doc):
    try:
        manifest = parse_manifest(json.dumps(doc).encode('utf-8', 'surrogatepass'), 'M')
    except ManifestError:
        return
    assert re.fullmatch('[0-9a-f]{40}', manifest.revision)
    for name, entry in manifest.files.items():
        assert entry.name == name and name_problem(name) is None
        assert not os.path.isabs(name) and '..' not in name.split('/')
        assert isinstance(entry.size, int) and not isinstance(entry.size, bool) and 0 <= entry.size <= 2**63 - 1
        assert re.fullmatch('[0-9a-f]{64}' if entry.algorithm == 'sha256' else '[0-9a-f]{40}', entry.digest)


@SETTINGS
@given(st.binary(max_size=64))
def test_parse_manifest_of_any_bytes(raw):
    try:
        parse_manifest(raw, 'M')
    except ManifestError:
        pass


@SETTINGS
@given(st.text(max_size=45), st.booleans(), st.one_of(st.none(), st.text(max_size=12)))
def test_only_a_commit_passes_unless_unpinned_is_allowed(revision, allow, repo_id):
    problem = revision_problem(revision, allow, repo_id)
    assert problem is None or isinstance(problem, str)
    if problem is None and not allow:
        assert re.fullmatch('[0-9a-f]{40}', revision)
    if problem is not None:
        # The revision is shown as JSON, so the message is one line whatever the revision holds.
        assert problem.isprintable()


@SETTINGS
@given(st.text(max_size=110))
def test_an_accepted_repo_id_makes_a_clean_url(repo_id):
    if repo_id_problem(repo_id) is None:
        url = model_info_url('https://huggingface.co', repo_id, 'a' * 40)
        assert re.fullmatch(r'https://huggingface\.co/api/models/[\w./-]+/revision/a{40}\?blobs=true', url, re.ASCII)
        assert '..' not in repo_id and repo_id.count('/') <= 1


@SETTINGS
@given(
    st.lists(
        st.tuples(st.text(max_size=6), st.sampled_from(['sha256', 'git-sha1']), st.text(alphabet=HEX, max_size=6)),
        max_size=6,
    ),
    st.randoms(),
)
def test_fingerprint_is_order_free_and_sees_every_digest(digests, rand):
    shuffled = list(digests)
    rand.shuffle(shuffled)
    assert fingerprint(shuffled) == fingerprint(digests)
    if digests:
        name, algorithm, digest = digests[0]
        assert fingerprint([(name, algorithm, digest + '0')] + digests[1:]) != fingerprint(digests)
        assert fingerprint(digests[1:]) != fingerprint(digests)


@SETTINGS
@given(st.text())
def test_printable_is_always_utf8_and_leaves_utf8_alone(text):
    shown = printable(text)
    shown.encode('utf-8')
    try:
        text.encode('utf-8')
    except UnicodeEncodeError:
        return
    assert shown == text


@SETTINGS
@given(st.one_of(st.binary(max_size=64), JSON_VALUES.map(lambda v: json.dumps({'format': 1, 'entries': v}).encode())))
def test_any_cache_file_loads_or_is_set_aside(raw):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'checkpoint-digests.json'), 'wb') as f:
            f.write(raw)
        os.chmod(os.path.join(d, 'checkpoint-digests.json'), 0o600)
        cache = DigestCache(d)
        cache.load()
        info = os.stat(d)
        for path in list(cache.entries) + [d]:
            value = cache.get(path, info, 'sha256')
            assert value is None or isinstance(value, str)
        assert cache.save(d) is None


SHARD_HEADER = b'{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'
FILES = {
    'config.json': b'{"a": 1}\n',
    'tokenizer.json': b'{}\n',
    'w.safetensors': struct.pack('<Q', len(SHARD_HEADER)) + SHARD_HEADER + b'\1\2\3\4',
}
CHANGES = st.sampled_from(['delete', 'append', 'flip', 'truncate'])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.dictionaries(st.sampled_from(sorted(FILES)), CHANGES, max_size=3),
    st.lists(st.sampled_from(['x.txt', 'sub/y']), max_size=2, unique=True),
)
def test_the_problems_name_exactly_the_files_changed(changes, extras):
    with tempfile.TemporaryDirectory() as d:
        for name, data in FILES.items():
            with open(os.path.join(d, name), 'wb') as f:
                f.write(data)
        entries = fake_hub.describe_tree(d)
        manifest = parse_manifest(
            json.dumps({'sha': 'a' * 40, 'siblings': [fake_hub.sibling(e, True) for e in entries]}).encode('utf-8'), 'M'
        )
        for name, change in changes.items():
            full = os.path.join(d, name)
            data = FILES[name]
            if change == 'delete':
                os.unlink(full)
            else:
                data = {'append': data + b'!', 'flip': data[:-1] + bytes([data[-1] ^ 1]), 'truncate': data[:-1]}[change]
                with open(full, 'wb') as f:
                    f.write(data)
        for name in extras:
            os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
            open(os.path.join(d, name), 'w').close()
        report = verify(d, manifest, threads=2)
        assert set(p['file'] for p in report.problems) == set(changes) | set(extras)
        assert report.ok == (not changes and not extras)
        assert (report.fingerprint is None) == bool(changes or extras)


# --- no run of the token or of the endpoint's password comes back --------------------------------

# Printable ASCII without a space, as the token must be, and no '*' (the mask is made of it).
TOKENS = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters='*'), min_size=PART
)
PASSWORD = 'pw-zq7"hub\\secret'
ENDPOINT = 'http://hub:%s@127.0.0.1:9' % percent_encode(PASSWORD, safe='')
BASIC = base64.b64encode(('hub:%s' % PASSWORD).encode()).decode()
ENDPOINT_SECRETS = (percent_encode(PASSWORD, safe=''), PASSWORD, BASIC)


class Answer(io.BytesIO):
    """A 200 answer with a body."""

    headers: ClassVar[dict[str, str]] = {}

    def getcode(self):
        return 200


def refused(status, headers, body=b''):
    return lambda url, text: HTTPError(url, status, 'X', headers(text), io.BytesIO(body or text.encode()))


def model_info(doc):
    return lambda url, text: Answer(json.dumps(doc(text)).encode())


# How the Hub's text reaches an error of the fetch: the Hub's words (its header or its body), a redirect's
# Location, a network error, and every value of a model info that the checks quote.
ANSWERS = {
    'x-error-message': refused(500, lambda text: {'X-Error-Message': text}, b'-'),
    'error-body': refused(403, lambda text: {}),
    'redirect': refused(302, lambda text: {'Location': text}, b'-'),
    'network': lambda url, text: URLError(text),
    'sha': model_info(lambda text: {'sha': text, 'siblings': []}),
    'sibling': model_info(lambda text: {'sha': 'a' * 40, 'siblings': [text]}),
    'rfilename': model_info(lambda text: {'sha': 'a' * 40, 'siblings': [{'rfilename': text}]}),
    'size': model_info(lambda text: {'sha': 'a' * 40, 'siblings': [{'rfilename': 'f', 'size': text, 'blobId': 'b'}]}),
    'lfs': model_info(lambda text: {'sha': 'a' * 40, 'siblings': [{'rfilename': 'f', 'size': 1, 'lfs': {'x': text}}]}),
    'twice': model_info(
        lambda text: {'sha': 'a' * 40, 'siblings': [{'rfilename': 'f' + text, 'size': 0, 'blobId': 'b' * 40}] * 2}
    ),
}
TOKEN_AND_TEXT = TOKENS.flatmap(lambda token: st.tuples(st.just(token), echoing(token, *ENDPOINT_SECRETS)))


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(TOKEN_AND_TEXT, st.sampled_from(sorted(ANSWERS)))
def test_no_fetch_error_shows_a_run_of_the_token_or_the_endpoints_password(drawn, answer):
    token, text = drawn
    url = model_info_url(ENDPOINT, 'org/model', 'a' * 40)
    outcome = ANSWERS[answer](url, text)
    patched = {'side_effect': outcome} if isinstance(outcome, Exception) else {'return_value': outcome}
    with mock.patch.object(_hub_manifest, 'open_url', **patched):
        try:
            fetch_manifest(ENDPOINT, 'org/model', 'a' * 40, token=token, timeout=5)
        except ManifestError as exc:
            message = str(exc)
        else:
            return  # a text that made a manifest of nothing (an empty sibling list) says nothing
    assert message.startswith('http://hub:********@127.0.0.1:9/') or message.startswith('cannot fetch http://hub:*')
    assert not shown_runs(message, token, *ENDPOINT_SECRETS)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(TOKEN_AND_TEXT.flatmap(lambda drawn: st.tuples(st.just(drawn[0]), st.lists(echoing(drawn[0]), max_size=4))))
def test_no_returned_text_shows_a_run_of_the_token(drawn):
    token, texts = drawn
    problems = [{'file': text, 'kind': 'missing', 'detail': text[::-1] + text} for text in texts]
    result = {'ok': False, 'msg': ' '.join(texts), 'problems': problems, 'rewritten_by_kv_cache_quant': texts}
    masked = masked_result(result, (token,))
    shown = [masked['msg']] + masked['rewritten_by_kv_cache_quant']
    shown += [found[key] for found in masked['problems'] for key in ('file', 'detail')]
    assert not [text for text in shown if shown_runs(text, token)]
