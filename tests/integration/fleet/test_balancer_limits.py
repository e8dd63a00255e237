# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The balancer holds without a key (docs/security.md): one host that opens HAProxy's maxconn-worth of connections,
half of them idle and half stopped inside their TLS ClientHello, keeps no other client from an answer.

sandbox-fleet-lb runs playbooks/balancer.yml at the vllm_haproxy role's defaults. The sandboxes share this machine's
network, where every 127.0.0.0/8 address is loopback: 127.0.0.3 is the host that holds connections, 127.0.0.2 the
client that asks, and the other fleet tests' clients (127.0.0.1) keep their own share. The test leaves no connection
behind, and the holder's rate entry in HAProxy's table expires 30 s later.

Runs in `molecule verify` of the fleet scenario (make molecule-fleet).
"""

import http.client
import json
import os
import resource
import select
import socket
import ssl
import subprocess
import sys
import time

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'sandbox'))
from sandbox_helpers import BIN, REPO, ansible_env  # noqa: E402

INVENTORY = os.environ.get('MOLECULE_INVENTORY_FILE')
pytestmark = pytest.mark.skipif(
    not (INVENTORY and os.environ.get('LLMSERVE_FLEET')),
    reason='needs the sandbox hosts of `molecule test -s fleet` (make molecule-fleet)',
)

BALANCER = 'sandbox-fleet-lb'
HAPROXY_DEFAULTS = os.path.join(REPO, 'roles', 'vllm_haproxy', 'defaults', 'main.yml')
SANDBOX_CA = os.path.join(REPO, '.cache', 'sandbox', 'ca', 'ca.pem')
HOLDER = '127.0.0.3'
CLIENT = '127.0.0.2'
# A TLS record header announcing a 512-byte handshake message (a ClientHello) of which nothing follows.
HALF_CLIENT_HELLO = b'\x16\x03\x01\x02\x00'
# The bound: another client has its answer within this many seconds.
ANSWER_WITHIN = 10
# Seconds HAProxy may take past its client timeout to close what is left (its timers' granularity, this loaded host).
CLOSE_SLACK = 3


@pytest.fixture(scope='module')
def balancer():
    """The balancer's settings (the role's defaults, then sandbox-fleet-lb's inventory) and a replica's API key."""
    listing = json.loads(
        subprocess.check_output([os.path.join(BIN, 'ansible-inventory'), '-i', INVENTORY, '--list'], env=ansible_env())
    )
    with open(HAPROXY_DEFAULTS) as handle:
        settings = yaml.safe_load(handle)
    settings.update(listing['_meta']['hostvars'][BALANCER])
    replica = sorted(listing['vllm']['hosts'])[0]
    settings['api_key'] = listing['_meta']['hostvars'][replica]['vllm_kimi_api_key']
    # One descriptor per held connection, and the test's own besides.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = settings['vllm_haproxy_max_connections'] + 1024
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    return settings


def hold(port, count):
    """count connections from HOLDER, every other one stopped inside its ClientHello; those the kernel took."""
    held = []
    for number in range(count):
        sock = socket.socket()
        sock.bind((HOLDER, 0))
        sock.settimeout(2)
        try:
            sock.connect(('127.0.0.1', port))
            if number % 2:
                sock.sendall(HALF_CLIENT_HELLO)
        except OSError:  # reset already, or left unanswered past a full listen queue: not held
            sock.close()
            continue
        held.append(sock)
    return held


def still_open(held):
    """The connections of held that HAProxy has not closed (nothing to read on them: no end, no reset)."""
    poller = select.poll()
    for sock in held:
        poller.register(sock, select.POLLIN)
    ended = {fd for fd, _event in poller.poll(0)}
    return [sock for sock in held if sock.fileno() not in ended]


def until(condition, seconds):
    """Seconds until condition() held, or None if it did not within seconds."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if condition():
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def ask(settings):
    """(status, seconds) of GET /v1/models through the balancer from CLIENT, over TLS with the sandbox's CA; the
    status is the error's text where no answer came."""
    start = time.monotonic()
    connection = http.client.HTTPSConnection(
        '127.0.0.1',
        settings['vllm_haproxy_port'],
        timeout=ANSWER_WITHIN,
        source_address=(CLIENT, 0),
        context=ssl.create_default_context(cafile=SANDBOX_CA),
    )
    try:
        connection.request('GET', '/v1/models', headers={'Authorization': 'Bearer ' + settings['api_key']})
        answer = connection.getresponse()
        answer.read()
        return answer.status, time.monotonic() - start
    except OSError as error:  # the balancer never finished our handshake, or never answered
        return '%s: %s' % (type(error).__name__, error), time.monotonic() - start
    finally:
        connection.close()


def test_a_host_holding_maxconn_worth_of_idle_and_half_open_connections_locks_no_other_client_out(balancer):
    share = balancer['vllm_haproxy_source_connections']
    held = hold(balancer['vllm_haproxy_port'], balancer['vllm_haproxy_max_connections'])
    # Each connection HAProxy kept goes once its handshake has been silent for the client timeout.
    released_by = time.monotonic() + balancer['vllm_haproxy_client_timeout'] + CLOSE_SLACK
    try:
        until(lambda: len(still_open(held)) <= share, 5)
        status, seconds = ask(balancer)
        holding = len(still_open(held))
        print('%s after %.2f s while %s held %d connections' % (status, seconds, HOLDER, holding))
        assert (status, seconds < ANSWER_WITHIN) == (200, True)

        # Past its share, HAProxy refused the holder before any handshake; the answer came while it held its share.
        assert holding == share, '%s held %d connections at once, its share is %d' % (HOLDER, holding, share)

        # Below its share again, the holder is still refused: it opened more than its rate in the last 10 s.
        kept = still_open(held)
        for sock in kept[: share // 2]:
            sock.close()
        kept = kept[share // 2 :]
        probe = hold(balancer['vllm_haproxy_port'], 1)
        held += probe
        assert until(lambda: not still_open(probe), 2) is not None, 'a connection past the rate was kept'

        released = until(lambda: not still_open(kept), released_by - time.monotonic())
        assert released is not None, '%d connections still open %.0f s after they were opened' % (
            len(still_open(kept)),
            balancer['vllm_haproxy_client_timeout'] + CLOSE_SLACK,
        )
    finally:
        for sock in held:
            sock.close()
