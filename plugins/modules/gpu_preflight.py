#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: gpu_preflight
short_description: Predict whether a model fits the GPUs, and with how much context, before vLLM loads it
version_added: 0.1.0
description:
  - "Answers, in well under a second and before anything loads, what vLLM would only say after loading the weights
    (many minutes for a 540 GB checkpoint): whether the KV cache for O(max_model_len) fits, how many tokens it holds, and the
    largest context that fits."
  - Weight bytes come from the safetensors headers (never the tensor data), read from the Hub before the shards are
    downloaded where O(hub) names the revision. Without them they come
    from C(config.json)'s dimensions and quantization config for the tensors C(model.safetensors.index.json) names
    (Llama, Mistral, Qwen2/3 and their mixtures of experts, Mixtral, DeepSeek-V2/V3, Kimi-K2/K2.5; FP8 blocks, ModelOpt
    NVFP4, compressed-tensors integer groups; a weight with a scale beside it in the index is quantized), else from the
    index's C(total_size). Shards that the index names but are missing or truncated are reported as problems.
  - What vLLM adds after loading counts too (a bfloat16 copy of a quantized MLA C(kv_b_proj); vLLM 0.7's absorbed MLA
    matrices), and where the tensor sizes are predicted (C(config.json)'s dimensions, the index's total) the plan keeps a
    margin of 2 % of the predicted weights beside them (RV(weights_margin_bytes_per_gpu)); in the collected start-up logs
    vLLM's C(Model loading took) was at most 1.4 % above the prediction. Weights read from the headers get none.
  - Per-GPU weights follow vLLM's tensor and pipeline parallelism; tensors every tensor-parallel rank holds in full (the MLA
    q_a/kv_a down-projections, norms, router gates; GQA key/value projections when there are fewer KV heads than ranks) are
    counted in full on every GPU; layers past C(num_hidden_layers) (DeepSeek's MTP layer) are not counted since vLLM does not load them.
  - "KV bytes per token per GPU: multi-head latent attention (DeepSeek-V3, Kimi-K2/K2.5) caches
    num_hidden_layers × (kv_lora_rank + qk_rope_head_dim) × dtype bytes on every rank, not divided by tensor parallelism;
    standard and grouped-query attention 2 × ceil(num_key_value_heads / tensor_parallel_size) × head_dim × dtype bytes × num_hidden_layers."
  - "The KV budget per GPU is vLLM's: ceil(memory.total × gpu_memory_utilization) − weights per GPU − reserve, or exactly
    O(kv_cache_memory_bytes) when given."
  - "Also reports, in RV(problems), what else breaks a start: fewer GPUs than O(tensor_parallel_size) × O(pipeline_parallel_size),
    GPU memory held by other processes (named with PID and process name), a too small O(shm_path), O(port) already in use,
    and a missing C(/dev/nvidia-uvm) (O(dev_path)). A GPU whose persistence mode is off (nvidia-smi's C(persistence_mode))
    is a warning."
  - The config is read from C(config.json), or its C(text_config) for multimodal checkpoints.
  - "With O(hub) and no C(config.json) in O(model_path) (or no O(model_path) yet), everything the plan reads comes from
    the Hub revision, in memory: C(config.json), C(hf_quant_config.json) where vLLM reads it, the weights index where
    the revision has one, and the safetensors headers over byte ranges (RV(config_source=hub), RV(weights_source=hub)).
    Nothing is written on the host, so the plan can come first, in check mode too."
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
options:
  model_path:
    description:
      - Directory of the Hugging Face checkpoint, holding C(config.json) and the safetensors shards or at least
        C(model.safetensors.index.json).
      - "With O(hub), it may lack C(config.json) or not exist yet (the directory the checkpoint will be staged in): the
        files missing from it are read from the Hub revision (RV(config_source)). It is never created."
    type: path
    required: true
  tensor_parallel_size:
    description: vLLM's C(--tensor-parallel-size).
    type: int
    default: 1
  pipeline_parallel_size:
    description: vLLM's C(--pipeline-parallel-size). Layers are split over stages as vLLM's C(get_pp_indices) does.
    type: int
    default: 1
  gpu_memory_utilization:
    description: vLLM's C(--gpu-memory-utilization), the fraction of each GPU's memory vLLM may use (0 < value <= 1).
    type: float
    default: 0.9
  max_model_len:
    description:
      - The context length to check, an integer, or V(auto) for the largest that fits, capped at the model's
        C(max_position_embeddings).
    type: raw
    default: auto
  decode_context_parallel_size:
    description:
      - vLLM's C(--decode-context-parallel-size) (C(-dcp)), which splits each request's MLA latent cache by token across
        that many tensor-parallel ranks, so that a rank holds 1/dcp of it. Under plain tensor parallelism every rank
        holds the whole latent (one KV head), and more GPUs add no KV capacity.
      - V(auto) plans none where the asked O(max_model_len) fits without it. Where it does not, and the checkpoint is
        MLA on GPUs, the plan takes the smallest size dividing O(tensor_parallel_size) that holds one request of
        O(max_model_len), with O(max_num_seqs) as given or, where not given, the largest of vLLM's default, 256, 128, 64,
        32, 16 and 8 that fits (TRITON_MLA's decode workspace grows with the size); RV(decode_context_parallel) says
        what it costs.
      - V(1) forbids it; a context that does not fit is then refused with the largest that fits, and a remedy names the
        size that would hold it. Another number is taken as given; it must divide O(tensor_parallel_size), and the
        preflight sizes it for MLA checkpoints on GPUs only.
      - Speculative decoding with it takes vLLM's slower draft path (a warning).
    type: raw
    default: auto
    version_added: 0.2.0
  kv_cache_dtype:
    description:
      - vLLM's C(--kv-cache-dtype). V(auto) follows the checkpoint as vLLM does (C(get_kv_cache_quant_algo_string) in
        C(vllm/utils/torch_utils.py)), a ModelOpt C(kv_cache_scheme) or C(kv_cache_quant_algo) in the top-level
        C(quantization_config) or C(hf_quant_config.json) gives V(fp8_e4m3); otherwise the model's dtype.
    type: str
    default: auto
    choices: [auto, bfloat16, float16, half, float32, fp8, fp8_e4m3, fp8_e5m2]
  fp8_kv_cache_policy:
    description:
      - What the deploy does with an FP8 KV cache that the checkpoint asks for; the plan (RV(kv_cache_dtype) and the
        figures that follow from it) assumes this decision, returned as RV(fp8_kv_cache_stripped).
      - V(auto) strips it only where RV(strip_fp8_kv_cache) says the GPU needs it, V(strip) always, V(keep) never.
      - The checkpoint is judged as shipped, also after M(llmserve.vllm.kv_cache_quant) stripped it (its record beside
        the checkpoint says what it was), so that repeated runs decide alike.
    type: str
    choices: [auto, strip, keep]
    default: auto
  kv_cache_memory_bytes:
    description:
      - "Mirrors vLLM's C(--kv-cache-memory-bytes) (and C(VLLM_CPU_KVCACHE_SPACE) on the CPU build): the KV budget per GPU is
        then exactly this, and O(gpu_memory_utilization) is ignored for it. Required with O(accelerator=cpu)."
    type: int
  weights_bytes_per_gpu:
    description:
      - Weight bytes per GPU, when known better than the headers tell, for example from vLLM's C(Model loading took X GiB)
        of an earlier start.
    type: int
  gpus:
    description:
      - The GPUs to plan for, instead of querying nvidia-smi (planning for hardware not at hand).
    type: list
    elements: dict
    suboptions:
      name:
        description: GPU name.
        type: str
        required: true
      memory_total_mib:
        description: Total memory in MiB as nvidia-smi reports it (an RTX PRO 6000 Blackwell has 97887).
        type: int
        required: true
      compute_capability:
        description: Compute capability, for example V(12.0) or V(9.0).
        type: str
        required: true
      memory_used_mib:
        description: Memory already in use, in MiB.
        type: int
        default: 0
  fail_on_misfit:
    description:
      - Fail when the requested O(max_model_len) does not fit, or when RV(problems) lists anything else that breaks a start.
      - With V(false) the module does not fail on these; RV(max_model_len) is then the largest length that fits. It still
        fails when no context length fits at all (not one KV-cache block, or no GPU), since there is no length to start with.
    type: bool
    default: true
  accelerator:
    description:
      - "V(nvidia) reads nvidia-smi (or O(gpus)). V(cpu) plans for the CPU build of vLLM: no nvidia-smi is read, GPU checks are
        skipped, O(kv_cache_memory_bytes) is required and is the budget, and RV(strip_fp8_kv_cache) is false."
    type: str
    default: nvidia
    choices: [nvidia, cpu]
  nvidia_smi_path:
    description: The nvidia-smi program, a name looked up on E(PATH) or an absolute path.
    type: path
    default: nvidia-smi
  nvidia_smi_timeout:
    description:
      - Seconds each of the two nvidia-smi queries may take (1 to 86400). A wedged NVIDIA driver hangs nvidia-smi; past the
        deadline it is killed and the module fails, naming the query and the deadline. Output beyond 16 MiB is refused too.
    type: int
    default: 30
  reserve_bytes_per_gpu:
    description:
      - Memory per GPU outside weights and KV cache. Given, it is used as is (set it from a real start, total ×
        utilization − weights − the KV cache vLLM logged, for an exact plan).
      - "Not given, it is estimated in the terms vLLM's C(determine_available_memory) uses, returned part by part as
        RV(reserve): the larger of the activation peak of the profile run at O(max_num_batched_tokens) tokens (from
        C(hidden_size), C(intermediate_size) and, for mixtures of experts, C(moe_intermediate_size) and
        C(num_experts_per_tok) in C(config.json), divided by tensor parallelism) and the sampler's dummy run over
        O(max_num_seqs) × C(vocab_size) logits (40 bytes each); non-torch memory (cuBLAS and the like; the current
        vLLM leaves the NCCL communicators to the headroom, so they are not counted); the CUDA-graph memory vLLM
        estimates and subtracts since 0.21 (16 MiB a layer); gpu_memory_utilization × the memory nvidia-smi
        counts but CUDA does not offer (616 MiB on an H200, measured; 640 MiB on other GPUs); and, from vLLM 0.33, for
        an MLA model on GPUs where vLLM runs the TRITON_MLA backend (compute capability 12.x, and below 9.x), its
        decode workspace, O(max_num_seqs) × the attention heads per GPU × its split count × (C(kv_lora_rank) + 1) × 4
        bytes (see O(gpu_sm_count))."
      - A C(config.json) without C(hidden_size) or C(vocab_size) gets 5 GiB (5368709120) and a warning. 0 on the CPU
        build, whose KV space is fixed. Ignored when O(kv_cache_memory_bytes) is given.
      - Calibrated against real vLLM start-up logs (C(tests/fixtures/startup_logs); C(docs/preflight-accuracy.md) has the
        figures).
    type: int
  max_num_seqs:
    description:
      - vLLM's C(--max-num-seqs), for the reserve's sampler, penalty-count and MLA decode-workspace terms. Not given,
        vLLM's default for C(vllm serve) (1024 on GPUs of 70 GiB or more but the A100, else 256; vLLM 0.33/0.34's
        C(EngineArgs.get_batch_defaults) in C(engine/arg_utils.py)).
    type: int
  gpu_sm_count:
    version_added: 0.2.0
    description:
      - The streaming multiprocessors of one GPU, for the split count of TRITON_MLA's decode workspace, which vLLM caps
        at twice the SM count (C(_compute_num_kv_splits) in C(v1/attention/backends/mla/triton_mla.py)).
      - Not given, the preflight's table by nvidia-smi's GPU name (RTX PRO 6000 Blackwell 188, RTX 5090 170, L40S 142,
        RTX 4090 128, A100 108, ...); for a GPU the table does not know, the splits are not capped (the larger
        workspace) and the plan warns. nvidia-smi does not print it; CUDA's deviceQuery does ("Multiprocessors").
    type: int
  max_num_batched_tokens:
    description:
      - vLLM's C(--max-num-batched-tokens), the tokens of the profile run that sets the reserve's activation term. Not
        given, vLLM's default for C(vllm serve) (8192 on GPUs of 70 GiB or more but the A100, 16384 on GPUs of 160 GiB
        or more from 0.33, else 2048).
    type: int
  memory_key:
    description:
      - What else decides vLLM's memory at start that the module does not see, for the plan's memory key (RV(memory_key));
        the role passes the model revision, the vLLM package spec and its other serving flags.
      - Its C(serve_flags) also tell the reserve whether vLLM runs eager. With C(--enforce-eager) among them vLLM captures no
        CUDA graphs and estimates none, so RV(reserve.cuda_graphs) is V(0).
      - The key also holds the GPUs' model and count, the resolved KV-cache dtype and the memory options
        (O(tensor_parallel_size), O(pipeline_parallel_size), O(gpu_memory_utilization), O(kv_cache_memory_bytes),
        O(max_num_seqs), O(max_num_batched_tokens), O(block_size), O(multimodal)), the decode context parallel size where
        it is over 1, and O(max_model_len) only through
        the split count of TRITON_MLA's decode workspace (RV(reserve.mla_decode_splits)) where it applies; otherwise
        the KV cache vLLM sizes does not depend on the context length.
    type: dict
    default: {}
  measurements_dir:
    description:
      - A directory of vLLM's figures measured at earlier starts, one C(<memory_key_id>.json) per memory key, as the
        role records them after each passed gate (keys C(memory_key_id), C(startup), C(recorded_at), C(host); C(startup) as
        M(llmserve.vllm.chat_check) returns it). A file for this plan's RV(memory_key_id) that gives the KV tokens
        sets RV(kv_cache_tokens) to them exactly (RV(kv_cache_tokens_source=measured)); the prediction is
        returned as RV(predicted).
      - A missing directory, and files that are not such measurements, are passed over.
    type: path
  measurements:
    description:
      - Measurements as in O(measurements_dir), given directly (the role passes those of the other hosts of the
        play, so that nodes of one memory key share one node's measurement). The newest that matches wins.
    type: list
    elements: dict
    default: []
  multimodal:
    description:
      - How vLLM serves a checkpoint with a vision tower (C(vision_config) in C(config.json)), as the role's
        C(vllm_kimi_multimodal) sets it. V(text_only) (C(--language-model-only)) skips the encoder; with
        V(encoder_data_parallel) or V(encoder_tensor_parallel) the reserve counts the encoder outputs that vLLM's
        profile run keeps through the language model's dummy run (max(O(max_num_batched_tokens), the largest
        item's tokens) embeddings of the hidden size; the largest item is taken to be within O(max_num_batched_tokens),
        as Kimi-K2.5's 4225-token image is within 8192). The vision tower's weights count as replicated on every GPU
        in every mode.
      - Without a vision tower it changes nothing.
    type: str
    choices: [text_only, encoder_data_parallel, encoder_tensor_parallel]
    default: encoder_data_parallel
  hub:
    description:
      - The Hub revision the checkpoint comes from, for a plan before its shards are downloaded. Where
        O(model_path) holds the weights index but none of its shards, the module reads each shard's safetensors
        header over two byte ranges of C({endpoint}/{repo_id}/resolve/{revision}/{file}) (a few kilobytes a shard, as
        huggingface_hub's C(get_safetensors_metadata) does), so every tensor is sized exactly
        (RV(weights_source=hub)).
      - Where the headers cannot be had (no network, a gated repository without O(hub.token)), a warning says why and
        the weights come from C(config.json)'s layout. The role passes its staged revision.
      - "Where O(model_path) has no C(config.json) (or does not exist), the plan is made from the revision alone,
        read into memory and written nowhere: C(config.json) and, where the revision has them, C(hf_quant_config.json)
        (read when C(config.json) has no C(quantization_config), as vLLM does) and C(model.safetensors.index.json) from
        C({endpoint}/{repo_id}/resolve/{revision}/{file}); the revision's files are listed by
        C({endpoint}/api/models/{repo_id}/revision/{revision}?blobs=true). Without an index, every top-level
        C(*.safetensors) file of the revision (a single C(model.safetensors)) is sized from its header over byte ranges.
        Where O(model_path) has C(config.json) but neither the index nor a shard, the weights alone come from the Hub."
      - "When C(config.json) cannot be had from the Hub, or the weights of a revision without an index, the module
        fails naming the URL and the cause: a private or gated repository without O(hub.token) (set it), a token
        refused, no such repository or revision (HTTP 404), or no answer. The token is sent to the endpoint only and
        appears in no message or return value."
    type: dict
    suboptions:
      repo_id:
        description: The repository, C(owner/name).
        type: str
        required: true
      revision:
        description: The revision, best its full commit.
        type: str
        required: true
      endpoint:
        description: The Hub or a mirror of it.
        type: str
        default: https://huggingface.co
      token:
        description: A token for gated or private repositories, sent to the endpoint only (not to the storage it redirects to).
        type: str
      timeout:
        description:
          - Seconds for each request to the Hub (each file, the list of files, each shard's two byte ranges together).
        type: int
        default: 30
  vllm_version:
    description:
      - The vLLM release that will serve (V(0.33.0)), for what differs between releases. The sampler of vLLM's profile
        run (PyTorch's sort-based top-k/top-p at 38 bytes a logit before 0.33, FlashInfer's sort-free one at 14 with
        the model runner's int32 penalty counts from 0.33), V0's accounting of the NCCL communicators before 0.10, the
        CUDA-graph estimate subtracted since 0.21, the matrices vLLM 0.7 absorbs into MLA's weights, and TRITON_MLA's
        decode workspace reserved in the profile run from 0.33 (vllm#46819).
      - Not given, or not a version, it is taken to be a current one (0.34 or later). The role passes the version
        pinned in C(vllm_kimi_package_spec).
    type: str
  block_size:
    description:
      - vLLM's KV-cache block size in tokens; the cache is allocated in whole blocks. 16 is vLLM's usual size on GPUs and its
        CPU build's for MLA; the CPU build uses 128 for standard attention (a difference of at most 0.2% in RV(kv_cache_tokens)).
    type: int
    default: 16
  port:
    description: TCP port vLLM will listen on; a problem is reported if another process already listens there.
    type: int
  host:
    description: Address vLLM will listen on, used when C(/proc/net/tcp) cannot be read.
    type: str
    default: 127.0.0.1
  service_name:
    description:
      - The systemd unit of our own vLLM (for example V(vllm) or V(vllm.service)), which the deploy restarts. Processes in
        that unit (their C(/proc/PID/cgroup) path names it) do not count as holding GPU memory or the port.
    type: str
  shm_path:
    description: The shared-memory filesystem NCCL and vLLM use.
    type: path
    default: /dev/shm
  shm_min_bytes:
    description:
      - Smallest acceptable size of O(shm_path). NCCL's shared-memory transport needs buffers for each pair of ranks
        (56 directed pairs at tensor parallel 8, a few MiB each), and vLLM's shared-memory message queues and PyTorch's tensor
        passing between worker processes need more; Docker's default 64 MiB is known to break NCCL. 1 GiB is ample for
        tensor parallel 8. V(0) skips the check.
    type: int
    default: 1073741824
  dev_path:
    description:
      - Directory of the NVIDIA device nodes. With O(accelerator=nvidia) and GPUs read from nvidia-smi (not O(gpus)),
        a missing C(nvidia-uvm) there is a problem, since CUDA needs it and a service without privileges cannot create
        it. The remedy named is C(nvidia-modprobe -u -c=0) as root, or loading the C(nvidia_uvm) module.
      - Tests point it at a directory built from a real host's listing; deployments keep the default.
    type: path
    default: /dev
  setting_names:
    version_added: 0.2.0
    description:
      - How the module's own messages name its options, for a caller that sets them under names of its own. Each
        key is an option of this module, each value the name the caller's user sets. The vllm_kimi role maps each
        option it sets from a role variable to that variable, so that a remedy reads C(set vllm_kimi_max_model_len to
        160960), not C(set max_model_len to 160960).
      - The remedies, the warnings and the messages of a refusal or of a preflight that cannot answer use these
        names. RV(problems) keep vLLM's own words.
      - A key that is no option of this module is refused.
    type: dict
    default: {}
notes:
  - "Checked against vLLM 0.32.0 (CPU build): the predicted RV(kv_cache_tokens) for a grouped-query Llama (bf16 and fp8) and an
    MLA DeepSeek-V3 are within 0.12% of vLLM's logged C(CPU KV cache size)."
  - Only the headers of the safetensors files are read, so a 540 GB checkpoint in 119 shards is analysed in milliseconds.
  - "On compute capability 12.x (RTX PRO 6000 Blackwell) vLLM's MLA backend could not use an FP8 KV cache; when the
    checkpoint asks for one there, RV(strip_fp8_kv_cache) is true and the plan assumes the model's dtype for the KV cache."
seealso:
  - name: vLLM memory usage
    description: How vLLM sizes the KV cache.
    link: https://docs.vllm.ai/en/latest/configuration/conserving_memory/
"""

EXAMPLES = r"""
- name: Check that Kimi-K2.5 fits the eight GPUs with a 131072-token context
  llmserve.vllm.gpu_preflight:
    model_path: /srv/models/Kimi-K2.5-NVFP4
    tensor_parallel_size: 8
    gpu_memory_utilization: 0.95
    max_model_len: 131072
    port: 8000
    service_name: vllm
  register: __preflight

- name: Plan for hardware not at hand, before downloading the shards
  llmserve.vllm.gpu_preflight:
    model_path: /srv/models/Kimi-K2.5-NVFP4
    tensor_parallel_size: 8
    max_model_len: auto
    fail_on_misfit: false
    gpus: "{{ [{'name': 'NVIDIA RTX PRO 6000 Blackwell Server Edition', 'memory_total_mib': 97887, 'compute_capability': '12.0'}] * 8 }}"

- name: Plan from the Hub revision before anything of it is on the host
  llmserve.vllm.gpu_preflight:
    model_path: /srv/models/Kimi-K2.5-NVFP4/0123456789abcdef0123456789abcdef01234567
    hub:
      repo_id: nvidia/Kimi-K2.5-NVFP4
      revision: 0123456789abcdef0123456789abcdef01234567
      token: "{{ hf_token }}"
    tensor_parallel_size: 8
    max_model_len: 131072
  check_mode: true

- name: Size the KV cache of the CPU build of vLLM
  llmserve.vllm.gpu_preflight:
    model_path: /srv/models/tiny-chat
    accelerator: cpu
    kv_cache_memory_bytes: 1073741824
"""

RETURN = r"""
decode_context_parallel_size:
  description:
    - The C(--decode-context-parallel-size) the plan is sized with (V(1) where it plans none). The role renders it where
      it is over 1, with the C(max_num_seqs) of RV(decode_context_parallel) as C(--max-num-seqs).
  returned: always
  type: int
  sample: 2
  version_added: 0.2.0
decode_context_parallel:
  description:
    - What decode context parallelism costs and holds in this plan.
    - C(size) as RV(decode_context_parallel_size); C(source) V(planned) (auto found the asked context needs it),
      V(given) or V(not needed) (auto, and the context fits without it).
    - C(max_num_seqs) and C(max_num_seqs_source) (V(given), V(planned) or V(default), vLLM's) are the sequences the
      plan is sized for; C(full_length_requests) how many requests of RV(max_model_len) the KV cache holds at once;
      C(mla_decode_workspace_bytes) TRITON_MLA's decode workspace per GPU at that size (0 where it does not apply).
  returned: always
  type: dict
  sample:
    size: 2
    source: planned
    max_num_seqs: 64
    max_num_seqs_source: given
    full_length_requests: 1.88
    mla_decode_workspace_bytes: 790069248
  version_added: 0.2.0
gpus:
  description:
    - The GPUs planned for (the first O(tensor_parallel_size) × O(pipeline_parallel_size)), with the processes holding their memory.
    - C(persistence_mode) is nvidia-smi's (V(Enabled), V(Disabled)), empty when it could not be read or for O(gpus).
  returned: always
  type: list
  elements: dict
  sample:
    - index: 0
      name: NVIDIA H200
      memory_total_mib: 143771
      memory_used_mib: 10767
      compute_capability: '9.0'
      driver_version: 580.159.04
      persistence_mode: Enabled
      uuid: GPU-5cc339a9-9917-25f6-912e-7bd3ebe1758a
      processes:
        - pid: 578
          process_name: python3
          used_memory_mib: 10758
          ours: false
driver_version:
  description: The NVIDIA driver version, empty for O(accelerator=cpu) or O(gpus).
  returned: always
  type: str
  sample: 580.159.04
weights_bytes_total:
  description: Bytes of all weights in the checkpoint (sum of the safetensors headers, or the index's C(total_size)).
  returned: always
  type: int
  sample: 540000000000
weights_bytes_per_gpu:
  description: Weight bytes on the most loaded GPU, as vLLM holds them after loading (predicted; as given with O(weights_bytes_per_gpu)).
  returned: always
  type: int
  sample: 74427253056
weights_margin_bytes_per_gpu:
  description:
    - What the plan keeps beside predicted weights, 2 % of RV(weights_bytes_per_gpu) where RV(weights_source) is
      V(config) or V(index); V(0) for weights read from the headers (V(headers), V(hub)) and for O(weights_bytes_per_gpu).
      The KV budget, RV(max_model_len_fit) and the remedies are computed with it.
  returned: always
  type: int
  sample: 1488545062
weights_source:
  description:
    - Where RV(weights_bytes_per_gpu) comes from. V(headers) (the shards' safetensors headers), V(hub) (before the
      download, the headers of the index's shards or of a revision's single file, read from the Hub over byte ranges,
      O(hub)), V(config) (before the download, C(config.json)'s dimensions for the tensors the index names), V(index)
      (the index's C(total_size) shared out, for a family the layout does not model) or V(given)
      (O(weights_bytes_per_gpu)).
  returned: always
  type: str
  choices: [headers, hub, config, index, given]
  sample: config
config_source:
  description:
    - Where C(config.json) and C(hf_quant_config.json) came from, V(local) (O(model_path)) or V(hub) (read in memory
      from the O(hub) revision, as O(model_path) has no C(config.json)). RV(weights_source) says where the weights'
      sizes came from.
  returned: success, and failures after the checkpoint's files were read
  type: str
  choices: [local, hub]
  sample: hub
reserve_bytes_per_gpu:
  description: The reserve for activations, non-torch memory and CUDA graphs that was used.
  returned: always
  type: int
  sample: 4218421657
reserve:
  description:
    - Where RV(reserve_bytes_per_gpu) comes from, in bytes per GPU. C(source) is V(given) (O(reserve_bytes_per_gpu)),
      V(cpu) (0), V(estimated) or V(fallback) (5 GiB, as C(config.json) lacks the sizes). An estimate also has its parts
      and the batching it assumed.
  returned: always
  type: dict
  contains:
    source:
      description: V(given), V(cpu), V(estimated) or V(fallback).
      type: str
      returned: always
    total:
      description: The reserve, equal to RV(reserve_bytes_per_gpu).
      type: int
      returned: always
    max_num_seqs:
      description: The max_num_seqs the estimate assumed (O(max_num_seqs) or vLLM's default).
      type: int
      returned: when source is V(estimated) or V(fallback)
    max_num_batched_tokens:
      description: The max_num_batched_tokens the estimate assumed (O(max_num_batched_tokens) or vLLM's default).
      type: int
      returned: when source is V(estimated) or V(fallback)
    activation:
      description:
        - The larger of the profile run's activation peak and the sampler's dummy run over max_num_seqs × vocabulary
          logits (with the batch's hidden states it keeps alive), by the sampler of O(vllm_version); from vLLM 0.26,
          with the Triton top-k/top-p's buffer and, for unquantized mixture-of-experts weights, the Triton experts'
          workspace that vLLM keeps through the sampler's run.
      type: int
      returned: when source is V(estimated)
    non_torch:
      description: cuBLAS workspaces, and NCCL and custom all-reduce buffers under tensor parallelism.
      type: int
      returned: when source is V(estimated)
    cuda_graphs:
      description: The CUDA-graph memory vLLM 0.21 and later subtracts before sizing the KV cache; V(0) with C(--enforce-eager).
      type: int
      returned: when source is V(estimated)
    driver:
      description: gpu_memory_utilization × the memory nvidia-smi counts but CUDA does not offer.
      type: int
      returned: when source is V(estimated)
    encoder_outputs:
      description:
        - The vision encoder's outputs that the profile run keeps through the language model's dummy run (see
          O(multimodal)); V(0) without a vision tower or with O(multimodal=text_only).
      type: int
      returned: when source is V(estimated)
    penalty_counts:
      description:
        - vLLM 0.33's per-sequence int32 token counts for the penalties (max_num_seqs × vocabulary × 4 bytes), which
          its profile counts; V(0) before 0.33 (O(vllm_version)).
      type: int
      returned: when source is V(estimated)
    mla_decode_workspace:
      description:
        - TRITON_MLA's decode workspace, which vLLM 0.33 and later reserve in the profile run and so take from the KV
          cache; V(0) where it does not apply (not MLA, a sparse MLA model, a GPU that runs another MLA backend, or
          an earlier vLLM). Included in RV(reserve.total).
      type: int
      returned: when source is V(estimated) or V(fallback) and the accelerator is V(nvidia)
    mla_decode_splits:
      description: The workspace's split count, V(0) where it does not apply; part of RV(memory_key) where not 0.
      type: int
      returned: when source is V(estimated) or V(fallback) and the accelerator is V(nvidia)
    mla_decode:
      description:
        - The workspace's factors, where it applies - C(bytes), C(splits), C(heads_per_rank), C(sm_count) and
          C(sm_count_source) (V(given), V(table) or V(unknown)), C(max_num_seqs) and C(max_model_len) (the requested
          one, or for V(auto) the model's maximum).
      type: dict
      returned: where RV(reserve.mla_decode_workspace) is not 0
  sample:
    source: estimated
    total: 9453961216
    max_num_seqs: 1024
    max_num_batched_tokens: 8192
    activation: 2466250752
    penalty_counts: 671088640
    non_torch: 268435456
    cuda_graphs: 1023410176
    driver: 603979776
    encoder_outputs: 117440512
    mla_decode_workspace: 4303355904
    mla_decode_splits: 256
    mla_decode:
      bytes: 4303355904
      splits: 256
      heads_per_rank: 8
      sm_count: 188
      sm_count_source: table
      max_num_seqs: 1024
      max_model_len: 131072
kv_cache_dtype:
  description: The KV-cache dtype the plan uses (after V(auto) resolution, and after stripping when RV(strip_fp8_kv_cache)).
  returned: always
  type: str
  sample: bfloat16
kv_cache_dtype_source:
  description: Where RV(kv_cache_dtype) came from.
  returned: always
  type: str
  sample: kv_cache_dtype auto resolves to fp8_e4m3 from hf_quant_config.json (quant_method modelopt_fp4), as in vLLM
attention:
  description: V(mla) (multi-head latent attention) or V(standard) (multi-head and grouped-query attention).
  returned: always
  type: str
  sample: mla
kv_cache_bytes_per_token:
  description: KV-cache bytes one token takes on one GPU.
  returned: always
  type: int
  sample: 70272
kv_cache_bytes:
  description: The KV-cache budget per GPU in bytes.
  returned: always
  type: int
  sample: 22736069479
kv_cache_tokens:
  description: Tokens the KV budget holds, in whole blocks; what vLLM logs as C(GPU KV cache size).
  returned: always
  type: int
  sample: 323536
kv_cache_tokens_source:
  description:
    - V(measured) where a measurement of this plan's memory key (O(measurements_dir), O(measurements)) set
      RV(kv_cache_tokens) to the tokens vLLM logged, else V(predicted).
  returned: always
  type: str
  sample: measured
predicted:
  description: The prediction, also where a measurement set the plan.
  returned: always
  type: dict
  contains:
    kv_cache_tokens:
      description: The tokens the predicted KV budget holds.
      type: int
      returned: always
    kv_cache_bytes:
      description: The predicted KV budget per GPU.
      type: int
      returned: always
    weights_bytes_per_gpu:
      description: RV(weights_bytes_per_gpu).
      type: int
      returned: always
    weights_margin_bytes_per_gpu:
      description: RV(weights_margin_bytes_per_gpu).
      type: int
      returned: always
    reserve_bytes_per_gpu:
      description: RV(reserve_bytes_per_gpu).
      type: int
      returned: always
  sample:
    kv_cache_tokens: 160960
    kv_cache_bytes: 11311359591
    weights_bytes_per_gpu: 74427253056
    weights_margin_bytes_per_gpu: 1488545062
    reserve_bytes_per_gpu: 5150605312
measured:
  description: The measurement the plan used (as recorded), or V({}) for none.
  returned: always
  type: dict
  sample:
    memory_key_id: 3f1c2a9b8d7e6f50
    startup: {kv_tokens: 4096, max_concurrency: 4.0, kv_cache_device: CPU}
    recorded_at: '2026-12-01T16:25:40Z'
    host: sandbox
memory_key:
  description: What decides vLLM's memory at start for this plan (see O(memory_key)).
  returned: always
  type: dict
memory_key_id:
  description: A short stable name of RV(memory_key), the file name of its measurement.
  returned: always
  type: str
  sample: 3f1c2a9b8d7e6f50
max_model_len_fit:
  description: The largest context length that fits, capped at the model's C(max_position_embeddings).
  returned: always
  type: int
  sample: 262144
max_model_len:
  description:
    - "The chosen context length: the requested one if it fits; with O(max_model_len=auto) the largest that fits; with
      O(fail_on_misfit=false) and a requested length that does not fit, the largest that fits."
  returned: always
  type: int
  sample: 131072
fits:
  description: Whether the requested context length fits and RV(problems) is empty.
  returned: always
  type: bool
  sample: true
strip_fp8_kv_cache:
  description:
    - "Whether the checkpoint's FP8 KV cache must be stripped for this GPU, attention type and KV dtype: compute capability 12.x
      with MLA and an FP8 KV cache from the checkpoint."
  returned: always
  type: bool
  sample: true
fp8_kv_cache_stripped:
  description:
    - Whether the deploy should strip the checkpoint's FP8 KV cache (O(llmserve.vllm.kv_cache_quant#module:state=absent)), as
      O(fp8_kv_cache_policy) decided; the KV-cache figures assume it.
  returned: always
  type: bool
  sample: true
unified_vision_chunk:
  description:
    - Whether vLLM takes the checkpoint's images and videos as one modality, C(vision_chunk) (a vision tower and
      C(use_unified_vision_chunk) in C(config.json), as Kimi-K2.5 has). A C(--limit-mm-per-prompt) must then name
      C(vision_chunk), since a limit on C(image) or C(video) binds nothing; the role maps them.
  returned: always
  type: bool
  sample: true
problems:
  description: What would make vLLM's start fail; empty when none.
  returned: always
  type: list
  elements: str
  sample:
    - GPU 0 (NVIDIA H200) memory is held by PID 578 (python3, 10758 MiB)
remedies:
  description: Concrete changes that make the plan fit, naming the options as O(setting_names) names them.
  returned: always
  type: list
  elements: str
  sample:
    - set max_model_len to 250496 (fits at gpu_memory_utilization 0.9)
    - set gpu_memory_utilization to 0.91 (fits max_model_len 262144)
warnings:
  description: Human-readable warnings that do not stop a start.
  returned: always
  type: list
  elements: str
  sample:
    - per-GPU weights estimated from model.safetensors.index.json without per-tensor sizes (shards not downloaded)
"""

import functools
import json
import os
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmserve.vllm.plugins.module_utils import _command as command
from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import (
    MAX_WAIT_SECONDS,
    nul_free_path,
    range_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CheckpointError,
    resolve_kv_cache_dtype,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._kv_cache_quant import (
    RECORD_NAME,
    KvCacheQuantError,
    shipped_with_fp8_kv_cache,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import url_secrets
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_checkpoint import plan_inputs
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_files import HubFileError
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_headers import HeaderFetchError
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import DEFAULT_ENDPOINT
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._gpu_preflight import (
    AUTO_MAX_MODEL_LEN,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    plan,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._host_probes import (
    DEFAULT_DEV_PATH,
    DEFAULT_SHM_MIN_BYTES,
    DEFAULT_SHM_PATH,
    belongs_to_service,
    device_node_exists,
    port_conflict,
    process_name,
    shm_size,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._kv_cache import DEFAULT_BLOCK_SIZE
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._model_config import MAX_CONFIG_INT
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._nvidia_smi import (
    DEFAULT_NVIDIA_SMI_TIMEOUT,
    query_nvidia_smi,
    query_persistence,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._preflight_common import PreflightError
from ansible_collections.llmserve.vllm.plugins.module_utils.preflight._setting_names import (
    callers_texts,
    in_callers_words,
    unknown_setting_names,
)

# Integer options and their least values (the optional ones are checked when given).
INT_OPTIONS = (
    ('tensor_parallel_size', 1),
    ('pipeline_parallel_size', 1),
    ('block_size', 1),
    ('kv_cache_memory_bytes', 0),
    ('weights_bytes_per_gpu', 0),
    ('reserve_bytes_per_gpu', 0),
    ('max_num_seqs', 1),
    ('gpu_sm_count', 1),
    ('max_num_batched_tokens', 1),
    ('shm_min_bytes', 0),
)
# selectors cannot wait much longer than a day, and no nvidia-smi needs that long.
# A measurement is a few hundred bytes; a larger file is not one.
MAX_MEASUREMENT_BYTES = 64 * 1024

ARGUMENT_SPEC = dict(
    model_path=dict(type=nul_free_path, required=True),
    tensor_parallel_size=dict(type='int', default=1),
    pipeline_parallel_size=dict(type='int', default=1),
    gpu_memory_utilization=dict(type='float', default=DEFAULT_GPU_MEMORY_UTILIZATION),
    max_model_len=dict(type='raw', default='auto'),
    decode_context_parallel_size=dict(type='raw', default='auto'),
    kv_cache_dtype=dict(
        type='str',
        default='auto',
        choices=['auto', 'bfloat16', 'float16', 'half', 'float32', 'fp8', 'fp8_e4m3', 'fp8_e5m2'],
    ),
    kv_cache_memory_bytes=dict(type='int'),
    weights_bytes_per_gpu=dict(type='int'),
    gpus=dict(
        type='list',
        elements='dict',
        options=dict(
            name=dict(type='str', required=True),
            memory_total_mib=dict(type='int', required=True),
            compute_capability=dict(type='str', required=True),
            memory_used_mib=dict(type='int', default=0),
        ),
    ),
    fail_on_misfit=dict(type='bool', default=True),
    accelerator=dict(type='str', default='nvidia', choices=['nvidia', 'cpu']),
    nvidia_smi_path=dict(type=nul_free_path, default='nvidia-smi'),
    nvidia_smi_timeout=dict(type='int', default=DEFAULT_NVIDIA_SMI_TIMEOUT),
    reserve_bytes_per_gpu=dict(type='int'),
    max_num_seqs=dict(type='int'),
    gpu_sm_count=dict(type='int'),
    max_num_batched_tokens=dict(type='int', no_log=False),
    multimodal=dict(
        type='str',
        choices=['text_only', 'encoder_data_parallel', 'encoder_tensor_parallel'],
        default='encoder_data_parallel',
    ),
    vllm_version=dict(type='str'),
    hub=dict(
        type='dict',
        options=dict(
            repo_id=dict(type='str', required=True),
            revision=dict(type='str', required=True),
            endpoint=dict(type='str', default=DEFAULT_ENDPOINT),
            token=dict(type='str', no_log=True),
            timeout=dict(type='int', default=30),
        ),
    ),
    block_size=dict(type='int', default=DEFAULT_BLOCK_SIZE),
    port=dict(type='int'),
    host=dict(type='str', default='127.0.0.1'),
    service_name=dict(type='str'),
    shm_path=dict(type=nul_free_path, default=DEFAULT_SHM_PATH),
    shm_min_bytes=dict(type='int', default=DEFAULT_SHM_MIN_BYTES),
    dev_path=dict(type=nul_free_path, default=DEFAULT_DEV_PATH),
    fp8_kv_cache_policy=dict(type='str', default='auto', choices=['auto', 'strip', 'keep']),
    memory_key=dict(type='dict', default={}, no_log=False),
    measurements_dir=dict(type=nul_free_path),
    measurements=dict(type='list', elements='dict', default=[]),
    setting_names=dict(type='dict', default={}),
)


def int_error(name, value, minimum, maximum=MAX_CONFIG_INT):
    """The message for an integer option outside minimum..maximum, or None. AnsibleModule lets booleans through as ints."""
    if isinstance(value, bool):
        return '%s must be an integer, got %s' % (name, value)
    # The maximum guards the arithmetic alone: a refusal names it only to a value above it.
    return range_problem(name, value, minimum) or range_problem(name, value, maximum=maximum)


def max_model_len_error(p):
    """Check max_model_len (an integer or auto) and make it an int; the message when it is neither, or None."""
    mml = p['max_model_len']
    if mml in AUTO_MAX_MODEL_LEN:
        return None
    try:
        value = int(mml)
    except (TypeError, ValueError, OverflowError):
        return 'max_model_len must be an integer or auto, got %r' % (mml,)
    if value < 1 or str(value) != str(mml).strip():
        return 'max_model_len must be a positive integer or auto, got %r' % (mml,)
    p['max_model_len'] = value
    return int_error('max_model_len', value, 1)


def check_params(p):
    """Ranges argument_spec cannot express; returns an error message or None."""
    errors = [int_error(key, p[key], minimum) for key, minimum in INT_OPTIONS if p.get(key) is not None]
    errors.append(int_error('nvidia_smi_timeout', p['nvidia_smi_timeout'], 1, MAX_WAIT_SECONDS))
    for i, gpu in enumerate(p['gpus'] or []):
        errors.append(int_error('gpus[%d].memory_total_mib' % i, gpu['memory_total_mib'], 1))
        errors.append(int_error('gpus[%d].memory_used_mib' % i, gpu['memory_used_mib'], 0))
    if p['port'] is not None:
        errors.append(range_problem('port', p['port'], 1, 65535))
    errors.append(range_problem('gpu_memory_utilization', p['gpu_memory_utilization'], 0, 1, above=True))
    errors.append(max_model_len_error(p))
    return next((e for e in errors if e), None)


def argument_error(p):
    """The message that refuses the arguments, in the caller's words (setting_names), or None."""
    naming_error = unknown_setting_names(p['setting_names'], ARGUMENT_SPEC)
    if naming_error:
        return naming_error
    error = check_params(p) or model_path_error(p['model_path'], p['hub'])
    return in_callers_words(error, p['setting_names'], callers_texts(p)) if error else None


def model_path_error(path, hub):
    """The message when model_path is no directory, or None; with hub, a directory still to be made is planned from
    the Hub."""
    if not os.path.exists(path):
        return None if hub else 'model_path %s does not exist' % path
    if not os.path.isdir(path):
        return 'model_path %s is not a directory' % path
    return None


def kv_cache_dtype_info(p, inputs):
    """resolve_kv_cache_dtype's answer for the checkpoint as shipped."""
    dtype_info = resolve_kv_cache_dtype(p['kv_cache_dtype'], None, inputs.config, inputs.hf_quant_config)
    # A config from the Hub is as shipped; kv_cache_quant's record is beside a local one.
    if p['kv_cache_dtype'] == 'auto' and inputs.config_source == 'local' and shipped_with_fp8_kv_cache(p['model_path']):
        # The decision concerns the checkpoint as shipped: judged from the stripped files,
        # a second run would restore the FP8 KV cache that the first one removed.
        dtype_info = (
            'fp8',
            'the checkpoint as shipped asks for an FP8 KV cache (stripped earlier by '
            'llmserve.vllm.kv_cache_quant, see %s)' % RECORD_NAME,
            dtype_info[2],
        )
    return dtype_info


def gpus_and_apps(module, p):
    """The GPUs to plan for and the processes on them: none for the CPU build, the gpus option, or nvidia-smi's."""
    if p['accelerator'] != 'nvidia':
        return [], []
    if p['gpus']:
        return [dict(g, index=i, driver_version='', uuid='planned-%d' % i) for i, g in enumerate(p['gpus'])], []
    smi = p['nvidia_smi_path']
    path = smi if os.path.isabs(smi) else module.get_bin_path(smi)
    if not path or not os.path.exists(path):
        raise PreflightError(
            '%s not found%s: is the NVIDIA driver installed? (set nvidia_smi_path, or gpus to plan '
            'without GPUs)' % (smi, '' if os.path.isabs(smi) else ' on PATH')
        )
    run = functools.partial(command.run, timeout=p['nvidia_smi_timeout'])
    gpus, apps = query_nvidia_smi(run, path)
    try:
        modes = query_persistence(run, path)
    except PreflightError as exc:
        module.warn('persistence mode not read: %s' % exc)
        modes = {}
    for gpu in gpus:
        gpu['persistence_mode'] = modes.get(gpu['uuid'], '')
    return gpus, apps


def host_facts(p):
    """The callables plan() asks the host's facts with."""
    service = p['service_name']
    host = {
        'belongs': lambda pid: belongs_to_service(pid, service),
        'name': process_name,
        'port': lambda h, port: port_conflict(h, port, service),
    }
    if p['accelerator'] != 'cpu':
        host['shm'] = shm_size
    if p['accelerator'] == 'nvidia' and not p['gpus']:
        host['device'] = device_node_exists
    return host


def failure_message(result):
    """The problems and their remedies, as one message."""
    msg = ' '.join(x if x.endswith('.') else x + '.' for x in result['problems'])
    if result['remedies']:
        msg += ' Remedies: ' + '; '.join(result['remedies']) + '.'
    return msg


def recorded_measurements(directory):
    """The measurements kept in directory (<memory_key_id>.json each); unreadable or foreign files are passed over:
    a measurement only refines the plan, and without one the plan is the prediction."""
    if not directory or not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith('.json') or not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            if os.path.getsize(path) > MAX_MEASUREMENT_BYTES:
                continue
            with open(path, 'rb') as f:
                measurement = json.loads(f.read().decode('utf-8'))
        except (OSError, ValueError):
            continue
        if isinstance(measurement, dict) and measurement.get('memory_key_id') == name[: -len('.json')]:
            found.append(measurement)
    return found


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_if=[('accelerator', 'cpu', ['kv_cache_memory_bytes'])],
        supports_check_mode=True,
    )
    p = dict(module.params)
    names = p['setting_names']
    # The paths, the Hub's repository and the service's name are the caller's words: never renamed in a message.
    words = callers_texts(p)
    # Ansible hides a no_log option only whole: the Hub endpoint's password, wherever an error or the invocation shows it.
    module.no_log_values.update(url_secrets(str((p['hub'] or {}).get('endpoint') or '')))
    error = argument_error(p)
    if error:
        module.fail_json(msg=error)

    result: dict[str, Any] = dict(changed=False)
    apps = []
    try:
        inputs = plan_inputs(p['model_path'], p['hub'], p['weights_bytes_per_gpu'] is None)
        result['config_source'] = inputs.config_source
        dtype_info = kv_cache_dtype_info(p, inputs)
        gpus, apps = gpus_and_apps(module, p)
        measurements = p['measurements'] + recorded_measurements(p['measurements_dir'])
        facts = host_facts(p)
        result.update(
            plan(
                p, inputs.config, inputs.checkpoint, gpus, apps, dtype_info, facts, measurements, inputs.hf_quant_config
            )
        )
    except (
        CheckpointError,
        command.CommandError,
        HeaderFetchError,
        HubFileError,
        KvCacheQuantError,
        PreflightError,
    ) as exc:
        module.fail_json(msg=in_callers_words(str(exc), names, words), **result)

    # Ansible shows these and returns them as the registered result's warnings
    # (passing warnings= to exit_json is deprecated).
    for text in inputs.warnings + result.pop('warnings'):
        module.warn(in_callers_words(text, names, words))
    result['remedies'] = [in_callers_words(remedy, names, words) for remedy in result['remedies']]
    for g in result['gpus']:
        g['processes'] = [
            dict(a, ours=belongs_to_service(a['pid'], p['service_name']))
            for a in apps
            if a['gpu_uuid'] == g.get('uuid')
        ]
    result['driver_version'] = gpus[0].get('driver_version', '') if gpus else ''
    # No context length at all is no plan to start vLLM with, whatever fail_on_misfit says.
    if result['problems'] and (p['fail_on_misfit'] or result['max_model_len_fit'] == 0):
        module.fail_json(msg=failure_message(result), **result)
    module.exit_json(**result)


if __name__ == '__main__':
    main()
