# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The Hugging Face Hub's list of a revision's files, read and checked.

PRIVATE to the collection: this is not a public API; it may change without notice.

``GET {endpoint}/api/models/{repo_id}/revision/{commit}?blobs=true`` (what
``huggingface_hub.model_info(repo_id, revision=commit, files_metadata=True)`` fetches)
answers ``{"sha": commit, "siblings": [{"rfilename", "size", "blobId", "lfs": {"sha256",
"size", "pointerSize"}}]}``. ``lfs`` is there for files kept in Git LFS (the weights):
their ``blobId`` is the git blob of the LFS pointer, so their content is ``lfs.sha256``.
For the others ``blobId`` is the git blob SHA-1 of the content,
``sha1(b"blob <size>\\0" + content)``.
"""

import json
import re
import time
from collections.abc import Iterable, Sequence
from email.message import Message
from http.client import HTTPException
from typing import Any, Optional
from urllib.error import HTTPError, URLError
from urllib.parse import quote

from ansible.module_utils.urls import open_url

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CheckpointError, open_regular
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import GIT_SHA1, SHA256
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    MAX_QUOTE,
    mask,
    quote_masked,
    read_limited,
    url_secrets,
    without_credentials,
)

DEFAULT_ENDPOINT = 'https://huggingface.co'
# Kimi-K2.5's model info is about 60 kB; anything near this is not a model info.
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 2**63 - 1
# The most of an error answer's body read for the Hub's own words; a message quotes HUB_SAYS_CHARS of them.
MAX_ERROR_BODY_BYTES = 64 << 10
HUB_SAYS_CHARS = 300
# The longest JSON value, or file name, that a message quotes.
SHOWN_CHARS = 120

# Matched with fullmatch: '$' would also match before a final line break.
_COMMIT = re.compile(r'[0-9a-f]{40}')
_HEX40 = re.compile(r'[0-9a-fA-F]{40}')
_HEX64 = re.compile(r'[0-9a-fA-F]{64}')
# huggingface_hub's validate_repo_id: an optional namespace and a name of word characters, '-' and '.'.
_REPO_ID = re.compile(r'(?:[A-Za-z0-9_][\w.-]*/)?[A-Za-z0-9_][\w.-]{0,95}', re.ASCII)
_ENDPOINT = re.compile(r'https?://[^/\s?#]+(/[^\s?#]*)?')


class ManifestError(Exception):
    """The manifest cannot be had or read; the message names where it came from and why."""


class ManifestFile:
    """One file of the revision: its size and the digest its content must have."""

    def __init__(self, name: str, size: int, algorithm: str, digest: str) -> None:
        self.name = name
        self.size = size
        self.algorithm = algorithm
        self.digest = digest


class Manifest:
    """A revision's commit and its files {rfilename: ManifestFile}."""

    def __init__(self, revision: str, files: dict[str, ManifestFile]) -> None:
        self.revision = revision
        self.files = files


def _shown(value: Any, secrets: Sequence[Optional[str]] = ()) -> str:
    """A JSON value for a message, cut short, the secrets masked before the cut."""
    return quote_masked(json.dumps(value), SHOWN_CHARS, *secrets)


def _name(name: str, secrets: Sequence[Optional[str]]) -> str:
    """A file name of the manifest for a message, cut short, the secrets masked before the cut."""
    return quote_masked(name, SHOWN_CHARS, *secrets)


def revision_problem(revision: str, allow_unpinned: bool = False, repo_id: Optional[str] = None) -> Optional[str]:
    """Why ``revision`` cannot be used, or None.

    A branch or tag can move between the runs on two nodes (or between the fetch and
    the check), and then nodes serve different weights under the same name.
    """
    if _COMMIT.fullmatch(revision):
        return None
    if _HEX40.fullmatch(revision):
        return 'revision %s must be written in lowercase, as the Hub writes commits' % revision
    if allow_unpinned:
        return None if revision.strip() else 'revision must not be empty'
    repo = repo_id if repo_id and repo_id.isprintable() else 'REPO'
    ref = revision if revision.isprintable() else 'BRANCH'
    return (
        'revision %s is not a commit: a branch or tag can move, and then nodes fetch different files. '
        'Give the full 40-hex commit it points to now: `hf models info %s --revision %s --expand sha --json`, '
        "huggingface_hub.model_info(%r, revision=%r).sha, or the commit history on the repository's "
        'web page (Files and versions, History); allow_unpinned_revision=true accepts a branch or tag anyway'
        % (_shown(revision), repo, ref, repo, ref)
    )


