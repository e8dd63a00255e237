# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


import json
import math
import re
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.parsing.convert_bool import boolean

from ansible_collections.llmserve.vllm.plugins.module_utils._shown import is_word, shown
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preload_smoke import (
    SmokeReportError,
    report_from_journal,
    summarize,
)

# A pip requirement that pins one release: vllm==0.33.0 (spaces allowed around the operator; ===, the arbitrary
# equality, pins as well). The version takes PEP 440's characters only: ==0.33.* matches every 0.33 release, a
# prefix and no pin.
_PINNED = re.compile(r'^\s*[A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?\s*===?\s*([0-9][A-Za-z0-9.!+_-]*)\s*(?:;.*)?$')
# A whole number of a setting is below 2**64 (20 digits): thousands of digits are no setting, and Python converts
# no more than 4,300 of them.
_WHOLE_NUMBER = re.compile(r'\s*[0-9]{1,20}\s*')
_WHOLE_NUMBER_LIMIT = 2**64
_LONG_OPTION = re.compile(r'--[a-z0-9][a-z0-9-]*')


def vllm_flag_value(argv, flag):
    if not isinstance(argv, (list, tuple)):
        raise AnsibleFilterError(
            'vllm_flag_value expects a list of arguments, got %s %s' % (type(argv).__name__, shown(argv))
        )
    if not isinstance(flag, str) or not flag.startswith('--'):
        raise AnsibleFilterError('vllm_flag_value expects a long option such as --max-num-seqs, got %s' % shown(flag))
    for word in argv:
        if not is_word(word):
            raise AnsibleFilterError(
                'vllm_flag_value expects arguments that are texts or numbers, got %s' % shown(word)
            )
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
        'uds',
        'tensor_parallel_size',
        'pipeline_parallel_size',
        'max_model_len',
        'gpu_memory_utilization',
        'kv_cache_memory_bytes',
        'kv_cache_dtype',
        'tool_call_parser',
        'trust_remote_code',
        'multimodal',
        'allowed_media_domains',
        'limit_mm_per_prompt',
        'flags',
        'cluster_args',
        'extra_args',
    )
)
# vLLM fetches media from any host when --allowed-media-domains is empty: "no host" is a list whose only name can
# never resolve (RFC 6761 reserves .invalid).
NO_MEDIA_DOMAIN = 'media.invalid'


def _refusal(key, expected, value):
    return AnsibleFilterError('vllm_serve_argv: %s must be %s, got %s' % (key, expected, shown(value)))


def _text(settings, key, optional=False):
    """The setting as one word; optional: None or '' is none, given as ''."""
    value = settings[key]
    if optional and value is None:
        return ''
    if not is_word(value) or (value == '' and not optional):
        raise _refusal(key, 'a text' if optional else 'a text that is not empty', value)
    return to_text(value)


def _whole_number(settings, key, optional=False):
    """The setting as a whole number, given as a number or as its digits (-e port=8000 gives a text); optional: None
    or '' is none, given as 0."""
    value = settings[key]
    if optional and (value is None or value == ''):
        return 0
    if isinstance(value, str) and _WHOLE_NUMBER.fullmatch(value) and int(value) < _WHOLE_NUMBER_LIMIT:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _WHOLE_NUMBER_LIMIT:
        return int(value)
    raise _refusal(key, 'a whole number, 0 or more and below 2**64', value)


def _fraction(settings, key):
    """The setting as a finite number, given as a number or as a text of one."""
    value = settings[key]
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not is_word(number)
        or (isinstance(number, float) and not math.isfinite(number))
    ):
        raise _refusal(key, 'a number', value)
    return number


def _boolean(settings, key):
    """The setting as a boolean. Ansible's own texts for one are read as it reads them: -e name=false gives the text
    'false', and the role's argument spec (type bool) validates it without converting it. Any other value would be
    read by its truth: 'false' as true."""
    value = settings[key]
    try:
        return boolean(value, strict=True)
    except (TypeError, ValueError):  # ValueError: its own message could not write an integer of 5,000 digits
        raise _refusal(key, 'a boolean: true or false (or yes, no, on, off, 1, 0)', value) from None


