# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""One server of an HAProxy backend, taken out of rotation and put back, behind llmserve.vllm.haproxy_server.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

HAProxy's runtime API (its stats socket) answers one command per connection: RuntimeApi sends it and reads the reply
to its end. ServerControl takes that exchange as an argument, with a clock and a sleep, so the unit tests drive the
reads, the set and the wait with replies recorded from HAProxy 2.6 and no real time. The formats are HAProxy's
doc/management.txt ("show stat", "show servers state", "set server") and src/stats.c.
"""

import csv
import errno
import io
import os
import re
import socket
import stat
import time
from typing import Any, Callable, NoReturn, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import file_kind
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import format_seconds, quote

DEFAULT_SOCKET = '/run/haproxy/admin.sock'
STATES = ('ready', 'drain', 'maint')
DEFAULT_TIMEOUT = 600.0
DEFAULT_SLEEP = 1.0
MAX_SLEEP = 60.0
# Seconds one command may take from the connect to the reply's end; HAProxy answers these in milliseconds.
EXCHANGE_SECONDS = 10.0
# The most of a reply that is read: `show stat` of one backend is a few kilobytes a server.
MAX_REPLY_BYTES = 16 * 1024 * 1024
READ_CHUNK = 1 << 16
# Longest part of an error reply quoted in a message (an unknown command lists HAProxy's commands).
MAX_QUOTE = 300
# srv_admin_state bits that `set server ... state` sets and clears (include/haproxy/server-t.h): the forced ones.
# The inherited (tracked server), configuration and DNS bits are not the module's to set; they show in the status.
FORCED_MAINT = 0x01
FORCED_DRAIN = 0x08
# The status of a server that takes new requests with its health check passed at its full health ("UP 1/3" is up
# but failing checks, as a server that just left maintenance is until its first check), or that has no check.
SERVING_STATUSES = ('UP', 'no check')
# The rows of `show stat` that are no server.
PROXY_ROWS = ('FRONTEND', 'BACKEND')
# What HAProxy accepts in a proxy or server name (src/tools.c invalid_char): nothing that could end a command
# (`;`, a space, a newline) and so run another one.
NAME = re.compile(r'[A-Za-z0-9_.:-]+\Z')
# What `show servers state <backend>` answers for a backend that is not there.
NO_BACKEND = "Can't find backend."

# exchange(command) -> the reply's text.
Exchange = Callable[[str], str]
# connect(path, timeout) -> a connected socket whose operations time out after timeout seconds.
Connect = Callable[[str, float], socket.socket]


class HAProxyFailed(Exception):
    """The runtime API could not be used, refused a command, or the wait ran out; details go into the result."""

    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details


def name_problem(option: str, value: str) -> Optional[str]:
    """The refusal of a backend or server name that HAProxy cannot have, or None."""
    if NAME.match(value):
        return None
    return '%s must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got %r' % (option, value)


def connect_unix(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def socket_problem(path: str) -> Optional[str]:
    """Why nothing can connect to path as a socket (missing, a file of another kind), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return exc.strerror or str(exc)
    except ValueError as exc:  # a NUL in the path
        return str(exc)
    if stat.S_ISSOCK(mode):
        return None
    return 'it is %s, not a socket' % file_kind(mode)


class RuntimeApi:
    """exchange(command) -> reply over the runtime API socket at path, one connection a command."""

    def __init__(self, path: str, timeout: float = EXCHANGE_SECONDS, connect: Connect = connect_unix) -> None:
        self.path = path
        self.timeout = timeout
        self.connect = connect

    def __call__(self, command: str) -> str:
        problem = socket_problem(self.path)
        if problem:
            self._fail(problem)
        try:
            with self.connect(self.path, self.timeout) as sock:
                sock.sendall(command.encode('utf-8') + b'\n')
                return self._read(sock, command)
        except socket.timeout:
            self._fail('no complete answer to %r within %s s' % (command, format_seconds(self.timeout)))
        except OSError as exc:
            cause = exc.strerror or str(exc)
            if exc.errno == errno.ECONNREFUSED:
                cause += ' (no HAProxy listens on it)'
            self._fail(cause)

    def _read(self, sock: socket.socket, command: str) -> str:
        """The reply up to HAProxy's close of the connection, which ends every non-interactive answer."""
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = sock.recv(READ_CHUNK)
            if not chunk:
                return b''.join(chunks).decode('utf-8', errors='replace')
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                self._fail('the answer to %r is longer than %d bytes' % (command, MAX_REPLY_BYTES))
            chunks.append(chunk)

    def _fail(self, cause: str) -> NoReturn:
        raise HAProxyFailed('cannot use the HAProxy runtime API socket %s: %s' % (self.path, cause))


def refusal(command: str, reply: str) -> str:
    """The message of a reply that is an error, quoting it on one line (HAProxy pads its lists with spaces)."""
    text = ' '.join(reply.split())
    return "HAProxy's runtime API answered %r with: %s" % (command, quote(text or '(nothing)', MAX_QUOTE))


