# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""llmserve.vllm.haproxy_server as Ansible runs it (ad hoc, the module shipped to localhost), against a real HAProxy
(/usr/sbin/haproxy, in the foreground) in front of two local HTTP replicas with HTTP health checks.

tests/unit/plugins/module_utils/test__haproxy.py covers the replies' parsing and the wait on a fake clock.
"""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from ansible_collections.llmserve.vllm.tests.support import COLLECTIONS_PATH, REPO, free_port

HAPROXY = '/usr/sbin/haproxy'
pytestmark = pytest.mark.skipif(
    not os.path.exists(HAPROXY), reason='needs HAProxy at %s (Debian package haproxy)' % HAPROXY
)
# The ansible-core beside this interpreter, and this interpreter on the "host": discovery may find a pyenv shim.
ANSIBLE = os.path.join(os.path.dirname(sys.executable), 'ansible')
CONFIG = """global
    stats socket {socket} mode 600 level admin
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
frontend fe
    bind 127.0.0.1:{port}
    default_backend vllm
backend vllm
    balance roundrobin
    option httpchk GET /health
    default-server check inter 200ms fall 2 rise 2
    server a 127.0.0.1:{a}
    server b 127.0.0.1:{b}
"""
# What the slow request's answer is: long enough to come in several reads.
SLOW_BODY_LINES = 20000
# Seconds the slow answer takes once released; the test holds it until the drain is set, since Ansible's own start
# takes seconds on a loaded machine.
SLOW_SECONDS = 3


class Handler(http.server.BaseHTTPRequestHandler):
    """/health answers 200, or 503 once the replica is sick; /slow answers once released; anything else at once.
    Every answer names the replica."""

    def do_GET(self):
        replica = self.server
        if self.path == '/health':
            self.answer(503 if replica.sick else 200, b'')
            return
        if self.path == '/slow':
            replica.release.wait(60)
            time.sleep(SLOW_SECONDS)
            self.answer(200, ('%s slow\n' % replica.name).encode() * SLOW_BODY_LINES)
            return
        self.answer(200, ('%s\n' % replica.name).encode())

    def answer(self, status, body):
        self.send_response(status)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

    def handle(self):
        try:
            super().handle()
        except ConnectionError:
            pass  # HAProxy's checks close once they read the status line


def start_replica(name):
    replica = http.server.ThreadingHTTPServer(('127.0.0.1', free_port()), Handler)
    replica.name = name
    replica.sick = False
    replica.release = threading.Event()
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    return replica


class HAProxy:
    """A foreground HAProxy on its config in directory, with the test's own reads of its runtime API."""

    def __init__(self, directory):
        self.socket = str(directory / 'admin.sock')
        self.port = free_port()
        self.replicas = {name: start_replica(name) for name in ('a', 'b')}
        config = directory / 'haproxy.cfg'
        config.write_text(
            CONFIG.format(
                socket=self.socket,
                port=self.port,
                **{name: replica.server_address[1] for name, replica in self.replicas.items()},
            )
        )
        self.log = directory / 'haproxy.log'
        with open(str(self.log), 'w') as log:
            self.process = subprocess.Popen([HAPROXY, '-db', '-f', str(config)], stdout=log, stderr=log)
        self.until(lambda: all(self.stat(name)['status'] == 'UP' for name in self.replicas), 'both replicas UP')

    def cli(self, command):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(self.socket)
            sock.sendall(command.encode() + b'\n')
            reply = b''
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return reply.decode()
                reply += chunk

    def stat(self, server):
        """The server's row of `show stat` as a dict."""
        lines = self.cli('show stat vllm 4 -1').splitlines()
        header = lines[0][2:].split(',')
        rows = (dict(zip(header, line.split(','))) for line in lines[1:] if line)
        return next(row for row in rows if row['svname'] == server)

    def until(self, condition, what, seconds=30):
        deadline = time.monotonic() + seconds
        while True:
            try:
                if condition():
                    return
            except (OSError, IndexError):
                pass  # HAProxy not listening yet
            assert time.monotonic() < deadline, 'no %s within %d s; HAProxy logged: %s' % (
                what,
                seconds,
                self.log.read_text(),
            )
            time.sleep(0.05)

    def get(self, path):
        with urllib.request.urlopen('http://127.0.0.1:%d%s' % (self.port, path), timeout=60) as answer:
            return answer.read().decode()

    def close(self):
        self.process.terminate()
        self.process.wait(10)
        for replica in self.replicas.values():
            replica.release.set()
            replica.shutdown()
            replica.server_close()


