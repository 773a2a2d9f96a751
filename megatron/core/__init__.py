"""Megatron-Core: the library (no argparse, no global args). Importing it imports no torch."""
