# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The README is a front door to docs/: short, linking every page, and every relative link of the prose lands on a
file and, where it names one, a heading there. Every task of vllm_kimi that stops a play with a message of its own has
an entry in docs/troubleshooting.md, under the task's name as the play shows it."""

import glob
import os
import re

import pytest
import yaml

from ansible_collections.llmserve.vllm.tests.support import REPO

README = os.path.join(REPO, 'README.md')
PAGES = sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))
PROSE = (
    [README, os.path.join(REPO, 'CONTRIBUTING.md')]
    + PAGES
    + sorted(glob.glob(os.path.join(REPO, 'roles', '*', 'README.md')))
)
MAX_README_LINES = 200
LINK = re.compile(r'\]\(([^)\s]+)\)')


def read(path):
    with open(path) as handle:
        return handle.read()


def anchors(path):
    """The anchors GitHub gives a file's headings: lower case, spaces to dashes, punctuation but - and _ dropped."""
    return {
        re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')
        for heading in re.findall(r'^#+ (.+)$', read(path), flags=re.MULTILINE)
    }


def test_the_readme_is_short_and_links_every_page():
    text = read(README)
    assert len(text.splitlines()) <= MAX_README_LINES
    assert PAGES, 'docs/ has no page'
    linked = {os.path.normpath(os.path.join(REPO, link.partition('#')[0])) for link in LINK.findall(text)}
    assert [page for page in PAGES if page not in linked] == []


@pytest.mark.parametrize('path', PROSE, ids=lambda path: os.path.relpath(path, REPO))
def test_every_relative_link_lands(path):
    broken = []
    for link in LINK.findall(read(path)):
        if re.match(r'[a-z]+:', link):
            continue
        target, anchor = (link.split('#', 1) + [''])[:2]
        full = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(full):
            broken.append('%s (no such file)' % link)
        elif anchor and full.endswith('.md') and anchor not in anchors(full):
            broken.append('%s (no such heading)' % link)
    assert broken == []


def stopping_tasks(tasks):
    """The names of the tasks that end a play with a message of their own (assert, fail), blocks walked."""
    for task in tasks or []:
        for part in ('block', 'rescue', 'always'):
            yield from stopping_tasks(task.get(part))
        if 'ansible.builtin.assert' in task or 'ansible.builtin.fail' in task:
            yield task['name']


def test_every_task_that_stops_a_play_has_a_troubleshooting_entry():
    entries = set(re.findall(r'^### (.+)$', read(os.path.join(REPO, 'docs', 'troubleshooting.md')), flags=re.MULTILINE))
    names = set()
    for path in glob.glob(os.path.join(REPO, 'roles', 'vllm_kimi', 'tasks', '*.yml')):
        names.update(stopping_tasks(yaml.safe_load(read(path))))
    assert len(names) >= 20
    assert sorted(names - entries) == []


def test_every_alert_has_a_runbook_entry_where_its_runbook_url_points():
    with open(os.path.join(REPO, 'roles', 'vllm_monitoring', 'templates', 'llmserve_alerts.yml.j2')) as handle:
        rules = handle.read()
    alerts = re.findall(r'- alert: (\w+)', rules)
    targets = re.findall(r'runbook_url: "\[\[ vllm_monitoring_runbook_url \]\]#([a-z]+)"', rules)
    assert alerts and targets == [alert.lower() for alert in alerts]
    assert set(targets) <= anchors(os.path.join(REPO, 'docs', 'troubleshooting.md'))


def test_the_readme_names_every_phase_tag_of_the_role_and_no_other():
    tags = set()
    with open(os.path.join(REPO, 'roles', 'vllm_kimi', 'tasks', 'main.yml')) as handle:
        for task in yaml.safe_load(handle):
            tags.update(task.get('tags', []))
    listed = re.search(r'^Tags select phases: (.+?)\. ', read(README), flags=re.MULTILINE | re.DOTALL)
    assert listed, 'README.md has no "Tags select phases:" sentence'
    assert sorted(re.findall(r'`(\w+)`', listed.group(1))) == sorted(tags - {'vllm_kimi'})


def test_galaxy_the_changelog_and_the_readme_name_the_same_release():
    with open(os.path.join(REPO, 'galaxy.yml')) as handle:
        version = yaml.safe_load(handle)['version']
    with open(os.path.join(REPO, 'changelogs', 'changelog.yaml')) as handle:
        releases = yaml.safe_load(handle)['releases']
    assert max(releases, key=lambda release: tuple(int(part) for part in release.split('.'))) == version
    assert 'this is release %s.' % version in read(os.path.join(REPO, 'README.md'))
    assert '\nv%s\n' % version in read(os.path.join(REPO, 'CHANGELOG.rst'))


def test_every_vllm_release_the_docs_and_playbooks_name_is_one_the_project_read():
    """A `vllm==X` in a user's command or default is a release whose wheel tests/fixtures/vllm_serve_options records
    (read from PyPI), not one that does not exist."""
    recorded = {
        name[: -len('.txt')] for name in os.listdir(os.path.join(REPO, 'tests', 'fixtures', 'vllm_serve_options'))
    }
    texts = PROSE + sorted(glob.glob(os.path.join(REPO, 'playbooks', '**', '*.yml'), recursive=True))
    texts += sorted(glob.glob(os.path.join(REPO, 'roles', '*', 'defaults', 'main.yml')))
    texts += sorted(glob.glob(os.path.join(REPO, 'inventories', '**', '*.yml'), recursive=True))
    named = {
        (os.path.relpath(path, REPO), release)
        for path in texts
        for release in re.findall(r'\bvllm==([\w.]+)', read(path))
    }
    assert named and sorted((path, release) for path, release in named if release not in recorded) == []
