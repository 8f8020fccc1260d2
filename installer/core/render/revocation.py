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
"""

from __future__ import annotations

import json

from installer.core.render.manifests import LABELS

POLICY = "hiddenplane-revoked-nodes"


def identity(node: str) -> str:
    return f"system:node:{node}"


def expression(nodes: list[str]) -> str:
    """True when the request may pass: its user is none of the revoked identities."""
    # json.dumps of a plain string is a valid CEL string literal (same escapes)
    names = ", ".join(json.dumps(identity(n)) for n in sorted(set(nodes)))
    return f"!(request.userInfo.username in [{names}])"


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
