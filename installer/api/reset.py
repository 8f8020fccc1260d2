"""`installer reset`: take off every host what the installer put there."""

from installer.actions.reset import reset

__all__ = ["reset"]
