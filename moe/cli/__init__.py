"""What the scripts in `scripts/` run: each module holds one command's argument parser and its `main`."""
