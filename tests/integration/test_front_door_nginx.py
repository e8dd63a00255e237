# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The front door's rendered configuration run by the nginx the sandboxes install (Debian bookworm's, from the cached
sandbox tree of tools/sandbox), in a mount namespace of this test's own, on loopback, with nothing behind it: the
order of nginx's phases judged by nginx itself, without a sandbox or a vLLM.

1. The key on every path but /health, /invocations added included: 401 without it, passed on with it.
2. The key is checked after the client's limits: 300 wrong keys from one address meet 429 past the burst.
3. /metrics by the connection's own address: a client behind a trusted balancer that names a source is refused.
"""

import collections
import concurrent.futures
import http.client
import importlib.util
import os
import re
import ssl
import subprocess
import time

import pytest

from ansible_collections.llmserve.vllm.tests.certificates import write_pair
from ansible_collections.llmserve.vllm.tests.integration.test_role_render import GPU_VARS, REPO, render

# One nginx a module (its fixture): its tests run on one worker (make integration's --dist loadgroup).
pytestmark = pytest.mark.xdist_group('front_door_nginx')

KEY = 'sk-nginx-test-key-0123456789abcdef'
BALANCER = '127.0.0.5'
PATHS = ['/v1/chat/completions', '/v1/models', '/health', '/invocations']
REQUEST_BURST = 64
REQUESTS_PER_SECOND = 10
WRONG_KEY_SOURCE = '127.0.0.30'
WRONG_KEYS = 300


def sandbox_tree():
    """The sandbox tree tools/sandbox built (it holds nginx), or None where it has not been built here."""
    spec = importlib.util.spec_from_file_location('sandbox_tool', os.path.join(REPO, 'tools', 'sandbox.py'))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = tool.rootfs_path()
    return path if os.path.exists(os.path.join(path, '.complete')) else None


def local_config(front, port, directory):
    """The rendered configuration, served from directory on 127.0.0.1:port to an upstream nothing listens on."""
    replaced = [
        (r'include \S+front\.auth\.conf;', 'include %s/front.auth.conf;' % directory),
        (r'(?m)^user .*$', 'user nobody nogroup;'),
        (r'ssl_certificate \S+;', 'ssl_certificate %s/front.pem;' % directory),
        (r'ssl_certificate_key \S+;', 'ssl_certificate_key %s/front.key;' % directory),
        (r'_temp_path [^;]+;', '_temp_path %s/buffers;' % directory),
        (r'access_log syslog[^;]+;', 'access_log off;'),
        (r'listen \S+ ssl;', 'listen 127.0.0.1:%d ssl;' % port),
        (r'server unix:[^;]+;', 'server 127.0.0.1:1;'),
    ]
    for pattern, replacement in replaced:
        front, count = re.subn(pattern, replacement.replace('\\', '\\\\'), front)
        assert count >= 1, pattern
    return front


@pytest.fixture(scope='module')
def door(tmp_path_factory, free_port_module):
    tree = sandbox_tree()
    if tree is None or os.geteuid() != 0:
        pytest.skip(
            "needs the sandbox tree (tools/sandbox rootfs, make sandbox-up builds it) and root for nginx's mounts"
        )
    out = tmp_path_factory.mktemp('door')
    render(
        out,
        GPU_VARS,
        vault_vllm_kimi_api_key=KEY,
        vllm_kimi_front_paths=PATHS,
        vllm_kimi_front_trusted_proxies=[BALANCER],
        vllm_kimi_front_metrics_sources=['127.0.0.1'],
    )
    files = tmp_path_factory.mktemp('door-files')
    write_pair(files, 'front')
    (files / 'front.auth.conf').write_text((out / 'front.auth.conf').read_text())
    inside = '/tmp/llmserve-door'
    (files / 'nginx.conf').write_text(local_config((out / 'front.nginx.conf').read_text(), free_port_module, inside))
    # A tmpfs over the tree's /tmp in a mount namespace of its own: the cached tree is never written.
    script = (
        'mount -t tmpfs tmpfs "$1/tmp" && cp -R "$2" "$1%s" && exec chroot "$1" /usr/sbin/nginx -c %s/nginx.conf '
        % (
            inside,
            inside,
        )
    )
    script += "-e stderr -g 'pid %s/nginx.pid;'" % inside
    master = subprocess.Popen(
        ['unshare', '--mount', '--propagation', 'private', 'sh', '-c', script, 'door', tree, str(files)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and master.poll() is None:
        try:
            http.client.HTTPConnection('127.0.0.1', free_port_module, timeout=1).connect()
            break
        except OSError:
            time.sleep(0.2)
    assert master.poll() is None, master.communicate()[0]
    yield free_port_module
    master.terminate()
    master.wait(timeout=30)


@pytest.fixture(scope='module')
def free_port_module():
    from ansible_collections.llmserve.vllm.tests import support

    return support.free_port()


def ask(port, path, method='GET', key=None, source='127.0.0.1', headers=None, connection=None):
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    own = connection is None
    connection = connection or http.client.HTTPSConnection(
        '127.0.0.1', port, context=context, source_address=(source, 0), timeout=10
    )
    sent = dict(headers or {}, **({'Authorization': 'Bearer ' + key} if key else {}))
    try:
        connection.request(method, path, body='{}' if method == 'POST' else None, headers=sent)
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        if own:
            connection.close()


@pytest.mark.parametrize(
    'path, method', [('/invocations', 'POST'), ('/v1/chat/completions', 'POST'), ('/v1/models', 'GET')]
)
def test_every_path_but_health_needs_the_key(door, path, method):
    """Without the key 401 from the door; with it the request is passed on (503: nothing listens behind it)."""
    assert ask(door, path, method, source='127.0.0.20') == (401, b'{"error": "Unauthorized"}')
    assert ask(door, path, method, key=KEY, source='127.0.0.20')[0] == 503
    assert ask(door, '/health', source='127.0.0.20')[0] == 503
    # The key's own location is the door's alone.
    assert ask(door, '/@llmserve-key', source='127.0.0.20')[0] == 404


def test_wrong_keys_meet_the_clients_rate_limit(door):
    """300 wrong keys from one address, on six connections at once: past the burst only what the rate refilled while
    they were sent got 401, the others 429. A check in the rewrite phase (return 401, as the door had) answered all
    300 with 401."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    def send(first):
        connection = http.client.HTTPSConnection(
            '127.0.0.1', door, context=context, source_address=(WRONG_KEY_SOURCE, 0)
        )
        try:
            return [
                ask(door, '/v1/models', key='wrong-%d' % n, connection=connection)[0] for n in range(first, first + 50)
            ]
        finally:
            connection.close()

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = [status for part in pool.map(send, range(0, WRONG_KEYS, 50)) for status in part]
    seconds = time.monotonic() - started
    counted = collections.Counter(statuses)
    assert set(counted) == {401, 429}, counted
    # The burst and the request the bucket holds, and what the rate refilled meanwhile.
    assert counted[401] <= REQUEST_BURST + 2 + REQUESTS_PER_SECOND * seconds, (counted, seconds)


def test_metrics_by_the_connections_own_address(door):
    assert ask(door, '/metrics')[0] == 503
    assert ask(door, '/metrics', source='127.0.0.2')[0] == 403
    # The trusted balancer passes on a client that names a source; the client is still not one.
    assert ask(door, '/metrics', source=BALANCER, headers={'X-Forwarded-For': '127.0.0.1'})[0] == 403