def table_lines(command: str, reply: str, header: str) -> list[str]:
    """The non-empty lines of a show command's table from its header on; HAProxyFailed quoting any other reply.

    `show servers state` puts its format version before the header; the others start with it.
    """
    lines = reply.splitlines()
    for index, line in enumerate(lines[:2]):
        if line.startswith(header):
            return [line for line in lines[index:] if line]
    raise HAProxyFailed(refusal(command, reply))


def parse_servers_state(command: str, reply: str) -> dict[str, dict[str, str]]:
    """{server name: {column: value}} of `show servers state <backend>` (space-separated, '#' header)."""
    lines = table_lines(command, reply, '# be_id ')
    columns = lines[0][2:].split()
    rows = (dict(zip(columns, line.split())) for line in lines[1:] if not line.startswith('#'))
    return {row['srv_name']: row for row in rows if 'srv_name' in row}


def parse_stat(command: str, reply: str, backend: str) -> dict[str, dict[str, str]]:
    """{server name: {field: value}} of the backend's servers in `show stat` (CSV, '# ' before its header)."""
    lines = table_lines(command, reply, '# pxname,')
    rows = csv.DictReader(io.StringIO('\n'.join([lines[0][2:]] + lines[1:])))
    return {row['svname']: row for row in rows if row.get('pxname') == backend and row.get('svname') not in PROXY_ROWS}


def parse_backends(command: str, reply: str) -> list[str]:
    """The backend names of `show backend`."""
    return table_lines(command, reply, '# name')[1:]


def number(row: dict[str, str], field: str, command: str) -> Optional[int]:
    """The integer in a field of a reply's row; None where HAProxy left it empty."""
    text = row.get(field) or ''
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise HAProxyFailed("HAProxy's answer to %r has %s %r, not a number" % (command, field, text)) from None


def admin_state(bits: int) -> str:
    """The admin state `set server ... state` set: forced maintenance wins over a forced drain, as in HAProxy."""
    if bits & FORCED_MAINT:
        return 'maint'
    if bits & FORCED_DRAIN:
        return 'drain'
    return 'ready'


def server_figures(state_row: dict[str, str], stat_row: dict[str, str], backend: str) -> dict[str, Any]:
    """What the module returns of one server, from its rows of `show servers state` and `show stat`."""
    state_command = 'show servers state %s' % backend
    stat_command = stat_request(backend)
    return {
        'admin_state': admin_state(number(state_row, 'srv_admin_state', state_command) or 0),
        'status': stat_row.get('status') or '',
        'sessions': number(stat_row, 'scur', stat_command) or 0,
        'queued': number(stat_row, 'qcur', stat_command) or 0,
        # A check under way shows as "* L7OK" (src/stats.c): the status is the last one's either way.
        'check_status': (stat_row.get('check_status') or '').removeprefix('* ') or None,
        'check_running': (stat_row.get('check_status') or '').startswith('* '),
        'check_code': number(stat_row, 'check_code', stat_command),
        'check_description': stat_row.get('check_desc') or None,
        'check_detail': stat_row.get('last_chk') or None,
    }


def stat_request(backend: str) -> str:
    """`show stat` of the backend's servers alone (type 4, every server id)."""
    return 'show stat %s 4 -1' % backend


def describe_check(figures: dict[str, Any]) -> str:
    """The last health check in words: 'L4CON (Layer4 connection problem: Connection refused)', or 'none'."""
    if not figures['check_status']:
        return 'none'
    words = [figures['check_description'], figures['check_detail']]
    if figures['check_code'] is not None and figures['check_description'] is None:
        words[0] = 'code %d' % figures['check_code']
    said = ': '.join(word for word in words if word)
    return figures['check_status'] + (' (%s)' % said if said else '')


def with_finished_check_detail(figures: dict[str, Any], earlier: Optional[dict[str, Any]]) -> dict[str, Any]:
    """figures, their check detail taken from an earlier read where a check under way emptied it.

    HAProxy empties last_chk when a check starts (set_server_check_status, HCHK_STATUS_START) but keeps the finished
    check's status and code until the new one ends, so a read in between pairs that status with no detail.
    """
    if (
        earlier is None
        or not figures['check_running']
        or figures['check_detail'] is not None
        or (earlier['check_status'], earlier['check_code']) != (figures['check_status'], figures['check_code'])
    ):
        return figures
    return dict(figures, check_detail=earlier['check_detail'])


def reached(state: str, figures: dict[str, Any]) -> bool:
    """Whether the wait of state is over: UP for ready, no session left nor request queued otherwise."""
    if state == 'ready':
        return figures['status'] in SERVING_STATUSES
    return figures['sessions'] == 0 and figures['queued'] == 0


def count(amount: int, noun: str) -> str:
    return '%d %s%s' % (amount, noun, '' if amount == 1 else 's')


def waited_for(state: str, name: str) -> str:
    if state == 'ready':
        return '%s to be UP' % name
    return 'the sessions on %s to end' % name


