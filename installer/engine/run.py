"""One command's run: its cluster (inventory and state), its session (connections), the locks it
holds and its control plane, opened once and handed down.

``open_run(cluster)`` opens one: the state directory held (an flock), a ``Session`` whose
connections open on first use, and the ``ControlPlane`` the inventory names (``planes.plane_for``,
the one place that picks it). Everything is given back when the block ends, a failure
included: the apply lock first (its release is a round trip of the run), then the plane's own
clients, then the connections.

A command inside another one (an apply inside ``node add`` or an upgrade's turn, ``etcd member
remove`` inside ``node remove``) is handed the outer command's Run, not a Cluster:
``open_run(run)`` gives it back as it is, ``run.derived(inv)`` the same run on another inventory
(a node left out, other versions). So one process holds one lock per command and needs no
registry of what it holds: the lock file and the Lease name the run's id, and a nested command
asking again finds its own.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

from installer.core.cluster import Cluster
from installer.core.inventory import Inventory
from installer.core.state import StateDir, default_state_dir
from installer.engine.planes import ControlPlane, plane_for
from installer.engine.session import Session
from installer.host.ssh import Remote

Log = Callable[[str], None]


@dataclasses.dataclass(eq=False)
class Run:
    cluster: Cluster
    session: Session
    plane: ControlPlane
    log: Log = print

    @property
    def inv(self) -> Inventory:
        return self.cluster.inv

    @property
    def state(self):
        return self.cluster.state

    @property
    def material(self):
        return self.cluster.material

    @property
    def plans(self):
        return self.cluster.plans

    def derived(self, inv: Inventory) -> Run:
        """This run on another inventory of the same cluster (a node left out, other versions):
        the same state, connections, locks and plane."""
        return dataclasses.replace(self, cluster=self.cluster.with_inventory(inv))

    # a Run stands wherever its Cluster does (an action handed either reads the same fields)
    with_inventory = derived

    @contextmanager
    def hold(self, skip: frozenset[str] = frozenset()) -> Iterator[Run]:
        """The apply lock for the command's whole length: on every control host but ``skip``
        (hosts known to be gone), or a hosted tenant's Lease; their connections open. A command
        inside one that holds it (the same Run) goes on under that hold."""
        if self.session.holding:
            yield self
            return
        self.plane.hold(self, skip)
        self.session.holding = True
        # every command of the run from here on carries its mark (applylock.end_dead_run)
        self.session.mark_scope(always=True)
        try:
            yield self
        finally:
            self.session.holding = False
            self.plane.release()


@contextmanager
def open_run(target: Cluster | Run | Inventory, *, log: Log = print, accept_new_host_keys: bool = False,
             remote: Callable[..., Remote] = Remote, hold_state: bool = True) -> Iterator[Run]:
    """The command's Run on ``target``: a Cluster, opened here and closed at the end of the
    block; a Run, the caller's, as it is; an Inventory, on its default state directory. The state
    is held unless ``hold_state`` is False or ``target`` is an Inventory: a command that writes
    none (the etcd member list, a snapshot save) runs beside an apply, and reads the state only
    for a hosted tenant's owner id (core/tenancy.py)."""
    if isinstance(target, Run):
        yield target
        return
    cluster = target if isinstance(target, Cluster) else Cluster(target, StateDir(default_state_dir(target)))
    hold = hold_state and isinstance(target, Cluster)
    with cluster.state.locked(create=False) if hold else nullcontext(), \
            Session(cluster.inv, log=log, accept_new_host_keys=accept_new_host_keys, remote=remote) as session:
        plane = plane_for(cluster.inv, session, cluster.state)
        try:
            yield Run(cluster, session, plane, log)
        finally:
            plane.close()           # the locks first: their release is the run's round trips
