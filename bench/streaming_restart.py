# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What clients see through a restart and through a change, under constant streaming load (make bench-streaming-restart).

On a deployed sandbox (default: the demo's, inventories/sandbox after `make demo`), --clients clients of the official
`openai` client (tests/integration/sandbox/streaming_load.py, no retries) stream answers of --tokens tokens through the
front door without pause. After --settle seconds, `systemctl restart` of the service, or with --change a change made
with playbooks/deploy.yml (the context length, alternately 2048 and the inventory's; its performance gate and pre-load
smoke off, see change()); the load goes on until the service answers again and --settle seconds more. Printed, per round:

- the requests open when the stop began, and how each ended (complete: every token, its usage and [DONE]; cut;
  or the error that ended it);
- what requests during the restart got: 503 (the front door's, with Retry-After), 502, resets, refused connections;
- the requests that failed before the stop began (with --change, what the steps before the restart cost), and when;
- how long the stop took (systemd's, from the journal) against --shutdown-timeout, and the time without any complete
  answer.

Writes them as JSON (default .cache/bench/streaming_restart.json). Run as root, from the repo, with .venv/bin on PATH
and ANSIBLE_COLLECTIONS_PATH set (the Makefile does both).
"""

import argparse
import collections
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests', 'integration', 'sandbox'))
from sandbox_helpers import CA, Sandbox  # noqa: E402
from streaming_load import StreamingLoad  # noqa: E402


def stop_of(sandbox, since):
    """When systemd began stopping the unit and how long the stop took ("Stopping" to "Stopped"), from the journal."""
    lines = sandbox.sh(
        "journalctl -u %s --no-pager -o short-unix --since @%d | grep -E 'Stopping |Stopped |Deactivated successfully'"
        % (sandbox.unit, since)
    ).splitlines()
    stamps = [float(line.split()[0]) for line in lines]
    if len(stamps) < 2:
        raise SystemExit('no stop of %s in the journal since @%d' % (sandbox.unit, since))
    return stamps[0], round(stamps[-1] - stamps[0], 2)


def restart(sandbox, number):
    sandbox.sh('systemctl reset-failed %s; systemctl restart %s' % (sandbox.unit, sandbox.unit))


def change(sandbox, number):
    """A change through the playbook: the role restarts onto it, gates it and records it."""
    length = 2048 if number % 2 else sandbox.vars['vllm_kimi_max_model_len']
    # Two steps of the change measure the host, not what its clients see, and this bench's own clients skew both on
    # two cores; the tests run them. The performance gate compares the release's throughput with the last good
    # deployment's, measured without these clients: beside them it judges their load (one run read 50.9 % "below" and
    # rolled a sound change back). The pre-load smoke, before the stop, is starved wherever it is held on the core
    # that the serving vLLM's CPU worker spins on (docs/benchmarks.md).
    settings = ('vllm_kimi_max_model_len=%s' % length, 'vllm_kimi_perf_gate=never', 'vllm_kimi_preload_smoke=false')
    rc, output, report = sandbox.deploy(*[word for setting in settings for word in ('-e', setting)])
    if rc != 0:
        raise SystemExit('the change failed:\n%s' % output[-3000:])


def count_by(records, kind):
    return dict(collections.Counter(kind(record) for record in records))


def one_round(sandbox, clients, tokens, settle, disturb, number):
    front = 'https://127.0.0.1:%s/v1' % sandbox.vars['vllm_kimi_front_port']
    load = StreamingLoad(
        front, sandbox.vars['vllm_kimi_api_key'], sandbox.vars['vllm_kimi_served_model_name'], CA, clients, tokens, 0
    )
    with load:
        time.sleep(settle)
        since = int(time.time()) - 1
        disturb(sandbox, number)
        gate = sandbox.gate()
        if gate['failed']:
            raise SystemExit('the restart did not end in a coherent answer: %s' % gate.get('msg'))
        time.sleep(settle)
    stop_at, stop_seconds = stop_of(sandbox, since)
    # Every request open when the stop began, whatever its end: a stream cut by a reset ends as an error, not as 'cut'.
    in_flight = [r for r in load.requests if r['start'] < stop_at < r['end']]
    during = [r for r in load.requests if r['start'] >= stop_at and r['outcome'] == 'error']
    before = [r for r in load.requests if r['end'] <= stop_at and r['outcome'] == 'error']
    summary = load.summary()
    return {
        'streams_in_flight_at_stop': len(in_flight),
        'how_they_ended': count_by(in_flight, lambda r: r['error'] if r['outcome'] == 'error' else r['outcome']),
        'requests_during_restart': count_by(during, lambda r: r['error']),
        # Failures before the stop began: what the change's steps before its restart cost the clients.
        'errors_before_stop': count_by(
            before, lambda r: '%s, %.1f s before the stop' % (r['error'], stop_at - r['end'])
        ),
        'stop_seconds': stop_seconds,
        'shutdown_timeout': sandbox.vars['vllm_kimi_shutdown_timeout'],
        'longest_gap_seconds': summary['longest_gap_seconds'],
        'requests': summary['requests'],
        'outcomes': summary['outcomes'],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--inventory', default=os.path.join(REPO, 'inventories', 'sandbox'))
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--clients', type=int, default=4)
    parser.add_argument('--tokens', type=int, default=128)
    parser.add_argument('--settle', type=float, default=10.0)
    parser.add_argument('--change', action='store_true', help='a change through deploy.yml instead of a restart')
    parser.add_argument(
        '--out', help='default .cache/bench/streaming_restart.json, or streaming_change.json with --change'
    )
    args = parser.parse_args()
    args.out = args.out or os.path.join(
        REPO, '.cache', 'bench', 'streaming_change.json' if args.change else 'streaming_restart.json'
    )
    sandbox = Sandbox(args.inventory)
    disturb = change if args.change else restart
    rounds = [
        one_round(sandbox, args.clients, args.tokens, args.settle, disturb, number)
        for number in range(1, args.rounds + 1)
    ]
    for number, figures in enumerate(rounds, 1):
        print('round %d: %s' % (number, json.dumps(figures, sort_keys=True)))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(
            {'through': disturb.__name__, 'clients': args.clients, 'tokens': args.tokens, 'rounds': rounds},
            f,
            indent=2,
            sort_keys=True,
        )
    print('written to %s' % args.out)


if __name__ == '__main__':
    main()
