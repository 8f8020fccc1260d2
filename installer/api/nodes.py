"""Nodes on day 2: list, add, drain, remove, revoke."""

from installer.actions.node_ops import add, drain, list_nodes, node_target
from installer.actions.node_retire import Outcome, remove, remove_plan, revoke
from installer.core.etcd_rules import Change

__all__ = ["Change", "Outcome", "add", "drain", "list_nodes", "node_target", "remove", "remove_plan", "revoke"]
