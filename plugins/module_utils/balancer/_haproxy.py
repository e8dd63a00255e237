# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""One server of an HAProxy backend, taken out of rotation and put back, behind llmserve.vllm.haproxy_server.

PRIVATE to the collection: this is not a public API and may change at any time.
Only the modules of llmserve.vllm may import it.

HAProxy's runtime API (its stats socket) answers one command per connection: RuntimeApi sends it and reads the reply
to its end, within the seconds it is given. ServerControl takes that exchange as an argument, with a clock and a
sleep, so the unit tests drive the reads, the set and the wait with replies recorded from HAProxy 2.6 and no real
time; it gives each exchange what is left of the module's timeout, at most EXCHANGE_SECONDS. The formats are
HAProxy's doc/management.txt ("show stat", "show servers state", "set server") and src/stats.c.

Only what was read counts: a figure the reply lacks, leaves empty or cuts off is unknown, never 0, and fails the
module quoting the row; a set is read back before anything waits on it.
"""

import csv
import errno
import math
import os
import re
import socket
import stat
import time
import unicodedata
from typing import Any, Callable, NoReturn, Optional

from ansible.module_utils.common.validation import check_type_str

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path
from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
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
# The longest line of a reply that is parsed. A row of `show stat` is some 500 characters; a line this long is no
# HAProxy's, and it keeps every field below csv's own limit (128 KiB), whose csv.Error would end the parse.
MAX_LINE = 64 * 1024
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

# exchange(command, seconds) -> the reply's text, read to its end within seconds.
Exchange = Callable[[str, float], str]
# connect(path, timeout) -> a connected socket whose operations time out after timeout seconds.
Connect = Callable[[str, float], socket.socket]


class HAProxyFailed(Exception):
    """The runtime API could not be used, refused a command, or the wait ran out; details go into the result."""

    def __init__(self, msg: str, **details: Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details


class NoAnswer(HAProxyFailed):
    """The reply to command did not end within the seconds its exchange was given."""

    def __init__(self, path: str, command: str, seconds: float) -> None:
        super().__init__(
            'cannot use the HAProxy runtime API socket %s: no complete answer to %r within %s s'
            % (path, command, format_seconds(seconds))
        )
        self.path = path
        self.command = command

    def by_the_timeout(self, timeout: float) -> HAProxyFailed:
        """The failure where the module's timeout, not the exchange's own bound, cut the exchange short."""
        return HAProxyFailed(
            "cannot use the HAProxy runtime API socket %s: no complete answer to %r by the end of the module's "
            'timeout (%s s)' % (self.path, self.command, format_seconds(timeout))
        )


class OutOfTime(HAProxyFailed):
    """The module's timeout ran out before command could be sent."""

    def __init__(self, command: str, timeout: float) -> None:
        super().__init__(
            "the module's timeout (%s s) ran out before %r was sent to HAProxy" % (format_seconds(timeout), command)
        )


# The argument spec's types: AnsibleModule logs its arguments (syslog, the journal) once they passed the spec, and
# before the module's own checks; what must not reach the log has to be refused by a type.


def haproxy_name(value: object) -> str:
    """A backend or server name that HAProxy can have: nothing that could end a command, nor a control character."""
    name = check_type_str(value, allow_conversion=True)
    if not NAME.match(name):
        raise ValueError('must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got %r' % name)
    return name


