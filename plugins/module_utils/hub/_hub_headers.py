# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The safetensors headers of a Hub repository's shards, read over HTTP byte ranges before any download.

PRIVATE to the collection: this is not a public API; it may change without notice.

As ``huggingface_hub.get_safetensors_metadata`` does: for each shard ``GET
{endpoint}/{repo_id}/resolve/{revision}/{file}`` with ``Range: bytes=0-7`` gives the header
length N, then ``Range: bytes=8-{8+N-1}`` the header itself, so every tensor is sized exactly
while only a few kilobytes to a few megabytes per shard cross the network. The Hub redirects
LFS files to its storage; the redirect is followed with the Range, the token stays behind.
Messages name the URL without the endpoint's password; the token and the password are masked in
what the Hub or the network error says before it is shortened.
"""

import struct
from http.client import HTTPException
from typing import Any, Callable, Optional
from urllib.error import HTTPError, URLError
from urllib.parse import quote

from ansible.module_utils import urls

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import CheckpointError
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import (
    MAX_HEADER_BYTES,
    parse_header,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    MAX_QUOTE,
    READ_CHUNK,
    credentials_problem,
    mask,
    quote_masked,
    read_limited,
    url_secrets,
    without_credentials,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    HUB_SAYS_CHARS,
    _status_problem,
    endpoint_problem,
    name_problem,
    repo_id_problem,
    revision_problem,
)


class HeaderFetchError(Exception):
    """A shard's header cannot be had or read; the message names its URL (without the endpoint's password) and why."""


def resolve_url(endpoint: str, repo_id: str, revision: str, name: str) -> str:
    """The URL of one file of a revision."""
    return '%s/%s/resolve/%s/%s' % (endpoint.rstrip('/'), repo_id, quote(revision, safe=''), quote(name))


def open_file(
    opener: Callable[..., Any], url: str, token: Optional[str], timeout: float, headers: Optional[dict[str, str]] = None
) -> Any:
    """GET a file of a revision as every file request of the collection goes: the Hub sends its large files on to its
    CDN, so GET redirects are followed ('safe'), and the token, a Bearer header, goes to the Hub alone (no redirect
    carries it on); the body comes as sent, never unpacked. An HTTP status is an answer: its HTTPError, which reads as
    a response, is returned. (The manifest, what every file is checked against, follows no redirect at all:
    _hub_manifest.fetch_manifest.)"""
    sent = dict(headers or {})
    if token:
        sent['Authorization'] = 'Bearer %s' % token
    try:
        return opener(
            url,
            headers=sent,
            method='GET',
            timeout=timeout,
            follow_redirects='safe',
            unredirected_headers=['Authorization'],
            decompress=False,
        )
    except HTTPError as exc:
        return exc


def _file_bytes(response: Any) -> Optional[int]:
    """The whole file's size as the answer tells it (Content-Range of a 206, Content-Length of a 200), or None."""
    if response.getcode() == 206:
        total = (response.headers.get('Content-Range') or '').rpartition('/')[2]
    else:
        total = response.headers.get('Content-Length') or ''
    return int(total) if total.isdigit() else None


