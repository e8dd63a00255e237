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

import base64
import functools
import html
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
from urllib.parse import quote as percent_encode
from urllib.parse import quote_plus, unquote, urlsplit

from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.urls import Request, make_context

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline

DEFAULT_URL = 'http://127.0.0.1:8000'
# Longest answer or body excerpt quoted in a message.
MAX_QUOTE = 500
MASK = '********'
# Any run of this many characters of a secret is masked, wherever it appears: what a cut leaves of a secret, or a
# server that quotes part of one. A secret shorter than this is masked whole.
SECRET_PART_CHARS = 8
# Bytes a bounded read asks for at a time.
READ_CHUNK = 1 << 16


# http(method, path, payload, timeout, limit) -> (status, text): see make_transport.
Http = Callable[[str, str, Optional[dict[str, Any]], float, int], tuple[int, str]]


class Unreachable(Exception):
    """The endpoint did not answer at all (refused, reset, timed out); timed_out when its time ran out."""

    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


class TooLarge(Exception):
    """The endpoint answered with more bytes than the check reads from it."""

    def __init__(self, limit: int) -> None:
        self.reason = 'an answer of more than %d bytes' % limit
        super().__init__(self.reason)


def endpoint_argument_spec() -> dict[str, dict[str, Any]]:
    """The options of how a module reaches the endpoint, as the llmserve.vllm.endpoint documentation fragment
    documents them (a new dict each call: AnsibleModule keeps what it is given)."""
    return dict(
        validate_certs=dict(type='bool', default=True),
        ca_path=dict(type='path'),
        use_proxy=dict(type='bool', default=True),
        unix_socket=dict(type='path'),
    )


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

    A typo fails here at once instead of making every poll fail until the timeout. The messages show the URL
    without its user name and password.
    """
    shown = without_credentials(url)
    if not url.startswith(('http://', 'https://')):
        return "url '%s' must start with http:// or https://" % shown
    if any(char.isspace() or not char.isprintable() for char in url):
        return "url '%s' has a space or a control character in it" % shown
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        return "url '%s' is not a valid URL: %s" % (shown, mask(to_text(exc), *url_secrets(url)))
    if parts.query or parts.fragment:
        return "url '%s' has a query or a fragment; give the server's base URL" % shown
    if parts.path.rstrip('/').endswith('/v1'):
        return "url '%s' ends with /v1; give the server's base URL, without /v1" % shown
    if not parts.hostname:
        return "url '%s' has no host name" % shown
    try:
        port_valid = parts.port != 0
    except ValueError:  # not a number, or above 65535
        port_valid = False
    if not port_valid:
        return "url '%s' has a port that is not a number from 1 to 65535" % shown
    if not parts.netloc.rpartition('@')[2].startswith('['):
        try:
            parts.hostname.encode('idna')
        except UnicodeError:
            return "url '%s' has a host name with an empty or too long label: '%s'" % (shown, parts.hostname)
    return None


def without_credentials(url: str) -> str:
    """url with its password, everything between the first : after its :// and its last @, as ********.

    Whatever the password holds, a raw / or @ included (which moves where a parser sees the host), none of it
    shows. A user name without a password is a token: it is masked whole. A URL with an @ in its path loses its
    host as well: credentials_problem refuses it.
    """
    scheme_end = url.find('://')
    userinfo_start = scheme_end + 3 if scheme_end >= 0 else 0
    at = url.rfind('@')
    if at < userinfo_start:
        return url
    user, colon, _password = url[userinfo_start:at].partition(':')
    return url[:userinfo_start] + (user + colon if colon else '') + MASK + url[at:]


def credentials_problem(url: str, option: str = 'url') -> Optional[str]:
    """Why the user name and password in url are not where every reader of it finds them, or None.

    urlsplit reads them up to the last @ of what precedes the first /, ? or #; Ansible's open_url up to the
    first @. A raw @, /, ? or # in a password makes them disagree, and then an error that names the host
    would quote part of the password.
    """
    try:
        netloc = urlsplit(url).netloc
    except ValueError:  # url_problem says what is wrong with such a url
        return None
    if url.count('@') > 1 or ('@' in url and '@' not in netloc):
        return (
            "%s '%s' has more than one @, or one after a /, ? or #: percent-encode an @, /, ? or # "
            'in its user name or password (%%40, %%2F, %%3F, %%23)' % (option, without_credentials(url))
        )
    return None


def url_secrets(url: str) -> tuple[str, ...]:
    """What of the credentials in url a server or an error may quote: the password as written and decoded (the
    user name when there is no password: such a user name is a token), and the Basic credentials that
    Ansible's open_url sends when a server asks for them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    if parts.username is None:
        return ()
    secret = parts.password if parts.password is not None else parts.username
    user, password = unquote(parts.username), unquote(parts.password or '')
    basic = base64.b64encode(('%s:%s' % (user, password)).encode('utf-8', 'surrogateescape')).decode('ascii')
    return tuple(value for value in (secret, unquote(secret), basic) if value)