def repo_id_problem(repo_id: str) -> Optional[str]:
    """Why ``repo_id`` is no Hub repository id, or None."""
    if _REPO_ID.fullmatch(repo_id) and '..' not in repo_id and '--' not in repo_id and not repo_id.endswith(('.', '-')):
        return None
    return (
        "repo_id %s is not a Hub repository id: NAMESPACE/NAME of letters, digits, '_', '-' and '.' "
        '(for example moonshotai/Kimi-K2.5)' % _shown(repo_id)
    )


def endpoint_problem(endpoint: str) -> Optional[str]:
    """Why endpoint is no URL of a Hub, or None; the message shows it without its password."""
    if _ENDPOINT.fullmatch(endpoint):
        return None
    return 'endpoint %s is not an http:// or https:// URL' % _shown(without_credentials(endpoint))


def model_info_url(endpoint: str, repo_id: str, revision: str) -> str:
    """The model-info URL of one revision with its blob metadata."""
    return '%s/api/models/%s/revision/%s?blobs=true' % (endpoint.rstrip('/'), repo_id, quote(revision, safe=''))


def name_problem(name: object) -> Optional[str]:
    """Why a file name from the Hub cannot be a file inside the checkpoint directory, or None."""
    if not isinstance(name, str) or not name:
        return 'is not a non-empty string'
    try:
        name.encode('utf-8')
    except UnicodeEncodeError:
        return 'is not valid UTF-8 text (a lone surrogate escape)'
    if '\0' in name:
        return 'holds a NUL character'
    parts = name.split('/')
    if name.startswith('/') or any(part in ('', '.', '..') for part in parts):
        return 'is not a relative path inside the checkpoint'
    return None


def _byte_count(value: Any) -> Optional[int]:
    # A JSON true is an int to Python, and no size; no file holds more bytes than a signed 64-bit offset counts.
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_FILE_BYTES else None


def _file_entry(sibling: Any, where: str, position: int, secrets: Sequence[Optional[str]]) -> ManifestFile:
    """ManifestFile of one sibling; raises ManifestError naming it."""
    if not isinstance(sibling, dict):
        raise ManifestError('%s: siblings[%d] is %s, not an object' % (where, position, _shown(sibling, secrets)))
    name: Any = sibling.get('rfilename')  # a str once name_problem passes it
    problem = name_problem(name)
    if problem:
        raise ManifestError('%s: siblings[%d].rfilename %s %s' % (where, position, _shown(name, secrets), problem))
    shown = _name(name, secrets)
    if 'size' not in sibling or ('blobId' not in sibling and not sibling.get('lfs')):
        raise ManifestError(
            '%s: %s has no size and blobId: the manifest must be the model info with blob metadata '
            '(?blobs=true, files_metadata=True)' % (where, shown)
        )
    size = _byte_count(sibling['size'])
    if size is None:
        raise ManifestError('%s: %s has size %s, not a byte count' % (where, shown, _shown(sibling['size'], secrets)))
    lfs = sibling.get('lfs')
    if lfs is not None:
        digest = lfs.get('sha256') if isinstance(lfs, dict) else None
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ManifestError(
                '%s: %s has lfs %s without a sha256 of 64 hex digits' % (where, shown, _shown(lfs, secrets))
            )
        if 'size' in lfs and lfs['size'] != size:
            raise ManifestError(
                '%s: %s has size %s but lfs.size %s' % (where, shown, size, _shown(lfs['size'], secrets))
            )
        return ManifestFile(name, size, SHA256, digest.lower())
    digest = sibling['blobId']
    if not isinstance(digest, str) or not _HEX40.fullmatch(digest):
        raise ManifestError(
            '%s: %s has blobId %s, not a git blob id of 40 hex digits' % (where, shown, _shown(digest, secrets))
        )
    return ManifestFile(name, size, GIT_SHA1, digest.lower())


def parse_manifest(data: bytes, where: str, secrets: Sequence[Optional[str]] = ()) -> Manifest:
    """The Manifest in ``data`` (bytes of model-info JSON); ``where`` names its source in messages.

    ``secrets``: masked in what the messages quote of ``data`` (a Hub's answer may echo the token).
    """
    doc = decode_json(data, where, ManifestError)
    if not isinstance(doc, dict):
        raise ManifestError("%s does not hold a JSON object (the Hub's model info)" % where)
    revision = doc.get('sha')
    if not isinstance(revision, str) or not _HEX40.fullmatch(revision):
        raise ManifestError(
            '%s has sha %s, not the 40-hex commit of the revision it describes' % (where, _shown(revision, secrets))
        )
    siblings = doc.get('siblings')
    if not isinstance(siblings, list):
        raise ManifestError(
            "%s has siblings %s, not the list of the revision's files" % (where, _shown(siblings, secrets))
        )
    files = {}
    for position, sibling in enumerate(siblings):
        entry = _file_entry(sibling, where, position, secrets)
        if entry.name in files:
            raise ManifestError('%s lists %s twice' % (where, _name(entry.name, secrets)))
        files[entry.name] = entry
    return Manifest(revision.lower(), files)


