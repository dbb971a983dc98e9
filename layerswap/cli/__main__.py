"""`python -m layerswap.cli`: the same as the `layerswap` command."""

import sys

from layerswap.cli import main

sys.exit(main())
