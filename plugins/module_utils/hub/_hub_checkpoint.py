# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What the GPU preflight plans from, read from the model directory or, where it lacks the files, from the Hub.

PRIVATE to the collection: this is not a public API; it may change without notice.

With the hub option and no config.json in the model directory (or no directory at all), the config,
hf_quant_config.json where vLLM reads it, and the weights index come from the Hub revision in memory, and the
weights are sized from the safetensors headers over byte ranges (_hub_headers): the plan comes before anything
is written on the host. The files that are there are read as before.
"""

import os
from typing import Any, Callable, Optional

from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import (
    CONFIG_NAME,
    HF_QUANT_CONFIG_NAME,
    CheckpointError,
    Config,
    load_config,
    read_hf_quant_config,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._safetensors import (
    INDEX_NAME,
    Checkpoint,
    has_weights,
    index_entries,
    index_only,
    scan,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_files import (
    MAX_INDEX_BYTES,
    HubFileError,
    HubRevision,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_headers import HeaderFetchError, fetch_headers

# Hub option: repo_id, revision, endpoint, token, timeout (gpu_preflight's hub).
Hub = dict[str, Any]


class PlanInputs:
    """config.json, hf_quant_config.json where vLLM reads it, the checkpoint's weights (None when not asked for),
    where the config came from (``local`` or ``hub``), and warnings."""

    def __init__(
        self,
        config: Config,
        hf_quant_config: Optional[Config],
        checkpoint: Optional[Checkpoint],
        config_source: str,
        warnings: list[str],
    ) -> None:
        self.config = config
        self.hf_quant_config = hf_quant_config
        self.checkpoint = checkpoint
        self.config_source = config_source
        self.warnings = warnings


def config_from_hub(model_path: str, hub: Optional[Hub]) -> bool:
    """Whether the config comes from the Hub: the hub option is given and the directory has no config.json."""
    return bool(hub) and not os.path.lexists(os.path.join(model_path, CONFIG_NAME))


def plan_inputs(
    model_path: str, hub: Optional[Hub], with_weights: bool, open_url: Optional[Callable[..., Any]] = None
) -> PlanInputs:
    """What the plan reads, each file from model_path where it is there, else from the Hub revision.

    Raises CheckpointError (a local file), HubFileError or HeaderFetchError (the Hub), naming file or URL and cause.
    """
    revision = HubRevision(hub, open_url) if hub else None
    names: Optional[list[str]] = None
    if revision is not None and config_from_hub(model_path, hub):
        config = revision.json_file(CONFIG_NAME)
        names = revision.file_names()
        hf_quant_config = None
        if config.get('quantization_config') is None and HF_QUANT_CONFIG_NAME in names:
            hf_quant_config = revision.json_file(HF_QUANT_CONFIG_NAME)
        source = 'hub'
    else:
        config = load_config(model_path)
        hf_quant_config = read_hf_quant_config(model_path, config)
        source = 'local'
    warnings: list[str] = []
    checkpoint = None
    if with_weights:
        if revision is not None and not has_weights(model_path):
            checkpoint = weights_from_hub(revision, names if names is not None else revision.file_names())
        else:
            checkpoint = scan(model_path)
        warning = size_from_hub(checkpoint, revision)
        if warning:
            warnings.append(warning)
        if checkpoint.source == 'index' and checkpoint.index_total_size is None and revision is not None:
            # Only a Hub index gets here without a total (scan refuses a local one): the headers were its sizes.
            raise CheckpointError('%s has no metadata.total_size, and %s' % (revision.url(INDEX_NAME), warning))
    return PlanInputs(config, hf_quant_config, checkpoint, source, warnings)


def weights_from_hub(revision: HubRevision, names: list[str]) -> Checkpoint:
    """The revision's weights before the download: its index's tensors (sized later by size_from_hub), or without an
    index every top-level *.safetensors file sized from its header."""
    if INDEX_NAME in names:
        url = revision.url(INDEX_NAME)
        try:
            weight_map, total_size = index_entries(revision.json_file(INDEX_NAME, MAX_INDEX_BYTES), url)
        except CheckpointError as exc:
            raise HubFileError(str(exc)) from None
        return index_only(weight_map, total_size)
    files = sorted(name for name in names if name.endswith('.safetensors') and '/' not in name)
    if not files:
        raise HubFileError(
            '%s at revision %s holds neither %s nor any *.safetensors file'
            % (revision.repo_id, revision.revision, INDEX_NAME)
        )
    headers = fetch_headers(
        revision.endpoint, revision.repo_id, revision.revision, files, revision.token, revision.timeout
    )
    checkpoint = Checkpoint()
    for name in files:
        checkpoint.tensors.update(headers[name])
    checkpoint.total_bytes = sum(nbytes for nbytes in checkpoint.tensors.values() if nbytes)
    checkpoint.source = 'hub'
    return checkpoint


def size_from_hub(checkpoint: Checkpoint, revision: Optional[HubRevision]) -> Optional[str]:
    """Size the tensors of a checkpoint planned from its index alone from its shards' headers on the Hub; returns a
    warning where they cannot be had (the plan then predicts the sizes), else None."""
    if checkpoint.source != 'index' or revision is None:
        return None
    try:
        headers = fetch_headers(
            revision.endpoint, revision.repo_id, revision.revision, checkpoint.missing, revision.token, revision.timeout
        )
    except HeaderFetchError as exc:
        return "the shards' headers could not be read from the Hub, so the weights are predicted: %s" % exc
    for tensors in headers.values():
        checkpoint.tensors.update(tensors)
    checkpoint.source = 'hub'
    return None
