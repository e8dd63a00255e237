# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""tools/stages.py ends a run with what failed: CI shows a run's last lines, so they must name the failing test."""

import os
import stat
import subprocess
import sys

from ansible_collections.llmserve.vllm.tests.support import REPO

STAGES = os.path.join(REPO, 'tools', 'stages.py')
# A stage's log as molecule's verify writes it through this tool: minutes, molecule's frame, colours, wrapped lines.
MOLECULE_LOG = (
    '[+5:23]   \x1b[2m\u2502\x1b[0m PLAY RECAP\n'
    '[+23:57]   \x1b[2m\u2502\x1b[0m tests/integration/sandbox/test_front_door.py ....F...\n'
    '[+23:57]   \x1b[2m\u2502\x1b[0m E       AssertionError: (66, 4.2)\n'
    '[+23:57]   \x1b[2m\u2502\x1b[0m E       assert 66 <= 64\n'
    '[+23:57]   \x1b[2m\u2502\x1b[0m FAILED tests/integration/sandbox/test_front_door.py::test_a_burst_past - Ass\n'
    '[+23:57]   \x1b[2m\u2502\x1b[0m ======================= 1 failed, 138 passed in 1113.79s\n'
    '[+24:14] \x1b[36mINFO    \x1b[0m default \u279c verify: Executed: Failed\n'
)


def test_the_lines_that_name_a_failure_are_picked_out_of_a_molecule_log():
    sys.path.insert(0, os.path.dirname(STAGES))
    try:
        import stages
    finally:
        sys.path.pop(0)
    assert stages.failure_lines(MOLECULE_LOG) == [
        'E       AssertionError: (66, 4.2)',
        'E       assert 66 <= 64',
        'FAILED tests/integration/sandbox/test_front_door.py::test_a_burst_past - Ass',
    ]
    many = '\n'.join('[+0:01] fatal: [h%d]: FAILED! => {}' % number for number in range(50))
    assert stages.failure_lines(many, limit=3) == [
        'fatal: [h0]: FAILED! => {}',
        'fatal: [h1]: FAILED! => {}',
        'fatal: [h2]: FAILED! => {}',
        '... and 47 more such lines',
    ]

    # A linter's own format: the log's last lines, make's message of the recipe among them.
    yamllint = (
        '[+0:00] /work/ci/.venv/bin/yamllint -s .\n[+0:04] ./changelogs/changelog.yaml\n'
        '[+0:04]   6:7       error    wrong indentation: expected 8 but found 6  (indentation)\n'
        '[+0:05] \n[+0:05] make[1]: *** [Makefile:107: lint] Error 1\n'
    )
    assert stages.failure_lines(yamllint)[-3:] == [
        './changelogs/changelog.yaml',
        '6:7       error    wrong indentation: expected 8 but found 6  (indentation)',
        'make[1]: *** [Makefile:107: lint] Error 1',
    ]


def test_a_run_ends_with_what_failed_after_the_table(tmp_path):
    fake_make = tmp_path / 'make'
    fake_make.write_text(
        '#!/bin/sh\n'
        'case "$2" in\n'
        '  good) echo all fine ;;\n'
        "  bad) printf 'collected 2 items\\nFAILED tests/t.py::test_b - assert 1 == 2\\n'; exit 2 ;;\n"
        'esac\n'
    )
    fake_make.chmod(fake_make.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run(
        [sys.executable, STAGES, '--lane', 'good bad', '--make', str(fake_make)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    tail = proc.stdout[proc.stdout.index('Stage times') :]
    assert tail.endswith(
        '\n== what failed in bad (.build/stages/bad.log) ==\nFAILED tests/t.py::test_b - assert 1 == 2\n'
    ), tail
    assert 'good' not in tail[tail.index('== what failed') :]


def test_the_table_tells_a_stage_that_computes_from_one_that_waits(tmp_path):
    fake_make = tmp_path / 'make'
    burn = 'import time; t = time.process_time()\nwhile time.process_time() - t < 2: pass'
    fake_make.write_text(
        '#!/bin/sh\ncase "$2" in\n  computes) "%s" -c "%s" ;;\n  waits) sleep 2 ;;\nesac\n' % (sys.executable, burn)
    )
    fake_make.chmod(fake_make.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run(
        [sys.executable, STAGES, '--lane', 'computes', '--lane', 'waits', '--make', str(fake_make)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = dict(line.split()[1:4:2] for line in proc.stdout.splitlines() if line.split()[-1:] == ['passed'])
    # lane, stage, wall, CPU, verdict: the CPU column of each stage.
    assert rows == {'computes': '0:02', 'waits': '0:00'}, proc.stdout