def runtime_api_path(value: object) -> str:
    """A path (nul_free_path: user and variables expanded, UTF-8) without a control character, which would forge a
    line of the log or of a message."""
    path = nul_free_path(value)
    control = next((character for character in path if unicodedata.category(character) == 'Cc'), None)
    if control is not None:
        raise ValueError('a path cannot hold a control character (U+%04X)' % ord(control))
    return path


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
    """exchange(command, seconds) -> reply over the runtime API socket at path, one connection a command.

    One deadline (SIGALRM) bounds the whole exchange, from the connect to the reply's end: a socket timeout alone
    bounds each read, and a peer that sends a byte at a time restarts it with each byte.
    """

    def __init__(self, path: str, connect: Connect = connect_unix) -> None:
        self.path = path
        self.connect = connect

    def __call__(self, command: str, seconds: float) -> str:
        problem = socket_problem(self.path)
        if problem:
            self._fail(problem)
        try:
            with deadline(seconds), self.connect(self.path, seconds) as sock:
                sock.sendall(command.encode('utf-8') + b'\n')
                return self._read(sock, command)
        except (DeadlinePassed, socket.timeout):
            raise NoAnswer(self.path, command, seconds) from None
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


class Row(dict[str, str]):
    """One row of a show command's table, {column: value}, with the line HAProxy sent and how many fields it has
    beside how many columns its header names (a row cut short lacks the columns past its end)."""

    def __init__(self, columns: list[str], fields: list[str], line: str) -> None:
        super().__init__(zip(columns, fields))
        self.line = line
        self.fields = len(fields)
        self.columns = len(columns)


def table_lines(command: str, reply: str, header: str) -> list[str]:
    """The non-empty lines of a show command's table from its header on; HAProxyFailed quoting any other reply, or a
    line longer than MAX_LINE.

    `show servers state` puts its format version before the header; the others start with it. HAProxy ends its lines
    with a newline alone: the other line breaks of str.splitlines (a carriage return, U+0085, ...) stay in the line.
    """
    lines = reply.split('\n')
    for index, line in enumerate(lines[:2]):
        if line.startswith(header):
            table = [line for line in lines[index:] if line]
            for line in table:
                if len(line) > MAX_LINE:
                    raise HAProxyFailed(
                        "HAProxy's answer to %r has a line of %d characters, more than %d: %s"
                        % (command, len(line), MAX_LINE, quote(line, MAX_QUOTE))
                    )
            return table
    raise HAProxyFailed(refusal(command, reply))


def require_column(command: str, columns: list[str], column: str, header: str) -> None:
    if column not in columns:
        raise HAProxyFailed("HAProxy's answer to %r has no %s column: %s" % (command, column, quote(header, MAX_QUOTE)))


def parse_servers_state(command: str, reply: str) -> dict[str, Row]:
    """{server name: row} of `show servers state <backend>` (space-separated, '#' header)."""
    lines = table_lines(command, reply, '# be_id ')
    columns = lines[0][2:].split()
    require_column(command, columns, 'srv_name', lines[0])
    rows = (Row(columns, line.split(), line) for line in lines[1:] if not line.startswith('#'))
    return {row['srv_name']: row for row in rows if 'srv_name' in row}


def csv_fields(command: str, number: int, line: str) -> list[str]:
    """The fields of one line of CSV, each line read on its own: a quote left open ends with its line."""
    try:
        return next(csv.reader([line]))
    except csv.Error as exc:
        raise HAProxyFailed(
            "HAProxy's answer to %r is no CSV that HAProxy writes (line %d: %s): %s"
            % (command, number, exc, quote(line, MAX_QUOTE))
        ) from None


def parse_stat(command: str, reply: str, backend: str) -> dict[str, Row]:
    """{server name: row} of the backend's servers in `show stat` (CSV, '# ' before its header)."""
    lines = table_lines(command, reply, '# pxname,')
    columns = csv_fields(command, 1, lines[0][2:])
    for column in ('pxname', 'svname'):
        require_column(command, columns, column, lines[0])
    rows = (Row(columns, csv_fields(command, number, line), line) for number, line in enumerate(lines[1:], 2))
    return {row['svname']: row for row in rows if row.get('pxname') == backend and row.get('svname') not in PROXY_ROWS}


def parse_backends(command: str, reply: str) -> list[str]:
    """The backend names of `show backend`."""
    return table_lines(command, reply, '# name')[1:]


