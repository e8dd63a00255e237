# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import json
import re

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text

from ansible_collections.llmserve.vllm.plugins.module_utils._preload_smoke import (
    SmokeReportError,
    report_from_journal,
    summarize,
)

# A pip requirement that pins one release: vllm==0.33.0 (spaces allowed around the operator; ===, the arbitrary
# equality, pins as well).
_PINNED = re.compile(r'^\s*[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?\s*===?\s*([0-9][^,;\s]*)\s*(?:;.*)?$')


def vllm_flag_value(argv, flag):
    if not isinstance(argv, (list, tuple)):
        raise AnsibleFilterError('vllm_flag_value expects a list of arguments, got %s' % type(argv).__name__)
    flag = to_text(flag)
    if not flag.startswith('--'):
        raise AnsibleFilterError('vllm_flag_value expects a long option such as --max-num-seqs, got %r' % flag)
    words = [to_text(word) for word in argv]
    value = ''
    # As vLLM's argparse parser reads them: "--flag N" or "--flag=N", the last one wins.
    for position, word in enumerate(words):
        if word == flag and position + 1 < len(words):
            value = words[position + 1]
        elif word.startswith(flag + '='):
            value = word[len(flag) + 1 :]
    return value


# vLLM's flags for vllm_kimi_multimodal's modes of the vision encoder (recipes: data on 8-GPU nodes).
_MULTIMODAL_FLAGS = {
    'encoder_data_parallel': ['--mm-encoder-tp-mode', 'data'],
    'encoder_tensor_parallel': ['--mm-encoder-tp-mode', 'weights'],
    'text_only': ['--language-model-only'],
}
_SERVE_SETTINGS = frozenset(
    (
        'entrypoint',
        'model',
        'served_model_name',
        'host',
        'port',
        'tensor_parallel_size',
        'pipeline_parallel_size',
        'max_model_len',
        'gpu_memory_utilization',
        'kv_cache_memory_bytes',
        'kv_cache_dtype',
        'tool_call_parser',
        'reasoning_parser',
        'trust_remote_code',
        'multimodal',
        'allowed_media_domains',
        'limit_mm_per_prompt',
        'shutdown_timeout',
        'cluster_args',
        'extra_args',
    )
)
# vLLM fetches media from any host when --allowed-media-domains is empty: "no host" is a list whose only name can
# never resolve (RFC 6761 reserves .invalid).
NO_MEDIA_DOMAIN = 'media.invalid'


def vllm_serve_argv(settings):
    if not isinstance(settings, dict):
        raise AnsibleFilterError('vllm_serve_argv expects a mapping of settings, got %s' % type(settings).__name__)
    missing = sorted(_SERVE_SETTINGS - set(settings))
    unknown = sorted(set(settings) - _SERVE_SETTINGS)
    if missing or unknown:
        raise AnsibleFilterError(
            'vllm_serve_argv: settings missing %s, unknown %s'
            % (', '.join(missing) or 'none', ', '.join(unknown) or 'none')
        )
    s = settings
    # `vllm serve MODEL`: vLLM deprecates --model beside serve.
    argv = [to_text(word) for word in s['entrypoint']] + [to_text(s['model'])]
    argv += ['--served-model-name', to_text(s['served_model_name']), '--host', to_text(s['host'])]
    argv += ['--port', to_text(s['port'])]
    argv += ['--tensor-parallel-size', to_text(s['tensor_parallel_size'])]
    argv += ['--pipeline-parallel-size', to_text(s['pipeline_parallel_size'])]
    argv += ['--max-model-len', to_text(s['max_model_len'])]
    argv += ['--gpu-memory-utilization', to_text(s['gpu_memory_utilization'])]
    if s['kv_cache_memory_bytes']:
        argv += ['--kv-cache-memory-bytes', to_text(s['kv_cache_memory_bytes'])]
    if s['kv_cache_dtype'] != 'auto':
        argv += ['--kv-cache-dtype', to_text(s['kv_cache_dtype'])]
    # vLLM loads a tool parser only with --enable-auto-tool-choice: without it a request with tools
    # (tool_choice auto, the default) is refused 400.
    if s['tool_call_parser']:
        argv += ['--enable-auto-tool-choice', '--tool-call-parser', to_text(s['tool_call_parser'])]
    if s['reasoning_parser']:
        argv += ['--reasoning-parser', to_text(s['reasoning_parser'])]
    if s['trust_remote_code']:
        argv.append('--trust-remote-code')
    argv += _MULTIMODAL_FLAGS.get(s['multimodal'], [])
    argv += ['--allowed-media-domains'] + [
        to_text(domain) for domain in s['allowed_media_domains'] or [NO_MEDIA_DOMAIN]
    ]
    # --language-model-only takes no media at all.
    if s['limit_mm_per_prompt'] and s['multimodal'] != 'text_only':
        argv += ['--limit-mm-per-prompt', json.dumps(dict(s['limit_mm_per_prompt']), sort_keys=True)]
    if s['shutdown_timeout']:
        argv += ['--shutdown-timeout', to_text(s['shutdown_timeout'])]
    return argv + [to_text(word) for word in list(s['cluster_args']) + list(s['extra_args'])]


def pinned_version(spec):
    match = _PINNED.match(to_text(spec))
    return match.group(1) if match else ''


def preload_smoke_report(journal):
    try:
        return summarize(report_from_journal(journal))
    except SmokeReportError as exc:
        raise AnsibleFilterError('preload_smoke_report: %s' % exc) from None


class FilterModule:
    def filters(self):
        return {
            'vllm_flag_value': vllm_flag_value,
            'pinned_version': pinned_version,
            'vllm_serve_argv': vllm_serve_argv,
            'preload_smoke_report': preload_smoke_report,
        }