def _words(settings, key, required=False):
    """The setting, a list of words; a text would become a word per character."""
    value = settings[key]
    if not isinstance(value, (list, tuple)) or (required and not value):
        raise _refusal(key, 'a list of texts that is not empty' if required else 'a list of texts', value)
    for word in value:
        if not is_word(word):
            raise _refusal(key, 'a list of texts or numbers', value)
    return [to_text(word) for word in value]


def _media_limits(settings):
    """--limit-mm-per-prompt's JSON for the setting's mapping of modality to a count (or to vLLM's options of the
    modality, a mapping); '' for an empty one."""
    value = settings['limit_mm_per_prompt']
    expected = 'a mapping of modality to a whole number (or a mapping)'
    if not isinstance(value, Mapping):
        raise _refusal('limit_mm_per_prompt', expected, value)
    limits = dict(value)
    for modality, limit in limits.items():
        is_count = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
        if not isinstance(modality, str) or not (is_count or isinstance(limit, Mapping)):
            raise _refusal('limit_mm_per_prompt', expected, value)
    if not limits:
        return ''
    try:
        return json.dumps(limits, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(
            'vllm_serve_argv: limit_mm_per_prompt is no JSON (%s), got %s' % (exc, shown(value))
        ) from None


def _flags(settings):
    """The options that pass a value as it is, from the setting's mapping of option to value: the option and its
    value; the option alone for true; nothing for none, empty or false."""
    value = settings['flags']
    expected = 'a mapping of long options (--name) to a text, a number, a boolean or none'
    if not isinstance(value, Mapping):
        raise _refusal('flags', expected, value)
    argv = []
    for flag, given in value.items():
        finite = not isinstance(given, float) or math.isfinite(given)
        if not (isinstance(flag, str) and _LONG_OPTION.fullmatch(flag)) or not (
            given is None or isinstance(given, bool) or (is_word(given) and finite)
        ):
            raise _refusal('flags', expected, value)
        if given is True:
            argv.append(flag)
        elif given is not None and given is not False and given != '':
            argv += [flag, to_text(given)]
    return argv


def _cluster_args(nnodes, node_rank, master_addr, master_port):
    """vLLM's multi-node launcher: every node names the node count, its rank and the head's store; the others run
    --headless workers that join the head. Nothing for a single node."""
    if nnodes <= 1:
        return []
    argv = ['--nnodes', to_text(nnodes), '--node-rank', to_text(node_rank)]
    argv += ['--master-addr', master_addr, '--master-port', to_text(master_port)]
    return argv + ([] if node_rank == 0 else ['--headless'])


def vllm_cluster_args(nnodes, node_rank, master_addr, master_port):
    given = {'nnodes': nnodes, 'node_rank': node_rank, 'master_addr': master_addr, 'master_port': master_port}
    numbers = {key: _whole_number(given, key) for key in ('nnodes', 'node_rank', 'master_port')}
    if numbers['nnodes'] > 1 and numbers['node_rank'] >= numbers['nnodes']:
        raise _refusal('node_rank', 'below nnodes (%d)' % numbers['nnodes'], node_rank)
    address = _text(given, 'master_addr', optional=numbers['nnodes'] <= 1)
    return _cluster_args(numbers['nnodes'], numbers['node_rank'], address, numbers['master_port'])


def vllm_serve_argv(settings):
    if not isinstance(settings, dict):
        raise AnsibleFilterError(
            'vllm_serve_argv expects a mapping of settings, got %s %s' % (type(settings).__name__, shown(settings))
        )
    missing = sorted(_SERVE_SETTINGS - set(settings))
    # Keys of any type: sorted and joined as texts.
    unknown = sorted(to_text(key) for key in set(settings) - _SERVE_SETTINGS)
    if missing or unknown:
        raise AnsibleFilterError(
            'vllm_serve_argv: settings missing %s, unknown %s'
            % (', '.join(missing) or 'none', ', '.join(unknown) or 'none')
        )
    s = settings
    multimodal = _text(s, 'multimodal', optional=True)
    # A misspelt mode would otherwise leave its flag out silently.
    if multimodal and multimodal not in _MULTIMODAL_FLAGS:
        raise _refusal('multimodal', 'one of %s, or empty' % ', '.join(sorted(_MULTIMODAL_FLAGS)), s['multimodal'])
    # `vllm serve MODEL`: vLLM deprecates --model beside serve.
    argv = _words(s, 'entrypoint', required=True) + [_text(s, 'model')]
    argv += ['--served-model-name', _text(s, 'served_model_name')]
    host, port, uds = _text(s, 'host'), to_text(_whole_number(s, 'port')), _text(s, 'uds', optional=True)
    if uds and not uds.startswith('/'):
        raise _refusal('uds', 'an absolute path, or empty', s['uds'])
    # vLLM binds the Unix socket and ignores --host and --port where --uds is given.
    argv += ['--uds', uds] if uds else ['--host', host, '--port', port]
    argv += ['--tensor-parallel-size', to_text(_whole_number(s, 'tensor_parallel_size'))]
    argv += ['--pipeline-parallel-size', to_text(_whole_number(s, 'pipeline_parallel_size'))]
    argv += ['--max-model-len', to_text(_whole_number(s, 'max_model_len'))]
    argv += ['--gpu-memory-utilization', to_text(_fraction(s, 'gpu_memory_utilization'))]
    kv_cache_memory_bytes = _whole_number(s, 'kv_cache_memory_bytes', optional=True)
    if kv_cache_memory_bytes:
        argv += ['--kv-cache-memory-bytes', to_text(kv_cache_memory_bytes)]
    kv_cache_dtype = _text(s, 'kv_cache_dtype')
    if kv_cache_dtype != 'auto':
        argv += ['--kv-cache-dtype', kv_cache_dtype]
    # vLLM loads a tool parser only with --enable-auto-tool-choice: without it a request with tools
    # (tool_choice auto, the default) is refused 400.
    tool_call_parser = _text(s, 'tool_call_parser', optional=True)
    if tool_call_parser:
        argv += ['--enable-auto-tool-choice', '--tool-call-parser', tool_call_parser]
    if _boolean(s, 'trust_remote_code'):
        argv.append('--trust-remote-code')
    argv += _MULTIMODAL_FLAGS.get(multimodal, [])
    argv += ['--allowed-media-domains'] + (_words(s, 'allowed_media_domains') or [NO_MEDIA_DOMAIN])
    media_limits = _media_limits(s)
    # --language-model-only takes no media at all.
    if media_limits and multimodal != 'text_only':
        argv += ['--limit-mm-per-prompt', media_limits]
    return argv + _flags(s) + _words(s, 'cluster_args') + _words(s, 'extra_args')


# A setting's value that makes the renderer give each option it gives only under some setting (vllm_serve_argv):
# with these, every variant of the command line together names every option the role renders, on one node or many
# (head and workers), on a Unix socket or TCP, with each multimodal mode, with tools and without.
_EVERY_OPTION = {
    'kv_cache_memory_bytes': 1,
    'kv_cache_dtype': 'fp8',
    'tool_call_parser': 'any',
    'trust_remote_code': True,
    'limit_mm_per_prompt': {'image': 1},
}
_OPTION_WORD = re.compile(r'-{1,2}[A-Za-z]')


def _rendering_variants(settings):
    base = dict(settings, extra_args=[])
    base.setdefault('max_model_len', 1)
    flags = base['flags']
    every_option = dict(base, multimodal='', **_EVERY_OPTION)
    if isinstance(flags, Mapping):
        every_option['flags'] = dict.fromkeys(flags, True)
    yield base
    for uds, node_rank in (('', 0), ('/any.sock', 1)):
        yield dict(every_option, uds=uds, cluster_args=_cluster_args(2, node_rank, 'any', 1))
    for mode in _MULTIMODAL_FLAGS:
        yield dict(base, multimodal=mode)


def vllm_rendered_flags(settings):
    if not isinstance(settings, dict):
        raise AnsibleFilterError(
            'vllm_rendered_flags expects the mapping of settings vllm_serve_argv takes, got %s'
            % type(settings).__name__
        )
    skip = len(_words(settings, 'entrypoint', required=True)) + 1
    flags: set[str] = set()
    for variant in _rendering_variants(settings):
        # The options: a value that begins with a dash and a letter (which vLLM's parser would take for an option
        # too) counts as one, which refuses more, never less.
        words = vllm_serve_argv(variant)[skip:]
        flags.update(word for word in words if _OPTION_WORD.match(word))
    return sorted(flags)


# vLLM 0.33's short spellings of its long options (vllm/engine/arg_utils.py; -O in vllm/utils/argparse_utils.py): the
# extra arguments may name an option the role renders by its short spelling (-tp 2, -r 1).
_SHORT_OPTIONS = {
    '-ac': '--attention-config',
    '-cc': '--compilation-config',
    '-dc': '--diffusion-config',
    '-dcp': '--decode-context-parallel-size',
    '-dp': '--data-parallel-size',
    '-dpa': '--data-parallel-address',
    '-dpb': '--data-parallel-backend',
    '-dpe': '--data-parallel-external-lb',
    '-dph': '--data-parallel-hybrid-lb',
    '-dpl': '--data-parallel-size-local',
    '-dpm': '--data-parallel-multi-port-external-lb',
    '-dpn': '--data-parallel-rank',
    '-dpp': '--data-parallel-rpc-port',
    '-dpr': '--data-parallel-start-rank',
    '-ep': '--enable-expert-parallel',
    '-n': '--nnodes',
    '-O': '--optimization-level',
    '-pcp': '--prefill-context-parallel-size',
    '-pp': '--pipeline-parallel-size',
    '-q': '--quantization',
    '-r': '--node-rank',
    '-sc': '--speculative-config',
    '-tp': '--tensor-parallel-size',
}


def _names(word, long_flag):
    """Whether vLLM's parser may read the word as the long option: in "_" for "-" and in any case, up to "=" or "."
    (--limit-mm-per-prompt.image 2 sets a key of --limit-mm-per-prompt), abbreviated (argparse takes any beginning:
    --hos for --host), or by its short spelling, abbreviated too (-t for -tp) or with its value attached (-r1)."""
    name = re.split('[=.]', word, maxsplit=1)[0]
    if name.startswith('--'):
        name = '--' + name[2:].lower().replace('_', '-')
        return len(name) > 2 and long_flag.startswith(name)
    return len(name) > 1 and any(
        long_name == long_flag and (short.startswith(name) or (len(short) == 2 and name.startswith(short)))
        for short, long_name in _SHORT_OPTIONS.items()
    )


def vllm_flags_named(argv, flags):
    if not isinstance(argv, (list, tuple)) or not isinstance(flags, (list, tuple)):
        raise AnsibleFilterError(
            'vllm_flags_named expects a list of arguments and a list of options, got %s and %s'
            % (shown(argv), shown(flags))
        )
    for word in list(argv) + list(flags):
        if not is_word(word):
            raise AnsibleFilterError('vllm_flags_named expects texts or numbers, got %s' % shown(word))
    words = [to_text(word) for word in argv if to_text(word).startswith('-')]
    # A short option among flags stands for its long one.
    wanted = [to_text(flag) for flag in flags]
    return [flag for flag in wanted if any(_names(word, _SHORT_OPTIONS.get(flag, flag)) for word in words)]


def pinned_version(spec):
    if not isinstance(spec, str):
        raise AnsibleFilterError('pinned_version expects a pip requirement, a text, got %s' % shown(spec))
    match = _PINNED.match(spec)
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
            'vllm_flags_named': vllm_flags_named,
            'pinned_version': pinned_version,
            'vllm_serve_argv': vllm_serve_argv,
            'vllm_rendered_flags': vllm_rendered_flags,
            'vllm_cluster_args': vllm_cluster_args,
            'preload_smoke_report': preload_smoke_report,
        }
