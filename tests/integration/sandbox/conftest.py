# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Fixtures for the fault scenarios on a sandbox host where the deploy already ran.

They run inside `molecule verify` (make molecule), on the sandbox molecule
converged, so no second sandbox and no second vLLM install are needed.  To run
them by hand against the demo sandbox after `make demo`:

    LLMSERVE_SANDBOX_INVENTORY=inventories/sandbox .venv/bin/pytest tests/integration/sandbox
"""

import os
import re
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

# The helpers sit next to this file, which is no package (tests/ has no __init__.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox_helpers import INVENTORY, SANDBOX_VARS, Sandbox  # noqa: E402

# make test's default scenario converges while the models lane still trains the failing revisions, and the fake
# Hub serves each once it is made (mk/sandbox.mk, fakehub-early): the tests wait for all before the first runs.
REVISIONS_TIMEOUT = 1200


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    skip = pytest.mark.skip(
        reason='needs a deployed sandbox host: runs in `molecule verify` (make molecule), '
        'or set LLMSERVE_SANDBOX_INVENTORY=inventories/sandbox after `make demo`'
    )
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(pytest.mark.sandbox)
            if not INVENTORY:
                item.add_marker(skip)


@pytest.fixture(scope='session')
def sandbox():
    return Sandbox(INVENTORY)


@pytest.fixture(scope='session', autouse=True)
def hub_serves_every_revision():
    """Waits until the fake Hub serves every revision the sandbox inventory documents."""
    if not INVENTORY:
        return
    with open(SANDBOX_VARS) as f:
        text = f.read()
    endpoint = yaml.safe_load(text)['vllm_kimi_hf_endpoint']
    repo = yaml.safe_load(text)['vllm_kimi_model_repo']
    waiting = set(re.findall(r'^#   [a-z-]+: ([0-9a-f]{40}) ', text, re.M))
    deadline = time.monotonic() + REVISIONS_TIMEOUT
    while waiting and time.monotonic() < deadline:
        for commit in sorted(waiting):
            try:
                urllib.request.urlopen('%s/api/models/%s/revision/%s' % (endpoint, repo, commit), timeout=10).close()
                waiting.discard(commit)
            except (urllib.error.URLError, OSError):
                pass
        if waiting:
            time.sleep(2)
    assert not waiting, 'the fake Hub at %s did not serve revisions %s of %s within %d s' % (
        endpoint,
        ', '.join(sorted(waiting)),
        repo,
        REVISIONS_TIMEOUT,
    )