def last_seen(state: str, figures: dict[str, Any]) -> str:
    """The figures the wait judged, for the message of a wait that ran out."""
    if state == 'ready':
        return 'status %s, last check %s' % (figures['status'], describe_check(figures))
    return '%s still open, %s queued (status %s)' % (
        count(figures['sessions'], 'session'),
        count(figures['queued'], 'request'),
        figures['status'],
    )


def state_diff(name: str, before: str, after: str) -> dict[str, str]:
    return {
        'before': 'admin_state: %s\n' % before,
        'after': 'admin_state: %s\n' % after,
        'before_header': '%s (before)' % name,
        'after_header': '%s (after)' % name,
    }


class ServerControl:
    """One server of a backend through exchange; clock() is monotonic seconds, sleep(seconds) waits."""

    def __init__(
        self,
        exchange: Exchange,
        backend: str,
        server: str,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.exchange = exchange
        self.backend = backend
        self.server = server
        self.name = '%s/%s' % (backend, server)
        self.clock = clock
        self.sleep = sleep

    def read(self) -> dict[str, Any]:
        """The server's admin state, status, sessions and last check."""
        state_row = self._servers_state()
        command = stat_request(self.backend)
        stat_row = parse_stat(command, self.exchange(command), self.backend).get(self.server)
        if stat_row is None:
            # Removed between the two reads (a dynamic server): as unknown as one never there.
            self._unknown_server(self._servers_state_rows())
        return server_figures(state_row, stat_row, self.backend)

    def _servers_state_rows(self) -> dict[str, dict[str, str]]:
        command = 'show servers state %s' % self.backend
        reply = self.exchange(command)
        if reply.strip() == NO_BACKEND:
            self._unknown_backend()
        return parse_servers_state(command, reply)

    def _servers_state(self) -> dict[str, str]:
        rows = self._servers_state_rows()
        if self.server not in rows:
            self._unknown_server(rows)
        return rows[self.server]

    def _unknown_backend(self) -> NoReturn:
        backends = parse_backends('show backend', self.exchange('show backend'))
        raise HAProxyFailed(
            'HAProxy has no backend %r; its backends: %s' % (self.backend, ', '.join(backends) or 'none')
        )

    def _unknown_server(self, rows: dict[str, dict[str, str]]) -> NoReturn:
        raise HAProxyFailed(
            'HAProxy backend %r has no server %r; its servers: %s'
            % (self.backend, self.server, ', '.join(rows) or 'none')
        )

    def set_state(self, state: str) -> None:
        """`set server <backend>/<server> state <state>`, which answers nothing when it worked."""
        command = 'set server %s state %s' % (self.name, state)
        reply = self.exchange(command)
        if reply.strip():
            raise HAProxyFailed(refusal(command, reply))

    def wait(self, state: str, timeout: float, interval: float) -> tuple[dict[str, Any], float]:
        """(figures, seconds waited) once reached(state); HAProxyFailed with both once timeout seconds passed."""
        start = self.clock()
        figures: Optional[dict[str, Any]] = None
        while True:
            figures = with_finished_check_detail(self.read(), figures)
            elapsed = self.clock() - start
            if reached(state, figures):
                return figures, round(elapsed, 3)
            remaining = timeout - elapsed
            if remaining <= 0:
                raise HAProxyFailed(
                    'timed out after %s s waiting for %s: %s'
                    % (format_seconds(timeout), waited_for(state, self.name), last_seen(state, figures)),
                    server=figures,
                    elapsed=round(elapsed, 3),
                )
            self.sleep(min(interval, remaining))


def outcome(name: str, state: str, previous: str, changed: bool, check_mode: bool) -> str:
    """The first words of the module's message: what was (or would be) set."""
    if not changed:
        return '%s is already in admin state %s' % (name, state)
    if check_mode:
        return '%s would be set from %s to %s' % (name, previous, state)
    return '%s set from %s to %s' % (name, previous, state)


def apply(
    control: ServerControl, state: str, wait: bool, timeout: float, interval: float, check_mode: bool
) -> dict[str, Any]:
    """Set the server's admin state where it differs, then wait for what the state promises.

    Check mode reads only. A failure after the set carries changed, so the play knows HAProxy was changed.
    """
    previous = control.read()
    changed = previous['admin_state'] != state
    msg = outcome(control.name, state, previous['admin_state'], changed, check_mode)
    result: dict[str, Any] = {'changed': changed, 'previous': previous, 'server': previous, 'elapsed': 0.0}
    if check_mode:
        return dict(result, msg=msg)
    if changed:
        control.set_state(state)
    if not wait:
        server = control.read() if changed else previous
        return dict(result, server=server, msg=msg + '; not waited for')
    try:
        server, elapsed = control.wait(state, timeout, interval)
    except HAProxyFailed as exc:
        exc.details.update(changed=changed, previous=previous)
        raise
    done = 'UP' if state == 'ready' else 'no session left'
    return dict(result, server=server, elapsed=elapsed, msg='%s; %s after %s s' % (msg, done, format_seconds(elapsed)))