class _Fetch:
    """The ranged GETs of one file; endpoint_secrets are the credentials in its URL (url_secrets)."""

    def __init__(
        self,
        opener: Callable[..., Any],
        url: str,
        repo_id: str,
        revision: str,
        token: Optional[str],
        endpoint_secrets: tuple[str, ...],
        timeout: float,
    ) -> None:
        self.opener = opener
        self.url = url
        self.shown = without_credentials(url)
        self.repo_id = repo_id
        self.revision = revision
        self.token = token
        self.endpoint_secrets = endpoint_secrets
        self.secrets = (token,) + endpoint_secrets
        self.timeout = timeout

    def get(self, first: int, last: int) -> Any:
        """The open answer to ``Range: bytes=first-last``: a 206, or a 200 of the whole file."""
        response = open_file(self.opener, self.url, self.token, self.timeout, {'Range': 'bytes=%d-%d' % (first, last)})
        status = response.getcode()
        if status not in (200, 206):
            try:
                body = read_limited(response, 4096) or b''
            finally:
                response.close()
            raise HeaderFetchError(self.status_problem(status, response.headers, body))
        return response

    def status_problem(self, status: int, headers: Any, body: bytes) -> str:
        if status in (401, 403):
            return _status_problem(
                status, headers, body, self.shown, self.repo_id, self.revision, self.token, self.endpoint_secrets
            )
        hub_says = (headers.get('X-Error-Message') if headers is not None else None) or ''
        detail = ' (the Hub says: %s)' % quote_masked(hub_says, HUB_SAYS_CHARS, *self.secrets) if hub_says else ''
        if status == 404:
            cause = 'no such file in %s at revision %s' % (self.repo_id, self.revision)
        elif status == 416:
            cause = 'the file is shorter than the 8-byte header length'
        else:
            cause = 'the Hub did not give the bytes asked for'
        # Masked again whole: the URL and the Hub's words side by side could spell what neither does alone.
        return mask('%s answered HTTP %d: %s%s' % (self.shown, status, cause, detail), *self.secrets)

    def read(self, response: Any, count: int) -> bytes:
        """At most ``count`` bytes of the body: fewer only when the file ends first.

        An answer that ends short of its own Content-Length was cut (http.client's read does not say so).
        """
        body = bytearray()
        while len(body) < count:
            chunk = response.read(min(READ_CHUNK, count - len(body)))
            if not chunk:
                break
            body += chunk
        length = response.headers.get('Content-Length') or ''
        if length.isdigit() and len(body) < min(count, int(length)):
            raise HeaderFetchError(
                'cannot fetch %s: the answer ended after %d of its %s bytes (the connection was cut)'
                % (self.shown, len(body), length)
            )
        return bytes(body)

    def header(self, n: int) -> bytes:
        """The n bytes of header JSON after the length, by the second ranged GET."""
        if not n:
            return b''
        response = self.get(8, 8 + n - 1)
        try:
            if response.getcode() == 206:
                return self.read(response, n)
            return self.read(response, 8 + n)[8:]
        finally:
            response.close()

    def tensors(self) -> dict[str, int]:
        response = self.get(0, 7)
        try:
            whole = response.getcode() == 200
            file_bytes = _file_bytes(response)
            head = self.read(response, 8)
            if len(head) < 8:
                raise HeaderFetchError(
                    '%s is truncated: %d bytes, shorter than the 8-byte header length' % (self.shown, len(head))
                )
            (n,) = struct.unpack('<Q', head)
            if n > MAX_HEADER_BYTES:
                raise HeaderFetchError(
                    '%s has a header length of %d bytes, above the 100 MB safetensors limit: '
                    'not a safetensors file or corrupt' % (self.shown, n)
                )
            if file_bytes is not None and 8 + n > file_bytes:
                raise HeaderFetchError(
                    '%s is truncated: its header length %d reaches beyond the end of the file (%d bytes)'
                    % (self.shown, n, file_bytes)
                )
            if whole:
                # The range was not honoured: the header follows in the same answer, read no further.
                raw = self.read(response, n)
        finally:
            response.close()
        if not whole:
            raw = self.header(n)
        if len(raw) < n:
            raise HeaderFetchError(
                '%s is truncated: its header length is %d, the answer ended after %d header bytes'
                % (self.shown, n, len(raw))
            )
        available = None if file_bytes is None else file_bytes - 8 - n
        try:
            return parse_header(raw, self.shown, available)
        except CheckpointError as exc:
            # The message quotes the header's tensor names: the Hub's words, which may echo a secret.
            raise HeaderFetchError(mask(str(exc), *self.secrets)) from None


def fetch_headers(
    endpoint: str,
    repo_id: str,
    revision: str,
    files: list[str],
    token: Optional[str] = None,
    timeout: float = 30,
    open_url: Optional[Callable[..., Any]] = None,
) -> dict[str, dict[str, int]]:
    """{file: {tensor: bytes}} of each safetensors file of a revision, from its header alone.

    Two ranged GETs per file, each file within ``timeout`` seconds. Raises HeaderFetchError, whose message shows
    neither the token nor the endpoint's password.
    """
    for problem in (
        credentials_problem(endpoint, 'endpoint'),
        endpoint_problem(endpoint),
        repo_id_problem(repo_id),
        revision_problem(revision, True),
    ):
        if problem:
            raise HeaderFetchError(problem)
    endpoint_secrets = url_secrets(endpoint)
    opener = open_url or urls.open_url
    found = {}
    for name in files:
        problem = name_problem(name)
        if problem:
            # The names come from the Hub (its list of files, the weights index), which may echo a secret.
            raise HeaderFetchError(mask('file name %r %s' % (name, problem), token, *endpoint_secrets))
        fetch = _Fetch(
            opener, resolve_url(endpoint, repo_id, revision, name), repo_id, revision, token, endpoint_secrets, timeout
        )
        try:
            with deadline(timeout):
                found[name] = fetch.tensors()
        except DeadlinePassed:
            raise HeaderFetchError('%s gave no complete header within %d s' % (fetch.shown, timeout)) from None
        except (URLError, HTTPException, OSError, ValueError) as exc:
            reason = quote_masked(str(getattr(exc, 'reason', None) or exc), MAX_QUOTE, *fetch.secrets)
            raise HeaderFetchError('cannot fetch %s: %s' % (fetch.shown, reason)) from exc
    return found
