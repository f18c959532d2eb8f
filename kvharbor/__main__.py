"""``python -m kvharbor``: the same as the ``kvharbor`` command."""

from kvharbor.cli import main

raise SystemExit(main())
