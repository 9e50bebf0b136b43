"""`python -m poplar` runs the command line."""

from poplar.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