def integer(text: str, field: str, command: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise HAProxyFailed(
            "HAProxy's answer to %r has %s %s, not a number" % (command, field, quote(repr(text), MAX_QUOTE))
        ) from None


def number(row: dict[str, str], field: str, command: str) -> Optional[int]:
    """The integer in a field of a reply's row; None where HAProxy left it empty."""
    text = row.get(field) or ''
    return integer(text, field, command) if text else None


def admin_state(bits: int) -> str:
    """The admin state `set server ... state` set: forced maintenance wins over a forced drain, as in HAProxy."""
    if bits & FORCED_MAINT:
        return 'maint'
    if bits & FORCED_DRAIN:
        return 'drain'
    return 'ready'


def whole(row: Row, command: str, name: str) -> None:
    """HAProxyFailed quoting the row where it has more or fewer fields than its header names columns."""
    if row.fields != row.columns:
        raise HAProxyFailed(
            "HAProxy's answer to %r has the row of %s with %d fields where its header names %d: %s"
            % (command, name, row.fields, row.columns, quote(row.line, MAX_QUOTE))
        )


def known(row: Row, field: str, command: str, name: str, what: str) -> str:
    """The field's text; HAProxyFailed quoting the row where the reply has none (unknown is not 0)."""
    text = row.get(field) or ''
    if not text:
        raise HAProxyFailed(
            "HAProxy's answer to %r has no %s for %s (%s unknown): %s"
            % (command, field, name, what, quote(row.line, MAX_QUOTE))
        )
    return text


def known_number(row: Row, field: str, command: str, name: str, what: str) -> int:
    return integer(known(row, field, command, name, what), field, command)


def server_figures(state_row: Row, stat_row: Row, backend: str) -> dict[str, Any]:
    """What the module returns of one server, from its rows of `show servers state` and `show stat`; HAProxyFailed
    where either row is cut or lacks what the module decides on."""
    name = '%s/%s' % (backend, stat_row['svname'])
    state_command = 'show servers state %s' % backend
    stat_command = stat_request(backend)
    whole(state_row, state_command, name)
    whole(stat_row, stat_command, name)
    return {
        'admin_state': admin_state(known_number(state_row, 'srv_admin_state', state_command, name, 'its admin state')),
        'status': known(stat_row, 'status', stat_command, name, 'its status'),
        'sessions': known_number(stat_row, 'scur', stat_command, name, 'its sessions'),
        'queued': known_number(stat_row, 'qcur', stat_command, name, 'its queue'),
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
    """One server of a backend through exchange; clock() is monotonic seconds, sleep(seconds) waits.

    limit(timeout) bounds everything it does from then on: each exchange gets what is left, at most
    EXCHANGE_SECONDS, and the wait ends at the same time.
    """

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
        self.timeout = math.inf
        self.ends_at = math.inf

    def limit(self, timeout: float) -> None:
        self.timeout = timeout
        self.ends_at = self.clock() + timeout

    def _exchange(self, command: str) -> str:
        left = self.ends_at - self.clock()
        if left <= 0:
            raise OutOfTime(command, self.timeout)
        try:
            return self.exchange(command, min(EXCHANGE_SECONDS, left))
        except NoAnswer as exc:
            if left < EXCHANGE_SECONDS:
                raise exc.by_the_timeout(self.timeout) from None
            raise

    def read(self) -> dict[str, Any]:
        """The server's admin state, status, sessions and last check."""
        state_row = self._servers_state()
        command = stat_request(self.backend)
        reply = self._exchange(command)
        stat_row = parse_stat(command, reply, self.backend).get(self.server)
        if stat_row is None:
            self._no_stat_row(command, reply)
        return server_figures(state_row, stat_row, self.backend)

    def _servers_state_rows(self) -> dict[str, Row]:
        command = 'show servers state %s' % self.backend
        reply = self._exchange(command)
        if reply.strip() == NO_BACKEND:
            self._unknown_backend()
        return parse_servers_state(command, reply)

    def _servers_state(self) -> Row:
        rows = self._servers_state_rows()
        if self.server not in rows:
            self._unknown_server(rows)
        return rows[self.server]

    def _no_stat_row(self, command: str, reply: str) -> NoReturn:
        rows = self._servers_state_rows()
        if self.server not in rows:
            # Removed between the two reads (a dynamic server): as unknown as one never there.
            self._unknown_server(rows)
        raise HAProxyFailed(
            "HAProxy's answer to %r has no row for %s, which 'show servers state %s' lists: %s"
            % (command, self.name, self.backend, quote(' '.join(reply.split()) or '(nothing)', MAX_QUOTE))
        )

    def _unknown_backend(self) -> NoReturn:
        backends = parse_backends('show backend', self._exchange('show backend'))
        raise HAProxyFailed(
            'HAProxy has no backend %r; its backends: %s' % (self.backend, ', '.join(backends) or 'none')
        )

    def _unknown_server(self, rows: dict[str, Row]) -> NoReturn:
        raise HAProxyFailed(
            'HAProxy backend %r has no server %r; its servers: %s'
            % (self.backend, self.server, ', '.join(rows) or 'none')
        )

    def set_state(self, state: str) -> dict[str, Any]:
        """`set server <backend>/<server> state <state>`, which answers nothing when it worked; the server as read
        back after it. HAProxyFailed (changed false) where HAProxy refused it or the admin state did not follow.

        Neither failure carries the server's figures: roles/vllm_haproxy's drain tells a wait that ran out (which
        does) from a drain that could not begin by them.
        """
        command = 'set server %s state %s' % (self.name, state)
        reply = self._exchange(command)
        if reply.strip():
            raise HAProxyFailed(refusal(command, reply), changed=False)
        after = self.read()
        if after['admin_state'] != state:
            raise HAProxyFailed(
                'HAProxy did not take %r: %s is in admin state %s (status %s) after it'
                % (command, self.name, after['admin_state'], after['status']),
                changed=False,
            )
        return after

    def wait(self, state: str, interval: float, first: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], float]:
        """(figures, seconds waited) once reached(state), from the read first where given; HAProxyFailed with both
        once the time limit() gave ran out.

        The seconds waited end where the read that saw the state began: 0 where the first one did.
        """
        start = seen = self.clock()
        figures = first if first is not None else self.read()
        while not reached(state, figures):
            left = self.ends_at - self.clock()
            if left > 0:
                self.sleep(min(interval, left))
            try:
                seen = self.clock()
                figures = with_finished_check_detail(self.read(), figures)
            except OutOfTime:
                raise HAProxyFailed(
                    'timed out after %s s waiting for %s: %s'
                    % (format_seconds(self.timeout), waited_for(state, self.name), last_seen(state, figures)),
                    server=figures,
                    elapsed=round(self.clock() - start, 3),
                ) from None
        return figures, round(seen - start, 3)


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
    """Set the server's admin state where it differs, then wait for what the state promises; all within timeout.

    Check mode reads only. A failure after the set carries changed, so the play knows HAProxy was changed.
    """
    control.limit(timeout)
    previous = control.read()
    changed = previous['admin_state'] != state
    msg = outcome(control.name, state, previous['admin_state'], changed, check_mode)
    result: dict[str, Any] = {'changed': changed, 'previous': previous, 'server': previous, 'elapsed': 0.0}
    if check_mode:
        return dict(result, msg=msg)
    try:
        server = control.set_state(state) if changed else previous
        if not wait:
            return dict(result, server=server, msg=msg + '; not waited for')
        # The set's read-back is the wait's first read; a server left as it was is read afresh.
        server, elapsed = control.wait(state, interval, server if changed else None)
    except HAProxyFailed as exc:
        exc.details.setdefault('changed', changed)
        exc.details['previous'] = previous
        raise
    done = 'UP' if state == 'ready' else 'no session left'
    return dict(result, server=server, elapsed=elapsed, msg='%s; %s after %s s' % (msg, done, format_seconds(elapsed)))
