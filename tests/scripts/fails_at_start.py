"""A script that fails at every start, before tmrun.init(): a required argument is missing (the
crash loop of issue 31). Each start appends a line to $STARTS_FILE."""

import argparse
import os

import tmrun

with open(os.environ["STARTS_FILE"], "a") as starts:
    starts.write(f"{os.environ.get('RANK')} {os.getpid()}\n")
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.parse_args()
tmrun.init()