def hide_url_password(module: Any, option: str = 'url') -> None:
    """The credentials in module.params[option] are as secret as api_key: Ansible then masks them in all the
    module returns, its invocation included."""
    module.no_log_values.update(url_secrets(module.params[option] or ''))


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
    unix_socket: Optional[str] = None,
) -> Any:
    """open_url as every request to vLLM goes: safe redirects only, and no unpacking of a body nobody asked
    to be compressed (a gzip body would escape the byte limits, and a broken one raise zlib.error).

    context: an endpoint_context(validate_certs, ca_path) to reuse, or None to build one for this request.
    ca_path: as endpoint_context's, for the context built here; a given context already holds its CA.
    use_proxy: whether the environment's proxy carries the request; never for a loopback URL, which a proxy would
    resolve on its own host (and which would read the request's key on the way), nor through a Unix socket.
    unix_socket: the path of the Unix socket the server listens on (vLLM's --uds), or None for the URL's host and
    port; the URL then names only the scheme, the Host header and the path.
    """
    return Request().open(
        method,
        url,
        data=data,
        headers=headers,
        timeout=timeout,
        validate_certs=validate_certs,
        use_proxy=use_proxy and not is_loopback_url(url) and not unix_socket,
        follow_redirects='safe',
        decompress=False,
        context=context,
        ca_path=_cafile(validate_certs, ca_path),
        unix_socket=unix_socket,
    )


def _json_escaped(char: str) -> str:
    return json.dumps(char)[1:-1]


def _slash_escaped(char: str) -> str:
    """As PHP's json_encode writes it: JSON with '/' escaped."""
    return '\\/' if char == '/' else _json_escaped(char)


def _html_safe_json(char: str) -> str:
    """As Go's encoding/json writes it: JSON with <, > and & as \\u escapes."""
    return '\\u%04x' % ord(char) if char in '<>&' else _json_escaped(char)


def _repr_escaped(char: str) -> str:
    return repr(char)[1:-1]


def _repr_quote_escaped(char: str) -> str:
    """As repr writes it in a text that holds both quotes: ' escaped too."""
    return repr(char + '"')[1:-2]


def _bytes_repr_escaped(char: str) -> str:
    return repr(char.encode('utf-8', 'surrogatepass') + b'"')[2:-2]


def _percent_encoded(char: str) -> str:
    return percent_encode(char, safe='')


def _percent_encoded_lowercase(char: str) -> str:
    encoded = _percent_encoded(char)
    return encoded if encoded == char else encoded.lower()


def _form_encoded(char: str) -> str:
    return quote_plus(char, safe='')


def _uri_component_encoded(char: str) -> str:
    """As JavaScript's encodeURIComponent writes it."""
    return percent_encode(char, safe="!'()*~")


def _html_escaped(char: str) -> str:
    return html.escape(char)


def _html_numeric_escaped(char: str) -> str:
    """As Jinja's MarkupSafe and Go's html/template write it."""
    return {'"': '&#34;', "'": '&#39;'}.get(char) or html.escape(char)


def _layered(outer: Callable[[str], str], inner: Callable[[str], str]) -> Callable[[str], str]:
    return lambda char: ''.join(outer(written) for written in inner(char))


# How servers, proxies and tracebacks write a character of a secret: as it is, escaped, encoded, and the
# layerings that occur (a JSON body quoted as JSON again or in a repr, HTML of JSON, a URL encoded twice).
_SPELLINGS = (
    str,
    _json_escaped,
    _slash_escaped,
    _html_safe_json,
    _repr_escaped,
    _repr_quote_escaped,
    _bytes_repr_escaped,
    _percent_encoded,
    _percent_encoded_lowercase,
    _form_encoded,
    _uri_component_encoded,
    _html_escaped,
    _html_numeric_escaped,
    _layered(_json_escaped, _json_escaped),
    _layered(_repr_escaped, _json_escaped),
    _layered(_repr_quote_escaped, _json_escaped),
    _layered(_bytes_repr_escaped, _json_escaped),
    _layered(_html_escaped, _json_escaped),
    _layered(_json_escaped, _html_escaped),
    _layered(_percent_encoded, _percent_encoded),
)


@functools.lru_cache(maxsize=32)
def _spelled_parts(secret: str) -> tuple[str, ...]:
    """Every run of SECRET_PART_CHARS characters of secret (all of it when shorter), as each of _SPELLINGS writes it."""
    size = min(SECRET_PART_CHARS, len(secret))
    spelled = [[spell(char) for char in secret] for spell in _SPELLINGS]
    return tuple(
        sorted(
            set(''.join(chars[start : start + size]) for chars in spelled for start in range(len(secret) - size + 1))
        )
    )


