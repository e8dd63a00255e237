# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""vLLM's start-up figures read from real start-up logs (tests/fixtures/startup_logs: their lines verbatim, and the
figures a person read off them, in `logged`)."""

import glob
import json
import os

import pytest

from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._startup_log import startup_figures
from ansible_collections.llmserve.vllm.tests.support import fixture_path

LOGS = sorted(glob.glob(os.path.join(fixture_path('startup_logs'), '*.json')))
FIGURES = ('weights_gib', 'available_kv_gib', 'kv_tokens', 'cudagraph_gib', 'gpu_blocks')
# Figures a person derived rather than read: V0 prints blocks, not tokens (tokens = blocks x block size), and one
# reporter quoted the KV memory in prose ("is only 8.69GiB"), not as vLLM logs it.
DERIVED = {
    'deepseek-r1-h200-tp8-v0': {'kv_tokens'},
    'llama31-8b-rtx3090-v0-20k': {'kv_tokens', 'gpu_blocks'},
    'llama31-8b-rtx3090-v0-29k-failed': {'kv_tokens'},
    'qwen25-15b-t4-v0': {'kv_tokens', 'gpu_blocks'},
    'qwen25-math-15b-l40-v0': {'kv_tokens', 'gpu_blocks'},
    'r1-distill-qwen-14b-2x4090-v0-tp2-failed': {'kv_tokens', 'available_kv_gib'},
    # The excerpt joins starts; the figures are the last one's, whose lines lack the graph capture.
    'r1-distill-qwen-15b-a100-40gb-v1-0901': {'cudagraph_gib'},
}
# Reporters who quoted vLLM's messages without the prefix its logger writes before each (which the figures are read
# behind: a journal always has it).
UNPREFIXED = {'llama31-8b-rtx3090-v0-20k', 'llama31-8b-rtx3090-v0-29k-failed'}
VLLM_PREFIX = 'INFO 01-01 00:00:00 [worker.py:1] '


def load(path):
    with open(path) as f:
        return json.load(f)


def excerpt_lines(path):
    """The log's lines, each with vLLM's prefix where its reporter left it out."""
    lines = load(path)['excerpt']
    return [VLLM_PREFIX + line for line in lines] if os.path.basename(path)[:-5] in UNPREFIXED else lines


@pytest.mark.parametrize('path', LOGS, ids=[os.path.basename(p)[:-5] for p in LOGS])
def test_every_logged_figure_is_read_from_the_lines(path):
    log = load(path)
    name = os.path.basename(path)[:-5]
    got = startup_figures(excerpt_lines(path))
    wanted = {
        key: log['logged'][key]
        for key in FIGURES
        if log['logged'].get(key) is not None and key not in DERIVED.get(name, ())
    }
    assert {key: got.get(key) for key in wanted} == wanted


def test_the_logs_cover_every_figure():
    read = set()
    for path in LOGS:
        read.update(startup_figures(excerpt_lines(path)))
    assert read >= set(FIGURES) | {'kv_cache_device', 'max_concurrency'}


def test_eight_ranks_give_the_bounding_figures():
    lines = [
        '(Worker_TP%d pid=%d) INFO 09-24 20:50:59 [gpu_model_runner.py:2392] Model loading took %s GiB and 287.2 seconds'
        % (rank, 2000 + rank, weights)
        for rank, weights in enumerate(
            ('27.7183', '27.7190', '27.7183', '27.7183', '27.7183', '27.7183', '27.7183', '27.7')
        )
    ] + [
        '(Worker_TP%d pid=%d) INFO 09-24 20:53:40 [gpu_worker.py:298] Available KV cache memory: %s GiB'
        % (rank, 2000 + rank, kv)
        for rank, kv in enumerate(('10.66', '10.64', '10.68', '10.65', '10.66', '10.67', '10.66', '10.65'))
    ]
    figures = startup_figures(lines)
    assert (figures['weights_gib'], figures['available_kv_gib']) == (27.719, 10.64)


def test_the_cpu_builds_lines_as_the_sandbox_logs_them():
    lines = [
        '(Worker pid=598) INFO 12-01 16:25:21 [default_loader.py:501] Loading weights took 0.01 seconds',
        '(EngineCore pid=583) INFO 12-01 16:25:22 [kv_cache_utils.py:2327] CPU KV cache size: 4,096 tokens, '
        'Maximum concurrency for 1,024 tokens per request: 4.00x',
    ]
    assert startup_figures(lines) == {
        'kv_tokens': 4096,
        'max_concurrency': 4.0,
        'weights_read_seconds': 0.01,
        'kv_cache_device': 'CPU',
    }


@pytest.mark.parametrize(
    'name, ledger',
    [
        # V1 at TP 8 on eight H200 NVL: eight ranks' loads, compilation inside the engine's start.
        (
            'kimi-k26-int4-h200nvl-tp8-v1-0200',
            {
                'weights_seconds': 48.817523,
                'weights_gib_per_second': 1.458,
                'compile_seconds': 43.51,
                'graph_capture_seconds': 4.0,
                'engine_init_seconds': 97.94,
            },
        ),
        # V1 restarted in one excerpt: the last start's load alone (its API server's first line begins a run).
        ('r1-distill-qwen-15b-a100-40gb-v1-0901', {'weights_seconds': 1.397818, 'weights_gib_per_second': 2.394}),
        # V0: its memory profiling timed, its engine's start in seconds.
        ('deepseek-r1-h200-tp8-v0', {'memory_profiling_seconds': 7.63}),
        ('deepseek-coder-v2-lite-a100-40gb-tp8-v0', {'engine_init_seconds': 15.79}),
    ],
)
def test_a_real_starts_ledger_is_read_from_its_lines(name, ledger):
    figures = startup_figures(load(fixture_path('startup_logs', name + '.json'))['excerpt'])
    assert {
        key: figures[key] for key in figures if key.endswith('_seconds') or key == 'weights_gib_per_second'
    } == ledger


def test_the_weights_rate_is_over_the_checkpoints_read_where_vllm_timed_it():
    lines = [
        'INFO 12-01 16:25:21 [default_loader.py:501] Loading weights took 20.00 seconds',
        'INFO 12-01 16:25:21 [gpu_model_runner.py:5150] Model loading took 60.00 GiB memory and 30.000000 seconds',
    ]
    figures = startup_figures(lines)
    assert (figures['weights_seconds'], figures['weights_read_seconds'], figures['weights_gib_per_second']) == (
        30.0,
        20.0,
        3.0,
    )


@pytest.mark.parametrize(
    'line',
    [
        'Model loading took 60.00 GiB memory and , seconds',
        'Graph capturing finished in secs, took 0.45 GiB',
        'init engine (profile, create kv cache, warmup model) took nan s',
        'torch.compile took 1e999 s in total',
    ],
)
def test_a_phase_without_a_figure_is_left_out(line):
    assert not [key for key in startup_figures([line]) if key.endswith('_seconds')]


def test_no_figure_no_key():
    assert startup_figures(['INFO:     Application startup complete.']) == {}


def test_the_backends_of_real_starts_are_read_from_their_lines():
    """Kimi-K2.6 on eight H200 NVL (its experts on Marlin) and a V1 start on an A100 (FlashAttention), as logged."""
    assert startup_figures(load(fixture_path('startup_logs', 'kimi-k26-int4-h200nvl-tp8-v1-0200.json'))['excerpt'])[
        'backends'
    ] == ['Marlin']
    excerpt = load(fixture_path('startup_logs', 'r1-distill-qwen-15b-a100-40gb-v1-0901.json'))['excerpt']
    first_start = excerpt[: next(at for at, line in enumerate(excerpt) if 'vLLM API server version' in line)]
    assert startup_figures(first_start)['backends'] == ['Flash Attention']


@pytest.mark.parametrize(
    'line, backend',
    [
        # vLLM 0.32's own wordings (platforms/cpu.py, platforms/cuda.py, the MoE oracles, the MLA prefill selector).
        ('(EngineCore pid=583) INFO 12-01 16:25:20 [cpu.py:175] Using CPU_MLA backend.', 'CPU_MLA'),
        (
            '(Worker_TP3 pid=9) INFO 12-01 16:25:21 [cuda.py:507] Using TRITON_MLA attention backend out of potential backends: '
            "['TRITON_MLA'].",
            'TRITON_MLA attention',
        ),
        (
            "(Worker_TP0 pid=9) INFO 12-01 16:25:21 [nvfp4.py:242] Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend out of potential "
            "backends: ['FLASHINFER_CUTLASS', 'MARLIN'].",
            'FLASHINFER_CUTLASS NvFp4 MoE',
        ),
        ('INFO 12-01 16:25:21 [selector.py:106] Using FLASHINFER MLA prefill backend.', 'FLASHINFER MLA prefill'),
        # What names no backend.
        ('INFO 12-01 16:25:21 [cuda.py:179] Cannot use FlashAttention-2 backend for Volta and Turing GPUs.', None),
        ('INFO 12-01 16:25:21 [interface.py:1] Using backend TORCH_SDPA for vit attention', None),
        (
            '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [interface.py:429] Using default backend '
            'AttentionBackendEnum.TORCH_SDPA for vit attention',
            None,
        ),
        (
            '[W1204 20:58:29.923995797 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation '
            'on the NUMA nodes (0).',
            None,
        ),
        ('INFO 12-01 16:25:21 [x.py:1] Using ' + 'x' * 200 + ' backend.', None),
    ],
)
def test_a_backend_is_what_vllm_says_it_uses(line, backend):
    assert startup_figures([line]).get('backends') == ([backend] if backend else None)


def test_each_backend_once_in_the_order_first_named_and_a_bounded_list():
    ranks = [
        '(Worker_TP%d pid=%d) INFO 12-04 20:57:27 [cpu.py:175] Using CPU_MLA backend.' % (rank, rank)
        for rank in range(8)
    ]
    many = ['INFO 12-04 20:57:27 [x.py:1] Using B%02d backend.' % number for number in range(40)]
    assert startup_figures(ranks + many)['backends'] == ['CPU_MLA'] + ['B%02d' % number for number in range(15)]


def test_the_sandboxs_start_names_its_cpu_backends():
    """A tiny-kimi start on vLLM 0.32.0's CPU build with tensor parallel 2, as the sandbox's journal has it."""
    lines = [
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [interface.py:429] Using default backend '
        'AttentionBackendEnum.TORCH_SDPA for vit attention',
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [mm_encoder_attention.py:372] Using AttentionBackendEnum.TORCH_SDPA '
        'for MMEncoderAttention.',
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [cpu.py:175] Using CPU_MLA backend.',
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [selector.py:131] Using CPU_SDPA_MLA MLA prefill backend.',
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:27 [unquantized.py:364] Using CPU Unquantized MoE backend out of '
        "potential backends: ['CPU'].",
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:28 [unquantized.py:528] Using MoEPrepareAndFinalizeNoDPEPModular',
        '(Worker_TP0 pid=6458) INFO 12-04 20:57:28 [unquantized.py:529] Using CPUUnquantizedExperts MoE backend',
    ]
    assert startup_figures(lines)['backends'] == [
        'CPU_MLA',
        'CPU_SDPA_MLA MLA prefill',
        'CPU Unquantized MoE',
        'CPUUnquantizedExperts MoE',
    ]
