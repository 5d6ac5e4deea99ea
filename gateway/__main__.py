"""`python -m gateway`: the `mlxd` command."""

from gateway.cli import main

raise SystemExit(main())
