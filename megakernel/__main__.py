"""`python -m megakernel ...`: see megakernel.cli.main."""

from megakernel.cli.main import main

raise SystemExit(main())
