# Copyright: (c) 2026, llmserve maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The performance gate's figures (make bench-perf-gate): what llmserve.vllm.load_probe measures on the
CPU build of vLLM serving the sandbox's miniature (tiny-kimi, with the sandbox's flags, every process on the
cores of --cpus as the default scenario's unit has them), how much it varies, and how far a heavier revision falls.

1. Concurrency 1, 4 and 8, RUNS probes each: output tokens/s, time to first token p50/p95,
   time per output token p50.
2. The spread of REPEAT probes at the role's sandbox settings (concurrency 4, 10 s): the noise that
   vllm_kimi_perf_max_regression_percent must stand above.
3. The heavy revision (tools/make_tiny_models.py's tiny-kimi-heavy: the same answers, its MLPs and
   experts zero-padded), the change the sandbox test makes the performance gate reject: the drop it must catch.

The module runs through `ansible localhost`, as the role runs it. Prints a table and writes JSON
(default .cache/bench/perf_gate.json). Run as root from the repo with .venv/bin on PATH and
ANSIBLE_COLLECTIONS_PATH set (the Makefile does both), after `make models`.
"""

from __future__ import absolute_import, division, print_function

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
VLLM_CLI = os.path.join(REPO, "roles", "vllm_kimi", "files", "llmserve-vllm-cli")
# inventories/sandbox/group_vars/vllm.yml's flags: its parsers, text only, its extra_args and KV cache.
SANDBOX_FLAGS = ["--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice",
                 "--language-model-only", "--enforce-eager", "--compilation-config",
                 '{"custom_ops": ["all", "-rotary_embedding"]}', "--max-model-len", "1024",
                 "--kv-cache-memory-bytes", "14155776"]


def tiny_models():
    """The directory of tiny-kimi/ and tiny-kimi-heavy/."""
    return subprocess.run([VLLM_PYTHON, os.path.join(REPO, "tools", "make_tiny_models.py")], check=True,
                          stdout=subprocess.PIPE).stdout.decode().strip().splitlines()[-1]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Vllm(object):
    """vLLM's OpenAI server on loopback, `vllm serve` through the role's version shim, kept to CPUS."""

    def __init__(self, model, cpus):
        self.port = free_port()
        self.log = open(os.path.join(REPO, ".cache", "bench", "perf_gate_vllm.log"), "w")
        self.proc = subprocess.Popen(
            ["taskset", "-c", cpus, VLLM_PYTHON, VLLM_CLI, "serve", model, "--served-model-name", "tiny",
             "--port", str(self.port)] + SANDBOX_FLAGS,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        started = time.time()
        while True:
            try:
                urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % self.port, timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() - started > 600:
                    self.stop()
                    raise SystemExit("vLLM did not come up; see .cache/bench/perf_gate_vllm.log") from None
                time.sleep(1)
        self.ready_after = time.time() - started

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(60)
        self.log.close()


def probe(port, concurrency, duration):
    args = {"url": "http://127.0.0.1:%d" % port, "model": "tiny", "concurrency": concurrency, "duration": duration,
            "max_tokens": 128}
    proc = subprocess.run(["ansible", "localhost", "-m", "llmserve.vllm.load_probe", "-a", json.dumps(args),
                           "-o", "-e", json.dumps({"ansible_python_interpreter": sys.executable})],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=False)
    out = proc.stdout.decode()
    result = json.loads(out[out.index("{"):])
    if proc.returncode != 0:
        raise SystemExit("the probe failed: %s" % result.get("msg"))
    return result


def summary(results):
    tps = [r["output_tokens_per_second"] for r in results]
    return {
        "runs": len(results),
        "tokens_per_second_median": round(statistics.median(tps), 1),
        "tokens_per_second_min": round(min(tps), 1),
        "tokens_per_second_max": round(max(tps), 1),
        "spread_percent": round(100.0 * (max(tps) - min(tps)) / statistics.median(tps), 1),
        "ttft_p50": statistics.median(r["time_to_first_token"]["p50"] for r in results),
        "ttft_p95": statistics.median(r["time_to_first_token"]["p95"] for r in results),
        "tpot_p50": statistics.median(r["time_per_output_token"]["p50"] for r in results),
        "requests_median": statistics.median(r["requests"] for r in results),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--cpus", default="0", help="taskset's list for every vLLM process (default: 0)")
    parser.add_argument("--json", default=os.path.join(REPO, ".cache", "bench", "perf_gate.json"))
    options = parser.parse_args()
    os.makedirs(os.path.dirname(options.json), exist_ok=True)
    models = tiny_models()
    figures = {"cpus": options.cpus, "duration": options.duration, "max_tokens": 128}

    server = Vllm(os.path.join(models, "tiny-kimi"), options.cpus)
    try:
        figures["ready_after_seconds"] = round(server.ready_after, 1)
        figures["by_concurrency"] = {}
        for concurrency in (1, 4, 8):
            results = [probe(server.port, concurrency, options.duration) for run in range(options.runs)]
            figures["by_concurrency"][concurrency] = summary(results)
        figures["repeat_at_4"] = summary([probe(server.port, 4, options.duration) for run in range(options.repeat)])
    finally:
        server.stop()

    heavy = Vllm(os.path.join(models, "tiny-kimi-heavy"), options.cpus)
    try:
        figures["heavy_ready_after_seconds"] = round(heavy.ready_after, 1)
        figures["heavy_at_4"] = summary([probe(heavy.port, 4, options.duration) for run in range(options.runs)])
    finally:
        heavy.stop()
    base = figures["repeat_at_4"]["tokens_per_second_median"]
    figures["heavy_drop_percent"] = round(100.0 * (base - figures["heavy_at_4"]["tokens_per_second_median"]) / base, 1)

    with open(options.json, "w") as f:
        json.dump(figures, f, indent=2)
    print("| Probe (%d s, 128 tokens per request) | tokens/s median (min-max) | spread | TTFT p50 / p95 | TPOT p50 |"
          % options.duration)
    print("| --- | --- | --- | --- | --- |")
    rows = [("concurrency %s, %d runs" % (c, s["runs"]), s) for c, s in figures["by_concurrency"].items()]
    rows.append(("concurrency 4, %d runs (sandbox settings)" % figures["repeat_at_4"]["runs"], figures["repeat_at_4"]))
    rows.append(("concurrency 4, the heavy revision, %d runs" % figures["heavy_at_4"]["runs"], figures["heavy_at_4"]))
    for name, s in rows:
        print("| %s | %.1f (%.1f-%.1f) | %.1f %% | %.3f / %.3f s | %.4f s |" % (
            name, s["tokens_per_second_median"], s["tokens_per_second_min"], s["tokens_per_second_max"],
            s["spread_percent"], s["ttft_p50"], s["ttft_p95"], s["tpot_p50"]))
    print("heavy revision: %.1f %% below tiny-kimi's median (vLLM ready after %.0f s instead of %.0f s)"
          % (figures["heavy_drop_percent"], figures["heavy_ready_after_seconds"], figures["ready_after_seconds"]))
    print("figures written to %s" % options.json)


if __name__ == "__main__":
    main()
