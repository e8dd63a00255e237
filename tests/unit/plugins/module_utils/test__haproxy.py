# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The HAProxy runtime API's replies as HAProxy 2.6.12 gave them (tests/fixtures/haproxy/haproxy-2.6.json, recorded by
tests/fixtures/haproxy/capture.py), read, set and waited for on a fake clock; the socket's failures on real sockets.

tests/integration/test_haproxy_server.py runs the module against a real HAProxy.
"""

import json
import os
import socket
import threading

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.balancer import _haproxy
from ansible_collections.llmserve.vllm.plugins.module_utils.balancer._haproxy import (
    HAProxyFailed,
    RuntimeApi,
    ServerControl,
    admin_state,
    apply,
    describe_check,
    haproxy_name,
    parse_servers_state,
    parse_stat,
    server_figures,
    state_diff,
)
from ansible_collections.llmserve.vllm.tests.support import recorded

RECORDED = json.loads(recorded('haproxy', 'haproxy-2.6.json'))
SNAPSHOTS = RECORDED['snapshots']
STATE_VLLM = 'show servers state vllm'
STAT_VLLM = 'show stat vllm 4 -1'
SERVERS = 'a, b, c, d, e, f, sick'


def figures(admin, status, sessions=0, check=None, code=None, description=None, detail=None, running=False):
    return {
        'admin_state': admin,
        'status': status,
        'sessions': sessions,
        'queued': 0,
        'check_status': check,
        'check_running': running,
        'check_code': code,
        'check_description': description,
        'check_detail': detail,
    }


PASSED = dict(check='L7OK', code=200, description='Layer7 check passed')


# ---------------------------------------------------------------- parsing the recorded replies


def read_recorded(step, backend, server):
    snapshot = SNAPSHOTS[step]
    state_command = 'show servers state %s' % backend
    stat_command = 'show stat %s 4 -1' % backend
    state_row = parse_servers_state(state_command, snapshot[state_command])[server]
    stat_row = parse_stat(stat_command, snapshot[stat_command], backend)[server]
    return server_figures(state_row, stat_row, backend)


@pytest.mark.parametrize(
    'step, backend, server, expected',
    [
        ('draining', 'vllm', 'a', figures('drain', 'DRAIN', sessions=1, **PASSED)),
        ('drained', 'vllm', 'a', figures('drain', 'DRAIN', **PASSED)),
        ('draining', 'vllm', 'b', figures('ready', 'UP', **PASSED)),
        ('draining', 'vllm', 'c', figures('ready', 'no check')),
        # "disabled" in the config: forced and configuration maintenance (0x05).
        ('draining', 'vllm', 'd', figures('maint', 'MAINT')),
        # Out of a configured maintenance, its first check seconds away: running, but not at full health.
        ('draining', 'vllm', 'e', figures('ready', 'UP 1/3', check='INI', description='Initializing')),
        (
            'draining',
            'vllm',
            'f',
            figures(
                'ready', 'DOWN', check='L4CON', description='Layer4 connection problem', detail='Connection refused'
            ),
        ),
        (
            'draining',
            'vllm',
            'sick',
            figures(
                'ready',
                'DOWN',
                check='L7STS',
                code=503,
                description='Layer7 wrong status',
                detail='Service Unavailable',
            ),
        ),
        ('maint', 'vllm', 'a', figures('maint', 'MAINT')),
        # Just out of maintenance: the check status is the last one before it, the health not yet full.
        ('leaving_maint', 'vllm', 'a', figures('ready', 'UP 1/2', **PASSED)),
        ('ready', 'vllm', 'a', figures('ready', 'UP', **PASSED)),
        # Maintenance inherited from the tracked vllm/d (0x02) is not the admin state `set server` forces.
        ('draining', 'other', 'y', figures('ready', 'MAINT (via vllm/d)')),
    ],
    ids=lambda value: value if isinstance(value, str) else '',
)
def test_recorded_servers_read_as_their_figures(step, backend, server, expected):
    assert read_recorded(step, backend, server) == expected


def test_show_stat_keeps_the_backends_servers_alone():
    rows = parse_stat(STAT_VLLM, SNAPSHOTS['draining'][STAT_VLLM], 'vllm')
    assert list(rows) == ['a', 'b', 'c', 'd', 'e', 'f', 'sick']
    assert parse_stat(STAT_VLLM, SNAPSHOTS['draining'][STAT_VLLM], 'other') == {}


def test_a_check_under_way_reads_as_its_last_status():
    # src/stats.c prefixes "* " while a check runs; the recorded row is marked so by hand.
    stat = SNAPSHOTS['ready'][STAT_VLLM].replace(',L7OK,200,', ',* L7OK,200,', 1)
    state_row = parse_servers_state(STATE_VLLM, SNAPSHOTS['ready'][STATE_VLLM])['a']
    read = server_figures(state_row, parse_stat(STAT_VLLM, stat, 'vllm')['a'], 'vllm')
    assert (read['check_status'], read['check_running']) == ('L7OK', True)


def test_a_field_that_is_no_number_is_named():
    stat = SNAPSHOTS['ready'][STAT_VLLM].replace('\nvllm,a,0,0,0,', '\nvllm,a,0,0,x,', 1)
    state_row = parse_servers_state(STATE_VLLM, SNAPSHOTS['ready'][STATE_VLLM])['a']
    with pytest.raises(HAProxyFailed) as failed:
        server_figures(state_row, parse_stat(STAT_VLLM, stat, 'vllm')['a'], 'vllm')
    assert failed.value.msg == "HAProxy's answer to 'show stat vllm 4 -1' has scur 'x', not a number"


@pytest.mark.parametrize(
    'bits, state',
    [
        (0x00, 'ready'),
        (0x01, 'maint'),  # FMAINT
        (0x02, 'ready'),  # IMAINT: inherited
        (0x04, 'ready'),  # CMAINT alone: a disabled server made ready
        (0x05, 'maint'),  # "disabled" in the config
        (0x08, 'drain'),  # FDRAIN
        (0x09, 'maint'),  # maintenance wins, as HAProxy's status says MAINT
        (0x10, 'ready'),  # IDRAIN: inherited
        (0x20, 'ready'),  # RMAINT: DNS resolution
    ],
)
def test_the_admin_state_is_the_forced_bits(bits, state):
    assert admin_state(bits) == state


@pytest.mark.parametrize(
    'server, words',
    [
        ('b', 'L7OK (Layer7 check passed)'),
        ('c', 'none'),
        ('e', 'INI (Initializing)'),
        ('f', 'L4CON (Layer4 connection problem: Connection refused)'),
        ('sick', 'L7STS (Layer7 wrong status: Service Unavailable)'),
    ],
)
def test_the_last_check_in_words(server, words):
    assert describe_check(read_recorded('draining', 'vllm', server)) == words


def test_a_check_code_without_words_is_named():
    assert describe_check(figures('ready', 'DOWN', check='L7STS', code=503)) == 'L7STS (code 503)'


@pytest.mark.parametrize('value, name', [('vllm', 'vllm'), ('be_vllm-2.k8s:8000', 'be_vllm-2.k8s:8000'), (7, '7')])
def test_names_that_haproxy_can_have_pass(value, name):
    assert haproxy_name(value) == name


@pytest.mark.parametrize(
    'value, problem',
    [
        ('', 'must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got \'\''),
        # `;` ends a runtime API command: the rest would run as another one.
        ('vllm;shutdown', 'must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got \'vllm;shutdown\''),
        ('vllm a', 'must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got \'vllm a\''),
        ('vllm\n', 'must be an HAProxy name (letters, digits, ".", "_", ":" and "-"), got \'vllm\\n\''),
    ],
)
def test_names_that_haproxy_cannot_have_are_refused(value, problem):
    with pytest.raises(ValueError) as refused:
        haproxy_name(value)
    assert str(refused.value) == problem


def test_the_diff_shows_the_admin_state():
    assert state_diff('vllm/a', 'ready', 'drain') == {
        'before': 'admin_state: ready\n',
        'after': 'admin_state: drain\n',
        'before_header': 'vllm/a (before)',
        'after_header': 'vllm/a (after)',
    }


# ---------------------------------------------------------------- set and wait, on a fake clock


class World:
    """HAProxy as recorded: each `show servers state` moves to the next step of steps (the last one repeats), and
    `show stat` answers from the same step; other commands answer from replies. The clock moves only by sleep."""

    def __init__(self, steps, replies=None, snapshots=SNAPSHOTS):
        self.steps = list(steps)
        self.snapshots = snapshots
        self.step = None
        self.replies = dict({'show backend': RECORDED['show backend']}, **(replies or {}))
        self.sent = []
        self.bounds = []
        self.sleeps = []
        self.now = 100.0

    def exchange(self, command, seconds):
        self.sent.append(command)
        self.bounds.append(seconds)
        if command.startswith('show servers state '):
            self.step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if command in self.replies:
            return self.replies[command]
        if command in self.snapshots[self.step or self.steps[0]]:
            return self.snapshots[self.step or self.steps[0]][command]
        if command.startswith('set server '):
            return RECORDED['set_replies']['set server vllm/a state ready']
        return RECORDED['errors'].get(command, RECORDED['errors']['bogus'])

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def control(self, backend='vllm', server='a'):
        return ServerControl(self.exchange, backend, server, clock=self.clock, sleep=self.sleep)

    def sets(self):
        return [command for command in self.sent if command.startswith('set ')]


def test_drain_waits_until_the_sessions_ended():
    world = World(['ready', 'draining', 'draining', 'draining', 'drained'])
    result = apply(world.control(), 'drain', wait=True, timeout=60, interval=2, check_mode=False)
    assert world.sets() == ['set server vllm/a state drain']
    assert world.sleeps == [2, 2, 2]
    assert result == {
        'changed': True,
        'previous': figures('ready', 'UP', **PASSED),
        'server': figures('drain', 'DRAIN', **PASSED),
        'elapsed': 6.0,
        'msg': 'vllm/a set from ready to drain; no session left after 6 s',
    }


def test_a_drained_server_is_left_alone_and_the_wait_still_happens():
    world = World(['draining', 'draining', 'draining', 'drained'])
    result = apply(world.control(), 'drain', wait=True, timeout=60, interval=1, check_mode=False)
    assert world.sets() == []
    assert (result['changed'], result['elapsed'], result['msg']) == (
        False,
        2.0,
        'vllm/a is already in admin state drain; no session left after 2 s',
    )


@pytest.mark.parametrize('state', ['drain', 'maint', 'ready'])
def test_check_mode_sends_no_set_and_does_not_wait(state):
    world = World(['draining'])
    result = apply(world.control(), state, wait=True, timeout=60, interval=1, check_mode=True)
    assert world.sets() == [] and world.sleeps == []
    expected = (
        'vllm/a is already in admin state drain' if state == 'drain' else 'vllm/a would be set from drain to ' + state
    )
    assert (result['changed'], result['msg'], result['elapsed']) == (state != 'drain', expected, 0.0)
    assert result['server'] == result['previous'] == figures('drain', 'DRAIN', sessions=1, **PASSED)


@pytest.mark.parametrize('start', ['maint', 'drained'])
def test_ready_waits_past_the_first_checks_for_up(start):
    world = World([start, 'leaving_maint', 'leaving_maint', 'ready'])
    result = apply(world.control(), 'ready', wait=True, timeout=60, interval=0.5, check_mode=False)
    assert world.sets() == ['set server vllm/a state ready']
    assert world.sleeps == [0.5, 0.5]
    assert result['server'] == figures('ready', 'UP', **PASSED)
    assert result['msg'] == 'vllm/a set from %s to ready; UP after 1 s' % result['previous']['admin_state']


def test_a_server_without_check_is_up_once_ready():
    world = World(['draining'])
    result = apply(world.control(server='c'), 'ready', wait=True, timeout=60, interval=1, check_mode=False)
    assert (result['changed'], result['server']['status'], world.sleeps) == (False, 'no check', [])


@pytest.mark.parametrize(
    'server, last_seen',
    [
        ('sick', 'status DOWN, last check L7STS (Layer7 wrong status: Service Unavailable)'),
        ('f', 'status DOWN, last check L4CON (Layer4 connection problem: Connection refused)'),
        ('e', 'status UP 1/3, last check INI (Initializing)'),
    ],
)
def test_ready_that_never_comes_up_fails_at_the_timeout_with_the_last_check(server, last_seen):
    world = World(['draining'])
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(server=server), 'ready', wait=True, timeout=5, interval=2, check_mode=False)
    assert failed.value.msg == 'timed out after 5 s waiting for vllm/%s to be UP: %s' % (server, last_seen)
    assert world.sleeps == [2, 2, 1]
    assert failed.value.details['elapsed'] == 5.0
    assert failed.value.details['changed'] is False
    assert failed.value.details['previous'] == failed.value.details['server']


def test_a_check_under_way_keeps_the_finished_checks_detail_in_the_timeout():
    # HAProxy empties last_chk as a check starts and keeps the finished one's status (src/check.c): the recorded
    # sick row as HAProxy shows it then, marked by hand.
    finished = SNAPSHOTS['draining'][STAT_VLLM]
    under_way = finished.replace(',L7STS,503,', ',* L7STS,503,', 1).replace(',Service Unavailable,', ',,', 1)
    assert under_way.count(',* L7STS,503,') == 1 and 'Service Unavailable' not in under_way
    checking = dict(SNAPSHOTS['draining'], **{STAT_VLLM: under_way})
    world = World(['draining', 'draining', 'checking'], snapshots=dict(SNAPSHOTS, checking=checking))
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(server='sick'), 'ready', wait=True, timeout=2, interval=1, check_mode=False)
    assert failed.value.msg == (
        'timed out after 2 s waiting for vllm/sick to be UP: status DOWN, last check L7STS (Layer7 wrong status: '
        'Service Unavailable)'
    )
    assert failed.value.details['server']['check_running'] is True


def test_a_drain_that_never_ends_fails_at_the_timeout_with_the_sessions_left():
    world = World(['ready', 'draining'])
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(), 'drain', wait=True, timeout=2.5, interval=1, check_mode=False)
    assert failed.value.msg == (
        'timed out after 2.5 s waiting for the sessions on vllm/a to end: 1 session still open, 0 requests queued '
        '(status DRAIN)'
    )
    assert failed.value.details == {
        'changed': True,
        'previous': figures('ready', 'UP', **PASSED),
        'server': figures('drain', 'DRAIN', sessions=1, **PASSED),
        'elapsed': 2.5,
    }


def test_without_wait_the_server_is_read_once_after_the_set():
    world = World(['ready', 'draining', 'drained'])
    result = apply(world.control(), 'drain', wait=False, timeout=60, interval=1, check_mode=False)
    assert world.sleeps == []
    assert result['server'] == figures('drain', 'DRAIN', sessions=1, **PASSED)
    assert result['msg'] == 'vllm/a set from ready to drain; not waited for'


def test_each_exchange_gets_what_is_left_of_the_timeout_and_the_wait_ends_with_it():
    world = World(['ready', 'draining'])
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(), 'drain', wait=True, timeout=12, interval=4, check_mode=False)
    # The first read, the set and its read-back at most 10 s each; the wait's reads what is left of the 12 s; none
    # once nothing is.
    assert world.bounds == [10, 10, 10, 10, 10, 8, 8, 4, 4]
    assert world.sleeps == [4, 4, 4]
    assert failed.value.msg == (
        'timed out after 12 s waiting for the sessions on vllm/a to end: 1 session still open, 0 requests queued '
        '(status DRAIN)'
    )
    assert (failed.value.details['elapsed'], failed.value.details['changed']) == (12.0, True)


@pytest.mark.parametrize('wait', [True, False])
def test_a_set_that_does_not_take_hold_fails_with_the_state_read_back(wait):
    world = World(['ready'])
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(), 'drain', wait=wait, timeout=60, interval=1, check_mode=False)
    assert failed.value.msg == (
        "HAProxy did not take 'set server vllm/a state drain': vllm/a is in admin state ready (status UP) after it"
    )
    # No server figures: the role's drain takes a failure that has them for a wait that ran out, and goes on.
    assert failed.value.details == {'changed': False, 'previous': figures('ready', 'UP', **PASSED)}
    assert world.sleeps == []


@pytest.mark.parametrize(
    'backend, server, msg',
    [
        ('vllm', 'zz', "HAProxy backend 'vllm' has no server 'zz'; its servers: " + SERVERS),
        ('nope', 'a', "HAProxy has no backend 'nope'; its backends: vllm, other"),
    ],
)
def test_unknown_names_fail_with_what_there_is(backend, server, msg):
    world = World(['ready'], replies={'show servers state nope': RECORDED['errors']['show servers state nope']})
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(backend, server), 'drain', wait=True, timeout=60, interval=1, check_mode=False)
    assert failed.value.msg == msg
    assert world.sets() == []


@pytest.mark.parametrize(
    'command, reply, msg',
    [
        (
            'set server vllm/a state drain',
            RECORDED['level_user']['set server vllm/a state drain'],
            "HAProxy's runtime API answered 'set server vllm/a state drain' with: Permission denied",
        ),
        (
            'set server vllm/a state drain',
            RECORDED['errors']['set server vllm/zz state drain'],
            "HAProxy's runtime API answered 'set server vllm/a state drain' with: No such server.",
        ),
        (
            STAT_VLLM,
            RECORDED['errors']['show stat nope 4 -1'],
            "HAProxy's runtime API answered 'show stat vllm 4 -1' with: No such proxy.",
        ),
        (
            STATE_VLLM,
            RECORDED['errors']['bogus'],
            "HAProxy's runtime API answered 'show servers state vllm' with: Unknown command, but maybe one of the "
            'following ones is a better match: show fd [num] : dump list of file descriptors in use or a specific one '
            'show libs : show loaded object files and libraries show pools : report information about the memory pools '
            'usage show sess [id] : report the list of current s... (204 more characters)',
        ),
        (STAT_VLLM, '', "HAProxy's runtime API answered 'show stat vllm 4 -1' with: (nothing)"),
    ],
    ids=['permission', 'no-such-server', 'no-such-proxy', 'unknown-command', 'empty'],
)
def test_error_replies_fail_quoting_the_reply_and_the_command(command, reply, msg):
    world = World(['ready'], replies={command: reply})
    with pytest.raises(HAProxyFailed) as failed:
        apply(world.control(), 'drain', wait=True, timeout=60, interval=1, check_mode=False)
    assert failed.value.msg == msg


# ---------------------------------------------------------------- the socket, for real


def serve_once(path, reply, answer=True):
    """A Unix socket at path that reads one command and answers reply, then closes (as HAProxy does)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    received = []

    def run():
        connection, _address = listener.accept()
        with connection:
            received.append(connection.recv(4096))
            if answer:
                connection.sendall(reply)
            else:
                connection.recv(4096)  # until the client gives up
        listener.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return received, thread


