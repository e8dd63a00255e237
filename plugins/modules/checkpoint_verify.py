#!/usr/bin/python
# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

DOCUMENTATION = r"""
---
module: checkpoint_verify
short_description: Verify a model checkpoint file by file against the Hugging Face Hub's manifest of a revision
version_added: 0.1.0
description:
  - Checks every file of a checkpoint directory against the Hub's own description of one revision of the
    repository, the model info with blob metadata (C(GET /api/models/REPO/revision/COMMIT?blobs=true)).
    Each file must be there, with the size the manifest gives and its digest (the SHA-256 for Git LFS files,
    the weights; the git blob SHA-1 for the others).
  - Safetensors headers must parse and the tensor data must end exactly at the end of each file; the
    C(model.safetensors.index.json) weight map must name only shards that are there; a file in the
    directory that the manifest does not list is a problem too.
  - "Each problem names the file and its kind: V(missing), V(truncated) (smaller than the manifest says),
    V(oversized), V(digest_mismatch), V(extra_file), V(bad_safetensors_header), V(bad_safetensors_index),
    V(index_names_missing_shard), V(unreadable) (a FIFO, a device, a read error), V(link_outside) (a symbolic
    link that resolves outside the checkpoint directory, see O(allow_links_outside))."
  - Config files that M(llmserve.vllm.kv_cache_quant) rewrote pass when putting back the values its record
    (C(.llmserve-kv-cache-quant.json) beside the checkpoint) keeps gives exactly the manifest's bytes; they
    are listed in RV(rewritten_by_kv_cache_quant), not reported as corrupt.
  - The module fails, with the problems in its result, unless the checkpoint matches. It never changes the
    checkpoint.
  - Files are hashed in parallel by O(threads) threads. With O(cache_dir), what was read is remembered per
    file (path, size, modification time, inode), so a rerun on an unchanged checkpoint reads no shard.
author:
  - llmserve.vllm contributors (@llmserve)
extends_documentation_fragment:
  - llmserve.vllm.attributes
  - llmserve.vllm.attributes.READ_ONLY
options:
  path:
    description:
      - The checkpoint directory, the one that holds C(config.json) and the weights.
    type: path
    required: true
  manifest:
    description:
      - >-
        A file that holds the Hub's model info of the revision with blob metadata, for sites that cannot
        reach the Hub. Save it where the Hub is reachable, for example with
        C(curl -H "Authorization: Bearer $HF_TOKEN" https://huggingface.co/api/models/REPO/revision/COMMIT?blobs=true).
      - Exactly one of O(manifest) and O(repo_id) is required.
    type: path
  repo_id:
    description:
      - The Hub repository, V(NAMESPACE/NAME); the manifest is fetched from O(endpoint).
    type: str
  revision:
    description:
      - The full 40-hex commit of the revision. Required with O(repo_id).
      - A branch or tag is refused (it can move between the runs on two nodes), unless
        O(allow_unpinned_revision=true). Find the commit with
        C(hf models info REPO --revision main --expand sha --json), C(huggingface_hub.model_info(REPO).sha),
        or on the repository's web page (Files and versions, History).
      - With O(manifest), the manifest's commit must be this one.
    type: str
  allow_unpinned_revision:
    description:
      - Accept a branch or tag as O(revision); the commit it points to is returned in RV(revision).
    type: bool
    default: false
  endpoint:
    description:
      - The Hub or a mirror of it.
      - Defaults to the environment variable E(HF_ENDPOINT) on the host, else V(https://huggingface.co).
      - A password in it never shows. Messages show everything between the first C(:) after C(://) and the last
        C(@) as C(********), and a user name without a password (a token) too. An endpoint with more than one
        C(@), or one after a C(/), C(?) or C(#), is refused.
        Percent-encode these characters in a user name or password (C(%40), C(%2F), C(%3F), C(%23)).
    type: str
  token:
    description:
      - A Hub access token, for private and gated repositories. Sent as a bearer token, never shown.
      - Neither the token nor the password in O(endpoint) comes back in any text the module returns. They are
        masked as they are, escaped or encoded (JSON, Python, URL, HTML, or two of these layered), and so is
        every run of 8 of their characters (what a cut or the Hub leaves of them), before any text is shortened.
      - Printable ASCII only; a token with a line break (a YAML block scalar) is refused.
      - Defaults to the environment variable E(HF_TOKEN) on the host.
    type: str
  timeout:
    description:
      - Seconds the whole exchange that fetches the manifest may take, from 1 to 86400.
    type: int
    default: 60
  validate_certs:
    description:
      - Whether the TLS certificate of O(endpoint) is checked.
    type: bool
    default: true
  cache_dir:
    description:
      - A directory for the digest cache, C(checkpoint-digests.json), created readable by its owner only.
        Without it every file is read on every run.
      - The cache trusts a file whose size, modification time and inode are unchanged; to read everything
        again, remove the cache file. A cache file that another user owns or may write is not used.
      - The cache is not written in check mode.
    type: path
  threads:
    description:
      - How many files are hashed at once. Defaults to the number of CPUs, at most 8.
    type: int
  ignore:
    description:
      - Shell-style patterns of paths, relative to O(path), that are neither checked nor counted as extra
        files. C(*) also matches C(/). Patterns that leave no file of the manifest to check are refused.
      - The default leaves out what C(huggingface_hub) writes into a local directory it downloads to.
    type: list
    elements: str
    default: ['.cache/huggingface/**']
  allow_links_outside:
    description:
      - Accept symbolic links that resolve outside O(path), as in a snapshot of the Hugging Face cache
        (C(snapshots/COMMIT/) holds links to C(../../blobs/)).
      - By default each such link is a V(link_outside) problem and a directory it leads to is not walked, as a
        checkpoint served with C(--trust-remote-code) runs its Python files, and a link swapped in by whoever
        can write the directory would run or load something the manifest never described.
    type: bool
    default: false
  fail_on_mismatch:
    description:
      - With V(false), a checkpoint that does not match its manifest, or whose directory does not exist yet, is
        reported with RV(ok=false), its RV(problems) and RV(msg), and the task does not fail; a play asks first
        whether a fetch is needed, and an expected answer is no failure in its output.
      - What keeps the check from being made at all (a manifest that cannot be read, a path that is not a
        directory) fails the task either way.
    type: bool
    default: true
notes:
  - Hashing a 540 GB checkpoint takes minutes even on fast disks; run the task with C(async) and C(poll) so
    that the connection does not time out (see the examples).
seealso:
  - module: llmserve.vllm.kv_cache_quant
  - name: Hub API, model info
    description: The endpoint the manifest comes from.
    link: https://huggingface.co/docs/hub/api#get-apimodelsrepoid-or-apimodelsrepoidrevisionrevision
"""

