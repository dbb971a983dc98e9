"""layerswap app: `python app.py` starts on the offline demo models; pass --math/--lang/--base for your own.

The Hugging Face Space entry point (it reads the same flags from LAYERSWAP_* environment variables).
`layerswap app` (after `pip install layerswap`) is the same program.
"""

from layerswap.ui.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