@pytest.fixture
def haproxy(tmp_path):
    balancer = HAProxy(tmp_path)
    yield balancer
    balancer.close()


def ansible_argv(args, *flags):
    return [
        ANSIBLE,
        'localhost',
        '-i',
        'localhost,',
        '-c',
        'local',
        '-e',
        'ansible_python_interpreter=' + sys.executable,
        '-m',
        'llmserve.vllm.haproxy_server',
        '-a',
        json.dumps(args),
    ] + list(flags)


ANSIBLE_ENV = dict(
    os.environ,
    ANSIBLE_COLLECTIONS_PATH=COLLECTIONS_PATH,
    # One line per host with the module's result as JSON, the diff printed before it.
    ANSIBLE_STDOUT_CALLBACK='minimal',
    ANSIBLE_CALLBACK_RESULT_FORMAT='json',
    ANSIBLE_NOCOLOR='1',
    ANSIBLE_DEPRECATION_WARNINGS='0',
    PYTHONWARNINGS='ignore',
    no_proxy='127.0.0.1,localhost',
)
RESULT = re.compile(r'^localhost \| (SUCCESS|CHANGED|FAILED!) => ', re.MULTILINE)


def start_module(args, *flags):
    return subprocess.Popen(
        ansible_argv(args, *flags), cwd=REPO, env=ANSIBLE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process):
    """(result, stdout) of an ad hoc run; its result is the JSON after the host's line."""
    stdout, stderr = process.communicate(timeout=120)
    found = RESULT.search(stdout)
    assert found, stdout + stderr
    result, _end = json.JSONDecoder().raw_decode(stdout[found.end() :])
    # The minimal callback says FAILED! where the result's own 'failed' key was.
    result['failed'] = found.group(1) == 'FAILED!'
    return result, stdout


def run(args, *flags):
    return finish(start_module(args, *flags))


def test_drain_returns_once_the_answer_in_flight_reached_its_client(haproxy):
    answers = {}

    def client():
        answers['body'] = haproxy.get('/slow')
        answers['at'] = time.monotonic()

    reader = threading.Thread(target=client)
    reader.start()
    haproxy.until(lambda: any(haproxy.stat(name)['scur'] == '1' for name in 'ab'), 'session on a replica')
    busy = next(name for name in 'ab' if haproxy.stat(name)['scur'] == '1')
    other = 'b' if busy == 'a' else 'a'
    module = start_module({'socket': haproxy.socket, 'backend': 'vllm', 'server': busy, 'state': 'drain', 'sleep': 0.2})
    haproxy.until(lambda: haproxy.stat(busy)['status'] == 'DRAIN', 'DRAIN of ' + busy)

    # While draining, new requests go to the other replica, and the module waits for the answer in flight.
    assert [haproxy.get('/') for request in range(4)] == ['%s\n' % other] * 4
    time.sleep(1)
    assert module.poll() is None, 'the module returned while a response was in flight'
    haproxy.replicas[busy].release.set()
    result, _stdout = finish(module)
    ended = time.monotonic()
    reader.join(10)

    assert answers['body'] == '%s slow\n' % busy * SLOW_BODY_LINES
    assert answers['at'] <= ended
    assert (result['failed'], result['changed']) == (False, True)
    assert (result['previous']['admin_state'], result['previous']['sessions']) == ('ready', 1)
    assert (result['server']['admin_state'], result['server']['status'], result['server']['sessions']) == (
        'drain',
        'DRAIN',
        0,
    )
    assert result['elapsed'] >= 1 + SLOW_SECONDS
    assert result['msg'].startswith('vllm/%s set from ready to drain; no session left after ' % busy)

    again, _stdout = run({'socket': haproxy.socket, 'backend': 'vllm', 'server': busy, 'state': 'drain'})
    assert (again['changed'], again['msg']) == (
        False,
        'vllm/%s is already in admin state drain; no session left after 0 s' % busy,
    )


