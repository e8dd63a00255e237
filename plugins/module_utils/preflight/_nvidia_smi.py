# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What nvidia-smi says of the GPUs and of the processes that hold their memory.

PRIVATE to the collection: this is not a public API; it may change without notice.
"""

import math
from collections.abc import Iterator
from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils._command import CommandTimeout
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError

NVIDIA_SMI_GPU_FIELDS = 'index,name,memory.total,memory.used,compute_cap,driver_version,uuid'
NVIDIA_SMI_APP_FIELDS = 'pid,process_name,used_memory,gpu_uuid'
# Asked apart from NVIDIA_SMI_GPU_FIELDS, so that a driver that cannot tell it only loses the warning.
NVIDIA_SMI_PERSISTENCE_FIELDS = 'uuid,persistence_mode'
# Larger figures are no GPU's (2**43 MiB is 8 EiB) and would overflow the float arithmetic of the plan.
MAX_SMI_NUMBER = 2**43
# Seconds each query may take: a healthy driver answers in well under one.
DEFAULT_NVIDIA_SMI_TIMEOUT = 30

# A GPU and a process on one, as parse_gpus() and parse_apps() give them.
Gpu = dict[str, Any]
App = dict[str, Any]


def _number(text: str) -> Optional[int]:
    """The integer nvidia-smi printed, or None for "[N/A]" and anything else that is no finite number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) else None


def _int(text: str, what: str, line: str, minimum: int = 0) -> int:
    value = _number(text)
    if value is None:
        raise PreflightError('nvidia-smi printed %s %r where a number was expected, in line: %s' % (what, text, line))
    if not minimum <= value <= MAX_SMI_NUMBER:
        bound = 'at least %d' % minimum if value < minimum else 'at most %d' % MAX_SMI_NUMBER
        raise PreflightError(
            'nvidia-smi printed %s %r where a number of %s was expected, in line: %s' % (what, text, bound, line)
        )
    return value


def _rows(text: str, fields: str, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, list[str]]]:
    """(line, its values) for each line of an answer in CSV but the blank ones and those that start with skip;
    a line without one value for each of fields is refused."""
    expected = len(fields.split(','))
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(skip):
            continue
        cols = [c.strip() for c in line.split(',')]
        if len(cols) != expected:
            raise PreflightError(
                'nvidia-smi printed %d fields where %d (%s) were expected, in line: %s'
                % (len(cols), expected, fields, line)
            )
        yield line, cols


def parse_gpus(text: str) -> list[Gpu]:
    """nvidia-smi --query-gpu=NVIDIA_SMI_GPU_FIELDS --format=csv,noheader,nounits -> list of dicts."""
    return [
        {
            'index': _int(cols[0], 'index', line),
            'name': cols[1],
            'memory_total_mib': _int(cols[2], 'memory.total', line, minimum=1),
            'memory_used_mib': _int(cols[3], 'memory.used', line),
            'compute_capability': cols[4],
            'driver_version': cols[5],
            'uuid': cols[6],
        }
        for line, cols in _rows(text, NVIDIA_SMI_GPU_FIELDS)
    ]


def parse_apps(text: str) -> list[App]:
    """nvidia-smi --query-compute-apps=NVIDIA_SMI_APP_FIELDS --format=csv,noheader,nounits -> list of dicts."""
    apps = []
    for line, cols in _rows(text, NVIDIA_SMI_APP_FIELDS, skip=('No running',)):
        used = _number(cols[2])  # None for "[N/A]" or "[Insufficient Permissions]"
        if used is not None and not 0 <= used <= MAX_SMI_NUMBER:
            used = None
        apps.append(
            {'pid': _int(cols[0], 'pid', line), 'process_name': cols[1], 'used_memory_mib': used, 'gpu_uuid': cols[3]}
        )
    return apps


def parse_persistence(text: str) -> dict[str, str]:
    """nvidia-smi --query-gpu=NVIDIA_SMI_PERSISTENCE_FIELDS --format=csv,noheader,nounits -> {uuid: mode}, the mode
    as nvidia-smi prints it (Enabled, Disabled, [N/A])."""
    return {cols[0]: cols[1] for line, cols in _rows(text, NVIDIA_SMI_PERSISTENCE_FIELDS)}


def query_persistence(run: Callable[[list[str]], tuple[int, str, str]], nvidia_smi: str) -> dict[str, str]:
    """Each GPU's persistence mode by uuid, through run(argv) as query_nvidia_smi; PreflightError when unread."""
    argv = [nvidia_smi, '--query-gpu=' + NVIDIA_SMI_PERSISTENCE_FIELDS, '--format=csv,noheader,nounits']
    try:
        rc, out, err = run(argv)
    except (OSError, CommandTimeout) as exc:
        raise PreflightError('%s: %s' % (' '.join(argv), exc)) from exc
    if rc != 0:
        said = (err or '').strip() or (out or '').strip() or 'no output'
        raise PreflightError('%s failed with exit code %d: %s' % (' '.join(argv), rc, said))
    return parse_persistence(out)


def query_nvidia_smi(run: Callable[[list[str]], tuple[int, str, str]], nvidia_smi: str) -> tuple[list[Gpu], list[App]]:
    """Run nvidia-smi twice through run(argv) -> (rc, stdout, stderr), _command.run with a deadline; return (gpus, apps)."""
    results = []
    for query in ('--query-gpu=' + NVIDIA_SMI_GPU_FIELDS, '--query-compute-apps=' + NVIDIA_SMI_APP_FIELDS):
        argv = [nvidia_smi, query, '--format=csv,noheader,nounits']
        try:
            rc, out, err = run(argv)
        except OSError as exc:
            raise PreflightError(
                'cannot run %s: %s (is the NVIDIA driver installed? set nvidia_smi_path)'
                % (nvidia_smi, exc.strerror or exc)
            ) from exc
        except CommandTimeout as exc:
            raise PreflightError('%s: is the NVIDIA driver hung? (nvidia_smi_timeout sets the deadline)' % exc) from exc
        if rc < 0:
            raise PreflightError('%s was killed by signal %d' % (' '.join(argv), -rc))
        if rc != 0:
            said = (err or '').strip() or (out or '').strip() or 'no output'
            raise PreflightError('%s failed with exit code %d: %s' % (' '.join(argv), rc, said))
        results.append(out)
    return parse_gpus(results[0]), parse_apps(results[1])
