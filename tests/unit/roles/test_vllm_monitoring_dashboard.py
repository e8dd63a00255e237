# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The Grafana dashboard that vllm_monitoring ships, judged by Grafana's own models of its dashboard schema.

No Grafana server can be installed here; grafana-foundation-sdk is Grafana's published schema as Python models. A
field the schema does not know is dropped by them, and a value of another shape comes back changed. Its queries are
run against the sandbox's Prometheus in tests/integration/sandbox/test_monitoring.py.
"""

import json
import os
import re

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

ROLES = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'roles')
DASHBOARD = os.path.join(ROLES, 'vllm_monitoring', 'files', 'llmserve-vllm-dashboard.json')
METRICS_TEMPLATE = os.path.join(ROLES, 'vllm_kimi', 'templates', 'metrics.prom.j2')


def load():
    with open(DASHBOARD) as f:
        return json.load(f)


def lost_or_changed(ours, grafanas, path=''):
    """Where Grafana's model of the dashboard lost or changed what ours says (defaults it adds are no change)."""
    if isinstance(ours, dict) and isinstance(grafanas, dict):
        found = []
        for key in ours:
            if key not in grafanas:
                found.append('%s.%s lost' % (path, key))
            else:
                found += lost_or_changed(ours[key], grafanas[key], '%s.%s' % (path, key))
        return found
    if isinstance(ours, list) and isinstance(grafanas, list) and len(ours) == len(grafanas):
        return [p for i, (a, b) in enumerate(zip(ours, grafanas)) for p in lost_or_changed(a, b, '%s[%d]' % (path, i))]
    return [] if ours == grafanas else ['%s changed: %r to %r' % (path, ours, grafanas)]


def through_grafanas_model(dashboard):
    return json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))


def test_the_dashboard_survives_grafanas_schema_unchanged():
    dashboard = load()
    assert lost_or_changed(dashboard, through_grafanas_model(dashboard)) == []


def test_a_field_the_schema_does_not_know_would_be_seen():
    dashboard = load()
    dashboard['panels'][0]['gridpos'] = dashboard['panels'][0].pop('gridPos')
    assert lost_or_changed(dashboard, through_grafanas_model(dashboard)) == ['.panels[0].gridpos lost']


def test_panels_have_their_own_ids_and_places():
    panels = load()['panels']
    assert len({panel['id'] for panel in panels}) == len(panels)
    cells = [
        (x, y)
        for panel in panels
        for x in range(panel['gridPos']['x'], panel['gridPos']['x'] + panel['gridPos']['w'])
        for y in range(panel['gridPos']['y'], panel['gridPos']['y'] + panel['gridPos']['h'])
    ]
    assert len(cells) == len(set(cells)), 'panels overlap'
    assert all(panel['gridPos']['x'] + panel['gridPos']['w'] <= 24 for panel in panels)


@pytest.mark.parametrize('panel', load()['panels'], ids=lambda panel: panel['title'])
def test_each_query_selects_the_chosen_services_through_the_chosen_datasource(panel):
    assert panel['targets'], panel['title']
    for target in panel['targets']:
        assert target['datasource'] == {'type': 'prometheus', 'uid': '${datasource}'}
        assert 'service=~"$service"' in target['expr'], target['expr']


def test_every_llmserve_series_it_reads_is_one_the_role_writes():
    with open(METRICS_TEMPLATE) as f:
        written = set(re.findall(r'\bllmserve_[a-z_]+', f.read()))
    read = {
        name
        for panel in load()['panels']
        for t in panel['targets']
        for name in re.findall(r'\bllmserve_[a-z_]+', t['expr'])
    }
    assert read and read <= written, sorted(read - written)