def read_manifest_file(path: str) -> Manifest:
    """The Manifest in a file saved from the Hub (air-gapped sites)."""
    try:
        with open_regular(path) as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except CheckpointError as exc:
        raise ManifestError('manifest %s' % exc) from exc
    except OSError as exc:
        raise ManifestError('cannot read manifest %s: %s' % (path, exc.strerror or exc)) from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError('manifest %s is larger than %d bytes: not a model info' % (path, MAX_MANIFEST_BYTES))
    return parse_manifest(data, 'manifest %s' % path)


def _status_problem(
    status: int,
    headers: Optional[Message],
    body: bytes,
    url: str,
    repo_id: str,
    revision: str,
    token: Optional[str],
    endpoint_secrets: Iterable[str] = (),
) -> str:
    """The message for a model-info answer other than 200, the token and endpoint_secrets masked in it.

    What the Hub says is masked before it is shortened, so that no cut leaves part of a secret.
    """
    secrets = (token,) + tuple(endpoint_secrets)
    hub_says = (headers.get('X-Error-Message') if headers is not None else None) or ''
    if not hub_says:
        hub_says = body[:MAX_ERROR_BODY_BYTES].decode('utf-8', 'replace')
    hub_says = hub_says.strip()
    detail = ' (the Hub says: %s)' % quote_masked(hub_says, HUB_SAYS_CHARS, *secrets) if hub_says else ''
    if status == 401:
        cause = (
            'the token was refused'
            if token
            else 'the repository is private or gated and needs a token (token, or HF_TOKEN on the host)'
        )
    elif status == 403:
        cause = (
            'the token has no access to %s (a gated repository: accept its conditions on the Hub with this account)'
            % repo_id
        )
    elif status == 404:
        cause = 'no repository %s, or no revision %s in it' % (repo_id, revision)
    elif status in (301, 302, 303, 307, 308):
        location = (headers.get('Location') if headers is not None else None) or '?'
        cause = (
            'a redirect to %s, which is not followed (the token would go along): '
            'was the repository renamed? Use its new name' % quote_masked(location, MAX_QUOTE, *secrets)
        )
    else:
        cause = 'the Hub did not give the model info'
    # Masked again whole: the URL and the Hub's words side by side could spell what neither does alone.
    return mask('%s answered HTTP %d: %s%s' % (url, status, cause, detail), *secrets)


def fetch_manifest(
    endpoint: str,
    repo_id: str,
    revision: str,
    token: Optional[str] = None,
    timeout: float = 60,
    validate_certs: bool = True,
) -> Manifest:
    """The Manifest of one revision, fetched from the Hub (or a mirror) within ``timeout`` seconds.

    No message shows the token or the endpoint's password: the URL is shown without the password, and both
    are masked in what the Hub or the network error says before it is shortened.
    """
    url = model_info_url(endpoint, repo_id, revision)
    shown = without_credentials(url)
    endpoint_secrets = url_secrets(endpoint)
    secrets = (token,) + endpoint_secrets
    headers = {'Accept': 'application/json'}
    if token:
        headers['Authorization'] = 'Bearer %s' % token
    started = time.monotonic()
    try:
        with deadline(timeout):
            try:
                response = open_url(
                    url,
                    headers=headers,
                    method='GET',
                    timeout=timeout,
                    validate_certs=validate_certs,
                    # What every file is checked against comes from the endpoint named or not at all; the files
                    # themselves follow redirects to the Hub's CDN (_hub_headers.open_file).
                    follow_redirects='none',
                    decompress=False,
                )
            except HTTPError as exc:
                response = exc
            try:
                status, answer_headers = response.getcode(), response.headers
                body = read_limited(response, MAX_MANIFEST_BYTES)
            finally:
                response.close()
    except DeadlinePassed:
        raise ManifestError('%s gave no complete answer within %d s' % (shown, timeout)) from None
    except (URLError, HTTPException, OSError, ValueError) as exc:
        reason = getattr(exc, 'reason', None) or exc
        raise ManifestError(
            'cannot fetch %s: %s (after %.1f s)'
            % (shown, quote_masked(str(reason), MAX_QUOTE, *secrets), time.monotonic() - started)
        ) from exc
    if body is None:
        raise ManifestError('%s answered more than %d bytes: not a model info' % (shown, MAX_MANIFEST_BYTES))
    if status != 200:
        raise ManifestError(
            _status_problem(status, answer_headers, body, shown, repo_id, revision, token, endpoint_secrets)
        )
    manifest = parse_manifest(body, shown, secrets)
    if _COMMIT.fullmatch(revision) and manifest.revision != revision:
        raise ManifestError('%s describes commit %s, not %s' % (shown, manifest.revision, revision))
    return manifest
