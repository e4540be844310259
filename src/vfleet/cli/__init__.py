"""The command line: argparse front ends over the layers below."""
