"""Command-line interface: a thin click layer over ``installer.api``."""
