# SPDX-License-Identifier: GPL-3.0-or-later
"""Run make targets as timed stages, lane by lane, and end with a table of their wall and CPU times.

    python3 tools/stages.py --first "tools models" --lane "lint sanity units" --lane "molecule molecule-fleet"

The --first stages run one after the other before any lane starts: what the lanes share is built
once, not by two makes at the same time. Each lane runs its stages one after the other; the lanes run at the same time. A stage's output
goes to .build/stages/<stage>.log, each line prefixed with the minutes since the stage began, and is
printed whole once the stage ends, so that lanes running side by side do not interleave their lines. Every stage runs even when an earlier one failed (one
CI run then names every failure); the exit status is 1 if any stage failed. The table is printed
last, and also when the run is interrupted.

--pin LANE:CPUS runs that lane's makes under `taskset -c CPUS` (LANE counts from 1), so that what it
runs cannot take the cores another lane's measurements rely on.

--nice LANE:N runs that lane's makes under `nice -n N`: a lane with time to spare yields its core to the
lanes that are waited for (the models' training and the sandbox scenarios in make test).

After the table, the lines of each failed stage's log that name what failed (pytest's FAILED and ERROR lines and
its E lines, Ansible's fatal lines, tracebacks), at most FAILURE_LINES of them, or the log's last lines where it has
none of those (a linter's): CI shows a run's last lines, and these say which test or file to look at.

A stage's CPU time is its own processes' (make and every process it waited for, by the kernel's rusage): beside its
wall time it tells a stage that computes from one that waits. The sandboxes' services (vLLM in systemd-nspawn) are
no children of a stage, so the scenarios' CPU time is their controller's.

Under the table, how busy the machine's cores were, over the run and in each 5-minute slice (from /proc/stat, so the
sandboxes' processes count too): where the cores are busy throughout, only less work shortens the run; where they
idle, another order can.
"""

import argparse
import os
import re
import subprocess
import sys
import threading
import time

LOG_DIR = os.path.join('.build', 'stages')
CPU_SLICE = 300


