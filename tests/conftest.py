# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fixtures every test level shares (tests/support.py has them as plain functions too)."""

import os
import shutil

import pytest

from ansible_collections.llmserve.vllm.tests import support
from ansible_collections.llmserve.vllm.tests.fake_openai import FakeOpenAI


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
    """fake_openai(routes, port=0, tls=None) -> a FakeOpenAI server (tests/fake_openai.py) for this test, closed when
    it ends; over HTTPS with a LocalCA's server certificate when tls is one."""
    started = []

    def start(routes, port=0, tls=None):
        started.append(FakeOpenAI(routes, port, tls))
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
