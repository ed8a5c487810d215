"""``python -m alpacafarm`` runs the command-line interface."""

from alpacafarm.cli import main

raise SystemExit(main())
