# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Screenshots in headless Chromium of what users look at: a Prometheus's graphs of the dashboard's queries and,
where given, a page such as the docsite's front page. Each must show content, or the run fails naming it.

    python3 tools/screenshots.py --prometheus http://127.0.0.1:9391 --service vllm-kimi --out .build/screenshots
    python3 tools/screenshots.py --page .build/docsite/build/html/index.html --out .build/screenshots

No Grafana server can run here, so each panel's query is drawn by the Prometheus the dashboard would read, on its own
graph page, with the dashboard's `$service` set. A graph shows content when Prometheus's page, as Chromium rendered
it, names a series of the query's result (its labels in the legend) and says no "Empty query result", and when the
screenshot has more than a few colours. A page shows content when its text has words and its screenshot colours.
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import urllib.parse
import zlib

DASHBOARD = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    '..',
    'roles',
    'vllm_monitoring',
    'files',
    'llmserve-vllm-dashboard.json',
)
# As the machine's notes say: without the background-networking flags Chromium's connections are refused by this
# machine's closed network; as root it needs --no-sandbox.
CHROMIUM_FLAGS = [
    '--headless',
    '--no-sandbox',
    '--disable-gpu',
    '--disable-quic',
    '--no-first-run',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--hide-scrollbars',
    '--window-size=1400,900',
    # Prometheus's page draws its graph from a query it sends once loaded: time for both before the shot.
    '--virtual-time-budget=10000',
]
# A blank or single-colour page has at most a handful; a drawn graph or a page of text has hundreds.
MIN_COLOURS = 16


def png_colours(path):
    """The number of distinct pixel values of a PNG (8-bit RGB or RGBA, non-interlaced, as Chromium writes)."""
    with open(path, 'rb') as f:
        data = f.read()
    if data[:8] != b'\x89PNG\r\n\x1a\n':
        raise ValueError('%s is no PNG' % path)
    at, idat, header = 8, b'', None
    while at < len(data):
        length, kind = struct.unpack('>I4s', data[at : at + 8])
        chunk = data[at + 8 : at + 8 + length]
        if kind == b'IHDR':
            header = struct.unpack('>IIBBBBB', chunk)
        elif kind == b'IDAT':
            idat += chunk
        at += 12 + length
    width, height, depth, colour_type, _, _, interlace = header
    if depth != 8 or colour_type not in (2, 6) or interlace:
        raise ValueError('%s: only 8-bit RGB(A) non-interlaced PNGs are read' % path)
    step = 3 if colour_type == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * step
    previous = bytearray(stride)
    colours = set()
    for row in range(height):
        kind = raw[row * (stride + 1)]
        line = bytearray(raw[row * (stride + 1) + 1 : (row + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up = previous[i]
            upper_left = previous[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - upper_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - upper_left)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else upper_left)) & 0xFF
        colours.update(bytes(line[i : i + step]) for i in range(0, stride, step * 7))
        previous = line
    return len(colours)


def chromium(url, screenshot, workdir):
    """Render URL: its screenshot written, its DOM returned."""
    binary = shutil.which('chromium') or shutil.which('chromium-browser')
    if not binary:
        sys.exit("no chromium: install Debian's chromium package (apt-get install chromium)")
    profile = tempfile.mkdtemp(dir=workdir)
    common = [binary] + CHROMIUM_FLAGS + ['--user-data-dir=' + profile]
    subprocess.run(common + ['--screenshot=' + screenshot, url], check=True, capture_output=True, timeout=120)
    return subprocess.run(common + ['--dump-dom', url], check=True, capture_output=True, timeout=120).stdout.decode()


def dashboard_queries(service):
    with open(DASHBOARD) as f:
        panels = json.load(f)['panels']
    return [
        ('%02d%s' % (panel['id'], target['refId']), panel['title'], target['expr'].replace('$service', service))
        for panel in panels
        for target in panel['targets']
    ]


def graph_url(prometheus, expr):
    query = urllib.parse.urlencode({'g0.expr': expr, 'g0.tab': '0', 'g0.range_input': '1h'})
    return '%s/graph?%s' % (prometheus.rstrip('/'), query)


def shoot(out, name, url, workdir, shows_content):
    path = os.path.join(out, name + '.png')
    dom = chromium(url, path, workdir)
    colours = png_colours(path)
    problem = shows_content(dom)
    if colours < MIN_COLOURS:
        problem = problem or 'only %d colours' % colours
    print('%s %s (%d colours)%s' % ('FAILED' if problem else 'ok', path, colours, ': ' + problem if problem else ''))
    return problem


def graph_problem(dom):
    if 'Empty query result' in dom:
        return 'Prometheus says: Empty query result'
    if 'Error executing query' in dom or 'bad_data' in dom:
        return 'Prometheus refused the query'
    # The legend names each series by its labels.
    if not any(label in dom for label in ('instance=', 'replica=', 'service=')):
        return 'no series in the legend'
    return None


def page_problem(dom):
    words = len(dom.split())
    return None if words > 50 else 'only %d words' % words


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--prometheus', help="the Prometheus the dashboard reads, e.g. the sandbox's")
    parser.add_argument('--service', default='vllm-kimi', help="the dashboard's $service (default: vllm-kimi)")
    parser.add_argument('--page', action='append', default=[], help='a page (URL or file) to shoot as well')
    parser.add_argument('--out', default='.build/screenshots')
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    problems = []
    with tempfile.TemporaryDirectory() as workdir:
        if args.prometheus:
            for name, title, expr in dashboard_queries(args.service):
                problem = shoot(args.out, 'graph-' + name, graph_url(args.prometheus, expr), workdir, graph_problem)
                if problem:
                    problems.append('%s (%s): %s' % (title, expr, problem))
        for page in args.page:
            url = page if '://' in page else 'file://' + os.path.abspath(page)
            name = 'page-' + os.path.splitext(os.path.basename(urllib.parse.urlsplit(url).path))[0]
            problem = shoot(args.out, name, url, workdir, page_problem)
            if problem:
                problems.append('%s: %s' % (page, problem))
    for problem in problems:
        print('shows no content: ' + problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
