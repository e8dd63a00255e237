# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later


class ModuleDocFragment:
    # How a module that asks a vLLM endpoint (or its front door) reaches it: TLS, proxy and Unix socket.
    DOCUMENTATION = r"""
options:
  validate_certs:
    description:
      - Whether to verify the server's TLS certificate for an C(https) O(url).
      - V(false) also turns O(ca_path) off.
    type: bool
    default: true
  ca_path:
    description:
      - A file of PEM CA certificates that the server's certificate must chain to, for an C(https) O(url), instead
        of the host's trust store; for example the private CA that signed a front door's certificate (nginx
        terminating TLS before vLLM). The host's CA certificates are then not trusted for these requests.
      - The certificate must still name the host of O(url) (C(subjectAltName)), as with the host's trust store.
      - It is checked before the first request; a path that does not exist, is not a regular file, cannot be
        read, or holds no certificate fails at once with a message that names it.
      - Ignored (not even read) when O(validate_certs) is V(false).
    type: path
  use_proxy:
    description:
      - Whether to go through the proxy that the environment names (C(https_proxy), C(http_proxy)).
      - A loopback URL (C(localhost), C(127.0.0.0/8), C(::1)) never does. A proxy would reach its own host, and
        would read the API key on the way.
    type: bool
    default: true
  unix_socket:
    description:
      - The path of the Unix socket the server listens on (vLLM's C(--uds)), to connect there instead of to the host
        and port of O(url).
      - O(url) then names only the scheme, the C(Host) header and the path prefix, for example C(http://localhost).
        No proxy is used.
      - A socket that does not exist yet, or that refuses the connection, is a server that does not answer yet, as a
        closed port is.
    type: path
"""
