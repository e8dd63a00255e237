#!/usr/bin/env python3
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Predicted KV-cache tokens against real vLLM start-up logs, with the old 5 GiB reserve and with the estimate.

    .venv/bin/python bench/reserve_calibration.py

One row per log of tests/fixtures/startup_logs: the model, GPU, TP, the tokens the log shows, the prediction and
its error before (constant reserve) and after (_reserve.estimate), and whether the prediction fits max_model_len
where vLLM's start did (or did not); then the median and worst absolute error, fitted and held-out logs apart.
The weights are each log's own "Model loading took", so the error is the reserve's. Then the weights per GPU the
preflight predicts before the download, from config.json's layout, against each log's "Model loading took".
"""

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, '.build', 'collections'))

from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._reserve import FALLBACK_RESERVE_BYTES  # noqa: E402
from ansible_collections.llmserve.vllm.tests.support import (  # noqa: E402
    is_moe_at_scale,
    logged_tokens,
    predict,
    predict_weights,
    reserve_compared,
    startup_logs,
)


def percent(value):
    return '%+.1f %%' % (100 * value)


def main():
    rows = []
    errors = {'before': {False: [], True: []}, 'after': {False: [], True: []}}
    for log in startup_logs():
        logged = logged_tokens(log)[0]
        compared = reserve_compared(log)
        cells = []
        for label, reserve in (('before', FALLBACK_RESERVE_BYTES), ('after', None)):
            _, _, tokens, fits = predict(log, reserve)
            err = (tokens - logged) / logged
            if compared:
                errors[label][log['held_out']].append(abs(err))
            verdict = 'fits' if fits else 'no fit'
            cells += [
                '{:,}'.format(tokens),
                percent(err) if compared else '(%s)' % percent(err),
                verdict,
            ]
        rows.append(
            [
                log['name'] + (' *' if log['held_out'] else ''),
                log['gpu']['name'].replace('NVIDIA ', '').replace('GeForce ', ''),
                str(log['tensor_parallel_size']),
                log['vllm_version'],
                '{:,}'.format(logged) + ('' if log['logged']['kv_tokens'] else ' †'),
                'started' if log['logged']['started'] else 'failed',
            ]
            + cells
        )
    head = ['log (* held out)', 'GPU', 'TP', 'vLLM', 'logged tokens', 'start']
    head += ['5 GiB: tokens', 'error', 'verdict', 'estimate: tokens', 'error', 'verdict']
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head))
    for row in rows:
        print('| ' + ' | '.join(row) + ' |')
    print()
    print('| reserve | logs | median abs error | worst abs error |')
    print('|---|---|---|---|')
    for label in ('before', 'after'):
        name = '5 GiB constant' if label == 'before' else 'estimate'
        for held_out, which in ((False, 'fitted'), (True, 'held out'), (None, 'all')):
            errs = errors[label][False] + errors[label][True] if held_out is None else errors[label][held_out]
            print(
                '| %s | %s (%d) | %.1f %% | %.1f %% |'
                % (name, which, len(errs), 100 * statistics.median(errs), 100 * max(errs))
            )


def weights_table():
    """Weights per GPU before the download against each log's "Model loading took": the index's total shared out over
    the GPUs (the earlier model), and config.json's layout."""
    print()
    print('| log (* held out) | model type | TP | vLLM | logged GiB | index total: GiB | error | layout: GiB | error |')
    print('|---|---|---|---|---|---|---|---|---|')
    errors = {label: {False: [], True: [], 'moe': []} for label in ('before', 'after')}
    for log in startup_logs():
        logged = log['logged']['weights_gib'] * 1024**3
        cells = []
        for label, sized in (('before', False), ('after', True)):
            predicted = predict_weights(log, sized)
            err = (predicted - logged) / logged
            errors[label][log['held_out']].append(err)
            if is_moe_at_scale(log):
                errors[label]['moe'].append(err)
            cells += ['%.2f' % (predicted / 1024**3), percent(err)]
        print(
            '| %s%s | %s | %d | %s | %.2f | %s |'
            % (
                log['name'],
                ' *' if log['held_out'] else '',
                log['config'].get('model_type'),
                log['tensor_parallel_size'],
                log['vllm_version'],
                log['logged']['weights_gib'],
                ' | '.join(cells),
            )
        )
    print()
    print('| weights before download | logs | median abs error | worst abs error | most below |')
    print('|---|---|---|---|---|')
    for label in ('before', 'after'):
        name = 'index total shared out' if label == 'before' else "config.json's layout"
        for which, key in (('fitted', False), ('held out', True), ('MoE at TP >= 4', 'moe')):
            errs = errors[label][key]
            absolute = [abs(e) for e in errs]
            print(
                '| %s | %s (%d) | %.1f %% | %.1f %% | %s |'
                % (name, which, len(errs), 100 * statistics.median(absolute), 100 * max(absolute), percent(min(errs)))
            )


if __name__ == '__main__':
    main()
    weights_table()
