"""``python -m jaxkv [demo|generate|formats] ...``; see `jaxkv.cli`."""

import sys

from jaxkv import cli


def main(argv=None) -> int:
  """Console entry point (``jaxkv`` script and ``python -m jaxkv``)."""
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main())
