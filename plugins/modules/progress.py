#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: progress
short_description: Wait a while for an async job and report how far a download or a vLLM start has come
version_added: 0.1.0
description:
  - Waits up to O(wait) seconds for an async job (a task run with C(async) and C(poll=0)) to end, then reports
    whether it ended and, while it runs, how far it has come, in one line (RV(msg)) that a loop's label can show.
  - It is how the role shows its long waits. A fetch of a 540 GB revision runs for hours and the load of a
    checkpoint that size for over 20 minutes; run as a loop with C(loop_control.break_when) on RV(finished) and
    C(loop_control.label) set to RV(msg), the play shows one line per O(wait) seconds, and none of them says
    C(FAILED) (an C(until) loop would print C(FAILED - RETRYING) for each expected state).
  - With O(download), the figures are read from the disk under O(download.path) (files in place, and the
    downloader's C(.incomplete) parts under C(.cache/huggingface/download)), against the manifest's totals, giving the
    bytes and files done, the rate over the last interval and an estimate of the time left.
  - With O(unit), the figures are read from the journal of the unit's current run (its C(InvocationID)), and name the
    phase of a vLLM start by its latest progress line (shards loaded out of all, weights loaded, KV cache
    allocated, CUDA graphs captured, the API server up), and for how long it has been in that phase. The report
    that sees the job ended names the phase the start reached, since a fast start passes several between reports.
  - The job's own result is not read; M(ansible.builtin.async_status) collects it once this module reports
    RV(finished).
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
options:
  results_file:
    description:
      - The C(results_file) that the async task returned, where Ansible's async wrapper writes the job's state.
      - A file longer than 1 MiB is taken for the job's result, unread (a running job's record is a few dozen
        bytes), so RV(finished) is V(true).
      - A link, a directory, a FIFO or a device in its place, or a file that cannot be read, fails the report with
        a message that names the path and the cause.
    type: path
    required: true
  wait:
    description:
      - Seconds to wait for the job to end before reporting; the report comes as soon as it ends.
      - More than 0, at most 3600.
    type: float
    default: 60
  download:
    description:
      - Report a download into a checkpoint directory.
      - Mutually exclusive with O(unit).
    type: dict
    suboptions:
      path:
        description:
          - The directory the files are downloaded into; one not there yet holds nothing.
          - Links under it are not followed. A path that is no directory, or a directory under it that cannot be
            read, fails the report with a message that names it and the cause.
        type: path
        required: true
      total_bytes:
        description:
          - The size of the whole checkpoint in bytes, for the estimate (M(llmserve.vllm.checkpoint_verify)'s C(bytes)).
          - From 0 to 2^63 - 1; 0 is taken for unknown.
        type: int
      total_files:
        description:
          - How many files the whole checkpoint has (M(llmserve.vllm.checkpoint_verify)'s C(files)).
          - From 0 to 2^63 - 1; 0 is taken for unknown.
        type: int
  unit:
    description:
      - Report the start of the vLLM server that runs as this systemd unit, from its journal.
      - The name of one unit, as systemd allows it - ASCII letters, digits and C(:_.@\-), at most 255 characters.
      - Mutually exclusive with O(download).
    type: str
  previous:
    description:
      - The RV(sample) of the previous report in the same loop, for the rate and the phase's duration.
      - Omitted or empty for the first report. A value that is not a finite number where one belongs is ignored.
    type: dict
    default: {}
notes:
  - The journal is read with C(journalctl), which needs root or membership in C(systemd-journal). A journal that
    cannot be read leaves the phase unknown; it never fails the report. Only the first 1024 characters of each
    journal line are read for the phase, and RV(start.line) is cut to as many.
  - Files that are fetched again in place are counted once they are whole, so while such a file is rewritten the
    bytes done may run ahead of what was fetched; they never exceed O(download.total_bytes).
seealso:
  - module: ansible.builtin.async_status
  - module: llmserve.vllm.chat_check
  - name: Asynchronous actions and polling
    description: Ansible's async tasks, whose C(results_file) this module reads.
    link: https://docs.ansible.com/ansible/latest/playbook_guide/playbooks_async.html
"""

EXAMPLES = r"""
- name: Fetch the checkpoint in the background
  ansible.builtin.command:
    argv: [hf, download, moonshotai/Kimi-K2.5, --local-dir, /srv/models/kimi]
  async: 36000
  poll: 0
  register: fetch_job
  changed_when: false

- name: Show the fetch's progress once a minute
  llmserve.vllm.progress:
    results_file: "{{ fetch_job.results_file }}"
    wait: 60
    download:
      path: /srv/models/kimi
      total_bytes: 595000000000
      total_files: 130
    previous: "{{ fetch_progress.sample | default({}) }}"
  loop: "{{ range(601) | list }}"
  loop_control:
    label: "{{ fetch_progress.msg }}"
    break_when: fetch_progress.finished
  register: fetch_progress

- name: Collect the fetch's result
  ansible.builtin.async_status:
    jid: "{{ fetch_job.ansible_job_id }}"
  register: fetch
"""

RETURN = r"""
finished:
  description: Whether the job has ended (successfully or not).
  returned: always
  type: bool
  sample: false
msg:
  description: The report in one line.
  returned: always
  type: str
  sample: 412.3 GB of 540.0 GB, 98 of 119 files, 1.2 GB/s, about 1m44s left
elapsed:
  description: Seconds since the job began, where the results file still tells (it is rewritten when the job ends).
  returned: when known
  type: float
  sample: 342.5
download:
  description: The download's figures, with O(download).
  returned: with O(download) while the job runs
  type: dict
  contains:
    bytes:
      description: Bytes on disk, capped at RV(download.total_bytes).
      type: int
      returned: always
    total_bytes:
      description: O(download.total_bytes).
      type: int
      returned: always
    files:
      description: Files in place, capped at RV(download.total_files).
      type: int
      returned: always
    total_files:
      description: O(download.total_files).
      type: int
      returned: always
    bytes_per_second:
      description: The rate since the previous report; V(null) for the first.
      type: float
      returned: always
    seconds_left:
      description: The estimate at that rate; V(null) without a rate or a total.
      type: float
      returned: always
start:
  description: The start's figures, with O(unit); once the job ended, the phase the start reached.
  returned: with O(unit)
  type: dict
  contains:
    phase:
      description: The phase, as RV(msg) names it.
      type: str
      returned: always
      sample: 'loading weights: shard 52 of 119'
    line:
      description: The journal line that tells the phase, cut to 1024 characters; V(null) when the journal shows none.
      type: str
      returned: always
    phase_seconds:
      description: Seconds since a report first saw this phase.
      type: float
      returned: always
sample:
  description: What the next report of the same loop gets as O(previous).
  returned: always
  type: dict
"""

import errno
import os
import stat
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import nul_free_path, range_problem
from ansible_collections.llmserve.vllm.plugins.module_utils._file_transaction import file_kind
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._journal import JOURNAL_SCAN_LINES, journal_lines
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._progress import (
    MAX_RESULTS_BYTES,
    download_report,
    finite_number,
    format_duration,
    job_finished,
    start_report,
    unit_name,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._systemd import (
    UNIT_PROBE_SECONDS,
    UnitUnreadable,
    journal_reader,
    unit_probe,
)

MAX_WAIT = 3600
# The most bytes or files O(download.total_bytes) and O(download.total_files) may say: what an int64 holds.
MAX_TOTAL = 2**63 - 1
# How often the results file is read while waiting: a gate that failed is rolled back this much later at most.
POLL_SECONDS = 0.25
# The downloader's own files (huggingface_hub: <dir>/.cache/huggingface/), of which only the parts of files
# still downloading (download/<file>.<etag>.incomplete) are checkpoint bytes.
DOWNLOAD_CACHE = '.cache'
PART_SUFFIX = '.incomplete'
# The async wrapper writes a regular file and renames it into place: a link is not followed, and a FIFO in its
# place is opened without waiting for a writer (then refused as no regular file).
RESULTS_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW


class ResultsUnreadable(Exception):
    """The results file is there but is no regular file, or cannot be read; the message names it and the cause."""


def read_job(path):
    """(finished, the file's mtime) or (None, None) when there is no results file; ResultsUnreadable otherwise."""
    try:
        fd = os.open(path, RESULTS_OPEN_FLAGS)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise ResultsUnreadable(
                'the async job results file %s is a symbolic link, not the file the async wrapper writes' % path
            ) from None
        raise ResultsUnreadable('cannot read the async job results file %s: %s' % (path, exc.strerror)) from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            kind = file_kind(status.st_mode)
            raise ResultsUnreadable(
                'the async job results file %s is %s, not the file the async wrapper writes' % (path, kind)
            )
        # One byte past the limit tells job_finished that the file is longer than any running job's record.
        chunks = []
        left = MAX_RESULTS_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ResultsUnreadable('cannot read the async job results file %s: %s' % (path, exc.strerror)) from None
    finally:
        os.close(fd)
    return job_finished(b''.join(chunks)), status.st_mtime


def on_disk(directory):
    """(bytes, files) under directory: the regular files in place, and the bytes of the downloader's parts.

    A directory that is not there (yet) holds nothing; OSError, with the path that failed, where one cannot be
    read. Links are not followed; the walk keeps its own stack, so a tree of any depth is walked.
    """
    total = files = 0
    folders = [(directory, False)]
    while folders:
        folder, in_cache = folders.pop()
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except FileNotFoundError:
            continue  # not created yet, or moved away meanwhile
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, in_cache or (folder == directory and entry.name == DOWNLOAD_CACHE)))
                    continue
                if in_cache and not entry.name.endswith(PART_SUFFIX):
                    continue
                status = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # moved into place meanwhile: counted at the next report
            if stat.S_ISREG(status.st_mode):
                total += status.st_size
                files += 0 if in_cache else 1
    return total, files


def start_lines(module, unit):
    """The journal lines of the unit's current run (all its runs where systemd gives no InvocationID); [] where
    the journal cannot be read."""
    read = journal_reader(module, unit, None)
    if read is None:
        return []
    invocation = None
    if module.get_bin_path('systemctl'):
        try:
            invocation = unit_probe(module, unit, None)(UNIT_PROBE_SECONDS).get('InvocationID') or None
        except UnitUnreadable:
            pass  # the unit's lines of every run, then
    try:
        return journal_lines(read(invocation=invocation, lines=JOURNAL_SCAN_LINES))
    except Exception:  # the journal only adds detail; a report never fails for it
        return []


def wait_for_job(module, results_file, wait):
    """(finished, modified) of the async job's results file, once the job ended or wait seconds passed."""
    deadline = time.monotonic() + wait
    while True:
        try:
            finished, modified = read_job(results_file)
        except ResultsUnreadable as exc:
            module.fail_json(msg=str(exc))
        if finished is None:
            module.fail_json(
                msg='no async job results file at %s: was the task started with async and poll 0, on this host '
                'and as this user?' % results_file
            )
        if finished or time.monotonic() >= deadline:
            return finished, modified
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def ended_report(module, unit, now, started, previous):
    """The report of a job that ended: for how long it ran and, with a unit, the phase its start reached."""
    report: dict[str, Any] = {
        'msg': 'ended' + (' after %s' % format_duration(now - started) if started is not None else ''),
        'sample': {'time': now, 'started': started},
    }
    if unit:
        # The phases after the last report pass within seconds on a fast start: the end names the one reached.
        reached = start_report(start_lines(module, unit), now - (started or now), now, previous)
        report['start'] = reached['start']
        report['msg'] += '; the start reached: %s' % reached['start']['phase']
    return report


def main():
    module = AnsibleModule(
        argument_spec=dict(
            results_file=dict(type=nul_free_path, required=True),
            wait=dict(type='float', default=60),
            download=dict(
                type='dict',
                options=dict(
                    path=dict(type=nul_free_path, required=True),
                    total_bytes=dict(type='int'),
                    total_files=dict(type='int'),
                ),
            ),
            unit=dict(type=unit_name),
            previous=dict(type='dict', default={}),
        ),
        mutually_exclusive=[('download', 'unit')],
        supports_check_mode=True,
    )
    p = module.params
    problem = range_problem('wait', p['wait'], 0, MAX_WAIT, ' seconds', above=True)
    download = p['download'] or {}
    for total in ('total_bytes', 'total_files'):
        if download.get(total) is not None:
            problem = problem or range_problem('download.' + total, download[total], 0, MAX_TOTAL)
    if problem:
        module.fail_json(msg=problem)
    previous = p['previous'] or {}
    finished, modified = wait_for_job(module, p['results_file'], p['wait'])
    now = time.time()
    started = finite_number(previous.get('started'))
    if started is not None and started > now:
        started = None  # none that this loop's reports took
    if started is None and not finished:
        started = modified  # written once when the job began, again when it ends
    result = {'changed': False, 'finished': finished}
    if started is not None:
        result['elapsed'] = round(now - started, 1)
    if finished:
        result.update(ended_report(module, p['unit'], now, started, previous))
        module.exit_json(**result)

    if download:
        try:
            done_bytes, done_files = on_disk(download['path'])
        except OSError as exc:
            module.fail_json(
                msg='cannot read the download directory %s: %s' % (exc.filename or download['path'], exc.strerror)
            )
        report = download_report(
            done_bytes, download['total_bytes'], done_files, download['total_files'], now, previous
        )
    elif p['unit']:
        report = start_report(start_lines(module, p['unit']), now - (started or now), now, previous)
    else:
        report = {'msg': 'running for %s' % format_duration(now - (started or now)), 'sample': {'time': now}}
    report['sample']['started'] = started
    result.update(report)
    module.exit_json(**result)


if __name__ == '__main__':
    main()
