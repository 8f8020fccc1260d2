"""The admission policy that shuts revoked node identities out of every write.

Kubernetes has no certificate revocation list: a kubelet client certificate stays valid for the
apiserver until it expires. NodeRestriction alone does not help either: it lets a node create
its own Node object again after it was deleted. So ``node revoke`` adds ``system:node:<name>``
to one ValidatingAdmissionPolicy that denies every write (create, update, delete, connect, on
every resource and subresource) made by a revoked identity. Reads are not admission requests;
the Node authorizer limits a node to objects bound to it, and once its Node and pods are gone
that is next to nothing.

The CEL expression lists the names literally (a ledger of a few names, not a parameter object):
what is denied is visible in the policy itself, and tests evaluate this exact string with a CEL
library against sample requests.

Revocations only ever grow. ``node revoke`` reads the names the live policy denies
(``parse_expression``, the exact inverse of ``expression``: anything else is someone's edit and
stops the command before it writes) and writes the union with the state's ledger, so a run from a
state directory older than another revoke cannot drop that revoke. No command takes a name out,
deliberately: a revoked identity may hold a stolen certificate until it expires, and a name
dropped by mistake lets that certificate re-create its Node. Undoing one is a manual act, safe
only once no certificate of the name can be valid any more (expired, or after ``installer ca
rotate``): remove ``"system:node:<name>"`` from the expression keeping its exact form
(``kubectl edit validatingadmissionpolicy hiddenplane-revoked-nodes``), and the name's entry
from ``nodes.yaml`` in *every* state directory that has it (one still marking it revoked puts it
back at its next revoke).
"""

from __future__ import annotations

import json

from installer.core.inventory_fields import DNS1123_LABEL
from installer.core.render.manifests import LABELS

POLICY = "hiddenplane-revoked-nodes"
_NODE = "system:node:"
_HEAD, _TAIL = "!(request.userInfo.username in [", "])"


def identity(node: str) -> str:
    return f"{_NODE}{node}"


def expression(nodes: list[str]) -> str:
    """True when the request may pass: its user is none of the revoked identities."""
    # json.dumps of a plain string is a valid CEL string literal (same escapes)
    names = ", ".join(json.dumps(identity(n)) for n in sorted(set(nodes)))
    return f"{_HEAD}{names}{_TAIL}"


def parse_expression(expr: object) -> list[str]:
    """The node names ``expr`` denies, when ``expr`` is exactly what ``expression`` renders for
    them (sorted, unique, each a DNS-1123 label); ValueError saying what differs otherwise.
    Strict on purpose: an edited expression (another operator, a condition added, the list
    reordered) may deny more or less than its names say, so nothing is guessed from it."""
    if not isinstance(expr, str):
        raise ValueError(f"the expression is not a string: {expr!r}")
    if not (expr.startswith(_HEAD) and expr.endswith(_TAIL) and len(expr) >= len(_HEAD) + len(_TAIL)):
        raise ValueError(f"the expression is not of the form {_HEAD}...{_TAIL}: {expr!r}")
    try:
        # the list between the brackets, read as JSON: the literals expression() writes are JSON
        items = json.loads("[" + expr[len(_HEAD):-len(_TAIL)] + "]")
    except ValueError:
        raise ValueError(f"the list is not one of quoted user names: {expr!r}") from None
    names = []
    for item in items:
        name = item[len(_NODE):] if isinstance(item, str) and item.startswith(_NODE) else None
        if name is None or not DNS1123_LABEL.fullmatch(name):
            raise ValueError(f"{item!r} is not {_NODE}<a DNS-1123 label>")
        names.append(name)
    if expression(names) != expr:
        raise ValueError(f"the expression is not in the exact form `installer node revoke` writes (sorted, "
                         f"unique, \", \" between names): {expr!r}")
    return names


def policy_names(policy: dict) -> list[str]:
    """The node names a live revoked-nodes policy denies: its one validation's expression
    (``parse_expression``). ValueError when the policy holds anything else in its validations."""
    validations = (policy.get("spec") or {}).get("validations")
    if not isinstance(validations, list) or len(validations) != 1 or not isinstance(validations[0], dict):
        raise ValueError(f"spec.validations is not the one validation `installer node revoke` writes: {validations!r}")
    return parse_expression(validations[0].get("expression"))


def policy_objects(nodes: list[str]) -> list[dict]:
    """The policy and its binding (Deny). ``nodes`` must not be empty."""
    if not nodes:
        raise ValueError("no revoked node")
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY, "labels": LABELS},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [{
                    "apiGroups": ["*"], "apiVersions": ["*"],
                    "operations": ["CREATE", "UPDATE", "DELETE", "CONNECT"],
                    # every resource and every subresource (nodes/status, pods/eviction, ...);
                    # the apiserver refuses "*/*" beside anything else
                    "resources": ["*/*"],
                }],
            },
            "validations": [{
                "expression": expression(nodes),
                "message": "this node identity was revoked by hiddenplane (installer node revoke)",
                "reason": "Forbidden",
            }],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY, "labels": LABELS},
        "spec": {"policyName": POLICY, "validationActions": ["Deny"]},
    }
    return [policy, binding]
