# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""HTTP to an endpoint as every module of the collection speaks it: the base URL and the key checked before the
first request, one bounded exchange (time and bytes), secrets masked in every text that comes back.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

Shared by chat_check and load_probe (vLLM's OpenAI-compatible server) and by the Hub clients (_hub_manifest,
_hub_headers).
"""

import json
import os
import re
import socket
import ssl
import stat
import unicodedata
from http.client import BadStatusLine, HTTPException, IncompleteRead
from typing import Any, Callable, Optional
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit

from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.urls import Request, make_context

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline

DEFAULT_URL = 'http://127.0.0.1:8000'
# Longest answer or body excerpt quoted in a message.
MAX_QUOTE = 500
MASK = '********'
# Bytes a bounded read asks for at a time.
READ_CHUNK = 1 << 16


# http(method, path, payload, timeout, limit) -> (status, text): see make_transport.
Http = Callable[[str, str, Optional[dict[str, Any]], float, int], tuple[int, str]]


class Unreachable(Exception):
    """The endpoint did not answer at all (refused, reset, timed out)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TooLarge(Exception):
    """The endpoint answered with more bytes than the check reads from it."""

    def __init__(self, limit: int) -> None:
        self.reason = 'an answer of more than %d bytes' % limit
        super().__init__(self.reason)


def api_key_problem(api_key: str) -> Optional[str]:
    """Why api_key cannot travel as a Bearer token, or None. The message never quotes the key."""
    for position, char in enumerate(api_key, 1):
        if unicodedata.category(char) == 'Cc':
            return (
                'api_key has a control character (U+%04X) at position %d; a Bearer token cannot carry one. '
                "A YAML '|' block scalar ends with a newline: use '|-' or a quoted string" % (ord(char), position)
            )
        if ord(char) > 127:
            return 'api_key has a character outside ASCII at position %d; a Bearer token cannot carry one' % position
    return None


def url_problem(url: str) -> Optional[str]:
    """Why url cannot be the base URL of a vLLM server, or None.

    A typo fails here at once instead of making every poll fail until the timeout.
    """
    if not url.startswith(('http://', 'https://')):
        return "url '%s' must start with http:// or https://" % url
    if any(char.isspace() or not char.isprintable() for char in url):
        return "url '%s' has a space or a control character in it" % url
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return "url '%s' is not a valid URL: %s" % (url, exc)
    if parts.query or parts.fragment:
        return "url '%s' has a query or a fragment; give the server's base URL" % url
    if parts.path.rstrip('/').endswith('/v1'):
        return "url '%s' ends with /v1; give the server's base URL, without /v1" % url
    if not parts.hostname:
        return "url '%s' has no host name" % url
    try:
        port_valid = parts.port != 0
    except ValueError:  # not a number, or above 65535
        port_valid = False
    if not port_valid:
        return "url '%s' has a port that is not a number from 1 to 65535" % url
    if not parts.netloc.rpartition('@')[2].startswith('['):
        try:
            parts.hostname.encode('idna')
        except UnicodeError:
            return "url '%s' has a host name with an empty or too long label: '%s'" % (url, parts.hostname)
    return None


def hide_url_password(module: Any) -> None:
    """A password in module.params['url'] is as secret as api_key: Ansible then masks it in all the module returns."""
    try:
        password = urlsplit(module.params['url']).password
    except ValueError:  # url_problem says what is wrong with such a url
        return
    if password:
        module.no_log_values.add(password)


