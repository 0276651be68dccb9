"""``python -m zerotrain.config``: print the Markdown reference (``> docs/config.md``);
``python -m zerotrain.config FILE [--world-size N]``: check FILE (``zerotrain config check``)."""

import sys

from zerotrain.config.docs import config_reference_markdown


def main() -> int:
    """Print the Markdown reference of the config, or check the file given."""
    if len(sys.argv) > 1:
        from zerotrain.cli import main as cli_main

        return cli_main(["config", "check", *sys.argv[1:]])
    sys.stdout.write(config_reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
