"""``python -m jaxkv [demo|generate|formats] ...``; see `jaxkv.cli`."""

import sys


def main(argv=None) -> int:
  try:
    from jaxkv import cli
  except ImportError:  # CLI module not installed: fall back to the format table
    from jaxkv.report import format_report, print_report
    print_report(format_report())
    return 0
  return cli.main(argv)


if __name__ == "__main__":
  sys.exit(main())
