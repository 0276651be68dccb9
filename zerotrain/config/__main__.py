"""``python -m zerotrain.config``: print the Markdown reference (``> docs/config.md``)."""

import sys

from zerotrain.config.docs import config_reference_markdown


def main() -> None:
    """Print the Markdown reference of the config."""
    sys.stdout.write(config_reference_markdown())


if __name__ == "__main__":
    main()