def ca_path_problem(ca_path: Optional[str], validate_certs: bool = True) -> Optional[str]:
    """Why ca_path cannot be the CA certificates (PEM) that an https server's certificate must chain to, or None.

    Checked before the first request: ssl raises the same at every request otherwise, and a wait would poll until its
    timeout as if the endpoint were down. Without validate_certs, ca_path is not used, so not checked either.
    """
    ca_path = _cafile(validate_certs, ca_path)
    if not ca_path:
        return None
    try:
        # Opened without blocking and asked what it is: ssl would wait on a FIFO for ever, read /dev/zero without end.
        descriptor = os.open(ca_path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(descriptor).st_mode
        finally:
            os.close(descriptor)
    except FileNotFoundError:
        return "ca_path '%s' does not exist" % ca_path
    except OSError as exc:
        return "ca_path '%s' cannot be read: %s" % (ca_path, exc.strerror or exc)
    if stat.S_ISDIR(mode):
        return "ca_path '%s' is a directory; give a file of PEM CA certificates" % ca_path
    if not stat.S_ISREG(mode):
        return "ca_path '%s' is not a regular file; give a file of PEM CA certificates" % ca_path
    try:
        ssl.create_default_context(cafile=ca_path)
    except (ssl.SSLError, ValueError) as exc:
        # The place in CPython's C source ssl names says nothing to the user.
        reason = re.sub(r' \(_ssl\.c:\d+\)$', '', to_text(exc))
        return "ca_path '%s' holds no certificate that Python's ssl can load (PEM expected): %s" % (ca_path, reason)
    return None


def _cafile(validate_certs: bool, ca_path: Optional[str]) -> Optional[str]:
    """The CA file to verify with: none when certificates are not verified (ca_path is then not even read)."""
    return ca_path if validate_certs else None


def endpoint_context(validate_certs: bool, ca_path: Optional[str] = None) -> Any:
    """The TLS context of open_endpoint, for a caller that sends many requests: open_url builds one for every
    request, even for http, reading and parsing every CA certificate of the host (tens of milliseconds of CPU,
    most of them with the GIL held, which stalls the caller's other threads).

    ca_path: a PEM file of the CA certificates to trust instead of the host's (see ca_path_problem); ignored
    when validate_certs is false.
    """
    return make_context(cafile=_cafile(validate_certs, ca_path), validate_certs=validate_certs)


def is_loopback_url(url: str) -> bool:
    """Whether the URL's host is this host's loopback: localhost, 127.0.0.0/8 or ::1."""
    host = (urlsplit(url).hostname or '').lower()
    return (
        host in ('localhost', '::1')
        or host.endswith('.localhost')
        or re.match(r'^127\.\d+\.\d+\.\d+$', host) is not None
    )


def open_endpoint(
    url: str,
    data: Optional[str],
    headers: dict[str, str],
    method: str,
    timeout: float,
    validate_certs: bool,
    use_proxy: bool,
    context: Any = None,
    ca_path: Optional[str] = None,
) -> Any:
    """open_url as every request to vLLM goes: safe redirects only, and no unpacking of a body nobody asked
    to be compressed (a gzip body would escape the byte limits, and a broken one raise zlib.error).

    context: an endpoint_context(validate_certs, ca_path) to reuse, or None to build one for this request.
    ca_path: as endpoint_context's, for the context built here; a given context already holds its CA.
    use_proxy: whether the environment's proxy carries the request; never for a loopback URL, which a proxy would
    resolve on its own host (and which would read the request's key on the way).
    """
    return Request().open(
        method,
        url,
        data=data,
        headers=headers,
        timeout=timeout,
        validate_certs=validate_certs,
        use_proxy=use_proxy and not is_loopback_url(url),
        follow_redirects='safe',
        decompress=False,
        context=context,
        ca_path=_cafile(validate_certs, ca_path),
    )


def mask(text: str, secret: Optional[str]) -> str:
    """text with secret replaced by ********, as it is and as JSON or Python's repr escape it.

    Ansible masks a no_log value only as it is; a server or a traceback may quote it escaped.
    Masking happens before any text is shortened, so that no cut can leave part of the secret.
    """
    if not secret:
        return text
    spellings = set([secret, json.dumps(secret)[1:-1], repr(secret)[1:-1]])
    for spelling in sorted(spellings, key=len, reverse=True):
        text = text.replace(spelling, MASK)
    return text


def quote(text: Any, limit: int = MAX_QUOTE) -> str:
    """Shorten text for a message, marking what was cut."""
    text = to_text(text if text is not None else '')
    if len(text) > limit:
        return text[:limit] + '... (%d more characters)' % (len(text) - limit)
    return text


def describe_unreachable(exc: BaseException, timeout: float) -> str:
    """Say in a few words why a request got no HTTP answer."""
    reason = getattr(exc, 'reason', exc)
    if isinstance(reason, ConnectionRefusedError):
        return 'connection refused'
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return 'no complete answer within %s s' % format_seconds(timeout)
    if isinstance(reason, ConnectionResetError):
        return 'connection reset'
    if isinstance(reason, IncompleteRead):
        counts = '%d bytes read' % len(reason.partial)
        if reason.expected is not None:
            counts += ', %d more expected' % reason.expected
        return 'connection closed in the middle of the answer (%s)' % counts
    if isinstance(reason, BadStatusLine):
        return 'an answer that is not HTTP: %r' % reason.args[0]  # the status line
    if isinstance(reason, socket.gaierror):
        return 'host name not resolved (%s)' % to_text(reason)
    text = to_text(reason)
    if 'timed out' in text:
        return 'no complete answer within %s s' % format_seconds(timeout)
    return text or type(reason).__name__


def format_seconds(value: float) -> str:
    value = float(value)
    if value == int(value):
        return '%d' % value
    return '%.1f' % value


def make_transport(
    base_url: str,
    api_key: Optional[str] = None,
    validate_certs: bool = True,
    use_proxy: bool = True,
    ca_path: Optional[str] = None,
) -> Http:
    """Return http(method, path, payload, timeout, limit) -> (status, text) through open_url.

    ca_path: a PEM file of the CA certificates that an https server's certificate must chain to, instead of
    the host's; ignored when validate_certs is false.

    Any HTTP status comes back as a value. The whole exchange, the body included, ends
    within timeout seconds, or raises Unreachable as a missing answer does; a body of more
    than limit bytes raises TooLarge. The text is decoded with replacement characters
    (the result must stay valid UTF-8) and has the api_key masked.
    """
    base_url = base_url.rstrip('/')

    def call(
        method: str,
        path: str,
        payload: Optional[dict[str, Any]],
        timeout: float,
        limit: int,
    ) -> tuple[int, str]:
        headers = {'Accept': 'application/json'}
        data = None
        if payload is not None:
            data = json.dumps(payload)
            headers['Content-Type'] = 'application/json'
        if api_key:
            headers['Authorization'] = 'Bearer %s' % api_key
        try:
            with deadline(timeout):
                try:
                    response = open_endpoint(
                        base_url + path, data, headers, method, timeout, validate_certs, use_proxy, ca_path=ca_path
                    )
                except HTTPError as exc:
                    response = exc  # an HTTP status is an answer: read its body as well
                try:
                    status, body = response.getcode(), read_body(response, limit)
                finally:
                    response.close()
        except DeadlinePassed:
            raise Unreachable('no complete answer within %s s' % format_seconds(timeout)) from None
        except (URLError, HTTPException, OSError) as exc:
            raise Unreachable(mask(describe_unreachable(exc, timeout), api_key)) from exc
        return status, mask(to_text(body, errors='replace'), api_key)

    return call


def read_body(response: Any, limit: int) -> bytes:
    """Read at most limit bytes of a response's body; TooLarge when it has more.

    IncompleteRead when the connection closed before the Content-Length that the
    server announced (http.client returns a short body for a bounded read).
    """
    body = response.read(limit + 1)
    if len(body) > limit:
        raise TooLarge(limit)
    missing = getattr(response, 'length', None)
    if missing:
        raise IncompleteRead(body, missing)
    return body


def read_limited(response: Any, limit: int) -> Optional[bytes]:
    """The body, at most limit bytes, read in chunks as they come; None when it has more."""
    read = getattr(response, 'read1', None) or response.read
    body = bytearray()
    while len(body) <= limit:
        chunk = read(READ_CHUNK)
        if not chunk:
            return bytes(body)
        body += chunk
    return None
