# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fixtures every test level shares (tests/support.py has them as plain functions too)."""

import os
import shutil

import pytest

from ansible_collections.llmserve.vllm.tests import support
from ansible_collections.llmserve.vllm.tests.fake_openai import FakeOpenAI

# Where a test lives says how it runs: the one map of folder to runner, longest folder first wins. Each test is
# marked with its runner (pytest.ini), so a target runs one with -m; CONTRIBUTING.md shows the map.
RUNNERS = {
    # make units (and make check): the pure logic, the modules as Ansible runs them, the roles' files.
    'tests/unit': 'unit',
    # make adversarial: bad input per module, judged by tests/adversarial/harness.py.
    'tests/adversarial': 'adversarial',
    # make integration: ansible-playbook and vLLM's CPU build on this machine (make check: those marked
    # neither vllm nor sandbox).
    'tests/integration': 'controller',
    # make molecule: molecule verify on the default scenario's deployed sandbox host.
    'tests/integration/sandbox': 'sandbox_host',
    # make molecule-fleet: molecule verify on the fleet's three sandbox hosts.
    'tests/integration/fleet': 'fleet',
    # make molecule: the default scenario's own testinfra checks, beside tests/integration/sandbox.
    'molecule/default/tests': 'sandbox_host',
}


def runner_of(path):
    """The runner of a test file's path (relative to the checkout), by the longest folder of RUNNERS it is in."""
    folders = [folder for folder in RUNNERS if path == folder or path.startswith(folder + '/')]
    if not folders:
        raise ValueError('%s is in no folder of RUNNERS (tests/conftest.py): put it where its runner is' % path)
    return RUNNERS[max(folders, key=len)]


def pytest_collection_modifyitems(config, items):
    for item in items:
        # The checkout is also reached through the collection link (.build/collections): compare real paths.
        path = os.path.relpath(os.path.realpath(str(item.fspath)), os.path.realpath(support.REPO)).replace(os.sep, '/')
        item.add_marker(getattr(pytest.mark, runner_of(path)))


@pytest.fixture(scope='session')
def repo():
    """The checkout's root directory."""
    return support.REPO


@pytest.fixture
def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return support.free_port()


@pytest.fixture
def fake_openai():
    """fake_openai(routes, port=0, tls=None, unix_socket=None) -> a FakeOpenAI server (tests/fake_openai.py) for this
    test, closed when it ends; over HTTPS with a LocalCA's server certificate when tls is one; on the Unix socket at
    the path unix_socket when given."""
    started = []

    def start(routes, port=0, tls=None, unix_socket=None):
        started.append(FakeOpenAI(routes, port, tls, unix_socket))
        return started[-1]

    yield start
    for server in started:
        server.close()


@pytest.fixture(scope='session')
def local_ca(tmp_path_factory):
    """A LocalCA (tests/support.py): a CA of the tests' own and a certificate it signed for 127.0.0.1."""
    return support.LocalCA(str(tmp_path_factory.mktemp('local-ca')))


@pytest.fixture(scope='session')
def other_ca(tmp_path_factory):
    """Another LocalCA, which did not sign local_ca's server certificate."""
    return support.LocalCA(str(tmp_path_factory.mktemp('other-ca')), name='llmserve other CA')


@pytest.fixture
def module_result(tmp_path):
    """module_result(module, args, path_prefix=None, timeout=120) -> (rc, result): a module run as Ansible runs it,
    in a directory of its own beside the test's files."""
    workdir = tmp_path / 'module-run'
    workdir.mkdir()

    def run(module, args, path_prefix=None, timeout=120):
        return support.module_result(module, workdir, args, path_prefix=path_prefix, timeout=timeout)

    return run


@pytest.fixture(scope='session')
def promtool():
    """promtool: $LLMSERVE_PROMTOOL (the Makefile sets it), the one `make promtool` unpacks, or one on PATH."""
    built = os.path.join(support.REPO, '.build', 'prometheus', 'usr', 'bin', 'promtool')
    for candidate in (os.environ.get('LLMSERVE_PROMTOOL'), built, shutil.which('promtool')):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "promtool is missing: run `make promtool` (it unpacks Debian's prometheus package into .build/prometheus) "
        'or set LLMSERVE_PROMTOOL to a promtool.'
    )
