# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Whose words a line of vLLM's journal holds: vLLM's own loggers', uvicorn's, systemd's, or those of a process's
output; and which of them a result may quote or read figures from.

PRIVATE to the collection: this is not a public API; it may change without notice.

Once vLLM's API is up, clients' words reach the journal: uvicorn's access lines carry a request's path and query (on
a Unix socket, --uds, without even the client's address before them), and vLLM's request logger (--enable-log-requests)
a prompt. A line of either may be written to look like vLLM's own ("Model loading took 9999 GiB", "ValueError: ...").
So a result quotes, and the start ledger reads, only:

- the lines of vLLM's own loggers, known by their shape (vllm/logger.py of 0.32: "(%(vllm_process_name)s
  pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s", the date "%m-%d %H:%M:%S",
  the file's name or its path shortened; before 0.8 without the bracket before the file, the process's part only
  where a process of vLLM's own wrote it), but the request logger's (its prompt, parameters, outputs);
- systemd's lines about the unit ("vllm.service: Main process exited, ...");
- any other line (a traceback, argparse's refusal, a progress bar) only until the run's API is up (uvicorn's
  "Application startup complete."): no client reaches vLLM before, and a new run (systemd's restart, vLLM's first
  lines) starts the count again.
"""

import re
from collections.abc import Iterable
from typing import Optional

# "(EngineCore_DP0 pid=600) ", "(VllmWorker-0 pid=8966) ": a process of vLLM's own, before each line it writes.
_PROCESS = r'(?:\([\w.-]+ pid=\d+\) )?'
_LEVEL = r'(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)'
_VLLM_PREFIX = re.compile(
    _PROCESS
    + _LEVEL
    + r' \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[?(?:[\w.-]+/)*(?P<file>[\w.-]+\.py):\d+\] ?(?P<message>.*)\Z'
)
# uvicorn's logger: "INFO:     Application startup complete.", 'INFO:     127.0.0.1:51234 - "GET /health HTTP/1.1" 200'.
_UVICORN = re.compile(_PROCESS + r'(?:TRACE|' + _LEVEL[3:-1] + r'):\s+(?P<message>.*)\Z')
API_READY_MESSAGE = 'Application startup complete.'
# vLLM's request logger writes a client's prompt, parameters and outputs: vllm/entrypoints/serve/utils/
# request_logger.py in 0.32, vllm/entrypoints/logger.py before.
_REQUEST_LOGGER_FILES = frozenset(('request_logger.py', 'logger.py'))
# The first lines vLLM's API server logs in a run (0.6 to 0.33).
_RUN_START_MESSAGES = ('vLLM API server version ', 'non-default args: ', 'args: Namespace(')
# systemd's lines about a unit, as `journalctl --output cat` shows them: "vllm.service: Main process exited, ...".
_SYSTEMD_UNIT_LINE = re.compile(r'[\w:.@\\-]+\.service: ')
# systemd starting the unit (again): a new run.
_SYSTEMD_RUN_START = re.compile(
    r'(?:Started|Starting) [\w:.@\\-]+\.service\b|[\w:.@\\-]+\.service: Scheduled restart job'
)


def vllm_message(line: str) -> Optional[str]:
    """The message of a line of vLLM's own loggers (its request logger's excepted), else None."""
    found = _VLLM_PREFIX.match(line.strip())
    if not found or found.group('file') in _REQUEST_LOGGER_FILES:
        return None
    return found.group('message').strip()


def is_api_ready(line: str) -> bool:
    """Whether the line is uvicorn's that vLLM's API is up."""
    found = _UVICORN.match(line.strip())
    return found is not None and found.group('message').strip() == API_READY_MESSAGE


def starts_a_run(line: str) -> bool:
    """Whether the line is one of a new run's: vLLM's API server's first lines, or systemd starting the unit."""
    message = vllm_message(line)
    if message is not None:
        return message.startswith(_RUN_START_MESSAGES)
    return bool(_SYSTEMD_RUN_START.match(line.strip()))


def _trusted(line: str, serving: bool) -> bool:
    """Whether a line other than uvicorn's that the API is up holds no client's words: vLLM's own (its request
    logger's excepted), systemd's about the unit, or, before the API is up, a line of no logger (a traceback)."""
    text = line.strip()
    if vllm_message(text) is not None or _SYSTEMD_UNIT_LINE.match(text):
        return True
    return not serving and not _UVICORN.match(text) and not _VLLM_PREFIX.match(text)


def quotable_lines(lines: Iterable[str], api_ready: bool = False) -> list[str]:
    """The lines a result may quote (the module's docstring says which); api_ready: uvicorn's line that the API is up
    as well (progress shows it)."""
    picked: list[str] = []
    serving = False
    for line in lines:
        if starts_a_run(line):
            serving = False
        if is_api_ready(line):
            serving = True
            if api_ready:
                picked.append(line)
        elif _trusted(line, serving):
            picked.append(line)
    return picked


def start_messages(lines: Iterable[str]) -> list[str]:
    """The messages of vLLM's own lines that tell its last run's start: from the run's first lines to its API's
    being up. Lines after it are left out (a client's words may be among them), and so are an earlier run's."""
    messages: list[str] = []
    serving = False
    for line in lines:
        if starts_a_run(line):
            messages, serving = [], False
        if is_api_ready(line):
            serving = True
            continue
        message = vllm_message(line)
        if message is not None and not serving:
            messages.append(message)
    return messages
