"""A KvcsumConnector has one role, the scheduler's or a worker's: a hook of
the other role raises WrongRoleError naming the hook and the connector's
role, before anything is done (the wrapped connector is not called), never
AttributeError on a missing role or a silent no-op. The table of roles
(kvcsum.vllm.connector.WORKER_HOOKS, SCHEDULER_HOOKS) covers every hook of
vLLM 0.33's KVConnectorBase_V1 and agrees with where vLLM calls them. On
the CPU, with the engines of test_connector.py."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
import tempfile
from unittest import mock

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import store_connector  # noqa: E402
from harness import Engine, KVCacheLayout  # noqa: E402

import vllm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvcsum.vllm.connector import (  # noqa: E402
    BOTH_ROLES_HOOKS, PASSED_ON_HOOKS, SCHEDULER_HOOKS, WORKER_HOOKS, KvcsumConnector, WrongRoleError,
)

#: Public methods of KVConnectorBase_V1 that are no hook vLLM calls: a
#: connector's own helper.
NOT_HOOKS = {"has_connector_metadata"}


@pytest.fixture(scope="module")
def engine():
    store = tempfile.mkdtemp(prefix="kvcsum-vllm-roles-")
    store_connector.CORRUPT.clear()
    e = Engine("roles", role="kv_producer", tp=1, block_size=8, layout=KVCacheLayout.LBNHC, store_dir=store)
    yield e
    e.close()
    shutil.rmtree(store, ignore_errors=True)


def stand_in_arguments(hook: str) -> list:
    """One stand-in for each positional parameter vLLM passes the hook."""
    function = getattr(KVConnectorBase_V1, hook, None) or getattr(SupportsHMA, hook)
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [object() for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]


def hooks_of_base() -> set:
    """vLLM's instance methods of a connector: KVConnectorBase_V1's and
    SupportsHMA's public ones that are neither class methods nor properties."""
    names = set()
    for cls in (KVConnectorBase_V1, SupportsHMA):
        for name, value in vars(cls).items():
            if name.startswith("_") or isinstance(value, (classmethod, staticmethod, property)):
                continue
            if callable(value):
                names.add(name)
    return names


def assert_refused(connector, hook: str, needed: str, role: str) -> None:
    inner = mock.MagicMock(name="inner connector")
    with mock.patch.object(connector, "_inner", inner):
        with pytest.raises(WrongRoleError) as raised:
            getattr(connector, hook)(*stand_in_arguments(hook))
    assert str(raised.value) == f"{hook} is a {needed} hook; this KvcsumConnector has the {role} role", raised.value
    assert isinstance(raised.value, RuntimeError)
    assert not inner.mock_calls, f"{hook} on the {role} role called the wrapped connector: {inner.mock_calls}"


@pytest.mark.parametrize("hook", sorted(WORKER_HOOKS))
def test_a_worker_hook_on_the_scheduler_raises_naming_hook_and_role(engine, hook):
    connector = engine.connector()
    assert isinstance(connector, KvcsumConnector) and connector.scheduler_role is not None
    assert_refused(connector, hook, "worker", "SCHEDULER")


@pytest.mark.parametrize("hook", sorted(SCHEDULER_HOOKS))
def test_a_scheduler_hook_on_a_worker_raises_naming_hook_and_role(engine, hook):
    connector = engine.ranks[0].connector
    assert isinstance(connector, KvcsumConnector) and connector.worker_role is not None
    assert_refused(connector, hook, "scheduler", "WORKER")


def test_the_schedulers_verdicts_on_a_worker_raise_naming_the_role(engine):
    with pytest.raises(WrongRoleError, match=r"^last_verdicts is a scheduler property; this KvcsumConnector has the WORKER role$"):
        engine.ranks[0].connector.last_verdicts
    assert engine.connector().last_verdicts == {}


def test_a_hook_of_both_roles_works_on_both(engine):
    for connector in (engine.connector(), engine.ranks[0].connector):
        connector.get_kv_connector_stats()


def test_the_right_roles_hooks_are_the_classs_own_methods(engine):
    """Nothing stands between vLLM and the hooks of the connector's own
    role (they are called every step): each is the class's method, or,
    where kvcsum only passes it on, the wrapped connector's own."""
    scheduler, worker = engine.connector(), engine.ranks[0].connector
    for connector, hooks, role in (
        (scheduler, SCHEDULER_HOOKS | BOTH_ROLES_HOOKS, KVConnectorRole.SCHEDULER),
        (worker, WORKER_HOOKS | BOTH_ROLES_HOOKS, KVConnectorRole.WORKER),
    ):
        for hook in hooks:
            if hook in PASSED_ON_HOOKS[role]:
                assert getattr(connector, hook) == getattr(connector.inner, hook), hook
            else:
                assert hook not in vars(connector), hook


def test_every_hook_of_vllm_has_one_role():
    tables = {"worker": WORKER_HOOKS, "scheduler": SCHEDULER_HOOKS, "both": BOTH_ROLES_HOOKS, "not a hook": NOT_HOOKS}
    base = hooks_of_base()
    for hook in base:
        owners = [name for name, table in tables.items() if hook in table]
        assert len(owners) == 1, f"vLLM's {hook} is in {owners or 'no table'}"
    for name, table in tables.items():
        assert table <= base, f"{name}: not vLLM's hooks: {sorted(table - base)}"


def calls_in(paths: list, receiver: str) -> set:
    """The hooks called on `receiver` (a regular expression) in vLLM's files."""
    root = os.path.dirname(vllm.__file__)
    pattern = re.compile(receiver + r"\.([a-z_]+)\(")
    names = set()
    for relative in paths:
        full = os.path.join(root, relative)
        files = [full] if full.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(full) for f in fs if f.endswith(".py")
        ]
        assert files, full
        for path in files:
            with open(path, encoding="utf-8") as source:
                names |= set(pattern.findall(source.read()))
    return names & hooks_of_base()


def test_the_roles_agree_with_where_vllm_calls_the_hooks():
    worker_calls = calls_in(["v1/worker"], r"(?:kv_connector|get_kv_transfer_group\(\)|kv_transfer_group)")
    scheduler_calls = calls_in(["v1/core/sched/scheduler.py", "v1/engine/core.py"], r"(?:self\.connector|kv_connector)")
    print(f"vLLM's worker calls {sorted(worker_calls)}; its scheduler calls {sorted(scheduler_calls)}", flush=True)
    # Sanity: the scan found the hooks of every step.
    assert {"bind_connector_metadata", "start_load_kv", "wait_for_save", "get_block_ids_with_load_errors"} <= worker_calls
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "update_connector_output"} <= scheduler_calls
    assert not worker_calls - WORKER_HOOKS - BOTH_ROLES_HOOKS, sorted(worker_calls - WORKER_HOOKS - BOTH_ROLES_HOOKS)
    assert not scheduler_calls - SCHEDULER_HOOKS - BOTH_ROLES_HOOKS, sorted(scheduler_calls - SCHEDULER_HOOKS - BOTH_ROLES_HOOKS)
