"""Who owns a hosted tenant's namespace (core/tenancy.py): the rule, and the state's id. The
same guard against the real hosting cluster: tests/test_real_hosted.py (second_tenant)."""

from __future__ import annotations

import os
import stat

import pytest

from installer.core.errors import StateError
from installer.core.state import StateDir
from installer.core.state_tenant import TENANT_ID
from installer.core.tenancy import OWNER, owner_object, ownership_problem

NS, TENANT, ID = "hp-prod", "prod", "0123456789abcdef0123456789abcdef"


def namespace(labels: dict | None) -> dict:
    return {"metadata": {"name": NS, **({"labels": labels} if labels is not None else {})}}


@pytest.mark.parametrize("live, owner, state_id, refused", [
    # none yet: apply makes it (and records this state)
    (None, None, None, None),
    (None, None, ID, None),
    # the tenant's, recorded by this state
    (namespace({"hiddenplane.io/tenant": TENANT}), {"tenant": TENANT, "state": ID}, ID, None),
    # the tenant's, owner not recorded yet (an earlier release made it, or the hosting admin
    # made it for this tenant): the label lets it in, the next apply records the owner
    (namespace({"hiddenplane.io/tenant": TENANT}), None, ID, None),
    (namespace({"hiddenplane.io/tenant": TENANT}), None, None, None),
    # an application's namespace (no label), kube-system-like ones, another tenant's
    (namespace(None), None, ID, "its label hiddenplane.io/tenant is missing"),
    (namespace({"app": "shop"}), None, ID, "its label hiddenplane.io/tenant is missing"),
    (namespace({"hiddenplane.io/tenant": "other"}), {"tenant": "other", "state": ID}, ID,
     "its label hiddenplane.io/tenant is 'other'"),
    # another cluster of the same name (another state), or a state with no id (a wrong --state)
    (namespace({"hiddenplane.io/tenant": TENANT}), {"tenant": TENANT, "state": "f" * 32}, ID,
     "its owner id ffffffff…, this state's 01234567…"),
    (namespace({"hiddenplane.io/tenant": TENANT}), {"tenant": TENANT, "state": ID}, None,
     "its owner id 01234567…, this state's none"),
    # an owner ConfigMap without the id is nobody's
    (namespace({"hiddenplane.io/tenant": TENANT}), {}, ID, "another state directory applied it"),
])
def test_a_namespace_is_used_only_when_it_is_the_tenants_and_this_states(live, owner, state_id, refused):
    problem = ownership_problem(NS, TENANT, live, owner, state_id)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem and f"namespace {NS}" in problem, problem
        assert problem.endswith("nothing was changed"), problem


def test_the_owner_object_names_the_tenant_and_the_state():
    obj = owner_object(NS, TENANT, ID)
    assert (obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"]) == ("ConfigMap", OWNER, NS)
    assert obj["data"] == {"tenant": TENANT, "state": ID}
    assert obj["metadata"]["labels"]["hiddenplane.io/tenant"] == TENANT
    # what the guard reads back from it passes, for this state only
    live = namespace({"hiddenplane.io/tenant": TENANT})
    assert ownership_problem(NS, TENANT, live, obj["data"], ID) is None
    assert ownership_problem(NS, TENANT, live, obj["data"], "e" * 32) is not None


def test_the_state_makes_its_id_once_under_its_lock_and_keeps_it(tmp_path):
    state = StateDir(tmp_path / "state")
    assert state.tenant_id() is None                # no state directory yet
    with pytest.raises(StateError, match="only under its lock"):
        state.ensure_tenant_id()
    with state.locked(create=True):
        made = state.ensure_tenant_id()
        assert state.ensure_tenant_id() == made
    assert len(made) == 32 and int(made, 16) >= 0
    assert state.tenant_id() == made and StateDir(tmp_path / "state").tenant_id() == made
    assert stat.S_IMODE(os.stat(state.root / TENANT_ID).st_mode) == 0o600
    with StateDir(tmp_path / "other").locked(create=True) as other:
        assert other.ensure_tenant_id() != made


def test_a_corrupt_state_id_is_refused_naming_the_file(tmp_path):
    state = StateDir(tmp_path / "state")
    with state.locked(create=True):
        (state.root / TENANT_ID).write_text("not-an-id\n")
        os.chmod(state.root / TENANT_ID, 0o600)
    with pytest.raises(StateError, match="tenant-id is corrupt"):
        state.tenant_id()


UID, OTHER_UID = "6c1f0a9e-2b7d-4c8a-9e3f-0a1b2c3d4e5f", "0f0e0d0c-0b0a-4908-8706-050403020100"


def test_a_namespace_made_again_with_copied_labels_and_owner_is_refused():
    """Everything a namespace can be given (its label, the owner ConfigMap) copied into one made
    again under the tenant's name: the UID the state recorded is not its UID."""
    live = namespace({"hiddenplane.io/tenant": TENANT})
    live["metadata"]["uid"] = OTHER_UID
    owner = {"tenant": TENANT, "state": ID}
    problem = ownership_problem(NS, TENANT, live, owner, ID, UID)
    assert problem and f"its UID is {OTHER_UID}, this state's {UID}" in problem and "nothing was changed" in problem
    assert "tenant-namespace-uid" in problem
    # another tenant's namespace is named as that first, whatever UID this state holds
    other = namespace({"hiddenplane.io/tenant": "other"})
    other["metadata"]["uid"] = OTHER_UID
    assert "its label hiddenplane.io/tenant is 'other'" in ownership_problem(NS, TENANT, other, None, ID, UID)
    live["metadata"]["uid"] = UID
    assert ownership_problem(NS, TENANT, live, owner, ID, UID) is None
    # a state from before the UID was kept: the label and the owner record decide, as before
    assert ownership_problem(NS, TENANT, live, owner, ID, None) is None


def test_the_state_keeps_the_namespace_uid_under_its_lock_and_forgets_it(tmp_path):
    from installer.core.state_tenant import NAMESPACE_UID
    state = StateDir(tmp_path / "state")
    with pytest.raises(StateError, match="only under its lock"):
        state.record_namespace_uid(NS, UID)
    with state.locked(create=True):
        state.record_namespace_uid(NS, UID)
        with pytest.raises(StateError, match="which is no UID"):
            state.record_namespace_uid(NS, "../../etc/passwd")
        with pytest.raises(StateError, match="which is no UID"):
            state.record_namespace_uid("a b", UID)
    assert StateDir(tmp_path / "state").namespace_uid(NS) == UID
    # recorded for its namespace only: an inventory naming another has none recorded
    assert state.namespace_uid("hp-other") is None
    assert stat.S_IMODE(os.stat(state.root / NAMESPACE_UID).st_mode) == 0o600
    (state.root / NAMESPACE_UID).write_text("not a uid\n")
    with pytest.raises(StateError, match="tenant-namespace-uid is corrupt"):
        state.namespace_uid(NS)
    with state.locked():
        state.record_namespace_uid(NS, None)                # reset: the namespace is gone
    assert state.namespace_uid(NS) is None
