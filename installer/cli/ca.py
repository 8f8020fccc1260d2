"""``installer ca``: rotate the cluster's certificate authorities."""

from __future__ import annotations

import click


@click.group()
def ca():
    """Certificate-authority operations."""