def test_a_command_goes_out_on_its_line_and_the_reply_is_read_to_the_close(tmp_path):
    path = tmp_path / 'admin.sock'
    received, thread = serve_once(path, RECORDED['show backend'].encode())
    assert RuntimeApi(str(path))('show backend', 5) == '# name\nvllm\nother\n\n'
    thread.join(5)
    assert received == [b'show backend\n']


def test_a_reply_that_does_not_end_fails_at_the_exchange_timeout(tmp_path):
    path = tmp_path / 'admin.sock'
    serve_once(path, b'', answer=False)
    with pytest.raises(HAProxyFailed) as failed:
        RuntimeApi(str(path))('show backend', 0.2)
    assert failed.value.msg == (
        "cannot use the HAProxy runtime API socket %s: no complete answer to 'show backend' within 0.2 s" % path
    )


def test_a_reply_too_long_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_haproxy, 'MAX_REPLY_BYTES', 10)
    path = tmp_path / 'admin.sock'
    serve_once(path, b'x' * 11)
    with pytest.raises(HAProxyFailed) as failed:
        RuntimeApi(str(path))('show backend', 5)
    assert failed.value.msg == (
        "cannot use the HAProxy runtime API socket %s: the answer to 'show backend' is longer than 10 bytes" % path
    )


def unlistened_socket(path):
    """A socket file that nothing listens on: what HAProxy's stopped process leaves behind."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()


@pytest.mark.parametrize(
    'make, cause',
    [
        (lambda path: None, 'No such file or directory'),
        (lambda path: path.write_text(''), 'it is a regular file, not a socket'),
        (lambda path: path.mkdir(), 'it is a directory, not a socket'),
        (lambda path: os.mkfifo(str(path)), 'it is a FIFO, not a socket'),
        (unlistened_socket, 'Connection refused (no HAProxy listens on it)'),
    ],
    ids=['missing', 'file', 'directory', 'fifo', 'refused'],
)
def test_a_socket_that_cannot_be_used_is_named_with_the_cause(tmp_path, make, cause):
    path = tmp_path / 'admin.sock'
    make(path)
    with pytest.raises(HAProxyFailed) as failed:
        RuntimeApi(str(path))('show backend', 5)
    assert failed.value.msg == 'cannot use the HAProxy runtime API socket %s: %s' % (path, cause)
