# Copyright (c) llmserve.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Properties of the deployment state over generated input.

Whatever a record.json or a rollbacks.json holds, reading it gives a record or DeploymentError naming the file,
nothing else; whatever record is recorded, it is refused with nothing written, or it reads back as it was and the
restore puts its files back: no record is ever written that ends the rollbacks. A deployment's name is built from a
release only where the release is 12 hexadecimal digits and nothing else.
"""

import json
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ansible_collections.llmserve.vllm.plugins.module_utils._deployment import (
    DeploymentError,
    deployment_name,
    ensure_private_directory,
    last_good,
    record,
    restore,
    rollbacks,
)

pytestmark = pytest.mark.adversarial

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
GOOD = '20261201T120000Z-0123456789ab'
# The most a record may hold, as the module documents it.
LIMIT = 1 << 20

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


def nested(depth):
    value = []
    for dummy in range(depth):
        value = [value]
    return value


def deep_text(depth):
    return '{"a": ' + '[' * depth + ']' * depth + '}'


texts = (
    st.binary(max_size=64)
    | json_values.map(lambda value: json.dumps(value).encode('utf-8'))
    | st.integers(1, 200000).map(lambda depth: deep_text(depth).encode('ascii'))
    | st.integers(1, 200000).map(lambda depth: ('[' * depth).encode('ascii'))
)


def host(directory):
    deployments = os.path.join(directory, 'deployments')
    ensure_private_directory(deployments, False)
    unit, env = os.path.join(directory, 'unit'), os.path.join(directory, 'env')
    for path, text in ((unit, '[Service]\n'), (env, 'KEY=1\n')):
        with open(path, 'w') as handle:
            handle.write(text)
    return deployments, unit, env


def files_under(directory):
    found = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            found[full] = os.readlink(full) if os.path.islink(full) else None
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, 'rb') as handle:
                    found[full] = handle.read()
    return found


@SETTINGS
@given(texts, texts)
def test_reading_any_bytes_gives_a_record_or_the_modules_error(tmp_path_factory, record_text, count_text):
    deployments, unit, env = host(str(tmp_path_factory.mktemp('read')))
    os.mkdir(os.path.join(deployments, GOOD), 0o700)
    with open(os.path.join(deployments, GOOD, 'record.json'), 'wb') as handle:
        handle.write(record_text)
    with open(os.path.join(deployments, 'rollbacks.json'), 'wb') as handle:
        handle.write(count_text)
    os.symlink(GOOD, os.path.join(deployments, 'last-good'))
    try:
        name, found = last_good(deployments)
    except DeploymentError as exc:
        assert str(exc).startswith(os.path.join(deployments, GOOD, 'record.json') + ' '), str(exc)
    else:
        assert name == GOOD and isinstance(found, dict)
    try:
        counted = rollbacks(deployments)
    except DeploymentError as exc:
        assert str(exc).startswith(os.path.join(deployments, 'rollbacks.json') + ' '), str(exc)
    else:
        assert all(isinstance(counted[key], int) and counted[key] >= 0 for key in ('total', 'last'))


records = st.fixed_dictionaries(
    {'release': st.just('0123456789ab')},
    optional={
        'extra': json_values,
        'deep': st.integers(1, 60).map(nested),
        # Around the limit: the record refused whole or written whole.
        'pad': st.integers(LIMIT - 300, LIMIT + 300).map(lambda size: 'x' * size),
    },
)


@SETTINGS
@given(records)
def test_a_record_is_refused_untouched_or_reads_back_and_restores(tmp_path_factory, content):
    directory = str(tmp_path_factory.mktemp('record'))
    deployments, unit, env = host(directory)
    before = files_under(directory)
    try:
        done = record(deployments, GOOD, content, unit, env, None, 3, False)
    except DeploymentError:
        assert files_under(directory) == before
        return
    assert last_good(deployments) == (GOOD, done['record']) and done['record'] == dict(content, deployment=GOOD)
    with open(unit, 'w') as handle:
        handle.write('[Service]\nUser=root\n')
    restored = restore(deployments, unit, env, lambda: 1796126400, False)
    assert restored['record'] == done['record']
    with open(unit) as handle:
        assert handle.read() == '[Service]\n'


RELEASE = re.compile(r'\A[0-9a-f]{12}\Z')


@SETTINGS
@given(
    st.text(max_size=14)
    | st.sampled_from(['0123456789ab\n', '0123456789ab\r', '\n0123456789ab', '0123456789ab\x00', '0123456789AB'])
)
def test_a_name_is_built_only_from_a_whole_release(release):
    try:
        name = deployment_name('20261201T120000Z', release)
    except DeploymentError:
        assert not RELEASE.match(release)
    else:
        assert RELEASE.match(release) and name == '20261201T120000Z-' + release
