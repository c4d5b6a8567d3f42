"""``python -m magi_attention.info``."""

from . import console_main

if __name__ == "__main__":
    console_main()
