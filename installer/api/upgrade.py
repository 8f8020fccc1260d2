"""`installer upgrade`: roll a running cluster to new versions, one host at a time."""

from installer.actions.upgrade import UpgradeReport, cordoned_by_upgrade, upgrade

__all__ = ["UpgradeReport", "cordoned_by_upgrade", "upgrade"]
