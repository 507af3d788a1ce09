"""python -m tokenmill: the command line."""

from tokenmill.cli import main

raise SystemExit(main())
