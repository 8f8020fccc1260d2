"""`installer reset`: take off every host what the installer put there."""

from installer.actions.reset import plan, reset

__all__ = ["plan", "reset"]
