# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Credentials in the URLs a release is installed from.

PRIVATE to the collection: this is not a public API; it may change without notice.

A package spec, pip's arguments and a lock file end up where others read them: the release's record, the lock's
copy beside the release (0644), Ansible's output and logs. A URL there must not carry a user or a password (a
token is often given as the user); pip and uv both read them from root's ``~/.netrc`` instead. The messages show
each URL with its user information masked, never the credential itself.
"""

import re
from collections.abc import Mapping, Sequence
from typing import Union

# A URL up to the whitespace, quote or bracket it stands before; its netloc ends at the path, query or fragment.
# The user information runs to the netloc's last "@", as pip splits it: a password may hold quotes and brackets
# (https://me:pa"ss@host), which pip still sends.
_URL = re.compile(
    r'(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<netloc>(?:[^/?#\s]*@)?[^/?#\s\'"<>@]*)(?P<rest>[^\s\'"<>]*)'
)
# A user name alone is how SSH reaches git (git+ssh://git@host/...): no secret.
_USER_IS_NO_SECRET = frozenset(('ssh', 'git+ssh'))
MASK = '****'
WHERE_CREDENTIALS_BELONG = (
    "Give the URLs without them and put the credentials where only root reads them: root's ~/.netrc "
    '(machine HOST login USER password TOKEN, mode 0600), which pip and uv both read, or a root-only '
    '/etc/pip.conf (pip) or /etc/uv/uv.toml (uv).'
)

Source = Union[str, Sequence[str]]


# After a netloc's first ":", the port: digits alone. Anything else there is a password that ran on past a "/"
# (https://user:pa/ss@host/simple): urlsplit, as pip calls it, then reads host "user" and the password as the path.
_PORT = re.compile(r'[0-9]+')
# Where the host after such a password ends.
_HOST_END = re.compile(r'[/?#]|\Z')


def _user_information(netloc: str, rest: str) -> tuple[str, str, str]:
    """(user information, host, the rest) of a URL read as pip reads it, and with a password that holds a "/":
    the user information then runs on to the first "@" after the netloc."""
    userinfo, at, host = netloc.rpartition('@')
    if at:
        return userinfo, host, rest
    before, colon, after = netloc.partition(':')
    if netloc.startswith('[') or not colon or _PORT.fullmatch(after) or '@' not in rest:
        return '', netloc, rest
    secret, _at, after_secret = rest.partition('@')
    host_end = _HOST_END.search(after_secret)
    end = host_end.start() if host_end else len(after_secret)
    return netloc + secret, after_secret[:end], after_secret[end:]


def _masked(match: 're.Match[str]') -> str:
    """The URL matched, its user information masked where it carries a credential."""
    userinfo, host, rest = _user_information(match.group('netloc'), match.group('rest'))
    if not userinfo:
        return match.group(0)
    if ':' not in userinfo and match.group('scheme').lower() in _USER_IS_NO_SECRET:
        return match.group(0)
    return '%s://%s@%s%s' % (match.group('scheme'), MASK, host, rest)


def mask_credentials(text: str) -> str:
    """text with the user information of every URL that carries credentials replaced by ****."""
    return _URL.sub(_masked, text)


def credential_urls(text: str) -> list[str]:
    """The URLs in text that carry credentials, each masked."""
    return [_masked(match) for match in _URL.finditer(text) if _masked(match) != match.group(0)]


def _places(name: str, value: Source) -> list[tuple[str, str]]:
    """(where, text) of each part of a setting: an item of a list, a line of a text of several lines."""
    if isinstance(value, str):
        lines = value.splitlines()
        if len(lines) > 1:
            return [('%s, line %d' % (name, number), line) for number, line in enumerate(lines, 1)]
        return [(name, value)]
    return [('%s[%d]' % (name, index), str(item)) for index, item in enumerate(value)]


def credential_findings(sources: Mapping[str, Source]) -> list[str]:
    """'WHERE has URL' for each URL in sources (setting name: a text, or a list of texts) that carries credentials,
    the URL masked; WHERE names the setting, and the item of a list or the line of a text of several lines."""
    return [
        '%s has %s' % (where, url)
        for name, value in sources.items()
        for where, text in _places(name, value)
        for url in credential_urls(text)
    ]


def credential_message(sources: Mapping[str, Source]) -> str:
    """Why the credentials in sources' URLs are refused, where each is and where they belong; '' when none."""
    findings = credential_findings(sources)
    if not findings:
        return ''
    return (
        "Credentials in the package sources would be written into the release's record and shown in Ansible's "
        'output: %s. %s' % ('; '.join(findings), WHERE_CREDENTIALS_BELONG)
    )