EXAMPLES = r"""
- name: Ensure the checkpoint is exactly the pinned revision of the Hub repository
  llmserve.vllm.checkpoint_verify:
    path: /models/Kimi-K2.5-NVFP4
    repo_id: nvidia/Kimi-K2.5-NVFP4
    revision: 0123456789abcdef0123456789abcdef01234567
    cache_dir: /var/lib/llmserve/verify-cache
  # Reading 540 GB takes minutes: run it in the background and poll.
  async: 7200
  poll: 15
  register: __verify

- name: Ensure every node holds the same bytes
  ansible.builtin.assert:
    that: >-
      ansible_play_hosts | map('extract', hostvars, ['__verify', 'fingerprint']) | unique | length == 1
  run_once: true

- name: Ensure an air-gapped copy matches the manifest saved from the Hub
  llmserve.vllm.checkpoint_verify:
    path: /models/Kimi-K2.5-NVFP4
    manifest: /srv/manifests/Kimi-K2.5-NVFP4.json
    revision: 0123456789abcdef0123456789abcdef01234567
    ignore:
      - .cache/huggingface/**
      - original/**
"""

RETURN = r"""
ok:
  description: Whether the checkpoint matches the manifest (the module fails otherwise).
  returned: always
  type: bool
  sample: true
problems:
  description: What does not match, one entry per problem, sorted by file.
  returned: always
  type: list
  elements: dict
  contains:
    file:
      description: The file, relative to O(path).
      returned: always
      type: str
      sample: model-00002-of-00119.safetensors
    kind:
      description:
        - V(missing), V(truncated), V(oversized), V(digest_mismatch), V(extra_file), V(bad_safetensors_header),
          V(bad_safetensors_index), V(index_names_missing_shard), V(unreadable) or V(link_outside).
      returned: always
      type: str
      sample: truncated
    detail:
      description: The figures or the cause.
      returned: always
      type: str
      sample: '2147483648 bytes, the manifest says 4718592000 (2571108352 missing: an interrupted download?)'
  sample: []
msg:
  description: Why the checkpoint does not match, where O(fail_on_mismatch=false) reports it instead of failing.
  returned: when not RV(ok) and O(fail_on_mismatch=false)
  type: str
  sample: 'checkpoint /srv/hub/kimi does not exist yet: nothing of revision 0123... of org/model is fetched'
files:
  description: How many files of the manifest were checked (those O(ignore) leaves out are not).
  returned: when the manifest was read
  type: int
  sample: 130
bytes:
  description: Their size in bytes, as the manifest gives it.
  returned: when the manifest was read
  type: int
  sample: 593720000000
fingerprint:
  description:
    - SHA-256 over the sorted list of (file, digest) of the checkpoint as verified; the same on every node
      that holds the same bytes, so a play can compare nodes and replicas.
    - For a file that kv_cache_quant rewrote, the digest of its bytes as they are now.
  returned: when RV(ok)
  type: str
  sample: 5d41402abc4b2a76b9719d911017c592a1e6f0c2b3e8c8f0d1f6a3e2b7c9d0e1
revision:
  description: The commit the manifest describes.
  returned: when the manifest was read
  type: str
  sample: 0123456789abcdef0123456789abcdef01234567
rewritten_by_kv_cache_quant:
  description: Config files that differ from the manifest only by what M(llmserve.vllm.kv_cache_quant) recorded.
  returned: when the manifest was read
  type: list
  elements: str
  sample: [hf_quant_config.json]
cache_hits:
  description: How many files' digests came from the cache instead of being read.
  returned: when the manifest was read
  type: int
  sample: 130
hashed_bytes:
  description: How many bytes were read to compute digests in this run (0 on a rerun with an unchanged checkpoint).
  returned: when the manifest was read
  type: int
  sample: 0
elapsed:
  description: Seconds the module took.
  returned: always
  type: float
  sample: 0.21
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule, env_fallback

from ansible_collections.llmserve.vllm.plugins.module_utils._arguments import (
    MAX_WAIT_SECONDS,
    nul_free_path,
    range_problem,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint_verify import (
    DEFAULT_IGNORE,
    VerifyError,
    check_directory,
    default_threads,
    manifest_totals,
    masked_result,
    verify,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._digest import DigestCache
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    credentials_problem,
    hide_url_password,
    url_secrets,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    DEFAULT_ENDPOINT,
    ManifestError,
    endpoint_problem,
    fetch_manifest,
    read_manifest_file,
    repo_id_problem,
    revision_problem,
)

# Problems named in the failure message; all of them are in the result.
SHOWN_PROBLEMS = 3


# The manifest fetch runs under a SIGALRM deadline, which takes at most this many seconds.


def input_problem(params):
    """What is wrong with the options that the argument spec cannot say, or None."""
    token = params['token']
    if token is not None and not all(' ' < ch < '\x7f' for ch in token):
        # Named, never shown: http.client would print it escaped, out of reach of no_log's masking.
        return 'token must be printable ASCII, without spaces or control characters (a line break from a YAML block scalar?)'
    for name, low, high, unit in (('threads', 1, None, ''), ('timeout', 1, MAX_WAIT_SECONDS, ' seconds')):
        problem = params[name] is not None and range_problem(name, params[name], low, high, unit)
        if problem:
            return problem
    if params['revision'] is not None:
        found = revision_problem(params['revision'], params['allow_unpinned_revision'], params['repo_id'])
        if found:
            return found
    if params['repo_id'] is not None:
        endpoint = params['endpoint'] or DEFAULT_ENDPOINT
        return (
            repo_id_problem(params['repo_id'])
            or credentials_problem(endpoint, 'endpoint')
            or endpoint_problem(endpoint)
        )
    return None


def load_manifest(params):
    if params['manifest'] is not None:
        manifest = read_manifest_file(params['manifest'])
        wanted = params['revision']
        if wanted is not None and revision_problem(wanted) is None and manifest.revision != wanted:
            raise ManifestError(
                'manifest %s describes commit %s, not revision %s' % (params['manifest'], manifest.revision, wanted)
            )
        return manifest
    return fetch_manifest(
        params['endpoint'] or DEFAULT_ENDPOINT,
        params['repo_id'],
        params['revision'],
        token=params['token'],
        timeout=params['timeout'],
        validate_certs=params['validate_certs'],
    )


def failure_message(path, source, report):
    shown = '; '.join('%s: %s (%s)' % (p['file'], p['kind'], p['detail']) for p in report.problems[:SHOWN_PROBLEMS])
    more = len(report.problems) - SHOWN_PROBLEMS
    return 'checkpoint %s does not match %s: %d problem%s: %s%s' % (
        path,
        source,
        len(report.problems),
        '' if len(report.problems) == 1 else 's',
        shown,
        '; and %d more in problems' % more if more > 0 else '',
    )


ARGUMENT_SPEC = dict(
    path=dict(type=nul_free_path, required=True),
    manifest=dict(type=nul_free_path),
    repo_id=dict(type='str'),
    revision=dict(type='str'),
    allow_unpinned_revision=dict(type='bool', default=False),
    endpoint=dict(type='str', fallback=(env_fallback, ['HF_ENDPOINT'])),
    token=dict(type='str', no_log=True, fallback=(env_fallback, ['HF_TOKEN'])),
    timeout=dict(type='int', default=60),
    validate_certs=dict(type='bool', default=True),
    cache_dir=dict(type=nul_free_path),
    threads=dict(type='int'),
    ignore=dict(type='list', elements='str', default=list(DEFAULT_IGNORE)),
    allow_links_outside=dict(type='bool', default=False),
    fail_on_mismatch=dict(type='bool', default=True),
)


def not_fetched_yet(manifest, params, path, source):
    """The result for a checkpoint directory that does not exist yet: all of the manifest is still to come, and
    the fetch's progress counts against it."""
    files, size = manifest_totals(manifest, params['ignore'])
    return dict(
        files=files,
        bytes=size,
        problems=[{'file': '.', 'kind': 'missing', 'detail': 'the checkpoint directory does not exist'}],
        revision=manifest.revision,
        msg='checkpoint %s does not exist yet: nothing of revision %s of %s is fetched'
        % (path, manifest.revision, source),
    )


