"""The control plane as a target chosen once per command (planes/base.py says what a plane
offers): ``plane_for`` is the one place that picks it, from ``spec.controlPlane.mode``.

- ``systemd.py``: systemd units on the control hosts (etcd_hosts.py: etcd over SSH);
- ``hosted.py``: pods in a namespace of a hosting cluster (etcd_pods.py: etcd through
  ``pods/exec``; tenant_roll.py: its objects rolled by component).

Adding a kind of control plane is one class here with the operations of ``ControlPlane``, a line
in ``plane_for``, and its tests (docs/architecture.md, "The control plane").
"""

from __future__ import annotations

from installer.engine.planes.base import CONTROL_PLANE_UNITS, ControlPlane
from installer.engine.planes.systemd import SystemdPlane


def plane_for(inv, session, state=None) -> ControlPlane:
    """The plane of ``inv``'s cluster for one command (``session``: its connections; ``state``:
    its state directory, which a hosted tenant's namespace records as its owner)."""
    if inv.hosted:
        # lazy: the hosting cluster's client and pods/exec (urllib3, websocket), for tenants only
        from installer.engine.planes.hosted import HostedPlane
        return HostedPlane(inv, session, state)
    return SystemdPlane(inv, session, state)


__all__ = ["CONTROL_PLANE_UNITS", "ControlPlane", "SystemdPlane", "plane_for"]
