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
import sys

import pytest

# The helpers sit next to this file, which is no package (tests/ has no __init__.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox_helpers import INVENTORY, Sandbox  # noqa: E402


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
