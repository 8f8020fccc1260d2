"""What several command groups say the same way."""

import json

import click

STATE_DEFAULT = "Default: .hiddenplane/<cluster> next to the inventory file."

# day-2 commands: one JSON document on stdout (progress stays on stderr), and a dry run
OUTPUT = click.option("--output", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
                      help="json: the result on stdout as one JSON document (progress stays on stderr).")
DRY_RUN = click.option("--dry-run", is_flag=True,
                       help="Print the steps it would run, in order; change nothing (exit 0).")


def echo_json(doc) -> None:
    click.echo(json.dumps(doc, indent=2))


def echo_plan(what: str, steps: list[str], fmt: str, **extra) -> None:
    """A dry run's steps, as text or as ``{"dryRun": true, "steps": [...]}`` (exit 0)."""
    if fmt == "json":
        echo_json({**extra, "dryRun": True, "steps": steps})
        return
    click.echo(f"{what} would:")
    for step in steps:
        click.echo(f"  - {step}")
