# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run in .venv-vllm by test_preload_smoke.py: the smoke's attention_path and path_needs against
vLLM's real CUDA selector (vllm/platforms/cuda.py), with the GPU's capability given as MAJOR MINOR. Prints JSON.

The CPU wheel carries the CUDA platform's Python but not its compiled ops: an empty vllm._C_stable_libtorch lets
vllm/platforms/cuda.py import; the backends whose kernels the CPU wheel lacks say so in their rejection reasons.
"""

import importlib.machinery
import importlib.util
import json
import sys
import types
from unittest import mock

sys.modules['vllm._C_stable_libtorch'] = types.ModuleType('vllm._C_stable_libtorch')

import torch  # noqa: E402
from vllm.platforms.cuda import CudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

smoke_path, major, minor = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loader = importlib.machinery.SourceFileLoader('llmserve_preload_smoke', smoke_path)
spec = importlib.util.spec_from_loader(loader.name, loader)
assert spec is not None
smoke = importlib.util.module_from_spec(spec)
loader.exec_module(smoke)

# Kimi-K2.5's decoder layers: MLA with a latent of 512 + 64, 64 heads, 8 per rank at TP 8, bf16, vLLM's block size.
config = AttentionSelectorConfig(
    head_size=576, dtype=torch.bfloat16, kv_cache_dtype='auto', block_size=None, use_mla=True
)
capability = DeviceCapability(major, minor)
with mock.patch.object(CudaPlatform, 'get_device_capability', classmethod(lambda cls, device_id=0: capability)):
    picked, rejected = smoke.attention_path(CudaPlatform, config, 8)
paths = {'platform': 'cuda', 'attention': picked, 'attention_rejected': rejected, 'sampler': 'pytorch'}
paths['flashinfer_kernels'] = False
print(
    json.dumps(
        {'attention': picked, 'rejected': [name for name, _reason in rejected], 'needs': smoke.path_needs(paths)}
    )
)