def test_maint_then_ready_four_ways(haproxy):
    """Check mode, check and diff mode, the real run, the same run again, for maint and back to ready."""
    for state, status in (('maint', 'MAINT'), ('ready', 'UP')):
        args = {'socket': haproxy.socket, 'backend': 'vllm', 'server': 'a', 'state': state, 'sleep': 0.2}
        before = haproxy.stat('a')['status']
        checked, _stdout = run(args, '--check')
        assert (checked['failed'], checked['changed'], checked['elapsed']) == (False, True, 0.0)
        assert haproxy.stat('a')['status'] == before
        diffed, stdout = run(args, '--check', '--diff')
        assert diffed['changed'] is True
        previous = 'ready' if state == 'maint' else 'maint'
        assert '-admin_state: %s\n+admin_state: %s\n' % (previous, state) in stdout
        assert haproxy.stat('a')['status'] == before

        changed, _stdout = run(args)
        assert (changed['failed'], changed['changed'], changed['server']['status']) == (False, True, status)
        assert haproxy.stat('a')['status'] == status
        again, _stdout = run(args)
        assert (again['changed'], again['server']['status']) == (False, status)


def test_ready_waits_for_the_health_check_to_see_the_replica_up(haproxy):
    args = {'socket': haproxy.socket, 'backend': 'vllm', 'server': 'b', 'sleep': 0.05}
    run(dict(args, state='maint'))
    result, _stdout = run(dict(args, state='ready'))
    # Out of maintenance a server is "UP 1/2" until its first check passes; the module waited past it.
    assert (result['changed'], result['server']['status'], result['server']['check_status']) == (True, 'UP', 'L7OK')
    assert result['elapsed'] > 0


def test_ready_on_a_replica_whose_health_check_fails_fails_at_the_timeout(haproxy):
    args = {'socket': haproxy.socket, 'backend': 'vllm', 'server': 'b', 'sleep': 0.2}
    run(dict(args, state='maint'))
    haproxy.replicas['b'].sick = True
    result, _stdout = run(dict(args, state='ready', timeout=3))
    assert result['failed'] is True and result['changed'] is True
    # HAProxy adds the reply's reason to the check's description only where its last check read one: which of its
    # reads the timeout meets decides (on a loaded machine the shorter one came, 2026-12-07). The code is its own.
    assert re.fullmatch(
        r'timed out after 3 s waiting for vllm/b to be UP: status DOWN, last check L7STS '
        r'\(Layer7 wrong status(: Service Unavailable)?\)',
        result['msg'],
    ), result['msg']
    # The timeout bounds the whole run: the wait has what the reads and the set before it left.
    assert 2.5 <= result['elapsed'] < 5
    assert result['server']['check_code'] == 503


@pytest.mark.parametrize(
    'backend, server, msg',
    [
        ('vllm', 'c', "HAProxy backend 'vllm' has no server 'c'; its servers: a, b"),
        ('vllm2', 'a', "HAProxy has no backend 'vllm2'; its backends: vllm"),
    ],
)
def test_unknown_names_fail_with_what_haproxy_has(haproxy, backend, server, msg):
    result, _stdout = run({'socket': haproxy.socket, 'backend': backend, 'server': server, 'state': 'drain'})
    assert (result['failed'], result['changed'], result['msg']) == (True, False, msg)


def test_a_socket_that_is_missing_or_no_socket_is_named(tmp_path):
    plain = tmp_path / 'admin.sock'
    plain.write_text('')
    for path, cause in (
        (tmp_path / 'missing.sock', 'No such file or directory'),
        (plain, 'it is a regular file, not a socket'),
    ):
        result, _stdout = run({'socket': str(path), 'backend': 'vllm', 'server': 'a', 'state': 'drain'})
        assert (result['failed'], result['msg']) == (
            True,
            'cannot use the HAProxy runtime API socket %s: %s' % (path, cause),
        )