def _secret_spans(text: str, secrets: tuple[Optional[str], ...]) -> list[tuple[int, int]]:
    """(start, end) of the stretches of text that spell a part of a secret, sorted, those that touch merged."""
    found = []
    for secret in secrets:
        for part in _spelled_parts(secret) if secret else ():
            start = text.find(part)
            while start >= 0:
                found.append((start, start + len(part)))
                start = text.find(part, start + 1)
    spans: list[tuple[int, int]] = []
    for start, end in sorted(found):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def mask(text: str, *secrets: Optional[str]) -> str:
    """text with every secret replaced by ********, and every run of SECRET_PART_CHARS of its characters.

    Ansible masks a no_log value only whole and as it is. A server or a traceback may quote a secret escaped
    or encoded (JSON, repr, URL, HTML, or two of them layered), or only part of it, and a cut leaves part of
    one: each of these spellings is masked. Mask before shortening (quote_masked does both): a cut after it
    can leave nothing of a secret, one before it may leave a piece too short to be recognised.
    """
    masked, kept_from = [], 0
    for start, end in _secret_spans(text, secrets):
        masked += [text[kept_from:start], MASK]
        kept_from = end
    return ''.join(masked) + text[kept_from:]


def quote_masked(text: Any, limit: int, *secrets: Optional[str]) -> str:
    """quote(text, limit) of text with the secrets masked first (see mask): no cut can leave part of one.

    Only as much of a long text is searched as the cut can show, and at least one spelling of a part of a
    secret further, so that one that begins before the cut is found whole: a 1 MiB answer costs what its
    first kilobytes do.
    """
    text = to_text(text if text is not None else '')
    reach = max((len(part) for secret in secrets if secret for part in _spelled_parts(secret)), default=0)
    searched = limit + reach
    while True:
        head = text[:searched]
        shown, shown_to = _masked_head(head, _secret_spans(head, secrets), limit)
        if shown_to + reach <= len(head) or len(head) == len(text):
            break
        searched *= 2
    if shown_to < len(text):
        return shown + '... (%d more characters)' % (len(text) - shown_to)
    return shown


def _masked_head(text: str, spans: list[tuple[int, int]], limit: int) -> tuple[str, int]:
    """(the first limit characters of text with spans masked, the position in text where they end)."""
    shown, kept_from = '', 0
    for start, end in spans + [(len(text), len(text))]:
        if len(shown) + start - kept_from >= limit:
            return shown + text[kept_from : kept_from + limit - len(shown)], kept_from + limit - len(shown)
        shown += text[kept_from:start]
        if start == len(text):
            break
        shown += MASK
        kept_from = end
        if len(shown) >= limit:
            return shown[:limit], end
    return shown, len(text)


def quote(text: Any, limit: int = MAX_QUOTE) -> str:
    """Shorten text for a message, marking what was cut."""
    text = to_text(text if text is not None else '')
    if len(text) > limit:
        return text[:limit] + '... (%d more characters)' % (len(text) - limit)
    return text


def is_timeout(exc: BaseException) -> bool:
    """Whether a request failed because its time ran out."""
    reason = getattr(exc, 'reason', exc)
    return isinstance(reason, (socket.timeout, TimeoutError)) or 'timed out' in to_text(reason)


def describe_unreachable(exc: BaseException, timeout: float) -> str:
    """Say in a few words why a request got no HTTP answer."""
    reason = getattr(exc, 'reason', exc)
    if is_timeout(exc):
        return 'no complete answer within %s s' % format_seconds(timeout)
    if isinstance(reason, ConnectionRefusedError):
        return 'connection refused'
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
    return to_text(reason) or type(reason).__name__


def format_seconds(value: float) -> str:
    value = float(value)
    if value == int(value):
        return '%d' % value
    return '%.1f' % value


def json_request(payload: Optional[dict[str, Any]], api_key: Optional[str]) -> tuple[Optional[str], dict[str, str]]:
    """The body and headers of a JSON request: no body where payload is None, the api_key as a bearer token."""
    headers = {'Accept': 'application/json'}
    data = None
    if payload is not None:
        data = json.dumps(payload)
        headers['Content-Type'] = 'application/json'
    if api_key:
        headers['Authorization'] = 'Bearer %s' % api_key
    return data, headers


def make_transport(
    base_url: str,
    api_key: Optional[str] = None,
    validate_certs: bool = True,
    use_proxy: bool = True,
    ca_path: Optional[str] = None,
    unix_socket: Optional[str] = None,
) -> Http:
    """Return http(method, path, payload, timeout, limit) -> (status, text) through open_url.

    ca_path: a PEM file of the CA certificates that an https server's certificate must chain to, instead of
    the host's; ignored when validate_certs is false.
    unix_socket: as open_endpoint's.

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
        data, headers = json_request(payload, api_key)
        try:
            with deadline(timeout):
                try:
                    response = open_endpoint(
                        base_url + path,
                        data,
                        headers,
                        method,
                        timeout,
                        validate_certs,
                        use_proxy,
                        ca_path=ca_path,
                        unix_socket=unix_socket,
                    )
                except HTTPError as exc:
                    response = exc  # an HTTP status is an answer: read its body as well
                try:
                    status, body = response.getcode(), read_body(response, limit)
                finally:
                    response.close()
        except DeadlinePassed:
            raise Unreachable('no complete answer within %s s' % format_seconds(timeout), timed_out=True) from None
        except (URLError, HTTPException, OSError) as exc:
            raise Unreachable(mask(describe_unreachable(exc, timeout), api_key), timed_out=is_timeout(exc)) from exc
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
