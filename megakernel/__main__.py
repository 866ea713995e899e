"""`python -m megakernel ...`: see megakernel.cli."""

from megakernel.cli import main

raise SystemExit(main())
