"""Domain errors. The CLI turns each into one clear message and exit code 2."""


class InstallerError(Exception):
    """Base class of every error a user can cause and fix."""

    exit_code = 2


class InventoryError(InstallerError):
    """The inventory is invalid; ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


class StateError(InstallerError):
    """The local state directory is unusable (permissions, corrupt or foreign files)."""


class RenderError(InstallerError):
    """A template or rendered file is inconsistent."""
