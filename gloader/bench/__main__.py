"""`python -m gloader.bench`: see `gloader.bench`."""
from .cli import main

raise SystemExit(main())
