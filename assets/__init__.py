"""Data shipped with layerswap: the demo organism (demo/). Installed as the package `layerswap.assets`."""
