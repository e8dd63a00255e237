# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Judge a module run on bad input: every case ends in exactly one outcome.

Good outcomes: CLEAN_ERROR (the module failed with a message, no traceback) and
CORRECT_SUCCESS (it succeeded and the case's own check of the result holds).
Everything else is a defect: TRACEBACK (an uncaught exception, or output that is
no module result), HANG (the run outlived its deadline), WRONG_SUCCESS (success
where the input should have been refused, or a wrong result), WRONG_ERROR (a
refusal of good input), LEAK (a secret anywhere in the output) and STRAY_FILE
(something left behind that the case says must not be).
"""

from ansible_collections.llmserve.vllm.tests import support

# The one module runner of the tests, under the names the adversarial cases use.
COLLECTIONS_PATH = support.COLLECTIONS_PATH
Run = support.Run
run_module = support.run_module

CLEAN_ERROR = 'clean error'
CORRECT_SUCCESS = 'correct success'
TRACEBACK = 'traceback'
HANG = 'hang'
WRONG_SUCCESS = 'wrong success'
WRONG_ERROR = 'wrong error'
LEAK = 'leak'
STRAY_FILE = 'stray file'
GOOD = (CLEAN_ERROR, CORRECT_SUCCESS)
OUTCOMES = (CLEAN_ERROR, CORRECT_SUCCESS, TRACEBACK, HANG, WRONG_SUCCESS, WRONG_ERROR, LEAK, STRAY_FILE)


def judge(run, expect_success, check=None, secrets=(), stray=()):
    """The one outcome of a run.

    expect_success: whether the input deserves a success.  check(result): for a
    success, True when the result is right; for a failure, True when the message
    names what it must (the file or value and the cause).  secrets: strings that
    must appear nowhere in the output.  stray: paths found left behind.
    """
    raw = run.stdout + run.stderr
    if any(secret.encode('utf-8') in raw for secret in secrets if secret):
        return LEAK
    if run.hung:
        return HANG
    if run.result is None or 'exception' in run.result or 'MODULE FAILURE' in str(run.result.get('msg', '')):
        return TRACEBACK
    if stray:
        return STRAY_FILE
    failed = bool(run.result.get('failed'))
    if not failed:
        if not expect_success:
            return WRONG_SUCCESS
        return CORRECT_SUCCESS if check is None or check(run.result) else WRONG_SUCCESS
    if expect_success or not run.result.get('msg'):
        return WRONG_ERROR
    return CLEAN_ERROR if check is None or check(run.result) else WRONG_ERROR
