"""``python -m foundry`` runs the ``foundry`` command."""

from foundry.cli import main

raise SystemExit(main())