def keep_cache(module, cache, path):
    """Show the digest cache's warnings, and save it (not in check mode), warning where it could not be."""
    warnings = list(cache.warnings)
    if not module.check_mode:
        warnings.append(cache.save(path))
    for warning in warnings:
        if warning:
            module.warn(warning)


def verify_with_cache(params, path, manifest):
    """The check, with the digest cache of O(cache_dir) loaded first where there is one; (report, cache or None)."""
    cache = DigestCache(params['cache_dir']) if params['cache_dir'] else None
    if cache:
        cache.load()
    report = verify(
        path,
        manifest,
        params['ignore'],
        params['threads'] or default_threads(),
        cache,
        links_outside=params['allow_links_outside'],
    )
    return report, cache


def main():
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        mutually_exclusive=[('manifest', 'repo_id')],
        required_one_of=[('manifest', 'repo_id')],
        required_by={'repo_id': 'revision'},
        supports_check_mode=True,
    )
    started = time.monotonic()
    params = module.params
    hide_url_password(module, 'endpoint')
    secrets = (params['token'],) + url_secrets(params['endpoint'] or '')
    path = os.path.abspath(params['path'])
    result = dict(changed=False, ok=False, problems=[])

    def fail(msg):
        result['elapsed'] = round(time.monotonic() - started, 3)
        module.fail_json(**masked_result(dict(result, msg=msg), secrets))

    problem = input_problem(params)
    if problem:
        fail(problem)
    try:
        manifest = load_manifest(params)
        source = params['repo_id'] or 'manifest %s' % params['manifest']
        if not params['fail_on_mismatch'] and not os.path.lexists(path):
            result.update(not_fetched_yet(manifest, params, path, source), elapsed=round(time.monotonic() - started, 3))
            module.exit_json(**masked_result(result, secrets))
        check_directory(path)
    except (VerifyError, ManifestError) as exc:
        fail(str(exc))
    try:
        report, cache = verify_with_cache(params, path, manifest)
    except VerifyError as exc:
        fail(str(exc))
    if manifest.files and not report.files:
        fail('the ignore patterns leave none of the %d files of %s to check' % (len(manifest.files), source))
    if cache:
        keep_cache(module, cache, path)
    result.update(
        ok=report.ok,
        problems=report.problems,
        files=report.files,
        bytes=report.bytes,
        revision=manifest.revision,
        rewritten_by_kv_cache_quant=report.rewritten,
        cache_hits=report.cache_hits,
        hashed_bytes=report.hashed_bytes,
    )
    if not report.ok:
        message = failure_message(path, 'revision %s of %s' % (manifest.revision, source), report)
        if params['fail_on_mismatch']:
            fail(message)
        result.update(msg=message, elapsed=round(time.monotonic() - started, 3))
        module.exit_json(**masked_result(result, secrets))
    result.update(fingerprint=report.fingerprint, elapsed=round(time.monotonic() - started, 3))
    module.exit_json(**masked_result(result, secrets))


if __name__ == '__main__':
    main()
