# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The tests' one fake OpenAI-compatible server: an http.server thread on 127.0.0.1 that each case configures.

A case gives routes, {path: behaviour}; a path it does not name answers 404 as vLLM does. A behaviour,
behave(handler, stop), writes the whole answer: through the helpers below (reply, script, stream) or byte by
byte itself, as the adversarial tests' hostile servers do. It gets the request handler (its command, path,
headers, and body: the request's bytes) and an event that close() sets, so that no thread outlives its case.
Every request is recorded, in order, in requests.

It emulates the protocol only; the sandbox tests run the modules against a real vLLM.
"""

import json
import socketserver
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOT_FOUND = b'{"detail": "Not Found"}'


def reply(status=200, body=b'', content_type='application/json'):
    """Answer status with body (bytes or text), its Content-Length set."""
    data = body.encode('utf-8') if isinstance(body, str) else body

    def behave(handler, stop):
        handler.send_response(status)
        handler.send_header('Content-Type', content_type)
        handler.send_header('Content-Length', str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return behave


def script(*behaviours):
    """Answer the requests of a path with the behaviours in order; the last one repeats."""
    pending = list(behaviours)
    lock = threading.Lock()

    def behave(handler, stop):
        with lock:
            current = pending.pop(0) if len(pending) > 1 else pending[0]
        current(handler, stop)

    return behave


def stream(chunks, first=0.0, gap=0.0):
    """A text/event-stream in HTTP/1.1 chunks, as vLLM (uvicorn) sends one event per chunk: the first after
    `first` seconds, then one every `gap` seconds."""

    def behave(handler, stop):
        handler.protocol_version = 'HTTP/1.1'
        handler.send_response(200)
        handler.send_header('Content-Type', 'text/event-stream')
        handler.send_header('Transfer-Encoding', 'chunked')
        handler.send_header('Connection', 'close')
        handler.end_headers()
        handler.wfile.flush()
        for number, chunk in enumerate(chunks):
            time.sleep(first if number == 0 else gap)
            handler.wfile.write(b'%x\r\n%s\r\n' % (len(chunk), chunk))
            handler.wfile.flush()
        handler.wfile.write(b'0\r\n\r\n')
        handler.wfile.flush()

    return behave


class Request:
    """One request as the server got it."""

    def __init__(self, method, path, headers, body):
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


class _Handler(BaseHTTPRequestHandler):
    def _serve(self):
        length = int(self.headers.get('Content-Length') or 0)
        self.body = self.rfile.read(length) if length else b''
        fake = self.server.fake
        with fake.lock:
            fake.requests.append(Request(self.command, self.path, self.headers, self.body))
        behave = fake.routes.get(self.path, reply(404, NOT_FOUND))
        try:
            behave(self, fake.stop)
        except OSError:  # the client hung up, as the modules should on a hostile answer
            pass
        self.close_connection = True

    do_GET = _serve
    do_POST = _serve

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    """An http.server that speaks TLS when given a server-side context: each connection's handshake runs in that
    connection's thread, so a client that refuses the certificate stops only its own."""

    daemon_threads = True
    tls = None

    def finish_request(self, request, client_address):
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            request = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):  # the client refused the certificate, as it must without its CA
            return
        try:
            super().finish_request(request, client_address)
        finally:
            request.close()


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The same server on a Unix socket, as vLLM's --uds serves."""

    daemon_threads = True


class FakeOpenAI:
    """The server of one case, listening on port (0: any free one) from construction to close(); url is its
    base URL. With tls (a tests/support.py LocalCA) it serves HTTPS with the CA's certificate for 127.0.0.1.
    With unix_socket (a path) it listens there instead, and url is http://localhost."""

    def __init__(self, routes, port=0, tls=None, unix_socket=None):
        self.routes = dict(routes)
        self.requests = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if unix_socket is not None:
            self.httpd = _UnixServer(unix_socket, _Handler)
            self.httpd.fake = self
            self.url = 'http://localhost'
            self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
            self.thread.start()
            return
        self.httpd = _Server(('127.0.0.1', port), _Handler)
        self.httpd.fake = self
        scheme = 'http'
        if tls is not None:
            self.httpd.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.httpd.tls.load_cert_chain(tls.server_cert, tls.server_key)
            scheme = 'https'
        self.url = '%s://127.0.0.1:%d' % (scheme, self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
