"""`python -m layerswap.cli`: the same as the `layerswap` command."""

import sys

from . import main

sys.exit(main())
