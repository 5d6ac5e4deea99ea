"""`python -m worker`: the worker's commands."""

from worker.cli import main

raise SystemExit(main())
