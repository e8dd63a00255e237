# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A Hub revision's small files and the list of its files, read into memory: nothing is written on the host.

PRIVATE to the collection: this is not a public API; it may change without notice.

A file is ``GET {endpoint}/{repo_id}/resolve/{revision}/{name}`` (as huggingface_hub's hf_hub_download fetches
it), the list of files the ``siblings`` of ``GET {endpoint}/api/models/{repo_id}/revision/{revision}?blobs=true``
(model_info with files_metadata). Each request ends within its time and byte limits; the token goes to the
endpoint only (a redirect is followed without it). Messages name the URL without the endpoint's password; the
token and the password are masked in what the Hub or the network error says before it is shortened.
"""

from http.client import HTTPException
from typing import Any, Callable, Optional
from urllib.error import URLError

from ansible.module_utils import urls

from ansible_collections.llmserve.vllm.plugins.module_utils._deadline import DeadlinePassed, deadline
from ansible_collections.llmserve.vllm.plugins.module_utils._json_text import decode_json
from ansible_collections.llmserve.vllm.plugins.module_utils.checkpoint._checkpoint import Config
from ansible_collections.llmserve.vllm.plugins.module_utils.endpoint._http import (
    MAX_QUOTE,
    credentials_problem,
    describe_unreachable,
    mask,
    quote_masked,
    read_limited,
    url_secrets,
    without_credentials,
)
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_headers import open_file, resolve_url
from ansible_collections.llmserve.vllm.plugins.module_utils.hub._hub_manifest import (
    HUB_SAYS_CHARS,
    MAX_MANIFEST_BYTES,
    endpoint_problem,
    model_info_url,
    name_problem,
    repo_id_problem,
    revision_problem,
)

# A config.json or hf_quant_config.json is kilobytes; anything near this is not one.
MAX_CONFIG_BYTES = 16 << 20
# Kimi-K2.5's weights index is about 30 MB (280,000 tensor names).
MAX_INDEX_BYTES = 256 << 20


class HubFileError(Exception):
    """A file of the revision cannot be had or read; the message names its URL and why, never the token or the
    endpoint's password."""


def status_problem(
    status: int,
    headers: Any,
    shown: str,
    repo_id: str,
    revision: str,
    name: Optional[str],
    token: Optional[str],
    secrets: tuple[Optional[str], ...],
) -> str:
    """The message for an answer other than 200: the URL as shown, the status and what it means for the hub option.

    secrets (the token and the endpoint's credentials) are masked in what the Hub says before it is shortened.
    """
    hub_says = (headers.get('X-Error-Message') if headers is not None else None) or ''
    code = (headers.get('X-Error-Code') if headers is not None else None) or ''
    detail = ' (the Hub says: %s)' % quote_masked(hub_says, HUB_SAYS_CHARS, *secrets) if hub_says else ''
    if status in (401, 403) and not token:
        cause = 'the repository is private or gated: set hub.token to a token that has access to %s' % repo_id
        if code == 'RepoNotFound':
            cause = 'no repository %s, or %s' % (repo_id, cause)
    elif status == 401:
        cause = 'the token in hub.token was refused'
    elif status == 403:
        cause = (
            'the token in hub.token has no access to %s (a gated repository: accept its conditions on the Hub '
            "with the token's account)" % repo_id
        )
    elif status == 404 and code == 'EntryNotFound' and name:
        cause = '%s has no file %s at revision %s' % (repo_id, name, revision)
    elif status == 404 and code == 'RevisionNotFound':
        cause = 'no revision %s in %s' % (revision, repo_id)
    elif status == 404 and code == 'RepoNotFound':
        cause = 'no repository %s' % repo_id
    elif status == 404:
        cause = 'no repository %s, or no revision %s in it' % (repo_id, revision)
    else:
        cause = 'the Hub did not give %s' % (name or 'the list of files')
    # Masked again whole: the URL and the Hub's words side by side could spell what neither does alone.
    return mask('%s answered HTTP %d: %s%s' % (shown, status, cause, detail), *secrets)


class HubRevision:
    """One revision of a Hub repository, read file by file: hub is gpu_preflight's option (repo_id, revision,
    endpoint, token, timeout); open_url stands in for ansible's in tests."""

    def __init__(self, hub: dict[str, Any], open_url: Optional[Callable[..., Any]] = None) -> None:
        self.endpoint = str(hub['endpoint'])
        self.repo_id = str(hub['repo_id'])
        self.revision = str(hub['revision'])
        self.token: Optional[str] = hub.get('token') or None
        self.timeout = int(hub.get('timeout') or 30)
        self.open_url = open_url or urls.open_url
        self.secrets = (self.token,) + url_secrets(self.endpoint)
        for problem in (
            credentials_problem(self.endpoint, 'endpoint'),
            endpoint_problem(self.endpoint),
            repo_id_problem(self.repo_id),
            revision_problem(self.revision, True),
        ):
            if problem:
                raise HubFileError('hub: %s' % problem)

    def url(self, name: str) -> str:
        """Where the file name of this revision is, as messages name it: without the endpoint's password."""
        return without_credentials(resolve_url(self.endpoint, self.repo_id, self.revision, name))

    def get(self, url: str, limit: int, name: Optional[str]) -> bytes:
        """The body of a 200 answer to GET url, at most limit bytes, within the timeout; HubFileError otherwise,
        naming url without the endpoint's password."""
        shown = without_credentials(url)
        try:
            with deadline(self.timeout):
                response = open_file(self.open_url, url, self.token, self.timeout)
                try:
                    status, answer_headers = response.getcode(), response.headers
                    body = read_limited(response, limit) if status == 200 else b''
                finally:
                    response.close()
        except DeadlinePassed:
            raise HubFileError('%s gave no complete answer within %d s' % (shown, self.timeout)) from None
        except (URLError, HTTPException, OSError, ValueError) as exc:
            reason = quote_masked(describe_unreachable(exc, self.timeout), MAX_QUOTE, *self.secrets)
            raise HubFileError('cannot fetch %s: %s' % (shown, reason)) from None
        if status != 200:
            raise HubFileError(
                status_problem(
                    status, answer_headers, shown, self.repo_id, self.revision, name, self.token, self.secrets
                )
            )
        if body is None:
            raise HubFileError('%s answered more than %d bytes: not a %s' % (shown, limit, name or 'model info'))
        return body

    def json_file(self, name: str, limit: int = MAX_CONFIG_BYTES) -> Config:
        """The JSON object in the revision's file name."""
        url = resolve_url(self.endpoint, self.repo_id, self.revision, name)
        shown = without_credentials(url)
        doc = decode_json(self.get(url, limit, name), shown, HubFileError)
        if not isinstance(doc, dict):
            raise HubFileError('%s does not hold a JSON object' % shown)
        return doc

    def file_names(self) -> list[str]:
        """The names of the revision's files, from the model info's siblings."""
        url = model_info_url(self.endpoint, self.repo_id, self.revision)
        shown = without_credentials(url)
        doc = decode_json(self.get(url, MAX_MANIFEST_BYTES, None), shown, HubFileError)
        siblings = doc.get('siblings') if isinstance(doc, dict) else None
        if not isinstance(siblings, list):
            raise HubFileError("%s has no siblings: not the Hub's model info" % shown)
        names = []
        for position, sibling in enumerate(siblings):
            name = sibling.get('rfilename') if isinstance(sibling, dict) else None
            problem = name_problem(name)
            if problem:
                raise HubFileError('%s: siblings[%d].rfilename %s' % (shown, position, problem))
            names.append(str(name))
        return names
