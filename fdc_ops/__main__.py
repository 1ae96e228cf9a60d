"""``python -m fdc_ops <command>``: the command-line applications (fdc_ops/apps/cli.py)."""

from .apps.cli import main

main()
