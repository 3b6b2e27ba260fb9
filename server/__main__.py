"""``python -m specserve.server`` = the ``specserve`` command."""

from specserve.server.cli import main

raise SystemExit(main())
