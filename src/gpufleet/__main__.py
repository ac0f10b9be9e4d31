"""``python -m gpufleet`` is the ``gpufleet`` command."""

from gpufleet.cli import main

raise SystemExit(main())
