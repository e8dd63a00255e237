# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.haproxy_server against a runtime API that lies, stalls or answers in pieces, and bad options.

Each case runs the module as Ansible runs it (tests/adversarial/harness.py) against a fake runtime API on a Unix
socket that answers as HAProxy 2.6.12 did (tests/fixtures/haproxy/haproxy-2.6.json), but for what the case breaks:
a session or admin-state column missing, empty or cut off (unknown is not zero: the module must not report a drain
done on sessions it never read), a `set server` that answers as if it worked and changes nothing, an answer that
trickles a byte every half second or comes late for every command (the module's timeout bounds the whole run), a
field over csv's 128 KiB limit, a table without its server column or without the server's row. Each must end in a
clean error that quotes what HAProxy said, or in a success whose result is true, by its deadline.
"""

import json
import socketserver
import threading
import time

import pytest

from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.support import HANG_DEADLINE, LOADED_OVERRUN, recorded

MODULE = 'haproxy_server'
RECORDED = json.loads(recorded('haproxy', 'haproxy-2.6.json'))
SNAPSHOTS = RECORDED['snapshots']
STATE = 'show servers state vllm'
STAT = 'show stat vllm 4 -1'
# What a module run may take beyond its own timeout: the interpreter's and Ansible's start on a loaded machine.
START_SECONDS = 5


class FakeRuntimeApi(socketserver.ThreadingUnixStreamServer):
    """HAProxy's runtime API at path: one command a connection, answer(command)'s reply sent by send, then the close."""

    daemon_threads = True

    def __init__(self, path, answer, send):
        self.answer = answer
        self.send = send
        self.stopping = threading.Event()
        super().__init__(path, RuntimeApiHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self):
        self.stopping.set()
        self.shutdown()
        self.server_close()


class RuntimeApiHandler(socketserver.StreamRequestHandler):
    def handle(self):
        command = self.rfile.readline().decode('utf-8', errors='replace').rstrip('\n')
        try:
            self.server.send(self.request, self.server.answer(command).encode('utf-8'), self.server.stopping)
        except OSError:
            pass  # the module gave up on the answer, as it should


def at_once(connection, reply, stopping):
    connection.sendall(reply)


def trickled(connection, reply, stopping):
    """A byte every half second: each one restarts a timeout that bounds a single read."""
    for byte in reply:
        if stopping.wait(0.5):
            return
        connection.sendall(bytes([byte]))


def late(seconds):
    """Each answer whole, after seconds: each exchange within its own bound, the run not within its timeout."""

    def send(connection, reply, stopping):
        if not stopping.wait(seconds):
            connection.sendall(reply)

    return send


def silent(connection, reply, stopping):
    stopping.wait(HANG_DEADLINE)


def haproxy(step, replies=None, sets=None):
    """answer(command): HAProxy as recorded at step, replies answering their commands instead; `set server vllm/a
    state S` answers as HAProxy does (an empty line) and moves to the step sets[S], or nowhere when sets has none."""
    current = [step]

    def answer(command):
        if command in (replies or {}):
            return replies[command]
        prefix = 'set server vllm/a state '
        if command.startswith(prefix):
            current[0] = (sets or {}).get(command[len(prefix) :], current[0])
            return RECORDED['set_replies']['set server vllm/a state ready']
        return SNAPSHOTS[current[0]].get(command, RECORDED['errors']['bogus'])

    return answer


def stat_table(step):
    """(header fields, rows' fields) of the recorded `show stat` at step; the fixture's fields hold no comma."""
    lines = [line for line in SNAPSHOTS[step][STAT].split('\n') if line]
    return lines[0][2:].split(','), [line.split(',') for line in lines[1:]]


def stat_reply(header, rows):
    return '# ' + ','.join(header) + '\n' + ''.join(','.join(row) + '\n' for row in rows) + '\n'


def stat_without(step, column):
    header, rows = stat_table(step)
    index = header.index(column)
    return stat_reply(header[:index] + header[index + 1 :], [row[:index] + row[index + 1 :] for row in rows])


def stat_with(step, server, column, value):
    header, rows = stat_table(step)
    index = header.index(column)
    return stat_reply(header, [row[:index] + [value] + row[index + 1 :] if row[1] == server else row for row in rows])


def stat_cut(step, server, fields):
    header, rows = stat_table(step)
    return stat_reply(header, [row[:fields] if row[1] == server else row for row in rows])


def stat_row(reply, server):
    return next(line for line in reply.split('\n') if line.startswith('vllm,%s,' % server))


def state_row(reply, server):
    return next(line for line in reply.split('\n') if line.split()[3:4] == [server])


def state_without(step, column):
    version, header, *rows = [line for line in SNAPSHOTS[step][STATE].split('\n') if line]
    index = header[2:].split().index(column)

    def drop(line):
        return ' '.join(line.split()[:index] + line.split()[index + 1 :])

    return '\n'.join([version, '# ' + drop(header[2:])] + [drop(row) for row in rows]) + '\n\n'


def state_cut(step, server, fields):
    lines = SNAPSHOTS[step][STATE].split('\n')
    return '\n'.join(' '.join(line.split()[:fields]) if line.split()[3:4] == [server] else line for line in lines)


def run(tmp_path, answer, args, send=at_once):
    """The module run against a fake runtime API in tmp_path; the run's wall time as outcome.wall."""
    path = str(tmp_path / 'admin.sock')
    api = FakeRuntimeApi(path, answer, send)
    try:
        started = time.monotonic()
        outcome = harness.run_module(MODULE, tmp_path, dict({'socket': path, 'backend': 'vllm', 'server': 'a'}, **args))
        outcome.wall = time.monotonic() - started
    finally:
        api.close()
    return outcome


def says(*parts):
    return lambda result: all(part in result['msg'] for part in parts)


def said(msg):
    return lambda result: result['msg'] == msg


# ---------------------------------------------------------------- unknown is not zero


DRAINING_WITHOUT_SCUR = stat_without('draining', 'scur')
DRAINING_WITHOUT_QCUR = stat_without('draining', 'qcur')
DRAINING_SCUR_EMPTY = stat_with('draining', 'a', 'scur', '')
DRAINING_QCUR_EMPTY = stat_with('draining', 'a', 'qcur', '')
DRAINING_CUT = stat_cut('draining', 'a', 4)
FIELDS = len(stat_table('draining')[0])


@pytest.mark.parametrize(
    'answer, args, expected',
    [
        # Server a drains with a session open: the old reading took each of these for "no session left".
        (
            haproxy('draining', {STAT: DRAINING_WITHOUT_SCUR}),
            {'state': 'drain'},
            "HAProxy's answer to 'show stat vllm 4 -1' has no scur for vllm/a (its sessions unknown): "
            + stat_row(DRAINING_WITHOUT_SCUR, 'a')[:300],
        ),
        (
            haproxy('draining', {STAT: DRAINING_WITHOUT_QCUR}),
            {'state': 'drain'},
            "HAProxy's answer to 'show stat vllm 4 -1' has no qcur for vllm/a (its queue unknown): "
            + stat_row(DRAINING_WITHOUT_QCUR, 'a')[:300],
        ),
        (
            haproxy('draining', {STAT: DRAINING_SCUR_EMPTY}),
            {'state': 'drain'},
            "HAProxy's answer to 'show stat vllm 4 -1' has no scur for vllm/a (its sessions unknown): "
            + stat_row(DRAINING_SCUR_EMPTY, 'a')[:300],
        ),
        (
            haproxy('draining', {STAT: DRAINING_QCUR_EMPTY}),
            {'state': 'drain'},
            "HAProxy's answer to 'show stat vllm 4 -1' has no qcur for vllm/a (its queue unknown): "
            + stat_row(DRAINING_QCUR_EMPTY, 'a')[:300],
        ),
        (
            haproxy('draining', {STAT: DRAINING_CUT}),
            {'state': 'drain'},
            "HAProxy's answer to 'show stat vllm 4 -1' has the row of vllm/a with 4 fields where its header "
            'names %d: vllm,a,0,0' % FIELDS,
        ),
        # Server a is in maintenance: without its admin state it read as ready, and nothing was set.
        (
            haproxy('maint', {STATE: state_without('maint', 'srv_admin_state')}),
            {'state': 'ready', 'wait': False},
            "HAProxy's answer to 'show servers state vllm' has no srv_admin_state for vllm/a (its admin state "
            'unknown): ' + state_row(state_without('maint', 'srv_admin_state'), 'a'),
        ),
        (
            haproxy('maint', {STATE: state_cut('maint', 'a', 5)}),
            {'state': 'ready', 'wait': False},
            "HAProxy's answer to 'show servers state vllm' has the row of vllm/a with 5 fields where its header "
            'names 25: 3 vllm 1 a 127.0.0.1',
        ),
    ],
    ids=['scur-missing', 'qcur-missing', 'scur-empty', 'qcur-empty', 'stat-row-cut', 'admin-missing', 'state-row-cut'],
)
def test_a_figure_not_read_is_unknown_not_zero(tmp_path, verdict, answer, args, expected):
    run_ = run(tmp_path, answer, dict(args, timeout=5))
    verdict(MODULE, harness.judge(run_, expect_success=False, check=said(expected)), str(run_.result))


# ---------------------------------------------------------------- a set that did not take hold


@pytest.mark.parametrize(
    'step, args, expected',
    [
        ('ready', {'state': 'drain'}, 'vllm/a is in admin state ready (status UP) after it'),
        ('ready', {'state': 'drain', 'wait': False}, 'vllm/a is in admin state ready (status UP) after it'),
        ('ready', {'state': 'maint'}, 'vllm/a is in admin state ready (status UP) after it'),
        ('maint', {'state': 'ready', 'wait': False}, 'vllm/a is in admin state maint (status MAINT) after it'),
    ],
    ids=['drain', 'drain-no-wait', 'maint', 'ready-no-wait'],
)
def test_a_set_that_haproxy_ignores_is_a_failure(tmp_path, verdict, step, args, expected):
    command = 'set server vllm/a state %s' % args['state']
    run_ = run(tmp_path, haproxy(step), dict(args, timeout=5, sleep=0.1))
    msg = 'HAProxy did not take %r: %s' % (command, expected)
    # Without the server's figures, which roles/vllm_haproxy's drain reads as a wait that ran out, and goes on.
    outcome = harness.judge(
        run_, expect_success=False, check=lambda result: result['msg'] == msg and 'server' not in result
    )
    verdict(MODULE, outcome, str(run_.result))


def test_a_set_that_takes_hold_is_a_success(tmp_path, verdict):
    run_ = run(tmp_path, haproxy('ready', sets={'drain': 'drained'}), {'state': 'drain', 'timeout': 5})
    outcome = harness.judge(
        run_,
        expect_success=True,
        check=lambda result: (
            result['changed'] is True
            and result['server']['admin_state'] == 'drain'
            and result['server']['sessions'] == 0
            and result['msg'].startswith('vllm/a set from ready to drain; no session left after ')
        ),
    )
    verdict(MODULE, outcome, str(run_.result))


# ---------------------------------------------------------------- the timeout bounds the whole run


@pytest.mark.parametrize(
    'send, timeout, expected',
    [
        (
            trickled,
            2,
            "cannot use the HAProxy runtime API socket {socket}: no complete answer to 'show servers state vllm' "
            "by the end of the module's timeout (2 s)",
        ),
        (
            silent,
            2,
            "cannot use the HAProxy runtime API socket {socket}: no complete answer to 'show servers state vllm' "
            "by the end of the module's timeout (2 s)",
        ),
        # 1.5 s an answer, well within the 10 s an exchange may take: the first read's second exchange is cut at 2 s.
        (
            late(1.5),
            2,
            "cannot use the HAProxy runtime API socket {socket}: no complete answer to 'show stat vllm 4 -1' "
            "by the end of the module's timeout (2 s)",
        ),
    ],
    ids=['trickle', 'silent', 'late'],
)
def test_a_slow_runtime_api_fails_by_the_timeout(tmp_path, verdict, send, timeout, expected):
    run_ = run(tmp_path, haproxy('draining'), {'state': 'drain', 'timeout': timeout}, send=send)
    outcome = harness.judge(run_, expect_success=False, check=says(expected.format(socket=tmp_path / 'admin.sock')))
    if outcome in harness.GOOD and run_.wall > timeout + START_SECONDS + LOADED_OVERRUN:
        outcome = harness.HANG
    verdict(MODULE, outcome, '%s (%.1f s)' % (run_.result, run_.wall))


# ---------------------------------------------------------------- replies of the wrong shape


HEADER, ROWS = stat_table('draining')
WITHOUT_SVNAME = stat_without('draining', 'svname')
HUGE_FIELD = stat_with('draining', 'a', 'last_chk', 'x' * (200 * 1024))
GARBLED = '# ' + ','.join(HEADER) + '\n\x00\x01 garbled\n\n'


@pytest.mark.parametrize(
    'answer, expected',
    [
        (
            haproxy('draining', {STAT: WITHOUT_SVNAME}),
            "HAProxy's answer to 'show stat vllm 4 -1' has no svname column: " + WITHOUT_SVNAME[:300],
        ),
        # One field over csv's 128 KiB limit ended the module in a traceback (_csv.Error).
        (
            haproxy('draining', {STAT: HUGE_FIELD}),
            "HAProxy's answer to 'show stat vllm 4 -1' has a line of %d characters, more than 65536: "
            % len(stat_row(HUGE_FIELD, 'a'))
            + stat_row(HUGE_FIELD, 'a')[:300],
        ),
        # Its header and no row of a, which `show servers state` lists: not "no server 'a'; its servers: a, ...".
        (
            haproxy('draining', {STAT: GARBLED}),
            "HAProxy's answer to 'show stat vllm 4 -1' has no row for vllm/a, which 'show servers state vllm' "
            'lists: ' + ' '.join(GARBLED.split())[:300],
        ),
        (
            haproxy('draining', {STAT: stat_with('draining', 'a', 'last_chk', 'cut\rhere')}),
            "HAProxy's answer to 'show stat vllm 4 -1' is no CSV that HAProxy writes (line 2: new-line character "
            'seen in unquoted field',
        ),
    ],
    ids=['no-svname', 'field-over-128-KiB', 'no-row-for-the-server', 'carriage-return'],
)
def test_a_reply_of_the_wrong_shape_is_quoted(tmp_path, verdict, answer, expected):
    run_ = run(tmp_path, answer, {'state': 'drain', 'timeout': 5})
    verdict(MODULE, harness.judge(run_, expect_success=False, check=says(expected)), str(run_.result)[:3000])


# ---------------------------------------------------------------- options refused before they are logged


@pytest.mark.parametrize(
    'args, expected',
    [
        # syslog raised on the NUL: "Failed to log to syslog (embedded null character)".
        (
            {'socket': '/run/haproxy/admin\0.sock'},
            "argument 'socket' is of type str and we were unable to convert to runtime_api_path: a path cannot "
            'hold a NUL character',
        ),
        # Logged as it was: a line of syslog that the path's second half forges.
        (
            {'socket': '/run/haproxy/admin.sock\nJan  1 00:00:00 host sshd[1]: Accepted'},
            "argument 'socket' is of type str and we were unable to convert to runtime_api_path: a path cannot "
            'hold a control character (U+000A)',
        ),
        (
            {'socket': '/run/haproxy/\x1b[2Jadmin.sock'},
            "argument 'socket' is of type str and we were unable to convert to runtime_api_path: a path cannot "
            'hold a control character (U+001B)',
        ),
        (
            {'backend': 'vl\0lm'},
            "argument 'backend' is of type str and we were unable to convert to haproxy_name: must be an HAProxy "
            'name (letters, digits, ".", "_", ":" and "-"), got \'vl\\x00lm\'',
        ),
        (
            {'server': 'a\n'},
            "argument 'server' is of type str and we were unable to convert to haproxy_name: must be an HAProxy "
            'name (letters, digits, ".", "_", ":" and "-"), got \'a\\n\'',
        ),
    ],
    ids=['socket-nul', 'socket-newline', 'socket-escape', 'backend-nul', 'server-newline'],
)
def test_an_option_with_a_control_character_is_refused_by_its_name(tmp_path, verdict, args, expected):
    run_ = harness.run_module(
        MODULE,
        tmp_path,
        dict({'socket': str(tmp_path / 'admin.sock'), 'backend': 'vllm', 'server': 'a'}, **args, state='drain'),
    )
    verdict(MODULE, harness.judge(run_, expect_success=False, check=said(expected)), str(run_.result))