def cpu_ticks() -> tuple:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat's first line."""
    with open('/proc/stat') as f:
        fields = [int(value) for value in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


class CpuSampler:
    """The machine's CPU ticks at the start of the run and at each CPU_SLICE seconds after it."""

    def __init__(self):
        self.samples = [cpu_ticks()]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(CPU_SLICE):
            self.samples.append(cpu_ticks())

    def report(self) -> str:
        samples = self.samples + [cpu_ticks()]

        def busy(first, last):
            total = last[1] - first[1]
            return 100.0 * (last[0] - first[0]) / total if total else 0.0

        slices = ' '.join('%.0f' % busy(a, b) for a, b in zip(samples, samples[1:]))
        return 'CPU busy (%% of %d cores): %.0f over the run; by %d-minute slice: %s\n' % (
            os.cpu_count() or 1,
            busy(samples[0], samples[-1]),
            CPU_SLICE // 60,
            slices,
        )


class Stage:
    def __init__(self, lane: int, target: str, cpus: str = '', niceness: str = ''):
        self.lane = lane
        self.target = target
        self.cpus = cpus
        self.niceness = niceness
        self.started = None  # type: float | None
        self.ended = None  # type: float | None
        self.returncode = None  # type: int | None
        # CPU seconds of the stage's own processes (make and all it waited for), from the kernel's rusage: the
        # sandboxes' services are no children of it and are not counted.
        self.cpu_seconds = None  # type: float | None

    @property
    def log_path(self) -> str:
        return os.path.join(LOG_DIR, self.target + '.log')

    def seconds(self, now: float) -> float:
        if self.started is None:
            return 0.0
        return (self.ended or now) - self.started

    def verdict(self) -> str:
        if self.started is None:
            return 'not run'
        if self.returncode is None:
            return 'running'
        return 'passed' if self.returncode == 0 else 'FAILED (rc %d)' % self.returncode


PRINT_LOCK = threading.Lock()


def run_stage(stage: Stage, make: list) -> None:
    stage.started = time.time()
    pinned = (['taskset', '-c', stage.cpus] if stage.cpus else []) + (
        ['nice', '-n', stage.niceness] if stage.niceness else []
    )
    with open(stage.log_path, 'wb') as log:
        proc = subprocess.Popen(
            pinned + make + [stage.target], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        # Each line carries the minutes since its stage began: the log shows where a stage's time went.
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            log.write(b'[+%s] ' % minutes(time.time() - stage.started).encode() + line)
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = stage.returncode = os.waitstatus_to_exitcode(status)
    stage.cpu_seconds = usage.ru_utime + usage.ru_stime
    stage.ended = time.time()
    with PRINT_LOCK, open(stage.log_path, 'rb') as log:
        sys.stdout.write(
            '\n===== stage %s (%s): %s in %s =====\n'
            % (stage.target, lane_name(stage.lane), stage.verdict(), minutes(stage.seconds(stage.ended)))
        )
        sys.stdout.flush()
        sys.stdout.buffer.write(log.read())
        sys.stdout.write('===== end of stage %s =====\n' % stage.target)
        sys.stdout.flush()


def run_lane(stages: list, make: list) -> None:
    for stage in stages:
        run_stage(stage, make)


def lane_name(lane: int) -> str:
    return 'first' if lane < 0 else str(lane + 1)


def minutes(seconds: float) -> str:
    return '%d:%02d' % divmod(int(round(seconds)), 60)


FAILURE_LINES = 40
ANSI_ESCAPE = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')
# The minutes this tool prefixes, and the frame molecule draws around an action's output.
LOG_PREFIX = re.compile(r'^\[\+[0-9]+:[0-9]{2}\]\s*[\u2502\u2514\u2500]*\s*')
NAMES_A_FAILURE = re.compile(r'^(?:(?:FAILED|ERROR) |E {2,}\S|fatal: \[|Traceback |[A-Za-z.]*(?:Error|Exception): )')


# Where a log has none of those (a linter's own format): its last lines, make's message of the recipe that failed
# among them.
FALLBACK_LINES = 8


def failure_lines(log_text: str, limit: int = FAILURE_LINES) -> list:
    """The lines of a stage's log that name what failed, in order, at most limit of them (then how many more); else
    its last FALLBACK_LINES lines."""
    lines = [LOG_PREFIX.sub('', ANSI_ESCAPE.sub('', raw)).rstrip()[:300] for raw in log_text.splitlines()]
    found = [line for line in lines if NAMES_A_FAILURE.match(line)]
    if not found:
        return [line for line in lines if line][-FALLBACK_LINES:]
    if len(found) > limit:
        return found[:limit] + ['... and %d more such lines' % (len(found) - limit)]
    return found


def failures(stages: list) -> str:
    """What each failed stage's log says failed."""
    parts = []
    for stage in stages:
        if stage.returncode:
            with open(stage.log_path, encoding='utf-8', errors='replace') as log:
                lines = failure_lines(log.read())
            parts.append('\n'.join(['', '== what failed in %s (%s) ==' % (stage.target, stage.log_path)] + lines))
    return '\n'.join(parts) + '\n' if parts else ''


def table(stages: list, started: float) -> str:
    now = time.time()
    rows = [
        '',
        "Stage times (wall clock; lanes run side by side) and CPU time (the stage's own processes, not the sandboxes')",
        '%-5s  %-24s  %8s  %8s  %s' % ('lane', 'stage', 'm:ss', 'cpu m:ss', 'verdict'),
    ]
    for stage in stages:
        cpu = '-' if stage.cpu_seconds is None else minutes(stage.cpu_seconds)
        rows.append(
            '%-5s  %-24s  %8s  %8s  %s'
            % (lane_name(stage.lane), stage.target, minutes(stage.seconds(now)), cpu, stage.verdict())
        )
    rows.append('%-5s  %-24s  %8s' % ('', 'total', minutes(now - started)))
    return '\n'.join(rows) + '\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--first', default='', help='make targets run one after the other before the lanes')
    parser.add_argument('--lane', action='append', required=True, help='make targets run one after the other')
    parser.add_argument('--pin', action='append', default=[], help='LANE:CPUS, that lane under taskset -c CPUS')
    parser.add_argument('--nice', action='append', default=[], help='LANE:N, that lane under nice -n N')
    parser.add_argument('--make', default=os.environ.get('MAKE', 'make'), help='the make program')
    args = parser.parse_args(argv)
    os.makedirs(LOG_DIR, exist_ok=True)
    pins = dict(pin.split(':', 1) for pin in args.pin)
    niceness = dict(entry.split(':', 1) for entry in args.nice)
    first = [Stage(-1, target) for target in args.first.split()]
    lanes = [
        [Stage(i, target, pins.get(str(i + 1), ''), niceness.get(str(i + 1), '')) for target in lane.split()]
        for i, lane in enumerate(args.lane)
    ]
    stages = first + [stage for lane in lanes for stage in lane]
    make = [args.make, '--no-print-directory']
    started = time.time()
    cpu = CpuSampler()
    cpu.thread.start()
    threads = [threading.Thread(target=run_lane, args=(lane, make), daemon=True) for lane in lanes]
    try:
        run_lane(first, make)
        if any(stage.returncode for stage in first):
            return 1
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(1)
    finally:
        with PRINT_LOCK:
            sys.stdout.write(table(stages, started) + cpu.report() + failures(stages))
            sys.stdout.flush()
    return 0 if all(stage.returncode == 0 for stage in stages) else 1


if __name__ == '__main__':
    sys.exit(main())
