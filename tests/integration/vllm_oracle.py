# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What vLLM's own code (the CPU build in .venv-vllm) makes of checkpoint directories: the one oracle of the tests.

Run as a script by .venv-vllm's python, it reads each directory on its command line the way vLLM does at
start-up: get_config (hf_quant_config.json when config.json has no quantization_config), the ModelArch
convertor's quant-method normalization, resolve_kv_cache_dtype_string('auto'), the quant config class the
layers load (with the ModelOpt overrides); it prints one line, ORACLE {directory: report}. Imported by a
test, judge() runs it and returns the reports; kv_cache_dtype() derives from a report what the KV cache
becomes, with the Attention layer's rule that a kv_cache_scheme on the loaded quant config turns a dtype
still 'auto' into 'fp8' in layers that are not MLA (ModelConfig.use_mla: is_deepseek_mla and causal).
"""

import json
import os
import subprocess
import sys

# .venv-vllm has neither ansible nor this collection: nothing here imports them.
VLLM_PYTHON = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', '.venv-vllm', 'bin', 'python')


def report(path):
    """vLLM's view of one checkpoint directory (run under .venv-vllm's python)."""
    import types

    import vllm.config  # noqa: F401  (imported first: vllm.transformers_utils imports it circularly)
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    seen = {}
    try:
        cfg = get_config(path, trust_remote_code=False)
        text_cfg = cfg.get_text_config()
        convertor = ModelArchConfigConvertorBase(cfg, text_cfg)
        quant_cfg = convertor.get_quantization_config()  # normalizes quant_method in place, as ModelConfig does
        seen['config_class'] = type(cfg).__name__
        seen['quant_method'] = quant_cfg and quant_cfg['quant_method']
        seen['mla'] = bool(convertor.is_deepseek_mla() and getattr(text_cfg, 'is_causal', True))
        seen['resolved'] = resolve_kv_cache_dtype_string('auto', types.SimpleNamespace(hf_config=cfg))
        if quant_cfg is not None:
            name = quant_cfg['quant_method']
            for override in ('modelopt_fp4', 'modelopt'):
                if get_quantization_config(override).override_quantization_method(quant_cfg, None, hf_config=cfg):
                    name = override
                    break
            # weight_utils.get_quant_config: the checkpoint's quant class reads this dict.
            loaded = get_quantization_config(name).from_config(dict(quant_cfg))
            seen['loader'] = type(loaded).__name__
            seen['loader_kv_cache_quant_algo'] = getattr(loaded, 'kv_cache_quant_algo', None)
            seen['attention_kv_cache_scheme'] = getattr(loaded, 'kv_cache_scheme', None) is not None
    except Exception as exc:
        seen['error'] = '%s: %s' % (type(exc).__name__, exc)
    return seen


def kv_cache_dtype(seen):
    """The KV-cache dtype vLLM runs with --kv-cache-dtype auto, from a report."""
    if seen['resolved'] == 'auto' and seen.get('attention_kv_cache_scheme') and not seen['mla']:
        return 'fp8'
    return seen['resolved']


def judge(paths):
    """{directory: report} of vLLM for each checkpoint directory."""
    proc = subprocess.run(
        [VLLM_PYTHON, os.path.abspath(__file__)] + [str(p) for p in paths],
        capture_output=True,
        text=True,
        env=dict(os.environ, VLLM_TARGET_DEVICE='cpu', HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1'),
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith('ORACLE ')]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len('ORACLE ') :])


if __name__ == '__main__':
    print('ORACLE ' + json.dumps({path: report(path) for path in sys.argv[1:]}))
