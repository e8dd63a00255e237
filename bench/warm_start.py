# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A start's ledger, cold and warm: what the sealed caches save a restart (make bench-warm-start).

On a deployed sandbox (default: the demo's, inventories/sandbox after `make demo`):

1. Deploys the inventory's settings with torch.compile on (its vllm_kimi_extra_args without --enforce-eager) and a
   marker in vllm_kimi_environment, so that the release and command line have a store of sealed caches of their own:
   the deploy's gated start warms the caches, and the role seals them.
2. For each round: a cold restart (the store moved aside, so that the fresh HOME starts empty) and a warm one (the
   store back: the start is seeded from it), each followed by the role's coherence gate (llmserve.vllm.chat_check),
   whose start-up figures are the ledger the deployment record keeps.
3. Deploys the inventory's own settings again, unless --keep.

Prints each start's ledger (engine init, which on the CPU build holds the compile and warm-up; compile where vLLM
logs it; API ready) and the warm-to-cold ratio, and writes them as JSON (default .cache/bench/warm_start.json).
Run as root, from the repo, with .venv/bin on PATH and ANSIBLE_COLLECTIONS_PATH set (the Makefile does both).
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests', 'integration', 'sandbox'))
from sandbox_helpers import Sandbox  # noqa: E402

PHASES = ('weights_seconds', 'compile_seconds', 'graph_capture_seconds', 'engine_init_seconds')
# vLLM's line when a compiled artifact it found could not be used and it compiles again.
RECOMPILED = re.compile(r'Compiling model again due to a load failure from \S+, reason: (.*)')


def compiled_settings(sandbox):
    extra_args = [arg for arg in sandbox.vars['vllm_kimi_extra_args'] if arg != '--enforce-eager']
    environment = dict(sandbox.vars.get('vllm_kimi_environment') or {}, LLMSERVE_BENCH_WARM_START=str(int(time.time())))
    return {'vllm_kimi_extra_args': extra_args, 'vllm_kimi_environment': environment}


def store_of(sandbox):
    unit = sandbox.sh('cat /etc/systemd/system/%s.service' % sandbox.unit)
    return re.search(r'"seed" "(/[^"]+)"', unit).group(1)


def start(sandbox, label, since):
    """Restart the service, wait for the gate, and return the start's ledger."""
    sandbox.sh('systemctl reset-failed %s; systemctl restart %s' % (sandbox.unit, sandbox.unit))
    gate = sandbox.gate()
    if gate['failed']:
        raise SystemExit('%s start failed its gate: %s' % (label, gate.get('msg')))
    journal = sandbox.sh('journalctl -u %s --no-pager -o cat --since %s' % (sandbox.unit, since))
    recompiled = RECOMPILED.findall(journal)
    ledger = dict((phase, gate['startup'].get(phase)) for phase in PHASES)
    ledger.update(start=label, api_ready_seconds=gate['startup'].get('api_ready_seconds'), recompiled=recompiled[-1:])
    return ledger


def measure(sandbox, rounds):
    store = store_of(sandbox)
    aside = store + '.bench-aside'
    starts = []
    for number in range(rounds):
        since = '@%d' % int(time.time())
        sandbox.sh('mv %s %s' % (store, aside))
        try:
            starts.append(start(sandbox, 'cold %d' % (number + 1), since))
        finally:
            sandbox.sh('mv %s %s' % (aside, store))
        since = '@%d' % int(time.time())
        starts.append(start(sandbox, 'warm %d' % (number + 1), since))
    return store, starts


def table(starts):
    def seconds(value):
        return '-' if value is None else '%.2f s' % value

    lines = ['%-8s %12s %12s %12s' % ('start', 'engine init', 'compile', 'API ready')]
    for ledger in starts:
        lines.append(
            '%-8s %12s %12s %12s%s'
            % (
                ledger['start'],
                seconds(ledger['engine_init_seconds']),
                seconds(ledger['compile_seconds']),
                seconds(ledger['api_ready_seconds']),
                '  (vLLM compiled again: %s)' % ledger['recompiled'][0] if ledger['recompiled'] else '',
            )
        )
    return '\n'.join(lines)


def summary(starts):
    def median(kind, key):
        values = [s[key] for s in starts if s['start'].startswith(kind) and s[key] is not None]
        return statistics.median(values) if values else None

    result = {}
    for key in ('engine_init_seconds', 'api_ready_seconds'):
        cold, warm = median('cold', key), median('warm', key)
        result[key] = {
            'cold': cold and round(cold, 2),
            'warm': warm and round(warm, 2),
            'warm_to_cold': round(warm / cold, 3) if cold and warm else None,
        }
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--inventory', default=os.path.join(REPO, 'inventories', 'sandbox'))
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--keep', action='store_true', help='leave the compiled settings deployed')
    parser.add_argument('--out', default=os.path.join(REPO, '.cache', 'bench', 'warm_start.json'))
    args = parser.parse_args()
    sandbox = Sandbox(args.inventory)
    settings = compiled_settings(sandbox)
    rc, output, _report = sandbox.deploy('-e', json.dumps(settings))
    if rc != 0:
        raise SystemExit('the deploy with torch.compile on failed:\n%s' % output[-3000:])
    try:
        store, starts = measure(sandbox, args.rounds)
    finally:
        if not args.keep:
            rc, output, _report = sandbox.deploy()
            if rc != 0:
                print('the deploy of the inventory settings failed:\n%s' % output[-3000:], file=sys.stderr)
    figures = {'store': store, 'settings': settings, 'starts': starts, 'summary': summary(starts)}
    print(table(starts))
    for key, value in figures['summary'].items():
        print('%s: cold %s s, warm %s s, warm/cold %s' % (key, value['cold'], value['warm'], value['warm_to_cold']))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as handle:
        json.dump(figures, handle, indent=2, sort_keys=True)
    print('written to %s' % args.out)


if __name__ == '__main__':
    main()
