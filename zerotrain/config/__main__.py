"""``python -m zerotrain.config``: print the Markdown reference (``> docs/config.md``);
``python -m zerotrain.config FILE [--world-size N]``: check FILE, as ``zerotrain config check``
does."""

import argparse
import sys

from zerotrain.config.docs import config_reference_markdown
from zerotrain.config.report import check_file


def main() -> int:
    """Print the Markdown reference of the config, or check the file given."""
    if len(sys.argv) == 1:
        sys.stdout.write(config_reference_markdown())
        return 0
    parser = argparse.ArgumentParser(prog="python -m zerotrain.config")
    parser.add_argument("file", metavar="FILE", help="a .json, .yaml or .yml config")
    parser.add_argument("--world-size", type=int, help="also resolve the batch keys")
    args = parser.parse_args()
    ok, report = check_file(args.file, args.world_size)
    print(report, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
