"""`python -m jaxengine` runs the CLI."""

from jaxengine.cli.main import main

if __name__ == "__main__":
  raise SystemExit(main())
